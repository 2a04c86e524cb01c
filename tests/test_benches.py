"""Smoke runs of every bench on tiny inputs, so the README's and docs/results.md's figures cannot
rot: each script runs end to end through the same code as the full run (one torch thread) and
writes its result file, and each result is checked for what the bench claims. A bench script
(a ``bench/*.py`` with a ``__main__`` block) added without a smoke run here fails
:func:`test_every_bench_script_has_a_smoke_run`."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
# PYTHONPATH: the scripts import the working tree's packages even where the installed
# (editable) package list predates a new one
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
       "TOKENIZERS_PARALLELISM": "false"}
SMOKE_RUNS: set[str] = set()  # bench scripts a test below runs


def smoke(script: str):
    """Mark a test as the smoke run of ``bench/<script>`` (slow: it runs the script)."""
    SMOKE_RUNS.add(script)
    return pytest.mark.slow


def run(*args, timeout=300, tmpdir=None):
    """``python ARGS`` in the repository; ``tmpdir``: the script's TMPDIR (its scratch folders
    go there, for a test to check they are gone)."""
    env = ENV if tmpdir is None else {**ENV, "TMPDIR": str(tmpdir)}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def bench_scripts() -> set[str]:
    """Every runnable bench: the ``bench/*.py`` files with a ``__main__`` block (libraries such as
    synthetic.py and pipeline.py have none)."""
    return {p.name for p in (ROOT / "bench").glob("*.py")
            if 'if __name__ == "__main__":' in p.read_text()}


def test_every_bench_script_has_a_smoke_run():
    scripts = bench_scripts()
    assert {"oracle_bound.py", "cross_domain.py", "startup.py"} <= scripts  # the finder works
    assert scripts - SMOKE_RUNS == set(), "bench scripts without a smoke run in this file"
    assert SMOKE_RUNS - scripts == set(), "smoke runs of scripts that are no longer benches"


def test_no_bench_module_shadows_a_project_package():
    """A bench runs with bench/ first on sys.path: bench/cluster.py once hid the cluster package
    from every bench that imports replay."""
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    shadowing = {p.stem for p in (ROOT / "bench").glob("*.py")} & packages
    assert not shadowing, f"rename bench/{sorted(shadowing)[0]}.py: it shadows a package"


@smoke("oracle_bound.py")
def test_oracle_bound_bench_counts_no_cell_below_the_oracle(tmp_path):
    out = run("bench/oracle_bound.py", "--traces", str(tmp_path), "--models", "tiny-mixtral",
              "--eval-prompts", "1", "--cal-prompts", "2", "--max-new-tokens", "6")
    found = json.loads((tmp_path / "oracle_bound.json").read_text())["tiny-mixtral"]
    assert found["exact"]["cells"] > 0 and found["exact"]["max_abs_diff"] <= 1e-12
    assert sum(r["below"] for r in found["rows"]) == 0 and "total cells below" in out


@smoke("batch_regime.py")
def test_batch_regime_bench_measures_every_batch_size(tmp_path):
    (scratch := tmp_path / "tmp").mkdir()
    out = run("bench/batch_regime.py", "--models", "tiny-olmoe", "--batch-sizes", "1", "2",
              "--prompts", "2", "--cal-prompts", "1", "--new-tokens", "6", "--repeats", "2",
              "--out", str(tmp_path / "b.json"), tmpdir=scratch)
    assert not [p for p in scratch.iterdir() if p.name.startswith("batch-regime-")]  # removed
    rows = json.loads((tmp_path / "b.json").read_text())["tiny-olmoe"]["rows"]
    assert [r["batch_size"] for r in rows] == [1, 2]
    assert all(r["eagle_tokens_per_s"] > 0 and r["unique_experts"] > 0 for r in rows)
    assert rows[1]["unique_experts"] >= rows[0]["unique_experts"]  # a union only grows
    # one shortlist for two trees' tokens errs at least as much as one per tree (same B)
    assert rows[1]["rse"]["router@16"] >= rows[0]["rse"]["router@16"] - 1e-9
    assert all(r["replay_speed_vs_first"] > 0 and r["speedup"] > 0 for r in rows)
    # a smoke run has too few passes for the fit: refused in words, never a NaN fit
    assert "MoESD pass-time fit" in out or "MoESD pass-time model not fitted" in out, out
    assert "nan ms" not in out


@smoke("batch_ceiling.py")
def test_batch_ceiling_bench_sets_the_capture_beside_the_forward(tmp_path):
    (scratch := tmp_path / "tmp").mkdir()
    out = run("bench/batch_ceiling.py", "--batch-sizes", "1", "2", "--prompts", "2",
              "--new-tokens", "6", "--repeats", "1", "--out", str(tmp_path / "c.json"),
              tmpdir=scratch)
    assert not [p for p in scratch.iterdir() if p.name.startswith("batch-ceiling-")]  # removed
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert [r["batch_size"] for r in rows] == [1, 2]
    assert rows[0]["capture_ratio"] == rows[0]["ceiling_ratio"] == 1.0
    # T = 0: both batch sizes decode the same trees, so the tokens counted are the same
    assert rows[0]["capture"]["trees"] == rows[1]["capture"]["trees"] > 0
    assert abs(rows[0]["capture"]["tokens"] - rows[1]["capture"]["tokens"]) < 1e-6
    assert all(r["forward"]["tokens_per_s"] > 0 for r in rows) and "ceiling ratio" in out


def rendered_block(script: str, block: str, report, page: Path) -> str:
    """``page`` (a block typed by hand between ``block``'s markers) after ``bench/<script>
    --render REPORT --readme page``: the block rewritten, the text around it kept."""
    (page.parent / "report.json").write_text(json.dumps(report))
    marks = (f"<!-- {block}: begin (bench/{script} --readme; do not edit) -->",
             f"<!-- {block}: end -->")
    page.write_text(f"intro\n{marks[0]}\n| typed | by hand |\n{marks[1]}\noutro\n")
    run(f"bench/{script}", "--render", str(page.parent / "report.json"), "--readme", str(page))
    text = page.read_text()
    assert "typed" not in text and text.startswith("intro\n") and text.endswith("outro\n")
    return text


BENCHES = ("gsm8k", "mbpp")


@pytest.fixture(scope="module")
def cross_domain(tmp_path_factory):
    """One tiny cross-domain study (two benchmarks, coact): the traces closed_loop.py and
    energy_prior.py reuse, its result file and its output."""
    root = tmp_path_factory.mktemp("xdomain")
    out = run("bench/cross_domain.py", "--traces", str(root / "traces"), "--models",
              "tiny-olmoe", "--benches", *BENCHES, "--rankings", "coact", "--eval-prompts", "1",
              "--cal-prompts", "1", "--max-new-tokens", "4", "--output", str(root / "x.json"))
    return root / "traces", json.loads((root / "x.json").read_text()), out


@smoke("cross_domain.py")
def test_cross_domain_bench_fills_the_matrix(cross_domain):
    _, found, out = cross_domain
    cells = found["tiny-olmoe"]["cells"]
    sources = {c["calibration"] for c in cells if c["ranking"] == "coact"}
    assert sources == {*BENCHES, "all", "others"}  # the diagonal, off it, and mixed sources
    assert {c["bench"] for c in cells} == set(BENCHES)
    oracle_below_router = [c["oracle"] <= c["router"] + 1e-9 for c in cells]
    assert all(oracle_below_router) and all(c["rse"] >= 0 for c in cells)
    assert set(found["tiny-olmoe"]["worst"]) == {"coact"} and "coact" in out
    assert found["tiny-olmoe"]["budgets"] == [8, 16, 24, 32]  # k = 8 of N = 64: k to 32


@smoke("cross_domain.py")
def test_cross_domain_bench_captures_only_when_asked(tmp_path):
    """--capture-only: the evaluation and calibration runs (disjoint prompts, the calibration
    role) and nothing replayed, no table."""
    out = run("bench/cross_domain.py", "--traces", str(tmp_path), "--models", "tiny-mixtral",
              "--benches", "mbpp", "--eval-prompts", "2", "--cal-prompts", "1",
              "--max-new-tokens", "2", "--capture-only", "--threads", "1")
    from moe_spec.catalog import Catalog
    catalog = Catalog(tmp_path / "tiny-mixtral")
    runs = {r.name: r for r in catalog.runs(model="tiny-mixtral")}
    assert set(runs) == {"eval-mbpp", "cal-mbpp"} and "captured under" in out
    assert runs["cal-mbpp"].manifest["role"] == "calibration"
    assert not (tmp_path / "tiny-mixtral" / "results").exists() and "| model |" not in out


@smoke("cross_domain.py")
def test_cross_domain_bench_refuses_a_benchmark_too_short_before_capturing(tmp_path, capsys):
    """CNN/DM holds 80 prompts: 80 evaluation ones leave no calibration run (one line, exit 2,
    nothing captured); 70 leave it 10, not --cal-prompts' 24, and it says so."""
    args = ["bench/cross_domain.py", "--traces", str(tmp_path), "--models", "tiny-mixtral",
            "--benches", "mbpp", "cnndm", "--capture-only", "--threads", "1"]
    done = subprocess.run([sys.executable, *args, "--eval-prompts", "80"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "cnndm holds 80 prompts" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not any(tmp_path.iterdir())
    from moe_spec.bench import cross_domain
    refused = []
    cross_domain.check_prompts(SimpleNamespace(error=refused.append),
                               SimpleNamespace(benches=["cnndm"], eval_prompts=70, cal_prompts=24))
    assert not refused
    assert "calibration run gets the 10 after the 70 evaluation ones, not --cal-prompts 24" in \
        capsys.readouterr().err


@smoke("cross_domain.py")
def test_cross_domain_bench_writes_the_readme_table_from_its_output(cross_domain, tmp_path):
    _, found, _ = cross_domain
    readme = tmp_path / "README.md"
    text = rendered_block("cross_domain.py", "cross-domain matrix", found, readme)
    single, others = text.split("Calibrated on the other benchmarks together")
    rows = [line for line in single.splitlines() if line.startswith("| tiny-olmoe")]
    # two benchmarks: one off-diagonal cell each way × 4 budgets, per policy, for coact
    off = [c for c in found["tiny-olmoe"]["cells"] if c["ranking"] == "coact"
           and c["calibration"] in BENCHES and c["calibration"] != c["bench"]]
    assert len(rows) == len({c["coverage"] for c in off}) == 2
    mixed = [line for line in others.splitlines() if line.startswith("| tiny-olmoe")]
    held_out = [c for c in found["tiny-olmoe"]["cells"] if c["ranking"] == "coact"
                and c["calibration"] == "others" and c["coverage"] == "truncation"]
    assert len(mixed) == 2 and f"| {len(held_out)} |" in mixed[0]  # 2 benchmarks × 4 budgets
    worst = min(held_out, key=lambda c: c["gap_closed"])
    assert f"{100 * worst['gap_closed']:.0f}% ({worst['bench']} ← others, B=" in mixed[0]
    assert "← others" not in single  # each kind of source in its own table
    worst = min(c["gap_closed"] for c in off if c["coverage"] == "truncation")
    assert f"| {100 * worst:.0f}% (" in rows[0] and "| 8 |" in rows[0]
    at_k = sorted(c["gap_closed"] for c in off if c["coverage"] == "truncation"
                  and c["budget"] == 8)  # two cells: the median is their mean
    assert len(at_k) == 2 and rows[0].endswith(f"| {50 * (at_k[0] + at_k[1]):.0f}% |")
    readme.write_text("no markers\n")
    done = subprocess.run([sys.executable, "bench/cross_domain.py", "--render",
                           str(tmp_path / "report.json"), "--readme", str(readme)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True)
    assert done.returncode != 0 and readme.read_text() == "no markers\n"
    assert "no '<!-- cross-domain matrix: begin" in done.stderr


@smoke("closed_loop.py")
def test_closed_loop_bench_bootstraps_every_cell(cross_domain, tmp_path):
    traces = cross_domain[0]
    run("bench/closed_loop.py", "--traces", str(traces), "--models", "tiny-olmoe", "--benches",
        "mbpp", "--rankings", "router", "coact", "--budgets", "8,16", "--online-budgets", "16",
        "--eval-prompts", "1", "--max-new-tokens", "4", "--output", str(tmp_path / "c.json"))
    found = json.loads((tmp_path / "c.json").read_text())
    cells = {(r["ranking"], r["coverage"], r["budget"]) for r in found["closed"]}
    assert cells == {(r, c, b) for r in ("router", "coact") for c in ("truncation",
                                                                       "substitution")
                     for b in (8, 16)}
    for row in found["closed"]:
        mean, low, high = row["accepted_length"]  # the mean and its 95% interval
        assert 1 <= low <= mean <= high and row["captured_accepted_length"] >= 1
        assert all(0 <= row[m][0] <= 1 for m in ("path_unchanged", "top1_agreement"))
        assert row["mean_kl"][0] >= 0
    assert [(r["ranking"], r["budget"], r["prompts"]) for r in found["online"]] == [
        ("router", 16, 1), ("coact", 16, 1)]
    assert all(0 <= r["first_divergence"] <= r["output_tokens"] for r in found["online"])
    closed = {(r["ranking"], r["coverage"], r["budget"]): r for r in found["closed"]}
    for (ranking, coverage, budget), row in closed.items():  # paired Δ: the same trees
        router = closed[("router", coverage, budget)]
        for m in ("accepted_length", "mean_kl"):
            if ranking == "router":
                assert f"{m}_vs_router" not in row
                continue
            mean, low, high = row[f"{m}_vs_router"]
            assert low <= mean <= high
            assert mean == pytest.approx(row[m][0] - router[m][0], abs=1e-9)
        if ranking != "router":  # power: None only without two trees to measure a spread
            assert (row["trees_needed"] is None) == (row["trees"] < 2)
            if row["trees_needed"] is not None:
                assert row["trees_needed"] >= 1 and row["resolvable"] >= 0
    paired = found["paired"]
    assert paired["accepted_length_cells"] == paired["mean_kl_cells"] == 4
    assert paired["mean_kl_better"] + paired["mean_kl_worse"] <= 4
    readme = tmp_path / "README.md"  # the summary table, written between its markers
    readme.write_text("intro\n<!-- closed loop: begin (bench/closed_loop.py --readme; do not "
                      "edit) -->\ntyped by hand\n<!-- closed loop: end -->\noutro\n")
    run("bench/closed_loop.py", "--render", str(tmp_path / "c.json"), "--readme", str(readme))
    text = readme.read_text()
    assert "typed by hand" not in text and text.startswith("intro") and text.endswith("outro\n")
    tables = text.split("Trees needed to resolve")
    assert tables[0].count("| tiny-olmoe | ") == 4 + 2  # 2 policies × 2 budgets; 2 online
    powered = sum(r.get("trees_needed") is not None for r in found["closed"])
    assert len(tables) == (2 if powered else 1)
    assert powered == 0 or tables[1].count("| tiny-olmoe | ") == powered  # one bench: a row each
    for r in found["untranslated"]:  # open-loop better than router, closed loop not
        router = closed[("router", r["coverage"], r["budget"])]
        assert r["rse"] < r["router_rse"] and r["ranking"] != "router"
        assert r["accepted_length"][0] <= router["accepted_length"][0]


@smoke("energy_prior.py")
def test_energy_prior_bench_scores_every_source_and_kappa(cross_domain, tmp_path):
    traces = cross_domain[0]
    run("bench/energy_prior.py", "--traces", str(traces), "--benches", *BENCHES, "--kappa", "0",
        "256", "--output", str(tmp_path / "e.json"))
    rows = json.loads((tmp_path / "e.json").read_text())
    assert {(r["bench"], r["source"], r["kappa"]) for r in rows} == {
        (b, s, k) for b in BENCHES for s in BENCHES for k in (0.0, 256.0)}
    assert all(set(r) >= {"B=8", "B=16", "B=24", "B=32"} for r in rows)


@pytest.fixture(scope="module")
def coact_gap(tmp_path_factory):
    """One tiny coact-gap study: its traces (runs eval and cal, reused by replay_speed.py) and
    its curves."""
    root = tmp_path_factory.mktemp("coact")
    out = run("bench/coact_gap.py", "--traces", str(root / "traces"), "--eval-prompts", "1",
              "--cal-prompts", "1", "--max-new-tokens", "4", "--out", str(root / "g.json"))
    return root / "traces", json.loads((root / "g.json").read_text()), out


@smoke("coact_gap.py")
def test_coact_gap_bench_curves_put_the_oracle_lowest(coact_gap):
    _, curves, out = coact_gap
    rse = {(r["ranking"], r["coverage"], r["budget"]): r["rse"] for r in curves}
    budgets = sorted({b for _, _, b in rse})
    assert len(budgets) > 3 and {r for r, _, _ in rse} == {"static", "router", "oracle", "coact"}
    for coverage in ("truncation", "substitution"):
        for b in budgets:
            assert rse["oracle", coverage, b] <= min(rse[r, coverage, b] for r in (
                "static", "router", "coact")) + 1e-9
    assert "gap closed" in out


@smoke("replay_speed.py")
def test_replay_speed_bench_times_the_sweep_and_the_replay_process(coact_gap, tmp_path):
    traces = coact_gap[0]
    run("bench/replay_speed.py", "--out", str(tmp_path / "s.json"), "sweep", "--traces",
        str(traces), "--run", "eval", "--calibration", "cal", "--threads", "1")
    found = json.loads((tmp_path / "s.json").read_text())["sweep"]
    assert found["model"] == "tiny-olmoe" and found["tree_layers"] > 0
    for key in ("full_sweep", "sweep_without_oracle"):
        assert found[key]["tree_layers"] == found["tree_layers"] and found[key]["seconds"] > 0
    assert found["oracle_24"]["capture_decode_s"] > 0
    assert found["full_sweep"]["capture_decode_s"] == found["oracle_24"]["capture_decode_s"]
    run("bench/replay_speed.py", "--out", str(tmp_path / "c.json"), "closed", "--traces",
        str(traces), "--run", "eval", "--budgets", "8", "--threads", "1")
    found = json.loads((tmp_path / "c.json").read_text())["closed"]
    assert found["cells"] == 2 and found["trees"] > 0
    assert found["seconds"] > 0 and found["captured_verify_s"] > 0
    run("bench/replay_speed.py", "--out", str(tmp_path / "r.json"), "rss", "--trees", "4")
    found = json.loads((tmp_path / "r.json").read_text())["rss"]["4"]
    assert found["tree_layers"] == 32 and found["peak_rss_gib"] > 0 and found["replay_s"] > 0


@smoke("capture_overhead.py")
def test_capture_overhead_bench_measures_bytes_and_time(tmp_path):
    out = run("bench/capture_overhead.py", "--prompts", "1", "--max-new-tokens", "4", "--out",
              str(tmp_path / "o.json"))
    found = json.loads((tmp_path / "o.json").read_text())["tiny-olmoe"]
    assert found["trees"] >= 1 and found["traced_s"] > 0 and found["untraced_s"] > 0
    per_layer = found["bytes_per_tree_layer"]
    assert 0 < per_layer["bf16"] < per_layer["fp32"]  # fp32 and stored outputs take more
    assert "traced / untraced wall time" in out


@smoke("eagle_vs_ar.py")
def test_eagle_vs_ar_bench_compares_both_decoders(tmp_path):
    run("bench/eagle_vs_ar.py", "--model", "tiny-olmoe", "--bench", "mbpp", "--prompts", "1",
        "--max-new-tokens", "4", "--out", str(tmp_path / "e.json"))
    (row,) = json.loads((tmp_path / "e.json").read_text())
    assert (row["model"], row["bench"], row["prompts"]) == ("tiny-olmoe", "mbpp", 1)
    assert row["tau"] >= 1 and row["speed_ratio"] > 0
    assert row["unique_ar"] <= row["unique_verify"] <= row["experts"]  # a tree loads more


@smoke("scale_out.py")
@pytest.mark.ray
def test_scale_out_bench_gets_the_same_tables_from_two_workers(tmp_path):
    pytest.importorskip("ray")
    run("bench/scale_out.py", "--prompts", "2", "--max-new-tokens", "4", "--out",
        str(tmp_path / "s.json"))
    found = json.loads((tmp_path / "s.json").read_text())
    assert found["capture"]["tables_identical"] is True
    assert set(found["capture"]["prompts_per_s"]) == {"1", "2"}
    rows = found["replay"]["rows"]
    assert rows[0] == rows[1] > 0 and found["replay"]["max_difference"] == 0


@smoke("startup.py")
def test_startup_bench_gets_every_expected_exit_status(tmp_path):
    """Behaviour only: every case's exit status and one-line error, and the result file's
    shape. Its timings (and whether they meet the goal) depend on the machine's load, so they
    are never asserted, and the only time bound is one against a hang (its ~20 fresh processes
    each import torch or polars: minutes on a loaded machine)."""
    run("bench/startup.py", "--repeats", "1", "--output", str(tmp_path / "s.json"),
        timeout=3600)
    found = json.loads((tmp_path / "s.json").read_text())
    assert len(found["cases"]) >= 10
    assert all(c["ok"] for c in found["cases"]), [c for c in found["cases"] if not c["ok"]]
    assert all(isinstance(c["within_goal"], bool) and c["seconds"] >= 0 for c in found["cases"])
    assert {"torch", "polars"} <= set(found["imports"]) and found["goal"] == 1.5


@smoke("full_size.py")
def test_full_size_bench_runs_the_user_commands_at_small_width(tmp_path):
    run("bench/full_size.py", "--small", "--prompts", "1", "--max-new-tokens", "4", "--threads",
        "1", "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "f.json"), timeout=600)
    found = json.loads((tmp_path / "f.json").read_text())
    assert found["capture"]["trees"] >= 1 and found["capture"]["bytes_per_tree"] > 0
    assert found["replay"]["tree_layers"] == found["capture"]["trees"] * int(
        found["checkpoint"]["config"]["num_hidden_layers"])
    assert "overview" in found["app"]["pages"] and found["app"]["peak_rss_gib"] > 0


@smoke("analysis_scale.py")
def test_analysis_scale_bench_times_every_page(tmp_path):
    out = run("bench/analysis_scale.py", "--prompts", "2", "--steps", "4", "--keep",
              str(tmp_path / "traces"), "--out", str(tmp_path / "scale.json"), timeout=600)
    assert "summaries:" in out and "tree-layers/s" in out and "one routing part" in out
    assert "every dashboard page" in out and "slowest page" in out
    assert (tmp_path / "traces").is_dir()
    numbers = json.loads((tmp_path / "scale.json").read_text())
    built = numbers["summaries"]
    assert built["tree_layers"] == 2 * 4 * 16 and built["tree_layers_per_s"] > 0
    assert built["one_part"]["tree_layers"] == 4 * 16 and built["one_part"]["cpu_seconds"] > 0
    assert set(numbers["analyses"]["timings"]) >= {"tails", "coverage", "growth", "balance"}
    pages = numbers["pages"]
    assert "Runs overview" in pages["timings"] and len(pages["timings"]) > 1
    assert all(secs > 0 for secs in pages["timings"].values())
    assert 0 < pages["peak_rss_gib"] < 64 and 0 < numbers["analyses"]["peak_rss_gib"] < 64


@smoke("object_store.py")
def test_object_store_bench_measures_both_sides_and_compares_the_tables(tmp_path):
    out = run("bench/object_store.py", "--prompts", "1", "--max-new-tokens", "4", "--repeats",
              "1", "--budgets", "8,16", "--out", str(tmp_path / "o.json"))
    found = json.loads((tmp_path / "o.json").read_text())
    assert found["capture_ratio"] > 0 and found["replay_ratio"] > 0 and found["goal"] == 0.8
    assert found["local"]["tree_layers"] == found["s3"]["tree_layers"] > 0
    assert set(found["identical"]) >= {"routing", "moe_io", "trees", "replay_open"}
    assert all(found["identical"].values()) and "s3 / local" in out


@smoke("multi_node.py")
@pytest.mark.ray
def test_cluster_bench_gets_the_single_process_tables_on_two_nodes(tmp_path):
    pytest.importorskip("ray")
    pytest.importorskip("moto.server")
    out = run("bench/multi_node.py", "--prompts", "2", "--max-new-tokens", "4", "--budgets", "8,16",
              "--out", str(tmp_path / "c.json"))
    found = json.loads((tmp_path / "c.json").read_text())
    assert found["capture"]["identical"] is True and found["replay"]["identical"] is True
    assert found["nodes"] == {"capture": 2, "replay": 2}
    assert found["replay"]["two_nodes"]["count"] == found["replay"]["one_process"]["count"] > 0
    assert found["cluster_start_seconds"] > 0 and "identical: yes" in out


FROZEN_STREAM = """
import json
from moe_spec.bench import sketch_gap as sg
from moe_spec.bench.pipeline import loaded_model
from moe_spec.catalog import Catalog, reader
from moe_spec.policy import coverage
from moe_spec.policy.surrogate import InputMoments, Surrogate
_, adapter = loaded_model("tiny-mixtral")
catalog = Catalog("{root}")
cal = catalog.runs(model="tiny-mixtral", names=["cal-mbpp"])
fit = Surrogate.fit(InputMoments.collect(reader.tree_layers(cal), adapter), 2)
class Frozen:
    def refresh(self):
        return fit
    def observe(self, *args):
        pass
stream = list(sg.passes(catalog.runs(model="tiny-mixtral", names=["eval-mbpp"])[0], adapter))
count = sum(batch.size for _, batch in stream)
out = dict()
for name in ("substitution", "truncation"):
    cov = coverage.get(name)
    budgets = [b for b in (2, 4) if b >= cov.min_budget(adapter.top_k)]
    out[name] = dict(zip(map(str, budgets), (sg.online_rse(stream, Frozen, cov, budgets)
                                             / count).tolist()))
print(json.dumps(out))
"""

REPLAYED = """
import json
import polars as pl
from moe_spec.bench.pipeline import replay_runs
root = "{root}"
out = dict()
for label, rankings, cal in (("base", ("router", "oracle"), ()),
                             ("cal", ("coact-prior", "sketch-gated"), ("cal-mbpp",))):
    replay_runs(root, "tiny-mixtral", ["eval-mbpp"], rankings=rankings, bench="mbpp",
                coverages=("substitution", "truncation"), budgets="2,4", calibration=cal,
                out=root + "/replayed-" + label)
    df = pl.read_parquet(root + "/replayed-" + label + "/replay_open/**/*.parquet",
                         hive_partitioning=True)
    for r in df.group_by("ranking", "coverage", "budget").agg(pl.col("rse").mean()).to_dicts():
        out["|".join(map(str, (r["ranking"], r["coverage"], r["budget"])))] = r["rse"]
