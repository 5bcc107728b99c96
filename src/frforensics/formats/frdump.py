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

import contextlib
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import msgpack
import numpy as np

from frforensics.errors import CorruptDumpError, NotADumpError, UnsupportedVersionError
from frforensics.model import (
    ENTRY_COLUMNS,
    DeathInfo,
    DumpReason,
    EntryTable,
    Frame,
    GroupInfo,
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
        "local_rank": trace.local_rank,
        "cuda_device": trace.cuda_device,
        "gpu_uuid": trace.gpu_uuid,
        "pci_bus_id": trace.pci_bus_id,
    }
    packed: bytes = msgpack.packb(doc, use_bin_type=True)
    return MAGIC + packed


def write_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically: temp file, fsync, rename.

    A reader never sees half a file. Returns the final path.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


# ---------------------------------------------------------------- reading


def _field(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], source: str) -> Any:
    value = doc.get(key)
    if value is not None and not isinstance(value, kind):
        raise CorruptDumpError(f"{source}: field {key!r} has type {type(value).__name__}")
    return value


def _opt_int(doc: Mapping[str, Any], key: str, source: str) -> int | None:
    value = _field(doc, key, int, source)
    return None if value is None or isinstance(value, bool) else int(value)


def _opt_str(doc: Mapping[str, Any], key: str, source: str) -> str | None:
    value = _field(doc, key, str, source)
    return None if value is None else str(value)


def _int_column(raw: Any, what: str, source: str) -> np.ndarray:
    if not isinstance(raw, bytes) or len(raw) % 4:
        raise CorruptDumpError(f"{source}: {what} is not an int32 column")
    return np.frombuffer(raw, dtype="<i4")


