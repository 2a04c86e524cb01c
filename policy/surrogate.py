"""Per-expert output surrogates fitted on calibration (h, E_i(h)) pairs: what ``sketch`` predicts
every expert's output on a tree token from, before any expert is loaded.

Per MoE layer and expert i a rank-r linear map of the MoE input with a bias (x = [h, 1]),

    Ê_i(h) = U_i V_iᵀ x,    U_i [H, r] orthonormal,  V_i [H + 1, r]

fitted by reduced-rank least squares over every calibration token of the layer (all tokens, not
only those routed to i: under substitution a token runs experts outside its own top-k). From the
sums (:class:`InputMoments`, one pass over the calibration; they add across runs)

    Sxx = Σ_t x_t x_tᵀ,   Syx_i = Σ_t E_i(h_t) x_tᵀ,   Syy_i = Σ_t ||E_i(h_t)||²

the full least-squares map is ``W_i = Syx_i (Sxx + λI)⁻¹`` (λ = 1e-6 · tr Sxx / (H + 1), a
numerical guard) and the rank-r one keeps the top-r principal directions of its fitted outputs:
``U_i`` the top-r eigenvectors of ``W_i Sxx W_iᵀ``, ``V_iᵀ = U_iᵀ W_i`` (reduced-rank regression
with identity weight). What the map misses, the residual energy ``ρ_i = mean_t ||E_i(h_t) −
Ê_i(h_t)||²``, is kept too, and :func:`predicted_outputs` gives each expert a private direction
of length ``√ρ_i`` beside its H predicted coordinates: then ``⟨Ê'_i, Ê'_j⟩ = ⟨Ê_i, Ê_j⟩ + ρ_i
δ_ij``, the residuals taken as uncorrelated across experts, and every term the oracle's search
reads (Gram, natural top-k products, floor) follows consistently from one tensor.

A :class:`Surrogate` is an artifact: saved as ``.npz`` (no pickle) with its format version, rank,
layers and the model's weights hash (:meth:`Surrogate.save`, :meth:`Surrogate.load`).

Cost (:mod:`policy.overhead`, what the cost model charges): per layer ``N · (r·H + r·(H + 1) +
1)`` numbers; per token ``2·N·r·(H+1)`` FLOPs for the projections ``V_iᵀ x``, ``2·N·r·H`` for
``U_i z_i`` and ``2·N²·H`` for the Gram of the N predictions (the search then works on N × N
numbers per token).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

FORMAT_VERSION = 1
RIDGE = 1e-6  # λ relative to the mean input energy: a numerical guard, not a prior

MOMENTS = "sketch-moments"  # key in CalibrationStats.fitted of the surrogate's sums


@dataclass
class InputMoments:
    """Least-squares sums per MoE layer over calibration tokens (module docstring)."""

    layers: list[int]
    xx: torch.Tensor  # [L, H+1, H+1] float64
    yx: torch.Tensor  # [L, N, H, H+1] float64
    yy: torch.Tensor  # [L, N] float64
    count: torch.Tensor  # [L] float64 tokens
    sources: list[dict] = field(default_factory=list)

    @classmethod
    def empty(cls, layers: list[int], n: int, h: int, sources=None) -> InputMoments:
        el = len(layers)
        f64 = torch.float64
        return cls(list(layers), torch.zeros(el, h + 1, h + 1, dtype=f64),
                   torch.zeros(el, n, h, h + 1, dtype=f64), torch.zeros(el, n, dtype=f64),
                   torch.zeros(el, dtype=f64), list(sources or []))

    def add(self, layer: int, hidden: torch.Tensor, outputs: torch.Tensor) -> None:
        """Tokens ``hidden [M, H]`` and every expert's outputs on them ``outputs [M, N, H]``."""
        i = self.layers.index(layer)
        x = _augment(hidden.double())  # [M, H+1]
        y = outputs.double()
        self.xx[i] += x.T @ x
        self.yx[i] += torch.einsum("mnh,md->nhd", y, x)
        self.yy[i] += y.pow(2).sum((0, 2))
        self.count[i] += x.shape[0]

    @classmethod
    def collect(cls, tree_layers: Iterable, model, sources=None) -> InputMoments:
        """Sums over ``tree_layers`` (each with ``layer`` and ``hidden [M, H]``), every expert's
        output computed by ``model`` (``expert_outputs(layer, hidden) → [M, N, H]``, the MoE
        adapter's, as :meth:`policy.calibration.CalibrationStats.collect` uses)."""
        found = None
        for tl in tree_layers:
            hidden = torch.as_tensor(np.asarray(tl.hidden), dtype=torch.float32)
            outs = model.expert_outputs(tl.layer, hidden)
            if found is None:
                found = cls.empty(model.moe_layers, outs.shape[1], outs.shape[2], sources)
            found.add(tl.layer, hidden, outs)
        if found is None:
            raise ValueError("no calibration tree-layer with stored MoE inputs")
        return found

    @classmethod
    def merge(cls, parts: list[InputMoments]) -> InputMoments:
        first = parts[0]
        return cls(list(first.layers), sum(p.xx for p in parts), sum(p.yx for p in parts),
                   sum(p.yy for p in parts), sum(p.count for p in parts),
                   [s for p in parts for s in p.sources])


