"""Command names as the user can type them.

Hints (``run `capture` first``) and ``--help`` examples name other commands of the workbench.
A bare name works only where the virtual environment's ``bin`` folder is on ``PATH`` (an active
venv, or a ``pip install`` into the system); otherwise :func:`command` gives the path that works:
``.venv/bin/replay`` below the current folder, else the absolute path.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path

# pyproject.toml's [project.scripts] (a test checks they agree)
COMMANDS = ("capture", "replay", "query", "report", "evaluate", "profile-target", "profile-batch",
            "import-routing", "export-routing", "workbench-app", "inspect-model", "train-tiny",
            "train-draft")


def bin_dir() -> Path:
    """The folder the workbench's commands were installed in: that of the running command, or
    of the running interpreter (``python -m …``, tests)."""
    script = Path(os.path.abspath(sys.argv[0])) if sys.argv and sys.argv[0] else None
    if script is not None and script.name in COMMANDS and script.is_file():
        return script.parent
    return Path(os.path.abspath(sys.executable)).parent  # a venv's python, not its target


@functools.lru_cache(maxsize=None)
def command(name: str) -> str:
    """``name`` if typing it runs this installation's command, else a path to it that does."""
    exe = bin_dir() / name
    if not exe.is_file():
        return name  # not installed as a script here: the bare name is all we know
    found = shutil.which(name)
    if found and os.path.samefile(found, exe):
        return name
    try:
        rel = exe.relative_to(Path.cwd())
    except ValueError:
        return str(exe)
    return str(rel) if len(rel.parts) > 1 else f"./{rel}"


def commandline(line: str) -> str:
    """An example command line with its leading command name made typeable."""
    head, sep, rest = line.partition(" ")
    return command(head) + sep + rest if head in COMMANDS else line
