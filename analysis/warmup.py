"""Which measured passes a timing fit uses, whether it has enough of them, and how it is fitted:
the one place the rule is stated and applied (issue 42.3).

**The warm-up rule** (:data:`RULE`, :func:`drop`), per timed sequence of passes — a capture run
(one process), a ``profile-batch`` decoding (one mode, b, budget and repeat):

1. *warm-up*: its first ``WARMUP_PASSES`` = 1 pass is dropped — a process's or decoding's first
   forward pays allocation, lazy imports and kernel selection (measured: 7–23 s against medians
   of 0.2–0.6 s);
2. *stalls*: of the rest, a pass slower than ``median + OUTLIER_MADS · MAD`` of its sequence is
   dropped (``OUTLIER_MADS`` = 5, ``MAD = median |t − median|`` floored at 1% of the median so
   that equal times still bound): a pre-empted process on a loaded machine.

Every fit reports how many passes the rule dropped.

**The sample check** (:func:`check`): a fit needs at least ``MIN_PASSES`` = 5 kept passes at each
point it uses (a point with fewer is left out, and said so) and at least (parameters + 2)
points; otherwise it is refused — "not fitted: only 1 pass at b = 2 (need 5)" — and pages and
the report show that sentence instead of a fit.

**The fit** (:func:`nonneg_fit`): coefficients ``x ≥ 0`` minimising ``Σ ρ(((A·x − y)_i) / s)``
with the soft-L1 loss ``ρ(z) = 2·(√(1 + z²) − 1)`` (quadratic near 0, linear in the tails;
``scipy.optimize.least_squares``), ``s = 1.4826 · MAD`` of the non-negative least-squares
residuals it starts from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import polars as pl

from moe_spec.catalog.schema import WARMUP_PASSES  # the count, owned below capture (profile-batch)

OUTLIER_MADS = 5.0
MAD_FLOOR = 0.01  # × the median
MIN_PASSES = 5
RULE_SHORT = f"first pass of each run or decoding, then > median + {OUTLIER_MADS:g}·MAD"
RULE = (f"warm-up rule: the first pass of each run or decoding is dropped, then any pass slower "
        f"than median + {OUTLIER_MADS:g}·MAD of its run or decoding; a fit needs ≥ {MIN_PASSES} "
        "kept passes per point and ≥ parameters + 2 points")


def drop(frame: pl.DataFrame, seconds: str, by: list[str], order: str) -> tuple[pl.DataFrame, int]:
    """(the rows the warm-up rule keeps, the passes it dropped). ``by``: the columns naming a
    timed sequence (a run, a decoding); ``order``: its passes' order (rows sharing a value are
    one pass: a batched pass's trees); ``seconds``: each row's pass time."""
    if frame.is_empty():
        return frame, 0
    keys = by or None
    first = pl.col(order).rank("dense").over(keys) if keys else pl.col(order).rank("dense")
    marked = frame.with_columns(_warm=first <= WARMUP_PASSES)
    rest = marked.filter(~pl.col("_warm"))

    def over(e):
        return e.over(keys) if keys else e

    median = over(pl.col(seconds).median())
    mad = over((pl.col(seconds) - pl.col(seconds).median()).abs().median())
    bound = median + OUTLIER_MADS * pl.max_horizontal(mad, MAD_FLOOR * median)
    kept = rest.filter(pl.col(seconds) <= bound) if rest.height else rest
    passes = [*by, order]
    dropped = marked.select(passes).n_unique() - (kept.select(passes).n_unique() if kept.height
                                                  else 0)
    return kept.drop("_warm"), int(dropped)


@dataclass(frozen=True)
class Sample:
    """What :func:`check` found: the points a fit may use, those left out, or why it is refused."""

    used: list[int]
    left_out: list[str] = field(default_factory=list)  # "b = 3 (2 passes)"
    refused: str | None = None


def _passes(n: int) -> str:
    return f"{n} pass" + ("" if n == 1 else "es")


def check(passes, labels, parameters: int) -> Sample:
    """The sample check for ``parameters`` coefficients fitted to points with ``passes`` kept
    passes each (``labels``: "b = 2"): points with fewer than :data:`MIN_PASSES` are left out;
    refused with fewer than ``parameters + 2`` points left."""
    passes = [int(n) for n in passes]
    thin = [i for i, n in enumerate(passes) if n < MIN_PASSES]
    used = [i for i in range(len(passes)) if i not in thin]
    left_out = [f"{labels[i]} ({_passes(passes[i])})" for i in thin]
    need = parameters + 2
    if len(used) >= need:
        return Sample(used, left_out)
    if thin:
        worst = min(thin, key=lambda i: passes[i])
        more = len(thin) - 1
        why = (f"not fitted: only {_passes(passes[worst])} at {labels[worst]} (need {MIN_PASSES})"
               + (f", {more} more point{'s' if more > 1 else ''} below {MIN_PASSES}" if more else "")
               + (f"; {len(used)} point{'s' if len(used) != 1 else ''} with enough, need {need}"
                  f" for {parameters} parameters" if len(used) else ""))
    else:
        why = (f"not fitted: only {len(used)} point{'s' if len(used) != 1 else ''} for "
               f"{parameters} parameters (need {need})")
    return Sample(used, left_out, why)


def check_passes(n: int, parameters: int) -> str | None:
    """The sample check for a fit to ``n`` individual passes (each its own point): None when it
    may be fitted, else why not ("not fitted: only 3 passes (need 5)")."""
    need = max(MIN_PASSES, parameters + 2)
    return None if n >= need else f"not fitted: only {_passes(n)} (need {need})"


def nonneg_fit(a, y) -> np.ndarray:
    """Coefficients ``x ≥ 0`` of ``y ≈ a·x`` under the soft-L1 loss (module docstring)."""
    from scipy.optimize import least_squares, nnls
    a = np.asarray(a, dtype=float)
    y = np.asarray(y, dtype=float)
    scale = np.abs(a).max(0)
    scale[scale == 0] = 1
    a = a / scale
    x0, _ = nnls(a, y)
    r = a @ x0 - y
    s = 1.4826 * float(np.median(np.abs(r - np.median(r))))
    if s > 1e-9 * max(float(np.abs(y).mean()), 1e-300):  # an exact fit needs no robust step
        x0 = np.maximum(x0, 1e-15)
        x0 = least_squares(lambda x: a @ x - y, x0, bounds=(0, np.inf), loss="soft_l1",
                           f_scale=s, method="trf").x
    return x0 / scale
