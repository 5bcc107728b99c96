"""Per-rank digest: what the cross-rank analysis needs of one dump, compactly.

A :class:`RankDigest` is computed where the dump is decoded (in a worker process),
so the full ring — shapes, stacks of every entry — never crosses a process
boundary or stays in memory. It keeps:

* every entry's matching columns (group, seq, op/dtype hashes, the size that
  must agree across members, state, times), as numpy arrays; string ids are
  replaced by stable 32-bit hashes of the strings so digests of different ranks
  compare without a shared string table;
* full :class:`EntryDetail` records for the entries a report can talk about:
  every unfinished entry plus the last ``tail`` entries.

States are *effective* states: PyTorch records each member op of a coalesced
block (``_coalescing_manager``, ``batch_isend_irecv``, bucketed collectives)
without CUDA events, so a member's own entry stays ``scheduled`` and is never
retired; only the block's closing ``coalesced`` entry, which carries the same
``collective_seq_id`` (p2p: the same ``p2p_seq_id``), tracks the block's real
state (docs/native-format.md, "coalesced blocks"). Every member takes its
closing entry's state here, and ``unit`` maps each row to the row that carries
its block's state (itself when not coalesced).
"""

from __future__ import annotations

import functools
import operator
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Final, NamedTuple

import numpy as np
import numpy.typing as npt

from frforensics.model import (
    DumpHeader,
    Frame,
    GroupInfo,
    HeaderFields,
    OpState,
    RankTrace,
    is_library_file,
    user_frame,
)

__all__ = ["DTYPE_UNCHECKED", "ROOTED_OPS", "SIZE_FROM_OUTPUT", "DetailTable", "Details", "EntryDetail", "RankDigest", "coalesced_units", "compact",
           "compared_dtypes", "compared_side", "digest", "str_hash", "user_frame", "windowed"]

DEFAULT_TAIL: Final = 32

# What every member of a collective must agree on (docs/native-format.md, "What
# members agree on", with PyTorch's source line for each rule):
# * most ops: the input (all_reduce, broadcast, reduce, reduce_scatter*, the
#   all_gather_into_tensor forms, their coalesced forms);
# * ``all_gather`` (a list of outputs): the outputs' total, the same on every rank
#   even when the inputs are uneven (NCCL allows per-rank input sizes there);
# * rooted ops (``ROOTED_OPS``): the one tensor every member holds, on whichever
#   side the writer put it (``compared_side``);
# * uneven ops (all_to_all with splits): the dtype only; their sizes differ
#   legitimately between members, and so do their totals.
SIZE_FROM_OUTPUT: Final = frozenset({"all_gather"})
_SIZE_UNCHECKED: Final = frozenset(
    {"all_to_all", "all_to_all_single", "alltoall", "barrier", "coalesced", ""}
)
#: ops with a root whose other members hold only their own chunk
ROOTED_OPS: Final = frozenset({"scatter", "gather"})
#: ``dtype_hash`` of an entry whose dtype is not compared (as ``size`` -1)
DTYPE_UNCHECKED: Final = 0xFFFFFFFF
_UNDEFINED: Final = "Undefined"  # c10::toString(ScalarType::Undefined): NCCL's placeholder


def compared_side(op: str, in_dtypes: str, out_dtypes: str, in_numel: int = 0,
                  out_numel: int = 0) -> int:
    """Which side of an entry members compare: 0 inputs, 1 outputs, -1 neither.

    Only rooted ops (``ROOTED_OPS``) choose; every other op compares its inputs
    (0). Of a scatter or gather every member holds one tensor of the same size
    and dtype, its *chunk* (what it receives from scatter, sends to gather); the
    other side is the root's ``world`` chunks and nothing elsewhere. Writers put
    the chunk on different sides (docs/native-format.md, "What members agree
    on"): gloo records a scatter's chunk as its output and the root's chunks,
    stacked into one ``[world, *chunk]`` tensor, as its input (non-roots: none);
    NCCL records the chunk as the *input* of both scatter and gather and, on a
    non-root, an undefined tensor (dtype ``Undefined``) as the other side; our
    recorder as gloo, with the root's chunks as a list. So: the side that is
    defined when only one is; on the root, where both are, the smaller (the
    root's side is ``world`` times the chunk; equal in a one-member group: the
    inputs); neither (a damaged entry): nothing is compared.
    """
    if op not in ROOTED_OPS:
        return 0
    ins = any(d and d != _UNDEFINED for d in in_dtypes.split(","))
    outs = any(d and d != _UNDEFINED for d in out_dtypes.split(","))
    if ins and outs:
        return 0 if in_numel <= out_numel else 1
    return 0 if ins else 1 if outs else -1


def compared_dtypes(op: str, in_dtypes: str, out_dtypes: str, side: int | None = None) -> str:
    """The dtype text members compare for an entry (``compared_side``)."""
    if op not in ROOTED_OPS:
        return in_dtypes
    if side is None:
        side = compared_side(op, in_dtypes, out_dtypes)
    if side < 0:
        return ""
    text = in_dtypes if side == 0 else out_dtypes
    return ",".join(d for d in text.split(",") if d and d != _UNDEFINED)


def str_hash(s: str) -> int:
    """A stable 32-bit hash of a string (the same in every process)."""
    return zlib.crc32(s.encode("utf-8", "surrogatepass"))


class EntryDetail(NamedTuple):
    """One entry with every field resolved to text, for reports.

    A named tuple rather than a dataclass: digests travel from the decoding
    workers to the main process, and a frozen dataclass unpickles field by field
    in Python (0.3 ms per rank, half the cost of receiving a digest).
    """

    row: int
    record_id: int
    group: int
    seq: int
    p2p_seq: int
    peer_seq: int
    op: str
    is_p2p: bool
    peer: int
    root: int
    in_shapes: str
    out_shapes: str
    in_dtypes: str
    out_dtypes: str
    reduce_op: str
    state: OpState
    t_enqueue_ns: int
    t_start_ns: int
    t_complete_ns: int
    timeout_ms: int
    thread: str
    frames: tuple[Frame, ...]
    #: ``file:line in function`` of the user's call site (``user_frame``), if
    #: recorded; resolved in the worker, once per distinct stack
    location: str | None = None


