"""The ``frdump`` format: frforensics' own per-rank dump, versioned msgpack.

Layout::

    MAGIC (8 bytes: b"\\x93FRDUMP\\n")  then one msgpack map:
    {
      "format": "frforensics.frdump", "version": 1,
      "rank": 3, "world_size": 8, "host": "node07", "pid": 4121, "job_id": null,
      "dump_reason": "peer_signal", "dump_detail": "...",
      "dump_time_ns": ..., "dump_monotonic_ns": ..., "completion_resolution_ns": 2000000,
      "groups": [{"name": "0", "desc": "default_pg", "ranks": <i4 bytes>, "backend": "gloo"}],
      "strings": ["all_reduce", "Float", ...],              # string table
      "frames": {"file": <i4 bytes>, "line": <i4 bytes>, "name": <i4 bytes>},
      "stacks": [<i4 bytes: frame indices, outermost first>, ...],
      "entries": {"n": 2000, "dropped": 17, "columns": {"seq": ["<i8", <bytes>], ...}},
      "threads": [{"name": "MainThread", "ident": 1, "is_main": true, "stack": 4}],
      "stale_peers": [{"rank": 5, "age_s": 12.5}],
      "death": {"kind": "exception", "message": "...", "stack": 7} | null,
      "notes": [],
      "local_rank": 3, "cuda_device": 3, "gpu_uuid": "GPU-...", "pci_bus_id": "0000:1b:00.0"
    }                       # identity keys: absent in older dumps (read as null)

Entries are columns of little-endian integers (``model.ENTRY_COLUMNS``), so a
2000-entry dump decodes with one ``msgpack.unpackb`` and a few ``np.frombuffer``
calls and no per-entry Python object. Names, shapes, dtypes and file names are
stored once in the string table; stacks once in the stack table.

Compatibility: a reader accepts every version up to ``VERSION``; columns it does
not know are ignored and columns it expects but finds absent get their default,
so adding a column does not need a version bump. A newer version is refused with
a message naming the upgrade.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import msgpack
import numpy as np

from frforensics.errors import (
    CorruptDumpError,
    LimitExceededError,
    NotADumpError,
    UnsupportedVersionError,
)
from frforensics.formats._shared import shared_ranks
from frforensics.formats.limits import DEFAULT_LIMITS, Limits
from frforensics.model import (
    ENTRY_COLUMNS,
    NO_INDEX,
    DeathInfo,
    DumpHeader,
    DumpReason,
    EntryTable,
    Frame,
    GroupInfo,
    OpState,
    PeerHeartbeat,
    RankTrace,
    SourceFormat,
    ThreadStack,
)

MAGIC: Final = b"\x93FRDUMP\n"
FORMAT_NAME: Final = "frforensics.frdump"
VERSION: Final = 3
# Version history (readers accept all of them):
#   1  group members as a msgpack list of ints
#   2  group members as packed little-endian int32 (a 16k-rank default group in
#      every rank's dump decodes with one frombuffer, not 16k Python ints)
#   3  group members that form an arithmetic progression of 8 or more ranks (the
#      default group, TP blocks, DP/PP strides) as {"arith": [start, step, count]}:
#      a 10k-rank default group is 3 ints, not 40 KB, in the tail digests the
#      ranks publish through the c10d store at hang time

__all__ = ["MAGIC", "VERSION", "decode", "encode", "is_frdump", "write_atomic"]


def is_frdump(head: bytes) -> bool:
    """True when ``head`` (the first bytes of a file) starts with our magic."""
    return head.startswith(MAGIC)


class _Interner:
    """Builds a deduplicated string table and frame/stack tables for writing."""

    def __init__(self, strings: Sequence[str] = ()) -> None:
        self.strings: list[str] = list(strings)
        self._index = {s: i for i, s in enumerate(self.strings)}
        self.frame_file: list[int] = []
        self.frame_line: list[int] = []
        self.frame_name: list[int] = []
        self._frames: dict[Frame, int] = {}
        self.stacks: list[bytes] = []
        self._stacks: dict[tuple[Frame, ...], int] = {}

    def string(self, s: str) -> int:
        index = self._index.get(s)
        if index is None:
            index = self._index[s] = len(self.strings)
            self.strings.append(s)
        return index

    def frame(self, frame: Frame) -> int:
        index = self._frames.get(frame)
        if index is None:
            index = self._frames[frame] = len(self.frame_file)
            self.frame_file.append(self.string(frame.file))
            self.frame_line.append(frame.line)
            self.frame_name.append(self.string(frame.name))
        return index

    def stack(self, frames: tuple[Frame, ...]) -> int:
        index = self._stacks.get(frames)
        if index is None:
            index = self._stacks[frames] = len(self.stacks)
            ids = np.fromiter((self.frame(f) for f in frames), dtype="<i4", count=len(frames))
            self.stacks.append(ids.tobytes())
        return index


def _i4(values: Sequence[int]) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


_ARITH_MIN: Final = 8


def _ranks_doc(ranks: tuple[int, ...] | None) -> Any:
    """Group members: ``{"arith": [start, step, count]}`` for a long progression,
    packed int32 otherwise (None when unknown)."""
    if ranks is None:
        return None
    if len(ranks) >= _ARITH_MIN:
        steps = np.diff(np.asarray(ranks, dtype=np.int64))
        step = int(steps[0])
        if step > 0 and bool((steps == step).all()):
            return {"arith": [int(ranks[0]), step, len(ranks)]}
    return _i4(ranks)


def encode(trace: RankTrace) -> bytes:
    """Serialize ``trace`` to frdump bytes (magic + msgpack)."""
    tables = _Interner(trace.strings)
    # Entry stack indices refer to trace.stacks: keep their order in the table.
    for frames in trace.stacks:
        tables.stack(frames)
    if len(tables.stacks) != len(trace.stacks):
        raise ValueError("RankTrace.stacks holds duplicate stacks")
    threads = [
        {"name": t.name, "ident": t.ident, "is_main": t.is_main, "stack": tables.stack(t.frames)}
        for t in trace.threads
    ]
    death = None
    if trace.death is not None:
        death = {
            "kind": trace.death.kind,
            "message": trace.death.message,
            "stack": tables.stack(trace.death.frames),
        }
    entries = trace.entries
    columns = {
        name: [dtype, np.ascontiguousarray(getattr(entries, name), dtype=dtype).tobytes()]
        for name, dtype in ENTRY_COLUMNS.items()
    }
    doc: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": VERSION,
        "rank": trace.rank,
        "world_size": trace.world_size,
        "host": trace.host,
        "pid": trace.pid,
        "job_id": trace.job_id,
        "dump_reason": trace.dump_reason.value,
        "dump_detail": trace.dump_detail,
        "dump_time_ns": trace.dump_time_ns,
        "dump_monotonic_ns": trace.dump_monotonic_ns,
        "completion_resolution_ns": trace.completion_resolution_ns,
        "groups": [
            {
                "name": g.name,
                "desc": g.desc,
                "ranks": _ranks_doc(g.ranks),
                "backend": g.backend,
            }
            for g in trace.groups
        ],
        "strings": tables.strings,
        "frames": {
            "file": _i4(tables.frame_file),
            "line": _i4(tables.frame_line),
            "name": _i4(tables.frame_name),
        },
        "stacks": tables.stacks,
        "entries": {"n": len(entries), "dropped": trace.dropped, "columns": columns},
        "threads": threads,
        "stale_peers": [{"rank": p.rank, "age_s": p.age_s} for p in trace.stale_peers],
        "death": death,
        "notes": list(trace.notes),
        "unrecorded_ops": trace.unrecorded_ops,
        "local_rank": trace.local_rank,
        "cuda_device": trace.cuda_device,
        "gpu_uuid": trace.gpu_uuid,
        "pci_bus_id": trace.pci_bus_id,
    }
    packed: bytes = msgpack.packb(doc, use_bin_type=True)
    return MAGIC + packed


def write_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically and never through a link (the one
    implementation: :func:`frforensics._atomic.write_atomic`; its parents made,
    owner-only permissions as dumps always had). Returns the final path."""
    from frforensics._atomic import write_atomic as _write_atomic

    return _write_atomic(path, data, mode=0o600, make_parents=True, durable=True)


