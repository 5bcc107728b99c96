"""Digests on the wire: a compact, pickle-free encoding of batches of :class:`RankDigest`.

When digests are computed on the hosts that hold the dumps (``fr-analyze
--dask``), they cross the network to the central process. A pickled digest of a
2000-entry ring is ~180 KiB (24 KiB after zlib); this encoding brings it to a
few KiB (docs/scaling.md has the measurements) and decodes to an *identical*
``RankDigest`` (``tests/unit/test_wire.py`` checks equality field by field).

How, per batch of digests (one host's batch):

* **Columns** (every numpy field of the digest, whatever its name, so a field
  added to ``RankDigest`` later travels without changing this module): the
  batch's values of one field are one column, each rank a segment of it,
  stored in the cheapest of three forms, judged by bytes before compression:
  the values narrowed to the smallest integer type that holds them (an int64
  ``seq`` of a 2000-entry ring fits int16); the differences between
  consecutive rows narrowed the same way (sequence numbers and timestamps are
  nearly arithmetic: their steps fit 1–4 bytes), every segment restarting from
  its own first value, stored relative to the rank's dump time for time columns;
  or a dictionary of at most 256 distinct values with one-byte indices (op and
  dtype hashes, call sites, sizes). Multi-byte values are byte-shuffled (all low
  bytes, then the next...) so that the compressor sees runs.
* **Group membership once per batch**: every distinct ``GroupInfo`` goes into a
  batch-wide table and a digest refers to its groups by index; members that form
  an arithmetic progression (the default group, DP groups) are sent as
  ``start, step, count``.
* **Stacks once per batch**: frames and stacks (of the kept entry details, the
  threads, the death record) are tables shared by the whole batch; a stack is a
  list of frame indices, a frame indices into one string table.
* **Details as one matrix**: the kept :class:`EntryDetail` records of the
  batch (each rank's tail and unfinished entries) are one int64 matrix, a row
  per field, strings and stacks as indices into the batch's tables.
* everything else (scalars, small tuples) is msgpack, and the whole batch is
  compressed with zlib (or lzma, slower but smaller).

Decoding never runs code from the data: msgpack, ``numpy.frombuffer`` and
constructors of a fixed set of types. A malformed payload raises
:class:`WireError`. :class:`WireCache` makes equal groups and stacks of every
batch one object in the central process, as the local loader does per batch.
"""

from __future__ import annotations

import dataclasses
import lzma
import zlib
from collections.abc import Iterable, Sequence
from typing import Any, Final

import msgpack
import numpy as np
import numpy.typing as npt

from frforensics.analyzer.digest import EntryDetail, RankDigest
from frforensics.errors import FrForensicsError
from frforensics.model import (
    DeathInfo,
    Frame,
    GroupInfo,
    OpState,
    PeerHeartbeat,
    ThreadStack,
    progression,
    progression_members,
)

__all__ = ["WireCache", "WireError", "decode_batch", "encode_batch"]

_MAGIC: Final = b"FRW1"
_ZLIB: Final = b"z"
_LZMA: Final = b"x"

# columns whose first value is stored relative to the dump time
_TIME_COLUMNS: Final = frozenset({"t_enqueue_ns", "t_complete_ns", "t_start_ns"})

# forms of a stored integer column
_RAW: Final = 0
_DELTA: Final = 1
_DICT: Final = 2

_INT_TYPES: Final = (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
                     np.uint64)

# msgpack extension codes for the non-builtin values of a digest
_EXT_FRAME: Final = 1
_EXT_STACK: Final = 2
_EXT_GROUP: Final = 3
_EXT_THREAD: Final = 4
_EXT_PEER: Final = 5
_EXT_DEATH: Final = 6
_EXT_STATE: Final = 7

_DATACLASSES: Final[dict[type, int]] = {ThreadStack: _EXT_THREAD, PeerHeartbeat: _EXT_PEER,
                                        DeathInfo: _EXT_DEATH}
_BY_CODE: Final[dict[int, type]] = {code: cls for cls, code in _DATACLASSES.items()}

