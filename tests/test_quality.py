"""The embedded models' quality records exist, hold, and are re-measured here."""

import json

import pytest

from moe_spec.moe import models
from moe_spec.training import quality
from moe_spec.training.tiny_moe import SPECS


def record_of(name):
    return json.loads((models.EMBEDDED_DIR / name / quality.FILENAME).read_text())


def test_every_embedded_model_has_a_training_spec_and_record():
    assert set(models.EMBEDDED) == set(SPECS)
    for name in models.EMBEDDED:
        rec = record_of(name)
        assert rec["training"]["command"].startswith(f"train-tiny --model {name}")
        assert rec["training"]["seconds"] > 0 and rec["training"]["tokens"] > 0


@pytest.mark.slow  # held-out loss and routing per family: about 40 s of CPU each
def test_recorded_quality_is_what_the_model_measures(embedded):
    rec = record_of(embedded.name)
    now = quality.measure(embedded.model, embedded.tokenizer)
    assert now["heldout"]["loss"] == pytest.approx(rec["heldout"]["loss"], rel=2e-3)
    assert now["heldout"]["unigram_baseline"] == pytest.approx(
        rec["heldout"]["unigram_baseline"], rel=1e-6)
    for key, value in rec["routing"]["mean"].items():
        assert now["routing"]["mean"][key] == pytest.approx(value, rel=2e-3, abs=1e-4), key


def test_models_learned_language_and_routing():
    for name in models.EMBEDDED:
        rec = record_of(name)
        h, r = rec["heldout"], rec["routing"]
        # clearly better than a unigram model on held-out text
        assert h["loss"] < h["unigram_baseline"] - 1.0, (name, h)
        k, n = r["top_k"], r["num_experts"]
        # learned routing: per-token top-k mass at least twice uniform k/N
        assert r["mean"]["topk_mass"] >= 2 * k / n, (name, r["mean"])
        assert r["mean"]["entropy_ratio"] < 0.95, name


def test_embedded_data_stays_small():
    """Five tiny models (~9 MiB each in fp16) and their draft heads (~1.3 MiB each)."""
    total = sum(p.stat().st_size for p in models.EMBEDDED_DIR.parent.rglob("*") if p.is_file())
    assert total < 12 * 2**20 * len(models.EMBEDDED)
