"""Names that become paths: run names and hive partition values.

A run name is one path component: letters, digits, ``.``, ``_`` and ``-``, starting with a letter
or digit (so it is never hidden, never ``..`` and never a separator). Anything else is refused
with one line that names the problem and a valid alternative.
"""

from __future__ import annotations

import re

from moe_spec.errors import UserError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class InvalidName(UserError, ValueError):
    """A name that cannot become a path; the message is one line for the user."""


def check_name(value: str, what: str = "run name") -> str:
    if not isinstance(value, str) or not _NAME.match(value) or ".." in value:
        suggestion = re.sub(r"[^A-Za-z0-9._-]+", "-", str(value)).strip(".-_") or "run1"
        suggestion = re.sub(r"\.\.+", ".", suggestion)[:128]
        raise InvalidName(f"{what} {value!r} is not allowed: use letters, digits, '.', '_' and "
                         f"'-' (starting with a letter or digit), e.g. {suggestion!r}")
    return value


def partition_value(value: str) -> str:
    """A hive partition value for a model name: hub ids' ``/`` become ``--`` (as in the Hugging
    Face cache) and ``=`` becomes ``-``; a local folder's leading ``/``, ``.`` and ``~`` are dropped
    so the value is never hidden and never leaves its folder."""
    value = value.lstrip("/.~").replace("/", "--").replace("=", "-").replace("\\", "--")
    return value or "model"