#: EntryDetail's fields in a :class:`DetailTable` cell row: ints as they are, texts
#: (``"t"``) as indices into the table's texts, ``location`` (``"l"``) the same or -1
#: for None, ``frames`` (``"f"``) an index into its stacks, ``is_p2p`` (``"b"``) 0/1,
#: ``state`` (``"s"``) the OpState's value
_CELL_KINDS: Final = ("i", "i", "i", "i", "i", "i", "t", "b", "i", "i", "t", "t", "t", "t", "t",
                      "s", "i", "i", "i", "i", "t", "f", "l")
_INT64_MIN: Final = -(1 << 63)
_INT64_MAX: Final = (1 << 63) - 1


class DetailTable:
    """The kept entries (:class:`EntryDetail`) of a batch of digests as one int64
    array, a row per entry, with the batch's distinct texts and stacks beside it.

    Why: the main process receives every rank's digest, and at 100,000 ranks the
    details were 3.2 million named tuples, two thirds of the time to unpickle a
    digest (93 us a rank with them, 31 without: ``docs/performance.md``). A table
    unpickles as one buffer and a few lists; each rank's :class:`Details` reads its
    rows only when an analysis asks (the blocked op of a waiting rank, the
    timeline's few ranks, a culprit's last ops).
    """

    __slots__ = ("cells", "stacks", "texts")

    def __init__(self, cells: I8, texts: list[str], stacks: list[tuple[Frame, ...]]) -> None:
        self.cells = cells
        self.texts = texts
        self.stacks = stacks

    def __reduce__(self) -> tuple[Any, ...]:
        return (DetailTable, (self.cells, self.texts, self.stacks))

    def entry(self, values: list[int]) -> EntryDetail:
        """The :class:`EntryDetail` of one cell row (as a list of ints)."""
        t, (row, rid, grp, sq, p2p_seq, peer_seq, op, p2p, peer, root, ins, outs, ind, outd,
            red, state, t_enq, t_start, t_comp, tmo, thread, frames, loc) = self.texts, values
        return _new_detail((row, rid, grp, sq, p2p_seq, peer_seq, t[op], bool(p2p), peer, root,
                            t[ins], t[outs], t[ind], t[outd], t[red], OpState(state), t_enq,
                            t_start, t_comp, tmo, t[thread], self.stacks[frames],
                            None if loc < 0 else t[loc]))

    @classmethod
    def build(cls, ranks: Iterable[Mapping[int, EntryDetail]],
              stack: Callable[[tuple[Frame, ...]], tuple[Frame, ...]] | None = None,
              ) -> list[Details] | None:
        """One :class:`Details` per mapping of ``ranks``, over one shared table;
        ``stack`` maps each entry's stack to its canonical one (equal stacks stored
        once). ``None`` where the entries do not fit one (rows not ascending, a row
        that is not its entry's, an int outside int64): the caller keeps the mappings."""
        texts: dict[str, int] = {}
        stacks: dict[int, int] = {}
        stack_list: list[tuple[Frame, ...]] = []
        text = texts.setdefault
        rows_out: list[tuple[int, ...]] = []
        bounds: list[tuple[int, int]] = []
        for details in ranks:
            lo, last = len(rows_out), None
            for row, e in details.items():
                if (last is not None and row <= last) or e.row != row:
                    return None
                last = row
                frames = e.frames if stack is None else stack(e.frames)
                at = stacks.get(id(frames))
                if at is None:
                    at = stacks[id(frames)] = len(stack_list)
                    stack_list.append(frames)
                loc = -1 if e.location is None else text(e.location, len(texts))
                rows_out.append((
                    row, e.record_id, e.group, e.seq, e.p2p_seq, e.peer_seq,
                    text(e.op, len(texts)), int(e.is_p2p), e.peer, e.root,
                    text(e.in_shapes, len(texts)), text(e.out_shapes, len(texts)),
                    text(e.in_dtypes, len(texts)), text(e.out_dtypes, len(texts)),
                    text(e.reduce_op, len(texts)), int(e.state), e.t_enqueue_ns, e.t_start_ns,
                    e.t_complete_ns, e.timeout_ms, text(e.thread, len(texts)), at, loc))
            bounds.append((lo, len(rows_out)))
        try:
            cells = np.array(rows_out, dtype=np.int64).reshape(len(rows_out), len(_CELL_KINDS))
        except (OverflowError, TypeError, ValueError):
            return None
        table = cls(cells, list(texts), stack_list)
        return [Details(table, lo, hi) for lo, hi in bounds]


