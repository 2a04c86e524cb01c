"""Timing fits without warm-up (issue 42.3): the warm-up rule (analysis.warmup), the sample check
every fit passes before it is shown, and profile-batch's --warmup/--repeats, latency percentiles
and partial results."""

import json

import numpy as np
import polars as pl
import pytest

from moe_spec.analysis import cost, frames, moesd, warmup
from moe_spec.analysis.routing import moesd_uniform

N, K = 64, 8
SHAPE = cost.ModelShape(layers=16, hidden=2048, expert_inter=1024, num_experts=64, top_k=8,
                        heads=16, kv_heads=16, head_dim=128, vocab=50304)
HW = cost.PROFILES["A100-80G"]


# --- the rule -----------------------------------------------------------------------------------
def test_the_rule_drops_each_runs_first_pass_and_stalls_and_counts_them():
    rng = np.random.default_rng(0)
    rows = []
    for run in ("a", "b"):
        for i in range(30):
            rows.append(dict(run=run, order=i, seconds=0.2 * (1 + 0.05 * rng.standard_normal())))
    frame = pl.DataFrame(rows).with_columns(
        seconds=pl.when(pl.col("order") == 0).then(pl.col("seconds") * 20)  # warm-up: 20×
        .when((pl.col("run") == "b") & (pl.col("order") == 17)).then(3.0)  # a stall
        .otherwise(pl.col("seconds")))
    kept, dropped = warmup.drop(frame, "seconds", ["run"], "order")
    assert dropped == 3 and kept.height == 57
    assert 0 not in set(kept["order"]) and kept["seconds"].max() < 0.3
    # a batched pass's trees share their pass number: the whole first pass goes
    batched = pl.DataFrame(dict(run=["a"] * 12, order=[1, 1, 1] + list(range(2, 11)),
                                seconds=[5.0] * 3 + [0.2] * 9))
    kept, dropped = warmup.drop(batched, "seconds", ["run"], "order")
    assert dropped == 1 and kept.height == 9


def _passes(first_factor: float) -> pl.DataFrame:
    """Synthetic verify times from the roofline (two runs, 40 passes each, 3% noise) with each
    run's first pass ``first_factor`` times slower."""
    rng = np.random.default_rng(1)
    rows = []
    for run in ("r1", "r2"):
        for i in range(40):
            nodes, loaded, prefix = int(rng.integers(8, 64)), float(rng.integers(8, 65)), 256
            mem, comp = cost.pass_time(SHAPE, HW, nodes, prefix, loaded)[1:]
            t = (1.7 * mem + 0.3 * comp + 2e-4) * (1 + 0.03 * rng.standard_normal())
            rows.append(dict(run=run, pass_order=i + 1, measured=t * (first_factor if i == 0 else 1),
                             nodes=nodes, prefix_len=prefix, experts_loaded=loaded))
    return pl.DataFrame(rows)


def test_calibration_with_a_20x_first_pass_fits_after_the_rule_and_not_without():
    t = _passes(20.0)
    naive = cost.calibrate(SHAPE, HW, t["measured"], t["nodes"], t["prefix_len"],
                           t["experts_loaded"])
    assert naive.relative_rmse > 0.5 and not naive.usable  # what the speedup page showed
    frame, cal = frames.calibration_passes(SHAPE, HW, t)
    assert cal.dropped >= 2 and cal.points == frame.height <= 78
    assert cal.relative_rmse < 0.06 and cal.usable
    assert cal.alpha == pytest.approx(1.7, rel=0.1)
    assert f"{cal.dropped} dropped by the warm-up rule" in cal.verdict


def test_batch_fit_with_a_20x_first_pass_per_decoding_fits_after_the_rule_and_not_without():
    rng = np.random.default_rng(2)
    rows = []
    for b in (1, 2, 4, 8, 16):
        for mode, gamma in (("ar", 1), ("eagle", 8)):
            for i in range(12):
                t = (1e-3 + 2e-5 * float(moesd_uniform(N, K, np.array([b * gamma]))[0])
                     + 1e-5 * b * gamma) * (1 + 0.02 * rng.standard_normal())
                rows.append(dict(mode=mode, batch_size=b, budget=None, pass_index=i, pass_sequences=b,
                                 gamma=gamma, verify_seconds=t * (20 if i == 0 else 1)))
    passes = pl.DataFrame(rows, schema_overrides=dict(budget=pl.Int32))
    points, dropped = frames.batch_pass_points(passes)
    assert dropped >= 10 and (points["passes"] <= 11).all()
    good = moesd.fit(points, N, K)
    assert good["refused"] is None and good["relative_rmse"] < 0.03
    # without the rule: every pass a point of its own (a mean over the decoding does no better)
    raw = passes.select(pl.col("pass_sequences").alias("batch_size"), "gamma",
                        pl.col("verify_seconds").alias("seconds"))
    assert moesd.fit(raw, N, K)["relative_rmse"] > 0.5


