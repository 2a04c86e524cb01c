"""DuckDB over every trace and replay table: one connection with a named view per table.

    >>> from analysis.sql import connect
    >>> con = connect("traces")
    >>> con.sql("SELECT bench, avg(accepted_length) FROM trees WHERE role = 'evaluation' "
    ...         "GROUP BY bench").pl()

The connection is read-only and confined to the traces folder: DuckDB may read files under
``root`` only (no other file, no network, no extension installs), its configuration is locked,
(a root on an object store, ``s3://bucket/prefix``, is read through the fsspec filesystem of
:mod:`catalog.location`, registered with DuckDB, and confined to that prefix the same way),
and :func:`run_query` — what ``query`` and the dashboard's console run user SQL through —
refuses every statement that is not a query, so a typed ``COPY``, ``ATTACH``, ``CREATE`` or
``SET`` can neither write anywhere nor change what other users see.

Routing figures read ``summary_tree_layers`` and ``summary_layers`` (:mod:`analysis.summaries`,
built once per run by :func:`analysis.summaries.ensure`) instead of scanning ``routing``. Views
read the Parquet files lazily with hive partitioning (``model``, ``bench``, ``run`` and, for
replay results, ``config`` and ``block`` become columns) and show only what is final: rows of
complete runs (with the run's ``role`` as a column) and of complete replay blocks computed from
the current capture of their run. Running captures and interrupted replays are left out.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import duckdb
import pyarrow as pa

from moe_spec import console
from moe_spec.analysis import sql_child, summaries
from moe_spec.analysis.sql_guard import (  # noqa: F401 - re-exported: sql's API
    DECODERS,
    MAX_VALUE,
    MEMORY_ENV,
    TIMEOUT_ENV,
    QueryRefused,
    QueryTimeout,
    check_query,
    confine,
    sql_limits,
)
from moe_spec.catalog import Catalog, CatalogError, location, partition_value, reader, schema
from moe_spec.catalog.replay_metrics import BATCH_TABLE, OPEN_TABLE
from moe_spec.catalog.results import RESULT_TABLES, complete_blocks
from moe_spec.catalog.runs import PART_GLOB, WHOLE_PART
from moe_spec.policy import index  # torch-free: the budget modes (FIXED)

VIEWS = (*schema.TRACE_TABLES, schema.ROUTING_IDS, "runs", "quality", *RESULT_TABLES,
         *summaries.TABLES, *schema.BATCH_PROFILE_TABLES)


_WARNED: set[str] = set()


def warn(line: str) -> None:
    """Say on stderr, once per process, what a view leaves out and how to fix it."""
    if line not in _WARNED:
        _WARNED.add(line)
        print(f"warning: {line}", file=sys.stderr)


# --- what the views read: committed files only -------------------------------------------------
SETTING_COLUMNS = {  # runs view column -> (capture setting, Arrow type): the settings that make
    # two runs of one model and benchmark different data, as columns joinable from every table
    "max_new_tokens": ("max_new_tokens", pa.int64()), "temperature": ("temperature", pa.float64()),
    "top_p": ("top_p", pa.float64()), "sampling_top_k": ("top_k", pa.int64()),
    "tree_total_tokens": ("total_tokens", pa.int64()), "tree_depth": ("depth", pa.int64()),
    "tree_top_k": ("tree_top_k", pa.int64()), "batch_size": ("batch_size", pa.int64()),
    "seed": ("seed", pa.int64()), "offset": ("offset", pa.int64()),
    "budget": ("budget", pa.int64()), "online_ranking": ("ranking", pa.string()),
    "online_coverage": ("coverage", pa.string()), "chat_template": ("chat_template", pa.bool_()),
}


def _storage_text(manifest: dict) -> str | None:
    s = manifest.get("storage")
    if not isinstance(s, dict):
        return None
    layers = s.get("layers")
    every = layers == manifest.get("moe_layers")
    return (f"{'all' if every else len(layers or [])} MoE layer(s), passes {s.get('passes')}, "
            f"{s.get('dtype')}, output {s.get('output')}")


def runs_table(runs: list, root: Path) -> pa.Table:
    """One row per complete run: identity, role, the model's facts and every capture setting
    that changes the data, as columns (the ``runs`` view)."""
    rows = []
    for r in runs:
        m, st = r.manifest, r.settings
        row = dict(model=partition_value(r.model), bench=r.bench, run=r.name, role=r.role,
                   kind=r.kind, source_format=r.source_format,
                   run_id=r.run_id, status=m["status"], model_name=r.model,
                   model_location=m.get("model_location"), draft=m.get("draft"),
                   num_experts=m.get("num_experts"), top_k=m.get("top_k"),
                   num_layers=m.get("num_layers"), moe_layers=m.get("moe_layers"),
                   hidden_size=m.get("hidden_size"),
                   dtype=str(m.get("dtype") or "").removeprefix("torch.") or None,
                   device=m.get("device"), prompts=m.get("prompts_total",
                                                          len(m.get("prompt_ids", []))),
                   storage=_storage_text(m), schema_version=m.get("schema_version"),
                   committed=r.committed is not None,
                   settings=json.dumps(st, sort_keys=True),
                   summarised=summaries.is_fresh(root, r))
        for column, (key, _) in SETTING_COLUMNS.items():
            value = st.get(key, 1 if key == "batch_size" else None)
            row[column] = value if not isinstance(value, (list, dict)) else json.dumps(value)
        rows.append(row)
    fields = [(c, pa.string()) for c in ("model", "bench", "run", "role", "kind",
                                         "source_format", "run_id", "status", "model_name",
                                         "model_location", "draft")]
    fields += [("num_experts", pa.int64()), ("top_k", pa.int64()), ("num_layers", pa.int64()),
               ("moe_layers", pa.list_(pa.int64())), ("hidden_size", pa.int64()),
               ("dtype", pa.string()), ("device", pa.string()), ("prompts", pa.int64()),
               ("storage", pa.string()), ("schema_version", pa.int64()),
               ("committed", pa.bool_()), ("settings", pa.string()), ("summarised", pa.bool_())]
    fields += [(c, t) for c, (_, t) in SETTING_COLUMNS.items()]
    return pa.Table.from_pylist(rows, schema=pa.schema(fields))


VARIANT_FIELDS = [  # the columns that say which variant a replay result row is (unit keys)
    ("variant", pa.string()), ("mode", pa.string()), ("ranking_version", pa.int64()),
    ("calibration", pa.string()), ("calibration_run_ids", pa.string()),
    ("token_aware_starts", pa.bool_()), ("batch_seed", pa.int64()), ("dtype", pa.string()),
    ("means_version", pa.int64()), ("budget_mode", pa.string()),
    ("committed_at", pa.string())]
DEFAULT_VARIANT_RULE = ("one whole variant per curve (run, ranking, coverage, batch size, budget "
                        "mode: fixed and each adaptive mode are separate curves): the "
                        "one covering the most layers, then the most budgets at all of those "
                        "layers, then the calibrated one, the one replayed in the run's captured "
                        "dtype, the oracle's with the token-aware starts, batch seed 0, the most "
                        "recently computed; a budget that variant lacks is a gap, never another "
                        "variant's point")


def variant_columns(unit: dict, committed_at: str | None, config: str) -> dict:
    """A result unit's key (catalog.results) as readable columns."""
    cal = unit.get("calibration") or []
    return dict(variant=config, mode=unit.get("mode"), ranking_version=unit.get("version", 1),
                calibration=",".join(c[0] for c in cal) or None,
                calibration_run_ids=",".join(c[1] for c in cal) or None,
                token_aware_starts=bool(unit.get("token_aware_starts")),
                batch_seed=unit.get("batch_seed"), dtype=unit.get("dtype", "float32"),
                means_version=unit.get("means"), budget_mode=budget_mode(unit),
                committed_at=committed_at)