class Details(Mapping[int, EntryDetail]):
    """One rank's kept entries, row -> :class:`EntryDetail`, read from a batch's
    :class:`DetailTable` when asked: ``get`` and ``in`` build one entry; iterating
    keys builds none; ``[]`` and ``items``/``values`` build the rank's whole dict once."""

    __slots__ = ("_dict", "_hi", "_lo", "_table")

    def __init__(self, table: DetailTable, lo: int, hi: int) -> None:
        self._table = table
        self._lo = lo
        self._hi = hi
        self._dict: dict[int, EntryDetail] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # the table is one object in a batch's pickle: stored once for its ranks
        return (Details, (self._table, self._lo, self._hi))

    def _rows(self) -> I8:
        return self._table.cells[self._lo:self._hi, 0]

    def _at(self, row: object) -> int:
        """The table row holding entry ``row``, -1 if none."""
        try:
            row = operator.index(row)  # type: ignore[arg-type]
        except TypeError:
            return -1
        if not _INT64_MIN <= row <= _INT64_MAX:
            return -1
        rows = self._rows()
        i = int(np.searchsorted(rows, row))
        return self._lo + i if i < len(rows) and int(rows[i]) == row else -1

    def whole(self) -> dict[int, EntryDetail]:
        if self._dict is None:
            entry = self._table.entry
            self._dict = {values[0]: entry(values)
                          for values in self._table.cells[self._lo:self._hi].tolist()}
        return self._dict

    def __getitem__(self, row: int) -> EntryDetail:
        return self.whole()[row]

    def get(self, row: int, default: Any = None) -> Any:
        if self._dict is not None:
            return self._dict.get(row, default)
        at = self._at(row)
        return default if at < 0 else self._table.entry(self._table.cells[at].tolist())

    def __contains__(self, row: object) -> bool:
        return row in self._dict if self._dict is not None else self._at(row) >= 0

    def __iter__(self) -> Iterator[int]:
        return iter(self._rows().tolist())

    def __len__(self) -> int:
        return self._hi - self._lo

    def __repr__(self) -> str:
        return f"Details({self.whole()!r})"


I8 = npt.NDArray[np.int64]
I4 = npt.NDArray[np.int32]
U4 = npt.NDArray[np.uint32]
U1 = npt.NDArray[np.uint8]


@dataclass(frozen=True, slots=True)
class RankDigest(HeaderFields):
    """The compact, analyzable form of one rank's dump (see module doc).

    ``header`` is the trace's own :class:`~frforensics.model.DumpHeader` (read
    through as ``d.host`` etc.; ``format`` and ``dump_reason`` as their string
    values), with ``dropped`` raised by :func:`windowed`.
    """

    rank: int
    header: DumpHeader
    groups: tuple[GroupInfo, ...]
    #: the trace's notes and the digest's own (seqs renumbered, ring cut, ...)
    notes: tuple[str, ...]
    # matching columns, one row per entry, oldest first
    group: I4
    seq: I8
    p2p_seq: I8
    peer_seq: I8
    is_p2p: U1
    peer: I4
    op_hash: U4
    dtype_hash: U4
    size: I8  # the numel that must agree across members (-1: not compared)
    state: U1
    t_enqueue_ns: I8
    t_complete_ns: I8
    timeout_ms: I8
    first_record_id: int
    op_names: dict[int, str]
    details: Mapping[int, EntryDetail]
    # call site of every entry: stable hash of its whole stack (0: no frames), and
    # the hash -> user frame ("file:line in function") table; ``numel`` is the input numel of
    # every entry (p2p included), for pairing sends with recvs
    site: U4 | None = None
    sites: dict[int, str] | None = None
    numel: I8 | None = None
    #: row -> the row carrying its coalesced block's state (``coalesced_units``);
    #: ``None``: every row is its own unit
    unit: I8 | None = None
    #: the dump shows GPU progress (a ``started`` entry or a discovered start
    #: time: NCCL's CUDA events); gloo dumps never do
    gpu_states: bool = False
    #: GPU time of each entry's unit in ns (PyTorch's ``duration_ms``: start to end
    #: CUDA event, timing on; a coalesced member takes its closing entry's), -1
    #: where unknown; ``None``: no entry has one
    duration_ns: I8 | None = None
    #: the window starts at a whole unit: the rows were cut by ``windowed``, which
    #: never splits a coalesced block (a ring's own eviction may)
    whole_oldest: bool = False
    #: row -> (elements sent to each member, expected from each), in the group's
    #: member order, for the all_to_all entries whose dump recorded them (our
    #: recorder's ``splits`` column); ``None``: none did
    splits: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] | None = None
    #: the rank's newest op was issued inside a call that always went on to another
    #: op (:func:`stopped_in_call`): ``"where it stopped -> where the call went on"``;
    #: ``None``: not so, or the dump has no stacks
    stopped_in_call: str | None = None

    @property
    def format(self) -> str:
        return self.header.format.value

    @property
    def dump_reason(self) -> str:
        return self.header.dump_reason.value

    def __len__(self) -> int:
        return int(self.seq.shape[0])

    def __reduce__(self) -> tuple[Any, ...]:
        # Digests travel from the decoding workers to the main process, which
        # receives every rank's: the columns go as one buffer (numpy rebuilds each
        # array through a Python function otherwise) and the details as plain
        # tuples, ~45 us per rank less to unpickle (of ~160)
        values: list[Any] = [getattr(self, name) for name in _DIGEST_FIELDS]
        layout: list[tuple[int, str, int, int]] = []
        chunks: list[bytes] = []
        offset = 0
        placed: dict[int, tuple[int, int]] = {}  # id(array) -> (count, offset): shared
        for i, v in enumerate(values):
            if isinstance(v, np.ndarray) and v.ndim == 1 and not v.dtype.hasobject:
                at = placed.get(id(v))
                if at is not None:  # the same array in two fields (``compact``)
                    layout.append((i, _dtype_name(v.dtype), *at))
                    values[i] = None
                    continue
                # a one-value column (``compact``): its value once, count negated
                const = len(v) > 1 and v.strides[0] == 0
                data = v[:1].tobytes() if const else v.tobytes()
                count = -len(v) if const else len(v)
                placed[id(v)] = (count, offset)
                layout.append((i, _dtype_name(v.dtype), count, offset))
                chunks.append(data)
                pad = -len(data) % 8  # every column aligned
                if pad:
                    chunks.append(bytes(pad))
                offset += len(data) + pad
                values[i] = None
        details = values[_DETAILS_AT]
        if not isinstance(details, Details):  # a Details pickles as its batch's table
            values[_DETAILS_AT] = (tuple(details), tuple(tuple(e) for e in details.values()))
        return (_rebuild_digest, (tuple(values), tuple(layout), b"".join(chunks)))

    @property
    def newest_time_ns(self) -> int:
        """Newest timestamp in this dump (enqueue or completion), 0 if none."""
        newest = 0
        if len(self):
            newest = max(int(self.t_enqueue_ns.max()), int(self.t_complete_ns.max()))
        return max(newest, self.dump_time_ns or 0)

    def detail(self, row: int) -> EntryDetail | None:
        """Full detail of entry ``row`` when the digest kept it."""
        return self.details.get(row)

    def pending_rows(self) -> npt.NDArray[np.intp]:
        """Rows of entries that had not completed (oldest first).

        A failed op counts: the rank was still waiting in it when it failed (a
        timeout, or a peer's connection lost).
        """
        return np.flatnonzero(self.state != OpState.COMPLETED)

    def unit_of(self, row: int) -> int:
        """The row that carries ``row``'s coalesced block's state (``row`` itself if none)."""
        return row if self.unit is None else int(self.unit[row])

    def stuck_at(self) -> str | None:
        """Where the main thread was at dump time (user frame), if known."""
        for thread in self.threads:
            if thread.is_main:
                frame = user_frame(thread.frames)
                return None if frame is None else str(frame)
        return None