_DIGEST_FIELDS: Final = tuple(f.name for f in dataclasses.fields(RankDigest))


class WireError(FrForensicsError):
    """A wire payload that this version cannot decode (corrupt, or another version)."""


# ------------------------------------------------------------------ columns


_RANGES: Final = tuple((int(np.iinfo(t).min), int(np.iinfo(t).max), np.dtype(t)) for t in _INT_TYPES)


def _narrow(lo: int, hi: int) -> np.dtype[Any]:
    for tmin, tmax, dtype in _RANGES:
        if tmin <= lo and hi <= tmax:
            return dtype
    raise WireError(f"integer range {lo}..{hi} does not fit 64 bits")


def _shuffle(a: npt.NDArray[Any]) -> bytes:
    if a.dtype.itemsize == 1 or a.size == 0:
        return a.tobytes()
    return a.view(np.uint8).reshape(-1, a.dtype.itemsize).T.tobytes()


def _unshuffle(data: bytes | memoryview, dtype: np.dtype[Any], n: int) -> npt.NDArray[Any]:
    size = dtype.itemsize
    if len(data) != n * size:
        raise WireError("column length does not match its header")
    raw = np.frombuffer(data, dtype=np.uint8)
    if size == 1:
        return raw.view(dtype).copy()
    if not n:
        return np.empty(0, dtype=dtype)
    return np.ascontiguousarray(raw.reshape(size, n).T).view(dtype).reshape(n)