print(json.dumps(out))
"""


@smoke("sketch_gap.py")
def test_sketch_bench_scores_every_cell_and_reports_its_cost(tmp_path):
    """tiny-mixtral (N = 8): the oracle is exhaustive there, so no ranking closes more than the
    whole gap; the surrogate's cost is in the output."""
    out = run("bench/sketch_gap.py", "--traces", str(tmp_path), "--model", "tiny-mixtral",
              "--benches", "mbpp", "--ranks", "2", "--budgets", "2,4", "--eval-prompts", "1",
              "--cal-prompts", "1", "--max-new-tokens", "4", "--threads", "1", "--online", "64",
              "--online-step", "0.5", "--posterior", "2", "4",
              "--output", str(tmp_path / "s.json"), timeout=600)
    found = json.loads((tmp_path / "s.json").read_text())
    names = {c["ranking"] for c in found["cells"]}
    assert names == {"coact-prior", "sketch-r2", "sketch-online-r2", "sketch-nlms-r2",
                     "sketch-post2-r2", "sketch-post4-r2"}
    post = [found["cost"][f"sketch-post{w}-r2"]["real"]["bytes_per_layer"] for w in (2, 4)]
    assert found["cost"]["sketch-r2"]["real"]["bytes_per_layer"] < post[0] < post[1]
    online = found["cost"]["sketch-online-r2"]["real"]["expert_equivalents"]
    assert online > found["cost"]["sketch-r2"]["real"]["expert_equivalents"] and \
        found["online_kappa"] == 64
    assert {c["coverage"] for c in found["cells"]} == {"substitution", "truncation"}
    for c in found["cells"]:
        assert c["gap_closed"] != c["gap_closed"] or c["gap_closed"] <= 1 + 1e-6, c
    cost = found["cost"]["sketch-r2"]
    assert cost["tiny"]["bytes_per_layer"] == 8 * (2 * 128 + 2 * 129 + 1) * 4  # float32
    assert cost["real"]["expert_equivalents"] > 0 and cost["real"]["flops_per_token"] > 0
    assert "net tiny" in out and "gap closed" in out
    run("bench/sketch_gap.py", "--traces", str(tmp_path), "--model", "tiny-mixtral", "--benches",
        "mbpp", "--ranks", "2", "8", "--eval-prompts", "1", "--cal-prompts", "1",
        "--max-new-tokens", "4", "--threads", "1", "--surrogate-error", "--output",
        str(tmp_path / "e.json"))
    # comparability: the pass-by-pass stream the online variants are scored on, with a surrogate
    # that never learns, gives exactly what sketch scored on the batches (same tree-layers)
    frozen = json.loads(run("-c", FROZEN_STREAM.format(root=str(tmp_path / "tiny-mixtral"))))
    for c in found["cells"]:
        if c["ranking"] == "sketch-r2":
            assert frozen[c["coverage"]][str(c["budget"])] == pytest.approx(c["rse"], rel=1e-9)
    # router, oracle and coact-prior are scored as replay scores them: coact-prior streamed pass
    # by pass (two prompts, batches of 5 tree-layers that split passes) and refined from what each
    # budgeted pass executed. At 16 new tokens that refinement changes its error: its prior
    # alone, what the bench scored before, fails this comparison (checked when written)
    streamed = tmp_path / "streamed"
    run("bench/sketch_gap.py", "--traces", str(streamed), "--model", "tiny-mixtral", "--benches",
        "mbpp", "--ranks", "4", "--budgets", "2,4", "--eval-prompts", "2", "--cal-prompts", "1",
        "--max-new-tokens", "16", "--max-batch", "5", "--threads", "1", "--gated",
        "--output", str(streamed / "s.json"))
    long = json.loads((streamed / "s.json").read_text())
    replayed = json.loads(run("-c", REPLAYED.format(root=str(streamed / "tiny-mixtral"))))
    # (sketch-gated likewise: its coact-prior state streamed, sketch at replay's rank 4)
    compared = [c for c in long["cells"] if c["ranking"] in ("coact-prior", "sketch-gated-r4")]
    assert len(compared) == 8 and long["stateful"] == "streamed"
    for c in compared:
        name = c["ranking"].removesuffix("-r4")
        assert replayed[f"{name}|{c['coverage']}|{c['budget']}"] == pytest.approx(
            c["rse"], rel=1e-6), c
        router, oracle = (replayed[f"{r}|{c['coverage']}|{c['budget']}"] for r in
                          ("router", "oracle"))  # the gap closed's two ends, replayed
        assert c["gap_closed"] == pytest.approx((router - c["rse"]) / (router - oracle),
                                                rel=1e-6, abs=1e-9), c
    # the gate's record: every scored tree-layer once per calibration, and its share says which
    # ranking sketch-gated's cells are where it is all or nothing
    gate = long["gate"]["pairs"]["mbpp|mbpp"]
    assert gate["tree_layers"] == long["tree_layers"]["mbpp"] and 0 <= gate["gated_in"] <= 1
    assert gate["median_novelty"] > 0 and long["gate"]["threshold"] == 3
    if gate["gated_in"] in (0, 1):
        same = "sketch-r4" if gate["gated_in"] == 1 else "coact-prior"
        rse = {(c["ranking"], c["coverage"], c["budget"]): c["rse"] for c in long["cells"]}
        for (name, cov, b), value in rse.items():
            if name == "sketch-gated-r4":
                assert value == pytest.approx(rse[(same, cov, b)], rel=1e-9), (cov, b)
    gated = run("bench/sketch_gap.py", "--render", str(streamed / "s.json"))
    assert f"| tiny-mixtral | mbpp | mbpp | {gate['median_novelty']:.2f} |" in gated, gated
    assert "input gate" not in run("bench/sketch_gap.py", "--render", str(tmp_path / "s.json"))
    errors = json.loads((tmp_path / "e.json").read_text())["surrogate_error"]
    assert [e["rank"] for e in errors] == [2, 8] and all(0 < e["every"] for e in errors)
    assert all(e["own_top_k"] > 0 and e["kind"] == "diagonal" for e in errors)
    # the input gate's view of the same cell: the median novelty at each p (the full covariance
    # D last, one per cell whatever the rank) and its per-token rank correlation with the error
    assert list(errors[0]["novelty"]) == ["8", "16", "32", "D"]
    assert errors[0]["novelty"] == errors[1]["novelty"]
    assert all(v > 0 for v in errors[0]["novelty"].values())
    assert all(-1 <= e["spearman"] <= 1 for e in errors)
    readme = tmp_path / "results.md"  # the tables, written between their markers from the JSON
    readme.write_text("intro\n<!-- sketch: begin (bench/sketch_gap.py --readme; do not edit) -->"
                      "\ntyped by hand\n<!-- sketch: end -->\noutro\n")
    run("bench/sketch_gap.py", "--render", str(tmp_path / "s.json"), "--readme", str(readme))
    text = readme.read_text()
    assert "typed by hand" not in text and text.endswith("outro\n")
    assert "of 1 evaluation prompts a benchmark" in text
    assert "| coact-prior |" in text and "coact-prior†" not in text and "prior alone" not in text
    old = dict(found)  # an output written before the bench streamed coact-prior: marked so
    del old["stateful"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    marked = run("bench/sketch_gap.py", "--render", str(tmp_path / "old.json"))
    assert "| coact-prior† |" in marked and "| coact-prior |" not in marked
    assert "† coact-prior scored from its calibration prior alone" in marked
    saved = found["experts_saved"]
    rows = [line for line in text.splitlines() if line.startswith("| tiny-mixtral (")]
    assert rows and len(rows) == sum(v["saved"] is not None for k, v in saved.items()
                                     if "oracle" not in k)
    for row in rows:  # net = saved − the real shape's charge
        cells = [c.strip() for c in row.strip("|").split("|")]
        cov, name, got, charge, net = cells[3], cells[4], *map(float, cells[5:8])
        assert got == pytest.approx(saved[f"{cov}|{name}"]["saved"], abs=0.005)
        oracle = float(cells[8])  # the oracle's saving over the same cells and budgets
        assert oracle == pytest.approx(saved[f"{cov}|{name}"]["oracle"], abs=0.005)
        expected = found["cost"].get(name, {}).get("real", {}).get("expert_equivalents", 0.0)
        assert charge == pytest.approx(expected, abs=0.005) and net == pytest.approx(
            got - charge, abs=0.011)


@smoke("query_verify.py")
def test_query_verify_bench_times_committed_reads(tmp_path):
    out = run("bench/query_verify.py", "--prompts", "2", "--steps", "3", "--repeats", "1",
              "--out", str(tmp_path / "v.json"))
    found = json.loads((tmp_path / "v.json").read_text())
    assert found["tree_layers"] == 2 * 3 * 16 and found["parts"] > 0
    for cell in found["queries"].values():
        assert cell["warm_s"] > 0 and cell["as_found_s"] > 0 and cell["cold_s"] > 0
    assert "warm / as found" in out


@smoke("import_routing.py")
def test_import_routing_bench_imports_a_synthetic_sglang_source(tmp_path):
    """A few MiB of SGLang responses at Qwen3-30B-A3B's shape through import-routing (its own
    process): every token-layer imported, throughput and peak RSS measured."""
    out = run("bench/import_routing.py", "--mb", "3", "--out", str(tmp_path / "w"),
              "--result", str(tmp_path / "r.json"))
    found = json.loads((tmp_path / "r.json").read_text())
    assert (found["layers"], found["num_experts"], found["top_k"]) == (48, 128, 8)
    assert found["token_layers"] > 0 and found["responses"] > 0
    assert found["token_layers_per_s"] > 0 and found["token_layers_per_cpu_s"] > 0
    assert 0 < found["peak_rss_mib"] < 1024  # the goal: ≤ 1 GiB at any source size
    assert "token-layers/s" in out and not (tmp_path / "w" / "sglang.jsonl").exists()


@pytest.mark.slow  # a bench process per page block
@pytest.mark.parametrize("script, files, block, page", [
    ("sketch_gap.py", "docs/results/sketch/*.json", None, "docs/results.md"),
    ("closed_loop.py", "docs/results/sketch-closed/*.json", "sketch closed loop", "docs/results.md"),
    ("closed_loop.py", "docs/results/sketch-closed-203/*.json", "sketch closed loop, 4x trees",
     "docs/results.md"),
    ("closed_loop.py", "docs/results/sketch-closed-406/*.json", "sketch closed loop, 8x trees",
     "docs/results.md"),
    ("closed_loop.py", "docs/results/sketch-closed-bk/*.json", "sketch closed loop, B = k to size",
     "docs/results.md"),
    ("cross_domain.py", "docs/results/matrix/*.json", "sketch matrix", "docs/results.md"),
    ("cross_domain.py", "docs/results/matrix/*.json", "sketch matrix", "README.md"),
    ("sketch_gap.py", "docs/results/sketch-gated/*.json", "sketch gated", "docs/results.md"),
    ("frontier.py", "docs/results/frontier/*.json", None, "docs/results.md"),
    ("adaptive_budget.py", "docs/results/adaptive/*.json", "adaptive budgets", "docs/results.md"),
    ("adaptive_closed.py", "docs/results/adaptive-closed/*.json", "adaptive closed loop",
     "docs/results.md"),
])
def test_committed_results_render_to_what_the_docs_show(script, files, block, page, tmp_path):
    """docs/results.md's generated blocks, and the README's table, are what their bench
    renders from the committed JSON files (the command the docs name): a file edited, added or
    removed without re-rendering, or a block typed by hand, fails here."""
    found = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(files))
    assert found, files
    doc = (ROOT / page).read_text()
    copy = tmp_path / "page.md"
    copy.write_text(doc)
    run(f"bench/{script}", "--render", *found, "--readme", str(copy),
        *(["--block", block] if block else []))
    assert copy.read_text() == doc


