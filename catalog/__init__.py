"""The trace catalog: schema, runs and roles, partition paths, names, reading and the one atomic
write. Every other package finds and writes traces through here (pyarrow only, no torch)."""

from moe_spec.catalog.names import InvalidName, check_name, partition_value
from moe_spec.catalog.runs import Catalog, CatalogError, Run, dataset_version, read_manifest, run_dir
from moe_spec.catalog.schema import ROLES, SCHEMA_VERSION

__all__ = ["Catalog", "CatalogError", "InvalidName", "ROLES", "Run", "SCHEMA_VERSION",
           "check_name", "dataset_version", "partition_value", "read_manifest", "run_dir"]
