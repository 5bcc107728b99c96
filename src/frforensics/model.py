"""The in-memory model of one rank's flight-recorder dump.

Every reader (our own ``frdump`` format, PyTorch's native pickles and JSON) turns
its bytes into one :class:`RankTrace`; the recorder builds the same object at dump
time and hands it to the writer. Entries are *columns* (numpy arrays, one row per
recorded op) rather than one Python object per op: a 10,000-rank job holds tens of
millions of entries, and the matcher only needs a few integer columns of them.

Strings (op names, shapes, dtypes, thread names) are indices into
``RankTrace.strings``; Python stacks are indices into ``RankTrace.stacks``.
Stacks list the innermost frame first (as PyTorch's ``frames`` do). Times are wall-clock nanoseconds since the epoch (0 = unknown); ranks are global
unless a name says ``group_rank``.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Final

import numpy as np
import numpy.typing as npt

from frforensics._members import shared_ranks

__all__ = [
    "ENTRY_COLUMNS",
    "HEADER_FIELDS",
    "NO_INDEX",
    "DeathInfo",
    "DumpHeader",
    "DumpReason",
    "EntryTable",
    "Frame",
    "GroupInfo",
    "HeaderFields",
    "OpState",
    "PeerHeartbeat",
    "RankTrace",
    "SourceFormat",
    "ThreadStack",
    "is_library_file",
    "user_frame",
]

NO_INDEX: Final = -1
"""Value of an index or rank column when the dump does not say."""


class OpState(enum.IntEnum):
    """Where an op was when the dump was taken (PyTorch's ``state`` field)."""

    SCHEDULED = 0
    STARTED = 1
    COMPLETED = 2
    FAILED = 3


class DumpReason(str, enum.Enum):
    """Why a rank wrote its dump."""

    WATCHDOG_TIMEOUT = "watchdog_timeout"
    PEER_SIGNAL = "peer_signal"
    SIGNAL = "signal"
    API = "api"
    EXIT = "exit"
    EXCEPTION = "exception"
    UNKNOWN = "unknown"


class SourceFormat(str, enum.Enum):
    """Which writer produced a dump."""

    FRDUMP = "frdump"
    NATIVE_PICKLE = "native_pickle"
    NATIVE_JSON = "native_json"


@dataclass(frozen=True, slots=True)
class Frame:
    """One Python frame: file, line, function."""

    file: str
    line: int
    name: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.name}"

    def __reduce__(self) -> tuple[type[Frame], tuple[str, int, str]]:
        # the dataclass default restores slots one by one in Python: 2x slower
        return (Frame, (self.file, self.line, self.name))


# Frames inside these paths are library plumbing, not the user's code.
_LIBRARY_MARKERS: Final = (
    "/torch/distributed/",
    "/torch/nn/parallel/",
    "/torch/utils/",
    "/torch/_",
    "frforensics/recorder",
    "/site-packages/torch/",
    "<frozen ",
)


@functools.lru_cache(maxsize=1 << 16)
def is_library_file(file: str) -> bool:
    """Whether ``file`` is library plumbing (torch's, ours), not the user's code."""
    return any(marker in file for marker in _LIBRARY_MARKERS)


def user_frame(frames: tuple[Frame, ...]) -> Frame | None:
    """The innermost frame in the user's code (outside torch and frforensics)."""
    for frame in frames:
        if not is_library_file(frame.file):
            return frame
    return frames[0] if frames else None


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """A process group as one rank saw it.

    ``name`` alone is ambiguous (hashed names may be shared by groups with other
    members); ``ranks`` are global ranks, or ``None`` when the dump does not say
    (PyTorch's gloo dumps never do).
    """

    name: str
    desc: str
    ranks: tuple[int, ...] | None
    backend: str = ""

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        # A large membership in a progression (the default group: every rank) travels
        # as (start, step, count) and is rebuilt as the receiving process's one tuple
        # for it (formats._shared): a pool batch's pickle would otherwise carry, and the
        # main process rebuild, 65,536 ints per batch at 65,536 ranks
        arith = progression(self.ranks)
        if arith is not None:
            return (_group_in_progression, (self.name, self.desc, *arith, self.backend))
        return (GroupInfo, (self.name, self.desc, self.ranks, self.backend))

    def group_rank_to_global(self, group_rank: int) -> int:
        """Map a group-local rank to a global one (``NO_INDEX`` when unknown)."""
        if self.ranks is None or not 0 <= group_rank < len(self.ranks):
            return NO_INDEX
        return self.ranks[group_rank]


