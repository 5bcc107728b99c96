"""One switch for the cyclic garbage collector, shared by the readers and the analyzer."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (restored on exit; nests).

    A decoded native pickle is ~100,000 containers, and a loaded job's digests
    millions of long-lived objects; with the collector on, every 700 allocations
    would rescan the young ones and now and then all of them, which costs as much
    as the work itself. Dumps and digests hold no reference cycles: reference
    counting frees them, and the collector runs again when the pause ends.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