_DIGEST_FIELDS: Final = tuple(f.name for f in fields(RankDigest))
_DETAILS_AT: Final = _DIGEST_FIELDS.index("details")
_ARRAY_FIELDS: Final = ("group", "seq", "p2p_seq", "peer_seq", "is_p2p", "peer", "op_hash",
                        "dtype_hash", "size", "state", "t_enqueue_ns", "t_complete_ns",
                        "timeout_ms", "site", "numel", "unit", "duration_ns")
_DTYPE_NAMES: dict[np.dtype[Any], str] = {}
_DTYPES: dict[str, np.dtype[Any]] = {}
_new_detail = functools.partial(tuple.__new__, EntryDetail)


def _dtype_name(dtype: np.dtype[Any]) -> str:
    # one str object per dtype: a batch's pickle then stores each name once
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype.str
    return name


def _rebuild_digest(values: tuple[Any, ...], layout: tuple[tuple[int, str, int, int], ...],
                    blob: bytes) -> RankDigest:
    """A :class:`RankDigest` from its ``__reduce__``; the columns are writable, as
    unpickled arrays are, but one-value columns (``compact``): read-only views."""
    buf = bytearray(blob)
    out = list(values)
    for i, name, count, offset in layout:
        dtype = _DTYPES.get(name)
        if dtype is None:
            dtype = _DTYPES[name] = np.dtype(name)
        if count < 0:  # one value for every row (``compact``), read-only as broadcast_to's
            # (a stride-0 array over the one value: 1 us against broadcast_to's 4)
            one = np.ndarray((-count,), dtype, buf, offset, (0,))
            one.flags.writeable = False
            out[i] = one
        else:
            out[i] = np.frombuffer(buf, dtype, count, offset)
    if not isinstance(out[_DETAILS_AT], Details):
        rows, details = out[_DETAILS_AT]
        out[_DETAILS_AT] = dict(zip(rows, map(_new_detail, details), strict=True))
    return RankDigest(*out)


def ranks_with_other(digests: Sequence[RankDigest], name: str, value: int = 0, *,
                     same: bool = False) -> npt.NDArray[np.bool_]:
    """Per digest: whether column ``name`` holds a value other than ``value`` (with
    ``same``: the value itself). One pass over every digest's rows; a one-value
    column (:func:`compact`) is read by its value."""
    cols = [getattr(d, name) for d in digests]
    # a plain int: a numpy scalar compared with an IntEnum member (``OpState``)
    # costs ~7 us against ~1.7 (numpy probes the enum class for array protocols)
    value = int(value)
    n = len(cols)
    out = np.zeros(n, dtype=np.bool_)
    if not n:
        return out
    # which columns are one value (stride 0) and their values, read in bulk: a
    # numpy comparison and store per one-value digest was ~1.2 us (0.12 s a call at
    # 100,000 ranks, five calls per analysis), the bulk form ~0.5 us
    sizes = np.fromiter(map(len, cols), dtype=np.int64, count=n)
    flat = np.fromiter((c.strides[0] == 0 for c in cols), dtype=np.bool_, count=n) & (sizes > 1)
    one = np.flatnonzero(flat).tolist()
    if one:
        firsts = np.fromiter((cols[i][0] for i in one), dtype=cols[one[0]].dtype, count=len(one))
        out[one] = (firsts == value) == same
    varying = np.flatnonzero(~flat & (sizes > 0)).tolist()
    if varying:
        rows = np.concatenate([cols[i] for i in varying])
        hit = rows == value if same else rows != value
        del rows
        # every segment holds a row: its start is within the column
        part = sizes[varying]
        out[varying] = np.logical_or.reduceat(hit, np.cumsum(part) - part)
    return out


def compact(d: RankDigest, *, columns: bool = True) -> RankDigest:
    """``d`` with each column whose rows all hold one value as a read-only view of
    that value (stride 0), and ``numel`` as ``size`` where they are equal: a job's
    dumps repeat most columns (p2p columns of a job without p2p, one timeout, one
    state), and the main process holds every rank's digest (16,384 ranks: 3.4 GB
    before). Values and dtypes are unchanged; nothing writes into a digest.
    ``columns=False``: the caller made the one-value views (``wire``), ``numel`` only."""
    changes: dict[str, Any] = {}
    for name in _ARRAY_FIELDS if columns else ():
        v = getattr(d, name)
        if isinstance(v, np.ndarray) and v.ndim == 1 and len(v) > 1 and v.strides[0] != 0 \
                and bool((v == v[0]).all()):
            changes[name] = np.broadcast_to(v[:1].copy(), v.shape)
    size, numel = changes.get("size", d.size), changes.get("numel", d.numel)
    if numel is not None and numel.dtype == size.dtype and np.array_equal(numel, size):
        changes["numel"] = size
    return replace(d, **changes) if changes else d