# ---------------------------------------------------------------- reading


def _field(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], source: str) -> Any:
    value = doc.get(key)
    if value is not None and not isinstance(value, kind):
        raise CorruptDumpError(f"{source}: field {key!r} has type {type(value).__name__}")
    return value


def _opt_int(doc: Mapping[str, Any], key: str, source: str) -> int | None:
    value = _field(doc, key, int, source)
    return None if value is None or isinstance(value, bool) else int(value)


def _cut(text: str, limits: Limits) -> str:
    """``text`` within ``limits.max_string_chars`` (longer ones cut, with a mark)."""
    if len(text) <= limits.max_string_chars:
        return text
    return text[:limits.max_string_chars] + f"…[{len(text) - limits.max_string_chars} more chars]"


def _opt_str(doc: Mapping[str, Any], key: str, source: str, limits: Limits) -> str | None:
    value = _field(doc, key, str, source)
    return None if value is None else _cut(str(value), limits)


def _int_column(raw: Any, what: str, source: str) -> np.ndarray:
    if not isinstance(raw, bytes) or len(raw) % 4:
        raise CorruptDumpError(f"{source}: {what} is not an int32 column")
    return np.frombuffer(raw, dtype="<i4")


def _section(doc: Mapping[str, Any], key: str, kind: type, source: str) -> Any:
    """A top-level section of the given container type (absent or null: empty)."""
    value = doc.get(key)
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise CorruptDumpError(f"{source}: {key!r} is a {type(value).__name__}, "
                               f"not a {kind.__name__}")
    return value