def budget_mode(unit: dict) -> str:
    """A result unit's budget mode: its key's, ``fixed`` for keys stored before it existed."""
    return unit.get("budget_mode") or index.FIXED


def _preference(unit: dict, captured_dtype: str, committed_at: str | None) -> tuple:
    """How a variant ranks after its coverage (:data:`DEFAULT_VARIANT_RULE`): higher wins."""
    return (bool(unit.get("calibration")), unit.get("dtype", "float32") == captured_dtype,
            bool(unit.get("token_aware_starts")),
            unit.get("batch_seed", 0) == 0, committed_at or "", json.dumps(unit, sort_keys=True))


def curve_of(block: dict) -> tuple:
    """The curve a result block belongs to: (table, model, bench, run, ranking, coverage, batch
    size, budget mode). Every variant (``config``) of one curve is one experiment; a view draws
    one. Fixed and adaptive budgets are never one curve."""
    unit = block["unit"] if isinstance(block.get("unit"), dict) else {}
    return (block["table"], block["model"], block["bench"], block["run"], unit.get("ranking"),
            unit.get("coverage"), unit.get("batch_size", 1), budget_mode(unit))


def selects(block: dict, chosen: tuple[str, ...]) -> bool:
    """Whether a user's variant choice names this block's variant: its ``config`` hash (the
    ``variant`` column) or its calibration runs (``calibration``, comma-joined names)."""
    unit = block["unit"] if isinstance(block.get("unit"), dict) else {}
    cal = ",".join(c[0] for c in unit.get("calibration") or [])
    return block["config"] in chosen or (bool(cal) and cal in chosen)


