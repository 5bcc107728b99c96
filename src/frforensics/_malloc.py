"""Keep freed memory for reuse in a one-shot analysis process (glibc only).

glibc serves every allocation above its mmap threshold (128 KiB, rising with use
to at most 32 MiB) with a fresh ``mmap`` and returns it with ``munmap`` when
freed. The analysis of a big job makes and drops hundreds of column-sized
temporaries (tens to hundreds of MiB each): every one is a fresh mapping whose
pages the kernel faults in and zeroes again. At 16,384 ranks that was 1.6 million
minor faults and 22 s of system time out of 45 s of CPU (docs/performance.md,
"Freed memory kept").

:func:`keep_freed_memory` makes this process take all its memory from the heap
(``M_MMAP_MAX`` 0) and never trim it (``M_TRIM_THRESHOLD``): a freed
temporary's pages are handed to the next one already mapped. The peak stays what
the live data needs (the heap reuses freed blocks, it does not add them up); what
changes is that the process keeps its peak until it exits, which is what a
one-shot ``fr-analyze`` does. Only the CLI calls it: never a training process
(the recorder's in-job verdict, the launcher) or a library caller, whose
allocator is theirs. Forked pool workers inherit the setting.
"""

from __future__ import annotations

import ctypes
import platform
import sys

__all__ = ["keep_freed_memory"]

# mallopt parameters, glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Whether the setting took (glibc on Linux; anything else: nothing changes)."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        # mallopt returns 1 on success; the trim threshold is an int: 2 GiB - 1
        return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):  # no C library to ask: the default allocator
        return False
