"""A capture's default run name: the run of the same settings if there is one (a rerun resumes
it), else a readable new name. Torch-free: ``capture`` decides it before loading anything."""

from __future__ import annotations

import json
import time

from moe_spec.capture.settings import CaptureSettings
from moe_spec.catalog import schema
from moe_spec.catalog.writer import RunWriter


def default_run(settings: CaptureSettings, out, model: str) -> str:
    """The run a capture without ``--run`` writes: a run of ``model`` and the benchmark captured
    with the same settings (:meth:`CaptureSettings.identity`), complete or not, so a rerun
    resumes it; else a new readable name (:meth:`CaptureSettings.readable_run_name`, today's
    date in UTC), with the settings digest appended where another run already has that name."""
    bench_dir = RunWriter(out, model, settings.bench, "x").table_dir("runs").parent
    identity, names = settings.identity(), set()
    try:
        folders = sorted(bench_dir.iterdir(), key=lambda f: f.name) if bench_dir.exists() else []
    except OSError:
        folders = []
    for folder in folders:
        if not folder.name.startswith("run="):
            continue
        names.add(folder.name[4:])
        try:
            manifest = json.loads((folder / schema.MANIFEST).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(manifest, dict) and manifest.get("settings") == identity:
            return folder.name[4:]
    day = time.strftime("%Y%m%d", time.gmtime())
    name = settings.readable_run_name(model, day)
    return name if name not in names else f"{name}-{settings.digest()}"
