"""Issue 59's repeatable speedups (analysis.timing): a speedup is the median of paired
per-repeat ratios, its 95% interval the distribution-free order-statistic interval of that
median, held here to scipy's and to a seeded simulation of its coverage; measurements stored
before the pairing still read, unpaired."""

import numpy as np
import polars as pl
import pytest

from moe_spec.analysis import timing

TRIALS = 2000
SE = (0.05 * 0.95 / TRIALS) ** 0.5  # of a 95% coverage estimated from TRIALS draws


def test_the_interval_is_scipys_order_statistic_interval_of_the_median():
    """Reference: ``scipy.stats.quantile_test``'s confidence interval of the median."""
    from scipy.stats import quantile_test
    rng = np.random.default_rng(0)
    for n in range(1, 26):
        x = rng.lognormal(0, 0.5, n)
        median, low, high = timing.median_interval(x)
        ci = quantile_test(x, q=float(np.median(x)), p=0.5).confidence_interval(0.95)
        assert median == pytest.approx(float(np.median(x)))
        assert (low, high) == pytest.approx((ci.low, ci.high), nan_ok=True)
        assert np.isnan(low) == (n < timing.MIN_VALUES)
    assert timing.MIN_VALUES == 6 and timing.DEFAULT_REPEATS >= timing.MIN_VALUES + 1
    assert timing.coverage(6) == pytest.approx(1 - 2 / 2 ** 6)  # the range of 6: 96.9%
    assert timing.coverage(9) == pytest.approx(1 - 2 * 10 / 2 ** 9)  # [x(2), x(8)]


@pytest.mark.parametrize("draw", [
    lambda rng, size: rng.lognormal(0.1, 0.3, size),  # timing noise: right-skewed
    lambda rng, size: rng.exponential(1.0, size),  # heavily skewed
    lambda rng, size: np.where(rng.random(size) < 0.3, 2.0, 1.0) * rng.uniform(0.9, 1.1, size),
], ids=["lognormal", "exponential", "slow-periods"])
def test_the_interval_covers_the_median_as_often_as_it_says(draw):
    """A seeded simulation on distributions of known median: over TRIALS samples of n values,
    the interval holds the true median at least 95% of the time (and as often as
    ``coverage(n)`` says); with fewer than 6 values it claims no interval at all (a percentile
    bootstrap of 3 repeats gives the range, which holds the median 75% of the time)."""
    rng = np.random.default_rng(59)
    truth = float(np.median(draw(np.random.default_rng(1), 2_000_000)))
    for n in (3, 5, 6, timing.DEFAULT_REPEATS, 9, 12):
        hits = claimed = 0
        for _ in range(TRIALS):
            _, low, high = timing.median_interval(draw(rng, n))
            if np.isfinite(low):
                claimed += 1
                hits += low <= truth <= high
        if n < timing.MIN_VALUES:
            assert claimed == 0, n
            continue
        assert claimed == TRIALS
        assert hits / TRIALS >= 0.95 - 3 * SE, (n, hits / TRIALS)
        assert hits / TRIALS == pytest.approx(timing.coverage(n), abs=4 * SE), n


def _measurement(rng, repeats: int, speedup: float, slow: float, paired: bool = True):
    """batch_profile rows of one measurement at b = 1: each repeat runs on a machine as fast as
    a shared factor (lognormal, sigma ``slow``: slow periods of a shared machine) that both
    decodings of the repeat see, times 2% noise of their own; EAGLE is ``speedup`` times as
    fast, so the median of the per-repeat ratios is ``speedup`` exactly."""
    rows = []
    for r in range(repeats):
        machine = rng.lognormal(0, slow)
        for position, mode in enumerate(("ar", "eagle") if r % 2 == 0 else ("eagle", "ar")):
            spt = machine * rng.lognormal(0, 0.02) * (1.0 if mode == "ar" else 1 / speedup)
            rows.append(dict(mode=mode, batch_size=1, budget=None, tokens=64, seconds=64 * spt,
                             tau=1.0, repeat=r, latency_p50=spt,
                             **(dict(position=position) if paired else {})))
    return pl.DataFrame(rows, schema_overrides=dict(budget=pl.Int64))


def test_paired_ratios_keep_a_slow_period_shared_by_both_sides_out_of_the_speedup():
    """The pairing's point: slow periods that hit both sides of a repeat cancel in its ratio.
    Over 300 simulated measurements the paired interval holds the true speedup at least 95% of
    the time and is several times narrower than the unpaired one on the same decodings."""
    rng = np.random.default_rng(7)
    hits, claimed, paired_width, unpaired_width = 0, 0, [], []
    for _ in range(300):
        rows = _measurement(rng, timing.DEFAULT_REPEATS, 1.5, slow=0.3)
        r = timing.speedups(rows).row(0, named=True)
        assert r["paired"] and r["pairs"] == timing.DEFAULT_REPEATS
        old = timing.speedups(rows.drop("position")).row(0, named=True)
        assert not old["paired"] and old["pairs"] == 0
        claimed += 1
        hits += r["speedup_low"] <= 1.5 <= r["speedup_high"]
        paired_width.append(r["speedup_high"] - r["speedup_low"])
        unpaired_width.append(old["speedup_high"] - old["speedup_low"])
    assert claimed == 300
    assert hits / claimed >= 0.95 - 3 * (0.05 * 0.95 / claimed) ** 0.5
    # unpaired: as wide as the slow periods (or no interval at all: NaN)
    assert np.median(paired_width) * 5 < np.nanmedian(unpaired_width)