#: memberships shorter than this pickle as they are
_PROGRESSION_MIN = 64
#: the longest progression rebuilt from (start, step, count)
_PROGRESSION_MAX = 1 << 24
#: id(members) -> (members, progression or None): the decoders share one tuple per
#: distinct membership, so each long one is checked once per process (bounded; kept
#: alive with its result, so an id is never reused while it is here)
_progressions: dict[int, tuple[tuple[int, ...], tuple[int, int, int] | None]] = {}


def progression(ranks: tuple[int, ...] | None,
                min_len: int = _PROGRESSION_MIN) -> tuple[int, int, int] | None:
    """``(start, step, count)`` when ``ranks`` (at least ``min_len`` of them, at least
    2) is an arithmetic progression with a non-zero step; else ``None``."""
    if ranks is None or len(ranks) < max(2, min_len):
        return None
    memo = len(ranks) >= _PROGRESSION_MIN
    hit = _progressions.get(id(ranks)) if memo else None
    if hit is not None and hit[0] is ranks:
        return hit[1]
    start, step, n = ranks[0], ranks[1] - ranks[0], len(ranks)
    found = (start, step, n) if step != 0 and ranks == tuple(range(start, start + step * n, step)) \
        else None
    if memo:
        if len(_progressions) >= 64:
            _progressions.clear()
        _progressions[id(ranks)] = (ranks, found)
    return found


def progression_members(start: int, step: int, count: int) -> tuple[int, ...]:
    """:func:`progression`'s inverse, as this process's one tuple for it
    (``frforensics._members``); ``ValueError`` unless it is ``count`` (at most
    ``_PROGRESSION_MAX``) ranks >= 0 with a non-zero step."""
    if not (type(start) is int and type(step) is int and type(count) is int and step != 0
            and 0 <= count <= _PROGRESSION_MAX and start >= 0
            and (count == 0 or start + step * (count - 1) >= 0)):
        raise ValueError("bad group progression")
    ranks = shared_ranks(("progression", start, step, count), count,
                         lambda: tuple(range(start, start + step * count, step)))
    assert ranks is not None
    return ranks


def _group_in_progression(name: str, desc: str, start: int, step: int, count: int,
                          backend: str) -> GroupInfo:
    """``GroupInfo.__reduce__``'s other half."""
    return GroupInfo(name, desc, progression_members(start, step, count), backend)


@dataclass(frozen=True, slots=True)
class ThreadStack:
    """A thread's Python stack at dump time (innermost frame first, like PyTorch's `frames`)."""

    name: str
    ident: int
    is_main: bool
    frames: tuple[Frame, ...]

    def __reduce__(self) -> tuple[type[ThreadStack], tuple[str, int, bool, tuple[Frame, ...]]]:
        # every digest carries its rank's stacks to the main process: a frozen slotted
        # dataclass unpickles through dataclasses' generic __setstate__ (4 us each)
        return ThreadStack, (self.name, self.ident, self.is_main, self.frames)


@dataclass(frozen=True, slots=True)
class PeerHeartbeat:
    """A peer whose heartbeat this rank saw go stale (its watchdog stopped)."""

    rank: int
    age_s: float


@dataclass(frozen=True, slots=True)
class DeathInfo:
    """The rank's own dump says the process was dying (exception or exit)."""

    kind: str
    message: str
    frames: tuple[Frame, ...] = ()


# name -> numpy dtype of every entry column, in file order. Adding a column is a
# compatible change (readers fill absent ones with the default below).
ENTRY_COLUMNS: Final[dict[str, str]] = {
    "record_id": "<i8",  # per-process counter (not comparable across ranks)
    "pg": "<i4",  # index into RankTrace.groups
    "seq": "<i8",  # PyTorch collective_seq_id (per group, per process)
    "p2p_seq": "<i8",  # PyTorch p2p_seq_id (all p2p ops of a group on this process)
    "peer_seq": "<i8",  # k-th send to / recv from this peer in this group (1-based)
    "op": "<i4",  # string index: all_reduce, send, recv, coalesced, ...
    "is_p2p": "|u1",
    "peer": "<i4",  # global rank of the p2p peer
    "root": "<i4",  # global rank of the root of broadcast/reduce/gather/scatter
    "coalesced": "<i8",  # entries with one non-negative value form one unit
    "in_numel": "<i8",
    "out_numel": "<i8",
    "in_shapes": "<i4",  # string index, e.g. "[[4, 4]]"
    "out_shapes": "<i4",
    "in_dtypes": "<i4",  # string index, e.g. "Float" or "Float,Half"
    "out_dtypes": "<i4",
    "reduce_op": "<i4",  # string index
    "state": "|u1",  # OpState
    "t_enqueue_ns": "<i8",
    "t_start_ns": "<i8",
    "t_complete_ns": "<i8",
    "timeout_ms": "<i8",
    "thread": "<i4",  # string index of the issuing thread's name
    "device": "<i4",  # string index, e.g. "cuda:3"
    "stream": "<i8",
    "stack": "<i4",  # index into RankTrace.stacks
    # GPU time of the op, start event to end event (PyTorch's ``duration_ms``,
    # NCCL with timing on, computed when the watchdog retires the entry), in ns;
    # -1 (``NO_INDEX``) = unknown
    "duration_ns": "<i8",
    # string index: the elements this rank sends each member of the group and
    # expects from each, in the group's member order, as "s0,s1,..|r0,r1,.."
    # (all_to_all and all_to_all_single; our recorder only; NO_INDEX: not recorded,
    # and files before it have no such column)
    "splits": "<i4",
}

