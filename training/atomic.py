"""Write a whole output folder atomically."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_folder(out: Path):
    """Yield a temporary folder beside ``out``; swap it in for ``out`` only if the block
    succeeds, so a crash or kill never leaves a half-written model where a complete one was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