def _cut_column(v: npt.NDArray[Any], start: int) -> npt.NDArray[Any]:
    """Rows ``start:`` of a digest column, one-value columns kept as such."""
    if len(v) > 1 and v.strides[0] == 0:
        return np.broadcast_to(v[:1], (len(v) - start,))
    return np.ascontiguousarray(v[start:])


#: profiling names of the entry that closes a coalesced block: ``endCoalescing``
#: records "nccl:coalesced", or "nccl:<OPTYPE>_coalesced" for the uneven
#: all_gather / reduce_scatter paths (docs/native-format.md)
CLOSING_OPS: Final = frozenset({"coalesced", "ALLGATHER_coalesced", "REDUCE_SCATTER_coalesced"})
_CLOSING_HASHES: Final = np.array(sorted(str_hash(x) for x in CLOSING_OPS), dtype=np.uint32)


_CLOSING_SET: Final = frozenset(_CLOSING_HASHES.tolist())


def closing_rows(op_hash: U4) -> npt.NDArray[np.bool_]:
    """Where ``op_hash`` is a closing entry's (``CLOSING_OPS``): one comparison per
    closing op (``np.isin`` sorts, ~3x slower on a ring)."""
    out: npt.NDArray[np.bool_] = op_hash == _CLOSING_HASHES[0]
    for h in _CLOSING_HASHES[1:]:
        out |= op_hash == h
    return out


def coalesced_units(group: npt.NDArray[np.int32], seq: I8, p2p_seq: I8, is_p2p: U1,
                    op_hash: U4, state: U1,
                    closing: npt.NDArray[np.bool_] | None = None) -> tuple[I8 | None, U1, U1]:
    """Each row's unit, the effective states and the effective p2p flags.

    A coalesced block is its members followed by one closing entry
    (``CLOSING_OPS``) that carries the block's state; members are recorded
    without CUDA events and stay ``scheduled``. PyTorch bumps the block's seq
    once, so members and closing entry share it: ``collective_seq_id`` for a
    block of collectives, ``p2p_seq_id`` for a p2p batch. The closing entry of
    a p2p batch says ``is_p2p=False`` and carries the last *collective* seq
    (``initWork`` derives the flag from ``OpType::COALESCED``): it is taken as
    p2p here when the entry before it in its group is a p2p op of the same
    ``p2p_seq_id``, so it never poses as a collective.

    Returns ``(unit, state, is_p2p)``: ``unit[row]`` is the closing row of the
    row's block (``row`` itself if none), members take their closing entry's
    state. ``unit`` is ``None`` when the dump holds no closing entry.
    ``closing``: ``closing_rows(op_hash)``, where the caller has it.
    """
    if closing is None:
        closing = closing_rows(op_hash)
    n = len(state)
    if n == 0 or not closing.any():
        return None, state, is_p2p
    rows = np.arange(n, dtype=np.int64)
    p2p = _effective_p2p(group, p2p_seq, is_p2p, closing)
    key = np.where(p2p, p2p_seq, seq)
    order = np.lexsort((rows, key, p2p, group))
    g, k, kk = group[order], p2p[order], key[order]
    new_run = np.r_[True, (g[1:] != g[:-1]) | (k[1:] != k[:-1]) | (kk[1:] != kk[:-1])]
    starts = np.flatnonzero(new_run)
    run = np.cumsum(new_run) - 1
    # the last closing row of each run (-1: the run has none)
    close_row = np.maximum.reduceat(np.where(closing[order], order, -1), starts)
    carrier = close_row[run]
    unit = rows.copy()
    has = carrier >= 0
    unit[order[has]] = carrier[has]
    effective = state[unit]
    return (unit, np.ascontiguousarray(effective, dtype=np.uint8),
            np.ascontiguousarray(p2p, dtype=np.uint8))


