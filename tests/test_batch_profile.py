"""profile-batch (profiling.profile_batch): MoESD's speedup-vs-b measured, stored, fitted, shown;
and the roofline's batch terms against a per-sequence reference."""

import subprocess
import sys
import time

import numpy as np
import polars as pl
import pytest

from moe_spec.analysis import cost, frames
from moe_spec.analysis.sql import connect
from moe_spec.moe import shapes
from moe_spec.profiling import profile_batch


def test_a_batch_pass_reads_weights_once_and_computes_every_sequence():
    """Reference: b sequences are b single-sequence passes that share the weight reads."""
    shape = cost.ModelShape.from_config(shapes.REAL_SHAPES["olmoe"].build_config())
    hw = cost.PROFILES["H100-SXM"]
    for b, m, p, e in ((1, 63, 512, 20.0), (4, 63, 300, 50.0), (32, 1, 1000, 64.0)):
        one_b, one_f = shape.layer_terms(m, p, e)
        many_b, many_f = shape.layer_terms(m, p, e, batch_size=b)
        kv = 2 * p * shape.kv_heads * shape.head_dim * shape.bytes_per_param
        assert many_f == pytest.approx(b * one_f) and many_b == pytest.approx(one_b + (b - 1) * kv)
        assert shape.head_terms(m, b)[1] == pytest.approx(b * shape.head_terms(m)[1])
    assert cost.pass_time(shape, hw, 63, 512, 20.0) == cost.pass_time(shape, hw, 63, 512, 20.0, 1)
    # memory-bound at small b: a batch of 8 AR tokens costs far less than 8 single passes
    assert cost.pass_time(shape, hw, 1, 512, 40.0, 8)[0] < 0.5 * 8 * cost.pass_time(
        shape, hw, 1, 512, 8.0)[0]
    from moe_spec.analysis.routing import moesd_uniform

    def speedup(b):  # MoESD's shape: experts saturate with b, then compute takes over
        spec, ar = moesd_uniform(64, 8, [b * 63])[0], moesd_uniform(64, 8, [b])[0]
        return cost.projected_batch_speedup(shape, hw, b, 4.0, 63, 512, spec, ar)
    assert speedup(16) > speedup(4) > speedup(1) and speedup(16) > speedup(256) > speedup(1024)


@pytest.mark.slow  # a fresh process
@pytest.mark.parametrize("args, says", [
    (["--batch-sizes", "0,2"], "--batch-sizes '0,2'"),
    (["--batch-sizes", "2,2"], "distinct"),
    (["--budget", "x"], "--budget 'x'"),
    (["--limit", "0"], "--limit"),
    (["--model", "no-such-model"], "no-such-model"),
])
def test_bad_input_is_one_line_before_torch_loads(args, says):
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "moe_spec.profiling.profile_batch", *args],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("profile-batch: error:") and says in lines[0]
    assert time.perf_counter() - start < 10  # a generous bound on a loaded machine