# --- the sample check ---------------------------------------------------------------------------
def test_a_fit_with_too_few_passes_per_b_is_refused_with_the_reason():
    points = pl.DataFrame(dict(batch_size=[1, 2, 4], gamma=[8, 8, 8], seconds=[0.01, 0.012, 0.02],
                               passes=[40, 1, 3]))
    coef = moesd.fit(points, N, K)
    assert coef["refused"].startswith("not fitted: only 1 pass at b = 2 (need 5)")
    assert np.isnan(coef["c0"]) and np.isnan(coef["relative_rmse"])
    # enough passes but too few points for three parameters
    coef = moesd.fit(points.with_columns(passes=pl.lit(50)), N, K)
    assert coef["refused"] == "not fitted: only 3 points for 3 parameters (need 5)"
    # a thin point among enough others is left out, and said
    many = pl.DataFrame(dict(batch_size=[1, 2, 3, 4, 8, 16], gamma=[8] * 6, passes=[9, 9, 2, 9, 9, 9],
                             seconds=[1e-3 + 1e-5 * b * 8 for b in (1, 2, 3, 4, 8, 16)]))
    coef = moesd.fit(many, N, K)
    assert coef["refused"] is None and coef["points"] == 5 and coef["left_out"] == ["b = 3 (2 passes)"]
    cal = cost.calibrate(SHAPE, HW, [0.01, 0.02, 0.03], [8, 16, 32], [256] * 3, [8, 16, 24],
                         dropped=1)
    assert not cal.usable and cal.problems == ["not fitted: only 3 passes (need 5)"]
    assert cal.verdict.startswith("not fitted: only 3 passes (need 5)")


def _stored_profile(tmp_path, passes_per_b: dict[int, int]):
    """A profile-batch run written through the real writer: ar and eagle at each b, each
    decoding with ``passes_per_b[b]`` passes of b sequences."""
    from moe_spec.catalog.writer import write_batch_profile
    from moe_spec.profiling import profile_batch as pb
    settings = pb.ProfileBatchSettings(model="tiny-olmoe", batch_sizes=tuple(passes_per_b))
    decodings = []
    for b, count in passes_per_b.items():
        for mode, gamma in (("ar", 1), ("eagle", 8)):
            passes = [dict(pass_sequences=b, gamma=gamma, verify_seconds=1e-3 * (1 + b * gamma / 64),
                           draft_seconds=1e-4) for _ in range(count)]
            decodings.append(pb.Decoding(mode, b, None, 64, 1.0 if mode == "ar" else 0.5,
                                         passes, count * 2, count))
    tables = pb.tables(settings, decodings, num_experts=N, top_k=K, device="cpu", threads=1,
                       measurement=("m1", "2026-01-01T00:00:00+00:00"))
    write_batch_profile(tmp_path, "tiny-olmoe", "mbpp", "batch-x", "m1", tables)


def test_a_refused_batch_fit_is_not_drawn_and_the_report_says_why(tmp_path):
    from moe_spec.analysis import report
    from moe_spec.analysis.sql import connect
    _stored_profile(tmp_path, {1: 20, 2: 2, 4: 4})
    con = connect(tmp_path)
    speed = frames.batch_speedup(con)
    fit = frames.batch_fit(con, "tiny-olmoe", "mbpp", "batch-x", speed)
    assert fit["refused"].startswith("not fitted: only 1 pass at b = 2, γ = 1 (need 5)")
    assert fit["predicted"].is_empty() and fit["dropped"] == 6  # the first pass of each decoding
    figs = report.batch_figures(con, {"batch_speed": speed}, "tiny-olmoe", "mbpp", N)
    assert not [t for t in figs[0].data if "MoESD fit" in (t.name or "")]  # nothing drawn
    said = " ".join(a.text for a in figs[0].layout.annotations)
    assert "not fitted: only 1 pass at b = 2" in said and "6 passes dropped as warm-up" in said