def layer_rows(fitted: list[int], layers: torch.Tensor, what: str) -> torch.Tensor:
    """``[T]`` CPU indices into a per-layer artifact fitted on layers ``fitted`` for tree-layers
    at ``layers [T]``; a layer it was not fitted on is one clear error."""
    lookup = {layer: i for i, layer in enumerate(fitted)}
    try:
        return torch.tensor([lookup[int(x)] for x in layers.tolist()], dtype=torch.long)
    except KeyError as exc:
        raise ValueError(f"no {what} for layer {exc.args[0]}; fit it on the same model") from None


def _augment(h: torch.Tensor) -> torch.Tensor:
    """``[..., H] → [..., H + 1]``: the input with a constant 1 (the bias column)."""
    return torch.cat([h, torch.ones(*h.shape[:-1], 1, dtype=h.dtype, device=h.device)], -1)


@dataclass
class Surrogate:
    """Fitted rank-r maps per layer and expert (module docstring)."""

    layers: list[int]
    rank: int
    u: torch.Tensor  # [L, N, H, r] float32
    v: torch.Tensor  # [L, N, H+1, r] float32
    rho: torch.Tensor  # [L, N] float32 residual energy per token
    weights_hash: str | None = None

    @property
    def num_experts(self) -> int:
        return self.u.shape[1]

    @property
    def hidden_size(self) -> int:
        return self.u.shape[2]

    @classmethod
    def fit(cls, moments: InputMoments, rank: int, weights_hash: str | None = None) -> Surrogate:
        us, vs, rhos = [], [], []
        for row in range(len(moments.layers)):
            u, v, rho = reduced_rank(moments.xx[row], moments.yx[row], moments.yy[row],
                                     moments.count[row], rank)
            us.append(u)
            vs.append(v)
            rhos.append(rho)
        return cls(list(moments.layers), rank, torch.stack(us).float(), torch.stack(vs).float(),
                   torch.stack(rhos).float(), weights_hash)

    def rows(self, layers: torch.Tensor) -> torch.Tensor:
        return layer_rows(self.layers, layers, "surrogate")

    def save(self, path: Path) -> None:
        """``.npz`` without pickled objects: the tensors and a JSON header."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp.npz")
        header = json.dumps(dict(format=FORMAT_VERSION, kind="sketch-surrogate", rank=self.rank,
                                 layers=self.layers, weights_hash=self.weights_hash))
        np.savez(tmp, header=np.array(header), u=self.u.numpy(), v=self.v.numpy(),
                 rho=self.rho.numpy())
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path, weights_hash: str | None = None) -> Surrogate:
        """A saved surrogate; refuses another format or, given ``weights_hash``, another model."""
        with np.load(Path(path), allow_pickle=False) as f:
            header = json.loads(str(f["header"]))
            if header.get("format") != FORMAT_VERSION or header.get("kind") != "sketch-surrogate":
                raise ValueError(f"{path}: not a sketch surrogate of format {FORMAT_VERSION}")
            if weights_hash is not None and header.get("weights_hash") != weights_hash:
                raise ValueError(f"{path}: fitted on another model's weights "
                                 f"({header.get('weights_hash')}); refit it")
            return cls(header["layers"], int(header["rank"]), torch.from_numpy(f["u"]),
                       torch.from_numpy(f["v"]), torch.from_numpy(f["rho"]),
                       header.get("weights_hash"))


def reduced_rank(xx: torch.Tensor, yx: torch.Tensor, yy: torch.Tensor, count: torch.Tensor,
                 rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's rank-r maps from its least-squares sums (module docstring): ``xx [D, D]``
    shared by the N experts or ``[N, D, D]`` one per expert, ``yx [N, H, D]``, ``yy [N]``,
    ``count`` tokens (a number or ``[N]``) → ``U [N, H, r]``, ``V [N, D, r]``, ``ρ [N]``
    (float64)."""
    d = xx.shape[-1]
    lam = RIDGE * torch.diagonal(xx, dim1=-2, dim2=-1).sum(-1) / d  # [] or [N]
    reg = xx + lam[..., None, None] * torch.eye(d, dtype=xx.dtype, device=xx.device)
    w = torch.linalg.solve(reg, yx.transpose(-1, -2)).transpose(-1, -2)  # [N, H, D]
    fitted = w @ xx @ w.transpose(-1, -2)  # [N, H, H] Σ_t Ŷ Ŷᵀ
    vals, vecs = torch.linalg.eigh((fitted + fitted.transpose(-1, -2)) / 2)
    r = min(rank, vecs.shape[-1])
    u = vecs.flip(-1)[..., :r]  # top r: [N, H, r]
    v = (u.transpose(-1, -2) @ w).transpose(-1, -2)  # [N, D, r]
    m = u @ v.transpose(-1, -2)  # [N, H, D] the rank-r map
    resid = yy - 2 * (m * yx).sum((-1, -2)) + ((m @ xx) * m).sum((-1, -2))
    return u, v, (resid / count.clamp_min(1)).clamp_min(0)


