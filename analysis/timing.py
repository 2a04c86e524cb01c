"""Equal-work timing: how ``profile-batch``'s repeated decodings become a median with a 95%
interval, and a speedup with its interval (issue 59.2). The one place the rule is stated.

**Equal work.** Every decoding of a measurement — autoregressive, EAGLE, EAGLE under each budget
— decodes the same prompts to exactly ``--max-new-tokens`` new tokens each, end-of-sequence
ignored (:data:`METHOD`), so every configuration produces the same number of tokens and a
budget cannot look faster by stopping earlier or later. Readers check it from the stored rows
(:func:`equal_work`: the same ``tokens`` in every decoding at one b) rather than trusting it.

**Per decoding** (one repeat of one (mode, b, budget)): seconds per token = wall seconds of the
whole decoding (prefill and drafting included) / tokens; seconds per verification pass = the
median pass time (draft + verify) after the warm-up rule of :mod:`analysis.warmup`.

**Warm-up.** ``--warmup N`` (default 1) untimed rounds before the first timed decoding, and the
first pass of each decoding is left out of its pass times (:data:`catalog.schema.WARMUP_PASSES`).

**Paired, interleaved repeats** (:func:`repeat_order`). A repeat at one b decodes every configuration
(AR, EAGLE, EAGLE under each budget) back to back, so a slow period of a shared machine falls
on both sides of a ratio; repeat r starts at configuration ``r mod m`` of the m (rotated), so no
side always goes first. Each row stores its place in its repeat (``position``). The speedup of
repeat r is ``AR s/token_r / EAGLE s/token_r``; a measurement's speedup is the **median of its
per-repeat (paired) ratios**, its interval computed over those ratios.

**Outliers** (:func:`kept`): of a configuration's repeats, one slower than ``median + 5·MAD``
(MAD floored at 1% of the median, as :mod:`analysis.warmup` bounds passes) is dropped and
counted — a pre-empted process on a shared machine — from that configuration's medians
(seconds per token and per pass, tokens/s). The paired ratios are *not* trimmed: a slow period
that hits both decodings of a repeat cancels in its ratio, and one that hits a single side is
part of what a shared machine does, which a distribution-free interval of the median absorbs
by construction (at the default 9 repeats it leaves out the most extreme ratio on each side).
A MAD rule on 7 ratios flagged ordinary load noise: ratios 1.03, 1.02, 0.91, 1.12, 1.02, 1.03,
1.23 have a MAD of 1.2%, and 5·MAD dropped three of them.

**Interval** (:func:`median_interval`): the distribution-free order-statistic (binomial)
confidence interval of a median (as ``scipy.stats.quantile_test(...).confidence_interval``): of n
sorted values, ``[x₍ₖ₎, x₍ₙ₊₁₋ₖ₎]`` with the largest k whose exact coverage
``1 − 2·P(Bin(n, ½) ≤ k − 1)`` is at least 95%, for any continuous distribution
(:func:`coverage`; stored beside the speedup as ``speedup_coverage``). It exists from n = 6 (the
range, 96.9%); with fewer values there is no 95% interval (NaN) and pages and tables say so
instead of showing a bare number. The same rule gives EAGLE's seconds per token and per pass.
It replaces the percentile bootstrap of round 5, which cannot be wider than the repeats' range
and at 3 repeats *is* the range, whose coverage of the median is only 1 − 2·2⁻³ = 75%: three
identical runs gave intervals that missed each other.

**Repeats** (:data:`DEFAULT_REPEATS` = 9): the fewest at which the interval is
``[x₍₂₎, x₍₈₎]`` (96.1%), so one pre-empted repeat neither widens nor moves it; the interval
exists from 6 repeats (the range, 96.9%), and 7 or 8 still give the range.

**Measurements stored before the pairing** (no ``position``: round 5's first profile-batch and
earlier; their AR repeats all ran before EAGLE's) are read, never re-paired: ``paired`` is
false, the speedup is ``median(AR s/token) / median(EAGLE s/token)`` as it was, and its interval
the Bonferroni combination of the two medians' order-statistic intervals at 97.5% each,
``[low_AR / high_EAGLE, high_AR / low_EAGLE]`` (both hold with probability ≥ 95%, so the ratio
of the medians lies within); it needs 7 kept repeats a side, so their 3-repeat measurements show
"no interval (unpaired …)".
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the frames' type only: polars loads where a function builds one
    import polars as pl

CONFIDENCE = 0.95
OUTLIER_MADS = 5.0
MAD_FLOOR = 0.01  # × the median
DEFAULT_REPEATS = 9  # the interval exists from 6; from 9 it leaves out each extreme
METHOD = ("equal work: every decoding (AR, EAGLE, each budget) decodes the same prompts to "
          "exactly --max-new-tokens tokens each, end-of-sequence ignored")
INTERVAL = (f"speedup: the median of paired per-repeat ratios (AR and EAGLE decoded back to back "
            f"in each repeat, order rotated), {CONFIDENCE:.0%} distribution-free order-statistic "
            f"interval of that median (needs 6 repeats; ratios untrimmed); repeats slower than "
            f"median + {OUTLIER_MADS:g}·MAD left out of each configuration's medians")
INTERVAL_SHORT = (f"{CONFIDENCE:.0%} CI: order statistics of the median of paired per-repeat "
                  "ratios")


def repeat_order(configurations: list, repeat: int) -> list:
    """The configurations of one repeat in the order they are decoded, back to back: rotated
    by the repeat (repeat r starts at configuration ``r mod m``), so each goes first equally
    often and none always runs before another."""
    start = repeat % len(configurations) if configurations else 0
    return list(configurations[start:]) + list(configurations[:start])


def _kept_mask(values) -> np.ndarray:
    """Which of ``values`` the outlier rule keeps (None and NaN are not kept)."""
    v = np.asarray([np.nan if x is None else x for x in values], dtype=float)
    ok = np.isfinite(v)
    if ok.sum() < 3:  # two values bound nothing: each is as much an outlier as the other
        return ok
    median = float(np.median(v[ok]))
    mad = max(float(np.median(np.abs(v[ok] - median))), MAD_FLOOR * abs(median))
    return ok & (np.where(ok, v, np.inf) <= median + OUTLIER_MADS * mad)


def kept(values) -> tuple[np.ndarray, int]:
    """(the repeats the outlier rule keeps, how many it dropped): a value above
    ``median + OUTLIER_MADS · max(MAD, MAD_FLOOR · median)`` is dropped (larger is slower)."""
    v = np.asarray([np.nan if x is None else x for x in values], dtype=float)
    ok = _kept_mask(values)
    return v[ok], int((np.isfinite(v) & ~ok).sum())


def _finite(values) -> np.ndarray:
    v = np.asarray(values, dtype=float)
    return v[np.isfinite(v)]


@functools.lru_cache(maxsize=None)
def _order_k(n: int, confidence: float) -> int:
    """The largest k (1-based) with ``1 − 2·P(Bin(n, ½) ≤ k − 1) ≥ confidence``; 0: none."""
    from scipy.stats import binom
    k = 0
    while k + 1 <= (n + 1) // 2 and 1 - 2 * binom.cdf(k, n, 0.5) >= confidence - 1e-12:
        k += 1
    return k


def coverage(n: int, confidence: float = CONFIDENCE) -> float:
    """The exact coverage of the order-statistic interval of a median of n values
    (:func:`median_interval`), ``1 − 2·P(Bin(n, ½) ≤ k − 1)``; NaN when no interval reaches
    ``confidence`` (n < 6 at 95%)."""
    from scipy.stats import binom
    k = _order_k(n, confidence)
    return float(1 - 2 * binom.cdf(k - 1, n, 0.5)) if k else float("nan")


MIN_VALUES = next(n for n in range(1, 100) if _order_k(n, CONFIDENCE))  # 6 at 95%


def median_interval(values, confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(median, low, high) of the finite ``values`` (already through :func:`kept`) with the
    distribution-free order-statistic interval of the median at ``confidence``,
    ``[x₍ₖ₎, x₍ₙ₊₁₋ₖ₎]`` (:func:`coverage`; the interval ``scipy.stats.quantile_test(...)
    .confidence_interval`` gives, which the tests hold it to); NaN bounds with fewer than
    :data:`MIN_VALUES` values, NaN everything with none."""
    v = np.sort(_finite(values))
    if v.size == 0:
        return float("nan"), float("nan"), float("nan")
    median = float(np.median(v))
    k = _order_k(int(v.size), confidence)
    if not k:
        return median, float("nan"), float("nan")
    return median, float(v[k - 1]), float(v[v.size - k])


