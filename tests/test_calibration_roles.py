"""--calibration refuses a run captured for evaluation (replay and capture's online budgets) unless
told otherwise (--allow-evaluation-calibration), in one line saying how to capture a calibration
run."""

import pytest

from moe_spec.capture import cli as capture_cli
from moe_spec.replay import cli as replay_cli

pytestmark = pytest.mark.slow  # end to end (captures); scripts/test.sh --fast leaves it out

CAP = ["--model", "tiny-olmoe", "--bench", "mbpp", "--max-new-tokens", "10", "--no-progress",
       "--threads", "1"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """``some`` (evaluation), ``cal`` (calibration) and ``cal-eval`` (evaluation), one prompt
    each."""
    root = tmp_path_factory.mktemp("calibration_roles")
    assert capture_cli.main([*CAP, "--limit", "1", "--out", str(root), "--run", "some"]) == 0
    assert capture_cli.main([*CAP, "--limit", "1", "--offset", "100", "--out", str(root),
                             "--run", "cal", "--role", "calibration"]) == 0
    assert capture_cli.main([*CAP, "--limit", "1", "--offset", "101", "--out", str(root),
                             "--run", "cal-eval"]) == 0
    return root


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