COLUMN_DEFAULTS: Final[dict[str, int]] = {
    name: (0 if name in {"is_p2p", "state", "in_numel", "out_numel", "timeout_ms"}
           or name.startswith("t_") else NO_INDEX)
    for name in ENTRY_COLUMNS
}

I8 = npt.NDArray[np.int64]
I4 = npt.NDArray[np.int32]
U1 = npt.NDArray[np.uint8]


@dataclass(frozen=True, slots=True)
class EntryTable:
    """The ring buffer's entries as columns, oldest first (see ``ENTRY_COLUMNS``)."""

    record_id: I8
    pg: I4
    seq: I8
    p2p_seq: I8
    peer_seq: I8
    op: I4
    is_p2p: U1
    peer: I4
    root: I4
    coalesced: I8
    in_numel: I8
    out_numel: I8
    in_shapes: I4
    out_shapes: I4
    in_dtypes: I4
    out_dtypes: I4
    reduce_op: I4
    state: U1
    t_enqueue_ns: I8
    t_start_ns: I8
    t_complete_ns: I8
    timeout_ms: I8
    thread: I4
    device: I4
    stream: I8
    stack: I4
    duration_ns: I8
    splits: I4

    def __len__(self) -> int:
        return int(self.record_id.shape[0])

    @classmethod
    def from_columns(cls, n: int, columns: Mapping[str, npt.ArrayLike]) -> EntryTable:
        """Build a table of ``n`` rows; absent columns get their default value.

        Raises ``ValueError`` when a column has the wrong length.
        """
        built: dict[str, np.ndarray] = {}
        for name, dtype in ENTRY_COLUMNS.items():
            if name in columns:
                arr = np.asarray(columns[name], dtype=np.dtype(dtype).newbyteorder("="))
                if arr.shape != (n,):
                    raise ValueError(f"column {name!r} has {arr.shape[0] if arr.ndim else 0} rows, expected {n}")
            else:
                arr = np.full(n, COLUMN_DEFAULTS[name], dtype=np.dtype(dtype).newbyteorder("="))
            built[name] = arr
        return cls(**built)

    @classmethod
    def empty(cls) -> EntryTable:
        """A table with no rows."""
        return cls.from_columns(0, {})

    def columns(self) -> dict[str, np.ndarray]:
        """Every column by name, in ``ENTRY_COLUMNS`` order."""
        return {name: getattr(self, name) for name in ENTRY_COLUMNS}


@dataclass(frozen=True, slots=True)
class DumpHeader:
    """What one rank's dump says about the dump itself: who wrote it, when, why,
    and the process's state at that moment (everything but the entries).

    :class:`RankTrace` (the decoded dump) and ``analyzer.digest.RankDigest`` (its
    compact form) hold the same object, so the digest takes the header over
    without copying field by field. Fields a format does not carry are ``None``
    (unknown), never guessed here.
    """

    source: str
    format: SourceFormat
    version: str
    #: where the rank number came from: ``content``, ``filename`` or ``unknown``
    rank_from: str = "content"
    world_size: int | None = None
    host: str | None = None
    pid: int | None = None
    job_id: str | None = None
    dump_reason: DumpReason = DumpReason.UNKNOWN
    dump_detail: str = ""
    dump_time_ns: int | None = None
    dump_monotonic_ns: int | None = None
    completion_resolution_ns: int = 0
    #: entries the ring evicted before the dump (a digest cut by ``windowed``
    #: counts the rows it cut too)
    dropped: int = 0
    threads: tuple[ThreadStack, ...] = ()
    stale_peers: tuple[PeerHeartbeat, ...] = ()
    death: DeathInfo | None = None
    #: ops the rank issued that its dump does not record: PyTorch's gloo recorder
    #: skips send/recv, yet ``pg_status.last_enqueued_collective`` counts them
    #: (0: none, or unknown)
    unrecorded_ops: int = 0
    #: physical identity of the rank (orchestrators act on it): ``LOCAL_RANK``,
    #: the CUDA device index it used, that GPU's UUID and PCI bus id; ``None``
    #: where unknown (CPU jobs, older dumps, native dumps)
    local_rank: int | None = None
    cuda_device: int | None = None
    gpu_uuid: str | None = None
    pci_bus_id: str | None = None

    def __reduce__(self) -> tuple[type[DumpHeader], tuple[object, ...]]:
        # every digest carries one across the worker pool: the dataclass default
        # restores slots one by one in Python
        return (DumpHeader, tuple([getattr(self, name) for name in HEADER_FIELDS]))