UNPAIRED_SIDE = 1 - (1 - CONFIDENCE) / 2  # each median's interval in the unpaired ratio
UNPAIRED_MIN = next(n for n in range(1, 100) if _order_k(n, UNPAIRED_SIDE))  # 7 at 97.5%


def ratio_interval(numerator, denominator) -> tuple[float, float, float]:
    """(median(numerator) / median(denominator), low, high) of two *unpaired* samples (a
    measurement stored before repeats were interleaved): each median's order-statistic interval
    at 97.5%, combined as ``[low_n / high_d, high_n / low_d]`` (Bonferroni: both hold with
    probability ≥ 95%); NaN bounds when either side has too few values for 97.5%."""
    a, b = _finite(numerator), _finite(denominator)
    if a.size == 0 or b.size == 0:
        return float("nan"), float("nan"), float("nan")
    ma, a_lo, a_hi = median_interval(a, UNPAIRED_SIDE)
    mb, b_lo, b_hi = median_interval(b, UNPAIRED_SIDE)
    return float(ma / mb), float(a_lo / b_hi), float(a_hi / b_lo)


def with_interval(value: float, low: float, high: float, digits: int = 2, unit: str = "×",
                  missing: str = f"fewer than {MIN_VALUES} repeats kept") -> str:
    """"1.23× (95% CI 1.10–1.35×)", or "1.23× (no interval: fewer than 6 repeats kept)" —
    never a bare number."""
    if not np.isfinite(value):
        return "not measured"
    if not (np.isfinite(low) and np.isfinite(high)):
        return f"{value:.{digits}f}{unit} (no interval: {missing})"
    return f"{value:.{digits}f}{unit} ({CONFIDENCE:.0%} CI {low:.{digits}f}–{high:.{digits}f}{unit})"