def _records(doc: Mapping[str, Any], key: str, source: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = _section(doc, key, list, source)
    if not all(isinstance(x, dict) for x in items):
        raise CorruptDumpError(f"{source}: {key!r} holds something other than records")
    return items


def decode(data: bytes, *, source: str = "<bytes>", limits: Limits = DEFAULT_LIMITS) -> RankTrace:
    """Parse frdump bytes into a :class:`RankTrace`, within ``limits``.

    Raises ``NotADumpError`` without the magic, ``UnsupportedVersionError`` for a
    newer format, ``CorruptDumpError`` for anything truncated or malformed and
    ``LimitExceededError`` past a limit.
    """
    if not data.startswith(MAGIC):
        raise NotADumpError(f"{source}: not an frdump file (no magic)")
    try:
        doc = msgpack.unpackb(
            memoryview(data)[len(MAGIC):],
            raw=False,
            strict_map_key=False,
            use_list=True,
            # msgpack's own guards: no container may claim more items than the
            # bytes present could hold
            max_bin_len=len(data),
            max_str_len=len(data),
            max_array_len=len(data),
            max_map_len=len(data),
            max_ext_len=len(data),
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise CorruptDumpError(
            f"{source}: truncated or corrupt frdump ({type(exc).__name__}); "
            "was the dump interrupted while copying?"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptDumpError(f"{source}: frdump header is not a {FORMAT_NAME} map")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CorruptDumpError(f"{source}: frdump has no valid version")
    if version > VERSION:
        raise UnsupportedVersionError(
            f"{source}: written by frdump format version {version}; this frforensics reads "
            f"up to version {VERSION}: upgrade it (pip install -U frforensics)"
        )
    try:
        return _decode_doc(doc, source, limits, len(data))
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as exc:
        raise CorruptDumpError(f"{source}: malformed frdump ({type(exc).__name__}: {exc})") from None


def _small_int(doc: Mapping[str, Any], key: str, source: str) -> int | None:
    """An optional small non-negative int (device index, local rank): else unknown."""
    value = _opt_int(doc, key, source)
    return value if value is not None and 0 <= value < 1 << 20 else None


def _short_str(doc: Mapping[str, Any], key: str, source: str) -> str | None:
    """An optional identifier string, cut to 128 printable characters."""
    value = _field(doc, key, str, source)
    if value is None:
        return None
    return "".join(c for c in str(value)[:128] if c.isprintable()) or None


def _group_ranks(raw: Any, source: str, limits: Limits) -> tuple[int, ...] | None:
    """Group members: a progression (version 3), packed int32 (version 2) or a list
    of ints (version 1), within ``limits``."""
    if raw is None:
        return None
    if isinstance(raw, dict):
        arith = raw.get("arith")
        if isinstance(arith, list) and len(arith) == 3 and all(type(x) is int for x in arith):
            return shared_ranks(("arith", limits.max_rank, *arith), arith[2],
                                lambda: _parse_group_ranks(raw, source, limits))
    elif isinstance(raw, bytes):
        return shared_ranks(("packed", limits.max_rank, raw), len(raw) // 4,
                            lambda: _parse_group_ranks(raw, source, limits))
    return _parse_group_ranks(raw, source, limits)


def _parse_group_ranks(raw: Any, source: str, limits: Limits) -> tuple[int, ...] | None:
    if isinstance(raw, dict):
        arith = raw.get("arith")
        if (isinstance(arith, list) and len(arith) == 3 and all(type(x) is int for x in arith)
                and arith[1] > 0 and 0 <= arith[2] <= limits.max_rank and arith[0] >= 0
                and arith[0] + arith[1] * max(arith[2] - 1, 0) < limits.max_rank):
            start, step, count = arith
            return tuple(range(start, start + step * count, step))
        raise CorruptDumpError(f"{source}: group ranks are malformed")
    if isinstance(raw, bytes):
        ranks = _int_column(raw, "group ranks", source)
    elif isinstance(raw, list) and all(type(r) is int for r in raw):
        ranks = np.asarray(raw, dtype=np.int64) if raw else np.empty(0, dtype=np.int64)
    else:
        raise CorruptDumpError(f"{source}: group ranks are malformed")
    if len(ranks) > limits.max_rank or (len(ranks) and (
            int(ranks.min()) < 0 or int(ranks.max()) >= limits.max_rank)):
        raise LimitExceededError(f"{source}: a group lists implausible ranks "
                                 f"(0 <= rank < {limits.max_rank}, at most {limits.max_rank})")
    return tuple(ranks.tolist())


def _check_columns(entries: EntryTable, source: str, limits: Limits) -> None:
    """Every column within its domain: what the analyzer indexes with, or counts up to."""
    if not len(entries):
        return

    def within(name: str, low: int, high: int) -> None:
        col = getattr(entries, name)
        if int(col.min()) < low or int(col.max()) >= high:
            raise CorruptDumpError(f"{source}: entry column {name!r} holds a value outside "
                                   f"[{low}, {high})")

    # (indices into the string, stack and group tables need no check: the
    # model's accessors answer "unknown" for one out of range)
    within("state", 0, int(OpState.FAILED) + 1)
    for name in ("seq", "p2p_seq", "peer_seq"):
        within(name, NO_INDEX, limits.max_seq)
    for name in ("peer", "root"):
        within(name, NO_INDEX, limits.max_rank)
    for name in ("t_enqueue_ns", "t_start_ns", "t_complete_ns", "timeout_ms", "in_numel",
                 "out_numel"):
        within(name, 0, 1 << 62)
    within("duration_ns", NO_INDEX, 1 << 62)  # NO_INDEX: unknown (files before it: absent)


def _decode_doc(doc: dict[str, Any], source: str, limits: Limits, size: int) -> RankTrace:
    strings = _section(doc, "strings", list, source)
    if not all(isinstance(s, str) for s in strings):
        raise CorruptDumpError(f"{source}: string table is malformed")
    if any(len(s) > limits.max_string_chars for s in strings):
        strings = [_cut(s, limits) for s in strings]
    n_strings = len(strings)

    def text(index: int) -> str:
        return strings[index] if 0 <= index < n_strings else ""

    frames_doc = _section(doc, "frames", dict, source)
    f_file = _int_column(frames_doc.get("file", b""), "frames.file", source)
    f_line = _int_column(frames_doc.get("line", b""), "frames.line", source)
    f_name = _int_column(frames_doc.get("name", b""), "frames.name", source)
    if not len(f_file) == len(f_line) == len(f_name):
        raise CorruptDumpError(f"{source}: frame table columns differ in length")
    frames = [
        Frame(text(a), b, text(c))
        for a, b, c in zip(f_file.tolist(), f_line.tolist(), f_name.tolist(), strict=True)
    ]
    n_frames = len(frames)
    stacks: list[tuple[Frame, ...]] = []
    for raw in _section(doc, "stacks", list, source):
        ids = _int_column(raw, "stack", source).tolist()
        if ids and (min(ids) < 0 or max(ids) >= n_frames):
            raise CorruptDumpError(f"{source}: stack refers to a missing frame")
        stacks.append(tuple(map(frames.__getitem__, ids)))

    def stack_at(index: Any) -> tuple[Frame, ...]:
        return stacks[index] if isinstance(index, int) and 0 <= index < len(stacks) else ()

    entries_doc = _section(doc, "entries", dict, source)
    n = entries_doc.get("n", 0)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise CorruptDumpError(f"{source}: entry count is malformed")
    if n > limits.max_entries:
        raise LimitExceededError(f"{source}: {n} entries (limit {limits.max_entries} per rank)")
    raw_columns = _section(entries_doc, "columns", dict, source)
    columns: dict[str, np.ndarray] = {}
    for name, spec in raw_columns.items():
        if name not in ENTRY_COLUMNS:
            continue  # a column from a newer minor revision: ignore it
        if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[1], bytes)):
            raise CorruptDumpError(f"{source}: column {name!r} is malformed")
        dtype = np.dtype(ENTRY_COLUMNS[name])
        if spec[0] != ENTRY_COLUMNS[name] or len(spec[1]) != n * dtype.itemsize:
            raise CorruptDumpError(f"{source}: column {name!r} has the wrong size or type")
        columns[name] = np.frombuffer(spec[1], dtype=dtype)
    # A declared count is believed only when the bytes back it: absent columns
    # are filled with defaults, n rows each, so n entries need some column of n rows.
    if n and (not columns or n > size):
        raise CorruptDumpError(f"{source}: declares {n} entries but carries no entry columns")
    entries = EntryTable.from_columns(n, columns)
    notes = [_cut(str(x), limits) for x in _section(doc, "notes", list, source)]
    for name, what in (("t_enqueue_ns", "creation time"), ("timeout_ms", "timeout")):
        if n and name not in columns:
            notes.append(f"{source}: no {name} column: every entry's {what} is unknown")

    groups = []
    for g in _records(doc, "groups", source):
        groups.append(
            GroupInfo(
                name=_cut(str(g.get("name", "")), limits),
                desc=_cut(str(g.get("desc", "")), limits),
                ranks=_group_ranks(g.get("ranks"), source, limits),
                backend=_cut(str(g.get("backend", "")), limits),
            )
        )
    _check_columns(entries, source, limits)
    threads = tuple(
        ThreadStack(
            name=_cut(str(t.get("name", "")), limits),
            ident=int(t.get("ident", 0)),
            is_main=bool(t.get("is_main", False)),
            frames=stack_at(t.get("stack")),
        )
        for t in _records(doc, "threads", source)
    )
    death_doc = doc.get("death")
    death = None
    if isinstance(death_doc, dict):
        death = DeathInfo(
            kind=_cut(str(death_doc.get("kind", "")), limits),
            message=_cut(str(death_doc.get("message", "")), limits),
            frames=stack_at(death_doc.get("stack")),
        )
    try:
        reason = DumpReason(doc.get("dump_reason") or "unknown")
    except (ValueError, TypeError):
        reason = DumpReason.UNKNOWN
    stale = []
    for p in _records(doc, "stale_peers", source):
        peer = p["rank"]
        if type(peer) is not int or not 0 <= peer < limits.max_rank:
            raise CorruptDumpError(f"{source}: stale peer rank {peer!r} is not plausible")
        stale.append(PeerHeartbeat(rank=peer, age_s=float(p.get("age_s", 0.0))))
    dropped = entries_doc.get("dropped") or 0
    if type(dropped) is not int or dropped < 0:
        raise CorruptDumpError(f"{source}: dropped-entry count is malformed")
    return RankTrace(
        rank=_opt_int(doc, "rank", source),
        header=DumpHeader(
            source=source,
            format=SourceFormat.FRDUMP,
            version=str(doc["version"]),
            world_size=_opt_int(doc, "world_size", source),
            host=_opt_str(doc, "host", source, limits),
            pid=_opt_int(doc, "pid", source),
            job_id=_opt_str(doc, "job_id", source, limits),
            dump_reason=reason,
            dump_detail=_cut(str(doc.get("dump_detail") or ""), limits),
            dump_time_ns=_opt_int(doc, "dump_time_ns", source),
            dump_monotonic_ns=_opt_int(doc, "dump_monotonic_ns", source),
            completion_resolution_ns=_opt_int(doc, "completion_resolution_ns", source) or 0,
            dropped=dropped,
            threads=threads,
            stale_peers=tuple(stale),
            death=death,
            unrecorded_ops=min(max(_opt_int(doc, "unrecorded_ops", source) or 0, 0), 1 << 53),
            local_rank=_small_int(doc, "local_rank", source),
            cuda_device=_small_int(doc, "cuda_device", source),
            gpu_uuid=_short_str(doc, "gpu_uuid", source),
            pci_bus_id=_short_str(doc, "pci_bus_id", source),
        ),
        groups=tuple(groups),
        strings=tuple(strings),
        stacks=tuple(stacks),
        entries=entries,
        notes=tuple(notes),
    )
