"""Column types of trace tables as stored: what a Parquet file must hold to be read as a part of
a table (vectors in any storage dtype, lists compared up to the nullability of their values),
and the one-line reason a reader gives for a file it cannot read. Pyarrow only; no imports of
the rest of the catalog, so :mod:`catalog.runs` and :mod:`catalog.reader` both use it."""

from __future__ import annotations

import pyarrow as pa

from moe_spec.catalog import location, schema

VECTOR_TYPES = {pa.float32(), pa.float16(), pa.uint16()}  # storage dtypes (catalog.schema)


def expected_types(t: pa.Table, table: str) -> pa.Table:
    """Refuse columns whose type is not the schema's (vectors: any storage dtype)."""
    expected = schema.ALL_TABLES[table]
    for name in t.column_names:
        want, got = expected.field(name).type, t.schema.field(name).type
        if schema.same_type(got, want):
            continue
        if pa.types.is_list(want) and pa.types.is_list(got) and table == "moe_io" \
                and got.value_type in VECTOR_TYPES:
            continue
        if pa.types.is_null(got):
            continue
        raise ValueError(f"column {name} is {got}, the schema says {want}")
    return t


def reason(exc: Exception, path) -> str:
    """The reader's complaint in a few words: first line, the (already named) path cut out."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    first = first.replace(f"'{path}'", "the file").replace(str(path), "the file")
    return first[:120]



def check_footer(path, table: str) -> None:
    """A file's footer has ``table``'s column types (ValueError or an Arrow error otherwise)."""
    found = location.read_schema(path)
    known = [n for n in found.names if n in schema.ALL_TABLES[table].names]
    expected_types(found.empty_table().select(known), table)