def speedup_text(row: dict, digits: int = 2) -> str:
    """A :func:`speedups` row's speedup as shown everywhere: with its interval, or why it has
    none; "unpaired" when the measurement was stored before repeats were interleaved."""
    paired = row.get("paired", False)
    missing = (f"{row.get('pairs', 0)} paired repeats kept, {MIN_VALUES} needed" if paired else
               f"unpaired, {row.get('ar_repeats', 0)} AR and {row.get('repeats', 0)} EAGLE "
               f"repeats kept, {UNPAIRED_MIN} a side needed")
    text = with_interval(row["speedup"], row["speedup_low"], row["speedup_high"], digits,
                         missing=missing)
    return text if paired or "no interval" in text or text == "not measured" \
        else f"{text} (unpaired)"



def equal_work(tokens) -> bool:
    """Whether every decoding compared produced the same number of tokens."""
    return len({int(t) for t in tokens}) == 1


KEYS = ("model", "bench", "run", "measurement")  # one measurement: nothing pooled across them
LEGACY = "before-59"  # the measurement of rows stored without one (round 4 and before)


def _paired(at_b) -> bool:
    """Whether the decodings of one measurement at one b were interleaved by repeat (every row
    stores its ``position``), so repeat r of AR and of EAGLE form a pair."""
    return "position" in at_b.columns and at_b["position"].null_count() == 0 \
        and "repeat" in at_b.columns and at_b["repeat"].null_count() == 0


def paired_ratios(ar, eagle) -> np.ndarray:
    """AR s/token / EAGLE s/token of each repeat that has both (finite), untrimmed: a slow
    period that hits both decodings of a repeat cancels in its ratio."""
    import polars as pl
    pairs = ar.select("repeat", pl.col("_spt").alias("_ar")).join(
        eagle.select("repeat", pl.col("_spt").alias("_e")), on="repeat")
    return _finite((pairs["_ar"] / pairs["_e"]).to_numpy())