class _Blob:
    """Column bytes of a batch, appended in order; specs say where each column lies."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, data: bytes) -> tuple[int, int]:
        self.parts.append(data)
        self.size += len(data)
        return self.size - len(data), len(data)


def _put_column(blob: _Blob, a: npt.NDArray[Any], *, base: int = 0) -> list[Any]:
    """Store one column (see :func:`_put_segments`)."""
    return _put_segments(blob, [a], [base])


def _get_column(blob: memoryview, spec: Sequence[Any], *, base: int = 0) -> npt.NDArray[Any]:
    return _get_segments(blob, spec, [base])[0]


def _put_segments(blob: _Blob, arrays: Sequence[npt.NDArray[Any]], bases: Sequence[int]) -> list[Any]:
    """Store same-typed columns of several digests as one; returns the spec.

    ``[dtype, lengths, form, stored dtype, offset, length, extra]``; with the
    differences form, every segment starts over (its first value, minus its
    base, is in ``extra``), so one rank's clock never widens another's steps.
    """
    dtype = arrays[0].dtype
    if any(a.ndim != 1 or a.dtype != dtype for a in arrays):
        raise WireError("columns of one kind must be one-dimensional and of one type")
    lengths = [int(a.shape[0]) for a in arrays]
    a = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    n = int(a.shape[0])
    if dtype.kind not in "iub" or n == 0:
        off, ln = blob.add(np.ascontiguousarray(a).tobytes())
        return [dtype.str, lengths, _RAW, dtype.str, off, ln, None]
    x = a.astype(np.int64) if dtype != np.uint64 else a
    lo, hi = int(x.min()), int(x.max())
    best_form, best_dtype = _RAW, _narrow(lo, hi)
    best_size = best_dtype.itemsize * n
    ends = np.cumsum(lengths)
    starts = (ends - lengths)[np.asarray(lengths) > 0]
    diff: npt.NDArray[Any] | None = None
    if dtype != np.uint64 and best_dtype.itemsize > 1 and n > len(starts):
        diff = np.empty(n, dtype=np.int64)
        diff[0] = 0
        np.subtract(x[1:], x[:-1], out=diff[1:])
        diff[starts] = 0
        ddt = _narrow(int(diff.min()), int(diff.max()))
        if ddt.itemsize * n + 8 * len(starts) < best_size:
            best_form, best_dtype, best_size = _DELTA, ddt, ddt.itemsize * n + 8 * len(starts)
    values: npt.NDArray[Any] | None = None
    # a dictionary pays for hashes and sizes (4 bytes narrowed, a handful of
    # distinct values); short columns compress as well without one
    if best_dtype.itemsize >= 4 and n >= 64:
        uniq = _few_values(x)
        if uniq is not None:
            vdt = _narrow(int(uniq[0]), int(uniq[-1]))
            size = n + vdt.itemsize * len(uniq)
            if size < best_size:
                best_form, best_dtype, values = _DICT, vdt, uniq
    if best_form == _RAW:
        off, ln = blob.add(_shuffle(x.astype(best_dtype)))
        return [dtype.str, lengths, _RAW, best_dtype.str, off, ln, None]
    if best_form == _DELTA:
        assert diff is not None
        off, ln = blob.add(_shuffle(diff.astype(best_dtype)))
        seg_bases = np.asarray(bases, dtype=np.int64)[np.asarray(lengths) > 0]
        firsts = (x[starts] - seg_bases).astype("<i8")
        return [dtype.str, lengths, _DELTA, best_dtype.str, off, ln, firsts.tobytes()]
    assert values is not None
    off, ln = blob.add(np.searchsorted(values, x).astype(np.uint8).tobytes())
    table_off, table_len = blob.add(_shuffle(values.astype(best_dtype)))
    return [dtype.str, lengths, _DICT, best_dtype.str, off, ln, [len(values), table_off, table_len]]


def _few_values(x: npt.NDArray[Any]) -> npt.NDArray[Any] | None:
    """The sorted distinct values of ``x`` if there are at most 256, else None.

    Guessed from the first 4096 values, then checked against all of them
    (a binary search per value: cheaper than a full ``np.unique``).
    """
    guess = np.unique(x[:4096])
    if len(guess) > 256:
        return None
    at = np.minimum(np.searchsorted(guess, x), len(guess) - 1)
    if np.array_equal(guess[at], x):
        return guess
    uniq = np.unique(x)
    return uniq if len(uniq) <= 256 else None


_DTYPES: Final = {np.dtype(t).str: np.dtype(t)
                  for t in (*_INT_TYPES, np.bool_, np.float32, np.float64)}


def _get_segments(blob: memoryview, spec: Sequence[Any],
                  bases: Sequence[int]) -> list[npt.NDArray[Any]]:
    try:
        dtype_s, lengths, form, stored_s, off, ln, extra = spec
        dtype, stored = _DTYPES[dtype_s], _DTYPES[stored_s]
        if len(lengths) != len(bases) or not all(type(k) is int and k >= 0 for k in lengths):
            raise ValueError("segment lengths")
    except (TypeError, ValueError, KeyError) as exc:
        raise WireError(f"bad column spec: {exc!r}") from None
    n = sum(lengths)
    if not 0 <= off <= off + ln <= len(blob):
        raise WireError("bad column spec")
    data = blob[off:off + ln]
    if form == _RAW:
        if dtype.kind == "f":
            if len(data) != n * dtype.itemsize or stored != dtype:
                raise WireError("bad float column")
            x = np.frombuffer(data, dtype=dtype).copy()
        else:
            x = _unshuffle(data, stored, n).astype(dtype, copy=False)
    elif form == _DELTA:
        steps = _unshuffle(data, stored, n)
        nonempty = np.asarray(lengths) > 0
        if not isinstance(extra, bytes) or len(extra) != 8 * int(nonempty.sum()):
            raise WireError("bad delta column")
        firsts = np.frombuffer(extra, dtype="<i8") + np.asarray(bases, dtype=np.int64)[nonempty]
        c = np.cumsum(steps, dtype=np.int64)
        seg = np.asarray(lengths)[nonempty]
        starts = np.cumsum(seg) - seg
        x = (c + np.repeat(firsts - c[starts], seg)).astype(dtype, copy=False)
    elif form == _DICT:
        k, table_off, table_len = extra
        if not 0 <= table_off <= table_off + table_len <= len(blob):
            raise WireError("bad dictionary column")
        table = _unshuffle(blob[table_off:table_off + table_len], stored, k).astype(dtype)
        idx = np.frombuffer(data, dtype=np.uint8)
        if len(idx) != n or (n and int(idx.max()) >= k):
            raise WireError("bad dictionary column")
        x = table[idx]
    else:
        raise WireError(f"unknown column form {form!r}")
    if len(lengths) == 1:
        return [x]
    bounds = np.cumsum(lengths).tolist()
    return [x[e - k:e] for e, k in zip(bounds, lengths, strict=True)]


# ------------------------------------------------------------------ tables


class _Tables:
    """Strings, frames, stacks and groups of one batch, each stored once."""

    def __init__(self) -> None:
        self.strings: dict[str, int] = {}
        self.frames: dict[Frame, int] = {}
        self.frame_rows: list[tuple[int, int, int]] = []
        self.stacks: dict[tuple[Frame, ...], int] = {}
        self.stack_rows: list[tuple[int, ...]] = []
        # a digest's details share their stack tuples: look them up by identity
        # first (hashing a tuple of frames hashes every frame), keeping them alive
        self.stack_ids: dict[int, tuple[int, tuple[Frame, ...]]] = {}
        self.groups: dict[GroupInfo, int] = {}
        self.group_ids: dict[int, tuple[int, GroupInfo]] = {}

    def string(self, s: str) -> int:
        i = self.strings.get(s)
        if i is None:
            i = self.strings[s] = len(self.strings)
        return i

    def frame(self, f: Frame) -> int:
        i = self.frames.get(f)
        if i is None:
            i = self.frames[f] = len(self.frames)
            self.frame_rows.append((self.string(f.file), f.line, self.string(f.name)))
        return i

    def stack(self, frames: tuple[Frame, ...]) -> int:
        hit = self.stack_ids.get(id(frames))
        if hit is not None:
            return hit[0]
        i = self._stack(frames)
        self.stack_ids[id(frames)] = (i, frames)
        return i

    def _stack(self, frames: tuple[Frame, ...]) -> int:
        i = self.stacks.get(frames)
        if i is None:
            i = self.stacks[frames] = len(self.stacks)
            self.stack_rows.append(tuple(self.frame(f) for f in frames))
        return i

    def group(self, g: GroupInfo) -> int:
        # by identity first: hashing a group hashes its members (16,384 ints for
        # the default group at 16,384 ranks, 0.5 ms), and the loader already
        # made equal groups of a batch one object
        hit = self.group_ids.get(id(g))
        if hit is not None:
            return hit[0]
        i = self.groups.get(g)
        if i is None:
            i = self.groups[g] = len(self.groups)
        self.group_ids[id(g)] = (i, g)
        return i


def _members(ranks: tuple[int, ...] | None) -> Any:
    """Group members: ``None``, ``[start, step, count]`` if arithmetic, else int32 bytes."""
    if ranks is None:
        return None
    n = len(ranks)
    arith = progression(ranks, min_len=2)
    if arith is not None:
        return list(arith)
    if n == 1:
        return [ranks[0], 1, 1]
    a = np.asarray(ranks, dtype=np.int64)
    if n and (a.min() < -(2**31) or a.max() >= 2**31):
        return a.tolist()
    return a.astype("<i4").tobytes()


def _members_back(x: Any) -> tuple[int, ...] | None:
    if x is None:
        return None
    if isinstance(x, bytes):
        if len(x) % 4:
            raise WireError("bad group members")
        return tuple(np.frombuffer(x, dtype="<i4").tolist())
    if isinstance(x, (list, tuple)) and len(x) == 3 and all(type(v) is int for v in x):
        # one tuple per distinct membership in this process, as the decoders do
        # (formats._shared): the default group comes in every payload
        try:
            return progression_members(*x)
        except ValueError:
            raise WireError("bad group members") from None
    if isinstance(x, (list, tuple)) and all(type(v) is int for v in x):
        return tuple(x)
    raise WireError("bad group members")


# ------------------------------------------------------------------ values


def _pack_value(v: Any, t: _Tables) -> Any:
    """A digest field's value as msgpack data (tuples of frames as stack references)."""
    if isinstance(v, OpState):
        return msgpack.ExtType(_EXT_STATE, msgpack.packb(int(v)))
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return v
    if isinstance(v, Frame):
        return msgpack.ExtType(_EXT_FRAME, msgpack.packb(t.frame(v)))
    if isinstance(v, GroupInfo):
        return msgpack.ExtType(_EXT_GROUP, msgpack.packb(t.group(v)))
    if isinstance(v, tuple):
        if v and all(isinstance(x, Frame) for x in v):
            return msgpack.ExtType(_EXT_STACK, msgpack.packb(t.stack(v)))
        return [_pack_value(x, t) for x in v]
    if isinstance(v, dict):
        return {_pack_value(k, t): _pack_value(x, t) for k, x in v.items()}
    code = _DATACLASSES.get(type(v))
    if code is not None:
        fields = [_pack_value(getattr(v, f.name), t) for f in dataclasses.fields(v)]
        return msgpack.ExtType(code, msgpack.packb(fields, use_bin_type=True))
    raise WireError(f"cannot send a {type(v).__name__} in a digest")


