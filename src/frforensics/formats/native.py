"""PyTorch's native flight-recorder dumps (pickle and JSON), read safely.

PyTorch's ProcessGroupNCCL / ProcessGroupGloo write one dump per rank: a pickle of
plain builtins (dicts, lists, tuples, str, int, float, bool, None), or the same
document as JSON. Schema 2.x (see docs/native-format.md)::

    {"version": "2.10",
     "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}},
     "pg_status": {"0": {"last_enqueued_collective": 7, ...}},
     "entries": [{"record_id": 0, "pg_id": 0, "process_group": ("0", "default_pg"),
                  "collective_seq_id": 1, "p2p_seq_id": 0, "op_id": 1,
                  "profiling_name": "nccl:all_reduce", "time_created_ns": ...,
                  "input_sizes": [[4, 4]], "input_dtypes": ["Float"], ...,
                  "state": "scheduled", "time_discovered_started_ns": None,
                  "time_discovered_completed_ns": None, "retired": False,
                  "timeout_ms": 600000, "is_p2p": False,
                  "frames": [{"name": "step", "filename": "train.py", "line": 12}],
                  "thread_id": ..., "thread_name": ...}, ...]}

Safety: pickles are decoded by :class:`NoGlobalsUnpickler`, which refuses every
global (so no ``REDUCE``/``BUILD`` can reach code) and every persistent id. Older
2.x versions lack some keys (``p2p_seq_id``, ``is_p2p``, ``thread_*``,
``timeout_ms``...): absent keys become "unknown", never a crash.
"""

from __future__ import annotations

import io
import json
import math
import operator
import os
import pickle
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from itertools import chain, pairwise, repeat
from operator import itemgetter
from typing import Any, Final, NamedTuple, NoReturn

import numpy as np

from frforensics._gc import gc_paused
from frforensics.errors import (
    CorruptDumpError,
    LimitExceededError,
    NotADumpError,
    UnsafeDumpError,
)
from frforensics.formats._shared import shared_ranks
from frforensics.formats.limits import DEFAULT_LIMITS, Limits
from frforensics.model import (
    NO_INDEX,
    DumpHeader,
    EntryTable,
    Frame,
    GroupInfo,
    OpState,
    RankTrace,
    SourceFormat,
)

__all__ = [
    "NoGlobalsUnpickler",
    "decode_json",
    "decode_pickle",
    "looks_like_pickle",
    "pickle_to_trace",
    "scanner_available",
    "to_trace",
]

#: Largest native document we accept (bytes); beyond this a file is not a dump.
MAX_NATIVE_BYTES: Final = 2 << 30

_STATES: Final = {
    "scheduled": OpState.SCHEDULED,
    "started": OpState.STARTED,
    "completed": OpState.COMPLETED,
}

# PyTorch spells the same collective several ways across backends and versions.
_OP_ALIASES: Final = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "allgather": "all_gather",
    "_allgather_base": "all_gather_into_tensor",
    "_all_gather_base": "all_gather_into_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "all_reduce_barrier": "barrier",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "allgather_coalesced": "all_gather_coalesced",
    "reducescatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all_single",
    "all_to_all_base": "all_to_all_single",
    "recvanysource": "recv_any_source",
}

_P2P_NAME: Final = re.compile(r"^(send|recv)\s+(\d+)\s*(->|<-)\s*(\d+)")


def looks_like_pickle(head: bytes) -> bool:
    """True when ``head`` starts like a pickle of protocol 2 or newer."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


class NoGlobalsUnpickler(pickle.Unpickler):
    """An unpickler that builds only builtin containers and scalars.

    ``find_class`` refuses everything, so ``GLOBAL``/``STACK_GLOBAL``/``EXT*``
    opcodes — the only routes from a pickle to code — raise before anything runs.
    """

    def find_class(self, module: str, name: str) -> NoReturn:
        raise UnsafeDumpError(
            f"pickle references {module}.{name}: native dumps hold only builtins, "
            "so this file is refused unread (it could run code)"
        )

    def persistent_load(self, pid: Any) -> NoReturn:
        raise UnsafeDumpError("pickle uses persistent ids: refused unread")


def check_pickle(data: bytes) -> str | None:
    """Why the Python unpickler must not be given ``data``, or ``None``.

    Walks every opcode without running any (the C scanner's ``check``, or
    :mod:`pickletools` where it is not compiled): truncated arguments, unknown
    opcodes and memo indices past the size of the file (which make the unpickler
    allocate gigabytes before failing) are refused.
    """
    checker: Callable[[bytes], str | None] = getattr(_picklescan, "check", _check_pickle_python)
    return checker(data)


def _check_pickle_python(data: bytes) -> str | None:
    """:func:`check_pickle` where the C scanner is not compiled (slower, same rules)."""
    import pickletools

    limit = len(data)
    memoized = 0
    try:
        for opcode, arg, pos in pickletools.genops(data):
            if opcode.name in ("PUT", "BINPUT", "LONG_BINPUT") and isinstance(arg, int) and arg > limit:
                return f"memo index past the size of the file at byte {pos}"
            if opcode.name == "MEMOIZE":
                memoized += 1
            if opcode.name == "STOP":
                return None
    except Exception as exc:  # genops raises ValueError and others on bad bytes
        return f"malformed ({type(exc).__name__}: {exc})"
    return "truncated (no STOP opcode)"


def decode_pickle(data: bytes, *, source: str = "<bytes>") -> Any:
    """Decode a native pickle dump with :class:`NoGlobalsUnpickler` (after :func:`check_pickle`)."""
    why = check_pickle(data)
    if why is not None:
        raise CorruptDumpError(f"{source}: truncated or corrupt pickle ({why})")
    # A BufferedReader can be peeked, so the C unpickler reads it in large chunks;
    # on a bare BytesIO it calls read() once per opcode (protocol 2 has no frames),
    # four times slower than the decoding itself.
    stream = io.BufferedReader(io.BytesIO(data), buffer_size=1 << 16)
    try:
        with gc_paused():
            return NoGlobalsUnpickler(stream).load()
    except UnsafeDumpError as exc:
        raise UnsafeDumpError(f"{source}: {exc}") from None
    except RecursionError:
        raise CorruptDumpError(f"{source}: pickle nests too deeply") from None
    except Exception as exc:  # the unpickler raises many types on bad bytes
        raise CorruptDumpError(
            f"{source}: truncated or corrupt pickle ({type(exc).__name__}: {exc})"
        ) from None


def decode_json(data: bytes, *, source: str = "<bytes>") -> Any:
    """Decode a native JSON dump."""
    try:
        with gc_paused():
            return json.loads(data)
    except RecursionError:
        raise CorruptDumpError(f"{source}: JSON nests too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptDumpError(f"{source}: truncated or invalid JSON ({exc})") from None


_RANKS_TEXT: Final = re.compile(r"\s*\[\s*(\d+(?:\s*,\s*\d+)*)?\s*,?\s*\]\s*")


def _parse_ranks(raw: Any, limits: Limits = DEFAULT_LIMITS) -> tuple[int, ...] | None:
    """``pg_config`` ranks: a string like '[0, 1]' (or a list). Empty or implausible = unknown.

    The string is matched as a flat list of integers (no JSON parser: a nested
    '[[[[...' must cost nothing); members must be below ``limits.max_rank``.
    """
    if isinstance(raw, str):
        if len(raw) > 8 * limits.max_rank:
            return None
        match = _RANKS_TEXT.fullmatch(raw)
        if match is None or not match.group(1):
            return None
        digits = re.findall(r"\d+", match.group(1))
        if any(len(d) > 7 for d in digits):
            return None
        raw = [int(d) for d in digits]
    if not isinstance(raw, list | tuple) or not raw or len(raw) > limits.max_rank:
        return None
    if set(map(type, raw)) != {int} or min(raw) < 0 or max(raw) >= limits.max_rank:
        return None  # type() at C speed: no bools
    return tuple(raw)


_SCALARS: Final = frozenset({int, float, bool})


def _as_str(value: Any) -> str:
    """A string field as text; containers are never stringified (a nested or shared
    list would cost its whole depth or size), they read as ``<list>``."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if type(value) in _SCALARS:
        try:
            return str(value)
        except ValueError:  # an int past Python's 4,300 digits
            return f"<int of {value.bit_length()} bits>"
    return f"<{type(value).__name__}>"


