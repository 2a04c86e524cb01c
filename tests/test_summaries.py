"""Routing summaries: the figures they give equal the SQL over ``routing`` they replace; they are
built once per run, rebuilt when the run changes, and damage is one line naming the file."""

import shutil

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import reference_routing as ref  # noqa: I001 - tests/ module
from polars.testing import assert_frame_equal

from moe_spec.analysis import coactivation, routing, summaries
from moe_spec.analysis.sql import connect
from moe_spec.capture import cli as capture_cli
from moe_spec.catalog import Catalog, CatalogError

pytestmark = pytest.mark.slow  # end to end (captures); scripts/test.sh --fast leaves it out

CAP = ["--max-new-tokens", "10", "--no-progress"]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("sum")
    assert capture_cli.main([*CAP, "--limit", "2", "--out", str(root), "--run", "a"]) == 0
    assert capture_cli.main([*CAP, "--limit", "1", "--offset", "4", "--out", str(root),
                             "--run", "b", "--bench", "gsm8k"]) == 0
    assert capture_cli.main([*CAP, "--model", "tiny-mixtral", "--limit", "1", "--out", str(root),
                             "--run", "c"]) == 0
    return root


def _sorted(frame: pl.DataFrame) -> pl.DataFrame:
    return frame.sort(frame.columns[:-1])


def test_every_routing_figure_equals_sql_over_routing(traces):
    report = summaries.ensure(traces, workers=2)
    assert sorted(report.built) == ["a", "b", "c"] and report.tree_layers > 0
    con = connect(traces)
    tails = routing.heavy_tails(con)
    want = ref.heavy_tails(con)
    assert_frame_equal(tails.select(want.columns).sort(["model", "run", "step", "layer"]),
                       want.sort(["model", "run", "step", "layer"]), check_dtypes=False,
                       abs_tol=1e-5)
    by_layer = routing.heavy_tails_by_layer(con)
    pooled = routing.heavy_tails_summary(want, ("model", "bench", "layer"))
    assert_frame_equal(by_layer.sort(["model", "bench", "layer"]),
                       pooled.sort(["model", "bench", "layer"]), check_dtypes=False,
                       abs_tol=1e-5)
    for fn in ("coverage_curve", "activation_growth"):
        for by in ("model, bench", "model, bench, run, layer"):
            got, exp = getattr(routing, fn)(con, by), getattr(ref, fn)(con, by)
            keys = [c.strip() for c in by.split(",")] + ["budget" if "coverage" in fn else "tokens"]
            assert_frame_equal(got.select(exp.columns).sort(keys), exp.sort(keys),
                               check_dtypes=False, abs_tol=1e-9, rel_tol=1e-9)
    assert_frame_equal(routing.load_balance(con).sort(["model", "bench", "layer"]),
                       ref.load_balance(con).sort(["model", "bench", "layer"]),
                       check_dtypes=False, abs_tol=1e-12)
    for model, n in (("tiny-olmoe", 64), ("tiny-mixtral", 8)):
        for conv in ("all_pairs", "adjacent"):
            got = coactivation.coactivation(con, 1, n, conv, dict(model=model))
            topk = coactivation.topk_matrix(con, 1, dict(model=model))
            exact = coactivation.all_pairs(topk, n) if conv == "all_pairs" else \
                coactivation.adjacent_rank(topk, n)
            np.testing.assert_allclose(got.matrix, exact, atol=1e-12)
            assert (got.tokens, got.top_k) == topk.shape


def test_parallel_and_serial_builds_write_the_same_tables(traces, tmp_path):
    import pyarrow.parquet as pq
    copy = tmp_path / "copy"
    shutil.copytree(traces, copy, ignore=shutil.ignore_patterns("summaries"))
    summaries.ensure(copy, workers=1)
    summaries.ensure(traces, workers=2)
    for table in summaries.TABLES:
        for a in sorted((traces / "summaries" / table).rglob("*.parquet")):
            b = copy / a.relative_to(traces)
            assert pq.read_table(a).equals(pq.read_table(b)), a