def variant_cells(blocks: list[dict]) -> tuple[list[int | None], list[int]]:
    """(layers, budgets) of one variant's blocks: every layer any block covers (None: closed
    loop), and the budgets stored at every one of those layers (a budget held at some layers
    only is a gap: its mean would be over other layers)."""
    layers = sorted({x for b in blocks for x in (b.get("layers") or [None])},
                    key=lambda x: -1 if x is None else x)
    held: dict[int, set] = {}
    for b in blocks:
        for budget in b.get("budgets") or []:
            held.setdefault(budget, set()).update(b.get("layers") or [None])
    return layers, sorted(budget for budget, at in held.items() if at >= set(layers))


def default_cells(blocks: list[dict], dtypes: dict, chosen: tuple[str, ...] = ()) -> list[dict]:
    """Of every stored cell, those of the one variant per curve (:func:`curve_of`) the default
    views show (:data:`DEFAULT_VARIANT_RULE`): the whole variant, never a cell from another.
    ``dtypes``: (model, bench, run) -> captured dtype; ``chosen``: variants a user picked
    (:func:`selects`), which win their curve."""
    curves: dict[tuple, dict[str, list[dict]]] = {}
    for b in blocks:
        curves.setdefault(curve_of(b), {}).setdefault(b["config"], []).append(b)
    out = []
    for variants in curves.values():
        def rank(config: str) -> tuple:
            mine = variants[config]
            layers, budgets = variant_cells(mine)
            unit = mine[0]["unit"] if isinstance(mine[0].get("unit"), dict) else {}
            latest = max((b.get("committed_at") or "" for b in mine), default="")
            captured = dtypes.get((mine[0]["model"], mine[0]["bench"], mine[0]["run"]), "float32")
            return (selects(mine[0], chosen), len(layers), len(budgets),
                    *_preference(unit, captured, latest))
        best = variants[max(variants, key=rank)]
        layers, budgets = variant_cells(best)
        for b in best:
            for layer in (b.get("layers") or [None]):
                for budget in b.get("budgets") or []:
                    if budget in budgets:
                        out.append(dict(table=b["table"], model=b["model"], bench=b["bench"],
                                        run=b["run"], config=b["config"], block=b["block"],
                                        budget=budget, layer=-1 if layer is None else layer))
    return out


def variant_label(row: dict) -> str:
    """A variant (a row of the ``variants`` view) in a few words: its curve, then what makes it
    this variant (calibration, dtype, ranking version, mode, batch seed, when computed)."""
    curve = f"{row['ranking']}, {row['coverage']}" + (
        f", b = {row['batch_size']}" if (row.get("batch_size") or 1) > 1 else "") + (
        f", {row['budget_mode']}" if (row.get("budget_mode") or index.FIXED) != index.FIXED
        else "")
    what = [f"calibrated on {row['calibration']}" if row.get("calibration") else
            "uncalibrated", str(row.get("dtype") or "float32")]
    if (row.get("ranking_version") or 1) != 1:
        what.append(f"v{row['ranking_version']}")
    if row.get("batch_seed") not in (None, 0):
        what.append(f"batch seed {row['batch_seed']}")
    if row.get("token_aware_starts"):
        what.append("token-aware starts")
    when = str(row.get("committed_at") or "")[:16].replace("T", " ")
    return f"{curve}: {', '.join(what)}" + (f" ({when})" if when else "") + \
        f" [{row['variant']}]"