class _Unpacker:
    """Inverse of :func:`_pack_value` over one batch's tables."""

    def __init__(self, frames: list[Frame], stacks: list[tuple[Frame, ...]],
                 groups: list[GroupInfo]) -> None:
        self.frames, self.stacks, self.groups = frames, stacks, groups

    def ext(self, code: int, data: bytes) -> Any:
        value = _loads(data, self.ext)
        try:
            if code == _EXT_STATE:
                return OpState(value)
            if code == _EXT_FRAME:
                return self.frames[value]
            if code == _EXT_STACK:
                return self.stacks[value]
            if code == _EXT_GROUP:
                return self.groups[value]
            cls = _BY_CODE.get(code)
            if cls is not None:
                return cls(*value)
        except (IndexError, TypeError, ValueError) as exc:
            raise WireError(f"bad value in a digest: {exc}") from None
        raise WireError(f"unknown extension {code}")


def _loads(data: bytes, ext: Any | None) -> Any:
    try:
        if ext is None:
            return msgpack.unpackb(data, use_list=False, raw=False, strict_map_key=False)
        return msgpack.unpackb(data, use_list=False, raw=False, strict_map_key=False,
                               ext_hook=ext)
    except WireError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise WireError(f"corrupt digest payload: {exc}") from None


# ------------------------------------------------------------------ details


