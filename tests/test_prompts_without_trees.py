"""A prompt whose first generated token is EOS is recorded with no verification pass, the run goes
on, and every reader (catalog, summaries, replay, query) copes with prompts without trees."""

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from moe_spec.analysis import query_cli, summaries
from moe_spec.capture import cli as capture_cli
from moe_spec.catalog import Catalog, reader
from moe_spec.eagle.decoding import EagleDecoder
from moe_spec.replay import cli as replay_cli

pytestmark = pytest.mark.slow  # end to end (captures); scripts/test.sh --fast leaves it out

CAP = ["--model", "tiny-olmoe", "--bench", "mbpp", "--max-new-tokens", "10", "--no-progress",
       "--threads", "1"]
FIRST_TOKEN_EOS = {1, 2}  # prompts (seed = --seed 0 + prompt index) whose every token is EOS


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """``some``: prompts 0, 1 (1 stops at its first token); ``none``: prompts 1, 2 (both do);
    ``cal`` (calibration) on another prompt."""
    root = tmp_path_factory.mktemp("first_token_eos")
    stream = EagleDecoder.stream

    def first_token_eos(self, ids, *, eos_token_ids=None, seed=0, **kw):
        if seed in FIRST_TOKEN_EOS:
            eos_token_ids = set(range(self.target.config.vocab_size))
        return stream(self, ids, eos_token_ids=eos_token_ids, seed=seed, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EagleDecoder, "stream", first_token_eos)
        assert capture_cli.main([*CAP, "--limit", "2", "--out", str(root), "--run", "some"]) == 0
        assert capture_cli.main([*CAP, "--limit", "2", "--offset", "1", "--out", str(root),
                                 "--run", "none"]) == 0
    assert capture_cli.main([*CAP, "--limit", "1", "--offset", "100", "--out", str(root),
                             "--run", "cal", "--role", "calibration"]) == 0
    return root


def table(root, name, run):
    return pq.read_table(Path(root) / name / "model=tiny-olmoe" / "bench=mbpp" / f"run={run}")


def test_first_token_eos_is_recorded_with_no_pass_and_the_run_goes_on(traces):
    seqs = {s["prompt_index"]: s for s in table(traces, "sequences", "some").to_pylist()}
    assert sorted(seqs) == [0, 1]
    assert seqs[1]["steps"] == 0 and seqs[1]["stop_reason"] == "eos"
    assert len(seqs[1]["output_token_ids"]) == 1
    assert seqs[0]["steps"] > 0 and len(seqs[0]["output_token_ids"]) <= 10
    for name in ("trees", "nodes", "routing", "moe_io"):
        assert set(table(traces, name, "some")["prompt_index"].to_pylist()) == {0}, name
        assert table(traces, name, "none").num_rows == 0, name
    none = {s["prompt_index"]: s for s in table(traces, "sequences", "none").to_pylist()}
    assert sorted(none) == [1, 2] and all(s["steps"] == 0 for s in none.values())


def test_readers_take_runs_with_prompts_without_trees(traces):
    runs = {r.name: r for r in Catalog(traces).runs()}  # checked: every table has every prompt
    assert runs["some"].prompt_indices() == [0, 1] and runs["none"].prompt_indices() == [1, 2]
    for with_io in (True, False):
        assert {tl.prompt_index for tl in reader.tree_layers([runs["some"]], with_io=with_io)} \
            == {0}
        assert not list(reader.tree_layers([runs["none"]], with_io=with_io))
        assert sum(len(c) for c in reader.prompt_chunks(runs["some"], 1, with_io=with_io)) == 0
    report = summaries.ensure(traces, workers=1)
    assert report is not None


def test_replay_and_query_on_prompts_without_trees(traces, tmp_path, capsys):
    for run in ("some", "none"):
        for mode in (["--ranking", "router", "oracle"],
                     ["--mode", "closed", "--ranking", "router", "--coverage", "substitution"]):
            assert replay_cli.main(["--traces", str(traces), "--run", run, *mode, "--budget",
                                    "16", "--no-progress", "--out", str(tmp_path)]) == 0, \
                (run, mode, capsys.readouterr().err)
    capsys.readouterr()
    assert query_cli.main(["SELECT run, count(*) AS n FROM sequences GROUP BY run ORDER BY run",
                           "--traces", str(traces)]) == 0
    assert query_cli.main(["SELECT count(*) AS n FROM trees WHERE run = 'none'",
                           "--traces", str(traces)]) == 0
    # calibrating on a run without any tree is one line, not statistics of nothing
    assert replay_cli.main(["--traces", str(traces), "--run", "cal", "--role", "calibration",
                            "--ranking", "static", "--calibration", "none", "--allow-evaluation-calibration",
                            "--no-progress", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no tree-layer" in err and len(err.splitlines()) == 1, err
