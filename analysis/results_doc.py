"""The generated blocks of the results pages (docs/results.md, the README): a table a bench writes
from its JSON output between two marker lines, never typed by hand.

A block named ``NAME`` that ``bench/SCRIPT`` writes lies between

    <!-- NAME: begin (bench/SCRIPT --readme; do not edit) -->
    ...
    <!-- NAME: end -->

and ``SCRIPT --render OUTPUT.json --readme PAGE [--block NAME]`` rewrites what lies between them
(:func:`add_table_options`); the text around the block is kept byte for byte. A page without
both markers (or with either twice, or the end before the begin) is refused in one line and no
page is written: a table typed by hand is never silently kept beside a generated one. The one
owner of this rule: every bench imports it from here.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

from moe_spec.catalog import atomic
from moe_spec.errors import UserError, fail


class MissingBlock(UserError, ValueError):
    """A page without exactly one begin and one end marker line of the block; one line."""


def block_markers(block: str, script: str) -> tuple[str, str]:
    """The marker lines of the results block named ``block`` that ``bench/<script>`` writes (its
    ``--block``): e.g. the README's ``sketch matrix`` (cross_domain.py)."""
    return (f"<!-- {block}: begin (bench/{script} --readme; do not edit) -->",
            f"<!-- {block}: end -->")


def replace_block(text: str, body: str, begin: str, end: str, where: str = "the page") -> str:
    """``text`` with what lies between its ``begin`` and ``end`` marker lines replaced by
    ``body`` (the markers and everything around them unchanged). :class:`MissingBlock` unless
    each marker occurs exactly once, ``begin`` first."""
    counts = (text.count(begin), text.count(end))
    if counts != (1, 1) or text.index(end) < text.index(begin):
        raise MissingBlock(f"{where} has no '{begin}' … '{end}' block (begin marker found "
                           f"{counts[0]} times, end {counts[1]}); add both marker lines, once "
                           "each and begin first, where the table belongs")
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    return f"{head}{begin}\n{body}\n{end}{tail}"


def write_block(pages: Iterable[Path], body: str, block: str, script: str) -> list[Path]:
    """Rewrite block ``block`` (of ``bench/<script>``) of every page with ``body``. Every page is
    checked before any is written (:class:`MissingBlock`), and each is replaced atomically
    (:func:`catalog.atomic.write_bytes`): a refused page leaves all of them as they were."""
    begin, end = block_markers(block, script)
    pages = [Path(p) for p in pages]
    new = [replace_block(p.read_text(), body, begin, end, str(p)) for p in pages]
    for page, text in zip(pages, new):
        atomic.write_bytes(atomic.check_target(page), text.encode())
    return pages


def write_block_or_exit(pages: Iterable[Path], body: str, block: str, script: str) -> list[Path]:
    """:func:`write_block` for a bench's command line: a refused page (or an unreadable one) is
    one line on stderr, ``<script>: error: …``, and exit status 2 (:func:`errors.fail`)."""
    try:
        return write_block(pages, body, block, script)
    except (MissingBlock, atomic.UnsafeTarget) as exc:
        raise SystemExit(fail(script, exc)) from None
    except OSError as exc:
        raise SystemExit(fail(script, f"{exc.filename}: {exc.strerror}")) from None


def add_table_options(p: argparse.ArgumentParser, block: str) -> None:
    """A bench's ``--render`` (earlier ``--output`` files, nothing computed), ``--readme`` (pages
    whose block is rewritten from the results) and ``--block`` (that block's name, ``block`` by
    default: :func:`block_markers`)."""
    p.add_argument("--render", type=Path, nargs="+", default=None,
                   help="compute nothing: read these JSON files (earlier --output, e.g. one per "
                        "model) and print the table, for --readme")
    p.add_argument("--readme", type=Path, nargs="+", default=[],
                   help="rewrite these files' --block block from the results (README.md, "
                        "docs/results.md)")
    p.add_argument("--block", default=block,
                   help=f"the name in the marker lines of the block --readme rewrites (default "
                        f"{block!r}; another name writes a second block, e.g. one study's subset)")


def read_model_outputs(paths: Iterable[Path], script: str, version: int,
                       tool: str | None = None) -> dict:
    """The ``models`` of a bench's ``--output`` files (``{"version": V, ["tool": T,] "models":
    {model: ...}}``), merged in order, for ``--render``; a file of another bench or version (or
    not JSON), or a model key two files hold (one result would silently hide the other), is one
    line on stderr, ``<script>: error: …``, and exit status 2."""
    report, source = {}, {}
    for path in paths:
        try:
            rep = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            rep = None
        if not isinstance(rep, dict) or rep.get("version") != version \
                or (tool is not None and rep.get("tool") != tool) \
                or not isinstance(rep.get("models"), dict):
            raise SystemExit(fail(script, f"{path} is not an --output of this version of "
                                          f"bench/{script}"))
        for key in rep["models"]:
            if key in source:
                raise SystemExit(fail(script, f"{source[key]} and {path} both hold {key}: render "
                                              "one of them, or rerun one under another key"))
            source[key] = path
        report.update(rep["models"])
    return report
