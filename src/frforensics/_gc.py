"""One switch for the cyclic garbage collector, shared by the readers and the analyzer."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["gc_paused"]


@contextlib.contextmanager
def gc_paused(*, settle: bool = False) -> Iterator[None]:
    """Pause the cyclic garbage collector (restored on exit; nests).

    A decoded native pickle is ~100,000 containers, and a loaded job's digests
    millions of long-lived objects; with the collector on, every 700 allocations
    would rescan the young ones and now and then all of them, which costs as much
    as the work itself. Dumps and digests hold no reference cycles: reference
    counting frees them, and the collector runs again when the pause ends.

    ``settle``: what the block allocated is long-lived (a loaded job's digests):
    the outermost pause ends by moving every tracked object straight to the
    oldest generation (``gc.freeze`` then ``gc.unfreeze``, both O(1)) instead of
    leaving them young, where the next allocation would trigger a scan of all of
    them (0.6 s of CPU at 16,384 ranks). Any cyclic garbage among them waits for
    the next full collection. Skipped where the caller froze objects itself.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if settle and not gc.get_freeze_count():  # a caller's own freeze stays as is
                gc.freeze()
                gc.unfreeze()
            gc.enable()