@pytest.mark.slow
def test_profile_batch_stores_every_decoding_and_the_report_draws_it(tmp_path):
    from moe_spec.analysis import report
    from moe_spec.capture import cli as capture_cli

    out = tmp_path / "t"
    assert capture_cli.main(["--model", "tiny-olmoe", "--limit", "2", "--max-new-tokens", "4",
                             "--out", str(out), "--no-progress"]) == 0
    args = ["--model", "tiny-olmoe", "--limit", "3", "--max-new-tokens", "6", "--batch-sizes",
            "1,2,3", "--budget", "12,24", "--out", str(out), "--no-progress", "--threads", "1",
            "--repeats", "2", "--output", str(tmp_path / "pb.json")]
    assert profile_batch.main(args) == 0
    assert profile_batch.main(["--ranking", "coact", *args]) == 2  # needs calibration
    con = connect(out)
    rows = con.sql("SELECT mode, batch_size, budget, tokens, passes FROM batch_profile").pl()
    assert rows.height == 3 * (2 + 2) * 2  # (ar, eagle, eagle B=12, eagle B=24) at each b, ×2
    assert rows["tokens"].to_list() == [3 * 6] * rows.height  # equal work, budgets included
    passes = con.sql("SELECT mode, gamma, pass_sequences FROM batch_profile_passes").pl()
    assert set(passes.filter(pl.col("mode") == "ar")["gamma"]) == {1}
    assert passes["pass_sequences"].max() == 3 and passes["pass_sequences"].min() >= 1
    speed = frames.batch_speedup(con)
    assert speed.height == 9 and (speed["speedup"] > 0).all()
    fit = frames.batch_fit(con, "tiny-olmoe", "mbpp", speed["run"][0], speed)
    assert fit is not None and fit["gamma"] > 1
    # 3 prompts x 6 tokens: too few EAGLE passes at b = 2, 3 for the sample check (42.3)
    assert fit["predicted"].height == 3 if fit["refused"] is None else \
        fit["refused"].startswith("not fitted: only") and fit["predicted"].is_empty()
    # the same command again is a second measurement of the same run, kept beside the first
    assert profile_batch.main(args) == 0
    assert connect(out).sql("SELECT count(DISTINCT run), count(DISTINCT measurement), count(*) "
                            "FROM batch_profile").fetchall() == [(1, 2, 2 * rows.height)]
    html = report.write_report(out, tmp_path / "r")[0].read_text()
    assert "speedup vs batch size (measured on equal work" in html


# --- issue 59.2: like-for-like timing ----------------------------------------------------------
def _boom(*args, **kwargs):
    raise AssertionError("work started before the options were checked")


