"""Issue 25: generation never runs past --max-new-tokens; a prompt whose first generated token is
EOS is recorded with no verification pass (and every reader copes); --calibration refuses runs
captured for evaluation unless told otherwise."""

import errno
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from analysis import query_cli, summaries
from capture import cli as capture_cli
from capture.background import WriterFailed
from capture.run import prompt_ids, write_errors
from catalog import Catalog, reader
from eagle import loading
from eagle.decoding import EagleDecoder
from replay import cli as replay_cli
from tasks import benchmarks

CAP = ["--model", "tiny-olmoe", "--bench", "mbpp", "--max-new-tokens", "10", "--no-progress",
       "--threads", "1"]
FIRST_TOKEN_EOS = {1, 2}  # prompts (seed = --seed 0 + prompt index) whose every token is EOS


# --- defect 3: --max-new-tokens is a hard cap ---------------------------------------------------
@pytest.mark.parametrize("out,eos,cap,expected", [
    ([1, 2, 3, 4, 5], {5}, 3, ([1, 2, 3], "max_new_tokens")),  # EOS past the cap: the cap wins
    ([1, 2, 3, 4, 5], {3}, 3, ([1, 2, 3], "eos")),  # EOS is the last token allowed
    ([1, 2, 3, 4, 5], {2, 4}, 3, ([1, 2], "eos")),
    ([1, 2, 3, 4, 5], {4}, 10, ([1, 2, 3, 4], "eos")),
    ([1, 2, 3, 4], set(), 3, ([1, 2, 3], "max_new_tokens")),
    ([1, 2], {9}, 3, ([1, 2], "")),
])
def test_stop_cuts_at_the_cap_before_looking_for_eos(out, eos, cap, expected):
    assert EagleDecoder._stop(None, out, eos, cap) == expected


@pytest.fixture(scope="module")
def olmoe():
    return loading.load_with_draft("tiny-olmoe", device="cpu", dtype="float32")


def test_no_generation_exceeds_max_new_tokens_when_a_pass_crosses_the_cap(olmoe):
    loaded, head = olmoe
    dec = EagleDecoder(loaded.model, head)
    ids = prompt_ids(loaded.tokenizer, benchmarks.load("mbpp", limit=1)[0].text)
    ref = dec.generate(ids, max_new_tokens=24)
    ends, n = set(), 1  # output lengths at which a pass ends (the root comes from prefill)
    for s in ref.steps:
        n += s.accepted_length
        ends.add(n)
    crossing = 0
    for cap in range(2, 20):
        after = ref.output_ids[cap]  # the first token past the cap
        if after in ref.output_ids[:cap]:
            continue
        crossing += cap not in ends  # a pass accepts tokens on both sides of the cap
        out = dec.generate(ids, max_new_tokens=cap, eos_token_ids={after})
        assert out.output_ids == ref.output_ids[:cap], cap
        assert out.stop_reason == "max_new_tokens", cap
        last = ref.output_ids[cap - 1]
        if last not in ref.output_ids[:cap - 1]:
            out = dec.generate(ids, max_new_tokens=cap, eos_token_ids={last})
            assert out.output_ids == ref.output_ids[:cap] and out.stop_reason == "eos", cap
    assert crossing >= 3  # the case that used to run past the cap was exercised


# --- defect 8: a prompt whose first generated token is EOS --------------------------------------
@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """``some``: prompts 0, 1 (1 stops at its first token); ``none``: prompts 1, 2 (both do);
    ``cal`` (calibration) and ``cal-eval`` (evaluation) on other prompts."""
    root = tmp_path_factory.mktemp("round3")
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
    assert capture_cli.main([*CAP, "--limit", "1", "--offset", "101", "--out", str(root),
                             "--run", "cal-eval"]) == 0
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


def test_write_errors_blame_the_disk_only_for_oserror(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device")
    for exc in (full, _failed(full)):
        message = str(write_errors(tmp_path)(exc))
        assert "No space left on device" in message and "free space" in message
    for exc in (_failed(ValueError("need at least one array to concatenate")),
                KeyError("step")):
        message = str(write_errors(tmp_path)(exc))
        assert "free space" not in message and "another --out" not in message
        assert type(exc.__cause__ or exc).__name__ in message
    assert "need at least one array" in str(write_errors(tmp_path)(
        _failed(ValueError("need at least one array to concatenate"))))


def _failed(cause: BaseException) -> WriterFailed:
    try:
        raise WriterFailed(str(cause)) from cause
    except WriterFailed as exc:
        return exc


# --- defect 5: --calibration refuses evaluation runs unless told -------------------------------
def test_replay_refuses_an_evaluation_run_as_calibration(traces, tmp_path, capsys):
    base = ["--traces", str(traces), "--run", "some", "--ranking", "static", "--budget", "16",
            "--no-progress", "--out", str(tmp_path)]
    assert replay_cli.main([*base, "--calibration", "cal-eval"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "cal-eval" in err and "evaluation" in err and "--role calibration" in err
    assert "--allow-evaluation-calibration" in err
    assert replay_cli.main([*base, "--calibration", "cal-eval",
                            "--allow-evaluation-calibration"]) == 0
    assert replay_cli.main([*base, "--calibration", "cal"]) == 0


def test_capture_refuses_an_evaluation_run_as_calibration(traces, capsys):
    online = [*CAP, "--limit", "1", "--offset", "3", "--out", str(traces), "--budget", "16",
              "--ranking", "static"]
    assert capture_cli.main([*online, "--run", "online", "--calibration", "cal-eval"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--allow-evaluation-calibration" in err, err
    assert "cal-eval" in err and "evaluation" in err
    assert not (traces / "runs" / "model=tiny-olmoe" / "bench=mbpp" / "run=online").exists()
    assert capture_cli.main([*online, "--run", "online", "--calibration", "cal-eval",
                             "--allow-evaluation-calibration"]) == 0
    assert capture_cli.main([*online, "--run", "online-cal", "--calibration", "cal"]) == 0