def test_the_speedup_is_the_median_of_the_paired_ratios_not_a_ratio_of_medians():
    ar = [1.0, 2.0, 3.0, 1.5, 2.5, 1.2, 2.2]
    eagle = [0.5, 2.0, 1.0, 1.0, 2.5, 0.4, 2.2]
    rows = pl.DataFrame([dict(mode=m, batch_size=1, budget=None, tokens=10, seconds=10 * v,
                              tau=1.0, repeat=r, position=(r + (m == "eagle")) % 2,
                              latency_p50=v)
                         for m, values in (("ar", ar), ("eagle", eagle))
                         for r, v in enumerate(values)], schema_overrides=dict(budget=pl.Int64))
    r = timing.speedups(rows).row(0, named=True)
    ratios = sorted(a / e for a, e in zip(ar, eagle))
    assert r["speedup"] == pytest.approx(float(np.median(ratios))) == 1.5
    assert r["speedup"] != pytest.approx(float(np.median(ar) / np.median(eagle)))
    assert (r["speedup_low"], r["speedup_high"]) == pytest.approx((ratios[0], ratios[-1]))
    assert r["pairs"] == 7 and r["speedup_coverage"] == pytest.approx(timing.coverage(7))


def test_a_slow_period_on_both_sides_keeps_its_pair_and_a_stall_on_one_moves_nothing():
    """The ratios are not trimmed: a repeat that ran 3× slower on both sides is a good pair
    (the per-configuration rule leaves it out of the tokens/s medians); one whose EAGLE
    decoding alone stalled is kept too, and at 9 repeats the interval leaves it out itself."""
    def speed(ar, eagle):
        rows = pl.DataFrame([dict(mode=m, batch_size=1, budget=None, tokens=10, seconds=10 * v,
                                  tau=1.0, repeat=r, position=0 if m == "ar" else 1,
                                  latency_p50=v)
                             for m, values in (("ar", ar), ("eagle", eagle))
                             for r, v in enumerate(values)],
                            schema_overrides=dict(budget=pl.Int64))
        return timing.speedups(rows).row(0, named=True)
    ar = [1.0, 1.01, 0.99, 1.02, 0.98, 1.0, 1.01, 0.99, 3.0]
    both = speed(ar, [a / 2 * (1 + 0.002 * i) for i, a in enumerate(ar)])
    assert both["pairs"] == 9 and both["dropped"] == 2  # kept as a pair, not in tok/s
    assert 1.95 < both["speedup_low"] <= both["speedup"] <= both["speedup_high"] <= 2.0
    one = speed(ar[:8] + [1.0], [0.5] * 8 + [1.5])  # EAGLE stalled, AR did not
    assert one["pairs"] == 9 and one["dropped"] == 1
    assert one["speedup"] == pytest.approx(2.0) and one["speedup_low"] > 1.9


def _old_file(tmp_path, repeats: int):
    """A measurement written by the real writer, then stripped of ``position`` as every file
    stored before repeats were interleaved is (AR's repeats all ran before EAGLE's)."""
    import pyarrow.parquet as pq

    from moe_spec.catalog.writer import write_batch_profile
    from moe_spec.profiling import profile_batch as pb
    settings = pb.ProfileBatchSettings(model="tiny-olmoe", limit=1, batch_sizes=(1,))
    decodings = [pb.Decoding(mode, 1, None, 10, 10.0 * spt * (1 + 0.01 * r), [], 10, 10,
                             repeat=r)
                 for mode, spt in (("ar", 1.0), ("eagle", 0.5)) for r in range(repeats)]
    found = pb.tables(settings, decodings, num_experts=64, top_k=8, device="cpu", threads=1,
                      measurement=("20261201T000000Z-aaaaaa", "2026-12-01T00:00:00+00:00"))
    write_batch_profile(tmp_path, "tiny-olmoe", "mbpp", "batch-x", "20261201T000000Z-aaaaaa",
                        found)
    for part in (tmp_path / "batch_profile").rglob("*.parquet"):
        table = pq.read_table(part)
        pq.write_table(table.drop(["position"]), part)


@pytest.mark.parametrize("repeats", [3, 7])
def test_a_measurement_stored_before_the_pairing_reads_unpaired(tmp_path, repeats):
    """Never re-paired: the ratio of the two medians as before, with the Bonferroni
    combination of their 97.5% order-statistic intervals (7 repeats a side), and every reader
    says "unpaired"; 3 unpaired repeats a side give no interval, and say why."""
    from moe_spec.analysis import figures, frames
    from moe_spec.analysis.sql import connect
    from moe_spec.app.screens.batch_regime import batch_speed_table
    _old_file(tmp_path, repeats)
    speed = frames.batch_speedup(connect(tmp_path))
    r = speed.row(0, named=True)
    assert not r["paired"] and r["pairs"] == 0
    assert r["speedup"] == pytest.approx(np.median([1 + 0.01 * i for i in range(repeats)])
                                         / np.median([0.5 * (1 + 0.01 * i)
                                                      for i in range(repeats)]))
    text = timing.speedup_text(r)
    table = batch_speed_table(speed)
    assert "unpaired" in table["repeats kept"][0] and "unpaired" in text
    assert "unpaired" in figures.batch_speedup(speed).layout.title.text
    if repeats == 3:
        assert np.isnan(r["speedup_low"]) and "no interval: unpaired, 3 AR and 3 EAGLE" in text
    else:
        assert r["speedup_low"] == pytest.approx(1.0 / (0.5 * 1.06))  # low AR / high EAGLE
        assert r["speedup_high"] == pytest.approx(1.06 / 0.5)
        assert r["speedup_coverage"] == pytest.approx(1 - 2 * 2 / 2 ** 7)
        assert "95% CI" in text
