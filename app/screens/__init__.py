"""The dashboard's pages, one module each; every module in this folder is a page.

A page module declares ``TITLE`` (its name in the navigation), ``ORDER`` (its place there,
lowest first) and ``draw()`` (the page), and ends with ``if __name__ == "__main__": draw()``:
Streamlit runs the file itself as the page (app/main.py gives it the URL ``/<name>``, its file
name with ``-`` for ``_``). Nothing else lists the pages: :data:`PAGES` is found here, so adding
a page is adding its module (docs/architecture.md, "Add a page").

The folder is not called ``pages/``: Streamlit would treat that name as its older multipage
layout and run a deep-linked page without app/main.py.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, NamedTuple


class Screen(NamedTuple):
    """A registered page: its title in the navigation and the function that draws it."""

    title: str
    draw: Callable[[], None]


def discover(package: str = __name__) -> dict[str, Screen]:
    """Every module of ``package`` as a page, keyed by module name, in navigation order
    (``ORDER``, then name). A module that is not a page (no ``TITLE``, ``ORDER`` or ``draw``)
    is refused by name, so a stray file never silently drops out of the navigation."""
    found = []
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        module = importlib.import_module(f"{package}.{info.name}")
        missing = [a for a in ("TITLE", "ORDER", "draw") if not hasattr(module, a)]
        if missing:
            raise TypeError(f"{module.__file__} is in the pages' folder but is no page: it lacks "
                            f"{', '.join(missing)}")
        found.append((module.ORDER, info.name, Screen(module.TITLE, module.draw)))
    return {name: screen for _, name, screen in sorted(found)}


# page module name (app/screens/<name>.py) -> (title, draw), in navigation order
PAGES = discover()