def speedups(rows) -> "pl.DataFrame":
    """One row per (model, bench, run, measurement, b, budget) of ``profile-batch``'s decodings
    (``batch_profile`` rows; keys a frame lacks are left out): EAGLE's seconds per token and
    per verification pass, each a median over the kept repeats with its interval; the speedup,
    the median of the paired per-repeat ratios ``AR s/token / EAGLE s/token`` at the same b
    with its order-statistic interval (``paired``; ``pairs`` kept), or for a measurement stored
    before the pairing the ratio of the two medians with :func:`ratio_interval`;
    ``speedup_coverage`` the interval's exact (or, unpaired, Bonferroni) coverage;
    ``equal_work`` whether every decoding at that b of the measurement produced the same tokens
    (:func:`equal_work`); τ the mean over kept repeats; ``repeats`` kept and ``dropped`` by the
    outlier rule (:func:`kept`), both sides counted, for the per-configuration medians (the
    paired ratios are not trimmed). Rows stored before measurements existed read as
    measurement :data:`LEGACY`."""
    import polars as pl
    if rows.is_empty():
        return pl.DataFrame()
    frame = rows.with_columns(
        (pl.col("seconds") / pl.col("tokens")).alias("_spt"),
        *([] if "measurement" in rows.columns else [pl.lit(None, pl.String).alias("measurement")]),
        *([] if "latency_p50" in rows.columns else [pl.lit(None, pl.Float64).alias("latency_p50")]),
        *([] if "measured_at" in rows.columns else [pl.lit(None, pl.String).alias("measured_at")]),
        *([] if "complete" in rows.columns else [pl.lit(None, pl.Boolean).alias("complete")]),
    ).with_columns(pl.col("measurement").fill_null(LEGACY))
    keys = [k for k in KEYS if k in frame.columns]
    out = []
    for key, at_b in frame.group_by([*keys, "batch_size"], maintain_order=True):
        ar = at_b.filter(pl.col("mode") == "ar")
        ar_spt, ar_dropped = kept(ar["_spt"].to_list())
        same = equal_work(at_b["tokens"].to_list())
        paired = _paired(at_b)
        for budget, e in at_b.filter(pl.col("mode") == "eagle").group_by("budget",
                                                                          maintain_order=True):
            spt, dropped = kept(e["_spt"].to_list())
            keep = e.filter(pl.Series(_kept_mask(e["_spt"].to_list())))
            s, s_lo, s_hi = median_interval(spt)
            pass_s, pass_lo, pass_hi = median_interval(keep["latency_p50"].drop_nulls()
                                                       .to_numpy())
            if paired:
                ratios = paired_ratios(ar, e)
                speed, low, high = median_interval(ratios)
                pairs, cover = int(ratios.size), coverage(ratios.size)
            else:
                speed, low, high = ratio_interval(ar_spt, spt)
                pairs = 0
                cover = 1 - (1 - coverage(ar_spt.size, UNPAIRED_SIDE)) \
                    - (1 - coverage(spt.size, UNPAIRED_SIDE))
            out.append(dict(zip([*keys, "batch_size"], key), budget=budget[0],
                            eagle_tokens_per_s=1 / s if s else float("nan"),
                            ar_tokens_per_s=1 / float(np.median(ar_spt)) if ar_spt.size
                            else float("nan"),
                            speedup=speed, speedup_low=low, speedup_high=high,
                            speedup_coverage=cover, paired=paired, pairs=pairs,
                            seconds_per_token=s, seconds_per_token_low=s_lo,
                            seconds_per_token_high=s_hi, pass_seconds=pass_s,
                            pass_seconds_low=pass_lo, pass_seconds_high=pass_hi,
                            tau=float(keep["tau"].mean()) if keep.height else float("nan"),
                            tokens=int(e["tokens"].median()), equal_work=same,
                            **{name: e[column][0] for name, column in
                               (("n", "num_experts"), ("k", "top_k"), ("device", "device"))
                               if column in e.columns},
                            repeats=int(spt.size),
                            ar_repeats=int(ar_spt.size), dropped=dropped + ar_dropped,
                            measured_at=e["measured_at"].drop_nulls().min(),
                            complete=e["complete"][0]))
    return pl.DataFrame(out, schema_overrides=dict(budget=pl.Int64, measured_at=pl.String,
                                                   complete=pl.Boolean))


def latest(speed) -> "pl.DataFrame":
    """The default reader rule: of each (model, bench, run) — one set of settings — the most
    recent complete measurement (by its UTC start; a measurement stored before measurements
    existed counts as the oldest), never several pooled; every measurement stays in
    ``batch_profile`` and in :func:`speedups`."""
    import polars as pl
    if speed.is_empty():
        return speed
    group = [k for k in ("model", "bench", "run") if k in speed.columns]
    order = (speed.with_columns(_done=pl.col("complete").fill_null(True),
                                _at=pl.col("measured_at").fill_null(""))
             .group_by([*group, "measurement"]).agg(pl.col("_done").all(), pl.col("_at").min())
             .sort("_done", "_at", "measurement").group_by(group).last())
    return speed.join(order.select(*group, "measurement"), on=[*group, "measurement"], how="semi")
