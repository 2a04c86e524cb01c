"""query: DuckDB views over traces and replay results, through the real CLI."""

import json

import pytest

from moe_spec.analysis import query_cli
from moe_spec.analysis.sql import connect, views
from moe_spec.capture import cli as capture_cli

pytestmark = pytest.mark.slow  # end to end (captures); scripts/test.sh --fast leaves it out


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("q")
    assert capture_cli.main(["--limit", "1", "--max-new-tokens", "8", "--out", str(root),
                             "--no-progress", "--run", "q"]) == 0
    return root


def test_views_cover_every_table_with_partition_columns(traces):
    con = connect(traces)
    assert set(views(con)) == {"sequences", "trees", "nodes", "routing", "moe_io", "runs"}
    model, run, n = con.execute("SELECT any_value(model), any_value(run), count(*) FROM trees").fetchall()[0]
    assert (model, run) == ("tiny-olmoe", "q") and n > 0
    per_layer = con.execute("SELECT layer, count(*) FROM routing GROUP BY layer").fetchall()
    assert len(per_layer) == 8


@pytest.mark.parametrize("fmt", ["csv", "json", "parquet"])
def test_formats(traces, tmp_path, fmt):
    out = tmp_path / f"r.{fmt}"
    assert query_cli.main(["SELECT step, accepted_length FROM trees ORDER BY step", "--traces",
                           str(traces), "--format", fmt, "--out", str(out)]) == 0
    if fmt == "json":
        assert json.loads(out.read_text())[0]["step"] == 0
    elif fmt == "csv":
        assert out.read_text().splitlines()[0] == "step,accepted_length"
    else:
        import polars as pl
        assert pl.read_parquet(out).height > 0


def test_schema_and_errors(traces, tmp_path, capsys):
    assert query_cli.main(["--schema", "--traces", str(traces)]) == 0
    assert "trees: prompt_index INTEGER" in capsys.readouterr().out
    assert query_cli.main(["SELECT nope FROM trees", "--traces", str(traces)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("query: error:") and len(err.strip().splitlines()) == 1
    assert query_cli.main(["SELECT 1", "--traces", str(tmp_path / "none")]) == 2


def test_query_draws_evaluation_runs_unless_asked(tmp_path, capsys):
    root = tmp_path / "t"
    assert capture_cli.main(["--limit", "1", "--max-new-tokens", "8", "--out", str(root),
                             "--no-progress", "--run", "ev"]) == 0
    assert capture_cli.main(["--limit", "2", "--offset", "40", "--max-new-tokens", "6", "--out",
                             str(root), "--no-progress", "--run", "cal", "--role",
                             "calibration"]) == 0
    sql = "SELECT count(DISTINCT run) AS runs, count(*) AS trees, min(role) AS role FROM trees"

    def rows(*extra):
        capsys.readouterr()
        assert query_cli.main([sql, "--traces", str(root), "--format", "json", *extra]) == 0
        return json.loads(capsys.readouterr().out)[0]

    only_eval = connect(root, roles=("evaluation",)).execute(
        "SELECT count(*) FROM trees").fetchall()[0][0]
    assert rows() == {"runs": 1, "trees": only_eval, "role": "evaluation"}  # the default
    assert rows("--role", "evaluation") == rows()
    everything = rows("--role", "all")
    assert everything["runs"] == 2 and everything["trees"] > only_eval
    assert rows("--role", "calibration")["role"] == "calibration"