def _cut(text: str, limits: Limits) -> str:
    """``text`` within ``limits.max_string_chars`` (longer ones cut, with a mark)."""
    if len(text) <= limits.max_string_chars:
        return text
    return text[:limits.max_string_chars] + f"…[{len(text) - limits.max_string_chars} more chars]"


def _by_identity(column: Sequence[Any], fn: Callable[[Any], Any]) -> list[Any]:
    """``[fn(v) for v in column]``, calling ``fn`` once per distinct *object*.

    A pickle may reference one list from every entry (its memo shares it): each
    distinct object is interpreted once, so the cost follows the file's size,
    never entries x list length. Objects stay alive for the call (ids are stable).
    """
    seen: dict[int, Any] = {}
    out = []
    for value in column:
        key = id(value)
        hit = seen.get(key, seen)
        if hit is seen:
            hit = seen[key] = fn(value)
        out.append(hit)
    return out


def normalize_op(profiling_name: str) -> tuple[str, int, int]:
    """``'nccl:send 0->1'`` -> ``('send', self_group_rank, peer_group_rank)``.

    Collectives return ``(name, -1, -1)`` with backend prefix and aliases removed.
    """
    name = profiling_name.split(":", 1)[1] if ":" in profiling_name else profiling_name
    name = name.strip()
    match = _P2P_NAME.match(name)
    if match:
        kind, a, _arrow, b = match.groups()
        return kind, int(a), int(b)
    base = name.split(" ", 1)[0]
    return _OP_ALIASES.get(base, base), NO_INDEX, NO_INDEX


class _TextBudgetExceeded(LimitExceededError):
    """A trace's string table passed its budget (the reader adds the source)."""


class _Table(dict[str, int]):
    """String interning for one trace: ``table[s]`` is the index of ``s`` (added on first use).

    A dict subclass so that ``map(table.__getitem__, column)`` interns a whole
    column at C speed, calling Python only for strings not seen before.
    """

    __slots__ = ("budget", "chars", "strings")

    def __init__(self, budget: int | None = None) -> None:
        super().__init__()
        self.strings: list[str] = []
        #: characters the table may hold (``Limits.text_budget``), None: unbounded
        self.budget = budget
        self.chars = 0

    def __missing__(self, s: str) -> int:
        if self.budget is not None:
            self.chars += len(s)
            if self.chars > self.budget:
                raise _TextBudgetExceeded(
                    f"its entries build more than {self.budget} characters of text "
                    "(shapes, dtype lists, names: the limit for a file of its size)")
        i = self[s] = len(self.strings)
        self.strings.append(s)
        return i

    def add(self, s: str) -> int:
        return self[s]


class _Memo(dict[Any, int]):
    """``memo[value]``: ``fill(value)``, computed once per distinct value."""

    __slots__ = ("fill",)

    def __init__(self, fill: Callable[[Any], int]) -> None:
        super().__init__()
        self.fill = fill

    def __missing__(self, key: Any) -> int:
        value = self[key] = self.fill(key)
        return value


class _Irregular(Exception):
    """The document is not uniform enough for the column-at-a-time reader."""


_NUMERIC: Final = re.compile(r"^\s*[+-]?\d{1,18}\s*$")


def lenient_ints(values: Sequence[Any], what: str) -> tuple[list[Any], list[str]]:
    """An integer field's values as PyTorch's own analyzer tolerates them.

    PyTorch's analyzer compares sequence ids with ``==`` and never converts them,
    and its tests write them as strings (``create_one_event``:
    ``"collective_seq_id": str(collective_seq_id)``). So a numeric string is read
    as its integer, and any other non-integer (a float, a list, a word) makes that
    entry's field unknown (read as absent, ``None``), never the dump unreadable.
    Each kind of leniency used gives one note naming the field (the analysis
    merges equal notes across ranks, naming them).
    """
    out: list[Any] = []
    strings = odd = 0
    for v in values:
        if type(v) in _INT_TYPES:
            out.append(v)
        elif isinstance(v, str) and _NUMERIC.match(v):
            out.append(int(v))
            strings += 1
        else:
            out.append(None)
            odd += 1
    notes = []
    if strings:
        notes.append(f"entry field {what!r} written as numeric strings (as PyTorch's analyzer "
                     "tests write it): read as integers")
    if odd:
        notes.append(f"entry field {what!r} holds a non-integer in some entries: unknown "
                     "there (read as absent)")
    return out, notes


