"""Signature pass: compare every group's collectives across its members.

Computed once, before the detectors (which only read it): for every process
group, every member's collectives are reduced to one row per seq (a coalesced
unit's entries are combined), all members' rows are sorted by seq, and each seq
whose members disagree on op, dtype or size is a mismatch. Only the *first*
mismatched seq of a group is kept per field: after one rank desyncs, every later
seq compares different calls. A ring that evicted entries may have cut its
oldest coalesced block in two, so a rank's oldest seq in such a window is not
compared when it may be a cut block (``_maybe_cut``); a single plain
collective there (nothing to cut), or a block whose consecutive records follow
an older record the ring still holds, is; so is every oldest unit of a window
cut by ``--window`` (``whole_oldest``: that cut never splits a block).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from frforensics.analyzer.digest import _CLOSING_HASHES, CLOSING_OPS, DTYPE_UNCHECKED
from frforensics.analyzer.merge import CollectiveRows, JobModel, collective_rows

Field = Literal["op", "dtype", "size", "splits"]

__all__ = ["Field", "Mismatch", "find_mismatches", "units"]


@dataclass(frozen=True, slots=True)
class Mismatch:
    """Members disagree at one seq of one group."""

    gid: int
    seq: int
    field: Field
    values: dict[int, str]  # rank -> what it used (op name, dtype, numel)
    later: int  # how many later seqs of the group also mismatch on this field
    raw: dict[int, int]  # rank -> the compared value (hash or numel)
    #: field "splits" (``analyzer.splits``): the culprits the pairwise rule chose, the
    #: disagreeing pairs (``SplitPair``) and why those ranks
    culprits: tuple[int, ...] | None = None
    pairs: tuple[Any, ...] = ()
    reason: str = ""


def units(job: JobModel, rank: int, gid: int) -> tuple[npt.NDArray[np.int64], ...] | None:
    view = job.view(rank, gid)
    if view is None or len(view.coll_rows) == 0:
        return None
    d = job.digests[rank]
    rows = _program_order(job, rank, gid, view.coll_rows)
    if len(rows) == 0:
        return None
    if job.window_evicted(rank) and not d.whole_oldest \
            and _maybe_cut(job, rank, rows, view.min_seq):
        rows = rows[d.seq[rows] != view.min_seq]
        if len(rows) == 0:
            return None
    seq = d.seq[rows]
    op = d.op_hash[rows].astype(np.int64)
    dtype = _dtypes(d.dtype_hash[rows])
    size = d.size[rows]
    order = np.argsort(seq, kind="stable")
    seq, op, dtype, size = seq[order], op[order], dtype[order], size[order]
    starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    if len(starts) != len(seq):  # coalesced units: combine their entries
        # order-aware sum (the k-th entry weighted 2k+1): XOR would cancel two
        # members with the same op or dtype, hiding a rank whose block is all Float
        # where its peers' is all BFloat16; one-entry units keep their own hash
        pos = np.arange(len(seq)) - np.repeat(starts, np.diff(np.r_[starts, len(seq)]))
        weight = (2 * pos + 1).astype(np.uint64)
        op = np.add.reduceat(op.astype(np.uint64) * weight, starts).view(np.int64)
        dtype = _combine_dtypes(dtype, weight, starts)
        unchecked = np.minimum.reduceat(size, starts) < 0
        size = np.where(unchecked, -1, np.add.reduceat(size, starts))
        seq = seq[starts]
    ranks = np.full(len(seq), rank, dtype=np.int64)
    return seq, ranks, op, dtype, size


def _program_order(job: JobModel, rank: int, gid: int,
                   rows: npt.NDArray[np.intp]) -> npt.NDArray[np.intp]:
    """``rows`` less what is not the program's order (``analyzer.frontiers``): the
    rank's error path (rows after its first failed op) and seqs beyond the group's
    lowest frontier."""
    stop = job.error_from.get(rank)
    if stop is not None:
        rows = rows[rows < stop]
    limit = job.frontier_limit.get(gid)
    if limit is not None:
        rows = rows[job.digests[rank].seq[rows] <= limit]
    return rows


def _dtypes(hashes: npt.NDArray[np.uint32]) -> npt.NDArray[np.int64]:
    """Dtype hashes as int64, -1 where not compared (``DTYPE_UNCHECKED``)."""
    out = hashes.astype(np.int64)
    out[hashes == DTYPE_UNCHECKED] = -1
    return out


def _combine_dtypes(dtype: npt.NDArray[np.int64], weight: npt.NDArray[np.uint64],
                    starts: npt.NDArray[np.intp]) -> npt.NDArray[np.int64]:
    """One dtype value per coalesced unit (order-aware sum); -1 when any member's
    dtype is not compared. A sum is kept non-negative (63 bits): -1 stays unique."""
    combined = np.add.reduceat(dtype.astype(np.uint64) * weight, starts)
    out = (combined & np.uint64((1 << 63) - 1)).view(np.int64)
    out[np.minimum.reduceat(dtype, starts) < 0] = -1
    return out


def _maybe_cut(job: JobModel, rank: int, rows: npt.NDArray[np.intp], seq: int) -> bool:
    """Whether the unit at ``seq`` (the oldest of ``rank``'s window on a group)
    may have lost entries to the ring's eviction.

    Eviction drops the oldest records, so only the group's oldest unit can be
    cut, and only a unit of several entries: a coalesced block records its
    members one after another, then its closing entry (``endCoalescing``), so
    what eviction leaves of a block is its tail, closing entry included. The
    unit is whole when either

    * it is a single entry that is not a closing entry (a plain collective; in a
      dump without closing entries, only where no seq of the group holds
      several entries), or
    * its entries are consecutive records and the ring still holds a record
      older than its first: its earlier members, recorded right before, would
      have been kept too (a block interleaved with another thread's records is
      not consecutive, and stays uncompared).
    """
    d = job.digests[rank]
    at = rows[d.seq[rows] == seq]
    if len(at) == 0:
        return False
    closing = d.op_names.get(int(d.op_hash[at[-1]]), "") in CLOSING_OPS
    if len(at) == 1 and not closing:
        if d.unit is not None:
            return False
        seqs = d.seq[rows]
        # strictly increasing in record order (the usual case) is unique without a
        # sort: np.unique per (rank, group) was 2 s of a 16,384-rank analysis
        if len(seqs) < 2 or bool(np.all(seqs[1:] > seqs[:-1])) \
                or len(np.unique(seqs)) == len(seqs):
            return False
    if len(at) == 1 and closing:
        return True  # a closing entry whose members are gone
    return int(at[0]) == 0 or bool(np.any(np.diff(at) != 1))


def find_mismatches(job: JobModel) -> tuple[Mismatch, ...]:
    """Every group's first mismatch per field (op, then size, then dtype).

    All groups in one numpy pass over every rank's collectives
    (``merge.collective_rows``, whose rows of a seq come in the group's member
    order whatever order the group lists its members in; the tests hold the
    group-by-group form as their oracle)."""
    c = collective_rows(job)
    # whole groups at a time: the per-row temporaries of one slice, not of every
    # row (at 16,384 ranks they were 3.1 GB at once)
    columns = tuple(c.getter(name) for name in ("op_hash", "dtype_hash", "size"))
    keep = _uncut(job, c, columns[0])
    keep = _in_program_order(job, c, keep)
    if len(c.seq) == 0:
        return ()
    found: list[Mismatch] = []
    for order in c.ordered(keep):
        found += _slice_mismatches(job, c, order, columns)
    return tuple(found)


def _slice_mismatches(job: JobModel, c: CollectiveRows, order: npt.NDArray[Any],
                      columns: tuple[Callable[[npt.NDArray[Any]], npt.NDArray[Any]], ...],
                      ) -> tuple[Mismatch, ...]:
    """``find_mismatches`` over the rows ``order`` (whole groups, sorted)."""
    # by (group, seq), then member order, then record order
    seq, gid, at = c.seq[order], c.gid[order], c.at[order]
    op = columns[0](order).astype(np.int64)
    dtype = _dtypes(columns[1](order))
    size = columns[2](order).astype(np.int64, copy=False)
    n = len(seq)
    ustarts = np.flatnonzero(np.r_[True, (gid[1:] != gid[:-1]) | (seq[1:] != seq[:-1])
                                   | (at[1:] != at[:-1])])
    if len(ustarts) != n:  # coalesced units: combined as ``units`` does
        pos = np.arange(n) - np.repeat(ustarts, np.diff(np.r_[ustarts, n]))
        weight = (2 * pos + 1).astype(np.uint64)
        op = np.add.reduceat(op.astype(np.uint64) * weight, ustarts).view(np.int64)
        dtype = _combine_dtypes(dtype, weight, ustarts)
        unchecked = np.minimum.reduceat(size, ustarts) < 0
        size = np.where(unchecked, -1, np.add.reduceat(size, ustarts))
        seq, gid, at = seq[ustarts], gid[ustarts], at[ustarts]
    return _compare_units(job, c.ranks, seq, gid, at, op, dtype, size)


def _uncut(job: JobModel, c: CollectiveRows,
           op_hash: Callable[[npt.NDArray[Any]], npt.NDArray[Any]] | None = None,
           ) -> npt.NDArray[np.bool_] | None:
    """Rows ``units`` compares (None: all): the oldest seq of a rank's window on a
    group is left out where the ring's eviction may have cut it (``_maybe_cut``).

    One numpy pass over the rows of every rank whose ring evicted entries: each
    (rank, group)'s oldest seq and whether the group's seqs rise in record order
    (then one row holds the oldest). The usual case -- one row, not a closing entry, seqs
    rising -- is whole, as ``_maybe_cut`` would find; only the others go
    through it (a Python call per (rank, group) was
    ~2 s of the central step at 100,000 ranks). The tests hold the rank-by-rank
    form as the oracle. ``op_hash``: the pass's getter of that column, if it has one
    (its concatenation is not made twice)."""
    n = len(c.ranks)
    digests = [job.digests[rank] for rank in c.ranks]
    # (built in bulk: a loop storing into two arrays per rank was 0.7 s at 100,000 ranks)
    lens = np.fromiter(map(len, digests), dtype=np.int64, count=n)
    start = np.cumsum(lens) - lens
    cut_able = np.fromiter((not d.whole_oldest and job.window_evicted(rank)
                            for rank, d in zip(c.ranks, digests, strict=True)),
                           dtype=np.bool_, count=n)
    rows = np.flatnonzero(cut_able[c.at]) if n else np.zeros(0, dtype=np.intp)
    if len(rows) == 0:
        return None
    # each (rank, group)'s rows together, in record order: a stable sort by the
    # group's local index (a radix sort of small numbers) keeps rank order within
    rows = rows[np.argsort(c.local[rows], kind="stable")]
    at, gid, seq = c.at[rows], c.gid[rows], c.seq[rows].astype(np.int64)
    new = np.r_[True, (at[1:] != at[:-1]) | (gid[1:] != gid[:-1])]
    first = np.flatnonzero(new)
    seg: npt.NDArray[Any] = np.cumsum(new, dtype=np.int32 if len(first) < 1 << 31 else np.int64)
    seg -= 1
    oldest = np.minimum.reduceat(seq, first)
    at_oldest = seq == oldest[seg]
    rising = np.logical_and.reduceat(np.r_[True, new[1:] | (seq[1:] > seq[:-1])], first)
    where = np.flatnonzero(at_oldest)
    pick = np.empty(len(first), dtype=np.intp)
    pick[seg[where][::-1]] = where[::-1]  # each segment's first row at its oldest seq
    closing = np.isin((op_hash or c.getter("op_hash"))(rows[pick]), _CLOSING_HASHES)
    whole = ~closing & rising  # seqs rising: the oldest is held by one row
    keep: npt.NDArray[np.bool_] | None = None
    ends = np.r_[first[1:], len(rows)]
    for k in np.flatnonzero(~whole):
        i = int(at[first[k]])
        mine = rows[first[k]:ends[k]]
        if _maybe_cut(job, c.ranks[i], c.take[mine].astype(np.intp) - start[i], int(oldest[k])):
            if keep is None:
                keep = np.ones(len(c.seq), dtype=np.bool_)
            keep[mine[at_oldest[first[k]:ends[k]]]] = False
    return keep


def _in_program_order(job: JobModel, c: CollectiveRows,
                      keep: npt.NDArray[np.bool_] | None) -> npt.NDArray[np.bool_] | None:
    """``keep`` less the rows ``_program_order`` leaves out (None: all kept)."""
    if not job.error_from and not job.frontier_limit:
        return keep
    out = np.ones(len(c.seq), dtype=np.bool_) if keep is None else keep.copy()
    base = 0
    for i, d in enumerate(c.digests):
        stop = job.error_from.get(c.ranks[i])
        if stop is not None:
            lo, hi = int(c.offsets[i]), int(c.offsets[i + 1])
            out[lo:hi] &= (c.take[lo:hi] - base) < stop
        base += len(d)
    for gid, limit in job.frontier_limit.items():
        out &= ~((c.gid == gid) & (c.seq > limit))
    return out


def _compare_units(job: JobModel, ranks: list[int], seq: npt.NDArray[np.int64],
                   gid: npt.NDArray[np.int32], at: npt.NDArray[np.int32],
                   op: npt.NDArray[np.int64], dtype: npt.NDArray[np.int64],
                   size: npt.NDArray[np.int64]) -> tuple[Mismatch, ...]:
    """The mismatches among units sorted by (group, seq, member order)."""
    starts = np.flatnonzero(np.r_[True, (gid[1:] != gid[:-1]) | (seq[1:] != seq[:-1])])
    bad_op, bad_size, bad_dtype = _bad(starts, op, dtype, size)
    first: dict[tuple[int, int], tuple[int, int]] = {}  # (gid, field) -> (block, later)
    for f, bad in enumerate((bad_op, bad_dtype, bad_size)):
        hits = np.flatnonzero(bad)
        if len(hits) == 0:
            continue
        uniq, idx, counts = np.unique(gid[starts[hits]], return_index=True, return_counts=True)
        for g, i, k in zip(uniq.tolist(), idx.tolist(), counts.tolist(), strict=True):
            first[(g, f)] = (int(hits[i]), k - 1)
    found: list[Mismatch] = []
    columns = (("op", op), ("dtype", dtype), ("size", size))
    for (g, f), (block, later) in sorted(first.items()):
        name, column = columns[f]
        lo = int(starts[block])
        hi = int(starts[block + 1]) if block + 1 < len(starts) else len(seq)
        raw = {ranks[a]: int(v) for a, v in zip(at[lo:hi].tolist(), column[lo:hi].tolist(),
                                                 strict=True)}
        values = {r: _render(job, name, r, v, g, int(seq[lo])) for r, v in raw.items()}
        found.append(Mismatch(g, int(seq[lo]), name, values, later, raw))  # type: ignore[arg-type]
    return tuple(found)


def _bad(starts: npt.NDArray[np.intp], op: npt.NDArray[np.int64], dtype: npt.NDArray[np.int64],
         size: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.bool_], ...]:
    """Per block of units (``starts``): whether its members disagree on op, size, dtype."""
    multi = np.diff(np.r_[starts, len(op)]) > 1
    bad_op = multi & (np.maximum.reduceat(op, starts) != np.minimum.reduceat(op, starts))
    # PyTorch's analyzer's order: op, then size, then dtype.
    checked = np.where(size < 0, np.iinfo(np.int64).min, size)
    sized = np.minimum.reduceat(size, starts) >= 0
    bad_size = multi & ~bad_op & sized & (
        np.maximum.reduceat(checked, starts) != np.minimum.reduceat(checked, starts))
    typed = np.minimum.reduceat(dtype, starts) >= 0  # -1: a member's dtype is not compared
    bad_dtype = multi & ~bad_op & ~bad_size & typed & (
        np.maximum.reduceat(dtype, starts) != np.minimum.reduceat(dtype, starts))
    return bad_op, bad_size, bad_dtype


def _render(job: JobModel, name: str, rank: int, value: int, gid: int, seq: int) -> str:
    d = job.digests[rank]
    if name == "size":
        return f"{value} elements"
    if name == "op":
        if value in d.op_names:
            return d.op_names[value]
        # a coalesced block: its entries' ops, in order
        view = job.view(rank, gid)
        if view is not None:
            rows = view.coll_rows[d.seq[view.coll_rows] == seq]
            ops = [d.op_names.get(int(h), "?") for h in d.op_hash[rows]]
            if ops:
                return "[" + ", ".join(ops) + "]"
        return f"op#{value:x}"
    return f"dtype#{value:x}"