def test_a_run_written_with_nullable_vectors_schema_3_summarises_the_same(traces, tmp_path):
    """The same routing values stored as schema 3 wrote them (list values nullable) and as
    schema 4 writes them (non-null, faster to decode) give identical summary tables."""
    root = tmp_path / "v3"
    shutil.copytree(traces, root, ignore=shutil.ignore_patterns(summaries.FOLDER))
    parts = sorted((root / "routing").rglob("part-*.parquet"))
    assert parts
    for part in parts:
        t = pq.read_table(part)
        assert not t.schema.field("router_probs").type.value_field.nullable  # as capture wrote
        old = pa.schema([pa.field(f.name, pa.list_(f.type.value_type)) if pa.types.is_list(f.type)
                         else f for f in t.schema])
        pq.write_table(t.cast(old), part, compression="zstd")
    assert pq.read_schema(parts[0]).field("router_probs").type.value_field.nullable
    from conftest import recommit
    recommit(root)  # as if schema 3 had captured them
    summaries.ensure(traces, workers=1)
    summaries.ensure(root, workers=1)
    for table in summaries.TABLES:
        for new in sorted((traces / summaries.FOLDER / table).rglob("part-0.parquet")):
            rel = new.relative_to(traces)
            assert pq.read_table(root / rel).equals(pq.read_table(new)), rel


def test_built_once_rebuilt_when_the_run_changes_dropped_when_it_goes(traces, tmp_path):
    root = tmp_path / "t"
    shutil.copytree(traces, root, ignore=shutil.ignore_patterns("summaries"))
    assert summaries.ensure(root).built
    again = summaries.ensure(root)
    assert again.built == [] and again.fresh == 3
    # a recaptured run (new run_id) is stale until rebuilt, and hidden from the views meanwhile
    run = next(r for r in Catalog(root).runs() if r.name == "b")
    manifest = dict(run.manifest, run_id="recaptured")
    from moe_spec.catalog.runs import write_manifest
    write_manifest(root, manifest)
    from conftest import recommit
    recommit(root, "b")  # (a recapture commits its manifest anew)
    con = connect(root)
    with pytest.raises(CatalogError, match="stale for run"):
        routing.coverage_curve(con)
    assert "b" not in set(con.sql("SELECT run FROM summary_layers").pl()["run"])
    assert summaries.ensure(root).built == ["b"]
    routing.coverage_curve(connect(root))
    # a deleted run's summaries go
    for table in ("runs", "sequences", "trees", "nodes", "routing", "moe_io"):
        shutil.rmtree(run.root / table / "model=tiny-olmoe" / "bench=gsm8k", ignore_errors=True)
    summaries.ensure(root)
    assert not list((root / "summaries").rglob("run=b"))


