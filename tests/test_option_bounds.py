"""Numeric options are bounded, before any work: not numbers (``--lr nan``), beyond the model
(sizes past its vocabulary or context), absurd (in a flag or a config file), or more workers
than prompts and CPUs. Every case is one line naming the option, exit code 2, before any model
loads or training starts (the loaders are replaced by ones that fail the test if called)."""

import os

import pytest
from helpers import CAP_ONE as CAP
from helpers import call, exit_code, one_line, one_line_error

from moe_spec.capture import cli as capture_cli


@pytest.fixture
def no_training(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("training started before the refusal")
    from moe_spec.training import draft, tiny_moe
    monkeypatch.setattr(tiny_moe, "train", started)
    monkeypatch.setattr(draft, "train", started)


# --- train-tiny / train-draft ---------------------------------------------------------------------
@pytest.mark.parametrize("command", ["train_tiny", "train_draft"])
@pytest.mark.parametrize("args,words", [
    (["--lr", "nan"], ["--lr nan", "finite"]),
    (["--lr", "inf"], ["--lr inf", "finite"]),
    (["--lr=-inf"], ["--lr -inf"]),
    (["--lr", "1e9"], ["--lr 1000000000.0", "at most 10"]),
    (["--seed", "-1"], ["--seed -1"]),
    (["--seed", "99999999999999999999999"], ["--seed"]),
    (["--steps", "99999999999999999999"], ["--steps"]),
    (["--batch", "1000000"], ["--batch 1000000"]),
    (["--seq-len", "100000"], ["--seq-len 100000", "4096"]),
])
def test_training_numbers_are_checked_before_any_work(command, args, words, tmp_path, capsys,
                                                      no_training, no_model):
    from moe_spec.training import cli
    argv = ["--model", "tiny-olmoe", "--out", str(tmp_path / "out"), "--threads", "1", *args]
    one_line(capsys, exit_code(getattr(cli, command), argv), *words)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,words", [
    (["--new-tokens", "100000"], ["--new-tokens 100000", "4096"]),
    (["--draft-vocab", "5000"], ["--draft-vocab 5000", "4096"]),  # tiny-olmoe's vocabulary
    (["--ttt", "100000"], ["--ttt 100000"]),
    (["--intermediate", "10000000"], ["--intermediate"]),
])
def test_draft_sizes_are_bounded_by_the_target(args, words, tmp_path, capsys, no_training,
                                               no_model):
    from moe_spec.training import cli
    argv = ["--model", "tiny-olmoe", "--out", str(tmp_path / "out"), "--threads", "1", *args]
    one_line(capsys, exit_code(cli.train_draft, argv), *words)


# --- profile-target / profile-batch ---------------------------------------------------------------
@pytest.mark.parametrize("args,words", [
    (["--prefix", "1000000000"], ["--prefix 1000000000", "max_position_embeddings 4096"]),
    (["--gammas", "1,100000"], ["--gammas 100000", "max_position_embeddings"]),
    (["--batches", "1,10000000"], ["--batch-sizes 10000000"]),  # (--batches: older spelling)
    (["--repeats", "100000000"], ["--repeats 100000000"]),
    (["--batches", "4096", "--prefix", "4000"], ["tokens in one forward"]),
])
def test_profile_target_sizes_are_bounded_before_the_model_loads(args, words, tmp_path, capsys,
                                                                 no_model):
    from moe_spec.profiling import profile_target
    argv = ["--model", "tiny-olmoe", "--out", str(tmp_path), "--threads", "1", *args]
    one_line(capsys, exit_code(profile_target.main, argv), *words)


@pytest.mark.parametrize("args,words", [
    (["--batch-sizes", "1,10000000"], ["--batch-sizes"]),
    (["--limit", "99999999999"], ["--limit 99999999999"]),
    (["--offset", "99999999999"], ["--offset 99999999999"]),
    (["--max-new-tokens", "100000"], ["--max-new-tokens 100000", "max_position_embeddings"]),
    (["--budget", "65"], ["--budget 65", "8..64"]),
    (["--budget", "4"], ["--budget 4", "8..64"]),  # substitution needs B >= k
    (["--budget", "99999999999"], ["--budget"]),
])
def test_profile_batch_sizes_are_bounded_before_the_model_loads(args, words, tmp_path, capsys,
                                                                no_model):
    from moe_spec.profiling import profile_batch
    argv = ["--model", "tiny-olmoe", "--out", str(tmp_path), "--threads", "1", "--no-progress",
            *args]
    one_line(capsys, exit_code(profile_batch.main, argv), *words)


# --- capture and replay ---------------------------------------------------------------------------
@pytest.mark.parametrize("args,words", [
    (["--budget", "65"], ["--budget 65", "8..64"]),
    (["--budget", "4"], ["--budget 4", "8..64", "substitution"]),
    (["--budget", "0", "--coverage", "truncation"], ["--budget 0", "1..64"]),
    (["--budget", "16", "--calibration", "nothing-here"], ["--calibration", "nothing-here",
                                                            "not found"]),
])
def test_capture_checks_budget_and_calibration_before_the_model_loads(args, words, tmp_path,
                                                                     capsys, no_model):
    code = capture_cli.main([*CAP, "--out", str(tmp_path / "t"), *args])
    one_line(capsys, code, *words)


@pytest.mark.parametrize("module,args,words", [
    ("moe_spec.replay.cli", ["--workers", "-2"], ["--workers -2"]),
    ("moe_spec.capture.cli", ["--workers", "-2"], ["--workers -2"]),
    ("moe_spec.capture.cli", ["--max-new-tokens", "99999999999999999999"], ["--max-new-tokens", "1000000"]),
    ("moe_spec.capture.cli", ["--seed", "99999999999999999999"], ["--seed"]),
    ("moe_spec.capture.cli", ["--batch-size", "100000"], ["--batch-size"]),
    ("moe_spec.capture.cli", ["--temperature", "inf"], ["--temperature"]),
])
def test_numeric_options_are_bounded(replayed, tmp_path, module, args, words):
    extra = {"moe_spec.capture.cli": [*CAP[:4], "--out", tmp_path / "x"],
             "moe_spec.replay.cli": ["--traces", replayed[0], "--no-progress"]}[module]
    one_line_error(call(module, *extra, *args, timeout=120), *words)


def test_a_config_file_cannot_ask_for_absurd_numbers(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("max_new_tokens = 99999999999999999999\n")
    one_line_error(call("moe_spec.capture.cli", *CAP[:4], "--config", config, "--out", tmp_path / "x",
                        timeout=120), "--max-new-tokens", "out of range")


def test_workers_are_capped_at_the_prompts_and_cpus(capsys):
    from moe_spec.cluster import cap_workers
    assert cap_workers(999, 1, "cpu") == 1
    assert "capped at 1" in capsys.readouterr().err
    assert cap_workers(999, 10_000, "cpu") == (os.cpu_count() or 1)
    assert cap_workers(999, 3, "cuda", local=False) == 3
    assert cap_workers(2, 10, "cpu", local=False) == 2 and cap_workers(0, 10, "cpu") == 0
