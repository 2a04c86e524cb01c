"""The replay-table recipe of docs/architecture.md: a replay mode with a result table of its own
is two files, its table's record (one ``register`` call in ``catalog/replay_metrics.py``) and
the mode (``replay/modes.py``). A copy of ``catalog/`` and ``replay/`` with just those two
additions has the table's stored schema, its results written by ``replay`` and read back, its
two SQL views (``<table>`` one variant per curve, ``<table>_all``) and its curves frame — with
no other module edited."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from helpers import overlay_env

ROOT = Path(__file__).resolve().parents[1]
ANCHOR = "# (a new table: its register call above this line)\n"
TABLE = '''FIRST = register(ReplayTable(
    "replay_first", tuple(m for m in OPEN_METRICS if m.name in ("rse", "mass_excluded")),
    per_layer=True, layouts=("{fingerprint}",), loop="open", counted="tree_layers",
    columns=(pa.field("layers_scored", pa.int16()),), frame="first_errors"))
'''
MODE = '''

class FirstLayer(OpenLoop):
    """Open loop on each run's first scored MoE layer only, into a table of its own."""

    name, record = "first-layer", replay_metrics.TABLES["replay_first"]

    def scored_layers(self, run, layers, notes):
        return super().scored_layers(run, layers, notes)[:1]

    def constants(self) -> dict:
        return dict(layers_scored=1)


MODES[FirstLayer.name] = FirstLayer()
'''
CHECK = '''
import json
import polars as pl
from moe_spec.analysis import frames, sql
from moe_spec.catalog import replay_metrics, results, schema
from moe_spec.replay import cli, modes
assert modes.__file__.startswith({copy!r}) and replay_metrics.__file__.startswith({copy!r})
assert "first-layer" in cli.parser().format_help()
want = ["prompt_index", "prompt_id", "step", "layer", "layers_scored", "ranking", "coverage",
        "budget", "budget_mode", "price", "rse", "mass_excluded"]
assert schema.REPLAY_TABLES["replay_first"].names == want, schema.REPLAY_TABLES["replay_first"]
assert "replay_first" in results.RESULT_TABLES
code = cli.main(["--traces", {traces!r}, "--mode", "first-layer", "--ranking", "router",
                 "oracle", "--budget", "8,16", "--coverage", "truncation", "--no-progress",
                 "--threads", "1", "--output", {result!r}])
assert code == 0, code
con = sql.connect({traces!r})
assert {{"replay_first", "replay_first_all"}} <= set(sql.views(con)), sql.views(con)
stored = con.sql("SELECT * FROM replay_first").pl()
every = con.sql("SELECT * FROM replay_first_all").pl()
frame = frames.ANALYSES["first_errors"](con)
drawn = frames.all_frames(con)["first_errors"]
print("RESULT", json.dumps(dict(
    columns=stored.columns, rows=stored.height, all_rows=every.height,
    layers=stored["layer"].unique().to_list(), scored=stored["layers_scored"].unique().to_list(),
    variants=con.sql("SELECT DISTINCT table_name FROM variants").pl()["table_name"].to_list(),
    frame=frame.to_dicts(), same=frame.equals(drawn),
    open_rows=con.sql("SELECT count(*) FROM replay_open").fetchone()[0]
    if "replay_open" in sql.views(con) else 0)))
'''


def test_a_mode_with_its_own_table_is_two_files(one_prompt, tmp_path):
    from moe_spec.catalog import replay_metrics
    traces = tmp_path / "traces"
    shutil.copytree(one_prompt, traces)
    copy = tmp_path / "tree"
    for package in ("catalog", "replay"):
        shutil.copytree(ROOT / package, copy / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    registry = copy / "catalog" / "replay_metrics.py"
    toy = tuple(m for m in replay_metrics.OPEN_METRICS if m.name in ("rse", "mass_excluded"))
    line = TABLE.format(fingerprint=replay_metrics.metrics_fingerprint(toy))
    assert registry.read_text().count(ANCHOR) == 1
    registry.write_text(registry.read_text().replace(ANCHOR, line + ANCHOR))
    (copy / "replay" / "modes.py").write_text((copy / "replay" / "modes.py").read_text() + MODE)
    changed = [p.relative_to(copy) for p in sorted(copy.rglob("*.py"))
               if p.read_bytes() != (ROOT / p.relative_to(copy)).read_bytes()]
    assert changed == [Path("catalog/replay_metrics.py"), Path("replay/modes.py")]
    result = tmp_path / "replay.json"
    code = CHECK.format(copy=str(copy), traces=str(traces), result=str(result))
    done = subprocess.run([sys.executable, "-c", code], env=overlay_env(copy), cwd=copy,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.split("RESULT ", 1)[1])
    # its results: written with the table's own schema, one layer, its own key column
    assert got["columns"][:11] == ["prompt_index", "prompt_id", "step", "layer",
                                   "layers_scored", "ranking", "coverage", "budget", "price",
                                   "rse", "mass_excluded"]
    assert "budget_mode" in got["columns"]  # from the unit key (catalog.schema.REPLAY_CELL)
    assert "token_error" not in got["columns"]  # only the metrics its record declares
    assert got["rows"] == got["all_rows"] > 0 and len(got["layers"]) == 1
    assert got["scored"] == [1] and got["open_rows"] == 0  # nothing went to replay_open
    assert got["variants"] == ["replay_first"]
    # its curves frame: per ranking × budget, the declared metrics' means and rows counted
    rows = {(r["ranking"], r["budget"]): r for r in got["frame"]}
    assert set(rows) == {(r, b) for r in ("router", "oracle") for b in (8, 16)}
    assert got["same"]
    for r in rows.values():
        assert {"rse", "rse_lo", "rse_hi", "mass_excluded", "tree_layers"} <= set(r)
        assert r["rse"] >= 0 and r["tree_layers"] > 0
    summary = json.loads(result.read_text())["summary"]
    assert {row["ranking"] for row in summary} == {"router", "oracle"}
    assert all("rse" in row and "token_error" not in row for row in summary)