def _effective_p2p(group: npt.NDArray[np.int32], p2p_seq: I8, is_p2p: U1,
                   closing: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
    """``is_p2p``, with the closing entry of every p2p batch taken as p2p.

    The closing entry of a ``batch_isend_irecv`` says ``is_p2p=False``
    (``initWork`` derives the flag from ``OpType::COALESCED``); it is the batch's
    when the entry before it in its group is a p2p op of the same ``p2p_seq_id``.
    """
    p2p = is_p2p.astype(bool)
    if not closing.any():
        return p2p
    n = len(p2p)
    rows = np.arange(n, dtype=np.int64)
    # the previous row of the same group, for each closing row
    by_group = np.lexsort((rows, group))
    prev = np.full(n, -1, dtype=np.int64)
    same = group[by_group[1:]] == group[by_group[:-1]]
    prev[by_group[1:][same]] = by_group[:-1][same]
    close_rows = np.flatnonzero(closing)
    before = prev[close_rows]
    p2p_close = close_rows[(before >= 0) & p2p[np.maximum(before, 0)]
                           & (p2p_seq[np.maximum(before, 0)] == p2p_seq[close_rows])]
    p2p = p2p.copy()
    p2p[p2p_close] = True
    return p2p


def _rooted(trace: RankTrace, op: str, rows: npt.NDArray[np.intp], size: I8,
            dtype_hash: U4) -> None:
    """Size and dtype of rooted entries at ``rows`` from their compared side
    (``compared_side``), in place; -1 (not compared) where neither side is one
    tensor. Each distinct (inputs, outputs) dtype pair is decided once."""
    e = trace.entries
    pairs: dict[tuple[int, int, bool], tuple[int, int]] = {}
    for row in rows.tolist():
        smaller_in = bool(e.in_numel[row] <= e.out_numel[row])
        key = (int(e.in_dtypes[row]), int(e.out_dtypes[row]), smaller_in)
        hit = pairs.get(key)
        if hit is None:
            ins, outs = trace.string(key[0]), trace.string(key[1])
            side = compared_side(op, ins, outs, 0, 0 if smaller_in else -1)
            hit = pairs[key] = (side, str_hash(compared_dtypes(op, ins, outs, side)))
        side, dtype = hit
        dtype_hash[row] = DTYPE_UNCHECKED if side < 0 else dtype
        size[row] = (-1 if side < 0 else int(e.in_numel[row]) if side == 0
                     else int(e.out_numel[row]))


#: the member op of each typed closing entry (NCCL's uneven all_gather and
#: reduce_scatter: ``_broadcast_oop`` / ``_reduce_oop`` members, docs/native-format.md)
_MEMBER_OF: Final = {"ALLGATHER_coalesced": "_broadcast_oop",
                     "REDUCE_SCATTER_coalesced": "_reduce_oop"}


def _units_in_order(trace: RankTrace, rows: npt.NDArray[np.intp],
                    closing: npt.NDArray[np.bool_]) -> I8:
    """Record-order numbers (1, 2, ...) of a group's collectives ``rows`` whose
    seqs carry no order: a coalesced block takes one number, as PyTorch bumps
    ``seqCollective_`` once per block.

    A block is a closing entry and the run of entries right before it that are
    its members: the typed closings' member op (``_MEMBER_OF``), or for a plain
    ``coalesced`` the op of the entry just before it (``_coalescing_manager``
    blocks hold one kind of op). A lone op of the same kind right before such a
    block reads as a member: the ranks' records agree on it either way.
    """
    e = trace.entries
    names = [trace.string(int(i)) for i in e.op[rows].tolist()]
    is_close = closing[rows].tolist()
    block_start = np.arange(len(rows), dtype=np.int64)
    i = len(rows) - 1
    while i >= 0:
        if is_close[i]:
            member = _MEMBER_OF.get(names[i], names[i - 1] if i > 0 else "")
            j = i
            while j > 0 and not is_close[j - 1] and names[j - 1] == member:
                j -= 1
            block_start[j:i + 1] = j
            i = j - 1
        else:
            i -= 1
    return np.cumsum(block_start == np.arange(len(rows), dtype=np.int64)).astype(np.int64)


def _record_order_seqs(trace: RankTrace, seq: I8, op_hash: U4,
                       closing: npt.NDArray[np.bool_]) -> tuple[I8, tuple[str, ...]]:
    """Collective seqs, numbered by record order in groups whose seqs never increase.

    Some hand-made and older dumps write ``collective_seq_id`` 0 (or one constant)
    for every collective: matching by seq would pair everything with
    everything. There the k-th collective of the group is numbered k (counting
    from the ring's first entry, so a ring that evicted entries is misaligned:
    the note says so).

    Not every shared seq means that. PyTorch bumps ``seqCollective_`` once per
    coalesced block, so a ring whose window on a group holds a single block (its
    members and one closing entry, last) legitimately shows one seq; and the
    closing entry of a p2p batch says ``is_p2p=False`` with the unchanged last
    collective seq (``coalesced_units``), so it is no collective of its group.
    """
    e = trace.entries
    coll = ~_effective_p2p(e.pg, e.p2p_seq, e.is_p2p, closing)
    notes: list[str] = []
    out = np.ascontiguousarray(seq)
    for local in np.unique(e.pg[coll]).tolist():
        rows = np.flatnonzero(coll & (e.pg == local))
        if int(seq[rows].min()) != int(seq[rows].max()):
            continue
        # PyTorch's first collective seq is 1 (the counter is bumped before the
        # record), so a 0 carries no order even on a single entry
        zero = int(seq[rows[0]]) == 0
        if len(rows) < 2 and not zero:
            continue
        numbers = _units_in_order(trace, rows, closing)
        if int(numbers[-1]) == 1 and not zero:
            continue  # one coalesced block (or what eviction left of it)
        if out is seq:
            out = seq.copy()
        out[rows] = numbers
        name = trace.groups[local].name if 0 <= local < len(trace.groups) else str(local)
        notes.append(f"group {name[:40]}: collective_seq_id never increases ({len(rows)} entries "
                     f"say {int(seq[rows[0]])}): collectives matched by record order"
                     + (" (this ring evicted entries, so the order may be shifted)"
                        if trace.dropped or (len(e) and int(e.record_id[0]) > 0) else ""))
    return out, tuple(notes)


def _details(trace: RankTrace, rows: list[int], state: U1, is_p2p: U1,
             seq: I8) -> dict[int, EntryDetail]:
    """:class:`EntryDetail` of ``rows`` (sorted): each column read once for all rows."""
    if not rows:
        return {}
    e = trace.entries
    s = trace.string
    idx = np.asarray(rows, dtype=np.int64)

    def col(values: npt.NDArray[Any]) -> list[Any]:
        return values[idx].tolist()  # type: ignore[no-any-return]

    def text(values: npt.NDArray[Any]) -> list[str]:
        return [s(i) for i in values[idx].tolist()]

    locations: dict[int, str | None] = {}
    stacks = col(e.stack)
    for stack in set(stacks):
        frame = user_frame(trace.stack(stack))
        locations[stack] = None if frame is None else str(frame)
    columns = zip(
        rows, col(e.record_id), col(e.pg), col(seq), col(e.p2p_seq), col(e.peer_seq),
        text(e.op), col(is_p2p), col(e.peer), col(e.root), text(e.in_shapes),
        text(e.out_shapes), text(e.in_dtypes), text(e.out_dtypes), text(e.reduce_op),
        col(state), col(e.t_enqueue_ns), col(e.t_start_ns), col(e.t_complete_ns),
        col(e.timeout_ms), text(e.thread), stacks, strict=True)
    return {
        row: EntryDetail(row, rid, pg, sq, p2p, pseq, op, bool(p), peer, root, ins, outs,
                         idt, odt, red, OpState(st), t0, t1, t2, tmo, thread,
                         trace.stack(stack), locations[stack])
        for (row, rid, pg, sq, p2p, pseq, op, p, peer, root, ins, outs, idt, odt, red, st,
             t0, t1, t2, tmo, thread, stack) in columns
    }


#: Said of a PyTorch gloo dump whose ``pg_status`` counts ops its entries lack.
UNRECORDED_P2P_NOTE = (
    "ran point-to-point ops (send/recv) that PyTorch's gloo flight recorder does not "
    "record (pg_status counts them, the entries lack them): a fault in them, such as "
    "a pipeline stage that stops sending or runs slow, cannot be seen in these dumps")


def _unrecorded_note(trace: RankTrace) -> tuple[str, ...]:
    """The abstention a reader must see where the dump cannot show p2p traffic
    (``formats.native._unrecorded_ops``; torch-2.13-facts.md: gloo records no
    send/recv yet advances ``last_enqueued_collective`` for them)."""
    return (UNRECORDED_P2P_NOTE,) if trace.unrecorded_ops > 0 else ()


def digest(trace: RankTrace, *, rank: int, tail: int = DEFAULT_TAIL,
           window: int | None = None) -> RankDigest:
    """Reduce ``trace`` to its :class:`RankDigest` (``rank`` already resolved).

    ``window``: keep the columns of only the newest ``window`` entries (and every
    entry from the earliest unfinished one on), as if the ring held that many
    (:func:`windowed`); ``None`` keeps the whole ring.
    """
    e = trace.entries
    n = len(e)
    hashes = np.fromiter((str_hash(x) for x in trace.strings), dtype=np.uint32,
                         count=len(trace.strings))
    lookup = np.append(hashes, np.uint32(0))  # index -1 (NO_INDEX) -> hash 0

    def hashed(col: npt.NDArray[np.int32]) -> U4:
        idx = np.where((col >= 0) & (col < len(hashes)), col, len(hashes))
        return lookup[idx]

    op_hash = hashed(e.op)
    size = e.in_numel.copy()
    dtype_hash = hashed(e.in_dtypes)
    op_names: dict[int, str] = {}
    for i in np.unique(e.op).tolist():
        name = trace.string(int(i))
        op_names[str_hash(name) if name else 0] = name
        if name in SIZE_FROM_OUTPUT:
            size[e.op == i] = e.out_numel[e.op == i]
        elif name in _SIZE_UNCHECKED:
            size[e.op == i] = -1
        elif name in ROOTED_OPS:
            _rooted(trace, name, np.flatnonzero(e.op == i), size, dtype_hash)
    size[e.is_p2p.astype(bool)] = -1

    # a call site is the whole stack (two call paths may share their user frame);
    # reports show its user frame
    stack_ids = [str_hash("|".join(map(str, frames))) for frames in trace.stacks]
    site_lookup = np.append(np.asarray(stack_ids, dtype=np.uint32), np.uint32(0))
    sites: dict[int, str] = {}
    for sid, frames in zip(stack_ids, trace.stacks, strict=True):
        frame = user_frame(frames)
        if frame is not None:
            sites[sid] = str(frame)
    site = site_lookup[np.where((e.stack >= 0) & (e.stack < len(trace.stacks)), e.stack,
                                len(trace.stacks))]

    # (the rows of closing entries, once: np.isin was ~20 us a call, three a rank)
    # (op_names is keyed by every op hash of the ring)
    closing = (closing_rows(op_hash) if not _CLOSING_SET.isdisjoint(op_names)
               else np.zeros(n, dtype=np.bool_))
    seq, order_notes = _record_order_seqs(trace, e.seq, op_hash, closing)
    unit, state, is_p2p = coalesced_units(e.pg, seq, e.p2p_seq, e.is_p2p, op_hash, e.state,
                                          closing)
    if unit is not None:
        size[closing] = 0  # no tensors of its own: the block's size is its members'
        size[is_p2p.astype(bool)] = -1
    # NCCL stamps states from CUDA events at dump time; gloo only retires
    gpu_states = bool(any(g.backend == "nccl" for g in trace.groups)
                      or (e.state == OpState.STARTED).any() or (e.t_start_ns > 0).any())
    duration: I8 | None = None
    if n and int(e.duration_ns.max()) >= 0:
        duration = np.ascontiguousarray(e.duration_ns if unit is None else e.duration_ns[unit])
    keep = set(range(max(0, n - tail), n))
    keep.update(np.flatnonzero(state != OpState.COMPLETED).tolist())
    details = _details(trace, sorted(keep), state, is_p2p, seq)
    out = RankDigest(
        rank=rank,
        header=trace.header,
        groups=trace.groups,
        notes=(*trace.notes, *order_notes, *_unrecorded_note(trace)),
        group=np.ascontiguousarray(e.pg),
        seq=seq,
        p2p_seq=np.ascontiguousarray(e.p2p_seq),
        peer_seq=np.ascontiguousarray(e.peer_seq),
        is_p2p=is_p2p if unit is not None else np.ascontiguousarray(e.is_p2p),
        peer=np.ascontiguousarray(e.peer),
        op_hash=op_hash,
        dtype_hash=dtype_hash,
        size=size,
        state=state if unit is not None else np.ascontiguousarray(e.state),
        t_enqueue_ns=np.ascontiguousarray(e.t_enqueue_ns),
        t_complete_ns=np.ascontiguousarray(e.t_complete_ns),
        timeout_ms=np.ascontiguousarray(e.timeout_ms),
        first_record_id=int(e.record_id[0]) if n else 0,
        op_names=op_names,
        details=details,
        site=site,
        sites=sites,
        numel=np.ascontiguousarray(e.in_numel),
        unit=unit,
        gpu_states=gpu_states,
        duration_ns=duration,
        splits=_splits(trace),
        stopped_in_call=stopped_in_call(trace),
    )
    out = compact(out)
    return out if window is None else windowed(out, window, e.record_id)


#: earlier calls from the newest op's call site that :func:`stopped_in_call` needs
MID_CALL_MIN: Final = 2


def _call_of(frames: tuple[Frame, ...]) -> tuple[Frame | None, tuple[Any, ...]]:
    """The user frame of a stack (innermost outside torch) and the call it is in:
    its function and file with every outer frame (``None`` frame: no user frame)."""
    for i, frame in enumerate(frames):
        if not is_library_file(frame.file):
            return frame, (frame.file, frame.name, frames[i + 1:])
    return None, ()


def stopped_in_call(trace: RankTrace) -> str | None:
    """Whether the rank's newest entry was issued inside a function call that, every
    earlier time, went on to issue another op (issue 29: a framework's ``_sync_ddp``
    issues a barrier, then an all_reduce). Every earlier entry with the newest one's
    whole stack (at least ``MID_CALL_MIN``) must be followed, as the rank's next entry,
    by one issued from the same call — the same function and the same callers, at a
    later line. A program that ran to its end returns from its calls; one that stopped
    in the middle of one failed there, or was stopped (``missing_dump``'s use of it).
    Returns ``"<where it stopped> -> <where the call went on>"``, or ``None``."""
    stack = trace.entries.stack
    n = len(stack)
    last = int(stack[-1]) if n else -1
    if n < MID_CALL_MIN + 1 or not 0 <= last < len(trace.stacks):
        return None
    frame, call = _call_of(trace.stack(last))
    earlier = np.flatnonzero(stack[:-1] == last)
    if frame is None or len(earlier) < MID_CALL_MIN:
        return None
    went_on: set[Frame] = set()
    for nxt in np.unique(stack[earlier + 1]).tolist():
        if not 0 <= nxt < len(trace.stacks):
            return None
        then, then_call = _call_of(trace.stack(int(nxt)))
        if then is None or then_call != call or then.line <= frame.line:
            return None
        went_on.add(then)
    return f"{frame} -> {', '.join(sorted(map(str, went_on)))}"


#: the most members a recorded split list may name (a longer one is not read)
_MAX_SPLIT_MEMBERS: Final = 1 << 17
#: split counts one digest keeps at most (distinct lists, newest rows first): a dump
#: of 64 KiB split strings on every row must not grow 15-fold in memory, times every
#: rank; 16,384 is 128 uneven all_to_alls of a 64-member expert group
_MAX_SPLIT_VALUES: Final = 1 << 14


def _splits(trace: RankTrace) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]] | None:
    """The ``splits`` column parsed (``model.ENTRY_COLUMNS``), text from an untrusted
    dump: a list that is not two comma-separated runs of non-negative integers of one
    length, at most ``_MAX_SPLIT_MEMBERS``, is left out."""
    col = trace.entries.splits
    rows = np.flatnonzero(col >= 0)
    if not len(rows):
        return None
    parsed: dict[int, tuple[tuple[int, ...], tuple[int, ...]] | None] = {}
    out: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    budget = _MAX_SPLIT_VALUES
    for row, index in zip(rows[::-1].tolist(), col[rows[::-1]].tolist(), strict=True):
        if index not in parsed:
            if budget <= 0:
                break  # older rows' splits are not kept
            value = parsed[index] = _parse_splits(trace.string(index))
            budget -= 0 if value is None else 2 * len(value[0])
        value = parsed[index]
        if value is not None:
            out[row] = value
    return dict(sorted(out.items())) or None


