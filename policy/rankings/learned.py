"""``learned``: a gradient-boosted scorer of each expert, trained to reproduce the oracle's order.

Trained on calibration tree-layers, where every expert's output is known: the label of expert i
is how early the truncation oracle adds it, ``y_i = 1 − rank_i / N`` (the oracle's greedy order
over ``Q_ij = Σ_t ḡ_i(t) ḡ_j(t) ⟨E_i(h_t), E_j(h_t)⟩``, :func:`policy.greedy.oracle_order`). At run time it
scores every expert from runtime-legal features only (:data:`FEATURES`: the tree's router
scores and the calibration statistics, never an expert output) and ranks by the score:

    router_share  s_i / Σ s            router mass (MoE-Spec's ranking)
    sqmass_share  Σ_t ḡ_i² / Σ_j Σ_t ḡ_j²   squared mixing mass
    token_share   #{t : i ∈ T_k(t)} / M    tokens that route to i
    max_weight    max_t ḡ_i(t)
    energy        G_ii / mean_j G_jj      calibration output energy
    calib_share   c_i / Σ c             calibration selection count
    coact_row     Σ_j A_ij G_ij / Σ_jl A_jl G_jl   coact's quadratic form, row i

A pointwise scorer: it sees co-activation through ``coact_row`` (with every tree expert, not
with those already chosen). scikit-learn's HistGradientBoostingRegressor, seeded, fitted once
per calibration (cached on the statistics) and saved with skops (:meth:`save`, :meth:`load`:
a safe format that loads only the types it names, never pickle). Under substitution its order
is one candidate of :class:`policy.rankings.base.SubstitutionAware`.

Predicting needs neither scikit-learn nor skops: the fitted trees are also kept as flat arrays
(:class:`Trees`, an ``.npz`` beside the ``.skops`` file, tied to it by its SHA-256) and walked
with numpy, summed in the model's own order, so scores equal ``model.predict`` bit for bit
(``tests/test_policy.py``). Importing the two packages costs ~3 s, more than a replay's oracle
spends on this start; the model itself stays the artifact, for anyone who wants the estimator.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from moe_spec.policy.calibration import CalibrationStats
from moe_spec.policy.greedy import oracle_order  # noqa: F401 - re-exported: how labels are made
from moe_spec.policy.rankings.base import (
    Ranking,
    RankingError,
    SubstitutionAware,
    by_mass,
    mass_tiebreak,
    register,
)

FEATURES = ("router_share", "sqmass_share", "token_share", "max_weight", "energy", "calib_share",
            "coact_row")
FORMAT_VERSION = 1
TREES_VERSION = 1  # the .npz layout of Trees


@dataclass(frozen=True)
class Trees:
    """A fitted ``HistGradientBoostingRegressor`` (squared error, numerical features) as flat
    arrays over all its nodes, trees in fitting order: per node the split feature, threshold,
    the side missing values take, the children (global indices), whether it is a leaf, and the
    leaf value; ``roots`` the first node of each tree.

        predict(x) = baseline + Σ_trees value(leaf reached by x)    (added tree by tree)

    A node goes left when ``x[feature] <= threshold`` (NaN: ``missing_left``), as scikit-learn's
    ``_predict_from_raw_data``; features are compared in float64, as the model converts them."""

    baseline: float
    feature: np.ndarray  # int64 [nodes]
    threshold: np.ndarray  # float64
    missing_left: np.ndarray  # bool
    left: np.ndarray  # int64, global
    right: np.ndarray  # int64, global
    leaf: np.ndarray  # bool
    value: np.ndarray  # float64
    roots: np.ndarray  # int64 [trees]

    FIELDS: ClassVar[tuple[str, ...]] = ("feature", "threshold", "missing_left", "left", "right",
                                         "leaf", "value", "roots")

    @classmethod
    def from_model(cls, model) -> Trees:
        """The trees of a fitted model (its ``_predictors`` and ``_baseline_prediction``: the
        estimator exposes no public tree arrays; the pinned scikit-learn range is tested)."""
        categorical = getattr(model, "is_categorical_", None)
        if model.n_trees_per_iteration_ != 1 or (categorical is not None and np.any(categorical)):
            raise RankingError("learned: only single-output models on numerical features")
        nodes = [predictor.nodes for (predictor,) in model._predictors]
        sizes = np.array([len(n) for n in nodes], dtype=np.int64)
        roots = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        cat = np.concatenate(nodes)
        shift = np.repeat(roots, sizes)  # each node's tree offset: children become global
        leaf = cat["is_leaf"].astype(bool)
        return cls(baseline=float(np.asarray(model._baseline_prediction).reshape(-1)[0]),
                   feature=cat["feature_idx"].astype(np.int64),
                   threshold=cat["num_threshold"].astype(np.float64),
                   missing_left=cat["missing_go_to_left"].astype(bool),
                   left=np.where(leaf, -1, cat["left"].astype(np.int64) + shift),
                   right=np.where(leaf, -1, cat["right"].astype(np.int64) + shift),
                   leaf=leaf, value=cat["value"].astype(np.float64), roots=roots)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """``[S, F] → [S]`` float64, all trees walked at once (one step per depth level)."""
        x = np.asarray(x, dtype=np.float64)
        rows = np.arange(len(x))
        node = np.repeat(self.roots[:, None], len(x), 1)  # [trees, S]
        inner = ~self.leaf[node]
        while inner.any():
            at = node[inner]
            v = x[np.broadcast_to(rows, node.shape)[inner], self.feature[at]]
            go_left = np.where(np.isnan(v), self.missing_left[at], v <= self.threshold[at])
            node[inner] = np.where(go_left, self.left[at], self.right[at])
            inner = ~self.leaf[node]
        values = self.value[node]
        out = np.full(len(x), self.baseline)
        for tree in values:  # tree by tree, the model's order of additions
            out += tree
        return out

    def save(self, path: Path, source: str) -> None:
        """An ``.npz`` (no pickled objects) naming the SHA-256 of the ``.skops`` it came from."""
        _write_atomically(path, lambda f: np.savez(
            f, version=TREES_VERSION, source=source, baseline=self.baseline,
            **{name: getattr(self, name) for name in self.FIELDS}))

    @classmethod
    def load(cls, path: Path, source: str) -> Trees | None:
        """The arrays saved for the ``.skops`` file with SHA-256 ``source``, or None when they are
        missing, of another version or model, or not a well-formed forest (every child after its
        parent, inside its own tree, so a walk always ends)."""
        try:
            with np.load(Path(path), allow_pickle=False) as found:
                if int(found["version"]) != TREES_VERSION or str(found["source"]) != source:
                    return None
                trees = cls(baseline=float(found["baseline"]),
                            **{f: np.asarray(found[f]) for f in cls.FIELDS})
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return trees if trees.well_formed() else None

    def well_formed(self) -> bool:
        n = len(self.leaf)
        dtypes = dict(feature="i", threshold="f", missing_left="b", left="i", right="i", leaf="b",
                      value="f", roots="i")
        if any(getattr(self, f).dtype.kind != k or getattr(self, f).ndim != 1
               for f, k in dtypes.items()) or n == 0 or len(self.roots) == 0:
            return False
        if any(len(getattr(self, f)) != n for f in self.FIELDS if f != "roots"):
            return False
        ends = np.append(self.roots[1:], n)
        if self.roots[0] != 0 or np.any(ends <= self.roots) or not np.isfinite(self.baseline):
            return False
        tree_end = np.repeat(ends, ends - self.roots)
        idx = np.arange(n)
        inner = ~self.leaf
        return bool(np.all((self.left[inner] > idx[inner]) & (self.left[inner] < tree_end[inner])
                           & (self.right[inner] > idx[inner])
                           & (self.right[inner] < tree_end[inner]))
                    and np.all(self.feature[inner] >= 0) and np.all(self.feature[inner] < len(FEATURES))
                    and np.all(np.isfinite(self.value[self.leaf])))


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _write_atomically(path: Path, write) -> None:
    """``write(file)`` into a temporary beside ``path``, then renamed over it: a reader never
    sees half a file (policy imports no catalog, whose ``atomic`` is the project's general
    one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        write(f)
    tmp.replace(path)


def features(batch, calibration: CalibrationStats) -> torch.Tensor:
    """``[T, N, F]`` float32, the columns of :data:`FEATURES`."""
    w = batch.dense_weights().double()  # [T, M, N]
    mass = batch.mass().double()
    sq = (w * w).sum(1)
    tokens = (w > 0).double().sum(1) / batch.mask.double().sum(-1, keepdim=True).clamp_min(1)
    gram = calibration.mean_gram(batch.layers).to(batch.device).double()
    energy = gram.diagonal(dim1=-2, dim2=-1)
    counts = calibration.selection_counts(batch.layers).to(batch.device).double()
    form = (w.transpose(1, 2) @ w) * gram  # A ⊙ G
    cols = [mass / mass.sum(-1, keepdim=True).clamp_min(1e-30),
            sq / sq.sum(-1, keepdim=True).clamp_min(1e-30), tokens, w.amax(1),
            energy / energy.mean(-1, keepdim=True).clamp_min(1e-30),
            counts / counts.sum(-1, keepdim=True).clamp_min(1),
            form.sum(-1) / form.sum((-1, -2))[:, None].clamp_min(1e-30)]
    return torch.stack(cols, -1).float()


@register
class Learned(SubstitutionAware, Ranking):
    name = "learned"
    order_reads_coverage = False  # cached for both policies (Ranking.batch_order)
    seed: ClassVar[int] = 0
    model = None  # the scikit-learn estimator, where this process fitted or loaded it
    trees: Trees | None = None  # what scores (the model's trees as arrays)
    source: Path | None = None  # the .skops file the trees came from, where there is one

    def fit(self, calibration=None):
        """Once per calibration (cached on it): beside a saved calibration, the arrays of the
        ``.skops`` saved there (numpy only), else that model (then the arrays are written), else
        a model trained now (both written)."""
        super().fit(calibration)
        found = calibration.fitted.get(self.name)
        beside = None if calibration.saved is None else Path(calibration.saved).with_suffix(
            f".{self.name}-v{FORMAT_VERSION}.skops")  # fitted once per saved calibration
        if found is None and beside is not None and beside.exists():
            found = self._read(beside, calibration)
        if found is None:
            self.model = self.train(calibration)
            self.trees, self.source = Trees.from_model(self.model), None
            if beside is not None:
                try:
                    self.save(beside)
                    self.source = beside
                    self.trees.save(self.arrays_path(beside), _sha256(beside))
                except OSError:
                    pass
            found = (self.model, self.trees, self.source)
        calibration.fitted[self.name] = found
        self.model, self.trees, self.source = found
        return self

    @staticmethod
    def arrays_path(skops: Path) -> Path:
        return Path(skops).with_suffix(".trees.npz")

    def _read(self, skops: Path, calibration):
        """``(model or None, trees, skops)`` from a saved fit, or None to refit (another format)."""
        arrays, digest = self.arrays_path(skops), _sha256(skops)
        trees = Trees.load(arrays, digest) if arrays.exists() else None
        model = None
        if trees is None:
            try:
                model = self.load(skops, calibration).model
            except RankingError:
                return None
            trees = Trees.from_model(model)
            try:
                trees.save(arrays, digest)
            except OSError:
                pass
        return model, trees, Path(skops)

    @classmethod
    def train(cls, calibration: CalibrationStats):
        """Fit on the calibration's stored examples (see :meth:`CalibrationStats.collect`)."""
        from sklearn.ensemble import HistGradientBoostingRegressor
        if not calibration.examples:
            raise RankingError("ranking learned needs calibration examples (oracle orders); "
                               "collect the calibration with examples=True")
        x, y = [], []
        for ex in calibration.examples:
            batch = ex.batch()
            x.append(features(batch, calibration)[0].numpy())
            rank = torch.empty(batch.n, dtype=torch.float64)
            rank[ex.order.long()] = torch.arange(batch.n, dtype=torch.float64)
            y.append((1 - rank / batch.n).numpy())
        model = HistGradientBoostingRegressor(max_iter=200, learning_rate=0.1,
                                              random_state=cls.seed)
        return model.fit(np.concatenate(x), np.concatenate(y))

    def order(self, batch, coverage, max_budget):
        x = features(batch, self.calibration)  # [T, N, F]
        score = torch.as_tensor(self.trees.predict(x.reshape(-1, x.shape[-1]).cpu().numpy()))
        score = score.view(batch.size, batch.n).to(batch.device).double()
        return by_mass(score + mass_tiebreak(batch))

    def save(self, path: Path) -> None:
        """The fitted model in skops' safe format, with the feature names and format version (a
        copy of the file it was read from, where this process did not load the model itself)."""
        if self.model is None and self.source is not None:
            _write_atomically(path, lambda f: f.write(Path(self.source).read_bytes()))
            return
        import skops.io as sio
        _write_atomically(path, lambda f: sio.dump(
            dict(version=FORMAT_VERSION, features=list(FEATURES), model=self.model), f))

    @classmethod
    def load(cls, path: Path, calibration: CalibrationStats) -> Learned:
        """A saved model; refuses files of another format or with types skops would not trust."""
        import skops.io as sio
        try:
            found = sio.load(Path(path), trusted=_TRUSTED)
        except Exception as exc:  # skops raises several types for untrusted or broken files
            raise RankingError(f"{path}: not a saved learned ranking ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0][:120] if str(exc) else ''}); "
                               "refit it") from None
        if not isinstance(found, dict) or found.get("version") != FORMAT_VERSION \
                or found.get("features") != list(FEATURES):
            raise RankingError(f"{path}: a learned ranking of another format; refit it")
        ranking = cls()
        Ranking.fit(ranking, calibration)
        ranking.model, ranking.source = found["model"], Path(path)
        ranking.trees = Trees.from_model(ranking.model)
        return ranking


_TRUSTED = [
    "sklearn.ensemble._hist_gradient_boosting.gradient_boosting.HistGradientBoostingRegressor",
    "sklearn.ensemble._hist_gradient_boosting.binning._BinMapper",
    "sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor",
    "sklearn._loss.loss.HalfSquaredError",
    "sklearn._loss.link.IdentityLink",
    "sklearn._loss.link.Interval",
    "numpy.dtype",
    "builtins.slice",
]