def several_variants(con: duckdb.DuckDBPyConnection) -> list[dict]:
    """The rows of the ``variants`` view whose curve has more than one variant (what a page's
    variant selector offers), empty without replay results."""
    if "variants" not in views(con):
        return []
    return con.sql("SELECT * FROM variants WHERE curve_variants > 1 ORDER BY table_name, "
                   "ranking, coverage, batch_size, budget_mode, committed_at").pl().to_dicts()


def results_per_run(con: duckdb.DuckDBPyConnection) -> dict[str, int]:
    """Run -> the replay result cells the default views draw of it (what a page prefers to
    open on)."""
    return dict(con.execute("SELECT run, count(*) FROM _default_cells GROUP BY run").fetchall())


def _result_blocks(root: Path, runs: list) -> list[dict]:
    """Complete blocks of the current captures of ``runs`` (their commit records checked)."""
    prompts = {(partition_value(r.model), r.bench, r.name): (r.run_id, r.prompt_indices())
               for r in runs}
    skipped: list[str] = []  # torn result configs: left out, and said so
    blocks = []
    for table in RESULT_TABLES:
        for b in complete_blocks(root, table, skipped):
            current = prompts.get((b["model"], b["bench"], b["run"]))
            if current is None or (b["run_id"], b["prompts"]) != current:
                continue
            if isinstance(b.get("unit"), dict):
                blocks.append(dict(b, table=table))
    for line in skipped:
        warn(line)
    return blocks


def _files(root: Path, runs: list, roles) -> tuple[dict[str, list[str]], list[dict]]:
    """table -> the files its view reads (committed, verified), and the result blocks."""
    from moe_spec.catalog.results import block_files
    files: dict[str, list] = {name: [] for name in VIEWS}
    # (runs without a commit record are read only on --allow-legacy, warned: catalog.runs)
    for r in runs:
        for table in schema.run_tables(r.kind):
            paths = r.files(table)
            if r.committed is None and paths:
                reader.check_paths(paths, table)  # types, from the footers
            files[table] += paths
        part = r.dir("quality") / WHOLE_PART  # evaluate writes it whole
        if part.is_file():
            files["quality"].append(part)
        if summaries.is_fresh(root, r):
            for table in summaries.TABLES:
                files[table].append(summaries.part_path(root, table, r))
        elif summaries.part_path(root, "summary_layers", r).parent.is_dir():
            warn(f"the routing summaries of run {r.name} are out of date or damaged: the "
                 "summary_layers and summary_tree_layers views leave that run out; run `report` "
                 "to rebuild them")
    blocks = _result_blocks(root, runs)
    for b in blocks:
        files[b["table"]] += block_files(b["folder"], b.get("files"), root)
    for table in schema.BATCH_PROFILE_TABLES:  # measurements, not runs: one file each, all kept
        files[table] = sorted((location.root(root) / table).glob(f"model=*/bench=*/run=*/"
                                                                  f"{PART_GLOB}"))
    return {t: [location.display(p) for p in ps] for t, ps in files.items()}, blocks


def _scan(paths: list[str]) -> str:
    listed = ", ".join("'" + p.replace("'", "''") + "'" for p in paths)
    return (f"read_parquet([{listed}], hive_partitioning = true, union_by_name = true, "
            "hive_types_autocast = false)")


