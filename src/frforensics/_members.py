"""One tuple per distinct group membership within a process (membership interning).

Model side of the part map: the decoders (``formats``, through ``formats._shared``)
and ``model.progression_members`` both intern here.

Every rank's dump lists the members of every group it is in, the default group
with all of them: at 16,384 ranks each decode would build a 16,384-int tuple
(~0.4 ms and 128 KiB) that equals the previous rank's. The decoders key the
parsed members by their raw form (a progression, packed bytes, the ``pg_config``
string: hashing those is memory-speed), so equal groups of every dump decoded in
this process share one tuple: less time, less memory, and the loader and
``merge.build_job`` can compare groups by identity.

Bounded: at most ``_SLOTS`` memberships and ``_MEMBERS`` ints are kept (oldest
dropped first); a miss only costs the parse it would have cost anyway.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

_SLOTS = 64
_MEMBERS = 1 << 22  # 4M ints (~32 MiB of tuple slots) in all
#: smaller memberships are cheap to parse and hash: not kept
_SMALL = 64

_cache: OrderedDict[Hashable, tuple[int, ...] | None] = OrderedDict()
_held = [0]
#: Dask workers may decode in several threads at once
_lock = threading.Lock()


def shared_ranks(key: Hashable, size_hint: int,
                 parse: Callable[[], tuple[int, ...] | None]) -> tuple[int, ...] | None:
    """``parse()``, or the tuple it returned for an equal ``key`` before."""
    if size_hint < _SMALL:
        return parse()
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    ranks = parse()  # outside the lock: a parse error must leave the cache as it was
    n = len(ranks) if ranks is not None else 0
    if n > _MEMBERS:
        return ranks
    with _lock:
        if key in _cache:  # another thread parsed it meanwhile: share its tuple
            return _cache[key]
        _cache[key] = ranks
        _held[0] += n
        while len(_cache) > _SLOTS or _held[0] > _MEMBERS:
            _, old = _cache.popitem(last=False)
            _held[0] -= len(old) if old is not None else 0
    return ranks