_DETAIL_FIELDS: Final = EntryDetail._fields


def _pack_details(all_details: Sequence[dict[int, EntryDetail]], t: _Tables, blob: _Blob,
                  bases: Sequence[int]) -> list[Any]:
    """The batch's kept entry details as one int64 matrix (a row per field), strings and
    stacks as table indices.

    Times are stored relative to their digest's dump time; the matrix is
    byte-shuffled so the high bytes that every small value leaves zero compress away.
    """
    counts = [len(d) for d in all_details]
    rows = [r for d in all_details for r in d.values()]
    n = len(rows)
    kinds: list[str] = []
    matrix = np.empty((len(_DETAIL_FIELDS) + 1, n), dtype=np.int64)
    matrix[0] = [k for d in all_details for k in d]
    shift = np.repeat(np.asarray(bases, dtype=np.int64), counts)
    for i, name in enumerate(_DETAIL_FIELDS):
        values: list[Any] = [r[i] for r in rows]
        col: list[Any]
        if all(type(v) is bool for v in values):
            kind, col = "b", values
        elif all(type(v) is OpState for v in values):
            kind, col = "e", values
        elif all(type(v) is int for v in values):
            kind, col = "i", values
        elif all(v is None or type(v) is str for v in values):
            kind, col = "s", [-1 if v is None else t.string(v) for v in values]
        elif all(type(v) is tuple for v in values):
            kind, col = "f", [t.stack(v) if v else -1 for v in values]
        else:
            raise WireError(f"cannot send entry detail field {name!r}")
        kinds.append(kind)
        matrix[i + 1] = col
        if name in _TIME_COLUMNS:
            matrix[i + 1] -= shift
    off, ln = blob.add(_shuffle(matrix.reshape(-1)))
    return [counts, list(_DETAIL_FIELDS), kinds, off, ln]