def connect(root: str | Path = "traces", database: str = ":memory:",
            roles: tuple[str, ...] | None = None,
            runs: tuple[str, ...] | None = None,
            variants: tuple[str, ...] = ()) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with a view for every table found under ``root``; ``roles`` limits
    every view to runs of those roles (default: all, with ``role`` as a column), ``runs`` to
    the runs of those names (a page's chosen setting), ``variants`` names the replay variants
    a user picked (``config`` hashes or calibration run names, :func:`selects`): each wins its
    curve in the default views, and every frame drawn from them follows.

    Views read exactly the files runs and replay blocks committed (:mod:`catalog.commit`),
    each verified first (content hash, cached per file version): anything else in the folders
    is ignored, and a committed file that changed is refused in one line naming it. Replay
    result tables come twice: ``replay_open_all`` (every variant, each row saying which:
    ranking version, calibration, mode, batch seed, dtype, …) and ``replay_open`` (one
    variant per curve, :data:`DEFAULT_VARIANT_RULE`, the one owner of that rule: frames,
    pages and reports read these views); the ``variants`` view lists them."""
    root = location.root(root)
    con = _open(root, database)
    names = list(runs) if runs is not None else None
    runs = Catalog(root).runs(roles=roles, names=names, kinds=None) if names != [] else []
    files, blocks = _files(root, runs, roles)
    for name, table in (("_complete_runs", runs_table(runs, root)),
                        ("_blocks", _variants_table(blocks)),
                        ("_default_cells", _default_cells_table(blocks, runs, tuple(variants)))):
        _create_table(con, name, table)  # tables, not registrations: cursors must see them too
    if runs or (root / "runs").is_dir():  # (a folder with no capture at all: no views)
        con.execute("CREATE VIEW runs AS SELECT * EXCLUDE (summarised) FROM _complete_runs")
    if blocks:  # the variants of the replay results there are
        _create_variants_view(con)
    _create_empty_views(con, root, files)
    for name in VIEWS:
        if name != "runs" and files.get(name):
            _create_views(con, name, _view_bodies(name, _scan(files[name])))
    lock_down(con, root)
    return con


def _open(root: Path, database: str) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection that can read ``root`` (local or remote), on this process's CPUs."""
    con = duckdb.connect(database)
    remote = location.duckdb_filesystem(root)
    if remote is not None:
        con.register_filesystem(remote)
    con.execute(f"SET threads = {console.threads.current()}")  # never more than this process's CPUs
    return con


def _create_table(con: duckdb.DuckDBPyConnection, name: str, table: pa.Table) -> None:
    """Copy an Arrow table into the connection as table ``name``."""
    con.register("_arrow", table)
    con.execute(f"CREATE TABLE {name} AS SELECT * FROM _arrow")
    con.unregister("_arrow")


def _variants_table(blocks: list[dict]) -> pa.Table:
    """One row per replay result block: its cell and which variant it is (``_blocks``)."""
    return pa.Table.from_pylist(
        [dict(table_name=b["table"], model=b["model"], bench=b["bench"], run=b["run"],
              config=b["config"], block=b["block"], ranking=b["unit"].get("ranking"),
              coverage=b["unit"].get("coverage"), batch_size=b["unit"].get("batch_size", 1),
              **variant_columns(b["unit"], b.get("committed_at"), b["config"]))
         for b in blocks],
        schema=pa.schema([("table_name", pa.string()), ("model", pa.string()),
                          ("bench", pa.string()), ("run", pa.string()), ("config", pa.string()),
                          ("block", pa.string()), ("ranking", pa.string()),
                          ("coverage", pa.string()), ("batch_size", pa.int64()),
                          *VARIANT_FIELDS]))


def _default_cells_table(blocks: list[dict], runs: list, chosen: tuple[str, ...] = ()
                         ) -> pa.Table:
    """The cells the default result views show (``_default_cells``): one variant per curve."""
    dtypes = {(partition_value(r.model), r.bench, r.name):
              str(r.manifest.get("dtype") or "float32").removeprefix("torch.") for r in runs}
    return pa.Table.from_pylist(default_cells(blocks, dtypes, chosen), schema=pa.schema(
        [(c, pa.string()) for c in ("table", "model", "bench", "run", "config", "block")]
        + [("budget", pa.int64()), ("layer", pa.int64())]))


def _create_variants_view(con: duckdb.DuckDBPyConnection) -> None:
    """The ``variants`` view: each replay variant, its blocks, and whether the views show it."""
    columns = ", ".join(c for c, _ in VARIANT_FIELDS if c != "committed_at")
    con.execute(f"""CREATE VIEW variants AS SELECT *, count(*) OVER (PARTITION BY table_name,
        model, bench, run, ranking, coverage, batch_size, budget_mode) AS curve_variants FROM (
        SELECT table_name, model, bench, run, ranking, coverage, batch_size, {columns},
            max(committed_at) AS committed_at, count(*) AS blocks,
            bool_or(EXISTS (SELECT 1 FROM _default_cells d WHERE d.config = b.config
                            AND d.block = b.block AND d.run = b.run AND d."table" = b.table_name))
            AS shown_by_default
            FROM _blocks b GROUP BY ALL) ORDER BY ALL""")


def _create_empty_views(con: duckdb.DuckDBPyConnection, root: Path,
                        files: dict[str, list[str]]) -> None:
    """An empty view for each trace table whose runs are all running: empty, not absent."""
    for name in (*schema.TRACE_TABLES, schema.ROUTING_IDS):
        if not files.get(name) and (root / name).is_dir():
            empty = schema.ALL_TABLES[name].empty_table()
            for column in ("model", "bench", "run", "role"):
                empty = empty.append_column(column, pa.array([], pa.string()))
            _create_table(con, f"_empty_{name}", empty)
            con.execute(f"CREATE VIEW {name} AS SELECT * FROM _empty_{name}")


def _result_views(name: str, scan: str) -> list[tuple[str, str]]:
    """A replay result table's two views: ``<name>_all`` (every variant, each row saying which)
    and ``<name>`` (the default variant of each cell)."""
    per_layer = name in (OPEN_TABLE, BATCH_TABLE)
    variant_select = ", ".join(f"v.{c}" for c, _ in VARIANT_FIELDS if c != "variant")
    # budget_mode comes from the unit's key (rows stored before the column existed lack it)
    rows = f"(SELECT COLUMNS(lambda c: c <> 'budget_mode') FROM {scan})"
    body = (f"SELECT t.*, {variant_select} FROM {rows} t JOIN _blocks v "
            "USING (model, bench, run, config, block)")
    cell = "t.budget = d.budget" + (" AND t.layer = d.layer" if per_layer else "")
    default = (f"SELECT t.* FROM {name}_all t SEMI JOIN (SELECT * FROM _default_cells "
               f"WHERE \"table\" = '{name}') d ON t.model = d.model AND t.bench = d.bench "
               f"AND t.run = d.run AND t.config = d.config AND t.block = d.block AND "
               f"{cell}")
    return [(f"{name}_all", body), (name, default)]


def _view_bodies(name: str, scan: str) -> list[tuple[str, str]]:
    """(view, SELECT) for each view of table ``name``, reading the files of ``scan``."""
    if name in RESULT_TABLES:
        return _result_views(name, scan)
    if name in schema.BATCH_PROFILE_TABLES:  # measurements, not runs: every one
        return [(name, f"SELECT * FROM {scan}")]
    return [(name, f"SELECT t.*, c.role FROM {scan} t JOIN _complete_runs c "
                   "USING (model, bench, run)")]


def _create_views(con: duckdb.DuckDBPyConnection, name: str,
                  views_sql: list[tuple[str, str]]) -> None:
    """Create table ``name``'s views; a damaged summary is left out (warned), any other
    unreadable table refused in one line."""
    for view, body in views_sql:
        try:
            con.execute(f"CREATE OR REPLACE VIEW {view} AS {body}")
        except duckdb.Error as exc:  # DuckDB reads the files' schemas here
            first = str(exc).strip().splitlines()[0]
            if name in summaries.TABLES:  # derived data: leave it out, never fail the rest
                warn(f"the {name} view is left out (a summary file is damaged: "
                     f"{first[:200]}); run `report` to rebuild it")
                continue
            raise CatalogError(f"the {name} table cannot be read ({first[:300]}); "
                               "recapture the affected run") from None


def matching(match: dict | None, *conditions: str) -> tuple[str, list]:
    """A WHERE condition for ``column = value`` pairs (and fixed ``conditions``), the values as
    DuckDB parameters: names and partition values (a model folder may hold a quote) never become
    SQL text. Columns are the caller's own names, never user input."""
    match = match or {}
    for column in match:
        if not column.isidentifier():
            raise ValueError(f"not a column name: {column!r}")
    parts = [*conditions, *(f"{column} = ?" for column in match)]
    return " AND ".join(parts) or "true", list(match.values())


def hidden_variants(con: duckdb.DuckDBPyConnection, sql: str) -> list[str]:
    """Notes for a query that reads a default-variant view while other variants exist: which
    view holds them all, and the rule that picked."""
    words = set(re.findall(r"[A-Za-z_]+", sql.lower()))
    notes = []
    present = views(con)
    for name in RESULT_TABLES:
        if name not in words or name not in present or "variants" not in present:
            continue
        hidden = con.execute("SELECT count(*) FROM variants WHERE table_name = ? AND NOT "
                             "shown_by_default", [name]).fetchone()[0]
        several = con.execute("SELECT count(*) FROM (SELECT run, ranking, coverage, batch_size "
                              "FROM variants WHERE table_name = ? GROUP BY ALL "
                              "HAVING count(DISTINCT variant) > 1)", [name]).fetchone()[0]
        if hidden or several:
            notes.append(f"{name} shows {DEFAULT_VARIANT_RULE}; {name}_all holds every "
                         "variant, the variants view lists them")
    return notes



_REMOTE: dict[str, object] = {}  # allowed prefix -> the remote root a connection reads


def lock_down(con: duckdb.DuckDBPyConnection, root: Path, memory: str | None = None) -> None:
    """Confine ``con`` to ``root`` (:func:`analysis.sql_guard.confine`: files under it only, no
    network, extension installs or spill folder, a memory limit, configuration locked), checked
    afterwards: DuckDB must report the traces root as the one folder it may read."""
    prefix = location.allowed_prefix(root)
    if location.is_remote(root):
        _REMOTE[prefix] = root
    confine(con, prefix, memory)
    allowed = con.execute("SELECT current_setting('allowed_directories')").fetchall()[0][0]
    if [a.rstrip("/") for a in allowed] != [prefix.rstrip("/")]:
        raise CatalogError(f"the SQL connection would read {allowed}, not the traces root alone; "
                           "this DuckDB version is not supported")


def _recipe(con: duckdb.DuckDBPyConnection) -> dict:
    """What the child needs to rebuild ``con`` (a confined connection or a cursor of one): its
    tables as Arrow IPC, its views' definitions in creation order, the folder it may read."""
    allowed = con.execute("SELECT current_setting('allowed_directories')").fetchall()[0][0]
    if len(allowed) != 1:
        raise CatalogError("user SQL runs only on a connection confined to one traces root "
                           "(analysis.sql.connect)")
    tables = {}
    for (name,) in con.execute("SELECT table_name FROM duckdb_tables() WHERE NOT temporary AND "
                               "NOT internal ORDER BY table_oid").fetchall():
        sink = pa.BufferOutputStream()
        table = con.sql(f'SELECT * FROM "{name}"').to_arrow_table()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        tables[name] = sink.getvalue().to_pybytes()
    views_sql = [sql for (sql,) in con.execute(
        "SELECT sql FROM duckdb_views() WHERE NOT internal AND NOT temporary "
        "ORDER BY view_oid").fetchall()]
    return dict(prefix=allowed[0], root=_REMOTE.get(allowed[0]), tables=tables, views=views_sql)


def run_query(con: duckdb.DuckDBPyConnection, sql: str, timeout: float | None = None,
              memory: str | None = None) -> pa.Table:
    """Run user SQL: queries only (``SELECT``, ``WITH … SELECT``, ``EXPLAIN``) calling allowed
    functions, never a statement that writes a file, attaches a database, or changes views or
    settings; in a child process under operating-system limits (:mod:`analysis.sql_child`):
    the result as an Arrow table, or one line when it is refused or stopped at its memory or
    time limit (:func:`sql_limits`)."""
    memory, timeout = sql_limits(memory, timeout)
    request = dict(_recipe(con), sql=sql)
    return sql_child.run(request, memory, timeout, console.threads.current())


def views(con: duckdb.DuckDBPyConnection) -> list[str]:
    return [r[0] for r in con.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_type = 'VIEW' "
        "ORDER BY table_name").fetchall()]


def damaged_file(root: str | Path, sql: str, error: duckdb.Error) -> str | None:
    """After a query failed reading data (DuckDB names no file for a corrupt page), the first
    Parquet file of the views ``sql`` mentions that does not read back with its page checksums,
    as one line for the user; None when the error is not about the data or no file is found."""
    if isinstance(error, (duckdb.ParserException, duckdb.BinderException,
                          duckdb.CatalogException)):
        return None
    root = location.root(root)
    words = set(re.findall(r"[A-Za-z_]+", sql.lower()))
    for name in VIEWS:
        if name not in words:
            continue
        folder = root / summaries.FOLDER / name if name in summaries.TABLES else root / name
        for path in sorted(folder.rglob("*.parquet")):
            try:
                location.read_table(path, page_checksum_verification=True)
            except (pa.ArrowException, OSError) as exc:
                why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                why = why.replace(str(path), "the file")[:200]
                return (f"{path}: corrupt or unreadable {name} file ({why}); recapture the run "
                        "(or delete the file if it is a replay result and replay again)")
    return None
