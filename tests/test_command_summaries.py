"""What commands print when they finish: replay's pivot per coverage with the gap closed (and how
it is aggregated), capture's summary of a batched run per verification pass, and evaluate naming
the quality table's folder."""

import json

import polars as pl
import pytest

from moe_spec.capture import cli as capture_cli

pytestmark = pytest.mark.slow  # end to end (captures); scripts/test.sh --fast leaves it out

CAP = ["--model", "tiny-olmoe", "--bench", "mbpp", "--max-new-tokens", "10", "--no-progress"]


@pytest.fixture(scope="module")
def batched(tmp_path_factory):
    """A b = 2 capture of 3 prompts (an odd count: the last pass holds one tree)."""
    root = tmp_path_factory.mktemp("batched")
    assert capture_cli.main([*CAP, "--limit", "3", "--out", str(root), "--run", "b2",
                             "--batch-size", "2", "--threads", "1"]) == 0
    return root


# --- replay ---------------------------------------------------------------------------------------
class _Run:
    def __init__(self, name):
        self.name, self.model, self.bench = name, "tiny-olmoe", "mbpp"


def test_summary_is_a_pivot_per_coverage_with_the_gap_closed():
    from moe_spec.replay.cli import summary_lines
    rows = []
    for cov in ("truncation", "substitution"):
        for b, (router, oracle, coact) in {8: (0.4, 0.2, 0.3), 16: (0.2, 0.1, 0.1)}.items():
            rows += [dict(ranking=r, coverage=cov, budget=b, rse=v, tree_layers=16)
                     for r, v in (("router", router), ("oracle", oracle), ("coact", coact))]
    lines = summary_lines(pl.DataFrame(rows), "open", [_Run("eval")],
                          ["router", "oracle", "coact"], ["truncation", "substitution"])
    assert lines[0] == ("tiny-olmoe / mbpp / run eval: open-loop replay, mean RSE (lower is "
                        "better); 16 tree-layers per cell")
    assert lines[1] == "coverage truncation:" and "coverage substitution:" in lines
    head, b8, b16, gap = (line.split() for line in lines[2:6])
    assert head == ["budget", "router", "oracle", "coact", "gap", "closed", "at", "B"]
    assert b8 == ["8", "0.4000", "0.2000", "0.3000", "50%"]
    assert b16 == ["16", "0.2000", "0.1000", "0.1000", "100%"]
    assert gap == ["gap", "closed,", "all", "B", "0%", "100%", "67%"]  # (0.6 − 0.4) / (0.6 − 0.3)
    assert len(lines) == 1 + 2 * 5 + 3  # and a footnote saying how each gap closed is made
    assert lines[-3].startswith("gap closed at B: (router − X) / (router − oracle)")
    assert lines[-2].startswith("gap closed, all B: Σ_B (router − X) / Σ_B (router − oracle)")
    assert "not a per-budget value" in lines[-1]


def test_summary_without_the_pair_has_no_gap_and_closed_loop_says_tau():
    from moe_spec.replay.cli import summary_lines
    frame = pl.DataFrame([dict(ranking="router", coverage="substitution", budget=b,
                               accepted_length=t, captured_accepted_length=3.0, trees=5)
                          for b, t in ((16, 2.5), (32, 2.9))])
    lines = summary_lines(frame, "closed", [_Run("a"), _Run("b")], ["router"], ["truncation",
                                                                                "substitution"])
    assert "run {a, b}" in lines[0] and "accepted length" in lines[0]
    assert "captured τ 3.000" in lines[0] and not any("gap" in line for line in lines)
    assert [line.split() for line in lines[2:]] == [["budget", "router"], ["16", "2.500"],
                                                    ["32", "2.900"]]


def test_replay_prints_the_pivot_and_writes_every_row(one_prompt, tmp_path, capsys):
    from moe_spec.replay import cli as replay_cli
    args = ["--traces", str(one_prompt), "--ranking", "router", "oracle", "--budget", "16,24",
            "--no-progress", "--out", str(tmp_path / "results")]
    for suffix in ("csv", "parquet", "json"):
        assert replay_cli.main([*args, "--output", str(tmp_path / f"s.{suffix}")]) == 0
    out = capsys.readouterr().out
    assert "tiny-olmoe / mbpp / run eval: open-loop replay, mean RSE" in out
    assert "coverage truncation:" in out and "coverage substitution:" in out
    # results stored apart from their traces: query (which reads results beside their runs)
    # is not offered
    assert "replay without --out" in out and "SELECT * FROM replay_open" not in out
    csv = pl.read_csv(tmp_path / "s.csv")
    assert csv.height == 8 and {"rse", "token_error", "mass_excluded"} <= set(csv.columns)
    parquet = pl.read_parquet(tmp_path / "s.parquet")
    assert parquet.columns == csv.columns and parquet.height == 8
    assert len(json.loads((tmp_path / "s.json").read_text())["summary"]) == 8


# --- capture --------------------------------------------------------------------------------------
def test_batched_capture_summary_has_passes_the_union_and_a_replay_hint(batched, capsys):
    from moe_spec.capture.summary import summarise
    from moe_spec.catalog.writer import RunWriter
    s = summarise(RunWriter(batched, "tiny-olmoe", "mbpp", "b2"), "tiny-olmoe", "mbpp", "b2", 0,
                  1.0, 0.5)
    trees = pl.read_parquet(batched / "trees" / "**" / "*.parquet")
    per_pass = trees.group_by("batch_pass").agg(pl.col("batch_unique_experts").first()
                                                .list.mean())
    assert s.batch_size == 2 and s.passes == per_pass.height < s.trees
    assert s.pass_unique_experts == pytest.approx(per_pass["batch_unique_experts"].mean())
    assert s.pass_unique_experts >= s.unique_experts  # a union holds each of its trees
    assert s.prompts_with_trees == trees["prompt_index"].n_unique()
    capture_cli.print_summary(s)
    out = capsys.readouterr().out
    assert "verification passes" in out and "unique experts / layer / pass" in out
    assert "--run b2" in out and "--batch-size 2" in out


def test_summary_says_how_many_prompts_have_verification_passes(tmp_path, capsys):
    from moe_spec.capture.summary import CaptureSummary
    s = CaptureSummary(tmp_path, "m", "mbpp", "r", 8, 0, 12, 3.0, 30.0, 30.0, 2 ** 20, 1.0,
                       prompts_with_trees=6)
    capture_cli.print_summary(s)
    out = capsys.readouterr().out
    assert "8 (6 with verification passes)" in out
    assert "verification passes " not in out.split("prompts")[0]  # b = 1: no per-pass rows
    assert "unique experts / layer / pass" not in out and "--batch-size" not in out


# --- evaluate -------------------------------------------------------------------------------------
def test_evaluate_says_where_it_wrote_the_quality_table(batched, capsys):
    from moe_spec.analysis import evaluate_cli
    assert evaluate_cli.main(["--traces", str(batched), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "quality table written" in out
    folder = (batched / "quality" / "model=tiny-olmoe" / "bench=mbpp" / "run=b2").resolve()
    assert str(folder) in out and any(folder.glob("*.parquet"))
    json.dumps(out)  # one printable block