class HeaderFields:
    """Read access to a :class:`DumpHeader`'s fields on the object that holds it
    (``trace.host`` for ``trace.header.host``). ``format`` and ``dump_reason``
    are left to the holder: a trace gives the enums, a digest their values."""

    __slots__ = ()
    header: DumpHeader

    @property
    def source(self) -> str:
        return self.header.source

    @property
    def version(self) -> str:
        return self.header.version

    @property
    def rank_from(self) -> str:
        return self.header.rank_from

    @property
    def world_size(self) -> int | None:
        return self.header.world_size

    @property
    def host(self) -> str | None:
        return self.header.host

    @property
    def pid(self) -> int | None:
        return self.header.pid

    @property
    def job_id(self) -> str | None:
        return self.header.job_id

    @property
    def dump_detail(self) -> str:
        return self.header.dump_detail

    @property
    def dump_time_ns(self) -> int | None:
        return self.header.dump_time_ns

    @property
    def dump_monotonic_ns(self) -> int | None:
        return self.header.dump_monotonic_ns

    @property
    def completion_resolution_ns(self) -> int:
        return self.header.completion_resolution_ns

    @property
    def dropped(self) -> int:
        return self.header.dropped

    @property
    def threads(self) -> tuple[ThreadStack, ...]:
        return self.header.threads

    @property
    def stale_peers(self) -> tuple[PeerHeartbeat, ...]:
        return self.header.stale_peers

    @property
    def death(self) -> DeathInfo | None:
        return self.header.death

    @property
    def unrecorded_ops(self) -> int:
        return self.header.unrecorded_ops

    @property
    def local_rank(self) -> int | None:
        return self.header.local_rank

    @property
    def cuda_device(self) -> int | None:
        return self.header.cuda_device

    @property
    def gpu_uuid(self) -> str | None:
        return self.header.gpu_uuid

    @property
    def pci_bus_id(self) -> str | None:
        return self.header.pci_bus_id


#: :class:`DumpHeader`'s fields, in order
HEADER_FIELDS: Final = tuple(f.name for f in fields(DumpHeader))


@dataclass(frozen=True, slots=True)
class RankTrace(HeaderFields):
    """Everything one rank's dump says, normalized.

    ``rank`` is the global rank (from the dump's content, or for native dumps from
    the file name; ``header.rank_from`` says which). What the dump says about
    itself is its :class:`DumpHeader` (read through as ``trace.host`` etc.);
    fields a format does not carry are ``None`` (unknown), never guessed here:
    inference belongs to the analyzer.
    """

    rank: int | None
    header: DumpHeader
    groups: tuple[GroupInfo, ...]
    strings: tuple[str, ...]
    stacks: tuple[tuple[Frame, ...], ...]
    entries: EntryTable
    notes: tuple[str, ...] = field(default=())

    @property
    def format(self) -> SourceFormat:
        return self.header.format

    @property
    def dump_reason(self) -> DumpReason:
        return self.header.dump_reason

    def string(self, index: int) -> str:
        """The string at ``index`` of the string table ('' for ``NO_INDEX``)."""
        if 0 <= index < len(self.strings):
            return self.strings[index]
        return ""

    def stack(self, index: int) -> tuple[Frame, ...]:
        """The frames at ``index`` of the stack table (empty for ``NO_INDEX``)."""
        if 0 <= index < len(self.stacks):
            return self.stacks[index]
        return ()

    def main_thread(self) -> ThreadStack | None:
        """The main thread's stack at dump time, if the dump has thread stacks."""
        for thread in self.threads:
            if thread.is_main:
                return thread
        return None
