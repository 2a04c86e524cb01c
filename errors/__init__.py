"""User errors: the one base class every project error a user can fix derives from, and the one
way a command line tool reports it.

A user error's message is one line that names the problem and what to do about it. Each package
keeps its own error class (``CatalogError``, ``CaptureError``, …) for ``except`` clauses that
mean that package, derived from :class:`UserError` and from the builtin it always had, so older
``except ValueError`` / ``except OSError`` clauses still catch it. This package imports nothing,
so every layer may import it (tests/test_layering.py).
"""

from __future__ import annotations

import sys

USAGE = 2  # exit status of a refused command: a user error, as argparse's own


class UserError(Exception):
    """A problem the user can fix; ``str(exc)`` is one line for them."""


def fail(prog: str, problem: BaseException | str, status: int = USAGE) -> int:
    """Print ``<prog>: error: <problem>`` on stderr (argparse's form) and return ``status``, the
    exit status a CLI's ``main`` returns: ``return fail("capture", exc)``."""
    print(f"{prog}: error: {problem}", file=sys.stderr)
    return status