class OnlineSurrogate:
    """A surrogate refit during a prompt from the outputs of the experts its passes executed.

    Off its calibration's domain a linear surrogate extrapolates badly (tiny-olmoe, r = 4: the
    relative error of the predicted outputs is 7–12% in domain and 39–118% calibrated on another
    benchmark). After a verification pass the outputs ``E_i(h_t)`` of every expert it ran are
    known, for the tokens that ran it, so, as coact-online does for its Gram, the calibration's
    sums count as ``κ`` pseudo-tokens of every expert and the run's own pairs are added:

        Sxx_i = (κ / n_cal) Sxx^cal + Σ_{t ran i} x_t x_tᵀ,   Syx_i = (κ / n_cal) Syx_i^cal
        + Σ_{t ran i} E_i(h_t) x_tᵀ,   (Syy_i and the count alike)

    and each layer a pass touched is refit by :func:`reduced_rank` before the next pass predicts.
    Before any pass it is exactly ``Surrogate.fit(moments, rank)`` (scaling every sum leaves the
    least-squares map and ρ unchanged). Runtime-legal: a pass reads only what earlier passes
    executed. The price is the state: ``Sxx_i`` is one ``(H + 1)²`` matrix per expert
    (:func:`policy.overhead.online_surrogate`), which at real shapes outweighs the experts a
    pass loads — a measurement of what per-token adaptation buys, not yet a deployable ranking.
    """

    def __init__(self, moments: InputMoments, rank: int, kappa: float):
        self.moments, self.rank, self.kappa = moments, rank, float(kappa)
        self.surrogate = Surrogate.fit(moments, rank)  # fresh tensors: refit in place
        self.own: dict[int, list[torch.Tensor]] = {}  # row -> [xx [N,D,D], yx, yy [N], count [N]]
        self.dirty: set[int] = set()

    def observe(self, layers: torch.Tensor, hidden: torch.Tensor, idx: torch.Tensor,
                weights: torch.Tensor, outputs: torch.Tensor) -> None:
        """A finished pass: at ``layers [T]`` the tokens' MoE inputs ``hidden [T, M, H]`` and what
        each token ran, ``idx, weights [T, M, k]`` (weight 0: not run, padding included), with
        those experts' outputs ``outputs [T, M, k, H]``."""
        n, h = self.surrogate.num_experts, self.surrogate.hidden_size
        rows = self.surrogate.rows(layers)
        x = _augment(hidden.double())  # [T, M, D]
        ran, y = executed_outputs(idx, weights, outputs, n)
        for t, row in enumerate(rows.tolist()):
            if row not in self.own:
                d = h + 1
                f64 = torch.float64
                self.own[row] = [torch.zeros(n, d, d, dtype=f64), torch.zeros(n, h, d, dtype=f64),
                                 torch.zeros(n, dtype=f64), torch.zeros(n, dtype=f64)]
            xx, yx, yy, count = self.own[row]
            xx += torch.einsum("mn,md,me->nde", ran[t], x[t], x[t])
            yx += torch.einsum("mnh,md->nhd", y[t], x[t])
            yy += y[t].pow(2).sum((0, 2))
            count += ran[t].sum(0)
            self.dirty.add(row)

    def refresh(self) -> Surrogate:
        """The surrogate with every layer observed since the last call refit."""
        m = self.moments
        for row in sorted(self.dirty):
            a = self.kappa / float(m.count[row].clamp_min(1))
            xx, yx, yy, count = self.own[row]
            u, v, rho = reduced_rank(a * m.xx[row] + xx, a * m.yx[row] + yx, a * m.yy[row] + yy,
                                     a * m.count[row] + count, self.rank)
            self.surrogate.u[row], self.surrogate.v[row] = u.float(), v.float()
            self.surrogate.rho[row] = rho.float()
        self.dirty.clear()
        return self.surrogate


