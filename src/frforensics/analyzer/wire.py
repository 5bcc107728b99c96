"""Digests on the wire: a compact encoding of :class:`RankDigest` batches, without pickle.

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
constructors of a fixed set of types. A payload is as untrusted as a dump file
(docs/security.md, "peers"): it is inflated only up to :func:`payload_cap` bytes
(the archive budget of ``formats.limits``), group members are expanded only
within ``Limits.max_rank`` and :data:`MAX_MEMBERS` per payload, every table
index is checked (never Python's negative indexing), the batch's columns are
checked as they are decoded (``_RowCounts``: dtypes, one length per digest,
group, peer, state and unit indices within their bounds), and every decoded
digest is checked field by field for the rest (:func:`check_digest`: types,
ranks, times within int64, string and count bounds); the values the decoder
builds from the payload's checked tables -- stacks, op-name and site tables
equal to one already checked, and each entry-detail field, whose kinds, indices
and missing strings it checks per column -- are checked at their table, not
again at each use.
A malformed payload raises :class:`WireError`, and so does one that runs out
of memory. :class:`WireCache` makes equal groups and stacks of every
batch one object in the central process, as the local loader does per batch.
"""

from __future__ import annotations

import dataclasses
import lzma
import zlib
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any, Final

import msgpack
import numpy as np
import numpy.typing as npt

