"""The replay driver: budget sweeps over captured trees, results to Parquet.

Open loop (per tree and MoE layer): recompute every expert's output from the captured MoE input
with the model's own weights (through the adapter), check the recomputed gold output against the
captured one, then score every ranking × coverage × budget on the same expert outputs.

Closed loop (per tree): re-run the tree's verification through the whole target with the budget
applied inside every MoE layer, and compare acceptance, top-1 and KL against the unbudgeted pass.

Results live beside the traces, keyed like them::

    <out>/replay_open/model=…/bench=…/run=…/config=<hash>/part-<prompt>.parquet
    <out>/replay_closed/model=…/bench=…/run=…/config=<hash>/part-<prompt>.parquet

``config=<hash>`` names the settings (``config.json`` inside); a finished configuration is reused,
an interrupted one resumes at the next prompt.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from capture import schema
from capture.moe_adapter import MoEAdapter
from replay import open_loop, rankings
from replay.coact import CoactStats, accumulate
from replay.data import CapturedRun, ReplayError, iter_tree_layers

# the paper's budget grids (MoE-Spec, Fig. 5) by number of experts
SWEEPS = {64: list(range(8, 57, 8)), 128: [16, 24, 32, 48, 64], 8: list(range(2, 8))}
GOLD_TOLERANCE = {"float32": 1e-3, "float16": 2e-2}  # relative, on Σ||O||² of a tree-layer


def parse_budgets(spec: str, n: int) -> list[int]:
    """``24``, ``8,16,32``, ``8:56:8`` (inclusive) or ``sweep`` (the paper's grid for N)."""
    if spec == "sweep":
        if n in SWEEPS:
            return SWEEPS[n]
        step = max(1, n // 8)
        return list(range(step, n, step))
    try:
        if ":" in spec:
            lo, hi, *st = (int(x) for x in spec.split(":"))
            values = list(range(lo, hi + 1, st[0] if st else 1))
        else:
            values = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ReplayError(f"cannot read --budget {spec!r}; use 24, 8,16,32, 8:56:8 or sweep") \
            from None
    bad = [b for b in values if not 1 <= b <= n]
    if bad or not values:
        raise ReplayError(f"--budget {spec!r} is out of range: budgets must be within 1..{n}")
    return sorted(set(values))


@dataclass(frozen=True)
class ReplaySettings:
    rankings: tuple[str, ...] = ("router", "oracle")
    coverages: tuple[str, ...] = ("truncation", "substitution")
    budgets: tuple[int, ...] = (24,)
    layers: tuple[int, ...] | None = None
    calibration: tuple[str, ...] = ()
    mode: str = "open"

    def config_hash(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]


def calibrate(runs: list[CapturedRun], adapter: MoEAdapter, layers: list[int] | None = None,
              progress: bool = False) -> CoactStats:
    """Selection counts and co-activation Gram statistics from calibration captures."""
    n = adapter.num_experts
    moe_layers = [layer.index for layer in adapter]
    stats = CoactStats(torch.zeros(len(moe_layers), n, n, dtype=torch.float64),
                       torch.zeros(len(moe_layers), n, n, dtype=torch.float64), moe_layers)
    dev = next(adapter.model.parameters()).device
    work = [(run, p) for run in runs for p in run.prompt_indices()]
    for run, prompt in tqdm(work, desc="calibration", unit="prompt", disable=not progress):
        for tl in iter_tree_layers(run, prompt, layers=layers):
            layer = adapter.layer(tl.layer)
            with torch.no_grad():
                h = tl.hidden.to(dev, next(adapter.model.parameters()).dtype)
                outs = layer.all_expert_outputs(h).float().cpu()
            picked = outs.gather(1, tl.idx[..., None].expand(-1, -1, outs.shape[-1]))
            accumulate(stats, tl.layer, tl.idx, picked)
    return stats


def check_disjoint(evaluated: list[CapturedRun], calibration: list[CapturedRun]) -> None:
    overlap = set().union(*(r.prompt_keys() for r in evaluated)) & \
        set().union(*(r.prompt_keys() for r in calibration))
    if overlap:
        bench, pid = sorted(overlap)[0]
        raise ReplayError(f"calibration and evaluated prompts overlap ({len(overlap)} prompts, "
                          f"e.g. {bench} {pid}); calibrate on other prompts (another --offset or "
                          "benchmark)")


def _check_gold(tl, recomputed: torch.Tensor, hidden_dtype: str, run: str) -> None:
    captured = tl.output.to(recomputed)
    rel = float((captured - recomputed).pow(2).sum() / captured.pow(2).sum().clamp_min(1e-30))
    if rel > GOLD_TOLERANCE[hidden_dtype] ** 2:
        raise ReplayError(f"run {run}: recomputed MoE output of prompt {tl.prompt_index} step "
                          f"{tl.step} layer {tl.layer} differs from the captured one (relative "
                          f"error {rel ** 0.5:.2e}); wrong --model or corrupt trace")


def open_loop_rows(tl_data, layer, settings: ReplaySettings, stats: CoactStats | None,
                   hidden_dtype: str, run: str) -> list[dict]:
    """Every ranking × coverage × budget for one (tree, layer), as column blocks (one dict of
    equal-length arrays per ranking × coverage; see :func:`blocks_to_table`)."""
    dev = next(layer.experts.parameters()).device
    dtype = next(layer.experts.parameters()).dtype
    with torch.no_grad():
        experts = layer.all_expert_outputs(tl_data.hidden.to(dev, dtype)).float().cpu()
    tl = open_loop.TreeLayer(tl_data.probs, tl_data.idx, tl_data.weights, experts,
                             layer.renormalize)
    _check_gold(tl_data, tl.gold, hidden_dtype, run)
    n, bs = tl.n, list(settings.budgets)
    unique = int(tl.union.numel())
    rows = []
    for ranking in settings.rankings:
        for coverage in settings.coverages:
            if ranking in rankings.RUNTIME:
                order = rankings.runtime_order(ranking, tl.probs, tl.idx, tl.weights, tl_data.layer,
                                               stats)
                masks, valid = open_loop.prefix_masks(order, bs, n), bs
            elif ranking == "oracle":
                masks, valid = open_loop.prefix_masks(
                    open_loop.oracle_order(tl, coverage, max(bs)), bs, n), bs
            else:  # exact
                found = [(b, open_loop.exact_best(tl, coverage, b)) for b in bs]
                found = [(b, m) for b, m in found if m is not None]
                if not found:
                    continue
                valid, masks = [b for b, _ in found], torch.stack([m for _, m in found])
            if coverage == "substitution":  # substitution needs B ≥ k
                ok = [i for i, b in enumerate(valid) if b >= tl.k]
                valid, masks = [valid[i] for i in ok], masks[ok]
                if not valid:
                    continue
            m = open_loop.metrics(tl, masks, coverage)
            count = len(valid)
            rows.append(dict(
                prompt_index=np.full(count, tl_data.prompt_index, np.int32),
                prompt_id=[tl_data.prompt_id] * count, step=np.full(count, tl_data.step, np.int32),
                layer=np.full(count, tl_data.layer, np.int16), ranking=[ranking] * count,
                coverage=[coverage] * count, budget=np.asarray(valid, np.int16),
                rse=m["rse"].numpy(), token_error=m["token_error"].numpy(),
                mass_excluded=m["mass_excluded"].double().numpy(),
                experts_loaded=m["experts_loaded"].numpy().astype(np.int16),
                unique_experts=np.full(count, unique, np.int16)))
    return rows


def blocks_to_table(blocks: list[dict], table: str) -> pa.Table:
    sch = schema.REPLAY_TABLES[table]
    if not blocks:
        return sch.empty_table()
    cols = {name: np.concatenate([np.asarray(b[name], dtype=object if isinstance(b[name], list)
                                             else None) for b in blocks])
            for name in sch.names}
    return pa.Table.from_pydict({k: pa.array(v, type=sch.field(k).type) for k, v in cols.items()},
                                schema=sch)


def _write_atomic(path: Path, table: pa.Table) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)


def results_dir(out: Path, table: str, run: CapturedRun, settings: ReplaySettings) -> Path:
    return (Path(out) / table / f"model={schema.partition_value(run.model)}" /
            f"bench={run.bench}" / f"run={run.name}" / f"config={settings.config_hash()}")


def replay_run(run: CapturedRun, adapter: MoEAdapter, settings: ReplaySettings,
               stats: CoactStats | None, out: Path, *, progress: bool = True) -> tuple[Path, bool]:
    """Replay one captured run; returns (results folder, reused?)."""
    table = "replay_open" if settings.mode == "open" else "replay_closed"
    folder = results_dir(out, table, run, settings)
    config_path = folder / "config.json"
    if config_path.is_file() and json.loads(config_path.read_text()).get("status") == "complete":
        return folder, True
    folder.mkdir(parents=True, exist_ok=True)
    config = {**asdict(settings), "run": run.name, "status": "running"}
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    hidden_dtype = run.manifest["settings"].get("hidden_dtype", "float32")
    prompts = run.prompt_indices()
    for p in tqdm(prompts, desc=f"replay {run.name}", unit="prompt", disable=not progress):
        part = folder / f"part-{p:06d}.parquet"
        if part.is_file():
            continue
        if settings.mode == "open":
            blocks = [b for tl in iter_tree_layers(run, p, layers=settings.layers)
                      for b in open_loop_rows(tl, adapter.layer(tl.layer), settings, stats,
                                              hidden_dtype, run.name)]
            _write_atomic(part, blocks_to_table(blocks, table))
        else:
            from replay.closed_loop import closed_loop_rows
            rows = closed_loop_rows(run, p, adapter, settings, stats)
            _write_atomic(part, pa.Table.from_pylist(rows, schema=schema.REPLAY_TABLES[table]))
    config_path.write_text(json.dumps({**config, "status": "complete"}, indent=2) + "\n")
    return folder, False


def summary_frame(folders: list[Path], mode: str):
    """Mean metrics per ranking × coverage × budget over everything replayed (polars)."""
    import polars as pl
    frames = [pl.read_parquet(list(f.glob("part-*.parquet"))) for f in folders
              if list(f.glob("part-*.parquet"))]
    if not frames:
        return None
    df = pl.concat(frames)
    keys = ["ranking", "coverage", "budget"]
    if mode == "open":
        aggs = [pl.col("rse").mean(), pl.col("token_error").mean(),
                pl.col("mass_excluded").mean(), pl.col("experts_loaded").mean(),
                pl.col("unique_experts").mean(), pl.len().alias("tree_layers")]
    else:
        aggs = [pl.col("accepted_length").mean(), pl.col("captured_accepted_length").mean(),
                pl.col("path_unchanged").mean(), pl.col("top1_agreement").mean(),
                pl.col("mean_kl").mean(), pl.len().alias("trees")]
    return df.group_by(keys).agg(aggs).sort(keys)