def test_limit_below_the_largest_batch_size_is_refused_before_any_work(monkeypatch, capsys):
    from moe_spec.tasks import benchmarks
    monkeypatch.setattr(benchmarks, "load", _boom)
    monkeypatch.setattr(profile_batch, "load_target", _boom)
    assert profile_batch.main(["--model", "tiny-olmoe", "--batch-sizes", "1,4,16", "--limit",
                               "8", "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--limit 8" in lines[0] and "largest batch size 16" in lines[0]


def test_the_readme_and_the_defaults_give_a_full_batch_at_every_b():
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    line = re.search(r"profile-batch (--model[^#\n]*)", readme).group(1).split()
    for argv in (line, ["--model", "tiny-olmoe"]):
        s = profile_batch.settings_from(profile_batch.parser().parse_args(argv))
        assert s.limit >= max(s.batch_sizes) and s.repeats >= 3


def _fake_measure(monkeypatch, settings):
    """profile_batch.measure with the model stood in for: every decode call's arguments."""
    from types import SimpleNamespace
    calls = []

    def decode(decoder, prompts, batch_size, max_new_tokens, *, eos=frozenset(),
               autoregressive=False, verify_context=None, budget=None, on_pass=None):
        calls.append(dict(eos=set(eos), max_new_tokens=max_new_tokens, b=batch_size))
        return profile_batch.Decoding("ar" if autoregressive else "eagle", batch_size, budget,
                                      len(prompts) * max_new_tokens, 1.0, [], 0, 0)
    monkeypatch.setattr(profile_batch, "decode", decode)
    monkeypatch.setattr("moe_spec.eagle.decoding.EagleDecoder", lambda *a: None)
    monkeypatch.setattr("moe_spec.moe.adapter.MoEAdapter", lambda *a: None)
    monkeypatch.setattr("moe_spec.moe.recorder.VerifyRecorder", lambda *a, **k: None)
    loaded = SimpleNamespace(model=None, tokenizer=SimpleNamespace(eos_token_id=2))
    got = list(profile_batch.measure(settings, loaded, None, [[5], [6]]))
    return got, calls


def test_every_configuration_decodes_the_same_tokens_end_of_sequence_ignored(monkeypatch):
    settings = profile_batch.ProfileBatchSettings(model="tiny-olmoe", limit=2,
                                                  batch_sizes=(1, 2))
    got, calls = _fake_measure(monkeypatch, settings)
    assert all(c["eos"] == set() for c in calls)  # EOS never stops a decoding: equal work
    timed = [c for c in calls if c["max_new_tokens"] == settings.max_new_tokens]
    repeats = settings.repeats
    assert len(got) == len(timed) == 2 * 2 * repeats  # (ar, eagle) × b × the default repeats
    assert {d.repeat for d in got} == set(range(repeats))


def test_each_repeat_decodes_every_configuration_back_to_back_in_rotated_order(monkeypatch):
    """Paired repeats (issue 59): at one b, repeat r decodes ar, eagle and eagle under each
    budget one after another, starting at configuration r mod 3, and every row says where."""
    settings = profile_batch.ProfileBatchSettings(model="tiny-olmoe", limit=2, budgets=(16,),
                                                  batch_sizes=(1, 2), repeats=4)
    got, _ = _fake_measure(monkeypatch, settings)
    configurations = [("ar", None), ("eagle", None), ("eagle", 16)]
    assert len(got) == 2 * 4 * 3
    for i, b in enumerate((1, 2)):
        at_b = got[i * 12:(i + 1) * 12]
        assert {d.batch_size for d in at_b} == {b}
        for r in range(4):
            one = at_b[r * 3:(r + 1) * 3]  # one repeat: every configuration, back to back
            assert {d.repeat for d in one} == {r}
            assert [(d.mode, d.budget) for d in one] == configurations[r % 3:] + \
                configurations[:r % 3]
            assert [d.position for d in one] == [0, 1, 2]
            assert [d.row()["position"] for d in one] == [0, 1, 2]


def _rows(spt: dict, tokens: dict | None = None, paired: bool = True, **extra) -> pl.DataFrame:
    """batch_profile rows: {(mode, b, budget): [seconds per token of each repeat]}; ``paired``:
    each row with its ``position`` (interleaved repeats), else none (stored before)."""
    rows = []
    for i, ((mode, b, budget), values) in enumerate(spt.items()):
        for r, v in enumerate(values):
            n = (tokens or {}).get((mode, b, budget), 100)
            rows.append(dict(mode=mode, batch_size=b, budget=budget, tokens=n, seconds=v * n,
                             tau=1.0 if mode == "ar" else 3.0, repeat=r, latency_p50=v * 3,
                             num_experts=64, top_k=8, device="cpu",
                             **(dict(position=(i - r) % len(spt)) if paired else {}), **extra))
    return pl.DataFrame(rows, schema_overrides=dict(budget=pl.Int64))


def test_a_speedup_is_a_median_ratio_with_its_interval_on_equal_work():
    from moe_spec.analysis import timing
    ar = [1.0, 1.1, 0.9, 1.05, 0.95, 1.02, 0.98, 1.01, 0.99]
    paired = [2.0, 1.9, 2.1, 1.95, 2.05, 2.0, 1.85, 2.02, 1.98]  # each repeat's AR / EAGLE
    stalled = [0.4, 0.42, 9.0, 0.41, 0.4, 0.42, 0.41, 0.4, 0.41]
    speed = timing.speedups(_rows({("ar", 1, None): ar,
                                   ("eagle", 1, None): [a / p for a, p in zip(ar, paired)],
                                   ("eagle", 1, 16): stalled}))
    plain = speed.filter(pl.col("budget").is_null()).row(0, named=True)
    assert plain["speedup"] == pytest.approx(2.0) and plain["equal_work"] and plain["paired"]
    ratios = sorted(paired)  # 9 ratios: [x(2), x(8)], coverage 96.1%
    assert (plain["speedup_low"], plain["speedup_high"]) == pytest.approx((ratios[1], ratios[7]))
    assert plain["speedup_coverage"] == pytest.approx(1 - 2 * 10 / 2 ** 9)
    budget = speed.filter(pl.col("budget") == 16).row(0, named=True)
    assert budget["dropped"] == 1 and budget["repeats"] == 8  # the outlier rule, counted
    assert budget["eagle_tokens_per_s"] == pytest.approx(1 / 0.41)  # the stall left out
    assert budget["pairs"] == 9  # ratios untrimmed: the interval leaves the stall out itself
    ratios = sorted(a / e for a, e in zip(ar, stalled))
    assert budget["speedup"] == pytest.approx(float(np.median(ratios)))
    assert (budget["speedup_low"], budget["speedup_high"]) == pytest.approx(
        (ratios[1], ratios[7])) and budget["speedup_low"] > 2
    # a budget that decodes other tokens is flagged, not compared silently
    unequal = timing.speedups(_rows({("ar", 1, None): [1.0, 1.0], ("eagle", 1, 16): [0.5, 0.6]},
                                    tokens={("eagle", 1, 16): 75}))
    assert not unequal["equal_work"][0]
    one = timing.speedups(_rows({("ar", 1, None): [1.0], ("eagle", 1, None): [0.5]}))
    r = one.row(0, named=True)
    assert "no interval" in timing.with_interval(r["speedup"], r["speedup_low"],
                                                 r["speedup_high"])


def test_every_measurement_is_kept_and_readers_pick_one(tmp_path):
    from moe_spec.analysis import timing
    from moe_spec.catalog.writer import write_batch_profile
    settings = profile_batch.ProfileBatchSettings(model="tiny-olmoe", limit=1, batch_sizes=(1,))
    ids = [("20260101T000000Z-aaaaaa", "2026-01-01T00:00:00+00:00"),
           ("20260102T000000Z-bbbbbb", "2026-01-02T00:00:00+00:00")]
    for (mid, at), eagle in zip(ids, (0.5, 0.25)):
        decodings = [profile_batch.Decoding("ar", 1, None, 10, 10.0, [], 10, 10),
                     profile_batch.Decoding("eagle", 1, None, 10, 10 * eagle, [], 10, 4)]
        found = profile_batch.tables(settings, decodings, num_experts=64, top_k=8, device="cpu",
                                     threads=1, measurement=(mid, at))
        write_batch_profile(tmp_path, "tiny-olmoe", "mbpp", "batch-x", mid, found)
    con = connect(tmp_path)
    rows = con.sql("SELECT measurement, count(*) AS n FROM batch_profile GROUP BY ALL").pl()
    assert sorted(rows["measurement"]) == [i for i, _ in ids] and set(rows["n"]) == {2}
    speed = frames.batch_speedup(con)
    assert sorted(speed["speedup"].to_list()) == pytest.approx([2.0, 4.0])  # never averaged
    assert timing.latest(speed)["speedup"].to_list() == pytest.approx([4.0])  # the latest


def test_the_batch_regime_table_and_figure_show_every_speedup_with_its_interval():
    from moe_spec.analysis import figures, timing
    from moe_spec.app.screens.batch_regime import batch_speed_table
    seven = (1.0, 1.1, 0.9, 1.05, 0.95, 1.02, 0.98)  # 7 repeats: the interval is their range
    speed = timing.speedups(_rows({("ar", 1, None): seven,
                                   ("eagle", 1, None): [s / 2 for s in seven],
                                   ("eagle", 1, 16): [s / 2.5 for s in seven]}))
    table = batch_speed_table(speed)
    assert table["budget B"].to_list() == ["none", "16"]  # never "None"
    assert all("95% CI" in s for s in table["speedup (95% CI)"])
    assert all("7 pairs" in s for s in table["repeats kept"])
    fig = figures.batch_speedup(speed)
    measured = [t for t in fig.data if t.name.startswith("measured")]
    assert measured and all(t.error_y.array is not None for t in measured)
    assert "equal work" in fig.layout.title.text
    assert timing.INTERVAL_SHORT in fig.layout.title.text  # the interval's rule, on the figure
    lines = profile_batch.summary_lines([
        profile_batch.Decoding(m, 1, None, 10, s * (1 if m == "ar" else 0.5), [], 10, 10,
                               repeat=r, position=(p + r) % 2)
        for p, m in enumerate(("ar", "eagle")) for r, s in enumerate(seven)])
    assert "95% CI" in lines[1] and "2.00×" in lines[1]
