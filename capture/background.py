"""Writing traces off the decode loop: a worker thread behind a bounded queue.

On a GPU a verification pass takes tens of milliseconds, while moving its tensors to the host
and encoding them as Parquet can take longer; both happen here, in submission order, while the
decoder goes on. The queue is bounded, so memory is too (the decoder waits when the writer falls
behind). After a failure the worker runs nothing more — in particular no later ``sequences``
part, the marker of a complete prompt — and the next :meth:`submit` or :meth:`drain` raises it,
so a failed capture leaves only complete prompts.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from moe_spec.errors import UserError


class WriterFailed(UserError, RuntimeError):
    """The background writer failed; ``__cause__`` holds the original error."""


class BackgroundWriter:
    def __init__(self, max_pending: int = 4):
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="trace-writer", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    fn, args = item
                    fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the submitting thread
                self._error = exc
            finally:
                self._queue.task_done()

    def _raise(self) -> None:
        if self._error is not None:
            raise WriterFailed(str(self._error) or type(self._error).__name__) from self._error

    def submit(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on the worker after everything submitted before it."""
        self._raise()
        self._queue.put((fn, args))

    def drain(self) -> None:
        """Wait until everything submitted is written; raise the worker's error, if any."""
        self._queue.join()
        self._raise()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
