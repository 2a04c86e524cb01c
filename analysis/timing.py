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

**Outliers** (:func:`kept`): of a configuration's repeats, one slower than ``median + 5·MAD``
(MAD floored at 1% of the median, as :mod:`analysis.warmup` bounds passes) is dropped and
counted — a pre-empted process on a shared machine.

**Interval** (:func:`median_interval`, :func:`ratio_interval`): the 95% percentile bootstrap
(``scipy.stats.bootstrap``, 2,000 resamples, seed 0) of the median over the kept repeats; a
speedup is ``median(AR s/token) / median(EAGLE s/token)`` at the same b, its interval the
bootstrap of that ratio resampling both sides' repeats independently. With R repeats the
interval cannot be wider than the repeats' spread: at the default R = 3 it is close to the
range of the ratios and optimistic (a percentile bootstrap of 3 values); fewer than 2 kept
repeats give no interval (NaN), and pages and tables then say so instead of showing a bare
number.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the frames' type only: polars loads where a function builds one
    import polars as pl

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0
OUTLIER_MADS = 5.0
MAD_FLOOR = 0.01  # × the median
DEFAULT_REPEATS = 3
METHOD = ("equal work: every decoding (AR, EAGLE, each budget) decodes the same prompts to "
          "exactly --max-new-tokens tokens each, end-of-sequence ignored")
INTERVAL = (f"{CONFIDENCE:.0%} percentile bootstrap ({RESAMPLES} resamples) of the median over "
            f"repeats; repeats slower than median + {OUTLIER_MADS:g}·MAD dropped")


def kept(values) -> tuple[np.ndarray, int]:
    """(the repeats the outlier rule keeps, how many it dropped): a value above
    ``median + OUTLIER_MADS · max(MAD, MAD_FLOOR · median)`` is dropped (larger is slower)."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if v.size < 3:  # two values bound nothing: each is as much an outlier as the other
        return v, 0
    median = float(np.median(v))
    mad = max(float(np.median(np.abs(v - median))), MAD_FLOOR * abs(median))
    ok = v <= median + OUTLIER_MADS * mad
    return v[ok], int((~ok).sum())


def _finite(values) -> np.ndarray:
    v = np.asarray(values, dtype=float)
    return v[np.isfinite(v)]


def _bootstrap(samples: tuple, statistic) -> tuple[float, float]:
    from scipy.stats import bootstrap
    if any(len(s) < 2 for s in samples):
        return float("nan"), float("nan")
    if all(np.ptp(s) == 0 for s in samples):  # no spread: the interval is the value itself
        value = float(statistic(*samples, axis=-1))
        return value, value
    res = bootstrap(samples, statistic, n_resamples=RESAMPLES, confidence_level=CONFIDENCE,
                    method="percentile", vectorized=True, paired=False,
                    rng=np.random.default_rng(SEED))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def median_interval(values) -> tuple[float, float, float]:
    """(median, low, high) of ``values`` (already through :func:`kept`) with the bootstrap 95%
    interval; NaN bounds with fewer than 2 finite values, NaN everything with none."""
    v = _finite(values)
    if v.size == 0:
        return float("nan"), float("nan"), float("nan")
    return (float(np.median(v)), *_bootstrap((v,), lambda x, axis: np.median(x, axis=axis)))


def ratio_interval(numerator, denominator) -> tuple[float, float, float]:
    """(median(numerator) / median(denominator), low, high): the ratio of medians of two
    independent samples (e.g. AR and EAGLE seconds per token over their repeats) with the
    bootstrap 95% interval resampling each independently."""
    a, b = _finite(numerator), _finite(denominator)
    if a.size == 0 or b.size == 0:
        return float("nan"), float("nan"), float("nan")
    return (float(np.median(a) / np.median(b)),
            *_bootstrap((a, b), lambda x, y, axis: np.median(x, axis=axis)
                        / np.median(y, axis=axis)))


def with_interval(value: float, low: float, high: float, digits: int = 2, unit: str = "×") -> str:
    """"1.23× (95% CI 1.10–1.35×)", or "1.23× (no interval: one repeat)" — never a bare
    number."""
    if not np.isfinite(value):
        return "not measured"
    if not (np.isfinite(low) and np.isfinite(high)):
        return f"{value:.{digits}f}{unit} (no interval: fewer than 2 repeats kept)"
    return f"{value:.{digits}f}{unit} ({CONFIDENCE:.0%} CI {low:.{digits}f}–{high:.{digits}f}{unit})"


def equal_work(tokens) -> bool:
    """Whether every decoding compared produced the same number of tokens."""
    return len({int(t) for t in tokens}) == 1


KEYS = ("model", "bench", "run", "measurement")  # one measurement: nothing pooled across them
LEGACY = "before-59"  # the measurement of rows stored without one (round 4 and before)


def speedups(rows) -> "pl.DataFrame":
    """One row per (model, bench, run, measurement, b, budget) of ``profile-batch``'s decodings
    (``batch_profile`` rows; keys a frame lacks are left out): EAGLE's seconds per token and
    per verification pass, each a median over the kept repeats with its interval; the speedup
    ``median(AR s/token) / median(EAGLE s/token)`` at the same b with its interval
    (:func:`ratio_interval`); ``equal_work`` whether every decoding at that b of the
    measurement produced the same tokens (:func:`equal_work`); τ the mean over kept repeats;
    ``repeats`` kept and ``dropped`` by the outlier rule (:func:`kept`), both sides counted.
    Rows stored before measurements existed read as measurement :data:`LEGACY`."""
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
        for budget, e in at_b.filter(pl.col("mode") == "eagle").group_by("budget",
                                                                          maintain_order=True):
            spt, dropped = kept(e["_spt"].to_list())
            keep = e.filter(pl.col("_spt").is_in(spt.tolist())) if spt.size else e.clear()
            s, s_lo, s_hi = median_interval(spt)
            pass_s, pass_lo, pass_hi = median_interval(keep["latency_p50"].drop_nulls()
                                                       .to_numpy())
            speed, low, high = ratio_interval(ar_spt, spt)
            out.append(dict(zip([*keys, "batch_size"], key), budget=budget[0],
                            eagle_tokens_per_s=1 / s if s else float("nan"),
                            ar_tokens_per_s=1 / float(np.median(ar_spt)) if ar_spt.size
                            else float("nan"),
                            speedup=speed, speedup_low=low, speedup_high=high,
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
