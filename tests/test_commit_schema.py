"""Commit verification cannot be switched off by editing: the schema decides whether a manifest
or replay config must list its files, manifests and configs are read only as bounded regular
files, every reader checks the data against the manifest, and the held connection's and
report's identity of the traces is the readers' file version (a flipped byte with its mtime
restored is seen)."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import recommit
from helpers import QUERY, one_line

from moe_spec.analysis import query_cli, report
from moe_spec.catalog import dataset_version


@pytest.fixture
def traces(replayed, tmp_path, monkeypatch):
    monkeypatch.delenv("MOESPEC_ALLOW_LEGACY", raising=False)
    shutil.copytree(replayed[0], tmp_path / "t", symlinks=True)
    return tmp_path / "t"


def _manifest(traces):
    return sorted(traces.glob("runs/**/_manifest.json"))[0]


def _query(traces, *extra):
    return query_cli.main([QUERY, "--traces", str(traces), "--format", "csv", *extra])


def test_a_committed_manifest_without_its_file_list_is_refused(traces, capsys):
    path = _manifest(traces)
    manifest = json.loads(path.read_text())
    for key in ("files", "commit_digest"):
        manifest.pop(key)
    path.write_text(json.dumps(manifest))
    one_line(capsys, _query(traces), "_manifest.json", "trace schema 5", "recapture")
    path.write_text(json.dumps({**manifest, "schema_version": 4}))  # an older layout
    one_line(capsys, _query(traces), "predates committed file lists", "--allow-legacy")
    assert _query(traces, "--allow-legacy") == 0  # read as found, the run named
    assert "warning: run r " in capsys.readouterr().err


def test_a_replay_block_without_its_file_list_is_not_read(traces, capsys):
    for path in traces.glob("replay_open/**/_config.json"):
        state = json.loads(path.read_text())
        for block in state["blocks"]:
            block.pop("files")
        path.write_text(json.dumps(state))
    assert query_cli.main(["--schema", "--traces", str(traces)]) == 0
    out, err = capsys.readouterr()
    # left out (no replay view at all), and said so; never read as found
    assert "replay_open" not in out and "lists none" in err and "left out" in err


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "folder", "huge"])
def test_a_manifest_that_is_not_a_small_regular_file_is_one_line(traces, capsys, kind):
    path = _manifest(traces)
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "folder":
        path.mkdir()
    else:
        with open(path, "wb") as f:
            f.truncate(65 * 2**20)  # sparse: larger than any manifest
    one_line(capsys, _query(traces), "_manifest.json", "cannot be read")
    code = report.main(["--traces", str(traces), "--out", str(traces.parent / "rep")])
    one_line(capsys, code, "_manifest.json")


def _rewrite_routing(traces, change):
    part = sorted(traces.glob("routing/**/part-000000-0000.parquet"))[0]
    table = change(pq.read_table(part))
    pq.write_table(table, part)
    recommit(traces)  # as if captured so: the hash matches, only the data can tell


def _nan_probs(t):
    probs = t["router_probs"].to_pylist()
    probs[0] = [float("nan")] * len(probs[0])
    i = t.schema.get_field_index("router_probs")
    return t.set_column(i, t.schema.field(i), pa.array(probs, t.schema.field(i).type))


@pytest.mark.parametrize("change,words", [
    (_nan_probs, ("router_probs", "non-finite")),
    (lambda t: pa.concat_tables([t, t.slice(0, 1)]), ("duplicated rows",)),
])
def test_recommitted_bad_rows_are_refused_by_query(traces, capsys, change, words):
    _rewrite_routing(traces, change)
    one_line(capsys, _query(traces), "routing", *words)


def test_manifest_facts_the_data_contradicts_are_refused_by_query(traces, capsys):
    path = _manifest(traces)
    manifest = json.loads(path.read_text())
    width = len(pq.read_table(sorted(traces.glob("routing/**/*.parquet"))[0])["router_probs"][0])
    path.write_text(json.dumps({**manifest, "num_experts": width // 2}))
    recommit(traces)  # the digest made anew: only the data can tell
    one_line(capsys, _query(traces), f"num_experts {width // 2}", f"hold {width} experts")


def test_a_flipped_byte_with_its_mtime_restored_is_a_new_version(traces, capsys, tmp_path):
    out = tmp_path / "rep"
    assert report.main(["--traces", str(traces), "--out", str(out), "--threads", "1"]) == 0
    before = dataset_version(traces)
    part = sorted(traces.glob("trees/**/part-000000-0000.parquet"))[0]
    st = part.stat()
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    os.utime(part, ns=(st.st_atime_ns, st.st_mtime_ns))  # same name, size and mtime
    assert part.stat().st_size == st.st_size and part.stat().st_mtime_ns == st.st_mtime_ns
    assert dataset_version(traces) != before
    capsys.readouterr()
    code = report.main(["--traces", str(traces), "--out", str(out), "--threads", "1"])
    one_line(capsys, code, "fails its content hash")
