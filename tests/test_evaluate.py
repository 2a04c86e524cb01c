"""Task quality: every scorer on known right and wrong answers, the sandbox on hostile code, the
evaluate command with a budgeted run and its twin, and the speedup–quality frontier."""

import json
import time

import polars as pl
import pytest

from moe_spec.analysis import cost, quality
from moe_spec.capture import cli as capture_cli
from moe_spec.tasks import benchmarks, scoring
from moe_spec.tasks.sandbox import run_python

pytestmark = pytest.mark.slow  # end to end (captures); scripts/test.sh --fast leaves it out


def prompt(bench, i=0):
    return benchmarks.load(bench, offset=i, limit=1)[0]


def test_gsm8k_answer_extraction_and_normalisation():
    p = prompt("gsm8k")
    want = scoring.final_number(p.reference)
    assert scoring.gsm8k(p, f" Let me think. 3 + 4 = 7.\n#### {want}").value == 1.0
    assert scoring.gsm8k(p, f" The answer is ${int(want):,}.00").value == 1.0
    assert scoring.gsm8k(p, " #### 123456789").value == 0.0
    assert scoring.gsm8k(p, " no number at all").value == 0.0
    assert scoring.normalise_number("$1,000.50") == "1000.5" and scoring.normalise_number("7.0") == "7"


def test_math500_is_symbolic():
    p = benchmarks.Prompt("math500", "x", "Problem: ...", r"\frac{1}{2}")
    assert scoring.math500(p, r" So the answer is $\boxed{0.5}$.").value == 1.0
    assert scoring.math500(p, r" The answer is $\dfrac{2}{4}$").value == 1.0
    assert scoring.math500(p, r" The answer is $\frac{1}{3}$").value == 0.0
    assert scoring.math500(p, "").value == 0.0


def test_mbpp_and_humaneval_run_the_benchmark_tests():
    p = prompt("mbpp")
    assert scoring.mbpp(p, p.reference).value == 1.0  # the reference solution passes
    assert scoring.mbpp(p, "def min_cost(cost, m, n):\n    return 0\n").value == 0.0
    assert scoring.mbpp(p, "").value == 0.0
    h = prompt("humaneval")
    assert scoring.humaneval(h, h.reference).value == 1.0
    assert scoring.humaneval(h, "    return None\n").value == 0.0


def test_rouge_l_against_the_reference_highlights():
    p = prompt("cnndm")
    assert scoring.rouge_l(p, " " + p.reference).value == pytest.approx(1.0)
    assert scoring.rouge_l(p, " bananas " * 5).value < 0.05
    assert scoring.rouge_l(p, "").value == 0.0


@pytest.mark.parametrize("code,reason", [
    ("while True:\n    pass\n", "timeout"),
    ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
     "timeout"),
    ("x = bytearray(8 << 30)\n", "failed"),
    ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\n", "failed"),
    ("import sys\nsys.exit(3)\n", "failed"),
])
def test_hostile_code_scores_zero_and_never_hangs(code, reason):
    start = time.time()
    result = run_python(code, timeout=3)
    assert not result.passed and result.reason == reason
    assert time.time() - start < 15


def test_sandboxed_code_cannot_write_outside_its_folder(tmp_path):
    target = tmp_path / "evil.txt"
    result = run_python(f"open({str(target)!r}, 'w').write('x')\n")
    assert not result.passed and not target.exists()


def test_evaluate_scores_runs_and_compares_a_budgeted_run_with_its_twin(tmp_path, capsys):
    base = ["--model", "tiny-olmoe", "--bench", "mbpp", "--limit", "2", "--max-new-tokens", "16",
            "--no-progress", "--out", str(tmp_path)]
    assert capture_cli.main([*base, "--run", "plain"]) == 0
    assert capture_cli.main([*base, "--run", "b8", "--budget", "8"]) == 0
    assert capture_cli.main([*base, "--run", "b64", "--budget", "64"]) == 0
    from moe_spec.analysis import evaluate_cli
    assert evaluate_cli.main(["--traces", str(tmp_path), "--output",
                              str(tmp_path / "q.json")]) == 0
    summary = json.loads((tmp_path / "q.json").read_text())
    assert summary["plain"]["metric"] == "pass@1" and "twin" not in summary["plain"]
    assert summary["b64"]["twin"] == "plain" and summary["b64"]["exact_match"] == 1.0
    assert summary["b8"]["exact_match"] < 1.0  # a tight budget changes the outputs
    rows = pl.read_parquet(tmp_path / "quality" / "**" / "*.parquet", hive_partitioning=True)
    b64 = rows.filter(pl.col("run") == "b64")
    assert (b64["first_divergence"] == -1).all()


def test_paired_bootstrap_interval_covers_the_difference():
    lo, hi = quality.bootstrap_ci([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0], seed=0)
    assert lo < 0.75 < hi and 0 <= lo and hi <= 1
    assert quality.first_divergence([1, 2, 3], [1, 2, 3]) == -1
    assert quality.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert quality.first_divergence([1, 2], [1, 2, 3]) == 2


def test_frontier_on_synthetic_runs():
    """Fewer experts loaded at the same τ projects a speedup; a lower τ costs it back."""
    import duckdb

    from moe_spec.analysis.frames import frontier_frame
    con = duckdb.connect()
    trees = pl.DataFrame(dict(
        model=["m"] * 6, bench=["b"] * 6, run=["plain", "plain", "b16", "b16", "b8", "b8"],
        budget=[None, None, 16, 16, 8, 8], ranking=[None, None, "router", "router", "router",
                                                    "router"],
        coverage=[None, None] + ["substitution"] * 4,
        accepted_length=[4, 4, 4, 4, 2, 2], experts_loaded=[[40, 40]] * 2 + [[16, 16]] * 2 +
        [[8, 8]] * 2, unique_experts=[[40, 40]] * 6, prefix_len=[100] * 6, nodes=[63] * 6))
    q = pl.DataFrame(dict(model=["m"] * 2, bench=["b"] * 2, run=["b16", "b8"],
                          twin_run=["plain", "plain"], score=[0.5, 0.25],
                          twin_score=[0.5, 0.5], exact_match=[True, False],
                          metric=["pass@1"] * 2))
    con.register("trees_df", trees.to_arrow())
    con.register("quality_df", q.to_arrow())
    con.execute("CREATE VIEW trees AS SELECT * FROM trees_df")
    con.execute("CREATE VIEW quality AS SELECT * FROM quality_df")
    shape = cost.ModelShape(16, 2048, 1024, 64, 8, 16, 16, 128, 50304)
    f = frontier_frame(con, "m", "b", shape, cost.PROFILES["H100-SXM"]).sort("budget")
    assert f["speedup_vs_eagle"][1] > 1.0  # B=16 at the same τ: fewer experts, faster
    assert f["speedup_vs_eagle"][0] < f["speedup_vs_eagle"][1]  # B=8 halves τ
    assert f["quality"].to_list() == [0.25, 0.5] and f["agreement"].to_list() == [0.0, 1.0]