def _int_list(values: list[Any], what: str, source: str,
              notes: list[str] | None = None) -> np.ndarray:
    if not set(map(type, values)) <= _INT_TYPES:
        values, said = lenient_ints(values, what)
        if notes is not None:
            notes.extend(n for n in said if n not in notes)
    try:
        out = np.array([0 if v is None else v for v in values], dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        out = None
    if out is None or out.shape != (len(values),):  # a list in an integer field: [[]] is 2-D
        raise CorruptDumpError(f"{source}: entry field {what!r} holds a non-integer") from None
    return out


def _bad(source: str, what: str) -> NoReturn:
    raise CorruptDumpError(f"{source}: {what}")


def _sizes_numel(sizes: Any, limits: Limits = DEFAULT_LIMITS) -> int:
    """Elements in ``sizes`` (a list of shapes); shapes that are not lists of ints count 0.

    Raises ``OverflowError`` past int64 and ``LimitExceededError`` for a shape of
    more than ``limits.max_dims`` dims (a corrupt dump); products are bounded in
    floating point first, so a hostile shape never builds a huge integer.
    """
    if not isinstance(sizes, list | tuple):
        return 0
    numel = 0
    shape_numel: dict[int, int] = {}
    for shape in sizes:
        hit = shape_numel.get(id(shape))
        if hit is None:
            hit = shape_numel[id(shape)] = _shape_numel(shape, limits)
        numel += hit
        if numel >= _MAX_NUMEL:
            raise OverflowError("tensor sizes past 2**62 elements")
    return numel


def _shape_numel(shape: Any, limits: Limits) -> int:
    if not isinstance(shape, list | tuple):
        return 0
    if len(shape) > limits.max_dims:
        raise LimitExceededError(f"a tensor shape of {len(shape)} dims (limit {limits.max_dims})")
    if not all(isinstance(d, int) for d in shape):
        return 0
    if math.prod(float(d) for d in shape) >= _MAX_NUMEL:
        raise OverflowError("tensor sizes past 2**62 elements")
    return math.prod(shape)


def _sizes_text(sizes: Any, limits: Limits) -> str:
    """``str(sizes)`` for a list of shapes of ints, bounded: never recurses past
    two levels, and a text of more than ``limits.max_shape_text_dims`` dims
    becomes a summary (the C scanner leaves those to this reader)."""
    if sizes is None:
        return "None"
    if not isinstance(sizes, list | tuple):
        return _cut(_as_str(sizes), limits)
    if set(map(type, sizes)) <= _SEQ_TYPES:  # the usual case, checked at C speed
        dims_total = sum(map(len, sizes))
        if (dims_total <= limits.max_shape_text_dims
                and max(map(len, sizes), default=0) <= limits.max_dims
                and set(map(type, chain.from_iterable(sizes))) <= {int}):
            return str(sizes)
    dims = 0
    for shape in sizes:
        if not isinstance(shape, list | tuple) or not set(map(type, shape)) <= {int}:
            return f"<{len(sizes)} malformed shapes>"
        dims += len(shape)
        if dims > limits.max_shape_text_dims or len(shape) > limits.max_dims:
            return f"<{len(sizes)} shapes, more than {limits.max_shape_text_dims} dims>"
    return str(sizes)


def _dtypes_text(dtypes: Any, limits: Limits) -> str:
    """``",".join`` of a dtype list, with the total length bounded."""
    if not dtypes:
        return ""
    if not isinstance(dtypes, list | tuple):
        return _as_str(dtypes)
    if set(map(type, dtypes)) <= {str} and sum(map(len, dtypes)) + len(dtypes) <= limits.max_string_chars:
        return ",".join(dtypes)  # the usual case, at C speed
    parts = []
    total = 0
    for part in map(_as_str, dtypes):
        parts.append(part)
        total += len(part) + 1
        if total > limits.max_string_chars:
            return _cut(",".join(parts), limits)
    return ",".join(parts)


def _pg_key(pgt: Any, pg_id: Any) -> tuple[str, str]:
    if isinstance(pgt, list | tuple) and len(pgt) >= 1:
        return _as_str(pgt[0]), _as_str(pgt[1]) if len(pgt) > 1 else ""
    return _as_str(pg_id), ""


def _state_of(value: Any) -> int:
    return int(_STATES.get(_as_str(value), OpState.SCHEDULED))


class _Context:
    """What both column readers share: the string table, groups, op kinds."""

    def __init__(self, config: dict[str, tuple[str, tuple[int, ...] | None]],
                 limits: Limits = DEFAULT_LIMITS, text_budget: int | None = None) -> None:
        self.config = config
        self.limits = limits
        self.strings = _Table(text_budget)
        self.group_index: dict[str, int] = {}
        self.groups: list[GroupInfo] = []
        # one row per distinct profiling_name: (op string index, local peer, p2p by name)
        self.op_kinds: list[tuple[int, int, bool]] = []
        self.op_kind = _Memo(self._new_op_kind)
        # backend prefixes of profiling names ("nccl:all_reduce" -> "nccl")
        self.backends: set[str] = set()
        # what the readers read leniently (``lenient_ints``), one note per kind
        self.notes: list[str] = []

    def group_of(self, name: str, desc: str) -> int:
        i = self.group_index.get(name)
        if i is None:
            cfg_desc, ranks = self.config.get(name, ("", None))
            i = self.group_index[name] = len(self.groups)
            self.groups.append(GroupInfo(name=_cut(name, self.limits),
                                         desc=_cut(desc or cfg_desc, self.limits), ranks=ranks))
        return i

    def _new_op_kind(self, profiling_name: Any) -> int:
        text = _as_str(profiling_name)
        if ":" in text:
            self.backends.add(text.split(":", 1)[0][:32])
        name, _self_rank, peer_local = normalize_op(text)
        self.op_kinds.append(
            (self.strings[name], peer_local, name in ("send", "recv", "recv_any_source"))
        )
        return len(self.op_kinds) - 1


class _Columns(NamedTuple):
    """The matching columns of every entry (detail columns come separately)."""

    pg: np.ndarray
    op_kind: np.ndarray  # index into _Context.op_kinds
    is_p2p: np.ndarray
    in_numel: np.ndarray
    out_numel: np.ndarray
    in_dtypes: np.ndarray
    state: np.ndarray
    record_id: np.ndarray
    seq: np.ndarray
    p2p_seq: np.ndarray
    t_enqueue: np.ndarray
    t_start: np.ndarray
    t_complete: np.ndarray
    timeout_ms: np.ndarray
    duration_ns: np.ndarray  # NO_INDEX: unknown (see _durations)


_SEQ_TYPES: Final = frozenset({list, tuple})
_STR_TYPES: Final = frozenset({str, type(None)})
_MAX_NUMEL: Final = float(1 << 62)  # beyond this, int64 products or sums could overflow
_BULK_KEYS: Final = (
    "process_group", "profiling_name", "is_p2p", "input_sizes", "output_sizes", "input_dtypes",
    "state", "retired", "record_id", "collective_seq_id", "p2p_seq_id", "time_created_ns",
    "time_discovered_started_ns", "time_discovered_completed_ns", "timeout_ms",
)


def _bulk_numel(column: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> np.ndarray:
    """``_sizes_numel`` of a whole column, or ``_Irregular`` unless every shape is well formed.

    Shapes and dims are flattened and typed at C speed and multiplied in numpy;
    types are checked before any arithmetic, so a hostile ``[["x", 10**9]]``
    never multiplies a string. A list object shared by many entries (a pickle's
    memo) is flattened once.
    """
    if not set(map(type, column)) <= _SEQ_TYPES:
        raise _Irregular
    keys = list(map(id, column))
    distinct = dict(zip(keys, column, strict=True))
    if len(distinct) < len(column):
        once = _bulk_numel(list(distinct.values()), limits)
        row_of = dict(zip(distinct, range(len(distinct)), strict=True))
        shared: np.ndarray = once[np.fromiter(map(row_of.__getitem__, keys), dtype=np.intp,
                                              count=len(keys))]
        return shared
    shapes = list(chain.from_iterable(column))
    if not set(map(type, shapes)) <= _SEQ_TYPES:
        raise _Irregular
    if len(shapes) and max(map(len, shapes)) > limits.max_dims:
        raise _Irregular  # the general reader says which limit
    dims = np.array(list(chain.from_iterable(shapes)))
    if dims.size and (dims.ndim != 1 or dims.dtype.kind != "i" or dims.min() < 0):
        raise _Irregular  # nested, bool, float, str, huge or negative dims: the general reader
    per_shape = np.fromiter(map(len, shapes), dtype=np.intp, count=len(shapes))
    starts = np.zeros(len(shapes), dtype=np.intp)
    np.cumsum(per_shape[:-1], out=starts[1:])
    # reduceat needs an element at every start, even for an empty trailing shape
    padded = np.append(dims, 1)
    if len(shapes) and np.multiply.reduceat(padded.astype(np.float64), starts).sum() >= _MAX_NUMEL:
        raise _Irregular  # int64 products or sums could overflow
    prods = np.multiply.reduceat(padded.astype(np.int64), starts) if len(shapes) else padded[:0]
    prods[per_shape == 0] = 1  # a scalar (shape []) holds one element
    cumulative = np.zeros(len(shapes) + 1, dtype=np.int64)
    np.cumsum(prods, out=cumulative[1:])
    per_entry = np.fromiter(map(len, column), dtype=np.intp, count=len(column))
    ends = np.cumsum(per_entry)
    numel: np.ndarray = cumulative[ends] - cumulative[ends - per_entry]
    return numel


_INT_TYPES: Final = frozenset({int, bool, type(None)})


def _bulk_int(column: Sequence[Any], *, none_is_zero: bool) -> np.ndarray:
    if not set(map(type, column)) <= _INT_TYPES:
        raise _Irregular  # lists (maybe one shared list) in an integer field
    if none_is_zero:
        column = [0 if v is None else v for v in column]
    out = np.array(column, dtype=np.int64)
    if out.shape != (len(column),):
        raise _Irregular  # lists in an integer field
    return out


def _mark_finished(state: np.ndarray, retired: np.ndarray, t_complete: np.ndarray) -> None:
    """Entries that are retired or have a completion time count as completed,
    whatever their ``state`` says (one rule for all three column readers)."""
    state[retired | (t_complete != 0)] = OpState.COMPLETED


#: Largest ``duration_ms`` taken as a duration (past it, ns would leave int64).
_MAX_DURATION_MS: Final = float(1 << 62) / 1e6
_NUMBER_TYPES: Final = frozenset({int, float})


def _durations(entries: list[dict[str, Any]]) -> np.ndarray:
    """Each entry's ``duration_ms`` in ns; ``NO_INDEX`` where absent or not a duration.

    PyTorch writes the key only for entries retired with timing on (a float of
    milliseconds, ``getDurationFromEvent``; docs/native-format.md). Anything else
    there (``None``, a bool, a string, a container, NaN, a negative or huge
    number) is damage and reads as unknown: the field is optional, so it never
    makes a dump unreadable. Milliseconds become ns as ``floor(ms * 1e6 + 0.5)``
    in float64, as the C scanner does, so both give the same integers.
    """
    raw: list[Any] = list(map(dict.get, entries, repeat("duration_ms")))
    out = np.full(len(raw), NO_INDEX, dtype=np.int64)
    types = set(map(type, raw))
    if types <= {type(None)}:  # timing off (the default): no entry has one
        return out
    if types <= {float, type(None)}:  # the usual case, at C speed (None -> NaN)
        values = np.array(raw, dtype=np.float64)
        rows = np.arange(len(raw), dtype=np.intp)
    else:
        picked = [i for i, v in enumerate(raw) if type(v) in _NUMBER_TYPES]
        # a huge int would overflow float(): past the range it is no duration anyway
        values = np.array([float(raw[i]) if -1e300 < raw[i] < 1e300 else math.nan
                           for i in picked], dtype=np.float64)
        rows = np.asarray(picked, dtype=np.intp)
    ok = (values >= 0) & (values < _MAX_DURATION_MS)  # NaN compares False
    out[rows[ok]] = np.floor(values[ok] * 1e6 + 0.5).astype(np.int64)
    return out


def _columns_bulk(entries: list[dict[str, Any]], ctx: _Context,
                  limits: Limits = DEFAULT_LIMITS) -> _Columns:
    """Column-at-a-time reader for uniform documents (every entry has every key).

    Each field is pulled for all entries with C-level ``map``; distinct values
    (group tuples, op names, dtype lists, states) are interpreted once. Raises
    ``_Irregular`` (or a ``KeyError``/``TypeError``/``ValueError``) on anything
    unusual: the caller then uses the entry-at-a-time reader, which decides what
    is malformed. Both readers give the same columns.
    """
    n = len(entries)
    # one tuple per entry, transposed into one tuple per field, both at C speed
    fields = zip(*map(itemgetter(*_BULK_KEYS), entries), strict=True) if n else repeat(())
    col: dict[str, Sequence[Any]] = dict(zip(_BULK_KEYS, fields, strict=False))

    group = _Memo(lambda pgt: ctx.group_of(*_pg_key(pgt, None)))
    pgs = col["process_group"]
    if not set(map(type, pgs)) <= _SEQ_TYPES or not all(pgs) or max(map(len, pgs), default=0) > 2:
        raise _Irregular  # the pg_id fallback (and odd tuples) are the general reader's business
    for key in ("profiling_name", "state"):
        if not set(map(type, col[key])) <= _STR_TYPES:
            raise _Irregular  # hashing a shared container per entry: the general reader
    pg = np.fromiter(map(group.__getitem__, pgs), dtype=np.int32, count=n)
    op_kind = np.fromiter(map(ctx.op_kind.__getitem__, col["profiling_name"]), dtype=np.int32, count=n)
    is_p2p = np.fromiter(map(bool, col["is_p2p"]), dtype=np.bool_, count=n).view(np.uint8)
    in_numel = _bulk_numel(col["input_sizes"], limits)
    out_numel = _bulk_numel(col["output_sizes"], limits)
    # each text interned as it is made (the table's budget bounds what is kept; a
    # list of every entry's text first held them all)
    in_dtypes = np.fromiter(
        _by_identity(col["input_dtypes"], lambda d: ctx.strings[_dtypes_text(d, limits)]),
        dtype=np.int32, count=n,
    )
    states = _Memo(_state_of)
    state = np.fromiter(map(states.__getitem__, col["state"]), dtype=np.uint8, count=n)
    retired = np.fromiter(map(operator.is_, col["retired"], repeat(True)), dtype=np.bool_, count=n)
    seq_ids = col["collective_seq_id"]
    if None in seq_ids:
        raise _Irregular  # older dumps: seq_id fallback
    t_complete = _bulk_int(col["time_discovered_completed_ns"], none_is_zero=True)
    _mark_finished(state, retired, t_complete)
    return _Columns(
        pg=pg,
        op_kind=op_kind,
        is_p2p=is_p2p,
        in_numel=in_numel,
        out_numel=out_numel,
        in_dtypes=in_dtypes,
        state=state,
        record_id=_bulk_int(col["record_id"], none_is_zero=True),
        seq=_bulk_int(seq_ids, none_is_zero=False),
        p2p_seq=_bulk_int(col["p2p_seq_id"], none_is_zero=True),
        t_enqueue=_bulk_int(col["time_created_ns"], none_is_zero=True),
        t_start=_bulk_int(col["time_discovered_started_ns"], none_is_zero=True),
        t_complete=t_complete,
        timeout_ms=_bulk_int(col["timeout_ms"], none_is_zero=True),
        duration_ns=_durations(entries),
    )


def _columns_general(entries: list[dict[str, Any]], ctx: _Context, source: str,
                     limits: Limits = DEFAULT_LIMITS) -> _Columns:
    """Entry-at-a-time reader: any 2.x schema, absent keys, odd types."""
    n = len(entries)
    pg = np.empty(n, dtype=np.int32)
    op_kind = np.empty(n, dtype=np.int32)
    is_p2p = np.zeros(n, dtype=np.uint8)
    in_numel = np.empty(n, dtype=np.int64)
    out_numel = np.empty(n, dtype=np.int64)
    in_dtypes = np.empty(n, dtype=np.int32)
    state = np.empty(n, dtype=np.uint8)
    retired = np.zeros(n, dtype=np.bool_)
    strings = ctx.strings
    numel_of: dict[int, int] = {}
    dtypes_of: dict[int, int] = {}

    def numel(sizes: Any) -> int:
        hit = numel_of.get(id(sizes))
        if hit is None:
            hit = numel_of[id(sizes)] = _sizes_numel(sizes, limits)
        return hit

    def dtypes(value: Any) -> int:
        hit = dtypes_of.get(id(value))
        if hit is None:
            hit = dtypes_of[id(value)] = strings[_dtypes_text(value, limits)]
        return hit

    try:
        for i, e in enumerate(entries):
            pg[i] = ctx.group_of(*_pg_key(e.get("process_group"), e.get("pg_id")))
            kind = op_kind[i] = ctx.op_kind[_as_str(e.get("profiling_name"))]
            is_p2p[i] = bool(e.get("is_p2p", ctx.op_kinds[kind][2]))
            in_numel[i] = numel(e.get("input_sizes"))
            out_numel[i] = numel(e.get("output_sizes"))
            in_dtypes[i] = dtypes(e.get("input_dtypes"))
            state[i] = _state_of(e.get("state"))
            retired[i] = e.get("retired") is True
    except LimitExceededError as exc:
        raise LimitExceededError(f"{source}: {exc}") from None
    except (TypeError, ValueError, AttributeError, OverflowError) as exc:
        _bad(source, f"malformed entry ({type(exc).__name__}: {exc})")

    def col(key: str, *fallbacks: str) -> np.ndarray:
        values = []
        for e in entries:
            v = e.get(key)
            for fb in fallbacks:
                if v is not None:
                    break
                v = e.get(fb)
            values.append(v)
        return _int_list(values, key, source, ctx.notes)

    t_complete = col("time_discovered_completed_ns")
    _mark_finished(state, retired, t_complete)
    return _Columns(
        pg=pg,
        op_kind=op_kind,
        is_p2p=is_p2p,
        in_numel=in_numel,
        out_numel=out_numel,
        in_dtypes=in_dtypes,
        state=state,
        record_id=col("record_id"),
        seq=col("collective_seq_id", "seq_id"),
        p2p_seq=col("p2p_seq_id"),
        t_enqueue=col("time_created_ns"),
        t_start=col("time_discovered_started_ns"),
        t_complete=t_complete,
        timeout_ms=col("timeout_ms"),
        duration_ns=_durations(entries),
    )


class _Details(NamedTuple):
    in_shapes: np.ndarray
    out_shapes: np.ndarray
    out_dtypes: np.ndarray
    thread: np.ndarray


def _read_details(
    entries: list[dict[str, Any]], rows: Iterable[int], strings: _Table, source: str,
    limits: Limits = DEFAULT_LIMITS,
) -> _Details:
    """Shapes, output dtypes and thread of the entries at ``rows`` (others: ``NO_INDEX``)."""
    n = len(entries)
    in_shapes = np.full(n, NO_INDEX, dtype=np.int32)
    out_shapes = np.full(n, NO_INDEX, dtype=np.int32)
    out_dtypes = np.full(n, NO_INDEX, dtype=np.int32)
    thread = np.full(n, NO_INDEX, dtype=np.int32)
    memo: dict[tuple[int, int], int] = {}  # (which, id(value)): each shared object once

    def text(which: int, value: Any) -> int:
        key = (which, id(value))
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = strings[_dtypes_text(value, limits) if which == 2
                                      else _sizes_text(value, limits)]
        return hit

    try:
        for i in rows:
            e = entries[i]
            in_shapes[i] = text(0, e.get("input_sizes"))
            out_shapes[i] = text(1, e.get("output_sizes"))
            out_dtypes[i] = text(2, e.get("output_dtypes"))
            thread[i] = strings[_cut(_as_str(e.get("thread_name")), limits)]
    except (TypeError, ValueError, AttributeError, OverflowError) as exc:
        _bad(source, f"malformed entry ({type(exc).__name__}: {exc})")
    return _Details(in_shapes, out_shapes, out_dtypes, thread)


class _Stacks:
    """Every entry's stack, each distinct stack resolved to ``Frame`` objects once.

    Pickles share one dict per distinct frame (the pickler memoizes them), so an
    entry's stack is keyed by the identities of its frame objects, computed for
    all entries at C speed; only a key not seen before is resolved. Identities
    are stable because ``entries`` stays alive for the whole call. JSON dumps
    (no memo) get one key per entry and are deduplicated by content.
    """

    def __init__(self, source: str, limits: Limits = DEFAULT_LIMITS) -> None:
        self.source = source
        self.limits = limits
        self.stacks: list[tuple[Frame, ...]] = []
        self._by_content: dict[tuple[Frame, ...], int] = {}
        self._frame_of: dict[int, Frame] = {}
        self._by_ids = _Memo(self._resolve)
        self._frames_of_key: dict[tuple[int, ...], Sequence[Any]] = {}

    def column(self, entries: list[dict[str, Any]]) -> np.ndarray:
        n = len(entries)
        frame_lists: list[Any] = list(map(dict.get, entries, repeat("frames")))
        if not set(map(type, frame_lists)) <= _SEQ_TYPES:
            return np.fromiter(map(self._one, frame_lists), dtype=np.int32, count=n)
        if len(set(map(id, frame_lists))) == n:  # every entry its own list (the usual case)
            id_maps: Iterator[Iterable[int]] = map(map, repeat(id), frame_lists)
            keys = list(map(tuple, id_maps))
        else:
            # one key per distinct list object: entries sharing one long frames
            # list cost that list once, not once per entry
            key_of: dict[int, tuple[int, ...]] = {}
            keys = []
            for frames in frame_lists:
                key = key_of.get(id(frames))
                if key is None:
                    key = key_of[id(frames)] = tuple(map(id, frames))
                keys.append(key)
        self._frames_of_key = dict(zip(keys, frame_lists, strict=True))
        try:
            return np.fromiter(map(self._by_ids.__getitem__, keys), dtype=np.int32, count=n)
        except (TypeError, ValueError, AttributeError, OverflowError) as exc:
            _bad(self.source, f"malformed entry ({type(exc).__name__}: {exc})")
        finally:
            self._frames_of_key = {}

    def _one(self, frames: Any) -> int:
        """One entry's stack index, checked entry by entry (odd types)."""
        if not frames:
            return NO_INDEX
        if not isinstance(frames, list | tuple):
            _bad(self.source, f"malformed entry ('frames' is a {type(frames).__name__})")
        try:
            return self._index_of(tuple(map(self._frame, frames)))
        except (TypeError, ValueError, AttributeError, OverflowError) as exc:
            _bad(self.source, f"malformed entry ({type(exc).__name__}: {exc})")

    def _resolve(self, key: tuple[int, ...]) -> int:
        if not key:
            return NO_INDEX
        return self._index_of(tuple(map(self._frame, self._frames_of_key[key])))

    def _index_of(self, resolved: tuple[Frame, ...]) -> int:
        s = self._by_content.get(resolved)
        if s is None:
            s = self._by_content[resolved] = len(self.stacks)
            self.stacks.append(resolved)
        return s

    def _frame(self, f: Any) -> Frame:
        hit = self._frame_of.get(id(f))
        if hit is None:
            if not isinstance(f, Mapping):
                raise TypeError(f"frame is a {type(f).__name__}")
            hit = Frame(_cut(_as_str(f.get("filename")), self.limits), int(f.get("line") or 0),
                        _cut(_as_str(f.get("name")), self.limits))
            if isinstance(f, dict):  # ids of objects alive for the whole call only
                self._frame_of[id(f)] = hit
        return hit


def _peers(cols: _Columns, ctx: _Context, groups: tuple[GroupInfo, ...]) -> np.ndarray:
    """Global rank of each p2p entry's peer (``NO_INDEX`` where unknown)."""
    n = len(cols.pg)
    peer = np.full(n, NO_INDEX, dtype=np.int32)
    if not ctx.op_kinds:
        return peer
    local_lut = np.array([k[1] for k in ctx.op_kinds], dtype=np.int64)
    local = local_lut[cols.op_kind]
    has_peer = local >= 0
    if not has_peer.any():
        return peer
    for gi, g in enumerate(groups):
        rows = np.flatnonzero(has_peer & (cols.pg == gi))
        if not len(rows):
            continue
        if g.ranks is not None:
            lut = np.append(np.array(g.ranks, dtype=np.int64), NO_INDEX)
            idx = local[rows]
            peer[rows] = lut[np.where(idx < len(g.ranks), idx, len(g.ranks))]
        elif _is_default_group(g):
            peer[rows] = local[rows]  # the default group's ranks are the global ranks
    return peer


def to_trace(
    doc: Any,
    *,
    source: str,
    fmt: SourceFormat,
    rank: int | None,
    rank_from: str = "filename",
    detail_tail: int | None = None,
    limits: Limits = DEFAULT_LIMITS,
    text_budget: int | None = None,
) -> RankTrace:
    """Normalize a decoded native document into a :class:`RankTrace`, within ``limits``.

    ``rank`` comes from the file name (native dumps carry none); a top-level
    ``rank`` key, where a writer added one, wins.

    ``detail_tail=None`` (the default) resolves every entry in full. With
    ``detail_tail=N`` the trace is a *matching view* for analysis: every column
    the cross-rank matching reads is complete, but the report-only columns
    (``in_shapes``, ``out_shapes``, ``out_dtypes``, ``thread``, ``stack``) are
    filled only for the last ``N`` entries and every unfinished one — exactly
    the entries :func:`frforensics.analyzer.digest.digest` keeps — and are
    ``NO_INDEX`` elsewhere (stacks are always complete: each distinct stack is
    resolved once). Formatting the shapes of 2000 entries costs a third of
    decoding the pickle; an analysis shows a few dozen.

    ``text_budget``: characters the trace's string table may hold
    (``Limits.text_budget`` of the file's size; past it, ``LimitExceededError``).
    A pickle's memo lets each entry build its text from one long shared string.
    """
    header = _header(doc, source=source, rank=rank, rank_from=rank_from, limits=limits)
    entries = doc.get("entries") or []
    if not isinstance(entries, list):
        _bad(source, "'entries' is not a list of records")
    if len(entries) > limits.max_entries:
        raise LimitExceededError(f"{source}: {len(entries)} entries (limit {limits.max_entries} "
                                 "per rank)")
    if not set(map(type, entries)) <= {dict}:
        if not all(isinstance(e, Mapping) for e in entries):
            _bad(source, "'entries' is not a list of records")
        entries = [dict(e) for e in entries]

    try:
        ctx = _Context(header.config, limits, text_budget)
        try:
            cols = _columns_bulk(entries, ctx, limits)
        except (_Irregular, KeyError, TypeError, ValueError, OverflowError):
            # start clean: the general reader interns in its own order
            ctx = _Context(header.config, limits, text_budget)
            cols = _columns_general(entries, ctx, source, limits)
        n = len(entries)
        details = _read_details(entries, _detail_rows(cols, n, detail_tail, ctx), ctx.strings,
                                source, limits)
    except _TextBudgetExceeded as exc:
        raise LimitExceededError(f"{source}: {exc}") from None
    stacks = _Stacks(source, limits)
    stack = stacks.column(entries)
    return _assemble(n, ctx, cols, details, tuple(stacks.stacks), stack, header, source, fmt,
                     limits)


class _Header(NamedTuple):
    version: str
    rank: int | None
    rank_from: str
    config: dict[str, tuple[str, tuple[int, ...] | None]]
    notes: tuple[str, ...] = ()
    #: sum over groups of ``pg_status[...]["last_enqueued_collective"]`` (None: absent)
    enqueued_total: int | None = None


def _enqueued_total(pg_status: Any) -> int | None:
    """Sum of every group's ``last_enqueued_collective`` (ints in pickles, strings in JSON)."""
    if not isinstance(pg_status, Mapping):
        return None
    total = 0
    for status in pg_status.values():
        if not isinstance(status, Mapping):
            return None
        raw = status.get("last_enqueued_collective")
        if isinstance(raw, str) and raw.lstrip("-").isdigit() and len(raw) < 19:
            raw = int(raw)
        if not isinstance(raw, int) or isinstance(raw, bool) or not -1 <= raw < 1 << 53:
            return None
        total += max(raw, 0)
    return total


#: the newest schema this reader was written against (torch 2.13-2.15 write "2.10")
NEWEST_KNOWN_VERSION: Final = (2, 10)
_KNOWN_TOP_KEYS: Final = frozenset({
    "version", "pg_config", "pg_status", "entries", "comm_lib_version", "nccl_version",
    "nccl_comm_state", "rank",
})
_KNOWN_ENTRY_KEYS: Final = frozenset({
    "record_id", "pg_id", "process_group", "collective_seq_id", "p2p_seq_id", "op_id",
    "profiling_name", "time_created_ns", "duration_ms", "input_sizes", "input_dtypes",
    "output_sizes", "output_dtypes", "state", "time_discovered_started_ns",
    "time_discovered_completed_ns", "retired", "timeout_ms", "is_p2p", "frames", "thread_id",
    "thread_name", "seq_id",
})


def _version_notes(version: str, unknown: set[str]) -> tuple[str, ...]:
    """Say when a dump is newer than this reader or has fields it does not know."""
    notes = []
    match = re.match(r"^(\d{1,4})\.(\d{1,4})", version)
    if not match:
        notes.append(f"schema version {version[:40]!r} not recognized: read as far as possible")
    elif (int(match[1]), int(match[2])) > NEWEST_KNOWN_VERSION:
        notes.append(f"schema version {version} is newer than the newest this analyzer knows "
                     f"({'.'.join(map(str, NEWEST_KNOWN_VERSION))}): read as far as possible")
    if unknown:
        names = sorted(str(k)[:40] for k in unknown)
        notes.append(f"unknown field(s) ignored: {', '.join(names[:8])}"
                     + (f" (+{len(names) - 8} more)" if len(names) > 8 else ""))
    return tuple(notes)


def _header(
    doc: Any, *, source: str, rank: int | None, rank_from: str, scanned: bool = False,
    limits: Limits = DEFAULT_LIMITS,
) -> _Header:
    """What a document says besides its entries: version, rank, group membership.

    ``scanned``: ``doc`` is the C scanner's top level, whose entries it took out.
    """
    if not isinstance(doc, Mapping):
        raise NotADumpError(f"{source}: not a flight-recorder dump (top level is {type(doc).__name__})")
    if not scanned and "entries" not in doc and "version" not in doc:
        raise NotADumpError(f"{source}: not a flight-recorder dump (no 'version' or 'entries')")
    if isinstance(doc.get("rank"), int) and not isinstance(doc.get("rank"), bool):
        rank, rank_from = int(doc["rank"]), "content"

    # groups: pg_config first (membership), then every group entries name
    pg_config = doc.get("pg_config") or {}
    if not isinstance(pg_config, Mapping):
        pg_config = {}
    config: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    ranks_of: dict[int, tuple[int, ...] | None] = {}  # a ranks string shared by many groups: once
    for key, cfg in pg_config.items():
        if not isinstance(cfg, Mapping):
            continue
        name = _cut(_as_str(cfg.get("name")) or _as_str(key), limits)
        if not name:
            continue  # gloo writes {'': {name: '', desc: '', ranks: '[]'}}
        raw = cfg.get("ranks")
        if id(raw) not in ranks_of:
            ranks_of[id(raw)] = (
                shared_ranks(("text", limits.max_rank, raw), len(raw) // 4, partial(_parse_ranks, raw, limits))
                if isinstance(raw, str) else _parse_ranks(raw, limits))
        config[name] = (_cut(_as_str(cfg.get("desc")), limits), ranks_of[id(raw)])
    version = _cut(_as_str(doc.get("version")), limits)
    # keys are named through _as_str: a tuple key is never stringified in depth
    unknown = {_as_str(k)[:40] for k in doc if k not in _KNOWN_TOP_KEYS}
    entries = doc.get("entries")
    if not scanned and isinstance(entries, list) and entries and isinstance(entries[0], Mapping):
        unknown |= {f"entries[].{_as_str(k)[:40]}" for k in entries[0]
                    if k not in _KNOWN_ENTRY_KEYS}
    return _Header(version, rank, rank_from, config, _version_notes(version, unknown),
                   _enqueued_total(doc.get("pg_status")))


#: ops whose compared side is chosen per entry from both dtype lists (the digest's
#: ``agreed_side``): their output dtypes are read in every view
ROOTED_OPS: Final = frozenset({"scatter", "gather"})


def _detail_rows(cols: _Columns, n: int, detail_tail: int | None,
                 ctx: _Context | None = None) -> Iterable[int]:
    """Rows whose report-only columns are resolved (see :func:`to_trace`): the
    tail, every unfinished entry, and every rooted op (``ROOTED_OPS``), whose
    output dtypes the matching reads."""
    if detail_tail is None:
        return range(n)
    pending = np.flatnonzero(cols.state < OpState.COMPLETED)
    start = max(0, n - detail_tail)
    rows = {*range(start, n), *pending[pending < start].tolist()}
    if ctx is not None and ctx.op_kinds:
        texts = ctx.strings.strings
        rooted = [k for k, (s, _peer, _p2p) in enumerate(ctx.op_kinds) if texts[s] in ROOTED_OPS]
        if rooted:
            hits = np.flatnonzero(np.isin(cols.op_kind[:start], rooted))
            rows.update(hits.tolist())
    return sorted(rows)


def _assemble(
    n: int,
    ctx: _Context,
    cols: _Columns,
    details: _Details,
    stacks: tuple[tuple[Frame, ...], ...],
    stack: np.ndarray,
    header: _Header,
    source: str,
    fmt: SourceFormat,
    limits: Limits = DEFAULT_LIMITS,
) -> RankTrace:
    _check_ranges(cols, source, limits)
    group_tuple = tuple(ctx.groups)
    if len(ctx.backends) == 1:
        # the profiling names' prefix says which backend wrote the states
        # ("nccl": CUDA events queried at dump time; "gloo": retirement only)
        backend = next(iter(ctx.backends))
        group_tuple = tuple(GroupInfo(g.name, g.desc, g.ranks, backend) for g in group_tuple)
    op_lut = np.array([k[0] for k in ctx.op_kinds] or [NO_INDEX], dtype=np.int32)
    unrecorded = _unrecorded_ops(cols, ctx, header)
    table = EntryTable.from_columns(
        n,
        {
            "record_id": cols.record_id,
            "pg": cols.pg,
            "seq": cols.seq,
            "p2p_seq": cols.p2p_seq,
            "op": op_lut[cols.op_kind] if n else np.empty(0, dtype=np.int32),
            "is_p2p": cols.is_p2p,
            "peer": _peers(cols, ctx, group_tuple),
            "in_numel": cols.in_numel,
            "out_numel": cols.out_numel,
            "in_shapes": details.in_shapes,
            "out_shapes": details.out_shapes,
            "in_dtypes": cols.in_dtypes,
            "out_dtypes": details.out_dtypes,
            "state": cols.state,
            "t_enqueue_ns": cols.t_enqueue,
            "t_start_ns": cols.t_start,
            "t_complete_ns": cols.t_complete,
            "timeout_ms": cols.timeout_ms,
            "duration_ns": cols.duration_ns,
            "thread": details.thread,
            "stack": stack,
        },
    )
    strings = ctx.strings.strings
    if strings and max(map(len, strings)) > limits.max_string_chars:
        strings = [_cut(x, limits) for x in strings]
    return RankTrace(
        rank=header.rank,
        header=DumpHeader(
            rank_from=header.rank_from if header.rank is not None else "unknown",
            source=source,
            format=fmt,
            version=header.version,
            unrecorded_ops=unrecorded,
        ),
        groups=group_tuple,
        strings=tuple(strings),
        stacks=stacks,
        entries=table,
        notes=(*header.notes, *ctx.notes, *_unknown_notes(cols, n)),
    )


def _unrecorded_ops(cols: _Columns, ctx: _Context, header: _Header) -> int:
    """Ops gloo counted in ``pg_status`` but never recorded (its send/recv).

    On gloo every work bumps the group's ``seq_`` (``last_enqueued_collective``)
    while only collectives are recorded, each with its own
    ``collective_seq_id``; the difference of the sums over groups is the rank's
    p2p ops. NCCL's ``pg_status`` mixes p2p and collective seqs differently (and
    NCCL records p2p), so this is computed for gloo dumps only.
    """
    if header.enqueued_total is None or ctx.backends != {"gloo"} or not len(cols.seq):
        return 0
    coll = cols.is_p2p == 0
    recorded = 0
    for g in np.unique(cols.pg[coll]).tolist():
        recorded += max(int(cols.seq[coll & (cols.pg == g)].max()), 0)
    return max(header.enqueued_total - recorded, 0)


def _check_ranges(cols: _Columns, source: str, limits: Limits) -> None:
    """Numbers the analyzer counts with, within their domains (damage is a load problem)."""
    if not len(cols.seq):
        return
    for name in ("seq", "p2p_seq"):
        col = getattr(cols, name)
        if int(col.min()) < NO_INDEX or int(col.max()) >= limits.max_seq:
            raise CorruptDumpError(f"{source}: a {name} of {int(col.max())} or "
                                   f"{int(col.min())} is not plausible (limit {limits.max_seq})")
    for name in ("t_enqueue", "t_start", "t_complete", "timeout_ms"):
        col = getattr(cols, name)
        if int(col.min()) < 0 or int(col.max()) >= 1 << 62:
            raise CorruptDumpError(f"{source}: entry field {name} holds an implausible value")


#: PyTorch's field names of the columns whose absence makes a judgement impossible.
_JUDGED_FIELDS: Final = (("t_enqueue", "time_created_ns", "how long it waited"),
                         ("timeout_ms", "timeout_ms", "whether it passed its timeout"))


def _unknown_notes(cols: _Columns, n: int) -> tuple[str, ...]:
    """A note per field missing (absent, null or 0) in some entries: an unknown, never a 0."""
    notes = []
    for column, field, what in _JUDGED_FIELDS:
        missing = int(np.count_nonzero(getattr(cols, column) == 0)) if n else 0
        if missing:
            notes.append(f"{field} missing in {missing} of {n} entries: "
                         f"{what} is unknown for them")
    return tuple(notes)


# ---- the C scanner's path -------------------------------------------------------

try:
    from frforensics.formats import _picklescan
except ImportError:  # not compiled (no compiler, not CPython): the unpickler path only
    _picklescan = None  # type: ignore[assignment]


def scanner_available() -> bool:
    """True when the C opcode scanner is compiled and not turned off.

    ``FRFORENSICS_PICKLE_SCAN=0`` turns it off (every pickle then goes through
    :class:`NoGlobalsUnpickler`), for comparisons and for a suspected bug.
    """
    return _picklescan is not None and os.environ.get("FRFORENSICS_PICKLE_SCAN", "1") != "0"


def pickle_to_trace(
    data: bytes,
    *,
    source: str,
    rank: int | None,
    detail_tail: int | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> RankTrace:
    """A native pickle dump's :class:`RankTrace`: ``to_trace(decode_pickle(data), ...)``.

    Regular dumps are read by the C scanner (``_picklescan``), which executes
    the pickle's opcodes into columns without building the document and gives
    the same trace as the Python readers; anything it does not accept (any
    global, odd types, missing fields, malformed bytes) is decoded by
    :class:`NoGlobalsUnpickler` and read in Python, which decides what is wrong,
    except a stream the scanner finds certainly malformed (truncated, stack
    underflow, a memo index past the end of the file...), refused at once.
    """
    scanned = (_picklescan.scan(data, limits.max_dims, limits.max_shape_text_dims,
                                limits.max_string_chars, limits.max_entries,
                                limits.text_budget(len(data)))
               if scanner_available() else None)
    if isinstance(scanned, tuple):  # a limit: more entries (counted before reading them), text
        raise LimitExceededError(f"{source}: {scanned[0]}")
    if isinstance(scanned, str):
        raise CorruptDumpError(f"{source}: truncated or corrupt pickle ({scanned})")
    if scanned is not None and ("duration" not in scanned or scanned.get("string_ints")):
        # a scanner compiled before duration_ms was read; or numeric strings in an
        # integer field (PyTorch's analyzer tests write str(seq)), which the Python
        # reader takes entry by entry, interning strings in that order: the Python reader
        scanned = None
    if scanned is None:
        doc = decode_pickle(data, source=source)
        return to_trace(doc, source=source, fmt=SourceFormat.NATIVE_PICKLE, rank=rank,
                        detail_tail=detail_tail, limits=limits,
                        text_budget=limits.text_budget(len(data)))
    return _trace_from_scan(scanned, source=source, rank=rank, detail_tail=detail_tail,
                            limits=limits)


def _first_seen(codes: np.ndarray, fill: Callable[[int], int], dtype: Any) -> np.ndarray:
    """``[fill(c) for c in codes]``, calling ``fill`` once per distinct code, in first-seen order.

    The order matters: ``fill`` may intern strings, and the Python reader
    interns them in entry order. Codes are string-table indices (a few hundred
    distinct in 2000 entries): a table indexed by code finds each one's first
    row without sorting (``np.unique`` was ~0.12 ms a column, a tenth of a
    pickle's reading after the scan); codes too large for a table, or negative,
    are sorted as before.
    """
    n = len(codes)
    if not n:
        return np.empty(0, dtype=dtype)
    low, top = int(codes.min()), int(codes.max())
    if low < 0 or top >= _DENSE_CODES + 4 * n:
        distinct, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
        lut = np.empty(len(distinct), dtype=dtype)
        for j in np.argsort(first, kind="stable").tolist():
            lut[j] = fill(int(distinct[j]))
        return lut[inverse.reshape(-1)]
    row = np.full(top + 1, n, dtype=np.int64)
    np.minimum.at(row, codes, np.arange(n, dtype=np.int64))  # each code's first row
    seen = np.flatnonzero(row < n)
    table = np.zeros(top + 1, dtype=dtype)
    for code in seen[np.argsort(row[seen], kind="stable")].tolist():
        table[code] = fill(code)
    out: np.ndarray = table[codes]
    return out


#: codes below this (or below 4 per row) go through a table, not a sort
_DENSE_CODES: Final = 1 << 16


def _group_codes(name: np.ndarray, desc: np.ndarray, strings: list[str], ctx: _Context) -> np.ndarray:
    """Each entry's group, from its name and description codes, in first-seen order.

    A (name, description) pair is one code: the name's code times the number of
    distinct descriptions plus the description's place among them (small enough
    for :func:`_first_seen`'s table, where name × len(strings) was not)."""
    if len(desc) and int(desc.min()) >= 0:
        mark = np.zeros(int(desc.max()) + 1, dtype=np.bool_)
        mark[desc] = True
        descs = np.flatnonzero(mark)
        place = np.cumsum(mark, dtype=np.int64) - 1
        k = len(descs)
        return _first_seen(name.astype(np.int64) * k + place[desc],
                           lambda key: ctx.group_of(strings[key // k], strings[int(descs[key % k])]),
                           np.int32)
    width = len(strings)
    return _first_seen(name.astype(np.int64) * width + desc,
                       lambda key: ctx.group_of(strings[key // width], strings[key % width]),
                       np.int32)


def _trace_from_scan(
    sc: dict[str, Any], *, source: str, rank: int | None, detail_tail: int | None,
    limits: Limits = DEFAULT_LIMITS,
) -> RankTrace:
    """The :class:`RankTrace` of a document the C scanner read (same as :func:`to_trace`)."""
    header = _header(sc["doc"], source=source, rank=rank, rank_from="filename", scanned=True,
                     limits=limits)
    strings: list[str] = sc["strings"]
    n: int = sc["n"]
    if n > limits.max_entries:
        raise LimitExceededError(f"{source}: {n} entries (limit {limits.max_entries} per rank)")

    def col(name: str, dtype: Any) -> np.ndarray:
        return np.frombuffer(sc[name], dtype=dtype)

    ctx = _Context(header.config, limits)
    pg = _group_codes(col("pg_name", np.int32), col("pg_desc", np.int32), strings, ctx)
    op_kind = _first_seen(col("profiling_name", np.int32), lambda s: ctx.op_kind[strings[s]], np.int32)
    in_dtypes = _first_seen(col("in_dtypes", np.int32), lambda s: ctx.strings[strings[s]], np.int32)
    state = _first_seen(col("state", np.int32), lambda s: _state_of(strings[s]), np.uint8)
    t_complete = col("t_complete", np.int64)
    _mark_finished(state, col("retired", np.bool_), t_complete)
    cols = _Columns(
        pg=pg,
        op_kind=op_kind,
        is_p2p=col("is_p2p", np.uint8),
        in_numel=col("in_numel", np.int64),
        out_numel=col("out_numel", np.int64),
        in_dtypes=in_dtypes,
        state=state,
        record_id=col("record_id", np.int64),
        seq=col("seq", np.int64),
        p2p_seq=col("p2p_seq", np.int64),
        t_enqueue=col("t_enqueue", np.int64),
        t_start=col("t_start", np.int64),
        t_complete=t_complete,
        timeout_ms=col("timeout_ms", np.int64),
        duration_ns=col("duration", np.int64),
    )

    # report-only columns, interned row by row in the Python reader's order
    details = _Details(*(np.full(n, NO_INDEX, dtype=np.int32) for _ in range(4)))
    sources = [col(name, np.int32) for name in ("in_sizes", "out_sizes", "out_dtypes", "thread")]
    table = ctx.strings
    for i in _detail_rows(cols, n, detail_tail, ctx):
        for out, src in zip(details, sources, strict=True):
            out[i] = table[strings[src[i]]]

    frames = [
        Frame(strings[f], line, strings[m])
        for f, line, m in zip(
            col("frame_file", np.int32).tolist(),
            col("frame_line", np.int64).tolist(),
            col("frame_name", np.int32).tolist(),
            strict=True,
        )
    ]
    offsets = col("stack_offsets", np.int32).tolist()
    flat = col("stack_frames", np.int32).tolist()
    stacks = tuple(
        tuple(frames[f] for f in flat[lo:hi]) for lo, hi in pairwise(offsets)
    )
    return _assemble(n, ctx, cols, details, stacks, col("stack", np.int32), header, source,
                     SourceFormat.NATIVE_PICKLE, limits)


def _is_default_group(group: GroupInfo) -> bool:
    return group.desc == "default_pg" or group.name == "0"
