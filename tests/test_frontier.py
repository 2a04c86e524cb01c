"""The speedup projection for every replayed ranking (issue 59.3): what each ranking's measured
quality buys on a real shape, MoE-Spec's frontier table, and messages that say exactly what is
missing."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_spec.analysis import cost, frames
from moe_spec.analysis.sql import connect

ROOT = Path(__file__).resolve().parents[1]
CAP = ["--model", "tiny-olmoe", "--bench", "mbpp", "--limit", "1", "--max-new-tokens", "8",
       "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """One prompt of tiny-olmoe, no replay; copy before replaying into it."""
    from moe_spec.capture import cli as capture_cli
    root = tmp_path_factory.mktemp("frontier") / "bare"
    from moe_spec.analysis import summaries
    assert capture_cli.main([*CAP, "--out", str(root), "--run", "e"]) == 0
    summaries.ensure(root, workers=1)  # the routing summaries the projection reads
    return root


@pytest.fixture(scope="module")
def others(bare, tmp_path_factory):
    """The capture with oracle and sqmass replayed open loop, router not at all."""
    from moe_spec.replay import cli as replay_cli
    root = tmp_path_factory.mktemp("frontier") / "others"
    shutil.copytree(bare, root)
    assert replay_cli.main(["--traces", str(root), "--ranking", "oracle", "sqmass", "--budget",
                            "8,16,32,48", "--coverage", "substitution", "--no-progress",
                            "--threads", "1"]) == 0
    return root


def test_no_router_replay_is_not_called_no_replay(bare, others):
    con = connect(bare)
    stats = frames.routing_statistics(con, "tiny-olmoe", "mbpp")
    assert stats["missing"] == "no replay at all of this dataset"
    con = connect(others)
    stats = frames.routing_statistics(con, "tiny-olmoe", "mbpp")
    assert stats["missing"] == "no router replay (replayed: oracle, sqmass)"
    frame = frames.speedup_frame(stats, next(iter(frames.real_targets().values())),
                                 [cost.PROFILES["H100-SXM"]])
    top = frames.headline(frame)
    assert top["bound"].startswith("no router replay (replayed: oracle, sqmass)")
    assert "no replay:" not in top["bound"] and "no replay:" not in frames.speedup_note(frame)
    truncated = frames.routing_statistics(con, "tiny-olmoe", "mbpp", ranking="oracle",
                                          coverage="truncation")
    assert truncated["missing"] == ("no oracle replay with truncation coverage (replayed: "
                                    "substitution)")


def test_the_projection_takes_any_replayed_ranking_with_its_own_quality(others):
    con = connect(others)
    target = next(iter(frames.real_targets().values()))
    hw = [cost.PROFILES["H100-SXM"]]
    by = {}
    for ranking in ("oracle", "sqmass"):
        stats = frames.routing_statistics(con, "tiny-olmoe", "mbpp", ranking=ranking)
        assert stats["missing"] is None and stats["quality_source"] == "open-loop replay"
        frame = frames.speedup_frame(stats, target, hw)
        assert set(frame["ranking"]) == {ranking}
        assert (frame["speedup_low"] <= frame["speedup"]).all()
        assert (frame["speedup"] <= frame["speedup_high"]).all()
        by[ranking] = dict(zip(frame["captured_budget"], frame["rse"]))
    want = con.sql("SELECT ranking, budget, avg(rse) AS rse FROM replay_open "
                   "GROUP BY ALL").pl()
    for r in want.iter_rows(named=True):
        assert by[r["ranking"]][r["budget"]] == pytest.approx(r["rse"])


def test_the_frontier_table_has_every_ranking_and_hardware(others):
    con = connect(others)
    target = next(iter(frames.real_targets().values()))
    hardware = list(cost.PROFILES.values())
    table = frames.frontier_table(con, "tiny-olmoe", "mbpp", target, hardware)
    assert set(table["ranking"]) == {"oracle", "sqmass"}
    assert set(table["hardware"]) == {h.name for h in hardware}
    assert (table["gain"] >= 1 - 1e-9).all()  # B = N is always within the bound
    gain = {(r["ranking"], r["hardware"]): r["gain"] for r in table.iter_rows(named=True)}
    for hw in hardware:  # the oracle needs no more experts than sqmass at matched quality
        assert gain[("oracle", hw.name)] >= gain[("sqmass", hw.name)] - 1e-9
    rows = frames.frontier_markdown_rows(table)
    assert all("×" in r["throughput gain over EAGLE"] and "(" in r["throughput gain over EAGLE"]
               for r in rows)  # never a bare number: an interval or why there is none


def test_this_cpu_is_a_measured_roofline_profile():
    cpu = cost.measure_cpu(megabytes=8, size=128, repeats=1)
    assert cpu.name == cost.THIS_CPU and cpu.bandwidth > 0 and cpu.peak_flops > 0


def _render(files, *extra):
    return subprocess.run([sys.executable, "bench/frontier.py", "--render", *map(str, files),
                           *map(str, extra)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_the_frontier_block_is_rendered_from_the_bench_output(others, tmp_path):
    from moe_spec.bench import frontier
    cpu = cost.Hardware(cost.THIS_CPU, 1e10, 1e11)
    found = dict(tool="bench/frontier.py", version=frontier.VERSION, prompts=1,
                 max_new_tokens=8, date="2026-12-04", cpu=dict(bandwidth=1e10, peak_flops=1e11),
                 **frontier.measure(others, "tiny-olmoe", "mbpp", cpu))
    (tmp_path / "f.json").write_text(json.dumps(found))
    page = tmp_path / "results.md"
    page.write_text("x\n<!-- frontier: begin (bench/frontier.py --readme; do not edit) -->\nold\n"
                    "<!-- frontier: end -->\ny\n")
    done = _render([tmp_path / "f.json"], "--readme", page)
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    assert "old" not in text and text.startswith("x\n") and text.endswith("y\n")
    assert "| tiny-olmoe | mbpp | oracle | substitution |" in text
    assert "this CPU (measured)" in text and "matched quality" in text
    wrong = tmp_path / "w.json"
    wrong.write_text(json.dumps({"rows": []}))
    bad = _render([wrong])
    assert bad.returncode != 0 and "not an --output of this version" in bad.stderr
    assert "Traceback" not in bad.stderr