class PosteriorSurrogate:
    """The exact refit's idea at a bounded price: the calibration fit as a prior, the last ``w``
    executed pairs of each expert as evidence, and the posterior mean in closed form.

    :class:`OnlineSurrogate` keeps one ``D × D`` sum per expert (D = H + 1); at real shapes that
    outweighs the experts a pass loads. Here the calibration enters through what every expert
    shares, the layer's input Gram ``A = a (Sxx + λI)`` with ``a = κ / n_cal`` (κ pseudo-tokens,
    as in the refit), and its rank-r map ``M_i = U_i V_iᵀ`` stands for its cross moments
    (``Syx_i ≈ M_i (Sxx + λI)``). With ``X_i [w, D]``, ``Y_i [w, H]`` the expert's last w
    executed pairs (pass order, then tree-token order), the least-squares map that weighs both,

        W_i = (a M_i (Sxx + λI) + Y_iᵀ X_i) (A + X_iᵀ X_i)⁻¹
            = M_i + E_iᵀ (I + X_i A⁻¹ X_iᵀ)⁻¹ X_i A⁻¹,   E_i = Y_i − X_i M_iᵀ

    (push-through identity: a w × w solve, A⁻¹ computed once per layer), is the rank-(r + w) map
    ``[U_i, E_iᵀ] [V_i, P_iᵀ]ᵀ`` with ``P_i = (I + X_i A⁻¹ X_iᵀ)⁻¹ X_i A⁻¹``: a :class:`Surrogate`
    of rank r + w whose first r columns are the calibration's (zero columns until w pairs
    arrive), so :class:`~policy.rankings.sketch.Sketch` searches on it unchanged. ρ_i is blended
    as in :class:`GradientSurrogate` from the errors the current fit made on the pass's pairs.
    Cost (:func:`policy.overhead.posterior_surrogate`): the rank-(r + w) surrogate read, an
    updated expert's pairs read and factors written, A⁻¹ read once per layer and pass; the pairs
    and A⁻¹ are kept as float32 (the solves upcast), as charged."""

    def __init__(self, moments: InputMoments, rank: int, kappa: float, window: int,
                 base: Surrogate | None = None, inverses: dict | None = None):
        """``base``: ``Surrogate.fit(moments, rank)`` if already fitted; ``inverses``: a dict
        shared by the instances of one calibration and κ, where each layer's A⁻¹ is kept once
        computed (a new prompt's posterior then starts without refitting or inverting)."""
        base = Surrogate.fit(moments, rank) if base is None else base
        el, n, h, r = base.u.shape
        self.base, self.moments = base, moments
        if window < 1 or not kappa > 0:
            raise ValueError(f"a posterior needs a window of at least 1 pair and a prior weight "
                             f"κ > 0 (got {window}, {kappa})")
        self.rank, self.kappa, self.window = r, float(kappa), int(window)
        u = torch.zeros(el, n, h, r + self.window)
        v = torch.zeros(el, n, h + 1, r + self.window)
        u[..., :r], v[..., :r] = base.u, base.v
        self.surrogate = Surrogate(list(base.layers), r + self.window, u, v, base.rho.clone(),
                                   base.weights_hash)
        self.rho0 = base.rho.double()
        self.errors = torch.zeros_like(self.rho0)
        self.count = torch.zeros_like(self.rho0)
        self.pairs: dict[int, list[list[torch.Tensor]]] = {}  # row -> per expert [X [f, D], Y [f, H]]
        self.inverse: dict[int, torch.Tensor] = {} if inverses is None else inverses  # row -> A⁻¹
        self.dirty: dict[int, set[int]] = {}  # row -> experts that got new pairs

    def prior_inverse(self, row: int) -> torch.Tensor:
        """``A⁻¹ = (a (Sxx + λI))⁻¹`` of one layer (λ as :func:`reduced_rank`'s guard)."""
        if row not in self.inverse:
            m = self.moments
            xx = m.xx[row]
            d = xx.shape[-1]
            lam = RIDGE * torch.diagonal(xx).sum() / d
            a = self.kappa / float(m.count[row].clamp_min(1))
            self.inverse[row] = torch.linalg.inv(
                a * (xx + lam * torch.eye(d, dtype=xx.dtype))).float()  # stored as float32
        return self.inverse[row].double()

    def observe(self, layers: torch.Tensor, hidden: torch.Tensor, idx: torch.Tensor,
                weights: torch.Tensor, outputs: torch.Tensor) -> None:
        """As :meth:`OnlineSurrogate.observe`."""
        s = self.surrogate
        n = s.num_experts
        x = _augment(hidden.double())  # [T, M, D]
        ran, y = executed_outputs(idx, weights, outputs, n)
        for t, row in enumerate(s.rows(layers).tolist()):
            if row not in self.pairs:
                self.pairs[row] = [[torch.zeros(0, x.shape[-1]), torch.zeros(0, y.shape[-1])]
                                   for _ in range(n)]
            pairs = self.pairs[row]
            for i in ran[t].sum(0).nonzero().flatten().tolist():
                sel = ran[t][:, i] > 0
                xi, yi = x[t][sel], y[t][sel, i]  # the pairs expert i ran on
                pred = (xi @ s.v[row, i].double()) @ s.u[row, i].double().T  # the current fit's
                self.errors[row, i] += (yi - pred).pow(2).sum()
                self.count[row, i] += xi.shape[0]
                old = pairs[i]  # stored as float32, as the cost charges them
                pairs[i] = [torch.cat([old[0], xi.float()])[-self.window:],
                            torch.cat([old[1], yi.float()])[-self.window:]]
                self.dirty.setdefault(row, set()).add(i)
            s.rho[row] = ((self.kappa * self.rho0[row] + self.errors[row])
                          / (self.kappa + self.count[row])).float()

    def refresh(self) -> Surrogate:
        """The surrogate with every layer observed since the last call updated (class
        docstring)."""
        s, r = self.surrogate, self.rank
        for row, experts in sorted(self.dirty.items()):
            inv = self.prior_inverse(row)
            for i in sorted(experts):  # only experts with new pairs change
                xs, ys = (p.double() for p in self.pairs[row][i])
                f = xs.shape[0]
                err = ys - (xs @ self.base.v[row, i].double()) @ self.base.u[row, i].double().T
                # E_i = Y_i − X_i M_iᵀ [f, H], M_i = U_i V_iᵀ applied factored
                g = xs @ inv  # X_i A⁻¹ [f, D]
                p = torch.linalg.solve(torch.eye(f, dtype=g.dtype) + g @ xs.T, g)  # P_i [f, D]
                s.u[row, i, :, r:] = 0
                s.v[row, i, :, r:] = 0
                s.u[row, i, :, r:r + f] = err.T.float()
                s.v[row, i, :, r:r + f] = p.T.float()
        self.dirty.clear()
        return s


