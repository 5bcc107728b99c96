"""The ring buffer and the hot-path capture helpers.

An entry is a plain Python list with fixed slots (creating a list is the cheapest
mutable record CPython has); the watchdog mutates the state and time slots in
place. Everything costly (shape strings, dtype names, frame names, wall-clock
conversion) is deferred to dump time: the hot path stores references only
(``torch.Size``, ``torch.dtype``, code objects, monotonic nanoseconds).
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, Final

# Slots of an entry list.
RECORD_ID: Final = 0
GROUP: Final = 1  # index into Recorder.groups
SEQ: Final = 2
P2P_SEQ: Final = 3
PEER_SEQ: Final = 4
OP: Final = 5  # normalized op name (str)
IS_P2P: Final = 6
PEER: Final = 7  # global rank or -1
ROOT: Final = 8  # global rank or -1
COALESCED: Final = 9  # coalescing block id or -1
INPUTS: Final = 10  # tuple of (torch.Size, torch.dtype)
OUTPUTS: Final = 11
REDUCE_OP: Final = 12  # ReduceOp-ish object or None
STATE: Final = 13  # model.OpState value
T_ENQUEUE: Final = 14  # monotonic ns
T_START: Final = 15  # monotonic ns or 0
T_COMPLETE: Final = 16  # monotonic ns or 0
TIMEOUT_MS: Final = 17
THREAD: Final = 18  # thread ident
DEVICE: Final = 19  # "cuda:3" or None (CPU)
STREAM: Final = 20  # CUDA stream handle or -1
STACK: Final = 21  # flat list [code, lasti, code, lasti, ...], innermost first
START_EVENT: Final = 22  # torch.cuda.Event or None
N_SLOTS: Final = 23
#: an optional trailing slot, appended only to ``all_to_all_single`` entries (no other
#: op pays for it): (input_split_sizes, output_split_sizes) as the caller passed them
SPLITS: Final = 23

SCHEDULED: Final = 0
STARTED: Final = 1
COMPLETED: Final = 2
FAILED: Final = 3


class Ring:
    """A bounded ring of entries; the oldest is overwritten when full."""

    __slots__ = ("capacity", "count", "slots")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, int(capacity))
        self.slots: list[list[Any] | None] = [None] * self.capacity
        self.count = 0  # entries ever written

    def snapshot(self) -> tuple[list[list[Any]], int]:
        """The live entries oldest first, and how many were dropped (overwritten)."""
        count = self.count
        cap = self.capacity
        slots = list(self.slots)  # one C-level copy: consistent enough under the GIL
        if count <= cap:
            live = slots[:count]
        else:
            head = count % cap
            live = slots[head:] + slots[:head]
        entries = [e for e in live if e is not None]
        entries.sort(key=lambda e: e[RECORD_ID])
        return entries, max(0, count - cap)


_filter_serials = itertools.count(1)


class FrameFilter:
    """Decides once per code object whether its frames belong in recorded stacks.

    Frames of torch and of this recorder say nothing about the user's program;
    they are skipped so the recorded ``depth`` frames are the caller's.

    The verdicts live in two sets of ``id(code)`` (hashing a code object hashes
    its bytecode and constants: ~1 us per frame, measured). Every classified code
    object is also kept in ``codes``, so an id can never be reused by another
    code object while its verdict is remembered.
    """

    __slots__ = ("codes", "keep_ids", "limit", "prefixes", "serial", "skip_ids")

    def __init__(self, prefixes: tuple[str, ...], limit: int = 100_000) -> None:
        self.prefixes = prefixes
        self.keep_ids: set[int] = set()
        self.skip_ids: set[int] = set()
        self.codes: list[CodeType] = []
        self.limit = limit  # generated code (exec, compilers) must not grow this forever
        # Tags the verdicts the C walk caches on code objects: a new filter, or one
        # that forgot its verdicts, never matches an older tag.
        self.serial = next(_filter_serials)

    def keep(self, code: CodeType) -> bool:
        """Classify ``code`` (first sighting) and remember the verdict."""
        if len(self.codes) >= self.limit:
            self.keep_ids.clear()
            self.skip_ids.clear()
            self.codes.clear()
            self.serial = next(_filter_serials)
        keep = not code.co_filename.startswith(self.prefixes)
        self.codes.append(code)
        (self.keep_ids if keep else self.skip_ids).add(id(code))
        return keep


def capture_stack(frame: FrameType | None, depth: int, flt: FrameFilter) -> list[Any]:
    """``[code, lasti, code, lasti, ...]`` of up to ``depth`` kept frames, innermost first.

    ``lasti`` is the frame's bytecode offset (``f_lasti``): reading it is a field
    load, where ``f_lineno`` scans the code's line table. :func:`line_of` turns it
    into a line number at dump time.
    """
    out: list[Any] = []
    if depth <= 0:
        return out
    keep_ids = flt.keep_ids
    skip_ids = flt.skip_ids
    limit = 2 * depth
    while frame is not None:
        code = frame.f_code
        cid = id(code)
        if cid in keep_ids or (cid not in skip_ids and flt.keep(code)):
            out.append(code)
            out.append(frame.f_lasti)
            if len(out) >= limit:
                break
        frame = frame.f_back
    return out


def capture_caller(skip: int, depth: int, flt: FrameFilter) -> list[Any]:
    """:func:`capture_stack` from the caller's ``skip``-th ancestor (pure Python).

    The same list as ``capture_stack(sys._getframe(skip), depth, flt)`` written
    where this is called; ``[]`` when the stack is not that deep. The signature of
    the C walk :data:`fast_walk`, which it stands in for.
    """
    try:
        frame = sys._getframe(skip + 1)
    except ValueError:
        return []
    return capture_stack(frame, depth, flt)


def _load_fast() -> Any:
    if os.environ.get("FRFORENSICS_PURE_PYTHON", "") not in ("", "0"):
        return None
    import importlib

    try:
        return importlib.import_module("frforensics.recorder._fastframes")
    except ImportError:  # not built (no compiler, not CPython 3.11): pure Python
        return None


def _load_fast_walk() -> Callable[[int, int, FrameFilter], list[Any]] | None:
    module = _load_fast()
    return None if module is None else module.walk


def _keep_tracked(obj: Any) -> Any:
    return obj


def _load_untrack() -> Callable[[Any], Any]:
    module = _load_fast()
    return _keep_tracked if module is None else module.untrack


#: The C walk over CPython 3.11's interpreter frames (``_fastframes.c``): same
#: arguments and result as :func:`capture_caller`, without creating a frame object
#: per frame. ``None`` where the extension is not built or
#: ``FRFORENSICS_PURE_PYTHON=1`` is set; the recorder then uses :func:`capture_stack`.
fast_walk: Final = _load_fast_walk()

#: ``untrack(entry) -> entry``: the entry list taken out of the cyclic GC (it can
#: never be in a cycle; ``_fastframes.c``), so the 2000 live entries cost a
#: training loop's collections nothing; the identity where the extension is not
#: built (the entries then stay tracked, as before).
untrack: Final = _load_untrack()


def line_of(code: CodeType, lasti: int) -> int:
    """The source line of bytecode offset ``lasti`` in ``code`` (dump time only)."""
    if lasti < 0:
        return int(code.co_firstlineno)
    for start, end, line in code.co_lines():
        if start <= lasti < end:
            return int(line) if line is not None else int(code.co_firstlineno)
    return int(code.co_firstlineno)


def default_skip_prefixes() -> tuple[str, ...]:
    """File prefixes whose frames are not recorded (torch, this package, decorators)."""
    import os

    prefixes = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
    for mod_name in ("typing_extensions", "contextlib", "functools"):
        mod_file = getattr(sys.modules.get(mod_name), "__file__", None)
        if mod_file:
            prefixes.append(os.path.abspath(mod_file))
    torch_mod = sys.modules.get("torch")
    torch_file = getattr(torch_mod, "__file__", None)
    if torch_file:
        # All of torch: the op name already says which API issued it; the frames
        # worth keeping are the caller's (DDP's backward, FSDP's forward, ...).
        prefixes.append(os.path.dirname(os.path.abspath(torch_file)) + os.sep)
    return tuple(prefixes)