def test_an_old_profile_file_without_repeats_and_percentiles_still_reads(tmp_path):
    """Files written before ``repeat``, the latency percentiles and measurements (one
    ``part-0.parquet`` per run): readers select by name."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from moe_spec.analysis.sql import connect
    from moe_spec.catalog import schema
    _stored_profile(tmp_path, {1: 12, 2: 12, 4: 12})
    new = {"measurement", "measured_at", "complete", "seconds_per_token"}
    for table, drop in (("batch_profile", {"repeat", "latency_p50", "latency_p90", "latency_p99",
                                           *new}),
                        ("batch_profile_passes", {"repeat", "measurement"})):
        for part in (tmp_path / table).rglob("*.parquet"):
            old = pq.read_table(part)
            pq.write_table(old.select([c for c in old.column_names if c not in drop & set(
                old.column_names)]), part.with_name("part-0.parquet"))
            part.unlink()
        assert drop <= set(schema.BATCH_PROFILE_TABLES[table].names)
    con = connect(tmp_path)
    speed = frames.batch_speedup(con)
    assert speed.height == 3 and (speed["repeats"] == 1).all()
    assert "repeat" not in con.sql("DESCRIBE batch_profile_passes").pl()["column_name"].to_list()
    fit = frames.batch_fit(con, "tiny-olmoe", "mbpp", "batch-x", speed)
    assert fit["dropped"] == 6 and fit["points"]["passes"].to_list() == [11] * 6
    assert pa is not None


# --- profile-batch ------------------------------------------------------------------------------
@pytest.mark.parametrize("args, says", [(["--warmup", "-1"], "--warmup -1 is out of range"),
                                        (["--repeats", "0"], "--repeats 0 is out of range")])
def test_profile_batch_warmup_and_repeats_are_checked(args, says):
    from moe_spec.profiling import profile_batch as pb
    with pytest.raises(ValueError, match=says):
        pb.settings_from(pb.parser().parse_args(["--model", "tiny-olmoe", *args]))
    settings = pb.settings_from(pb.parser().parse_args(["--model", "tiny-olmoe", "--warmup", "3",
                                                        "--repeats", "2"]))
    assert (settings.warmup, settings.repeats) == (3, 2)
    defaults = pb.settings_from(pb.parser().parse_args(["--model", "tiny-olmoe"]))
    assert (defaults.warmup, defaults.repeats) == (1, 9)  # issue 59: an interval by default
    assert pb.run_name(settings) != pb.run_name(defaults)  # they decide the numbers


def test_profile_batch_latency_percentiles_leave_the_first_pass_out():
    from moe_spec.profiling import profile_batch as pb
    times = [9.0] + [0.01 * i for i in range(1, 101)]
    d = pb.Decoding("eagle", 2, None, 10, 1.0, [dict(pass_sequences=2, gamma=8,
                                                     verify_seconds=t - 1e-3, draft_seconds=1e-3)
                                                for t in times], 10, 10)
    lat = d.latency
    for q in (50, 90, 99):
        assert lat[f"latency_p{q}"] == pytest.approx(np.percentile(times[1:], q))
    assert d.row()["latency_p99"] < 1.1  # the 9 s warm-up pass is not the tail
    lines = pb.latency_lines([d])
    assert "p50 ms" in lines[0] and "p99 ms" in lines[0] and "b=2 eagle" in lines[1]


ARGS = ["--model", "tiny-olmoe", "--batch-sizes", "1,2", "--limit", "2", "--max-new-tokens", "8",
        "--threads", "1", "--no-progress"]


@pytest.mark.slow
def test_profile_batch_repeats_and_reports_percentiles(tmp_path, capsys):
    from moe_spec.analysis.sql import connect
    from moe_spec.profiling import profile_batch as pb
    out = tmp_path / "t"
    assert pb.main([*ARGS, "--out", str(out), "--repeats", "2", "--warmup", "0",
                    "--output", str(tmp_path / "pb.json")]) == 0
    printed = capsys.readouterr().out
    assert "p50 ms" in printed and "p90 ms" in printed and "p99 ms" in printed
    assert "b=2 eagle #2" in printed
    rows = connect(out).sql("SELECT mode, batch_size, repeat, latency_p50, latency_p90, "
                            "latency_p99 FROM batch_profile").pl()
    assert rows.height == 2 * 2 * 2 and set(rows["repeat"]) == {0, 1}
    assert (rows["latency_p50"] <= rows["latency_p90"]).all()
    assert (rows["latency_p90"] <= rows["latency_p99"]).all()
    saved = json.loads((tmp_path / "pb.json").read_text())
    assert saved["complete"] is True and saved["decodings"] == "8 of 8"
    assert saved["settings"]["repeats"] == 2 and saved["settings"]["warmup"] == 0


@pytest.mark.slow
def test_a_stopped_profile_batch_leaves_the_decodings_it_finished(tmp_path, monkeypatch, capsys):
    from moe_spec.analysis.sql import connect
    from moe_spec.profiling import profile_batch as pb
    real, timed = pb.decode, []

    def decode(*args, **kwargs):
        if args[3] == 8:  # a timed decoding (warm-up decodings run for 2 tokens)
            timed.append(args[2])
            if len(timed) == 2:
                raise KeyboardInterrupt  # stopped during the second decoding
        return real(*args, **kwargs)

    monkeypatch.setattr(pb, "decode", decode)
    out = tmp_path / "t"
    assert pb.main([*ARGS, "--out", str(out), "--output", str(tmp_path / "pb.json"),
                    "--repeats", "1"]) == 130
    assert "interrupted; kept the 1 finished decodings of 4" in capsys.readouterr().err
    con = connect(out)
    rows = con.sql("SELECT mode, batch_size, repeat FROM batch_profile").pl()
    assert rows.rows() == [("ar", 1, 0)]  # the first decoding, whole
    passes = con.sql("SELECT DISTINCT mode, batch_size FROM batch_profile_passes").pl()
    assert passes.rows() == [("ar", 1)]
    saved = json.loads((tmp_path / "pb.json").read_text())
    assert saved["complete"] is False and saved["decodings"] == "1 of 4"
    assert len(saved["rows"]) == 1
