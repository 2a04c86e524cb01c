"""capture's options are declared once, on CaptureSettings' fields: the parser and the settings
built from parsed options both derive from those declarations."""

import dataclasses
import subprocess
import sys

import pytest

from moe_spec.capture import cli
from moe_spec.capture.settings import CaptureError, CaptureSettings, option_flag


def flags() -> set[str]:
    return {s for a in cli.parser()._actions for s in a.option_strings}


def test_every_declared_option_is_a_flag_and_only_those_fields_are():
    declared = CaptureSettings.options()
    assert len(declared) == len(dataclasses.fields(CaptureSettings)) - 1  # chunk_steps is not
    assert {option_flag(f) for f in declared} <= flags()
    assert "--chunk-steps" not in flags()


def test_no_options_build_the_default_settings():
    assert cli.settings_from(cli.parser().parse_args([])) == CaptureSettings()


def test_options_become_fields_through_their_declared_parsing():
    args = cli.parser().parse_args(["--limit", "0", "--calibration", "a", "b", "--budget", "16",
                                    "--temperature", "0.5", "--chat-template", "--hidden-dtype",
                                    "float32", "--store-expert-outputs", "--batch-size", "2"])
    got = cli.settings_from(args)
    assert got == CaptureSettings(limit=None, calibration=("a", "b"), budget=16, temperature=0.5,
                                  chat_template=True, hidden_dtype="float32",
                                  store_expert_outputs=True, batch_size=2)
    with pytest.raises(CaptureError, match=r"^--limit -1 is out of range: it must be 0 \(all\)"):
        cli.settings_from(cli.parser().parse_args(["--limit", "-1"]))


def test_declared_choices_are_enforced_by_the_parser():
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["--hidden-dtype", "int8"])
    assert "coact" in next(a for a in cli.parser()._actions if a.dest == "ranking").choices


@pytest.mark.slow  # a fresh process
def test_building_the_parser_imports_no_torch():
    code = ("import sys; from moe_spec.capture import cli; cli.parser().format_help(); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]"


def test_declared_bounds_refuse_a_value_however_the_settings_are_made():
    with pytest.raises(CaptureError, match=r"^--top-p 0 is out of range: it must be in \(0, 1\]$"):
        CaptureSettings(top_p=0)
    with pytest.raises(CaptureError, match=r"^chunk_steps 0 is out of range"):  # not an option
        CaptureSettings(chunk_steps=0)
    with pytest.raises(CaptureError, match=r"^--depth 2000 is out of range: it must be at most"):
        cli.settings_from(cli.parser().parse_args(["--depth", "2000"]))
    assert CaptureSettings(top_p=1.0, budget=None, limit=None).top_p == 1.0  # bounds inclusive
