"""A closed stdout (``query … | head``) ends a command quietly, as ``head`` expects.

    @console.pipes.quiet_broken_pipe
    def main(argv=None) -> int: ...

Python raises BrokenPipeError at the write after the reader has gone (and again when it flushes
stdout at exit, as an "Exception ignored" message). The decorator flushes stdout itself, and on
BrokenPipeError points stdout at /dev/null, so nothing more is written or reported, and returns
141 (128 + SIGPIPE: what a command killed by the signal reports, and what ``set -o pipefail``
scripts see). The approach of Python's ``signal`` module documentation. Rich's consoles handle
the broken pipe themselves (stdout pointed at /dev/null, then ``SystemExit(1)``): that exit is
reported as 141 too.
"""

from __future__ import annotations

import functools
import os
import sys

EXIT_BROKEN_PIPE = 141


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout replaced (tests) or already closed
        pass


def _stdout_is_devnull() -> bool:
    try:
        out, null = os.fstat(sys.stdout.fileno()), os.stat(os.devnull)
    except (OSError, ValueError, AttributeError):
        return False
    return (out.st_dev, out.st_ino) == (null.st_dev, null.st_ino)


def quiet_broken_pipe(main):
    """Wrap a command's ``main``: BrokenPipeError on stdout returns 141 without a traceback."""
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        was_devnull = _stdout_is_devnull()
        try:
            code = main(*args, **kwargs)
            sys.stdout.flush()  # here, not at exit, so a closed pipe is caught below
            return code
        except BrokenPipeError:
            _silence_stdout()
            return EXIT_BROKEN_PIPE
        except SystemExit as exc:  # rich's own handling of the same
            if exc.code == 1 and not was_devnull and _stdout_is_devnull():
                return EXIT_BROKEN_PIPE
            raise
    return wrapper