def decode(data: bytes, *, source: str = "<bytes>") -> RankTrace:
    """Parse frdump bytes into a :class:`RankTrace`.

    Raises ``NotADumpError`` without the magic, ``UnsupportedVersionError`` for a
    newer format, ``CorruptDumpError`` for anything truncated or malformed.
    """
    if not data.startswith(MAGIC):
        raise NotADumpError(f"{source}: not an frdump file (no magic)")
    try:
        doc = msgpack.unpackb(
            memoryview(data)[len(MAGIC):],
            raw=False,
            strict_map_key=False,
            use_list=True,
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
        return _decode_doc(doc, source)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CorruptDumpError(f"{source}: malformed frdump ({type(exc).__name__}: {exc})") from None


def _group_ranks(raw: Any, source: str) -> tuple[int, ...] | None:
    """Group members: a progression (version 3), packed int32 (version 2) or a list
    of ints (version 1)."""
    if raw is None:
        return None
    if isinstance(raw, dict):
        arith = raw.get("arith")
        if (isinstance(arith, list) and len(arith) == 3 and all(type(x) is int for x in arith)
                and arith[1] > 0 and 0 <= arith[2] <= 1 << 24 and arith[0] >= 0):
            start, step, count = arith
            return tuple(range(start, start + step * count, step))
        raise CorruptDumpError(f"{source}: group ranks are malformed")
    if isinstance(raw, bytes):
        return tuple(_int_column(raw, "group ranks", source).tolist())
    if isinstance(raw, list) and all(type(r) is int for r in raw):
        return tuple(raw)
    raise CorruptDumpError(f"{source}: group ranks are malformed")


def _decode_doc(doc: dict[str, Any], source: str) -> RankTrace:
    strings = doc.get("strings") or []
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise CorruptDumpError(f"{source}: string table is malformed")
    n_strings = len(strings)

    def text(index: int) -> str:
        return strings[index] if 0 <= index < n_strings else ""

    frames_doc = doc.get("frames") or {}
    f_file = _int_column(frames_doc.get("file", b""), "frames.file", source)
    f_line = _int_column(frames_doc.get("line", b""), "frames.line", source)
    f_name = _int_column(frames_doc.get("name", b""), "frames.name", source)
    if not len(f_file) == len(f_line) == len(f_name):
        raise CorruptDumpError(f"{source}: frame table columns differ in length")
    frames = [
        Frame(text(int(a)), int(b), text(int(c)))
        for a, b, c in zip(f_file.tolist(), f_line.tolist(), f_name.tolist(), strict=True)
    ]
    n_frames = len(frames)
    stacks: list[tuple[Frame, ...]] = []
    for raw in doc.get("stacks") or []:
        ids = _int_column(raw, "stack", source).tolist()
        if ids and (min(ids) < 0 or max(ids) >= n_frames):
            raise CorruptDumpError(f"{source}: stack refers to a missing frame")
        stacks.append(tuple(frames[i] for i in ids))

    def stack_at(index: Any) -> tuple[Frame, ...]:
        return stacks[index] if isinstance(index, int) and 0 <= index < len(stacks) else ()

    entries_doc = doc.get("entries") or {}
    n = entries_doc.get("n", 0)
    if not isinstance(n, int) or n < 0:
        raise CorruptDumpError(f"{source}: entry count is malformed")
    columns: dict[str, np.ndarray] = {}
    for name, spec in (entries_doc.get("columns") or {}).items():
        if name not in ENTRY_COLUMNS:
            continue  # a column from a newer minor revision: ignore it
        if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[1], bytes)):
            raise CorruptDumpError(f"{source}: column {name!r} is malformed")
        dtype = np.dtype(ENTRY_COLUMNS[name])
        if spec[0] != ENTRY_COLUMNS[name] or len(spec[1]) != n * dtype.itemsize:
            raise CorruptDumpError(f"{source}: column {name!r} has the wrong size or type")
        columns[name] = np.frombuffer(spec[1], dtype=dtype)
    entries = EntryTable.from_columns(n, columns)

    groups = []
    for g in doc.get("groups") or []:
        ranks = g.get("ranks")
        groups.append(
            GroupInfo(
                name=str(g.get("name", "")),
                desc=str(g.get("desc", "")),
                ranks=_group_ranks(ranks, source),
                backend=str(g.get("backend", "")),
            )
        )
    threads = tuple(
        ThreadStack(
            name=str(t.get("name", "")),
            ident=int(t.get("ident", 0)),
            is_main=bool(t.get("is_main", False)),
            frames=stack_at(t.get("stack")),
        )
        for t in doc.get("threads") or []
    )
    death_doc = doc.get("death")
    death = None
    if isinstance(death_doc, dict):
        death = DeathInfo(
            kind=str(death_doc.get("kind", "")),
            message=str(death_doc.get("message", "")),
            frames=stack_at(death_doc.get("stack")),
        )
    try:
        reason = DumpReason(doc.get("dump_reason") or "unknown")
    except ValueError:
        reason = DumpReason.UNKNOWN
    return RankTrace(
        rank=_opt_int(doc, "rank", source),
        source=source,
        format=SourceFormat.FRDUMP,
        version=str(doc["version"]),
        groups=tuple(groups),
        strings=tuple(strings),
        stacks=tuple(stacks),
        entries=entries,
        world_size=_opt_int(doc, "world_size", source),
        host=_opt_str(doc, "host", source),
        pid=_opt_int(doc, "pid", source),
        job_id=_opt_str(doc, "job_id", source),
        dump_reason=reason,
        dump_detail=str(doc.get("dump_detail") or ""),
        dump_time_ns=_opt_int(doc, "dump_time_ns", source),
        dump_monotonic_ns=_opt_int(doc, "dump_monotonic_ns", source),
        completion_resolution_ns=_opt_int(doc, "completion_resolution_ns", source) or 0,
        dropped=int(entries_doc.get("dropped") or 0),
        threads=threads,
        stale_peers=tuple(
            PeerHeartbeat(rank=int(p["rank"]), age_s=float(p.get("age_s", 0.0)))
            for p in doc.get("stale_peers") or []
        ),
        death=death,
        notes=tuple(str(x) for x in doc.get("notes") or []),
        local_rank=_opt_int(doc, "local_rank", source),
        cuda_device=_opt_int(doc, "cuda_device", source),
        gpu_uuid=_opt_str(doc, "gpu_uuid", source),
        pci_bus_id=_opt_str(doc, "pci_bus_id", source),
    )
