"""Command-line conventions shared by every tool.

* bad arguments are one line (``prog: error: message (see prog --help)``), not a usage dump;
* ``--help`` ends with an *examples* section and shows each default once;
* ``--config run.toml`` (where a tool offers it) holds options whose keys mirror the flags
  (``max_new_tokens = 16`` or ``max-new-tokens = 16``); flags on the command line win;
* ``--output summary.json`` (where offered) writes the one-screen summary as JSON;
* ``--threads N`` (commands that compute) sizes every CPU thread pool (:mod:`console.threads`);
* a closed stdout (``query … | head``) ends a command quietly (:mod:`console.pipes`);
* commands named in hints and examples are spelled so they run (:mod:`console.commands`).

This module imports the standard library only: ``--help`` must appear at once.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

from moe_spec.console import pipes, threads  # noqa: F401 - console.pipes / console.threads for callers
from moe_spec.console.commands import command, commandline


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default shown once ("not set" where there is none; never for flags,
    required options or help that already names one), and the description / examples kept as
    written."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or action.default is argparse.SUPPRESS or action.required
                or not action.option_strings or action.nargs == 0):  # flags: off unless given
            return text
        if action.default is None or (isinstance(action.default, (list, tuple, str))
                                      and len(action.default) == 0):
            return f"{text} (default: not set)"
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the conventions above. ``examples`` are command lines, one per line (a
    ``# comment`` after a command is kept)."""

    def __init__(self, *args, examples: str | None = None, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        if examples:
            lines = [line.strip() for line in examples.strip().splitlines()]
            kwargs["epilog"] = "examples:\n" + "\n".join(f"  {commandline(line)}"
                                                         for line in lines if line)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {command(self.prog)} --help)\n")

    # --- --config ------------------------------------------------------------------------
    def add_config_option(self, example: str = "max_new_tokens = 16") -> None:
        """``--config``; ``example``: one TOML line of this command's own options."""
        self.add_argument("--config", type=Path, default=None, metavar="FILE.toml",
                          help="read options from a TOML file whose keys mirror the flags "
                               f"({example}); flags given here win")

    def parse_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        if any(a.dest == "config" for a in self._actions) and "-h" not in argv \
                and "--help" not in argv:
            argv = self._config_argv(argv) + argv
        return super().parse_args(argv, namespace)

    def _config_argv(self, argv: list[str]) -> list[str]:
        """The config file's options as command-line tokens (so argparse checks them exactly as
        it checks flags, and later flags override them)."""
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config", type=Path, default=None)
        known, _ = pre.parse_known_args(argv)
        if known.config is None:
            return []
        try:
            table = tomllib.loads(known.config.read_text(encoding="utf-8"))
        except OSError as exc:
            self.error(f"cannot read --config {known.config}: {exc.strerror or exc}")
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            self.error(f"--config {known.config} is not valid TOML: {exc}")
        flags = {a.dest: a for a in self._actions if a.option_strings and a.dest != "help"}
        tokens: list[str] = []
        for key, value in table.items():
            action = flags.get(str(key).replace("-", "_"))
            if action is None or action.dest == "config":
                self.error(f"--config {known.config}: unknown key {key!r}; keys are the long "
                           f"options without dashes: {', '.join(sorted(flags))}")
            flag = max(action.option_strings, key=len)
            if action.nargs == 0:  # a switch: true turns it on, false leaves the default
                if not isinstance(value, bool):
                    self.error(f"--config {known.config}: {key} takes true or false")
                tokens += [flag] if value else []
            elif isinstance(value, list):
                tokens += [flag, *map(str, value)]
            elif isinstance(value, (dict,)):
                self.error(f"--config {known.config}: {key} must be a value, not a table")
            else:
                tokens += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
        return tokens

    # --- --output ------------------------------------------------------------------------
    def add_output_option(self) -> None:
        self.add_argument("--output", type=Path, default=None, metavar="FILE.json",
                          help="also write the summary as JSON (machine-readable)")


def write_json(path: Path | None, payload: dict) -> None:
    """Write ``payload`` as JSON atomically (a reader never sees half a file); no-op for None."""
    if path is None:
        return
    path = Path(path)
    if str(path) == "-":  # stdout, on purpose
        sys.stdout.write(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")
        return
    check_output(path)
    from moe_spec.catalog import atomic  # the one atomic write
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes(path, (json.dumps(payload, indent=2, sort_keys=True, default=str)
                              + "\n").encode("utf-8"))


def check_output_option(path: Path | None, error: type[Exception], traces=None,
                        differs: dict | None = None) -> None:
    """``--output PATH`` checked before any work (``-``, stdout, is always fine): a link,
    folder or device, a path inside the traces root ``traces``, or the same path as one of the
    command's other outputs (``differs``: ``{"DEST": path}``) is ``error`` in one line."""
    if path is None or str(path) == "-":
        return
    import os
    for option, other in (differs or {}).items():
        if other is not None and str(other) != "-" and \
                os.path.realpath(path) == os.path.realpath(other):
            raise error(f"--output {path} is {option} too; the summary would replace the "
                        f"result: give --output another name")
    try:
        check_output(path)
        from moe_spec.catalog.atomic import check_outside
        check_outside(path, traces, "--output")
    except OSError as exc:
        raise error(f"cannot write --output {path}: {exc}") from None


def check_output(path: Path) -> None:
    """Refuse to replace a symlink, folder, device or FIFO with a file (``os.replace`` would):
    :func:`catalog.atomic.check_target`, the one owner of that rule (imported here on use, so
    ``--help`` and one-line errors stay instant)."""
    from moe_spec.catalog.atomic import check_target
    check_target(path)
