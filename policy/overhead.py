"""What a ranking costs a verification pass beyond the experts it loads, at a model's shape.

Most rankings read the router's scores and a few calibration numbers per layer: nothing a pass
would notice. A token-aware ranking (``sketch``) runs a surrogate of every expert on every tree
token before any expert is loaded, so each verification pass also reads the surrogate's weights
and computes its predictions. Per MoE layer (N experts, hidden size H, rank r; the surrogate's
numbers are float32, as :mod:`policy.surrogate` fits, stores and runs them, s = 4 bytes; one
SwiGLU expert is 3·H·I numbers of the model's b bytes):

    bytes per layer    = N · (r·H + r·(H + 1) + 1) · s      (U_i, V_i and ρ_i of every expert)
    FLOPs per token    = 2·N·r·(H + 1) + 2·N·r·H             (z_i = V_iᵀ[h, 1], Ê_i = U_i z_i)
                         + 2·N²·H + N + 2·N·H                (the predictions' Gram, whose private
                                                              residual block is diagonal, and
                                                              their products with R̂)
    expert-equivalents = (bytes per layer) / (3·H·I·b)

The search that then runs on the predicted terms (the oracle's greedy and swaps) is not counted.
The cost model (:mod:`analysis.cost`) charges these to every verification pass of a ranking that
has them, and the experts-saved tables subtract the expert-equivalents from the experts a
ranking saves (net experts saved). A ranking is charged by name: a sketch that fell back to
coact-prior's shortlists (no surrogate or no h_t; it warns) is charged all the same.
``sketch-gated`` adds its input gate (:func:`input_gate`: p principal directions of the
calibration's inputs) and is charged the whole surrogate even where the gate sends a tree-layer
to coact-prior. Torch-free: :mod:`policy.index` names each ranking's overhead.
"""

from __future__ import annotations

from dataclasses import dataclass

SKETCH_RANK = 4  # the surrogate's rank r that replay and the online budget fit: r = 4, 8 and 16
# closed nearly the same share of the gap on tiny-olmoe (medians within 3 points) and r = 4 costs
# a quarter of r = 16's bytes (docs/results.md, sketch)
SURROGATE_BYTES = 4  # bytes a surrogate number takes (float32: policy.surrogate)
POSTERIOR_WINDOW = 16  # sketch-post: executed pairs kept per expert (policy.surrogate.PosteriorSurrogate)
POSTERIOR_KAPPA = 512.0  # sketch-post: the calibration fit's weight in pseudo-tokens
GATE_COMPONENTS = 32  # sketch-gated: principal directions of the calibration's inputs kept
# (policy.surrogate.InputGate); on tiny-olmoe and tiny-gpt-oss (H = 128) p = 32 put in-domain
# tree-layers at median novelty ~1.1 and other benchmarks' at 2.2 (humaneval <- mbpp) to 5.9
GATE_NOVELTY = 3.0  # sketch-gated: a tree-layer whose mean novelty exceeds this many times the
# calibration's own mean (1) runs coact-prior's shortlist instead of sketch's


@dataclass(frozen=True)
class Overhead:
    """Per verification pass: bytes read per MoE layer and FLOPs per tree token."""

    bytes_per_layer: float = 0.0
    flops_per_token: float = 0.0

    def __add__(self, other: Overhead) -> Overhead:
        return Overhead(self.bytes_per_layer + other.bytes_per_layer,
                        self.flops_per_token + other.flops_per_token)

    def expert_equivalents(self, hidden: int, intermediate: int, dtype_bytes: float = 2) -> float:
        """The bytes per layer in experts of the model (one expert: 3·H·I numbers of
        ``dtype_bytes``)."""
        return self.bytes_per_layer / (3 * hidden * intermediate * dtype_bytes)


NONE = Overhead()


def surrogate_numbers(n: int, h: int, rank: int) -> int:
    """Numbers a rank-r surrogate stores per MoE layer: per expert U [H, r], V [H + 1, r], ρ."""
    r = min(rank, h)
    return n * (r * h + r * (h + 1) + 1)


def surrogate(n: int, h: int, rank: int = SKETCH_RANK,
              number_bytes: float = SURROGATE_BYTES) -> Overhead:
    """The surrogate's :class:`Overhead` (module docstring) for N experts of hidden size H."""
    r = min(rank, h)
    return Overhead(bytes_per_layer=surrogate_numbers(n, h, rank) * number_bytes,
                    flops_per_token=2 * n * r * (h + 1) + 2 * n * r * h + 2 * n * n * h + n
                    + 2 * n * h)


def input_gate(h: int, components: int = GATE_COMPONENTS,
               number_bytes: float = SURROGATE_BYTES) -> Overhead:
    """What :class:`policy.surrogate.InputGate` adds to a pass, per MoE layer (D = H + 1, p
    principal directions):

        bytes per layer = (D·p + p + 1) · s     (the directions P, their variances λ and σ²)
        FLOPs per token = 2·D·p + 3·p + 2·D     (z = Pᵀx, Σ z²/λ and the residual energy)"""
    d = h + 1
    p = min(components, d)
    return Overhead(bytes_per_layer=(d * p + p + 1) * number_bytes,
                    flops_per_token=2 * d * p + 3 * p + 2 * d)


