"""A roofline cost model of verification, calibratable from measured timings, and projected
speedups under an expert budget.

Per decoder layer, a forward over ``M`` tokens after ``P`` cached ones reads

    bytes = (attention + router + norms) params · b  +  experts_loaded · 3·H·I · b
            + KV cache 2·P·kv_heads·head_dim · b
    flops = 2·M·(attention params) + 4·M·(P + M)·H  +  2·M·k·3·H·I

and takes ``max(bytes / bandwidth, flops / peak)`` (b = bytes per parameter); embeddings and
the LM head add one more such term. A ranking with a selection overhead (``sketch``'s
surrogates: :mod:`policy.overhead`, named by :func:`policy.index.overhead`) adds its bytes per
layer and M times its FLOPs per token to every MoE layer of a verification pass
(:meth:`ModelShape.overhead`). Summed over layers:

    T_verify(B) = Σ_ℓ max(bytes_ℓ(B) / BW, flops_ℓ / peak),   B = experts loaded per layer
    speedup(B)  = τ(B) · T_AR / (T_draft + T_verify(B))        (DESIGN.md)

A budget that varies between MoE layers (adaptive budgets, issue 63) is charged each layer's own
load n_ℓ: ``T_verify = Σ_ℓ max(bytes_ℓ(n_ℓ) / BW, flops_ℓ / peak)`` (:func:`pass_time` given the
loads, or a sample of them: :func:`layer_weights`). As ``max`` of an affine and a constant is
convex in n, a spread of loads costs at least the mean load (Jensen), more where some layers
are compute-bound; a constant allocation costs exactly what one B does.

with ``T_AR`` the same model for M = 1 (k experts per layer). Datasheet peaks come from
:data:`PROFILES`; ``calibrate`` fits ``T ≈ α·T_mem + β·T_flop + γ`` to measured (verify seconds,
experts loaded, tokens) with non-negative coefficients under a robust (soft-L1) loss, after
the warm-up rule and subject to the sample check of :mod:`analysis.warmup` (first pass of each
run dropped, then passes above median + 5·MAD; at least 5 passes), and reports the fit error; a
fit is *usable* only when fitted, with R² ≥ 0.5, relative RMSE ≤ 25% and α or β above 0
(``Calibration.usable``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moe_spec.policy import index  # torch-free: each ranking's overhead (policy.overhead)
from moe_spec.policy.overhead import NONE, Overhead


@dataclass(frozen=True)
class Hardware:
    name: str
    bandwidth: float  # bytes / s
    peak_flops: float  # flop / s (bf16 dense)


PROFILES = {
    "A100-80G": Hardware("A100-80G", 2.04e12, 312e12),
    "H100-SXM": Hardware("H100-SXM", 3.35e12, 989e12),
    "H200": Hardware("H200", 4.8e12, 989e12),
}


THIS_CPU = "this CPU (measured)"


def measure_cpu(megabytes: int = 64, size: int = 512, repeats: int = 3) -> Hardware:
    """This machine's CPU as a roofline profile, measured (best of ``repeats``, well under a
    second): bandwidth = bytes read + written by a copy of a ``megabytes`` float32 array / its
    time; peak = 2·size³ / time of a float32 ``size``² matrix product (numpy's BLAS, on the
    threads it is allowed). A measurement, not a datasheet: it varies with the load."""
    import time
    a = np.ones(megabytes * 2**20 // 4, dtype=np.float32)
    b = np.empty_like(a)
    m = np.ones((size, size), dtype=np.float32)
    copy = matmul = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(b, a)
        copy = min(copy, time.perf_counter() - t)
        t = time.perf_counter()
        m @ m
        matmul = min(matmul, time.perf_counter() - t)
    return Hardware(THIS_CPU, 2 * a.nbytes / copy, 2 * size ** 3 / matmul)


def custom(bandwidth_tbs: float, peak_tflops: float) -> Hardware:
    return Hardware("custom", bandwidth_tbs * 1e12, peak_tflops * 1e12)


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a MoE model (read from a transformers config)."""
    layers: int
    hidden: int
    expert_inter: int
    num_experts: int
    top_k: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    bytes_per_param: float = 2.0
    shared_inter: int = 0  # always-on shared experts' intermediate size per MoE layer (not in B)
    dense_layers: int = 0  # decoder layers with a dense MLP instead of experts
    dense_inter: int = 0  # their MLP's intermediate size

    @classmethod
    def from_config(cls, cfg, bytes_per_param: float = 2.0) -> "ModelShape":
        """The shape a config states (:func:`moe.families.facts`, its family's keys and
        dense-layer rule); AttributeError naming what it leaves out."""
        from moe_spec.moe.families import facts
        f = facts(cfg)
        dense = len(f.dense_layers)
        shape = (f.num_layers, f.hidden_size, f.expert_inter, f.num_experts, f.top_k, f.heads,
                 f.kv_heads, f.head_dim, f.vocab)
        if None in shape or (dense and f.dense_inter is None):
            raise AttributeError(f"the config states no complete MoE shape: {shape}")
        return cls(*shape, bytes_per_param, f.shared_inter, dense, f.dense_inter if dense else 0)

    @property
    def expert_bytes(self) -> float:
        return 3 * self.hidden * self.expert_inter * self.bytes_per_param

    def overhead(self, ranking: str | None) -> Overhead:
        """What ranking ``ranking`` adds to every verification pass at this shape (nothing for
        most rankings, for None and for names :mod:`policy.index` does not hold)."""
        if ranking is None:
            return NONE
        return index.overhead(ranking, self.num_experts, self.hidden)

    def overhead_experts(self, ranking: str | None) -> float:
        """The ranking's bytes per layer in experts of this shape (0 for most rankings)."""
        return self.overhead(ranking).expert_equivalents(self.hidden, self.expert_inter,
                                                         self.bytes_per_param)

    @property
    def attention_params(self) -> int:
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    def layer_terms(self, tokens: int, prefix: int, experts_loaded: float, batch_size: int = 1,
                    overhead: Overhead = NONE):
        """(bytes, flops) of one MoE decoder layer for ``batch_size`` sequences of ``tokens`` new
        tokens each after ``prefix`` cached ones: attention, router, the ``experts_loaded``
        routed experts' weights (the union over the batch: read once), the always-on shared
        experts and the selection's ``overhead`` (its bytes once, its FLOPs per token); each
        sequence reads its own KV cache and computes its own tokens."""
        always = (self.attention_params + self.num_experts * self.hidden + 2 * self.hidden
                  + 3 * self.hidden * self.shared_inter)
        kv = 2 * prefix * self.kv_heads * self.head_dim * self.bytes_per_param
        bytes_ = (always * self.bytes_per_param + experts_loaded * self.expert_bytes
                  + batch_size * kv + overhead.bytes_per_layer)
        flops = batch_size * (2 * tokens * self.attention_params
                              + 4 * tokens * (prefix + tokens) * self.hidden
                              + 2 * tokens * 3 * self.hidden * (self.top_k * self.expert_inter
                                                                + self.shared_inter)
                              + tokens * overhead.flops_per_token)
        return bytes_, flops

    def dense_layer_terms(self, tokens: int, prefix: int, batch_size: int = 1):
        """(bytes, flops) of one dense decoder layer (attention and a dense MLP)."""
        kv = 2 * prefix * self.kv_heads * self.head_dim * self.bytes_per_param
        params = self.attention_params + 3 * self.hidden * self.dense_inter + 2 * self.hidden
        flops = batch_size * (2 * tokens * self.attention_params
                              + 4 * tokens * (prefix + tokens) * self.hidden
                              + 2 * tokens * 3 * self.hidden * self.dense_inter)
        return params * self.bytes_per_param + batch_size * kv, flops

    def head_terms(self, tokens: int, batch_size: int = 1):
        return (2 * self.vocab * self.hidden * self.bytes_per_param,
                2 * batch_size * tokens * self.vocab * self.hidden)


