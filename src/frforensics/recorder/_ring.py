"""The ring buffer and the hot-path capture helpers.

An entry is a plain Python list with fixed slots (creating a list is the cheapest
mutable record CPython has); the watchdog mutates the state and time slots in
place. Everything costly (shape strings, dtype names, frame names, wall-clock
conversion) is deferred to dump time: the hot path stores references only
(``torch.Size``, ``torch.dtype``, code objects, monotonic nanoseconds).
"""

from __future__ import annotations

import sys
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
STACK: Final = 21  # flat tuple (code, lineno, code, lineno, ...), innermost first
START_EVENT: Final = 22  # torch.cuda.Event or None
N_SLOTS: Final = 23

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


class FrameFilter:
    """Decides once per code object whether its frames belong in recorded stacks.

    Frames of torch and of this recorder say nothing about the user's program;
    they are skipped so the recorded ``depth`` frames are the caller's.
    """

    __slots__ = ("cache", "prefixes")

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes
        # Keyed by id(): hashing a code object hashes its bytecode and constants
        # (measured ~1 us per frame). The code object is kept in the value, so its
        # id cannot be reused while the entry exists.
        self.cache: dict[int, tuple[CodeType, bool]] = {}

    def keep(self, code: CodeType) -> bool:
        keep = not code.co_filename.startswith(self.prefixes)
        self.cache[id(code)] = (code, keep)
        return keep


def capture_stack(frame: FrameType | None, depth: int, flt: FrameFilter) -> tuple[Any, ...]:
    """(code, line) pairs of up to ``depth`` kept frames from ``frame`` outwards."""
    out: list[Any] = []
    cache = flt.cache
    walked = 0
    while frame is not None and walked < 128:
        code = frame.f_code
        hit = cache.get(id(code))
        keep = hit[1] if hit is not None and hit[0] is code else flt.keep(code)
        if keep:
            out.append(code)
            out.append(frame.f_lineno)
            if len(out) >= 2 * depth:
                break
        frame = frame.f_back
        walked += 1
    return tuple(out)


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
