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
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from policy.calibration import CalibrationStats
from policy.greedy import oracle_order  # noqa: F401 - re-exported: how labels are made
from policy.rankings.base import Ranking, RankingError, SubstitutionAware, by_mass, mass_tiebreak, register

FEATURES = ("router_share", "sqmass_share", "token_share", "max_weight", "energy", "calib_share",
            "coact_row")
FORMAT_VERSION = 1


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
    version = 3  # 2: substitution picks by the predicted substitution error; 3: under
    # truncation, selected experts first
    needs_calibration = True
    artifact = "learned.skops"
    seed: ClassVar[int] = 0
    model = None

    def fit(self, calibration=None):
        super().fit(calibration)
        cached = calibration.fitted.get(self.name)
        beside = None if calibration.saved is None else Path(calibration.saved).with_suffix(
            f".{self.name}-v{FORMAT_VERSION}.skops")  # fitted once per saved calibration
        if cached is None and beside is not None and beside.exists():
            try:
                cached = calibration.fitted[self.name] = self.load(beside, calibration).model
            except RankingError:
                cached = None  # another format: refitted below
        if cached is None:
            cached = calibration.fitted[self.name] = self.train(calibration)
            if beside is not None:
                self.model = cached
                try:
                    self.save(beside)
                except OSError:
                    pass
        self.model = cached
        return self

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
        score = torch.as_tensor(self.model.predict(x.reshape(-1, x.shape[-1]).cpu().numpy()))
        score = score.view(batch.size, batch.n).to(batch.device).double()
        return by_mass(score + mass_tiebreak(batch))

    def save(self, path: Path) -> None:
        """The fitted model in skops' safe format, with the feature names and format version."""
        import skops.io as sio
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        sio.dump(dict(version=FORMAT_VERSION, features=list(FEATURES), model=self.model), tmp)
        tmp.replace(path)

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
        ranking.model = found["model"]
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