from frforensics.analyzer.digest import Details, DetailTable, EntryDetail, RankDigest
from frforensics.errors import FrForensicsError
from frforensics.formats.limits import DEFAULT_LIMITS, Limits
from frforensics.model import (
    HEADER_FIELDS,
    DeathInfo,
    DumpHeader,
    DumpReason,
    Frame,
    GroupInfo,
    OpState,
    PeerHeartbeat,
    SourceFormat,
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

#: a digest's fields as the wire carries them: its header's flat (``format`` and
#: ``dump_reason`` as their string values), then its own
_HEADER_KEYS: Final = HEADER_FIELDS
_OWN_FIELDS: Final = tuple(f.name for f in dataclasses.fields(RankDigest) if f.name != "header")
_DIGEST_FIELDS: Final = (*_HEADER_KEYS, *_OWN_FIELDS)


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


def _get_segments(blob: memoryview, spec: Sequence[Any], bases: Sequence[int], *,
                  one_value_views: bool = False,
                  whole: list[npt.NDArray[Any]] | None = None,
                  max_rows: int | None = None) -> list[npt.NDArray[Any]]:
    """The column's segment of each digest; ``one_value_views``: a segment of more than
    one row, all of one value, as a read-only stride-0 view of that value, as
    ``digest.compact`` leaves it (found for the whole batch in two passes).
    ``whole``: the column's rows, all segments together, are appended to it.
    ``max_rows``: a segment longer is refused before anything is decoded."""
    try:
        dtype_s, lengths, form, stored_s, off, ln, extra = spec
        dtype, stored = _DTYPES[dtype_s], _DTYPES[stored_s]
        if len(lengths) != len(bases) or not all(type(k) is int and k >= 0 for k in lengths):
            raise ValueError("segment lengths")
        if max_rows is not None and any(k > max_rows for k in lengths):
            raise ValueError(f"a segment of more than {max_rows} rows")
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
    if whole is not None:
        whole.append(x)
    if one_value_views and dtype.kind in "iub" and n:
        return _one_value_views(x, lengths)
    if len(lengths) == 1:
        return [x]
    bounds = np.cumsum(lengths).tolist()
    return [x[e - k:e] for e, k in zip(bounds, lengths, strict=True)]


def _one_value_views(x: npt.NDArray[Any], lengths: Sequence[int]) -> list[npt.NDArray[Any]]:
    """``x`` cut into segments of ``lengths``, those of one value as stride-0 views."""
    size = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(size)
    held = size > 0
    starts = (ends - size)[held]
    one = np.zeros(len(size), dtype=np.bool_)
    one[held] = np.minimum.reduceat(x, starts) == np.maximum.reduceat(x, starts)
    one &= size > 1
    out = []
    # the segments of one value and length are one view (read-only: a column all
    # of one timeout, state or peer is that in every rank of the batch)
    views: dict[tuple[Any, int], npt.NDArray[Any]] = {}
    for e, k, same in zip(ends.tolist(), size.tolist(), one.tolist(), strict=True):
        if same:
            key = (x[e - 1].item(), k)
            v = views.get(key)
            if v is None:
                v = views[key] = np.ndarray((k,), x.dtype, x[e - 1:e].copy(), 0, (0,))
                v.flags.writeable = False
            out.append(v)
        else:
            out.append(x[e - k:e])
    return out


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


#: group members expanded from one payload, all groups together (a real batch holds
#: each distinct membership once: the default group plus a few families, each at
#: most ``max_rank`` ranks)
MAX_MEMBERS: Final = 1 << 22


def _member_count(x: Any, limits: Limits) -> int:
    """How many ranks ``x`` (see :func:`_members`) expands to; ``WireError`` when it
    cannot be a membership of ranks below ``limits.max_rank``."""
    if x is None:
        return 0
    if isinstance(x, bytes):
        if len(x) % 4 or len(x) // 4 > limits.max_rank:
            raise WireError("bad group members")
        return len(x) // 4
    if isinstance(x, (list, tuple)) and len(x) == 3 and all(type(v) is int for v in x):
        start, step, count = x
        if not (step != 0 and 0 <= count <= limits.max_rank and 0 <= start < limits.max_rank
                and (count == 0 or 0 <= start + step * (count - 1) < limits.max_rank)):
            raise WireError(f"bad group members: progression {start}, {step}, {count} leaves "
                            f"0..{limits.max_rank - 1}")
        return int(count)
    if isinstance(x, (list, tuple)) and len(x) <= limits.max_rank:
        return len(x)
    raise WireError("bad group members")


def _members_back(x: Any, limits: Limits = DEFAULT_LIMITS) -> tuple[int, ...] | None:
    _member_count(x, limits)
    if x is None:
        return None
    if isinstance(x, bytes):
        a = np.frombuffer(x, dtype="<i4")
        if a.size and (int(a.min()) < 0 or int(a.max()) >= limits.max_rank):
            raise WireError(f"bad group members: ranks outside 0..{limits.max_rank - 1}")
        return tuple(a.tolist())
    if len(x) == 3 and all(type(v) is int for v in x):
        # one tuple per distinct membership in this process, as the decoders do
        # (formats._shared): the default group comes in every payload
        try:
            return progression_members(*x)
        except ValueError:
            raise WireError("bad group members") from None
    if all(type(v) is int and 0 <= v < limits.max_rank for v in x):
        return tuple(x)
    raise WireError(f"bad group members: ranks outside 0..{limits.max_rank - 1}")


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
                return self.frames[_index(value, len(self.frames), "frame")]
            if code == _EXT_STACK:
                return self.stacks[_index(value, len(self.stacks), "stack")]
            if code == _EXT_GROUP:
                return self.groups[_index(value, len(self.groups), "group")]
            cls = _BY_CODE.get(code)
            if cls is not None:
                return cls(*value)
        except (IndexError, TypeError, ValueError) as exc:
            raise WireError(f"bad value in a digest: {exc}") from None
        raise WireError(f"unknown extension {code}")


def _index(value: Any, n: int, what: str) -> int:
    """``value`` as an index into a table of ``n`` (never a negative, wrapping one)."""
    if type(value) is not int or not 0 <= value < n:
        raise WireError(f"bad {what} index {value!r} (the table holds {n})")
    return int(value)


#: msgpack's own bounds: no container or string larger than a real payload holds
_MSGPACK_LIMITS: Final = {"max_array_len": 1 << 22, "max_map_len": 1 << 22,
                          "max_str_len": 1 << 20, "max_ext_len": 1 << 30}


def _loads(data: bytes | bytearray, ext: Any | None) -> Any:
    try:
        if ext is None:
            return msgpack.unpackb(data, use_list=False, raw=False, strict_map_key=False,
                                   **_MSGPACK_LIMITS)
        return msgpack.unpackb(data, use_list=False, raw=False, strict_map_key=False,
                               ext_hook=ext, **_MSGPACK_LIMITS)
    except WireError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise WireError(f"corrupt digest payload: {exc}") from None


# ------------------------------------------------------------------ details


_DETAIL_FIELDS: Final = EntryDetail._fields


def _pack_details(all_details: Sequence[Mapping[int, EntryDetail]], t: _Tables, blob: _Blob,
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
                    bases: Sequence[int]) -> Sequence[Mapping[int, EntryDetail]]:
    counts, names, kinds, off, ln = spec
    if tuple(names) != _DETAIL_FIELDS or len(kinds) != len(names) or len(counts) != len(bases):
        raise WireError("entry details from another version of frforensics")
    if sum(counts) and tuple(kinds) != _DETAIL_KINDS:
        raise WireError(f"bad entry details: field kinds {''.join(map(str, kinds))!r}, "
                        f"expected {''.join(_DETAIL_KINDS)!r}")
    if not all(type(k) is int and k >= 0 for k in counts) or not 0 <= off <= off + ln <= len(blob):
        raise WireError("bad entry details")
    n = sum(counts)
    if n == 0:
        return [{} for _ in counts]
    matrix = _unshuffle(blob[off:off + ln], _I8, (len(names) + 1) * n).reshape(-1, n)
    shift = np.repeat(np.asarray(bases, dtype=np.int64), counts)
    table = _detail_table(matrix, counts, shift, strings, stacks)
    if table is not None:
        return table
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
                if col and max(col) >= len(strings):
                    raise WireError("bad entry details: string index past the table")
                if col and name != "location" and min(col) < 0:
                    # (only a location may be missing: check_digest's rule, here per column)
                    raise WireError(f"bad entry details: field {name} without its string")
                col = [None if v < 0 else strings[v] for v in col]
            elif kind == "f":
                if col and max(col) >= len(stacks):
                    raise WireError("bad entry details: stack index past the table")
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


def _detail_table(matrix: npt.NDArray[np.int64], counts: Sequence[int], shift: npt.NDArray[np.int64],
                  strings: list[str], stacks: list[tuple[Frame, ...]]) -> list[Details] | None:
    """The batch's details as one :class:`DetailTable` (each rank's read when asked),
    the fields checked as ``_unpack_details`` checks them one by one; ``None`` where
    they do not fit a table (a row key not its entry's row, keys not ascending within
    a rank) or a check fails: the caller's field-by-field path then decides."""
    n = matrix.shape[1]
    cells = np.empty((n, len(_DETAIL_FIELDS)), dtype=np.int64)
    for i, (name, kind) in enumerate(zip(_DETAIL_FIELDS, _DETAIL_KINDS, strict=True)):
        v = matrix[i + 1]
        if name in _TIME_COLUMNS:
            v = v + shift
        if not _cells_ok(v, kind, name, len(strings), len(stacks)):
            return None
        if kind == "b":
            v = v != 0
        elif kind == "f":
            v = np.where(v < 0, len(stacks), v)  # no frames: the table's last stack, ()
        cells[:, i] = v
    keys = matrix[0]
    ends = np.cumsum(np.asarray(counts, dtype=np.int64))
    rising = np.ones(n, dtype=np.bool_)
    rising[1:] = keys[1:] > keys[:-1]
    rising[ends[:-1][ends[:-1] < n]] = True  # a rank's first row follows another rank's
    if not np.array_equal(keys, cells[:, 0]) or not rising.all():
        return None
    table = DetailTable(cells, strings, [*stacks, ()])
    return [Details(table, int(hi - k), int(hi)) for k, hi in zip(counts, ends.tolist(), strict=True)]


def _cells_ok(v: npt.NDArray[np.int64], kind: str, name: str, n_strings: int, n_stacks: int) -> bool:
    """Whether one field's column holds what ``_unpack_details`` accepts for it."""
    if kind == "e":
        return bool(np.isin(v, _STATE_VALUES).all())
    if kind == "s":
        return int(v.max()) < n_strings and (name == "location" or int(v.min()) >= 0)
    if kind == "f":
        return int(v.max()) < n_stacks
    return True


#: the kind each EntryDetail field is sent as (``_pack_details``); another is refused
_DETAIL_KINDS: Final = tuple(
    {"op": "s", "in_shapes": "s", "out_shapes": "s", "in_dtypes": "s", "out_dtypes": "s",
     "reduce_op": "s", "thread": "s", "location": "s", "is_p2p": "b", "state": "e",
     "frames": "f"}.get(name, "i") for name in _DETAIL_FIELDS)
_I8: Final = np.dtype(np.int64)
_STATES: Final = {int(s): s for s in OpState}
_STATE_VALUES: Final = np.array(sorted(_STATES), dtype=np.int64)


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
        #: a group as the wire sends it (name, desc, members as sent, backend) -> its
        #: decoded, checked ``GroupInfo``: the default group of 100,000 ranks comes in
        #: every payload, and expanding and hashing its members there was ~8 % of a
        #: decode
        self.sent_groups: dict[tuple[Any, ...], GroupInfo] = {}

    def group(self, sent: Sequence[Any], limits: Limits) -> GroupInfo:
        """The one ``GroupInfo`` of a group table row (checked as ``_decode_doc`` checks it)."""
        name, desc, ranks, backend = sent
        # only the forms ``_members`` sends, exactly typed (``True == 1``: a member list
        # of other types is decoded and refused by ``_members_back``, never looked up)
        exact = ranks is None or type(ranks) is bytes or (
            type(ranks) is tuple and len(ranks) == 3 and all(type(v) is int for v in ranks))
        key = (name, desc, ranks, backend, limits.max_rank) if exact else None
        found = None if key is None else self.sent_groups.get(key)
        if found is None:
            g = GroupInfo(name, desc, _members_back(ranks, limits), backend)
            found = self.groups.setdefault(g, g)
            if key is not None:
                self.sent_groups[key] = found
        return found


#: the largest decompressed payload accepted at all (a guard against decompression bombs)
MAX_PAYLOAD_BYTES: Final = 1 << 31


def payload_cap(compressed: int, limits: Limits = DEFAULT_LIMITS) -> int:
    """Bytes a payload of ``compressed`` bytes may inflate to: the archive budget of the
    file readers (``max_archive_ratio`` times its size beyond ``archive_ratio_floor_bytes``),
    never more than :data:`MAX_PAYLOAD_BYTES`."""
    return min(MAX_PAYLOAD_BYTES, limits.max_archive_bytes,
               max(limits.archive_ratio_floor_bytes, limits.max_archive_ratio * compressed))


_STEP: Final = 8 << 20


def _inflate(data: bytes, limits: Limits) -> bytearray:
    """The body of a payload, never inflated past :func:`payload_cap` (the decompressor
    stops there: a bomb costs at most the cap)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"a digest payload is bytes, not {type(data).__name__}")
    data = bytes(data)
    if data[:4] != _MAGIC or len(data) < 5:
        raise WireError("not a frforensics digest payload")
    cap = payload_cap(len(data), limits)
    body = bytearray()
    try:
        # in steps into one growing buffer: a bomb costs about the cap, never twice it
        if data[4:5] == _ZLIB:
            d = zlib.decompressobj()
            rest = data[5:]
            while not d.eof:
                body += d.decompress(rest, _STEP)
                rest = d.unconsumed_tail
                if len(body) > cap:
                    raise WireError(f"digest payload inflates past {cap} bytes: refused")
                if not rest and not d.eof:
                    raise WireError("truncated digest payload")
        elif data[4:5] == _LZMA:
            dl = lzma.LZMADecompressor()
            rest = data[5:]
            while not dl.eof:
                body += dl.decompress(rest, _STEP)
                rest = b""
                if len(body) > cap:
                    raise WireError(f"digest payload inflates past {cap} bytes: refused")
                if dl.needs_input and not dl.eof:
                    raise WireError("truncated digest payload")
        else:
            raise WireError("unknown compression in a digest payload")
    except (zlib.error, lzma.LZMAError, EOFError) as exc:
        raise WireError(f"corrupt digest payload: {exc}") from None
    return body


def decode_batch(data: bytes, *, cache: WireCache | None = None,
                 limits: Limits = DEFAULT_LIMITS) -> list[RankDigest]:
    """Decode a payload of :func:`encode_batch` back into equal ``RankDigest``s.

    Anything wrong with the payload, running out of memory included, is one
    :class:`WireError` (the caller makes it one load problem for that peer)."""
    try:
        body = _inflate(data, limits)
        doc = _loads(body, None)
        del body
        return _decode_doc(doc, cache, limits)
    except WireError:
        raise
    except MemoryError:
        raise WireError("out of memory while decoding the digest payload: refused") from None
    except (KeyError, IndexError, TypeError, ValueError, OverflowError, AttributeError) as exc:
        raise WireError(f"malformed digest payload: {type(exc).__name__}: {exc}") from None


def _list(x: Any, what: str) -> Sequence[Any]:
    if not isinstance(x, (list, tuple)):
        raise WireError(f"bad {what}: {type(x).__name__}, not a list")
    return x


def _decode_doc(doc: Any, cache: WireCache | None, limits: Limits) -> list[RankDigest]:
    if not isinstance(doc, dict):
        raise WireError("malformed digest payload: not a map")
    blob_b = doc["blob"]
    if not isinstance(blob_b, bytes):
        raise WireError("malformed digest payload: blob")
    blob = memoryview(blob_b)
    strings = list(_list(doc["strings"], "string table"))
    if not all(type(s) is str and len(s) <= 4 * limits.max_string_chars for s in strings):
        raise WireError("bad string table")
    # three int64 columns, as the encoder sends them: the stacks made of them are
    # trusted (and cached for later payloads) without checking each frame again
    frame_columns = [_get_column(blob, spec) for spec in _list(doc["frames"], "frame table")]
    if len(frame_columns) != 3 or any(c.dtype != np.int64 for c in frame_columns):
        raise WireError("bad frame table: not three int64 columns (file, line, name)")
    files, lines, names = (c.tolist() for c in frame_columns)
    ns = len(strings)
    if any(not 0 <= i < ns for i in (*files, *names)):
        raise WireError(f"bad frame table: a string index outside 0..{ns - 1}")
    frames = [Frame(strings[f], ln, strings[n]) for f, ln, n in zip(files, lines, names, strict=True)]
    nf = len(frames)
    stacks = [tuple(frames[_index(i, nf, "frame")] for i in _list(s, "stack"))
              for s in _list(doc["stacks"], "stack table")]
    raw_groups = [_list(g, "group") for g in _list(doc["groups"], "group table")]
    if not all(len(g) == 4 and type(g[0]) is str and type(g[1]) is str and type(g[3]) is str
               for g in raw_groups):
        raise WireError("bad group table: a group is [name, desc, members, backend] (strings)")
    expanded = sum(_member_count(g[2], limits) for g in raw_groups)
    if expanded > MAX_MEMBERS:
        raise WireError(f"group members: {expanded} in one payload, more than {MAX_MEMBERS}: "
                        "refused")
    if cache is not None:
        stacks = [cache.stacks.setdefault(s, s) for s in stacks]
        groups = [cache.group(g, limits) for g in raw_groups]
    else:
        groups = [GroupInfo(name, desc, _members_back(ranks, limits), backend)
                  for name, desc, ranks, backend in raw_groups]
    unpacker = _Unpacker(frames, stacks, groups)
    # every stack of the table is frames of checked strings and int64 lines: the
    # digests' stacks (details, threads, a death) are these objects, checked once here
    # rather than once per use (~2 ms a rank: the central step of --dask at 100,000
    # ranks spent 200 s of CPU re-checking them)
    trusted = frozenset(map(id, stacks))
    packed = doc["digests"]
    if not isinstance(packed, bytes):
        raise WireError("malformed digest payload: digests")
    values = [dict(entry) for entry in _list(_loads(packed, unpacker.ext), "digest list")]
    for v in values:
        _check_scalars(v, limits)
    bases = [v.get("dump_time_ns") or 0 for v in values]
    zeros = [0] * len(values)
    rows = _RowCounts(values)
    sent: set[str] = set()
    for column in _list(doc["columns"], "column list"):
        name, members, spec = column
        if name not in _ARRAY_FIELDS:
            raise WireError(f"unknown column {name!r}")
        want = _ARRAY_FIELDS[name][0]  # the dtype, checked before anything is decoded
        if not isinstance(spec, (list, tuple)) or not spec or spec[0] != want.str:
            raise WireError(f"column {name} is not a one-dimensional {want.str} array")
        # one entry a column (the encoder's): a second would be decoded again, and
        # its segments' bounds would stand in for the first's (``_RowCounts``)
        if name in sent:
            raise WireError(f"column {name!r} sent twice")
        sent.add(name)
        members = _list(members, "column members")
        if len(set(members)) != len(members):
            raise WireError(f"column {name!r} names a digest twice")
        for i in members:
            _index(i, len(values), "digest")
        pick = bases if name in _TIME_COLUMNS else zeros
        whole: list[npt.NDArray[Any]] = []
        segments = _get_segments(blob, spec, [pick[i] for i in members], one_value_views=True,
                                 whole=whole, max_rows=limits.max_entries)
        rows.add(name, members, segments, whole[0])
        for i, col in zip(members, segments, strict=True):
            values[i][name] = col
    for v, details in zip(values, _unpack_details(doc["details"], blob, strings, stacks, bases),
                          strict=True):
        v["details"] = details
    _share_tables(values)
    rows.check(limits)
    out = []
    checked = set(trusted)
    for v in values:
        if set(v) != set(_DIGEST_FIELDS):
            raise WireError("digest from another version of frforensics (fields differ)")
        d = _digest_of(v)
        check_digest(d, limits, decoded=checked, columns_checked=True)
        # the tables it passed with (not a ``None`` sites: ids here vouch for objects)
        checked.update(id(t) for t in (d.op_names, d.sites) if type(t) is dict)
        out.append(d)
    return out


class _RowCounts:
    """What ``check_digest`` checks of a digest's columns, checked for the whole batch
    at once, column by column as the decoder makes them (each column's dtype is
    checked as sent, in ``_decode_doc``): each digest's columns all of one length, and the index columns within their bounds
    (groups of the digest, peers and states, coalesced units within its rows). A
    Python loop over 17 columns per digest was a tenth of a decode."""

    def __init__(self, values: list[dict[str, Any]]) -> None:
        self.values = values
        self.n = np.full(len(values), -1, dtype=np.int64)
        self.spans: dict[str, tuple[npt.NDArray[np.int64], npt.NDArray[Any], npt.NDArray[Any]]] = {}

    def add(self, name: str, members: Sequence[int], segments: list[npt.NDArray[Any]],
            x: npt.NDArray[Any]) -> None:
        # (its dtype was checked as sent, before decoding: ``_get_segments`` gives that one)
        at = np.asarray(members, dtype=np.int64)
        k = np.fromiter(map(len, segments), dtype=np.int64, count=len(segments))
        unset = self.n[at] < 0
        self.n[at[unset]] = k[unset]
        if not np.array_equal(self.n[at], k):
            i = int(np.flatnonzero(self.n[at] != k)[0])
            raise _bad(self.values[int(at[i])].get("rank"),
                       f"column {name} has {int(k[i])} rows, not {int(self.n[at[i]])}")
        if name in _BOUNDED and len(x):
            held = k > 0
            starts = (np.cumsum(k) - k)[held]
            self.spans[name] = (at[held], np.minimum.reduceat(x, starts),
                                np.maximum.reduceat(x, starts))

    def check(self, limits: Limits) -> None:
        for v in self.values:  # a field no column gave: only an optional one, as None
            for name, (_, optional) in _ARRAY_FIELDS.items():
                a = v.get(name)
                if type(a) is not np.ndarray and not (a is None and optional):
                    raise WireError(f"column {name} of a digest is missing")
        n = self.n
        if (n < 0).any() or (n > limits.max_entries).any():
            raise WireError(f"a digest without columns, or of more than {limits.max_entries} "
                            "entries")
        for name, (at, lo, hi) in self.spans.items():
            above = self._above(name, at, limits)
            out = (lo < _BOUNDED[name]) | (hi >= above)
            if out.any():
                i = int(np.flatnonzero(out)[0])
                top = int(np.broadcast_to(above, out.shape)[i]) - 1
                what = {"group": f"a group index outside -1..{top}",
                        "peer": f"a peer outside -1..{top}",
                        "state": "an op state that does not exist",
                        "unit": f"a coalesced unit outside 0..{top}"}[name]
                raise _bad(self.values[int(at[i])].get("rank"), what)

    def _above(self, name: str, at: npt.NDArray[np.int64], limits: Limits) -> Any:
        """The first value past the bounds of column ``name`` for the digests ``at``."""
        if name == "group":
            return np.fromiter((len(self.values[i]["groups"]) for i in at.tolist()),
                               dtype=np.int64, count=len(at))
        if name == "unit":
            return self.n[at]
        return limits.max_rank if name == "peer" else max(_STATES) + 1


#: the index columns and their lowest value (``check_digest``)
_BOUNDED: Final = {"group": -1, "peer": -1, "state": 0, "unit": 0}


def _share_tables(values: list[dict[str, Any]]) -> None:
    """Each digest's op-name and call-site tables as one object where equal to another
    digest's of the batch (the ranks of a job name the same ops at the same sites), as
    the local loader shares them (``load._Sharer``): held once, and checked once
    (``check_digest`` with the ids of the tables it has passed). An equal table stands
    in for a digest's own, so what a digest holds is always a table that was checked."""
    for name in ("op_names", "sites"):
        seen: list[Any] = []
        for v in values:
            table = v.get(name)
            if type(table) is not dict:
                continue
            for prev in seen:
                if prev == table:
                    v[name] = prev
                    break
            else:
                if len(seen) < 8:
                    seen.append(table)


def _digest_of(v: dict[str, Any]) -> RankDigest:
    """A :class:`RankDigest` from its flat wire fields (``_DIGEST_FIELDS``)."""
    head = {name: v.pop(name) for name in _HEADER_KEYS}
    for name, enum_type in (("format", SourceFormat), ("dump_reason", DumpReason)):
        value = head[name]
        if type(value) is not str:
            raise WireError(f"a digest's {name} is not a string")
        try:
            head[name] = enum_type(value)
        except ValueError:
            raise WireError(f"a digest's {name} {value!r:.40} is not one this version knows") from None
    # (the one-value columns are views already: ``_get_segments``); ``numel`` is
    # ``size`` where they are equal, as ``digest.compact`` leaves it (made here, not
    # by a ``replace`` of the digest: a second digest object per rank)
    size, numel = v.get("size"), v.get("numel")
    if isinstance(size, np.ndarray) and isinstance(numel, np.ndarray) \
            and numel.dtype == size.dtype and np.array_equal(numel, size):
        v["numel"] = size
    return RankDigest(header=DumpHeader(**head), **v)


# ------------------------------------------------------------------ checks

#: the numpy fields of a digest and their dtypes (``None``-able ones marked)
_ARRAY_FIELDS: Final[dict[str, tuple[np.dtype[Any], bool]]] = {
    name: (np.dtype(dt), optional) for name, dt, optional in (
        ("group", "<i4", False), ("seq", "<i8", False), ("p2p_seq", "<i8", False),
        ("peer_seq", "<i8", False), ("is_p2p", "|u1", False), ("peer", "<i4", False),
        ("op_hash", "<u4", False), ("dtype_hash", "<u4", False), ("size", "<i8", False),
        ("state", "|u1", False), ("t_enqueue_ns", "<i8", False), ("t_complete_ns", "<i8", False),
        ("timeout_ms", "<i8", False), ("site", "<u4", True), ("numel", "<i8", True),
        ("unit", "<i8", True), ("duration_ns", "<i8", True))}
_I64_MIN: Final = -(1 << 63)
_I64_MAX: Final = (1 << 63) - 1
_STR_FIELDS: Final = ("rank_from", "source", "format", "version", "dump_reason", "dump_detail")
_OPT_STR_FIELDS: Final = ("host", "job_id", "gpu_uuid", "pci_bus_id")
_INT_FIELDS: Final = ("completion_resolution_ns", "dropped", "first_record_id", "unrecorded_ops")
_OPT_INT_FIELDS: Final = ("pid", "local_rank", "cuda_device", "dump_monotonic_ns")
_MAX_NOTES: Final = 4096


def _bad(d: Any, what: str) -> WireError:
    return WireError(f"digest of rank {d!r}: {what}")


def _int64(v: Any) -> bool:
    return type(v) is int and _I64_MIN <= v <= _I64_MAX


def _text_ok(v: Any, limits: Limits) -> bool:
    return type(v) is str and len(v) <= 4 * limits.max_string_chars


def _int_to_text(table: dict[Any, Any], limits: Limits) -> bool:
    """Every key an int within int64, every value a string ``_text_ok`` takes (the
    types by set, the bounds by min and max: no Python call per item)."""
    if not table:
        return True
    keys, values = table.keys(), table.values()
    return (set(map(type, keys)) == {int} and min(keys) >= _I64_MIN and max(keys) <= _I64_MAX
            and set(map(type, values)) == {str}
            and max(map(len, values)) <= 4 * limits.max_string_chars)


def _check_scalars(v: dict[str, Any], limits: Limits) -> None:
    """The fields the decoder itself relies on (rank, dump time), before the columns."""
    rank = v.get("rank")
    if type(rank) is not int or not 0 <= rank < limits.max_rank:
        raise WireError(f"a digest's rank {rank!r:.40} is not in 0..{limits.max_rank - 1}")
    t = v.get("dump_time_ns")
    if t is not None and (type(t) is not int or not 0 <= t <= _I64_MAX):
        raise _bad(rank, f"dump_time_ns {t!r:.40} is not a time within int64")


def _frames_ok(frames: Any, limits: Limits, trusted: Container[int] = ()) -> bool:
    return id(frames) in trusted or (type(frames) is tuple and all(
        type(f) is Frame and _text_ok(f.file, limits) and _text_ok(f.name, limits)
        and _int64(f.line) for f in frames))


def check_digest(d: RankDigest, limits: Limits = DEFAULT_LIMITS, *,
                 decoded: Container[int] | None = None, columns_checked: bool = False) -> None:
    """``WireError`` unless every field of ``d`` has its type and lies within ``limits``:
    what a digest from a file reader guarantees, checked again for one that crossed a
    process boundary (a worker's or a peer's).

    ``decoded``: ``d`` is :func:`decode_batch`'s own, and these are the ids of its
    payload's stacks, already checked (frames of checked strings and int64 lines),
    and of the op-name and call-site tables an earlier digest of the payload passed
    with (``_share_tables``): one among them is not checked again, and the entry
    details, which the decoder built field by field from the checked tables
    (``_unpack_details``), are checked for their rows only."""
    trusted: Container[int] = () if decoded is None else decoded
    r = d.rank
    if type(r) is not int or not 0 <= r < limits.max_rank:
        raise WireError(f"a digest's rank {r!r:.40} is not in 0..{limits.max_rank - 1}")
    if type(d.header) is not DumpHeader or type(d.header.format) is not SourceFormat \
            or type(d.header.dump_reason) is not DumpReason:
        raise _bad(r, "header is not a dump header")
    ws = d.world_size
    if ws is not None and (type(ws) is not int or not 1 <= ws <= limits.max_rank):
        raise _bad(r, f"world size {ws!r:.40} is not in 1..{limits.max_rank}")
    for name in _STR_FIELDS:
        if not _text_ok(getattr(d, name), limits):
            raise _bad(r, f"{name} is not a string of at most {4 * limits.max_string_chars}")
    for name in _OPT_STR_FIELDS:
        x = getattr(d, name)
        if x is not None and not _text_ok(x, limits):
            raise _bad(r, f"{name} is not a string")
    for name in _INT_FIELDS:
        if not _int64(getattr(d, name)):
            raise _bad(r, f"{name} is not an integer within int64")
    for name in _OPT_INT_FIELDS:
        x = getattr(d, name)
        if x is not None and not _int64(x):
            raise _bad(r, f"{name} is not an integer within int64")
    if d.dump_time_ns is not None and not (type(d.dump_time_ns) is int
                                           and 0 <= d.dump_time_ns <= _I64_MAX):
        raise _bad(r, "dump_time_ns is not a time within int64")
    if type(d.gpu_states) is not bool or type(d.whole_oldest) is not bool:
        raise _bad(r, "a flag is not a boolean")
    if type(d.groups) is not tuple or not all(type(g) is GroupInfo for g in d.groups):
        raise _bad(r, "groups are not a tuple of groups")
    if type(d.threads) is not tuple or not all(
            type(t) is ThreadStack and _text_ok(t.name, limits) and _int64(t.ident)
            and type(t.is_main) is bool and _frames_ok(t.frames, limits, trusted)
            for t in d.threads):
        raise _bad(r, "threads are not (name, ident, is_main, frames) stacks")
    if type(d.stale_peers) is not tuple or not all(
            type(p) is PeerHeartbeat and type(p.rank) is int and 0 <= p.rank < limits.max_rank
            and type(p.age_s) in (int, float) and 0 <= p.age_s < 1e12 for p in d.stale_peers):
        raise _bad(r, f"stale peers are not (rank in 0..{limits.max_rank - 1}, finite age)")
    if d.death is not None and not (type(d.death) is DeathInfo and _text_ok(d.death.kind, limits)
                                    and _text_ok(d.death.message, limits)
                                    and _frames_ok(d.death.frames, limits, trusted)):
        raise _bad(r, "death is not (kind, message, frames)")
    if type(d.notes) is not tuple or len(d.notes) > _MAX_NOTES or not all(
            _text_ok(x, limits) for x in d.notes):
        raise _bad(r, "notes are not a bounded tuple of strings")
    if columns_checked:  # by the decoder, for its whole batch (``_RowCounts``)
        _check_rest(d, len(d.seq), limits, decoded)
        return
    n = None
    for name, (dtype, optional) in _ARRAY_FIELDS.items():
        a = getattr(d, name)
        if a is None and optional:
            continue
        if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != 1:
            raise _bad(r, f"column {name} is not a one-dimensional {dtype.str} array")
        if n is None:
            n = len(a)
        if len(a) != n:
            raise _bad(r, f"column {name} has {len(a)} rows, not {n}")
    assert n is not None
    if n > limits.max_entries:
        raise _bad(r, f"{n} entries, more than {limits.max_entries}")
    if n:
        if int(d.group.min()) < -1 or int(d.group.max()) >= len(d.groups):
            raise _bad(r, f"a group index outside -1..{len(d.groups) - 1}")
        if int(d.peer.min()) < -1 or int(d.peer.max()) >= limits.max_rank:
            raise _bad(r, f"a peer outside -1..{limits.max_rank - 1}")
        if int(d.state.max()) > max(_STATES):
            raise _bad(r, "an op state that does not exist")
        if d.unit is not None and (int(d.unit.min()) < 0 or int(d.unit.max()) >= n):
            raise _bad(r, f"a coalesced unit outside 0..{n - 1}")
    _check_rest(d, n, limits, decoded)


def _check_rest(d: RankDigest, n: int, limits: Limits, decoded: Container[int] | None) -> None:
    """``check_digest`` after the columns: the tables, details, splits (``n`` rows)."""
    r = d.rank
    trusted: Container[int] = () if decoded is None else decoded
    if type(d.first_record_id) is not int:
        raise _bad(r, "first_record_id is not an integer")
    for name, table in (("op_names", d.op_names), ("sites", d.sites)):
        if table is None and name == "sites":
            continue
        if type(table) is not dict or len(table) > max(n, 1) * 4 + 1024 \
                or (id(table) not in trusted and not _int_to_text(table, limits)):
            raise _bad(r, f"{name} is not a bounded table of integers to strings")
    if type(d.details) not in (dict, Details) or len(d.details) > n:
        raise _bad(r, "more entry details than entries")
    if decoded is not None:  # int keys, EntryDetails of checked fields (``_unpack_details``)
        if d.details and (min(d.details) < 0 or max(d.details) >= n):
            raise _bad(r, f"an entry detail's row outside 0..{n - 1}")
    else:
        _check_details(d, n, limits)
    if d.splits is not None:
        _check_splits(d.splits, r, n, limits)
    if d.stopped_in_call is not None and not _text_ok(d.stopped_in_call, limits):
        raise _bad(r, "stopped_in_call is not a string")


def _check_details(d: RankDigest, n: int, limits: Limits) -> None:
    """Every entry detail of ``d``, field by field (a digest not from the decoder)."""
    r = d.rank
    for row, e in d.details.items():
        if type(row) is not int or not 0 <= row < n or type(e) is not EntryDetail:
            raise _bad(r, f"entry detail of row {row!r:.40} outside 0..{n - 1}")
        for kind, name, value in zip(_DETAIL_KINDS, _DETAIL_FIELDS, e, strict=True):
            ok = (type(value) is bool if kind == "b" else type(value) is OpState if kind == "e"
                  else _int64(value) if kind == "i" else _frames_ok(value, limits) if kind == "f"
                  else (value is None and name == "location") or _text_ok(value, limits))
            if not ok:
                raise _bad(r, f"entry detail field {name} of row {row} is not a valid "
                              f"{type(value).__name__}")


def _check_splits(splits: Any, r: int, n: int, limits: Limits) -> None:
    """``RankDigest.splits``: rows 0..n-1 to two equally long runs of element counts."""
    if type(splits) is not dict or len(splits) > n:
        raise _bad(r, "more all_to_all splits than entries")
    for row, value in splits.items():
        ok = (type(row) is int and 0 <= row < n and type(value) is tuple and len(value) == 2
              and all(type(side) is tuple and 0 < len(side) <= limits.max_rank
                      and all(_int64(x) and x >= 0 for x in side) for side in value)
              and len(value[0]) == len(value[1]))
        if not ok:
            raise _bad(r, f"all_to_all splits of row {row!r:.40} are not two runs of counts")
