"""The trace catalog end to end: run roles, replay results that answer any subset and are never
stored twice or reused from an older capture, names that cannot leave the traces folder, and
the stateful ``previous`` ranking online, open loop and closed loop."""

import shutil
import subprocess
import sys

import duckdb
import pytest

from moe_spec.analysis.sql import connect
from moe_spec.capture import cli as capture_cli
from moe_spec.catalog import Catalog, InvalidName, check_name
from moe_spec.catalog.results import UnitResults
from moe_spec.replay import cli as replay_cli

pytestmark = pytest.mark.slow  # end to end (captures); scripts/test.sh --fast leaves it out

CAP = ["--model", "tiny-olmoe", "--bench", "mbpp", "--max-new-tokens", "8", "--no-progress"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("catalog")
    assert capture_cli.main([*CAP, "--limit", "2", "--out", str(root), "--run", "eval"]) == 0
    assert capture_cli.main([*CAP, "--limit", "2", "--offset", "100", "--out", str(root),
                             "--run", "cal", "--role", "calibration"]) == 0
    return root


def replay(root, *args, out=None):
    return replay_cli.main(["--traces", str(root), "--no-progress",
                            *(["--out", str(out)] if out else []), *args])


def stored(out, table="replay_open"):
    return duckdb.sql(f"SELECT * FROM read_parquet('{out}/{table}/**/*.parquet', "
                      "hive_partitioning=true)").pl()


def test_roles_are_recorded_and_calibration_runs_are_never_evaluated_by_accident(traces, tmp_path):
    roles = {r.name: r.role for r in Catalog(traces).runs()}
    assert roles == {"eval": "evaluation", "cal": "calibration"}
    assert replay(traces, "--ranking", "router", "--budget", "16", out=tmp_path) == 0
    assert set(stored(tmp_path)["run"]) == {"eval"}  # the calibration run was not replayed
    r = subprocess.run([sys.executable, "-m", "moe_spec.replay.cli", "--traces", str(traces), "--run",
                        "cal", "--no-progress"], capture_output=True, text=True)
    assert r.returncode == 2 and "is a calibration run; pass --role calibration" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert replay(traces, "--run", "cal", "--role", "calibration", "--ranking", "router",
                  "--budget", "16", out=tmp_path / "c") == 0
    con = connect(traces, roles=("evaluation",))
    assert con.sql("SELECT DISTINCT run FROM trees").fetchall() == [("eval",)]
    assert {r[0] for r in connect(traces).sql("SELECT DISTINCT role FROM trees").fetchall()} == \
        {"evaluation", "calibration"}


def test_a_finished_sweep_answers_any_subset_and_nothing_is_stored_twice(traces, tmp_path,
                                                                         capsys):
    out = tmp_path / "r"
    assert replay(traces, "--ranking", "router", "oracle", "--budget", "16,24", "--layers",
                  "0,7", out=out) == 0
    first = stored(out)
    capsys.readouterr()
    assert replay(traces, "--ranking", "oracle", "--budget", "24", "--layers", "7",
                  out=out) == 0
    assert "reused stored results for run eval" in capsys.readouterr().err
    assert stored(out).height == first.height  # nothing recomputed
    # a superset computes only the missing cells, as a new block
    assert replay(traces, "--ranking", "router", "oracle", "--budget", "8,16,24", "--layers",
                  "0,3,7", out=out) == 0
    after = stored(out)
    keys = ["run", "prompt_index", "step", "layer", "ranking", "coverage", "budget"]
    assert after.select(keys).is_duplicated().sum() == 0
    assert set(after["budget"]) == {8, 16, 24} and set(after["layer"]) == {0, 3, 7}
    blocks = after.select("config", "block").unique().height
    # 4 units (ranking × coverage) × (the first block, then layers 0,7 missing {8} and layer 3
    # missing {8, 16, 24}: two more)
    assert blocks == 4 * 3
    # the same rows as one fresh request (recomputing gives equal results)
    fresh = tmp_path / "fresh"
    assert replay(traces, "--ranking", "router", "oracle", "--budget", "8,16,24", "--layers",
                  "0,3,7", out=fresh) == 0
    a, b = (stored(p).drop("config", "block").sort(keys) for p in (out, fresh))
    assert a.equals(b)


def test_results_of_an_older_capture_are_never_reused(traces, tmp_path):
    root = tmp_path / "t"
    shutil.copytree(traces, root)
    assert replay(root, "--ranking", "router", "--budget", "16") == 0
    old = stored(root)
    for folder in root.glob("*/model=tiny-olmoe/bench=mbpp/run=eval"):
        if not folder.parts[-4].startswith("replay"):
            shutil.rmtree(folder)
    assert capture_cli.main([*CAP, "--limit", "1", "--out", str(root), "--run", "eval"]) == 0
    con = connect(root)
    assert "replay_open" not in [r[0] for r in con.execute(
        "SELECT table_name FROM information_schema.tables").fetchall()] or \
        con.execute("SELECT count(*) FROM replay_open").fetchone()[0] == 0  # stale rows hidden
    assert replay(root, "--ranking", "router", "--budget", "16") == 0
    new = stored(root)
    assert set(new["prompt_index"]) == {0} and new.height < old.height


def test_an_interrupted_block_is_not_final_and_resumes(traces, tmp_path):
    out = tmp_path / "r"
    run = Catalog(traces).runs(names=["eval"])[0]
    unit = UnitResults(out, "replay_open", run, dict(mode="open", ranking="router",
                                                     coverage="truncation", calibration=[]))
    with unit.locked():
        (block,) = unit.plan([0, 1, 2, 3, 4, 5, 6, 7], [16])
    assert replay(traces, "--ranking", "router", "--coverage", "truncation", "--budget", "16",
                  out=out) == 0  # resumes the same block
    assert [b.status for b in unit.blocks()] == ["complete"]
    assert connect(traces).execute("SELECT count(*) FROM trees").fetchone()[0] > 0


@pytest.mark.parametrize("name", ["x/../../../../../pwn", "a/b", "..", ".hidden", "", "a b"])
def test_names_that_would_become_paths_are_refused(name, tmp_path):
    with pytest.raises(InvalidName):
        check_name(name)
    r = subprocess.run([sys.executable, "-m", "moe_spec.capture.cli", *CAP, "--limit", "1", "--out",
                        str(tmp_path), "--run", name], capture_output=True, text=True)
    assert r.returncode == 2 and "is not allowed" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.parent.glob("pwn*"))


