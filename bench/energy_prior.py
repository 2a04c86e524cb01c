"""Where does coact fail across domains? Shrink each expert's calibration output energy G_ii
toward its layer's mean by how often calibration saw the expert, and replay again.

    G'_ii = (c_i · G_ii + κ · Ḡ) / (c_i + κ)      c_i: calibration tokens routed to i,
                                                  Ḡ: the layer's mean G_jj over seen experts

κ = 0 is coact as shipped. An experiment, not a ranking: it replays coact with shrunk statistics
into a scratch folder per κ and prints gap closed (``bench/cross_domain.py``'s definition,
against the router and oracle results that script stored) for every evaluation × single
calibration benchmark, truncation, B ∈ {8, 16, 24, 32}:

    python bench/energy_prior.py --traces /tmp/xdomain --model tiny-olmoe --kappa 0 256

Needs ``bench/cross_domain.py``'s traces and base results first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import polars as pl
import torch

from moe_spec.bench.pipeline import results_frame
from moe_spec.catalog import Catalog
from moe_spec.catalog.replay_metrics import gap_closed
from moe_spec.moe import models
from moe_spec.moe.adapter import MoEAdapter
from moe_spec.policy.calibration import CalibrationStats
from moe_spec.replay.run import ReplayRequest, calibration_stats, replay

BENCHES = ("mbpp", "humaneval", "gsm8k", "math500", "cnndm", "specbench")
BUDGETS = (8, 16, 24, 32)


@dataclasses.dataclass
class ShrunkStats(CalibrationStats):
    """Calibration statistics whose mean energies G_ii are shrunk toward the layer mean."""

    kappa: float = 0.0

    def layer_means(self) -> torch.Tensor:
        if self._means is None:
            means = super().layer_means().double()
            diag = means.diagonal(dim1=-2, dim2=-1)
            counts = self.pairs.diagonal(dim1=-2, dim2=-1)
            prior = self.mean_energy()  # [L]
            weight = counts + self.kappa
            diag.copy_(torch.where(weight > 0, (counts * diag + self.kappa * prior[:, None])
                                   / weight.clamp_min(1e-30), diag))  # κ = 0: unseen keep Ḡ
            self._means = means.float()
        return self._means


def shrunk(stats: CalibrationStats, kappa: float) -> ShrunkStats:
    fields = {f.name: getattr(stats, f.name) for f in dataclasses.fields(CalibrationStats)}
    return ShrunkStats(**{**fields, "_means": None, "fitted": {}}, kappa=kappa)


def base_rse(root: Path, model: str) -> pl.DataFrame:
    df = results_frame(root / "results" / "base", model=model)
    return (df.filter(pl.col("coverage") == "truncation").group_by("bench", "ranking", "budget")
            .agg(pl.col("rse").mean()).pivot(on="ranking", index=["bench", "budget"],
                                             values="rse"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", type=Path, default=Path("traces-xdomain"))
    p.add_argument("--model", default="tiny-olmoe")
    p.add_argument("--benches", nargs="+", default=list(BENCHES),
                   help="evaluation benchmarks and calibration sources (runs of cross_domain.py)")
    p.add_argument("--kappa", type=float, nargs="+", default=[0.0, 256.0])
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()
    root = args.traces / args.model
    models.quiet_transformers()
    catalog = Catalog(root)
    adapter = MoEAdapter(models.load(args.model, device="cpu").model)
    ref = base_rse(root, args.model)
    rows = []
    for bench in args.benches:
        run = catalog.runs(model=args.model, bench=bench, names=[f"eval-{bench}"])
        for source in args.benches:
            stats, cal = calibration_stats(catalog, [f"cal-{source}"], args.model, run, adapter,
                                           progress=False)
            for kappa in args.kappa:
                with tempfile.TemporaryDirectory() as out:
                    replay(catalog, run, adapter, ReplayRequest(("coact",), ("truncation",),
                                                                BUDGETS), shrunk(stats, kappa),
                           cal, Path(out), device=torch.device("cpu"), progress=False)
                    df = results_frame(Path(out))
                got = df.group_by("budget").agg(pl.col("rse").mean()).join(
                    ref.filter(pl.col("bench") == bench), on="budget").sort("budget")
                gap = got.select(gap_closed(pl.col("router"), pl.col("oracle"),
                                            pl.col("rse")))[:, 0].to_list()
                rows.append(dict(bench=bench, source=source, kappa=kappa,
                                 **{f"B={b}": g for b, g in zip(got["budget"], gap)}))
                print(f"{bench:<10} ← {source:<10} κ={kappa:<6g}" +
                      "".join(f"{100 * g:7.0f}" for g in gap), flush=True)
    table = pl.DataFrame(rows)
    cols = [f"B={b}" for b in BUDGETS]
    print("\nsummary (off-diagonal cells: share ≥ 50%, worst; diagonal: mean)")
    for kappa in args.kappa:
        t = table.filter(pl.col("kappa") == kappa)
        off = t.filter(pl.col("bench") != pl.col("source")).select(cols).to_numpy().ravel()
        diag = t.filter(pl.col("bench") == pl.col("source")).select(cols).to_numpy().ravel()
        print(f"  κ={kappa:g}: off-diagonal {100 * (off >= 0.5).mean():.0f}% of {off.size} cells "
              f"≥ 50, worst {100 * off.min():.0f}%; in domain mean {100 * diag.mean():.0f}%, "
              f"worst {100 * diag.min():.0f}%")
    if args.output:
        args.output.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
