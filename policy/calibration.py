"""Calibration statistics: what rankings learn offline from calibration runs.

Per MoE layer ℓ, over every calibration token t and pair of experts (i, j) in its top-k:

    pairs[ℓ, i, j] = #{t : i, j ∈ T_k(t)}                 (diagonal: selection counts c_i)
    gram[ℓ, i, j]  = Σ_{t : i, j ∈ T_k(t)} ⟨E_i(h_t), E_j(h_t)⟩

``static`` ranks by ``c_i``; ``coact`` uses the mean ``G_ij = gram / pairs`` (0 where a pair never
fired together; an expert never selected gets its layer's mean energy as ``G_ii``). The
statistics are sums, so runs can be added in any order and split across workers; ``sources``
records which runs (name and run id) they came from.

``moments`` holds, per layer and expert, sums over calibration *prompts* p of the prompt's energy
sum ``s_ip = Σ_{t∈p: i∈T_k(t)} ⟨E_i, E_i⟩`` and count ``c_ip``: ``[#{p: c_ip > 0}, Σ_p s_ip²,
Σ_p s_ip c_ip, Σ_p c_ip²]``, what the prompt-clustered sampling variance of the mean energy
``G_ii`` needs (:meth:`CalibrationStats.energy_variance`; tokens of one prompt are correlated,
so prompts, not tokens, are the independent draws). ``coact-prior`` chooses its energy prior
from them.

Rankings whose :mod:`policy.index` line says ``examples`` (``learned``) also need *examples*:
calibration tree-layers with the truncation oracle's order (collected on request, at most
``max_examples``, the first ones in run order), and ``fitted`` caches what rankings fit on the
statistics, so one calibration is fitted once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import numpy as np
import torch

from moe_spec.errors import UserError
from moe_spec.policy import index
from moe_spec.policy.greedy import oracle_order


class CalibrationError(UserError, ValueError):
    """A calibration that cannot be used (it learned nothing); the message is one line."""


class ExpertModel(Protocol):
    """What calibration needs of a model: its MoE layers and every expert's output."""

    moe_layers: list[int]
    num_experts: int

    def expert_outputs(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """``[M, H] → [M, N, H]`` float32 on the CPU."""

    # adaptive budgets' price calibration (calibrate_prices) also reads top_k and the routing
    # rule of layers ``[T]`` (batch_rule), as the MoE adapter gives them


MEANS_VERSION = index.MEANS_VERSION  # part of a calibrated result's key (kept in the index)
MAX_EXAMPLES = 4096  # calibration tree-layers the learned ranking trains on


def evaluation_calibration(runs: Iterable) -> str | None:
    """Why ``runs`` (objects with ``name`` and ``role``) should not be calibrated on, in one
    line, or None: statistics learned from a run captured for evaluation are refused unless the
    user says so (``--allow-evaluation-calibration``)."""
    bad = sorted(r.name for r in runs if r.role == "evaluation")
    if not bad:
        return None
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return (f"--calibration run {bad[0]}{more} has role evaluation in its manifest, not "
            "calibration; calibrate on a run captured with --role calibration, or pass "
            "--allow-evaluation-calibration to use it anyway")


def empty_calibration(stats: CalibrationStats, runs: Iterable) -> str | None:
    """One line when ``stats`` learned nothing (no tree-layer of ``runs`` had stored MoE
    inputs: every prompt stopped at its first token, or the storage policy kept no pass), else
    None: rankings fitted on nothing would rank experts arbitrarily."""
    if bool(stats.pairs.any()):
        return None
    names = ", ".join(sorted(r.name for r in runs))
    return (f"--calibration {names}: no tree-layer with stored MoE inputs to learn from (every "
            "prompt stopped before its first verification pass, or the storage policy kept no "
            "pass); calibrate on other runs")


def examples_for(rankings: list[str] | tuple[str, ...]) -> int:
    """How many examples a calibration for these rankings collects: 0 unless one of them says
    ``examples`` in :mod:`policy.index` (one that learns, or the oracle, which starts from the
    learned ranking's shortlists where it can fit it)."""
    return MAX_EXAMPLES if index.needs_examples(rankings) else 0


@dataclass
class Example:
    """One calibration tree-layer's routing and the oracle's order of its experts."""

    layer: int
    probs: torch.Tensor  # [M, N]
    idx: torch.Tensor  # [M, k]
    weights: torch.Tensor  # [M, k]
    order: torch.Tensor  # [N] the truncation oracle's greedy order

    def batch(self):
        from moe_spec.policy.batch import RoutingBatch
        from moe_spec.policy.routing import RoutingRule
        return RoutingBatch.single(self.probs, self.idx, self.weights, self.layer,
                                   RoutingRule(self.idx.shape[-1]))


@dataclass
class CalibrationStats:
    layers: list[int]  # decoder layer of each row
    gram: torch.Tensor  # [L, N, N] float64
    pairs: torch.Tensor  # [L, N, N] float64
    sources: list[dict] = field(default_factory=list)
    examples: list[Example] = field(default_factory=list)
    fitted: dict = field(default_factory=dict)  # ranking name -> what it fitted
    saved: object | None = None  # where one run's statistics are saved (collect_runs), if they
    # are: rankings that fit on them may keep what they fit beside them
    _means: torch.Tensor | None = field(default=None, repr=False)  # layer_means(), once
    moments: torch.Tensor | None = None  # [L, 4, N] float64 per-prompt energy moments (above)
    _prompt: tuple | None = field(default=None, repr=False)  # (key, s [L, N], c [L, N]) open

    @classmethod
    def empty(cls, layers: list[int], n: int, sources: list[dict] | None = None):
        shape = (len(layers), n, n)
        return cls(list(layers), torch.zeros(shape, dtype=torch.float64),
                   torch.zeros(shape, dtype=torch.float64), list(sources or []),
                   moments=torch.zeros(len(layers), 4, n, dtype=torch.float64))

    @property
    def num_experts(self) -> int:
        return self.gram.shape[-1]

    def rows(self, layers: torch.Tensor) -> torch.Tensor:
        """Row of each decoder layer in ``layers [T]``."""
        lookup = {layer: i for i, layer in enumerate(self.layers)}
        try:
            return torch.tensor([lookup[int(x)] for x in layers.tolist()], dtype=torch.long)
        except KeyError as exc:
            raise ValueError(f"no calibration statistics for layer {exc.args[0]}; calibrate on "
                             "the same model") from None

    def add(self, layer: int, idx: torch.Tensor, topk_outputs: torch.Tensor,
            prompt: object = None) -> None:
        """One batch of calibration tokens: ``idx [M, k]`` selected experts and ``topk_outputs
        [M, k, H]`` their outputs on those tokens, from calibration prompt ``prompt`` (any key;
        consecutive calls with the same key are one prompt; None: this batch is a prompt of its
        own)."""
        i = self.layers.index(layer)
        n = self.num_experts
        self._means = None
        out = topk_outputs.double()
        dots = torch.einsum("mah,mbh->mab", out, out)  # [M, k, k]
        flat = (idx[:, :, None] * n + idx[:, None, :]).reshape(-1)
        self.gram[i].view(-1).index_add_(0, flat, dots.reshape(-1))
        self.pairs[i].view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=self.pairs.dtype))
        if self._prompt is None or prompt is None or self._prompt[0] != prompt:
            self.close_prompt()
            shape = (len(self.layers), n)
            self._prompt = (prompt, torch.zeros(shape, dtype=torch.float64),
                            torch.zeros(shape, dtype=torch.float64))
        _, energy, count = self._prompt
        energy[i].index_add_(0, idx.reshape(-1), dots.diagonal(dim1=-2, dim2=-1).reshape(-1))
        count[i].index_add_(0, idx.reshape(-1), torch.ones(idx.numel(), dtype=torch.float64))
        if prompt is None:
            self.close_prompt()

    def close_prompt(self) -> None:
        """Add the open prompt's energy sums and counts to :attr:`moments`."""
        if self._prompt is None:
            return
        _, s, c = self._prompt
        self._prompt = None
        if self.moments is None:
            self.moments = torch.zeros(len(self.layers), 4, self.num_experts,
                                       dtype=torch.float64)
        self.moments += torch.stack([(c > 0).double(), s * s, s * c, c * c], dim=1)

    def energy_variance(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(v [L, N], P [L, N])``: the sampling variance of each mean energy ``G_ii`` over
        calibration prompts, and the prompts ``P_i`` that routed to the expert. With the mean
        ``x_i = Σ_p s_ip / c_i`` a ratio of prompt sums, its (cluster-robust) variance is

            v_i = P_i/(P_i − 1) · Σ_p (s_ip − x_i c_ip)² / c_i²
                = P_i/(P_i − 1) · (Σ s² − 2 x_i Σ s c + x_i² Σ c²) / c_i²,

        NaN where ``P_i < 2`` (one prompt says nothing about its spread)."""
        self.close_prompt()
        if self.moments is None:
            raise ValueError("these calibration statistics carry no per-prompt energy moments")
        prompts, ss, sc, cc = self.moments.unbind(1)
        counts = self.pairs.diagonal(dim1=-2, dim2=-1)
        x = self.gram.diagonal(dim1=-2, dim2=-1) / counts.clamp_min(1)
        spread = (ss - 2 * x * sc + x * x * cc).clamp_min(0)
        v = prompts / (prompts - 1).clamp_min(1) * spread / (counts * counts).clamp_min(1)
        return torch.where(prompts >= 2, v, torch.full_like(v, float("nan"))), prompts

    @classmethod
    def merge(cls, parts: list[CalibrationStats], max_examples: int = 0) -> CalibrationStats:
        """The statistics of several runs together (sums add); examples are drawn evenly, the
        first ``max_examples // len(parts)`` of each, so no run dominates a mixed calibration."""
        first = parts[0]
        out = cls(list(first.layers), sum(p.gram for p in parts), sum(p.pairs for p in parts),
                  [src for p in parts for src in p.sources])
        for p in parts:
            p.close_prompt()
        if all(p.moments is not None for p in parts):
            out.moments = sum(p.moments for p in parts)  # the runs' prompts are distinct
        share = max_examples // len(parts) if max_examples else 0
        out.examples = [ex for p in parts for ex in p.examples[:share]]
        return out

    def mean_gram(self, layers: torch.Tensor) -> torch.Tensor:
        """``G`` for each tree-layer's layer, ``[T, N, N]`` float32 (see :meth:`layer_means`)."""
        return self.layer_means()[self.rows(layers)]

    def layer_means(self) -> torch.Tensor:
        """``G [L, N, N]`` float32: ``gram / pairs`` where a pair fired together, 0 for pairs
        never seen together, and for an expert calibration never selected (``c_i = 0``) the
        layer's mean output energy ``mean_{j: c_j > 0} G_jj`` as ``G_ii``: unseen means unknown,
        not silent (with 0 an expert the calibration domain never used would be ranked last
        wherever another domain routes to it)."""
        if self._means is None:
            means = self.gram / self.pairs.clamp_min(1)
            diag = means.diagonal(dim1=-2, dim2=-1)  # a view: edits write into ``means``
            seen = self.pairs.diagonal(dim1=-2, dim2=-1) > 0
            diag.copy_(torch.where(seen, diag, self.mean_energy()[:, None]))
            self._means = means.float()
        return self._means

    def mean_energy(self) -> torch.Tensor:
        """``Ḡ [L]`` float64: each layer's mean output energy ``mean_{j: c_j > 0} G_jj`` over the
        experts calibration selected."""
        counts = self.pairs.diagonal(dim1=-2, dim2=-1)
        energy = self.gram.diagonal(dim1=-2, dim2=-1) / counts.clamp_min(1)
        seen = counts > 0
        return (energy * seen).sum(-1) / seen.sum(-1).clamp_min(1)

    def selection_counts(self, layers: torch.Tensor) -> torch.Tensor:
        """``c_i``: calibration tokens whose top-k holds expert i, ``[T, N]`` float32."""
        return self.pairs[self.rows(layers)].diagonal(dim1=-2, dim2=-1).float()

    @classmethod
    def collect(cls, tree_layers: Iterable, model: ExpertModel, sources: list[dict] | None = None,
                max_examples: int = 0):
        """Statistics over ``tree_layers`` (each with ``layer``, ``hidden [M, H]``, ``idx``,
        ``weights [M, k]`` and ``probs [M, N]``), the expert outputs computed by ``model`` (the
        target's MoE adapter); the first ``max_examples`` also become examples (:class:`Example`)."""
        stats = cls.empty(model.moe_layers, model.num_experts, sources)
        kept = []  # (layer, probs, idx, weights, order) of the examples, packed at the end
        for tl in tree_layers:
            idx = torch.as_tensor(np.asarray(tl.idx), dtype=torch.long)
            outs = model.expert_outputs(tl.layer, torch.as_tensor(np.asarray(tl.hidden)))
            picked = outs.gather(1, idx[..., None].expand(-1, -1, outs.shape[-1]))
            stats.add(tl.layer, idx, picked, getattr(tl, "prompt_index", None))
            if len(kept) < max_examples:
                w = torch.tensor(np.asarray(tl.weights), dtype=torch.float32)  # copies, not views
                kept.append((tl.layer, torch.tensor(np.asarray(tl.probs), dtype=torch.float32),
                             idx, w, oracle_order(idx, w, picked, outs.shape[1]).to(torch.int16)))
        stats.close_prompt()
        stats.examples = _packed(kept)
        return stats


def _packed(kept: list[tuple]) -> list[Example]:
    """Examples whose tensors are views of one packed tensor per field. Thousands of small
    tensors held across a pass of multi-MiB expert outputs would pin the freed outputs' memory
    (and keep each tree-layer's read chunk alive): on tiny-qwen3-moe six calibration runs held
    4.5 GiB that way."""
    if not kept:
        return []
    layers, *fields = zip(*kept)
    packed = [torch.cat(f) for f in fields]
    examples, starts = [], [0] * len(fields)
    for i, layer in enumerate(layers):
        views = []
        for j, f in enumerate(fields):
            views.append(packed[j][starts[j]:starts[j] + f[i].shape[0]])
            starts[j] += f[i].shape[0]
        examples.append(Example(layer, *views))
    return examples


_COLLECTED: dict[tuple, CalibrationStats] = {}
STATS_FORMAT = 1  # the saved statistics' layout (save_stats / load_stats)


def save_stats(stats: CalibrationStats, path) -> None:
    """One run's statistics (sums, moments, examples, layers, sources) as safetensors, written
    atomically: what :func:`collect_runs` reuses instead of recomputing every expert output."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file
    ex = stats.examples
    tensors = {"gram": stats.gram, "pairs": stats.pairs,
               "moments": stats.moments if stats.moments is not None else torch.zeros(0)}
    if ex:
        tensors.update(probs=torch.cat([e.probs for e in ex]), idx=torch.cat([e.idx for e in ex]),
                       weights=torch.cat([e.weights for e in ex]),
                       order=torch.stack([e.order for e in ex]),
                       rows=torch.tensor([e.probs.shape[0] for e in ex]),
                       layers=torch.tensor([e.layer for e in ex]))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{id(stats)}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={
        "format": str(STATS_FORMAT), "layers": json.dumps(stats.layers),
        "sources": json.dumps(stats.sources)})
    tmp.replace(path)


def load_stats(path) -> CalibrationStats | None:
    """Statistics :func:`save_stats` wrote, or None for a file of another format or a damaged
    one (then they are collected again)."""
    import json

    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != str(STATS_FORMAT):
                return None
            t = {k: f.get_tensor(k) for k in f.keys()}
        stats = CalibrationStats(json.loads(meta["layers"]), t["gram"], t["pairs"],
                                 json.loads(meta["sources"]),
                                 moments=t["moments"] if t["moments"].numel() else None)
    except Exception:  # noqa: BLE001 - any unreadable cache file is recomputed, never trusted
        return None
    if "order" in t:
        ends = t["rows"].cumsum(0).tolist()
        starts = [0] + ends[:-1]
        stats.examples = [Example(int(layer), t["probs"][a:b], t["idx"][a:b], t["weights"][a:b],
                                  t["order"][i])
                          for i, (layer, a, b) in enumerate(zip(t["layers"].tolist(), starts,
                                                                ends))]
    return stats


def collect_runs(runs: list, read: Callable[[object], Iterable], model: ExpertModel,
                 max_examples: int = 0, saved: Callable[[object], object] | None = None
                 ) -> CalibrationStats:
    """Statistics over complete calibration ``runs`` (objects with ``run_id``, ``name`` and
    ``ref``), each run's tree-layers read by ``read(run)``.

    Each run is collected once per process (a complete run never changes: a recapture has a new
    run id) and, with ``saved(run)`` (a path, or None), once per machine: saved there after
    collecting and loaded from there next time. Runs are merged, so a study that replays or
    captures against many calibration choices collects each run once, and a ranking that fits
    on the statistics (``learned``) fits once per choice."""
    shape = (tuple(model.moe_layers), model.num_experts, max_examples)
    parts = []
    for run in runs:
        key = (run.run_id, run.name, *shape)
        path = saved(run) if saved is not None and key not in _COLLECTED else None
        if path is not None:  # examples are collected on request: part of what is saved
            path = path.with_name(f"{path.stem}-examples{max_examples}{path.suffix}")
        if path is not None and path.exists():
            found = load_stats(path)
            if found is not None and found.layers == list(model.moe_layers):
                found.saved = path
                _COLLECTED[key] = found
        if key not in _COLLECTED:
            _COLLECTED[key] = CalibrationStats.collect(read(run), model, sources=[run.ref],
                                                       max_examples=max_examples)
            if path is not None:
                try:
                    save_stats(_COLLECTED[key], path)
                    _COLLECTED[key].saved = path
                except OSError:
                    pass  # a read-only traces root: collected again next time
        parts.append(_COLLECTED[key])
    if len(parts) == 1:
        return parts[0]
    key = (tuple(sorted((r.run_id, r.name) for r in runs)), *shape)
    if key not in _COLLECTED:
        _COLLECTED[key] = CalibrationStats.merge(parts, max_examples)
    return _COLLECTED[key]



PRICE_STEP = "moe_spec.policy.prices:calibrate_all"  # adaptive budgets' step (issue 63), named
# like the inputs' steps (policy.index): policy.prices imports the rankings, which import this


def calibrate(runs: list, read: Callable[[object], Iterable], model: ExpertModel, rankings,
              saved: Callable[[object], object] | None = None,
              prices=None) -> CalibrationStats:
    """The one calibration step, for replay and capture's online budget alike: the statistics
    of the calibration ``runs`` (:func:`collect_runs`, with the examples the ``rankings`` ask
    for), refused in one line when they learned nothing (:class:`CalibrationError`), then what
    each input the rankings read asks of a calibration (:func:`policy.index.calibration_steps`:
    the tree tokens' MoE inputs add the surrogate's sums), each step called as
    ``step(stats, runs, model, read)`` and returning the statistics to use. A ranking with a new
    input declares it in its line; no caller names a ranking. With ``prices`` (adaptive
    budgets: a :class:`policy.prices.PriceRequest`), each ranking × coverage's price λ per mean
    budget is calibrated on the same runs and kept in ``fitted`` (:data:`PRICE_STEP`)."""
    import importlib
    stats = collect_runs(runs, read, model, examples_for(tuple(rankings)), saved=saved)
    problem = empty_calibration(stats, runs)
    if problem:
        raise CalibrationError(problem)
    for step in index.calibration_steps(rankings):
        module, function = step.split(":")
        stats = getattr(importlib.import_module(module), function)(stats, runs, model, read)
    if prices is not None:
        module, function = PRICE_STEP.split(":")
        getattr(importlib.import_module(module), function)(stats, runs, model, read, rankings,
                                                           prices)
    return stats
