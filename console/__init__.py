"""Command-line conventions shared by every tool: bad arguments are one line, not a usage dump."""

from __future__ import annotations

import argparse


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with errors as ``prog: error: message (see prog --help)`` on one line."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