def _unpack_details(spec: Sequence[Any], blob: memoryview, strings: list[str],
                    stacks: list[tuple[Frame, ...]],
                    bases: Sequence[int]) -> list[dict[int, EntryDetail]]:
    counts, names, kinds, off, ln = spec
    if tuple(names) != _DETAIL_FIELDS or len(kinds) != len(names) or len(counts) != len(bases):
        raise WireError("entry details from another version of frforensics")
    if not all(type(k) is int and k >= 0 for k in counts) or not 0 <= off <= off + ln <= len(blob):
        raise WireError("bad entry details")
    n = sum(counts)
    if n == 0:
        return [{} for _ in counts]
    matrix = _unshuffle(blob[off:off + ln], _I8, (len(names) + 1) * n).reshape(-1, n)
    shift = np.repeat(np.asarray(bases, dtype=np.int64), counts)
    columns: list[list[Any]] = []
    try:
        for i, (name, kind) in enumerate(zip(names, kinds, strict=True)):
            row = matrix[i + 1]
            if name in _TIME_COLUMNS:
                row = row + shift
            col = row.tolist()
            if kind == "b":
                col = [v != 0 for v in col]
            elif kind == "e":
                col = [_STATES[v] for v in col]
            elif kind == "s":
                col = [None if v < 0 else strings[v] for v in col]
            elif kind == "f":
                col = [() if v < 0 else stacks[v] for v in col]
            elif kind != "i":
                raise WireError(f"unknown detail kind {kind!r}")
            columns.append(col)
    except (IndexError, KeyError) as exc:
        raise WireError(f"bad entry details: {exc!r}") from None
    keys = matrix[0].tolist()
    entries = list(map(EntryDetail._make, zip(*columns, strict=True))) if n else []
    out = []
    end = 0
    for k in counts:
        out.append(dict(zip(keys[end:end + k], entries[end:end + k], strict=True)))
        end += k
    return out


_I8: Final = np.dtype(np.int64)
_STATES: Final = {int(s): s for s in OpState}


# ------------------------------------------------------------------ batches


def encode_batch(digests: Iterable[RankDigest], *, codec: str = "zlib", level: int = 1) -> bytes:
    """Encode ``digests`` (one host's batch) into one compressed payload."""
    digests = list(digests)
    t = _Tables()
    blob = _Blob()
    bases = [d.dump_time_ns or 0 for d in digests]
    zeros = [0] * len(digests)
    docs = []
    arrays: dict[tuple[str, str], list[int]] = {}  # (field, dtype) -> digests that have one
    for i, d in enumerate(digests):
        fields: dict[str, Any] = {}
        for name in _DIGEST_FIELDS:
            v = getattr(d, name)
            if isinstance(v, np.ndarray):
                arrays.setdefault((name, v.dtype.str), []).append(i)
            elif name != "details":
                fields[name] = _pack_value(v, t)
        docs.append(fields)
    columns = []
    for (name, _), members in arrays.items():
        pick = bases if name in _TIME_COLUMNS else zeros
        spec = _put_segments(blob, [getattr(digests[i], name) for i in members],
                             [pick[i] for i in members])
        columns.append([name, members, spec])
    details = _pack_details([d.details for d in digests], t, blob, bases)
    frame_rows = np.asarray(t.frame_rows, dtype=np.int64).reshape(-1, 3)
    doc = {
        "strings": list(t.strings),
        "frames": [_put_column(blob, np.ascontiguousarray(frame_rows[:, i])) for i in range(3)],
        "stacks": [list(s) for s in t.stack_rows],
        "groups": [[g.name, g.desc, _members(g.ranks), g.backend] for g in t.groups],
        "blob": b"".join(blob.parts),
        # packed apart: its extension values refer to the tables above, which
        # the decoder builds first
        "digests": msgpack.packb(docs, use_bin_type=True),
        "columns": columns,
        "details": details,
    }
    body = msgpack.packb(doc, use_bin_type=True)
    if codec == "zlib":
        return _MAGIC + _ZLIB + zlib.compress(body, level)
    if codec == "lzma":
        return _MAGIC + _LZMA + lzma.compress(body, preset=min(level, 9))
    raise ValueError(f"unknown codec {codec!r}")