@pytest.mark.slow  # a bench process
def test_sketch_render_refuses_another_bench_s_output():
    done = subprocess.run([sys.executable, "bench/sketch_gap.py", "--render",
                           "docs/results/sketch-closed/tiny-olmoe.json"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "not an --output of this version" in done.stderr
    assert "Traceback" not in done.stderr


@smoke("frontier.py")
def test_frontier_bench_gives_every_ranking_a_row_per_hardware(tmp_path):
    """The frontier at its smallest: one prompt, router and oracle open loop, router closed loop
    at one budget; every (ranking, coverage) replayed has a row on every hardware profile."""
    out = tmp_path / "f.json"
    run("bench/frontier.py", "--traces", str(tmp_path / "t"), "--prompts", "1",
        "--max-new-tokens", "4", "--rankings", "router", "oracle", "--closed-rankings", "router",
        "--closed-budgets", "8", "--threads", "1", "--output", str(out))
    found = json.loads(out.read_text())
    assert found["tool"] == "bench/frontier.py" and found["trees"] > 0
    rows = {(r["ranking"], r["coverage"], r["hardware"]) for r in found["rows"]}
    assert {r for r, _, _ in rows} == {"router", "oracle"}
    hardware = {h for _, _, h in rows}
    assert len(hardware) >= 4 and len(rows) == len({(r, c) for r, c, _ in rows}) * len(hardware)


@pytest.fixture(scope="module")
def adaptive_budget(tmp_path_factory):
    """One tiny adaptive-budget study (tiny-mixtral: N = 8, so B̄ reaches N): its result file."""
    root = tmp_path_factory.mktemp("adaptive")
    out = run("bench/adaptive_budget.py", "--traces", str(root / "traces"), "--models",
              "tiny-mixtral", "--eval-prompts", "1", "--cal-prompts", "1", "--max-new-tokens",
              "4", "--threads", "1", "--output", str(root / "a.json"))
    return json.loads((root / "a.json").read_text()), out


@smoke("adaptive_budget.py")
def test_adaptive_budget_bench_bounds_every_cell_and_measures_the_achieved_mean(adaptive_budget):
    found, out = adaptive_budget
    model = found["models"]["tiny-mixtral"]
    cells = model["cells"]
    assert model["k"] == 2 and model["n"] == model["b_max"] == 8 and model["means"] == [2, 4, 6, 8]
    assert {(c["coverage"], c["predictor"]) for c in cells} == {
        (cov, p) for cov in ("truncation", "substitution") for p in ("mass", "calibrated")}
    for c in cells:
        # the exact adaptive oracle is a bound of every allocation at the same pass total
        assert c["oracle_adaptive"] <= min(c["oracle_fixed"], c["hindsight"]) + 1e-12
        assert c["oracle_adaptive"] <= c["oracle_adaptive_greedy"] + 1e-12
        assert c["hindsight"] <= c["fixed"] + 1e-12 and c["oracle_fixed"] <= c["fixed"] + 1e-9
        assert c["b_min"] <= c["p10"] <= c["achieved"] <= c["p90"] <= 8
    full = [c for c in cells if c["mean_budget"] == 8]  # B̄ = N: every expert, no error
    assert full and all(c["achieved"] == 8 and c["adaptive"] == c["fixed"] < 1e-9 for c in full)
    # substitution needs B ≥ k: at a pass total of k·L hindsight has nothing to adapt
    at_k = [c for c in cells if c["coverage"] == "substitution" and c["mean_budget"] == 2]
    assert at_k and all(c["hindsight"] == pytest.approx(c["fixed"], rel=1e-12) and
                        c["oracle_adaptive"] == pytest.approx(c["oracle_fixed"], rel=1e-12)
                        for c in at_k)
    assert "adaptive below fixed in" in out and "| tiny-mixtral | truncation |" in out
    # matched error: router's own fixed curve needs exactly router's experts (no saving)
    savings = model["savings"]
    assert {s["target_budget"] for s in savings} == {2, 4, 6, 8}
    assert all(s["fixed"] == pytest.approx(0, abs=1e-12) for s in savings)
    assert all(s["fixed_worth"]["checkpoint"] == "mistralai/Mixtral-8x7B-Instruct-v0.1"
               for s in savings)


@smoke("adaptive_budget.py")
@smoke("adaptive_closed.py")
@pytest.mark.parametrize("script, block, study, other", [
    ("adaptive_budget.py", "adaptive budgets", "adaptive_budget", {"tiny-mixtral": {}}),
    # another bench's file of the same version
    ("adaptive_closed.py", "adaptive closed loop", "adaptive_closed", {"version": 1,
                                                                       "models": {}}),
])
def test_adaptive_benches_render_their_block_and_refuse_other_files(script, block, study, other,
                                                                    request, tmp_path):
    found, out = request.getfixturevalue(study)
    text = rendered_block(script, block, found, tmp_path / "r.md")
    rows = [line for line in text.splitlines() if line.startswith("| tiny-mixtral |")]
    saved = [line for line in rows if "| B = " in line]  # matched error: B = k and the top
    rows = [line for line in rows if line not in saved]
    assert len(rows) == sum(len(m["cells"]) for m in found["models"].values()) and rows[0] in out
    if script == "adaptive_budget.py":
        assert len(saved) == 4 and "| truncation | B = 2 (" in saved[0]
    (tmp_path / "b.json").write_text(json.dumps(other))
    done = subprocess.run([sys.executable, f"bench/{script}", "--render",
                           str(tmp_path / "b.json")], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "not an --output of this version" in done.stderr
    assert "Traceback" not in done.stderr


def test_adaptive_budget_measures_the_achieved_mean_on_held_out_passes():
    """The price is calibrated to B̄ on the calibration passes; on evaluation passes whose
    router excludes more mass per expert the same price loads more, and the cell reports what it
    loaded there, not B̄."""
    import torch

    from moe_spec.bench import adaptive_budget
    from moe_spec.policy import adaptive
    g = torch.Generator().manual_seed(0)
    width, b_min = 9, 1

    def run_curves(scale):
        mass = torch.rand(6, 4, width, generator=g, dtype=torch.float64).sort(
            -1, descending=True).values * scale
        mass[..., -1] = 0
        loaded = torch.arange(b_min, b_min + width, dtype=torch.float64).expand_as(mass)
        return (dict(rse=mass * 0.5, mass_excluded=mass, experts_loaded=loaded), torch.arange(4),
                torch.tensor([0, 0, 0, 1, 1, 1]))

    cal = {"router": run_curves(1.0)}
    ev = {"router": run_curves(3.0)}
    cal["oracle"], ev["oracle"] = cal["router"], ev["router"]
    cell = adaptive_budget.evaluate(cal, ev, "router", [4], b_min, "mass", None)[0]
    gains = adaptive.gains_of(ev["router"][0]["mass_excluded"])
    loaded = adaptive.price_budgets(gains, cell["price"], b_min).double()
    assert cell["achieved"] == pytest.approx(float(loaded.mean()))
    assert abs(cell["calibration_mean"] - 4) < abs(cell["achieved"] - 4)
    assert not adaptive_budget.within(cell)
    # paced by each prompt's deficit, the same price holds the held-out mean near B̄; at a
    # vanishing pace it is the unpaced rule
    paced = adaptive_budget.evaluate(cal, ev, "router", [4], b_min, "mass", None, 0.5)[0]
    assert paced["pace"] == 0.5 and paced["price"] == cell["price"]
    assert abs(paced["achieved"] - 4) < abs(cell["achieved"] - 4)
    tiny = adaptive_budget.evaluate(cal, ev, "router", [4], b_min, "mass", None, 1e-12)[0]
    assert tiny["achieved"] == cell["achieved"] and tiny["adaptive"] == cell["adaptive"]


def test_adaptive_budget_reads_complete_curves_and_refuses_a_hole():
    """Replay rows become ``[passes, layers, budgets]`` in (prompt, step, layer, budget) order;
    a missing row (a layer or budget not replayed) is refused, never misaligned."""
    import polars as pl
    import torch

    from moe_spec.bench import adaptive_budget
    rows = [dict(run="r", ranking="router", coverage="truncation", prompt_index=p, step=s,
                 layer=layer, budget=b, rse=1.0 / b + layer + 10 * s + 100 * p,
                 mass_excluded=0.5 / b, predicted_rse=None if layer else 0.25 / b)
            for p in (1, 0) for s in (0, 1) for layer in (1, 0) for b in (3, 1, 2)]
    df = pl.DataFrame(rows)
    found, layers, prompts = adaptive_budget.curves(df, "r", "router", "truncation", 1, 3)
    assert prompts.tolist() == [0, 0, 1, 1]
    rse, mass = found["rse"], found["mass_excluded"]
    assert rse.shape == (4, 2, 3) and layers.tolist() == [0, 1]
    assert rse[3, 1].tolist() == pytest.approx([1 / b + 1 + 10 + 100 for b in (1, 2, 3)])
    assert mass[0, 0].tolist() == pytest.approx([0.5, 0.25, 0.5 / 3])
    # a null (no surrogate ran) reads as NaN, for the predictor's fallback to see
    assert found["predicted_rse"][0, 0].tolist() == pytest.approx([0.25, 0.125, 0.25 / 3])
    assert torch.isnan(found["predicted_rse"][:, 1]).all()
    with pytest.raises(SystemExit, match="replay them again"):
        adaptive_budget.curves(df.slice(1), "r", "router", "truncation", 1, 3)


@pytest.fixture(scope="module")
def adaptive_closed(tmp_path_factory):
    """One tiny closed-loop comparison of adaptive and fixed budgets (tiny-mixtral: k = 2 of
    N = 8), at B̄ = k and B̄ = N: its result file and printout."""
    root = tmp_path_factory.mktemp("adaptive-closed")
    out = run("bench/adaptive_closed.py", "--traces", str(root / "traces"), "--models",
              "tiny-mixtral", "--eval-prompts", "2", "--cal-prompts", "1", "--max-new-tokens",
              "6", "--means", "k", "8", "--same-spend", "--threads", "1", "--output",
              str(root / "c.json"))
    return json.loads((root / "c.json").read_text()), out


@smoke("adaptive_closed.py")
def test_adaptive_closed_bench_pairs_every_cell_and_sizes_it(adaptive_closed):
    found, out = adaptive_closed
    model = found["models"]["tiny-mixtral@2+1"]
    cells = model["cells"]
    assert model["k"] == 2 and model["means"] == [2, 8] and model["budget_mode"] == "adaptive:mass"
    assert {(c["coverage"], c["mean_budget"]) for c in cells} == {
        (cov, b) for cov in ("truncation", "substitution") for b in (2, 8)}
    for c in cells:
        assert c["trees"] >= 2 and c["achieved_fixed"] <= c["mean_budget"]
        mean, lo, hi = c["delta_tau"]
        assert lo <= mean <= hi and mean == pytest.approx(c["tau_adaptive"] - c["tau_fixed"])
        assert c["b_min"] <= c["p10"] <= c["p90"] <= 8 and c["b_min"] <= c["achieved"] <= 8
        assert c["trees_needed"] >= 1 and c["price"] is not None
        spend = c["same_spend"]  # fixed budgets around adaptive's own load, on the same trees
        low, high = spend["budgets"]
        assert low <= c["achieved"] and spend["loaded"][0] <= c["achieved"] <= spend["loaded"][1]
        assert 0 <= spend["weight"] <= 1 and high > low
    # B̄ = N: every expert offered in both settings (loaded: those a token routes to), no error
    full = [c for c in cells if c["mean_budget"] == 8]
    assert full and all(c["achieved"] == c["achieved_fixed"] and c["delta_tau"] == [0, 0, 0]
                        and abs(c["kl_fixed"]) < 1e-6 and c["trees_unchanged"] == c["trees"]
                        and adaptive_closed_bench().verdict(c) == "met" for c in full)
    assert "goal (Δτ interval excludes a loss" in out
    assert "| tiny-mixtral | router · adaptive:mass | truncation | 2 |" in out


def adaptive_closed_bench():
    from moe_spec.bench import adaptive_closed
    return adaptive_closed


def closed_rows(trees, tau, loaded, mode="fixed", price=None):
    """Closed-loop rows of one setting: one per (prompt, step) tree."""
    import polars as pl
    return pl.DataFrame([dict(prompt_index=p, step=s, accepted_length=t, mean_kl=0.1 * t,
                              experts_loaded=list(e), price=price, budget_mode=mode,
                              coverage="truncation", budget=4)
                         for (p, s), t, e in zip(trees, tau, loaded)])


def test_adaptive_closed_at_its_own_spend_against_the_fixed_mix_that_loads_as_much():
    """Adaptive loading a = 4.25 experts against fixed B = 4 and 5 (loading 4 and 5): the
    reference is the mix at B = 5 with w = 0.25, per tree (1 − w)·τ₄ + w·τ₅; counted by hand."""
    bench = adaptive_closed_bench()
    from moe_spec.analysis import power
    trees = [(0, 0), (0, 1), (1, 0), (1, 1)]
    low = closed_rows(trees, [3, 2, 5, 1], [(4, 4)] * 4)
    high = closed_rows(trees, [4, 2, 5, 5], [(5, 5)] * 4).with_columns(budget=pl_lit(5))
    adaptive = closed_rows(trees[::-1], [2, 6, 2, 3], [(4, 5), (4, 4), (4, 4), (5, 4)],
                           "adaptive:mass", 0.5)
    found = bench.same_spend(adaptive, low, high)
    assert found["budgets"] == [4, 5] and found["weight"] == pytest.approx(0.25)
    mix = [0.75 * a + 0.25 * b for a, b in zip([3, 2, 5, 1], [4, 2, 5, 5])]
    deltas = [t - m for t, m in zip([3, 2, 6, 2], mix)]  # adaptive's τ, trees in order
    assert found["delta_tau"] == pytest.approx(power.paired_interval(deltas))
    assert found["tau_fixed"] == pytest.approx(sum(mix) / 4)
    assert found["delta_tau_by_prompt"] == pytest.approx(
        power.paired_interval([(deltas[0] + deltas[1]) / 2, (deltas[2] + deltas[3]) / 2]))
    # a load outside the two fixed ones is refused, not extrapolated
    with pytest.raises(SystemExit):
        bench.same_spend(adaptive, high, high)
    # the budgets: ⌊a⌋ and the first above whose load reaches a (truncation loads ≤ B)
    loads = {6: 5.9, 7: 6.0, 8: 6.5}
    assert bench.spend_budgets(6.2, loads.__getitem__) == (6, 8)
    assert bench.spend_budgets(4.0, {5: 5.0}.__getitem__) == (4, 5)


def pl_lit(value):
    import polars as pl
    return pl.lit(value)


def test_adaptive_closed_pairs_by_tree_not_by_row_order(capsys):
    """Δτ is adaptive − fixed of the same tree: the adaptive rows listed in another order give
    the same cell, and the achieved mean counts every tree-layer the adaptive rule loaded."""
    bench = adaptive_closed_bench()
    trees = [(0, 0), (0, 1), (1, 0), (1, 1)]
    fixed = closed_rows(trees, [3, 2, 5, 1], [(4, 4)] * 4)
    adaptive = closed_rows(trees[::-1], [2, 6, 2, 3], [(2, 6), (3, 5), (4, 4), (6, 2)],
                           "adaptive:mass", 0.5)
    cell = bench.compare(fixed, adaptive, 4)
    deltas = [3 - 3, 2 - 2, 6 - 5, 2 - 1]  # trees (0, 0), (0, 1), (1, 0), (1, 1)
    from moe_spec.analysis import power
    assert cell["delta_tau"] == pytest.approx(power.paired_interval(deltas))
    assert cell["trees_unchanged"] == 2 and cell["achieved"] == 4 and cell["p10"] < 4
    assert cell["prompts"] == 2 and cell["delta_tau_by_prompt"] == pytest.approx(
        power.paired_interval([0, 1]))  # prompt 0's trees gain 0, prompt 1's 1 on average
    assert cell["trees_needed"] == power.trees_needed(deltas) and cell["price"] == 0.5
    assert cell["trees_needed_observed"] == power.trees_needed(deltas, 0.5)
    with pytest.raises(SystemExit) as exit_status:
        bench.compare(fixed, adaptive.slice(1), 4)
    assert exit_status.value.code == 2 and "did not replay the same trees" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.one_setting(pl_concat(fixed, fixed), "fixed", "truncation", 4)
    assert "a tree has two stored results" in capsys.readouterr().err


def pl_concat(*frames):
    import polars as pl
    return pl.concat(frames)


@pytest.mark.parametrize("interval, trees, needed, verdict", [
    ((0.0, 0.0, 0.0), 40, 1, "met"),  # every tree the same: no loss, one tree tells
    ((0.2, 0.05, 0.35), 300, 250, "met"),
    ((0.2, 0.05, 0.35), 200, 250, "underpowered"),  # no loss, but short of the power size
    ((0.1, -0.05, 0.25), 900, 250, "undecided"),  # a loss inside the interval
    ((-0.3, -0.5, -0.1), 900, 250, "loss"),
])
def test_adaptive_closed_verdict_needs_no_loss_at_the_power_size(interval, trees, needed,
                                                                  verdict):
    cell = dict(delta_tau=interval, trees=trees, trees_needed=needed)
    assert adaptive_closed_bench().verdict(cell) == verdict


def test_adaptive_closed_table_keeps_both_sizes_of_a_model_and_counts_the_goal():
    """Two studies of one model (8 and 440 prompts) are two sets of rows, and the goal line
    counts each cell's verdict once."""
    bench = adaptive_closed_bench()

    def cell(coverage, interval, trees, needed):
        return dict(coverage=coverage, mean_budget=4, trees=trees, tau_fixed=4.0,
                    tau_adaptive=4.0 + interval[0], delta_tau=interval, trees_unchanged=1,
                    kl_fixed=0.3, kl_adaptive=0.2, achieved=4.0, achieved_fixed=4.0, p10=3,
                    p90=5, trees_needed=needed, trees_needed_observed=None)

    def study(prompts, cells):
        return dict(model="tiny-gpt-oss", ranking="router", budget_mode="adaptive:mass",
                    eval_prompts=prompts, bench="mbpp", cal_prompts=8, max_new_tokens=32, k=4,
                    n=32, cells=cells)

    text = bench.markdown({
        "tiny-gpt-oss@8": study(8, [cell("truncation", (0.3, -0.2, 0.8), 46, 2000),
                                    cell("substitution", (0.0, 0.0, 0.0), 46, 1)]),
        "tiny-gpt-oss@440": study(440, [cell("truncation", (0.1, 0.02, 0.18), 2400, 2000)])})
    rows = [line for line in text.splitlines() if line.startswith("| tiny-gpt-oss |")]
    assert [r.split(" | ")[4] for r in rows] == ["8 · 8", "8 · 8", "440 · 8"]  # prompts: eval · λ
    assert [r.split(" | ")[5] for r in rows] == ["46", "46", "2400"]
    assert [r.rstrip(" |").rsplit("| ", 1)[1] for r in rows] == ["undecided", "met", "met"]
    assert "met in 2 of 3 cells" in text and "undecided 1" in text
    assert "- tiny-gpt-oss: router · adaptive:mass, 440 evaluation prompts" in text


def test_adaptive_closed_keys_each_rule_so_two_rules_of_a_model_render_side_by_side():
    from types import SimpleNamespace

    from moe_spec.bench import adaptive_closed
    args = lambda ranking, predictor, pace=None, cap=None, over="prompt": SimpleNamespace(  # noqa: E731,E501
        eval_prompts=440, cal_prompts=64, ranking=ranking, predictor=predictor, pace=pace,
        pass_cap=cap, pace_over=over)
    assert adaptive_closed.report_key("m", args("router", "mass")) == "m@440+64"
    assert adaptive_closed.report_key("m", args("sketch-gated", "surrogate")) == \
        "m@440+64:sketch-gated·surrogate"
    assert adaptive_closed.report_key("m", args("router", "mass", 0.5, 1.25)) == \
        "m@440+64:router·mass+cap1.25+pace0.5"
    assert adaptive_closed.report_key("m", args("router", "mass", 0.5, None, "run")) == \
        "m@440+64:router·mass+pace0.5-run"


@pytest.mark.parametrize("script", ["adaptive_budget.py", "adaptive_closed.py"])
def test_adaptive_studies_refuse_a_missing_benchmarks_folder_or_bench_in_one_line(script,
                                                                                   tmp_path):
    """Before any model loads: the study's first step is a capture, which would otherwise stop
    with a traceback from deep inside it."""
    cases = [(["--benchmarks", str(tmp_path / "nope")], "benchmarks folder not found"),
             (["--bench", "nobench"], "--bench nobench: unknown")]
    for extra, said in cases:
        done = subprocess.run([sys.executable, f"bench/{script}", "--traces",
                               str(tmp_path / "t"), *extra], cwd=ROOT, env=ENV,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr[-800:]
        assert said in done.stderr and "Traceback" not in done.stderr
        assert not (tmp_path / "t").exists()  # nothing captured


@pytest.mark.parametrize("script", ["adaptive_budget", "adaptive_closed"])
def test_adaptive_studies_refuse_pace_over_without_a_pace_in_one_line(script, tmp_path, capsys):
    """As replay does: --pace-over run without --pace would give unpaced cells silently."""
    import importlib
    main = importlib.import_module(f"moe_spec.bench.{script}").main
    with pytest.raises(SystemExit) as exc:  # (a missing benchmarks folder: nothing heavy runs)
        main(["--traces", str(tmp_path / "t"), "--benchmarks", str(tmp_path / "nope"),
              "--pace-over", "run"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "Traceback" not in err, err
    assert "--pace-over run" in err.splitlines()[-1] and "--pace ETA" in err.splitlines()[-1]


def test_a_bench_capture_ends_a_user_error_in_one_line(tmp_path):
    from moe_spec.bench import pipeline
    with pytest.raises(SystemExit, match=r"^capture: error: benchmarks folder not found"):
        pipeline.capture(tmp_path / "t", "eval-mbpp", model="tiny-olmoe", bench="mbpp",
                         benchmarks_root=tmp_path / "nope", limit=1)