def layer_weights(experts_loaded, moe_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """(loads, weights): the distinct per-layer loads of ``experts_loaded`` and how many of a
    pass's ``moe_layers`` MoE layers each stands for. ``experts_loaded`` is one number (every
    MoE layer loads it: weight ``moe_layers``), the loads ``n_ℓ`` of a pass's MoE layers, or any
    sample of per-layer loads (open loop: one per tree-layer; closed loop: a tree's list per
    layer, pooled): each of its S values weighs ``moe_layers / S``, so that

        Σ_ℓ t(n_ℓ)  ≈  moe_layers · mean_i t(n_i)     (exact for one pass's L loads; the
                                                        expected pass time for a sample that
                                                        holds every layer equally often)"""
    values = np.asarray(experts_loaded, dtype=float).ravel()
    if values.size == 0 or not np.isfinite(values).all():
        raise ValueError("experts loaded per layer: need at least one finite value")
    loads, counts = np.unique(values, return_counts=True)
    return loads, counts * (moe_layers / values.size)


def pass_time(shape: ModelShape, hw: Hardware, tokens: int, prefix: int,
              experts_loaded, batch_size: int = 1, overhead: Overhead = NONE
              ) -> tuple[float, float, float]:
    """(roofline time, memory-only time, compute-only time) of one forward of ``batch_size``
    sequences with ``tokens`` new tokens each, seconds; ``overhead``: the selection's, on every
    MoE layer (:meth:`ModelShape.overhead`). ``experts_loaded``: one number (every MoE layer
    loads it) or per-layer loads n_ℓ (:func:`layer_weights`), each layer charged its own:

        roof = Σ_ℓ max(bytes(n_ℓ) / BW, flops / peak) + dense layers + head"""
    moe_layers = shape.layers - shape.dense_layers
    loads, weights = layer_weights(experts_loaded, moe_layers)
    terms = [(w, *shape.layer_terms(tokens, prefix, float(n), batch_size, overhead))
             for n, w in zip(loads, weights)]
    terms += [(shape.dense_layers, *shape.dense_layer_terms(tokens, prefix, batch_size)),
              (1, *shape.head_terms(tokens, batch_size))]
    mem = sum(n * b / hw.bandwidth for n, b, _ in terms)
    comp = sum(n * f / hw.peak_flops for n, _, f in terms)
    roof = sum(n * max(b / hw.bandwidth, f / hw.peak_flops) for n, b, f in terms)
    return roof, mem, comp


def projected_speedup(shape: ModelShape, hw: Hardware, tau: float, experts_loaded,
                      tree_tokens: int, prefix: int, draft_seconds: float,
                      calibration: "Calibration | None" = None,
                      overhead: Overhead = NONE) -> float:
    """``τ(B) · T_AR / (T_draft + T_verify(B))``, T from the roofline of ``shape`` on ``hw``, or,
    with a ``calibration`` fitted on ``hw``'s datasheet terms, ``T = α·T_mem + β·T_flop + γ``
    (the device the calibration's timings came from). The selection's ``overhead`` is charged
    to the verification pass (the autoregressive pass selects nothing). ``experts_loaded``: one
    number or per-layer loads (:func:`pass_time`)."""
    def seconds(tokens: int, experts, extra: Overhead = NONE) -> float:
        roof, mem, comp = pass_time(shape, hw, tokens, prefix, experts, overhead=extra)
        return roof if calibration is None else float(calibration.predict(mem, comp))
    return tau * seconds(1, shape.top_k) / (
        draft_seconds + seconds(tree_tokens, experts_loaded, overhead))


def projected_batch_speedup(shape: ModelShape, hw: Hardware, batch_size: int, tau: float,
                            tree_tokens: int, prefix: int, experts_verify: float,
                            experts_ar: float, overhead: Overhead = NONE) -> float:
    """Verification-only speedup of speculative over autoregressive decoding at batch size b:

        speedup(b) = τ · T(b, 1, E_AR) / T(b, M, E_spec)

    T the roofline of ``shape`` on ``hw`` for b sequences (:func:`pass_time`), E the experts a
    pass loads per layer: the union over its b·1 (AR) or b·M (tree) tokens, at most a budget.
    Draft time is left out (it grows with b like the AR pass it replaces a share of). The
    selection's ``overhead`` is charged to the verification pass."""
    return tau * pass_time(shape, hw, 1, prefix, experts_ar, batch_size)[0] / \
        pass_time(shape, hw, tree_tokens, prefix, experts_verify, batch_size, overhead)[0]


# A calibration is usable only when the fit explains the timings: R² ≥ MIN_R2, relative RMSE ≤
# MAX_RELATIVE_RMSE, and at least one of α, β above zero (else T ≈ γ: a constant, no roofline).
MIN_R2 = 0.5
MAX_RELATIVE_RMSE = 0.25
QUALITY_RULE = (f"usable when R² ≥ {MIN_R2}, relative RMSE ≤ {MAX_RELATIVE_RMSE:.0%} and α or β "
                "above 0")


def _two(x: float) -> str:
    return f"{x:.2f}".replace("-0.00", "0.00")  # a fit no better than the mean is "0.00"


@dataclass
class Calibration:
    alpha: float  # × memory time
    beta: float  # × compute time
    gamma: float  # fixed seconds per pass (launches, Python)
    relative_rmse: float
    r2: float
    points: int  # passes fitted (after the warm-up rule)
    dropped: int = 0  # passes the warm-up rule dropped (analysis.warmup)
    refused: str | None = None  # the sample check's "not fitted: only 3 passes (need 5)"

    def predict(self, mem: np.ndarray, comp: np.ndarray) -> np.ndarray:
        return self.alpha * mem + self.beta * comp + self.gamma

    @property
    def problems(self) -> list[str]:
        """Why the fit cannot stand in for the roofline (empty: usable), by :data:`QUALITY_RULE`."""
        if self.refused:
            return [self.refused]
        out = []
        if self.alpha <= 0 and self.beta <= 0:
            out.append("α and β both fitted to 0: the timings follow neither the memory nor the "
                       "compute time of the roofline (a constant γ fits as well)")
        if not self.r2 >= MIN_R2:  # NaN (all times equal) fails too
            out.append(f"R² {_two(self.r2)} < {MIN_R2}" if np.isfinite(self.r2) else
                       "R² undefined (every measured time is the same)")
        if not self.relative_rmse <= MAX_RELATIVE_RMSE:
            out.append(f"relative RMSE {self.relative_rmse:.0%} > {MAX_RELATIVE_RMSE:.0%}")
        return out

    @property
    def usable(self) -> bool:
        return not self.problems

    @property
    def verdict(self) -> str:
        """One line: the fit's quality and whether it is used."""
        warm = f"{self.dropped} dropped by the warm-up rule"
        if self.refused:
            return f"{self.refused} ({self.points} passes kept, {warm})"
        fit = (f"T ≈ {self.alpha:.3g}·T_mem + {self.beta:.3g}·T_flop + {self.gamma * 1e3:.3g} ms "
               f"on {self.points} passes ({warm}), R² {_two(self.r2)}, relative RMSE "
               f"{self.relative_rmse:.0%}")
        if self.usable:
            return f"{fit} ({QUALITY_RULE}: usable)"
        return f"not usable ({'; '.join(self.problems)}; {QUALITY_RULE}); fit was {fit}"


def calibrate(shape: ModelShape, hw: Hardware, seconds, tokens, prefix, experts_loaded,
              dropped: int = 0) -> Calibration:
    """Fit of measured pass times to the model's memory and compute times,
    ``T ≈ α·T_mem + β·T_flop + γ`` with α, β, γ ≥ 0 under the soft-L1 loss
    (:func:`analysis.warmup.nonneg_fit`); relative RMSE ``√mean(r²) / mean(T)`` and R² over the
    passes given. The passes are those the warm-up rule kept (``dropped``: how many it dropped,
    :func:`analysis.warmup.drop`); fewer than 5 are refused (``Calibration.refused``)."""
    from moe_spec.analysis import warmup
    seconds = np.asarray(seconds, dtype=float)
    refused = warmup.check_passes(len(seconds), 3)
    if refused:
        nan = float("nan")
        return Calibration(nan, nan, nan, nan, nan, len(seconds), dropped, refused)
    terms = np.array([pass_time(shape, hw, int(t), int(p), float(e))[1:]
                      for t, p, e in zip(tokens, prefix, experts_loaded)])
    a = np.c_[terms, np.ones(len(seconds))]
    coef = warmup.nonneg_fit(a, seconds)
    pred = a @ coef
    resid = seconds - pred
    ss_tot = ((seconds - seconds.mean()) ** 2).sum()
    return Calibration(coef[0], coef[1], coef[2],
                       float(np.sqrt((resid ** 2).mean()) / seconds.mean()),
                       float(1 - (resid ** 2).sum() / ss_tot) if ss_tot > 0 else float("nan"),
                       len(seconds), dropped)