def _parse_splits(text: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    send, sep, recv = text.partition("|")
    if not sep or len(text) > 24 * _MAX_SPLIT_MEMBERS:
        return None
    try:
        a = tuple(int(x) for x in send.split(","))
        b = tuple(int(x) for x in recv.split(","))
    except ValueError:
        return None
    if len(a) != len(b) or not a or min(a) < 0 or min(b) < 0:
        return None
    return a, b


def windowed(d: RankDigest, window: int, record_id: I8 | None = None) -> RankDigest:
    """``d`` cut to its newest ``window`` entries, as a ring of that size would hold.

    The cut never drops an unfinished entry (it starts at the earliest one when
    that is older) nor splits a coalesced block (members stay with their closing
    entry). What is cut counts as evicted (``dropped``, ``first_record_id``), so
    the analyzer treats the rank as it treats a ring that overflowed: the oldest
    kept seq of each group is not compared. Every per-entry numpy column is cut,
    details of cut rows dropped and rows renumbered.
    """
    n = len(d)
    if window < 1 or n <= window:
        return d
    start = n - window
    unfinished = np.flatnonzero(d.state != OpState.COMPLETED)
    if len(unfinished):
        start = min(start, int(unfinished[0]))
    if d.unit is not None:
        # a member before the cut whose closing row is kept moves the cut back
        rows = np.arange(start, dtype=np.int64)
        split = np.flatnonzero(d.unit[:start] >= start)
        if len(split):
            start = int(rows[split[0]])
    if start <= 0:
        return d
    cut: dict[str, object] = {}
    for f in fields(d):
        value = getattr(d, f.name)
        if isinstance(value, np.ndarray) and value.shape == (n,):
            cut[f.name] = _cut_column(value, start)
    if d.unit is not None:
        cut["unit"] = np.ascontiguousarray(d.unit[start:] - start)
    cut["details"] = {row - start: det._replace(row=row - start)
                      for row, det in d.details.items() if row >= start}
    if d.splits is not None:
        cut["splits"] = {row - start: v for row, v in d.splits.items() if row >= start} or None
    first = (int(record_id[start]) if record_id is not None and len(record_id) == n
             else d.first_record_id + start)
    return compact(replace(d, header=replace(d.header, dropped=d.dropped + start),
                   first_record_id=first, whole_oldest=True,
                   notes=(*d.notes, f"ring cut to its newest {window} entries (--window {window}; "
                          "from the earliest unfinished one if older): older entries "
                          "count as evicted"),
                   **cut))  # type: ignore[arg-type]