def test_damaged_routing_is_one_line_naming_the_file(traces, tmp_path):
    root = tmp_path / "t"
    shutil.copytree(traces, root, ignore=shutil.ignore_patterns("summaries"))
    part = sorted((root / "routing").rglob("run=a/part-*.parquet"))[0]
    data = bytearray(part.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = b"\xff" * 64
    part.write_bytes(bytes(data))
    with pytest.raises(CatalogError) as err:
        summaries.ensure(root, workers=1)
    assert str(part) in str(err.value) and "\n" not in str(err.value)
    assert not list((root / "summaries").rglob("run=a/*.parquet"))


@pytest.mark.parametrize("damage", ["retype", "flip", "delete"])
def test_a_damaged_summary_is_rebuilt_not_read(traces, tmp_path, damage):
    root = tmp_path / "t"
    shutil.copytree(traces, root)
    part = sorted((root / "summaries" / "summary_layers").rglob("run=a/part-0.parquet"))[0]
    pristine = pq.read_table(part)
    if damage == "retype":  # a list column stored as strings: readable, wrong type
        name = "selections"
        pq.write_table(pristine.set_column(pristine.schema.get_field_index(name), name, pa.array(
            [str(v) for v in pristine[name].to_pylist()])), part)
    elif damage == "flip":
        data = bytearray(part.read_bytes())
        data[len(data) // 2] ^= 0x10
        part.write_bytes(bytes(data))
    else:
        part.unlink()
    assert summaries.ensure(root, workers=1).built == ["a"]
    assert pq.read_table(part).equals(pristine)
    routing.coverage_curve(connect(root))


def test_a_part_reduces_to_what_counting_token_by_token_gives(tmp_path):
    """reduce_part on a shuffled part with trees of every size against plain loops over tokens."""
    from moe_spec.catalog import schema
    rng = np.random.default_rng(7)
    n, k, max_nodes = 8, 3, 6
    rows = []
    for prompt in range(2):
        for step in range(3):
            for layer in (0, 2, 5):
                for node in range(int(rng.integers(1, max_nodes + 1))):
                    probs = rng.dirichlet(np.full(n, 0.3)).astype(np.float32)
                    rows.append((prompt, step, layer, node, probs,
                                 np.argsort(-probs, kind="stable")[:k].astype(np.int16)))
    rows = [rows[i] for i in rng.permutation(len(rows))]  # the reduction must sort them
    cols = list(zip(*rows))
    types = {f.name: f.type for f in schema.TABLES["routing"]}
    part = tmp_path / "part-000000-0000.parquet"
    pq.write_table(pa.table({
        name: pa.array([v.tolist() if isinstance(v, np.ndarray) else v for v in col], types[name])
        for name, col in zip(summaries.COLUMNS, cols)}), part)
    got = summaries.reduce_part(str(part), n, k, max_nodes)

    trees: dict[tuple, list] = {}
    for prompt, step, layer, node, probs, ids in sorted(rows, key=lambda r: r[:4]):
        trees.setdefault((prompt, step, layer), []).append((probs, ids))
    assert list(zip(got.rows["prompt_index"], got.rows["step"], got.rows["layer"])) == list(trees)
    assert got.rows["nodes"].tolist() == [len(t) for t in trees.values()]
    assert got.rows["unique_experts"].tolist() == [
        len({int(e) for _, ids in t for e in ids}) for t in trees.values()]
    assert got.layers.tolist() == [0, 2, 5]
    for i, layer in enumerate((0, 2, 5)):
        tokens = [ids.tolist() for (_, _, lay), t in trees.items() if lay == layer for _, ids in t]
        both, adjacent = np.zeros((n, n), int), np.zeros((n, n), int)
        for ids in tokens:
            for a in ids:
                for b in ids:
                    both[a, b] += a != b
            for a, b in zip(ids, ids[1:]):
                adjacent[a, b] += 1
                adjacent[b, a] += 1
        sums = {key: v[i] for key, v in got.sums.items()}
        assert sums["tokens"] == len(tokens)
        assert sums["tree_layers"] == sum(lay == layer for _, _, lay in trees)
        assert sums["selections"].tolist() == np.bincount(np.ravel(tokens), minlength=n).tolist()
        assert (sums["pairs"] + sums["pairs"].T).tolist() == both.tolist()
        assert sums["adjacent"].reshape(n, n).tolist() == adjacent.tolist()
        new_at = np.zeros((max_nodes + 1, max_nodes + 1), int)
        coverage = np.zeros(n)
        for (_, _, lay), t in trees.items():
            if lay != layer:
                continue
            firsts = {}
            for node, (_, ids) in enumerate(t):
                for e in ids:
                    firsts.setdefault(int(e), node)
            for f in firsts.values():
                new_at[len(t), f] += 1
            mass = np.sum([p.astype(np.float64) for p, _ in t], axis=0)
            coverage += np.cumsum(np.sort(mass / mass.sum())[::-1])
        assert sums["new_at"].tolist() == new_at.tolist()
        np.testing.assert_allclose(sums["coverage_sum"], coverage, rtol=1e-12)


@pytest.mark.parametrize("damage", ["nan", "above_one", "short_list", "null_list", "null_element",
                                    "null_layer", "id_out_of_range"])
def test_a_part_with_hostile_values_is_refused_in_one_line(tmp_path, damage):
    """Vectors are read from the Arrow buffers, not row by row: what a row-wise reader would
    trip on (a null, a list of another length) and values no capture writes are refused."""
    from moe_spec.catalog import schema
    n, k, rows = 4, 2, 6
    probs = [[0.4, 0.3, 0.2, 0.1]] * rows
    ids = [[0, 1]] * rows
    layer = [0] * rows
    if damage == "nan":
        probs = probs[:3] + [[0.4, float("nan"), 0.2, 0.1]] + probs[4:]
    elif damage == "above_one":
        probs = probs[:3] + [[1.5, 0.3, 0.2, 0.1]] + probs[4:]
    elif damage == "short_list":
        probs = probs[:3] + [[0.4, 0.3, 0.3]] + probs[4:]
    elif damage == "null_list":
        probs = probs[:3] + [None] + probs[4:]
    elif damage == "null_element":
        probs = probs[:3] + [[0.4, None, 0.2, 0.1]] + probs[4:]
    elif damage == "null_layer":
        layer = layer[:3] + [None] + layer[4:]
    else:
        ids = ids[:3] + [[0, n]] + ids[4:]
    # as schema 3 wrote them (nullable values; readable still), so a file can hold the nulls
    types = {f.name: pa.list_(f.type.value_type) if pa.types.is_list(f.type) else f.type
             for f in schema.TABLES["routing"]}
    values = dict(prompt_index=[0] * rows, step=[0] * rows, layer=layer, node=list(range(rows)),
                  router_probs=probs, topk_ids=ids)
    part = tmp_path / "part-000000-0000.parquet"
    pq.write_table(pa.table({c: pa.array(values[c], types[c]) for c in summaries.COLUMNS}), part)
    with pytest.raises(CatalogError) as err:
        summaries.reduce_part(str(part), n, k, rows)
    assert str(part) in str(err.value) and "\n" not in str(err.value)
