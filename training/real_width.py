"""Real-width model pairs: a random-weight target with a real model's widths and routing, and a
random EAGLE-3 head for it, saved as folders ``capture --model DIR --draft DIR`` loads (beside
the trained tiny models of this package: models built, not downloaded).

Built on the fly for benchmarks and tests (minutes at most), never committed. With one or two
decoder layers EAGLE-3's feature layers {2, L//2, L−3} do not exist; the head taps the inputs of
the layers there are.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moe_spec.eagle.draft_head import new_eagle3
from moe_spec.moe import families, models, shapes


def real_width_pair(name: str, out: Path, *, layers: int = 2, seed: int = 0) -> tuple[Path, Path]:
    """(model folder, draft folder) for the real shape ``name`` (``moe.shapes.REAL_SHAPES``)."""
    model_dir = shapes.save_random_model(name, out / f"{name}-{layers}l", layers=layers, seed=seed)
    loaded = models.load(str(model_dir), device="cpu", dtype="float32")
    torch.manual_seed(seed + 1)
    taps = [min(i, layers - 1) for i in (0, layers // 2, layers - 1)]
    hidden = families.facts(loaded.model.config).hidden_size
    head = new_eagle3(loaded.model, intermediate_size=hidden * 2, feature_layers=taps)
    draft_dir = out / f"{name}-{layers}l-eagle3"
    head.save_pretrained(draft_dir)
    return model_dir, draft_dir