def test_previous_ranking_online_open_and_closed_loop(traces, tmp_path):
    """The stateful ranking works everywhere a runtime ranking does."""
    root = tmp_path / "t"
    shutil.copytree(traces, root)
    assert capture_cli.main([*CAP, "--limit", "1", "--out", str(root), "--run", "online",
                             "--budget", "16", "--ranking", "previous"]) == 0
    trees = connect(root).sql("SELECT experts_loaded, ranking FROM trees WHERE run = 'online'")
    rows = trees.fetchall()
    assert rows and all(max(loaded) <= 16 and r == "previous" for loaded, r in rows)
    assert replay(root, "--run", "eval", "--ranking", "previous", "router", "--budget", "16,64",
                  "--coverage", "truncation") == 0
    df = stored(root)
    full = df.filter(df["budget"] == 64)
    assert full["rse"].max() < 1e-10
    prev, router = (df.filter((df["budget"] == 16) & (df["ranking"] == r)) for r in
                    ("previous", "router"))
    first = prev.filter(prev["step"] == 0).sort("layer")["rse"].to_list()
    assert first == router.filter(router["step"] == 0).sort("layer")["rse"].to_list()
    assert not prev.sort(["prompt_index", "step", "layer"])["rse"].equals(
        router.sort(["prompt_index", "step", "layer"])["rse"])  # later passes use the cache
    assert replay(root, "--run", "eval", "--mode", "closed", "--ranking", "previous",
                  "--budget", "16,64", "--coverage", "substitution") == 0
    closed = stored(root, "replay_closed")
    full = closed.filter(closed["budget"] == 64)
    assert (full["accepted_length"] == full["captured_accepted_length"]).all()
    assert closed.filter(closed["budget"] == 16)["experts_loaded"].list.max().max() <= 16


def test_results_of_an_older_ranking_definition_are_dropped_not_shown_twice(traces, tmp_path,
                                                                              monkeypatch):
    from moe_spec.policy.rankings.oracle import Oracle
    root = tmp_path / "t"
    shutil.copytree(traces, root)
    assert replay(root, "--ranking", "oracle", "router", "--budget", "16") == 0
    first = stored(root)
    monkeypatch.setattr(Oracle, "version", Oracle.version + 1)  # a redefined oracle
    assert replay(root, "--ranking", "oracle", "router", "--budget", "16") == 0
    con = connect(root)
    rows = con.execute("SELECT ranking, count(*) FROM replay_open GROUP BY ranking "
                       "ORDER BY ranking").fetchall()
    per_ranking = first.height // 2
    assert rows == [("oracle", per_ranking), ("router", per_ranking)]  # not twice
    configs = {p.parent.name for p in root.glob("replay_open/**/config=*/block=*")}
    assert len(configs) == 4  # oracle and router × two policies: the old oracle units are gone
