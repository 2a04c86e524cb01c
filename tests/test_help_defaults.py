"""Every option of every console script says its default in ``--help`` ("not set" where it has
none), except switches and required options (issue 42, item 13)."""

import argparse
import importlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


class Grabbed(Exception):
    pass


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_option_shows_its_default(name, monkeypatch):
    grabbed = {}

    def grab(self, args=None, namespace=None):
        grabbed["parser"] = self
        raise Grabbed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", grab)
    monkeypatch.setattr("sys.argv", [name, "--help"])
    module, function = SCRIPTS[name].split(":")
    with pytest.raises((Grabbed, SystemExit)):
        getattr(importlib.import_module(module), function)()
    parser = grabbed["parser"]
    formatter = parser._get_formatter()
    silent = [a.option_strings[-1] for a in parser._actions
              if a.option_strings and a.help != argparse.SUPPRESS and a.nargs != 0
              and not a.required and "default" not in formatter._get_help_string(a)]
    assert not silent, f"{name} --help says no default for {silent}"
