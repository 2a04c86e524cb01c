"""profile-batch (profiling.profile_batch): MoESD's speedup-vs-b measured, stored, fitted, shown;
and the roofline's batch terms against a per-sequence reference."""

import subprocess
import sys
import time

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
        many_b, many_f = shape.layer_terms(m, p, e, batch=b)
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
            "--output", str(tmp_path / "pb.json")]
    assert profile_batch.main(args) == 0
    assert profile_batch.main(["--ranking", "coact", *args]) == 2  # needs calibration
    con = connect(out)
    rows = con.sql("SELECT mode, batch_size, budget, tokens, passes FROM batch_profile").pl()
    assert rows.height == 3 * (2 + 2)  # (ar, eagle, eagle B=12, eagle B=24) at each b
    plain = rows.filter(pl.col("budget").is_null())  # lossless: the same tokens every way
    assert plain["tokens"].n_unique() == 1 and 3 <= plain["tokens"][0] <= 3 * 6
    passes = con.sql("SELECT mode, gamma, batch FROM batch_profile_passes").pl()
    assert set(passes.filter(pl.col("mode") == "ar")["gamma"]) == {1}
    assert passes["batch"].max() == 3 and passes["batch"].min() >= 1
    speed = frames.batch_speedup(con)
    assert speed.height == 9 and (speed["speedup"] > 0).all()
    fit = frames.batch_fit(con, "tiny-olmoe", "mbpp", speed["run"][0], speed)
    assert fit is not None and fit["gamma"] > 1
    # 3 prompts x 6 tokens: too few EAGLE passes at b = 2, 3 for the sample check (42.3)
    assert fit["predicted"].height == 3 if fit["refused"] is None else \
        fit["refused"].startswith("not fitted: only") and fit["predicted"].is_empty()
    # the same command again replaces its own points (one run, not two)
    assert profile_batch.main(args) == 0
    assert connect(out).sql("SELECT count(DISTINCT run) FROM batch_profile").fetchall() == [(1,)]
    html = report.write_report(out, tmp_path / "r")[0].read_text()
    assert "speedup vs batch size (measured)" in html