def gated_surrogate(n: int, h: int, rank: int = SKETCH_RANK,
                    components: int = GATE_COMPONENTS) -> Overhead:
    """sketch-gated's: the surrogate's (every pass runs it on the tree-layers the gate passes;
    charged in full) and the gate's (:func:`input_gate`)."""
    return surrogate(n, h, rank) + input_gate(h, components)


def online_surrogate(n: int, h: int, rank: int = SKETCH_RANK, top_k: int = 8,
                     number_bytes: float = SURROGATE_BYTES, exact: bool = True) -> Overhead:
    """What refitting the surrogate from a prompt's executed experts costs a pass
    (:class:`policy.surrogate.OnlineSurrogate`), per MoE layer: the surrogate read and written
    back, and every expert's least-squares sums (float64, D = H + 1) read and written

        bytes per layer = 2 · N · (r·H + r·D + 1) · s + 2 · N · (D² + H·D + 2) · 8
        FLOPs per token = the surrogate's + k · (2·D² + 2·H·D)   (each executed pair's update)

    The refit itself (a solve and an eigendecomposition per expert and layer) is not counted:
    a lower bound, and at real shapes already far above the experts a pass loads. ``exact=False``
    (:class:`policy.surrogate.GradientSurrogate`, no sums): the surrogate read and written back,

        bytes per layer = 2 · N · (r·H + r·D + 1) · s
        FLOPs per token = the surrogate's + k · (6·r·H + 2·r·D)   (e, Uᵀe and the two steps)"""
    d = h + 1
    read = surrogate(n, h, rank, number_bytes)
    if not exact:
        r = min(rank, h)
        return Overhead(bytes_per_layer=2 * read.bytes_per_layer,
                        flops_per_token=read.flops_per_token + top_k * (6 * r * h + 2 * r * d))
    return Overhead(bytes_per_layer=2 * read.bytes_per_layer + 2 * n * (d * d + h * d + 2) * 8,
                    flops_per_token=read.flops_per_token + top_k * (2 * d * d + 2 * h * d))


def posterior_surrogate(n: int, h: int, rank: int, window: int, tokens: int = 63,
                        top_k: int = 8, number_bytes: float = SURROGATE_BYTES) -> Overhead:
    """What :class:`policy.surrogate.PosteriorSurrogate` costs a pass, per MoE layer (D = H + 1,
    w the window, every number stored as float32, s = 4; the solves upcast):

        bytes per layer = N·((r + w)·(2H + 1) + 1)·s    (the rank-(r + w) surrogate and ρ, read)
                          + 3·N·w·(D + H)·s             (an updated expert's pairs X_i, Y_i read
                                                         and written back with the pass's new
                                                         ones, its factors E_iᵀ, P_iᵀ written)
                          + D²·s                        (the layer's prior inverse A⁻¹, read)
        FLOPs per token = the rank-(r + w) surrogate's (its prediction and the search's terms)
                          + k·2·(r + w)·(D + H)         (the current fit on each executed pair,
                                                         for ρ)
                          + N·(2·w·D² + 4·w²·D + 2·w·r·(D + H)) / tokens   (each update: X_i A⁻¹,
                            the w × w system and its solve against D columns, E_i; once per
                            pass, spread over the pass's ``tokens`` tree tokens)

    Every expert is counted as updated, each with a full window: an upper bound (a pass
    updates only the experts it ran, at most B of N)."""
    d = h + 1
    width = rank + window  # stored in full, whatever H is
    read = surrogate(n, h, width, number_bytes)
    update = n * (2 * window * d * d + 4 * window * window * d + 2 * window * rank * (d + h))
    return Overhead(bytes_per_layer=n * (width * (2 * h + 1) + 1) * number_bytes
                    + 3 * n * window * (d + h) * number_bytes + d * d * number_bytes,
                    flops_per_token=read.flops_per_token + top_k * 2 * width * (d + h)
                    + update / tokens)


def surrogate_cost(n: int, h: int, rank: int, intermediate: int, expert_bytes: float = 2,
                   online: str | None = None, top_k: int = 8, window: int = 0,
                   gated: bool = False) -> dict:
    """What the surrogate costs at shape (N experts, hidden H, expert width I, the experts'
    ``expert_bytes`` a number): bytes per layer, FLOPs per token and the bytes in
    expert-equivalents, as one record (the benches print it); ``online``: updated during the
    prompt, ``"refit"`` or ``"gradient"`` (:func:`online_surrogate`, top-k experts a token) or
    ``"posterior"`` (:func:`posterior_surrogate`, a window of ``window`` pairs); ``gated``: with
    sketch-gated's input gate (:func:`gated_surrogate`)."""
    if gated:
        cost = gated_surrogate(n, h, rank)
    elif online == "posterior":
        cost = posterior_surrogate(n, h, rank, window, top_k=top_k)
    else:
        cost = surrogate(n, h, rank) if online is None else \
            online_surrogate(n, h, rank, top_k, exact=online == "refit")
    return dict(bytes_per_layer=cost.bytes_per_layer, flops_per_token=cost.flops_per_token,
                expert_bytes=3 * h * intermediate * expert_bytes,
                expert_equivalents=cost.expert_equivalents(h, intermediate, expert_bytes))