class WireCache:
    """Makes equal groups and stacks of every decoded batch one shared object.

    At 16,384 ranks the default group alone is 16,384 ints per rank; one
    ``WireCache`` for the whole load keeps a single copy.
    """

    def __init__(self) -> None:
        self.groups: dict[GroupInfo, GroupInfo] = {}
        self.stacks: dict[tuple[Frame, ...], tuple[Frame, ...]] = {}


#: the largest decompressed payload accepted (a guard against decompression bombs)
MAX_PAYLOAD_BYTES: Final = 1 << 31


def decode_batch(data: bytes, *, cache: WireCache | None = None) -> list[RankDigest]:
    """Decode a payload of :func:`encode_batch` back into equal ``RankDigest``s."""
    if data[:4] != _MAGIC or len(data) < 5:
        raise WireError("not a frforensics digest payload")
    try:
        if data[4:5] == _ZLIB:
            d = zlib.decompressobj()
            body = d.decompress(data[5:], MAX_PAYLOAD_BYTES)
            if d.unconsumed_tail:
                raise WireError("digest payload too large")
            if not d.eof:
                raise WireError("truncated digest payload")
        elif data[4:5] == _LZMA:
            dl = lzma.LZMADecompressor()
            body = dl.decompress(data[5:], MAX_PAYLOAD_BYTES)
            if not dl.eof:
                raise WireError("truncated or too large digest payload")
        else:
            raise WireError("unknown compression in a digest payload")
    except (zlib.error, lzma.LZMAError) as exc:
        raise WireError(f"corrupt digest payload: {exc}") from None
    doc = _loads(body, None)
    try:
        return _decode_doc(doc, cache)
    except WireError:
        raise
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise WireError(f"malformed digest payload: {type(exc).__name__}: {exc}") from None


def _decode_doc(doc: Any, cache: WireCache | None) -> list[RankDigest]:
    blob = memoryview(doc["blob"])
    strings = list(doc["strings"])
    if not all(type(s) is str for s in strings):
        raise WireError("bad string table")
    files, lines, names = (_get_column(blob, spec).tolist() for spec in doc["frames"])
    frames = [Frame(strings[f], ln, strings[n]) for f, ln, n in zip(files, lines, names, strict=True)]
    stacks = [tuple(frames[i] for i in s) for s in doc["stacks"]]
    groups = [GroupInfo(name, desc, _members_back(ranks), backend)
              for name, desc, ranks, backend in doc["groups"]]
    if cache is not None:
        stacks = [cache.stacks.setdefault(s, s) for s in stacks]
        groups = [cache.groups.setdefault(g, g) for g in groups]
    unpacker = _Unpacker(frames, stacks, groups)
    values = [dict(entry) for entry in _loads(doc["digests"], unpacker.ext)]
    bases = [v.get("dump_time_ns") or 0 for v in values]
    zeros = [0] * len(values)
    for name, members, spec in doc["columns"]:
        if name not in _DIGEST_FIELDS or not all(type(i) is int for i in members):
            raise WireError(f"unknown column {name!r}")
        pick = bases if name in _TIME_COLUMNS else zeros
        for i, col in zip(members, _get_segments(blob, spec, [pick[i] for i in members]),
                          strict=True):
            values[i][name] = col
    for v, details in zip(values, _unpack_details(doc["details"], blob, strings, stacks, bases),
                          strict=True):
        v["details"] = details
    out = []
    for v in values:
        if set(v) != set(_DIGEST_FIELDS):
            raise WireError("digest from another version of frforensics (fields differ)")
        out.append(RankDigest(**v))
    return out