def executed_outputs(idx: torch.Tensor, weights: torch.Tensor, outputs: torch.Tensor,
                     n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which experts each token ran, ``ran [T, M, N]`` (1.0 / 0.0), and their outputs scattered
    to expert slots, ``[T, M, N, H]`` (0 where not run), from ``idx, weights [T, M, k]`` (weight
    0: not run; a token's experts distinct, as the coverage policies give them) and ``outputs
    [T, M, k, H]``; float64."""
    h = outputs.shape[-1]
    ran = torch.zeros(*idx.shape[:2], n, dtype=torch.float64)
    ran.scatter_add_(2, idx, (weights != 0).double())
    ran = (ran > 0).double()
    y = torch.zeros(*idx.shape[:2], n, h, dtype=torch.float64)
    y.scatter_(2, idx[..., None].expand(*idx.shape, h), outputs.double())
    return ran, y * ran[..., None]


class GradientSurrogate:
    """The cheap alternative to :class:`OnlineSurrogate`: no sums, the state is the surrogate
    itself, moved after each pass by one normalized gradient step on the squared error of the
    pairs it executed (normalized least mean squares), per expert i and layer:

        e_t = E_i(h_t) − U_i z_t,  z_t = V_iᵀ x_t                  (the pass's prediction error)
        V_i += η Σ_t x_t (U_iᵀ e_t)ᵀ / Σ_t ||x_t||²,   U_i += η Σ_t e_t z_tᵀ / Σ_t ||z_t||²
        ρ_i  = (κ ρ_i^cal + Σ_t ||e_t||²) / (κ + n_i)

    (sums over the tokens t that ran i; U_i is no longer orthonormal after a step, which nothing
    relies on). A pass reads the surrogate and writes it back:
    :func:`policy.overhead.online_surrogate` with ``exact=False``."""

    def __init__(self, moments: InputMoments, rank: int, step: float, kappa: float = 64.0):
        self.surrogate = Surrogate.fit(moments, rank)  # fresh tensors: stepped in place
        self.step, self.kappa = float(step), float(kappa)
        self.rho0 = self.surrogate.rho.double()  # a copy: float32 -> float64
        self.errors = torch.zeros_like(self.rho0)
        self.count = torch.zeros_like(self.rho0)

    def observe(self, layers: torch.Tensor, hidden: torch.Tensor, idx: torch.Tensor,
                weights: torch.Tensor, outputs: torch.Tensor) -> None:
        """As :meth:`OnlineSurrogate.observe`."""
        s = self.surrogate
        rows = s.rows(layers)
        x = _augment(hidden.double())  # [T, M, D]
        ran, y = executed_outputs(idx, weights, outputs, s.num_experts)
        for t, row in enumerate(rows.tolist()):
            u, v = s.u[row].double(), s.v[row].double()  # [N, H, r], [N, D, r]
            z = torch.einsum("md,ndr->mnr", x[t], v)
            e = (y[t] - torch.einsum("mnr,nhr->mnh", z, u)) * ran[t][..., None]  # [M, N, H]
            g = torch.einsum("mnh,nhr->mnr", e, u)
            norm_x = torch.einsum("mn,md->n", ran[t], x[t].pow(2)) + 1e-12
            norm_z = (z.pow(2).sum(-1) * ran[t]).sum(0) + 1e-12
            s.v[row] = (v + self.step * torch.einsum("md,mnr->ndr", x[t], g)
                        / norm_x[:, None, None]).float()
            s.u[row] = (u + self.step * torch.einsum("mnh,mnr->nhr", e, z)
                        / norm_z[:, None, None]).float()
            self.errors[row] += e.pow(2).sum((0, 2))
            self.count[row] += ran[t].sum(0)
            s.rho[row] = ((self.kappa * self.rho0[row] + self.errors[row])
                          / (self.kappa + self.count[row])).float()

    def refresh(self) -> Surrogate:
        return self.surrogate


def predicted_outputs(surrogate: Surrogate, layers: torch.Tensor, hidden: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """``Ê' [T, M, N, H + N]`` float32 for MoE inputs ``hidden [T, M, H]`` at ``layers [T]``:
    each expert's prediction ``U_i V_iᵀ [h, 1]`` and its private residual coordinate ``√ρ_i``
    (module docstring); 0 on padding (``mask [T, M]``)."""
    rows = surrogate.rows(layers).to(hidden.device)
    u = surrogate.u.to(hidden.device)[rows]  # [T, N, H, r]
    v = surrogate.v.to(hidden.device)[rows]  # [T, N, D, r]
    x = _augment(hidden.float())  # [T, M, D]
    z = torch.einsum("tmd,tndr->tmnr", x, v)
    pred = torch.einsum("tmnr,tnhr->tmnh", z, u)
    private = torch.diag_embed(surrogate.rho.to(hidden.device)[rows].sqrt())  # [T, N, N]
    private = private[:, None].expand(-1, hidden.shape[1], -1, -1)
    return torch.cat([pred, private], -1) * mask[..., None, None].to(pred.dtype)




@dataclass
class InputGate:
    """Whether a tree-layer's MoE inputs lie where the surrogate was fitted: a linear surrogate
    extrapolates badly off its calibration's inputs (relative error 7–12% in domain, 39–118%
    calibrated on another benchmark, tiny-olmoe), and how far an input lies is visible before any
    expert runs. Per layer, from the calibration's second moment ``C = Sxx / n`` of ``x = [h, 1]``
    (:class:`InputMoments`), with ``λ_1 ≥ … ≥ λ_D`` its eigenvalues, ``P [D, p]`` the top-p
    eigenvectors and ``σ² = mean_{j > p} λ_j`` (probabilistic PCA's covariance),

        novelty(x) = ( Σ_{j ≤ p} (P_jᵀ x)² / λ_j  +  (||x||² − ||Pᵀ x||²) / σ² ) / D

    a Mahalanobis distance per dimension: over the calibration's own tokens its mean is exactly 1
    (Σ_j mean (P_jᵀx)² = Σ_j λ_j). A tree-layer's novelty is the mean over its tokens. Held-out
    inputs of the calibration's own distribution score a little above 1, the more so the fewer
    calibration tokens a layer has per dimension (fit warns below one); p is capped at the
    directions the calibration spans (eigenvalues above 1e-9 of the largest), and a layer with
    no calibration tokens gates every input out (novelty ∞)."""

    layers: list[int]
    directions: torch.Tensor  # [L, D, p] float32
    variances: torch.Tensor  # [L, p] float32 λ_1..λ_p
    rest: torch.Tensor  # [L] float32 σ²

    @classmethod
    def fit(cls, moments: InputMoments, components: int) -> InputGate:
        d = moments.xx.shape[-1]
        dirs, lams, rests = [], [], []
        for row in range(len(moments.layers)):
            count = float(moments.count[row])
            if count < d:
                warnings.warn(f"input gate: layer {moments.layers[row]} has {count:.0f} calibration "
                              f"tokens for {d} input dimensions: held-out inputs of the same "
                              "domain score above 1 (calibrate on more tokens)", stacklevel=2)
            c = moments.xx[row] / max(count, 1.0)
            vals, vecs = torch.linalg.eigh((c + c.T) / 2)
            vals, vecs = vals.flip(0), vecs.flip(1)
            spanned = int((vals > 1e-9 * vals[0].clamp_min(0)).sum()) if vals[0] > 0 else 0
            p = min(components, max(spanned, 1))
            dirs.append(vecs[:, :p])
            if spanned == 0:  # no calibration inputs: nothing is near them (σ² = 0 marks it)
                lams.append(torch.full((p,), float("inf"), dtype=vals.dtype))
                rests.append(torch.tensor(0.0, dtype=vals.dtype))
                continue
            lams.append(vals[:p])
            rest = vals[p:].clamp_min(0)
            rests.append(rest.mean().clamp_min(1e-9 * float(vals[0])) if len(rest) else
                         torch.tensor(1.0, dtype=vals.dtype))
        width = max(len(x) for x in lams)  # a layer of lower rank pads with unused directions
        pad = [(torch.nn.functional.pad(dr, (0, width - dr.shape[1])),
                torch.nn.functional.pad(lm, (0, width - len(lm)), value=float("inf")))
               for dr, lm in zip(dirs, lams)]
        return cls(list(moments.layers), torch.stack([a for a, _ in pad]).float(),
                   torch.stack([b for _, b in pad]).float(), torch.stack(rests).float())

    def novelty(self, layers: torch.Tensor, hidden: torch.Tensor, mask: torch.Tensor
                ) -> torch.Tensor:
        """``[T]`` float32: each tree-layer's mean novelty over its tokens (``mask [T, M]``) for
        MoE inputs ``hidden [T, M, H]`` at ``layers [T]``."""
        per_token = self.per_token(layers, hidden, mask)
        count = mask.to(per_token.device).sum(-1).clamp_min(1)
        return (per_token.sum(-1) / count).float()

    def per_token(self, layers: torch.Tensor, hidden: torch.Tensor, mask: torch.Tensor
                  ) -> torch.Tensor:
        """``[T, M]`` float64: each token's novelty (0 on padding)."""
        rows = layer_rows(self.layers, layers, "input gate")
        x = _augment(hidden.double())  # [T, M, D]; float64: the residual is a difference
        directions = self.directions[rows].to(x.device, torch.float64)  # [T, D, p]
        z = torch.einsum("tmd,tdp->tmp", x, directions)
        inside = (z.pow(2) / self.variances[rows].to(x.device, torch.float64)[:, None]
                  ).sum(-1)  # (padding directions: variance ∞, term 0)
        outside = (x - torch.einsum("tmp,tdp->tmd", z, directions)).pow(2).sum(-1)
        rest = self.rest[rows].to(x.device, torch.float64)[:, None]
        per_token = (inside + outside / rest.clamp_min(1e-300)) / x.shape[-1]
        per_token = torch.where(rest > 0, per_token, torch.inf)  # a layer it never saw
        return torch.where(mask.to(x.device).bool(), per_token, 0.0)
