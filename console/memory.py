"""Give freed tree-layer arrays back to the operating system.

glibc raises its mmap threshold each time a large block is freed, after which blocks of a few
MiB (one tree-layer's expert outputs) come from the heap; small long-lived objects allocated in
between (calibration examples, result rows) then pin it, and a process that streams thousands
of tree-layers grows by gigabytes it no longer uses (a closed-loop replay with the learned
ranking on tiny-qwen3-moe reached 24 GiB). A fixed threshold keeps every block of 256 KiB or more
in its own mapping, returned on free. A no-op where glibc's ``mallopt`` is not available.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def return_large_blocks(threshold: int = 256 << 10) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes; True if it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(threshold)))
    except (OSError, AttributeError):
        return False
