"""``straggler``: a rank that consistently arrives last at its collectives.

Rule: for every collective that every member of its group recorded, compare the
members' arrivals, with two measures that do not depend on clocks agreeing
between hosts:

* *arrival lateness* ``A``: a collective completes at (nearly) the same instant on
  all members, so a member's wait in it, ``t_complete - t_enqueue`` (both on its
  own clock), is short when it arrived late: ``A = median(wait) - wait``;
* *excess think time* ``E``: how long the member took, from the moment its
  previous op released it to this enqueue, beyond the median member. A rank
  that is late only because it waited for the straggler in another group was
  released late, so its think time is normal and ``E`` is about 0: it is not
  blamed.

A member is *blamed* for a collective when both exceed a threshold: the larger
of 1 ms, three times the dumps' completion-time resolution, and eight robust
standard deviations of ``E`` over the whole job (so jitter never trips it). A
rank blamed in at least 3 collectives, at least 5 % of its own, and far more
often than the typical rank, is a straggler. Severity warning (status
``degraded`` when alone): nothing hangs, the job is slow.

NCCL dumps with GPU durations (PyTorch's ``duration_ms``, timing on) give both
measures without any clock (:func:`_duration_lateness`): ``A = median(duration)
- duration``, since a member's duration runs from when its GPU reached the op;
and, as members were released together by the group's previous collective, a
member's think time since then is the common time minus its durations since
(``B``) and now: ``E = median(B + duration) - (B + duration)``. A rank that waited
elsewhere has a long ``B`` and ``E`` about 0. Threshold: max(1 ms, 8 robust
standard deviations of ``E``).

Dumps without completion times (PyTorch's gloo recorder) fall back to enqueue
times — never NCCL dumps, whose CPU runs ahead of the GPU (an enqueue time is
not an arrival there): per-rank clock offsets are estimated as each rank's median arrival
offset, and a member's previous release as the last arrival at its previous
collective. Per-rank clock offsets are always estimated (from completions when
known, which are near-simultaneous on all members) and reported in evidence.

Below the floor: completion times stamped by polling (ours on gloo: every 10 ms)
cannot show lateness under three resolutions (30 ms), yet a rank 25 ms late at
every step costs a 20 ms-per-step job a third of its time. When the completions
name nobody, the same collectives are judged again on their enqueue times with
the 1 ms floor, exactly as PyTorch's gloo dumps are (clock offsets estimated,
what-if replay, at most ``MAX_ENQUEUE_ONLY`` rank named) (``_below_the_floor``).
Not on NCCL dumps, whose enqueue times are the CPU's.

Clocks: on enqueue times only, the estimated offsets absorb lateness that is the
same at every op (a rank 20 ms late everywhere reads like its host clock 20 ms
ahead). When that pass names no one, or more ranks than it can tell apart, the
rows are judged again taking the hosts' clocks to agree (``_same_clock``): a rank
late there by at least ``SAME_CLOCK_MIN_NS`` (median) is named, marked
``evidence["clocks"] = "assumed_to_agree"`` with the offset that would explain
the same times (its action is ``inspect``: check the clock before replacing
anything); several such ranks make one warning naming none.
Only each rank's most recent ``WINDOW`` (512) entries are looked at: a straggler
is slow now, and the whole ring cost more than the rest of the analysis at scale.
Everything is vectorized: per-collective medians sort each collective's members in
a padded (collectives × members) array, never all values at once; clock offsets are
only estimated once there is something to report (or lateness needs them), and a
job where no rank is late by the smallest possible threshold at least 3 times stops
after the lateness. 4096 ranks × 2000 entries take about a second.

Send/recv: on the completion basis, frforensics' dumps add each matched send/recv
pair (per-peer numbers) as a two-member collective, so a pipeline stage is judged
from its sends and receives. On gloo those completions are not polled: the
recorder stamps a send/recv when the program waits on it (``RecordedWork.wait``,
recorder/_pg.py), so their rows keep the 1 ms floor while polled collectives keep
three resolutions (``_row_floors``): a 1F1B stage 10 ms slower per microbatch
(40 ms per step) is named (tests/data/native_workloads/pipeline-slow10-ours).

Worked example (4 ranks, default group; rank 1 sleeps 300 ms before each step)::

    step k:  all_reduce #3k+2: ranks 0,2,3 enqueue at t, rank 1 at t+300 ms
             all_reduce #3k+3, #3k+4: everyone enqueues within 1 ms
    -> straggler, rank 1, late in 8 of 24 collectives by 300 ms (median, p95)
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from frforensics.analyzer.context import Context
from frforensics.analyzer.digest import RankDigest
from frforensics.analyzer.merge import RECV_HASH, SEND_HASH
from frforensics.analyzer.replay import MAX_ROWS, replay_spans
from frforensics.model import OpState
from frforensics.report import Finding, FindingKind, Severity

__all__ = ["ArrivalTable", "arrivals", "detect", "unjudged"]

#: Each rank's most recent entries the detector looks at. A straggler is a rank
#: that is slow *now*; 512 ops are ample evidence (it needs 3 late collectives),
#: and the whole 2000-entry ring made this detector the largest cost of the
#: analysis at scale (32 million rows at 16,384 ranks).
WINDOW: Final = 512
FLOOR_NS: Final = 1_000_000  # lateness below 1 ms is never worth a warning
SIGMAS: Final = 8.0
MIN_BLAMED: Final = 3
MIN_FRACTION: Final = 0.05
#: From enqueue times alone, lateness that propagates (a straggler's peers then
#: reach their other groups late; with gloo, pipeline neighbours through send/recv
#: it does not record) cannot be told from its source: when more ranks than this
#: qualify, none is named.
MAX_ENQUEUE_ONLY: Final = 1
#: Enqueue times judged as if the hosts' clocks agreed name a rank only when it is
#: this late (median): NTP keeps hosts on one LAN within about a millisecond of each
#: other, and ranks on one host share its clock.
SAME_CLOCK_MIN_NS: Final = 10_000_000
#: Significance (module doc): a rank is named only when its lateness costs the job
#: at least this share of its time (``AnalyzeOptions.straggler_min_cost``) ...
DEFAULT_MIN_COST: Final = 0.05
#: ... and is sustained: late on at least this share of a group's collectives, or
MOST: Final = 0.5
#: late at a regular stride: this share of at least ``MIN_STRIDES`` gaps between its
#: late collectives of a group within 12.5 % of their median (the same point of
#: every step; random spikes are rarely that regular). Late at least
#: ``MIN_RECURRING`` times either way.
MOST_REGULAR: Final = 0.75
MIN_STRIDES: Final = 6
#: a regular stride is looked for among late collectives 1 to this many apart
#: (that many late ones in every step: a 1F1B pipeline stage slow in its forward is
#: late at 5 of its 17 sends and receives per step). Random spikes do not pass at
#: any of these lags: a sum of m random gaps spreads by ~1/sqrt(m) of its mean,
#: still far wider than the 12.5 % the test allows at m = 8
MAX_LATE_PER_STEP: Final = 8
MIN_RECURRING: Final = 5

F8 = npt.NDArray[np.float64]
I8 = npt.NDArray[np.int64]
BOOL = npt.NDArray[np.bool_]
IX = npt.NDArray[np.integer[Any]]


@dataclass(frozen=True, slots=True)
class ArrivalTable:
    """One row per (rank, collective) of collectives that every member recorded.

    ``seg`` numbers the collectives (0..n_seg-1); ``lateness`` and ``excess`` are
    ``A`` and ``E`` of the module doc in ns (NaN where unknown); ``offset_ns`` is
    each rank's estimated clock offset (index = rank position in ``ranks``).
    """

    ranks: I8  # global rank per position
    pos: I8  # rank position per row
    gid: I8
    seg: I8
    lateness: F8
    excess: F8
    offset_ns: F8
    op: I8  # op-name hash per row
    op_names: dict[int, str]
    from_completions: bool
    resolution_ns: int


class _Layout:
    """Where each row's value goes in per-segment rows of a padded 2-D array.

    Segments are bucketed by width (their size rounded up to a power of two), so a
    median is a scatter, one row-wise sort (or partition) per bucket and a gather:
    no sort of all values, and the layout is reused across calls.
    """

    __slots__ = ("buckets", "n_seg")

    def __init__(self, seg: IX, col: IX, counts: I8) -> None:
        self.n_seg = len(counts)
        width = np.ones(len(counts), dtype=np.int64)
        big = counts > 1
        width[big] = 1 << np.ceil(np.log2(counts[big])).astype(np.int64)
        self.buckets: list[tuple[int, bool, I8, I8, I8]] = []
        row_width = width[seg]
        for w in np.unique(width[counts > 0]).tolist():
            segs = np.flatnonzero((width == w) & (counts > 0))
            brow = np.zeros(len(counts), dtype=np.int64)
            brow[segs] = np.arange(len(segs))
            rows = np.flatnonzero(row_width == w)
            flat = brow[seg[rows]] * w + col[rows]
            exact = bool((counts[segs] == w).all())
            self.buckets.append((w, exact, segs, rows, flat))

    @classmethod
    def contiguous(cls, seg: IX, n_seg: int) -> _Layout:
        """Layout for non-decreasing ``seg`` (rows of a segment are adjacent)."""
        counts = np.bincount(seg, minlength=n_seg)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        return cls(seg, np.arange(len(seg), dtype=np.int64) - starts[seg], counts)

    @classmethod
    def sorted_by(cls, seg: I8, n_seg: int) -> _Layout:
        """Layout for any ``seg`` (one stable sort)."""
        counts = np.bincount(seg, minlength=n_seg)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        order = np.argsort(seg, kind="stable")
        col = np.empty(len(seg), dtype=np.int64)
        col[order] = np.arange(len(seg), dtype=np.int64) - starts[seg[order]]
        return cls(seg, col, counts)

    def median(self, values: F8, *, upper: bool = False) -> F8:
        """Lower (or upper) median of ``values`` per segment (NaN values are ignored).

        Which one matters for two-member groups, where it picks the other member:
        lateness compares a member with the one that waited longest, excess think
        time with the one that thought least.
        """
        out = np.full(self.n_seg, np.nan)
        for w, exact, segs, rows, flat in self.buckets:
            v = values[rows]
            nan = np.isnan(v)
            cells = np.full(len(segs) * w, np.nan)
            cells[flat] = v
            grid = cells.reshape(len(segs), w)
            if exact and not nan.any():
                kth = w // 2 if upper else (w - 1) // 2
                out[segs] = np.partition(grid, kth, axis=1)[:, kth]
                continue
            grid.sort(axis=1)  # NaN last
            k = w - np.isnan(grid).sum(axis=1)
            has = k > 0
            mid = k[has] // 2 if upper else (k[has] - 1) // 2
            out[segs[has]] = grid[np.flatnonzero(has), mid]
        return out


@dataclass(slots=True)
class _Rows:
    """The per-(rank, collective) rows that :func:`arrivals` derives its table from."""

    ranks: I8
    pos: npt.NDArray[np.int32]
    gid: I8
    seg: I8
    enq: F8
    comp: F8
    rel: F8
    key_all: I8  # before ``keep``, for :meth:`prev`
    keep: BOOL
    starts: I8  # first row of each rank's collectives in ``key_all``
    op: npt.NDArray[Any]
    seg_size: I8
    by_seg: _Layout
    op_names: dict[int, str]
    resolution_ns: int
    #: GPU duration of each row's op in ns (NaN: unknown), and the sum of the
    #: durations of the rank's ops since its previous collective of the same group
    #: (NaN: unknown); see :func:`_duration_lateness`
    dur: F8 | None = None
    between: F8 | None = None
    #: how many ops (units) that sum covers
    n_between: F8 | None = None
    #: matched send/recv pairs (``_p2p_pairs``), judged on the completion basis
    p2p: dict[str, Any] | None = None

    @property
    def n_seg(self) -> int:
        return len(self.seg_size)

    def kept_keys(self) -> I8:
        out = np.empty(self.n_seg, dtype=np.int64)
        out[self.seg] = self.key_all[self.keep]
        return out

    def prev(self) -> I8:
        """Key of each row's previous collective on its rank (-1: none)."""
        prev = np.empty_like(self.key_all)
        prev[1:] = self.key_all[:-1]
        prev[self.starts] = -1
        return prev[self.keep]

    def seg_has_comp(self) -> BOOL:
        known = np.bincount(self.seg, weights=(~np.isnan(self.comp)).astype(np.float64),
                            minlength=self.n_seg)
        return np.asarray(known == self.seg_size)


def _member_layout(seg: I8, col: I8, counts: I8) -> _Layout | None:
    """Layout from each row's member index in its group (``None`` if not a bijection)."""
    if len(col) == 0 or col.min() < 0 or (col >= counts[seg]).any():
        return None
    layout = _Layout(seg, col, counts)
    for w, _, segs, _, flat in layout.buckets:
        filled = np.zeros(len(segs) * w, dtype=np.bool_)
        filled[flat] = True
        if int(np.count_nonzero(filled)) != len(flat):  # two rows in one cell
            return None
    return layout


class _Gathered:
    """Every rank's collectives, one row each, concatenated rank after rank.

    Rows are the entries of non-p2p ops on a known group with an enqueue time
    among each rank's last ``window`` entries, the first of each (rank, group,
    seq) only (a coalesced unit is one row), in record order within a rank.
    Computed for all ranks at once: a Python loop per rank cost ~0.6 ms per rank
    (18 s at 16,384 ranks).
    """

    def __init__(self, ctx: Context, ranks: list[int], window: int) -> None:
        job = ctx.job
        digests = [job.digests[r] for r in ranks]
        lens = np.fromiter((d.seq.shape[0] for d in digests), dtype=np.int64, count=len(digests))
        sizes = np.minimum(lens, window)
        whole = bool((sizes == lens).all())
        seq_all = _cat(digests, "seq") if whole else None
        top = (int(seq_all.max(initial=-2)) + 2 if seq_all is not None
               else max([int(d.seq.max()) + 2 for d in digests if len(d)], default=0))
        self.max_seq = max(top, 1)
        self.resolution = max([d.completion_resolution_ns for d in digests if len(d)] + [0])
        # (rank, local group) -> global group id, the rank's member index and a
        # number per global group within the rank (``analyzer.slots``); the per-row
        # index columns are int32 (8.4 million rows at 16,384 ranks: 34 MB each
        # instead of 67); keys and times stay int64
        slots = job.group_slots()
        if slots.ranks != ranks:
            raise ValueError("the gather is over every dumped rank, ascending")
        index_t: type[np.signedinteger[Any]] = np.int32 if len(slots.gid) < (1 << 31) else np.int64
        lut_cat, col_cat, canon_cat = slots.gid, slots.member, slots.canon

        def cat(name: str) -> npt.NDArray[Any]:  # each rank's last ``window`` entries
            if whole:
                return _cat(digests, name)
            return np.concatenate([getattr(d, name)[n_all - n:] for d, n_all, n
                                   in zip(digests, lens.tolist(), sizes.tolist(), strict=True)])

        at = np.repeat(np.arange(len(ranks), dtype=np.int32), sizes)
        # (at 16,384 ranks every column here is 8.4 million rows: each temporary
        # is deleted once used)
        local = slots.slot_of(at, cat("group"), index_t)
        gid = lut_cat[local]
        t_complete = cat("t_complete_ns")
        t_enqueue = cat("t_enqueue_ns")
        done = (cat("state") >= OpState.COMPLETED) & (t_complete > 0)
        comp = t_complete.astype(np.float64)  # NaN where not done
        np.copyto(comp, np.nan, where=~done)
        # what released each op: the latest completion before it on its rank, but
        # never a gloo send's: its completion is when the program called wait() on it
        # (docs/recorder.md: no future; a pipeline stage waits on a microbatch's send
        # after computing the next one), which says when the rank was done thinking,
        # not what let it go on (a pipeline stage 40 ms slow per forward read 0.1 ms)
        is_p2p, op_all = cat("is_p2p"), cat("op_hash")
        gloo_send = (is_p2p == 1) & (op_all == SEND_HASH)
        if any(d.gpu_states for d in digests):
            gloo_send &= np.repeat(np.array([not d.gpu_states for d in digests], dtype=np.bool_),
                                   sizes)
        releases = done & ~gloo_send
        del gloo_send
        rel = _release(at, t_complete, releases, sizes)
        np.fmin(rel, t_enqueue, out=rel)
        del releases, t_complete
        # the sends and recvs that may pair (their peer columns gathered only then)
        cand = np.flatnonzero((is_p2p == 1) & (gid >= 0) & (t_enqueue > 0) & done
                              & ((op_all == SEND_HASH) | (op_all == RECV_HASH)))
        self.p2p = None if len(cand) < 2 else _p2p_pairs(
            np.asarray(ranks, dtype=np.int64), at[cand], gid[cand], cat("peer")[cand],
            cat("peer_seq")[cand], op_all[cand], t_enqueue[cand], comp[cand], rel[cand])
        del done, cand

        # the collective rows; where that is every row (a job without p2p whose ops
        # all started), the columns are taken as they are, not gathered (25 million
        # rows at 100,000 ranks: each gather a copy of the column)
        coll = (is_p2p == 0) & (gid >= 0) & (t_enqueue > 0)
        del is_p2p
        every = bool(coll.all())
        rows = np.arange(len(coll)) if every else np.flatnonzero(coll)
        del coll
        seq_src = seq_all if seq_all is not None else cat("seq")
        seq = (seq_src if every else seq_src[rows]).astype(np.int64)
        del seq_all, seq_src
        at_r, gid_r = (at, gid) if every else (at[rows], gid[rows])
        local_r = local if every else local[rows]
        key = gid_r.astype(np.int64) * self.max_seq + seq
        col = col_cat[local_r]
        # first row of each (rank, key); ranks with a negative seq: keys of two
        # groups may collide there, so they are deduplicated as one (and the
        # dense numbering of collectives is off)
        neg = np.zeros(len(ranks), dtype=np.bool_)
        neg[at_r[seq < 0]] = True
        self.dense_ok = not neg.any()
        first = _first_of_each(at_r, canon_cat[local_r], key)
        del local, local_r, at, gid
        for a in np.flatnonzero(neg).tolist():
            mine = np.flatnonzero(at_r == a)
            first[mine] = _first_occurrence(key[mine])
            col[mine] = -1
        # seq range per group (over ranks without negative seqs), for dense numbering
        if self.dense_ok:
            ok_gid, ok_seq = gid_r, seq
        else:
            ok = ~neg[at_r]
            ok_gid, ok_seq = gid_r[ok], seq[ok]
        n_groups = len(job.groups)
        lo = np.full(n_groups, np.iinfo(np.int64).max, dtype=np.int64)
        hi = np.full(n_groups, np.iinfo(np.int64).min, dtype=np.int64)
        np.minimum.at(lo, ok_gid, ok_seq)
        np.maximum.at(hi, ok_gid, ok_seq)
        del ok_gid, ok_seq
        present = np.flatnonzero(hi >= lo)
        self.lo = dict(zip(present.tolist(), lo[present].tolist(), strict=True))
        self.hi = dict(zip(present.tolist(), hi[present].tolist(), strict=True))

        if not first.all():  # coalesced duplicates dropped (none: nothing to take)
            rows, at_r, key, gid_r, col = rows[first], at_r[first], key[first], gid_r[first], col[first]
            every = False

        def row_of(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
            return a if every else a[rows]

        dur, between, n_between = _durations_between(digests, sizes, rows, at_r, gid_r, key)
        per_rank = np.bincount(at_r, minlength=len(ranks))
        self.at_list: list[int] = np.flatnonzero(per_rank).tolist()
        self.lengths: list[int] = per_rank[self.at_list].tolist()
        self.cat = {
            "key": key, "enq": row_of(t_enqueue).astype(np.float64), "comp": row_of(comp),
            "rel": row_of(rel), "op": row_of(op_all), "gid": gid_r.astype(np.int32, copy=False),
            "col": col, "dur": dur, "between": between, "n_between": n_between,
        }
        self.op_names: dict[int, str] = {}
        for a in self.at_list:
            self.op_names.update(digests[a].op_names)
        if self.p2p is not None:
            for d in digests:
                self.op_names.update({h: n for h, n in d.op_names.items()
                                      if h in (SEND_HASH, RECV_HASH)})


def _cat(digests: list[RankDigest], name: str) -> npt.NDArray[Any]:
    """Column ``name`` of every digest, concatenated."""
    parts = list(map(operator.attrgetter(name), digests))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _p2p_pairs(ranks: I8, at: IX, gid: IX, peer: IX, peer_seq: IX, op: IX,
               t_enqueue: I8, comp: F8, rel: F8) -> dict[str, Any] | None:
    """Matched send/recv pairs among the windows' entries, for the completion basis
    (module doc, "Send/recv"): the k-th send from A to B on a group with the k-th
    recv at B from A, both completed — by the per-peer numbers of frforensics'
    dumps (``peer_seq``; PyTorch's own dumps carry none, and its gloo recorder no
    send/recv at all). ``None`` when there is no pair. The rows given are the
    completed sends and recvs on a known group with an enqueue time."""
    is_send = op == SEND_HASH
    rows = np.flatnonzero((peer >= 0) & (peer_seq > 0))
    if len(rows) < 2:
        return None
    me = ranks[at[rows]]
    other = peer[rows].astype(np.int64)
    send = is_send[rows]
    src, dst = np.where(send, me, other), np.where(send, other, me)
    cols = np.stack([gid[rows].astype(np.int64), src, dst, peer_seq[rows].astype(np.int64)])
    _, pair, counts = np.unique(cols, axis=1, return_inverse=True, return_counts=True)
    pair = pair.reshape(-1)
    sends = np.bincount(pair, weights=send.astype(np.float64), minlength=len(counts))
    good = (counts == 2) & (sends == 1)  # one send and its recv, each recorded once
    keep = good[pair]
    if not keep.any():
        return None
    rows, pair = rows[keep], pair[keep]
    dense = np.cumsum(good) - 1
    return {"at": at[rows], "gid": gid[rows].astype(np.int32), "pair": dense[pair],
            "n_pairs": int(good.sum()), "enq": t_enqueue[rows].astype(np.float64),
            "comp": comp[rows], "rel": rel[rows], "op": op[rows]}


def _durations_between(digests: list[RankDigest], sizes: I8, rows: I8, at: IX, gid: IX,
                       key: I8) -> tuple[F8, F8, F8]:
    """GPU duration of each gathered row, what its rank spent in its own ops since
    its previous collective of the same group, and how many ops (NaN where unknown).

    ``rows`` index the concatenated windows (rank after rank, record order), one per
    (rank, collective), the first entry of its unit. A unit's duration (a coalesced
    block's is its closing entry's) counts once, at its first row. The sum covers
    every unit strictly between the previous collective of the group (which must be
    the group's previous seq, ``key - 1``) and this one, p2p included; it is unknown
    when one of them has no duration or there is no previous collective.
    """
    if all(d.duration_ns is None for d in digests):  # no timing (gloo, NCCL by default)
        # one read-only NaN for every row (only ever indexed: 67 MB each at 16,384 ranks)
        nothing: F8 = np.broadcast_to(np.float64(np.nan), (len(rows),))
        return nothing, nothing, nothing
    n_rows = int(sizes.sum())
    dur_all = np.full(n_rows, -1, dtype=np.int64)
    first_of_unit = np.ones(n_rows, dtype=np.bool_)
    at0 = 0
    for d, n in zip(digests, sizes.tolist(), strict=True):
        if n:
            lo = len(d) - n
            if d.duration_ns is not None:
                dur_all[at0:at0 + n] = d.duration_ns[lo:]
            if d.unit is not None:
                u = d.unit[lo:]
                first_of_unit[at0 + 1:at0 + n] = u[1:] != u[:-1]
        at0 += n
    known = dur_all >= 0
    contrib = np.where(first_of_unit & known, dur_all, 0).astype(np.float64)
    unknown = (first_of_unit & ~known).astype(np.int64)
    s_incl, u_incl = np.cumsum(contrib), np.cumsum(unknown)
    s_excl, u_excl = s_incl - contrib, u_incl - unknown
    c_incl = np.cumsum(first_of_unit, dtype=np.int64)
    c_excl: I8 = c_incl - first_of_unit
    dur = np.where(known[rows], dur_all[rows], -1).astype(np.float64)
    dur[dur < 0] = np.nan
    # previous row of the same (rank, group): rows are in rank order, record order within
    order = np.lexsort((np.arange(len(rows)), gid, at))
    prev = np.full(len(rows), -1, dtype=np.int64)
    same = (at[order[1:]] == at[order[:-1]]) & (gid[order[1:]] == gid[order[:-1]])
    prev[order[1:][same]] = order[:-1][same]
    ok = prev >= 0
    ok[ok] = key[prev[ok]] + 1 == key[ok]
    p = rows[np.where(ok, prev, 0)] if len(rows) else rows
    between = np.full(len(rows), np.nan)
    clean = ok & (u_excl[rows] - u_incl[p] == 0) if len(rows) else ok
    between[clean] = s_excl[rows[clean]] - s_incl[p[clean]]
    n_between = np.full(len(rows), np.nan)
    n_between[clean] = c_excl[rows[clean]] - c_incl[p[clean]]
    return dur, between, n_between


def _release(at: IX, t_complete: I8, done: BOOL, sizes: I8) -> F8:
    """Latest completion among each row's earlier entries on its rank (NaN: none),
    counting the rows ``done`` marks.

    Three int64 columns at most at once (the 25 million rows of 100,000 ranks:
    fresh memory is most of what a column costs)."""
    if not done.any():
        return np.full(len(at), np.nan)
    t0 = int(t_complete.min(where=done, initial=np.iinfo(np.int64).max))
    span = int(t_complete.max(where=done, initial=np.iinfo(np.int64).min)) - t0 + 2
    if span * (len(sizes) + 1) >= 1 << 62:  # offsets would overflow: rank by rank
        out = np.full(len(at), np.nan)
        comp = np.where(done, t_complete.astype(np.float64), np.nan)
        starts = np.concatenate(([0], np.cumsum(sizes)))
        for lo, hi in zip(starts[:-1].tolist(), starts[1:].tolist(), strict=True):
            if hi > lo:
                out[lo:hi] = np.fmax.accumulate(np.concatenate(([np.nan], comp[lo:hi - 1])))
        return out
    # one running max over all ranks: rank a's values are lifted by a * span, so
    # no earlier rank's value can win; not-completed entries count as -1
    lift = at.astype(np.int64) * span
    lifted = np.where(done, t_complete - t0, -1)
    lifted += lift
    np.maximum.accumulate(lifted, out=lifted)
    prev = np.empty_like(lifted)
    prev[1:] = lifted[:-1]
    del lifted
    prev[0] = -1
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    prev[starts[sizes > 0]] = at[starts[sizes > 0]].astype(np.int64) * span - 1  # nothing before a rank's first
    prev -= lift
    del lift
    has = prev >= 0
    prev += t0
    out = prev.astype(np.float64)
    del prev
    out[~has] = np.nan
    return out


def _first_of_each(at: IX, canon: IX, key: I8) -> BOOL:
    """First row of each (rank, key), rows being in rank order and record order within.

    ``canon`` numbers a row's group within its rank (one number per global
    group). A group's seqs normally never decrease on a rank, so the first of
    each key is where the key changes from the previous row of the same (rank,
    group); a (rank, group) whose keys ever decrease is deduplicated with a sort.
    """
    first = np.ones(len(key), dtype=np.bool_)
    if len(key) < 2:
        return first
    # rows by group within the rank (a stable sort: a radix sort of the small
    # numbers), rank after rank within a group: each group's rows of a rank follow
    # each other
    top = int(canon.max())
    small = np.int8 if top < 127 else np.int16 if top < 32767 else np.int64
    narrow = canon.astype(small)
    idx = np.argsort(narrow, kind="stable")
    k, a, c = key[idx], at[idx], narrow[idx]
    del narrow
    same = (a[1:] == a[:-1]) & (c[1:] == c[:-1])
    first[idx[1:]] = ~same | (k[1:] != k[:-1])
    dec = np.flatnonzero(same & (k[1:] < k[:-1]))
    if len(dec):
        # a (rank, group) whose keys ever decrease: deduplicated with a sort
        for bad, j in sorted(set(zip(a[1:][dec].tolist(), c[1:][dec].tolist(), strict=True))):
            mine = idx[(a == bad) & (c == j)]
            first[mine] = _first_occurrence(key[mine])
    return first


def _first_occurrence(keys: I8) -> BOOL:
    """True at the first occurrence of each key."""
    first = np.zeros(len(keys), dtype=np.bool_)
    first[np.unique(keys, return_index=True)[1]] = True
    return first


def _collect(ctx: Context) -> _Rows | None:
    job = ctx.job
    ranks = sorted(job.digests)
    if len(ranks) < 2:
        return None
    gsize = np.array([len(g.ranks) for g in job.groups] + [0], dtype=np.int64)
    g = _Gathered(ctx, ranks, WINDOW)
    if not g.at_list:
        return None
    cat, lo, hi, max_seq, dense_ok = g.cat, g.lo, g.hi, g.max_seq, g.dense_ok
    lengths, at_list, op_names, resolution, p2p = g.lengths, g.at_list, g.op_names, g.resolution, g.p2p
    key, gid = cat["key"], cat["gid"]

    gids = sorted(lo)
    spans = np.array([hi[g] - lo[g] + 1 for g in gids], dtype=np.int64)
    if dense_ok and int(spans.sum()) <= 4 * len(key) + 4096:
        # number collectives densely by (group, seq), which is the order of ``key``
        shift = np.zeros(len(job.groups) + 1, dtype=np.int64)  # key -> dense number
        shift[gids] = (np.concatenate(([0], np.cumsum(spans)[:-1]))
                       - np.array([lo[g] + g * max_seq for g in gids], dtype=np.int64))
        dense = key + shift[gid]
        counts = np.bincount(dense, minlength=int(spans.sum()))
        full = counts == gsize[np.repeat(np.asarray(gids, dtype=np.int64), spans)]
    else:
        uniq, dense, counts = np.unique(key, return_inverse=True, return_counts=True)
        full = counts == gsize[uniq // max_seq]
    kept = full & (counts > 1)
    keep = kept[dense]
    if not keep.any():
        return None
    seg = (np.cumsum(kept) - 1)[dense[keep]]  # kept collectives, numbered densely
    n_seg = int(kept.sum())
    del dense
    n_rows = np.asarray(lengths, dtype=np.int64)
    seg_size = np.bincount(seg, minlength=n_seg)
    every = bool(keep.all())
    pos = np.repeat(np.asarray(at_list, dtype=np.int32), n_rows)
    if not every:
        pos = pos[keep]

    def kept_rows(name: str) -> npt.NDArray[Any]:
        # each gathered column is let go as soon as its kept rows are taken, and
        # taken as it is when every row is kept (a healthy job's windows: no copy)
        column: npt.NDArray[Any] = cat.pop(name)
        if every:
            return column
        if column.ndim == 1 and column.strides == (0,) and len(column):  # one read-only value
            return np.broadcast_to(column[0], (len(seg),))
        taken: npt.NDArray[Any] = column[keep]
        return taken

    by_seg = _member_layout(seg, kept_rows("col"), seg_size) or _Layout.sorted_by(seg, n_seg)
    del g, gid
    return _Rows(
        ranks=np.asarray(ranks, dtype=np.int64), pos=pos, gid=kept_rows("gid"), seg=seg,
        enq=kept_rows("enq"), comp=kept_rows("comp"), rel=kept_rows("rel"),
        key_all=key, keep=keep, starts=np.concatenate(([0], np.cumsum(n_rows)[:-1])),
        op=kept_rows("op"), seg_size=seg_size,
        by_seg=by_seg, op_names=op_names, resolution_ns=resolution,
        dur=kept_rows("dur"), between=kept_rows("between"), n_between=kept_rows("n_between"),
        p2p=p2p,
    )


def _with_p2p(t: _Rows) -> _Rows:
    """``t`` with its matched send/recv pairs as two-member collectives (module doc,
    "Send/recv"): rows appended after the collectives' (so only for the completion
    basis, which never needs rows in rank order)."""
    q = t.p2p
    if q is None:
        return t
    n = len(q["at"])
    seg = np.concatenate([t.seg, t.n_seg + q["pair"]])
    n_seg = t.n_seg + int(q["n_pairs"])
    nan = np.full(n, np.nan)
    return replace(
        t, pos=np.concatenate([t.pos, q["at"].astype(t.pos.dtype)]),
        gid=np.concatenate([t.gid, q["gid"].astype(t.gid.dtype)]), seg=seg,
        enq=np.concatenate([t.enq, q["enq"]]), comp=np.concatenate([t.comp, q["comp"]]),
        rel=np.concatenate([t.rel, q["rel"]]), op=np.concatenate([t.op, q["op"].astype(t.op.dtype)]),
        seg_size=np.bincount(seg, minlength=n_seg), by_seg=_Layout.sorted_by(seg, n_seg),
        dur=None if t.dur is None else np.concatenate([t.dur, nan]),
        between=None if t.between is None else np.concatenate([t.between, nan]),
        n_between=None if t.n_between is None else np.concatenate([t.n_between, nan]),
        p2p=None)


def _offsets(t: _Rows, base: F8) -> F8:
    """Per-rank clock offsets: each rank's median residual against its collectives' median."""
    n_ranks = len(t.ranks)
    if len(t.pos) < 2 or bool(np.all(t.pos[1:] >= t.pos[:-1])):
        by_pos = _Layout.contiguous(t.pos, n_ranks)  # rows are in rank order
    else:  # p2p pairs appended (``_with_p2p``)
        by_pos = _Layout.sorted_by(t.pos.astype(np.int64), n_ranks)
    offset = np.zeros(n_ranks)
    for _ in range(3):  # a few rounds: groups overlap, so offsets settle across the job
        shifted = base - offset[t.pos]
        resid = shifted - t.by_seg.median(shifted)[t.seg]
        step = by_pos.median(resid)
        offset += np.nan_to_num(step)
    offset -= np.median(offset)
    return offset


def _lateness_think(t: _Rows, from_completions: bool, has_comp: BOOL,
                    offset: F8 | None) -> tuple[F8, F8]:
    seg = t.seg
    if from_completions:
        wait = np.where(has_comp[seg], t.comp - t.enq, np.nan)
        return t.by_seg.median(wait, upper=True)[seg] - wait, t.enq - t.rel
    assert offset is not None
    n_seg = t.n_seg
    arrive = t.enq - offset[t.pos]
    lateness = arrive - t.by_seg.median(arrive)[seg]
    last_arrival = np.full(n_seg + 1, np.nan)
    np.fmax.at(last_arrival, seg, arrive)
    kept_keys, prev = t.kept_keys(), t.prev()
    pseg = np.searchsorted(kept_keys, prev)
    found = (prev >= 0) & (pseg < n_seg) & (kept_keys[np.minimum(pseg, n_seg - 1)] == prev)
    released = np.where(found, last_arrival[np.where(found, pseg, n_seg)], np.nan)
    return lateness, arrive - released


def _excess(t: _Rows, think: F8) -> F8:
    valid = ~np.isnan(think)
    valid_count = np.bincount(t.seg, weights=valid.astype(np.float64), minlength=t.n_seg)
    think = np.where((valid_count == t.seg_size)[t.seg], think, np.nan)
    return np.asarray(think - t.by_seg.median(think)[t.seg])


def _basis(t: _Rows) -> tuple[bool, BOOL, F8 | None]:
    """Whether completions are used, which collectives have them, and the clock
    offsets when lateness needs them (enqueue times only)."""
    has_comp = t.seg_has_comp()
    from_completions = bool(has_comp.mean() > 0.5)
    if from_completions:
        return True, has_comp, None
    return False, has_comp, _offsets(t, t.enq.copy())


def _table(t: _Rows, from_completions: bool, lateness: F8, excess: F8, offset: F8) -> ArrivalTable:
    return ArrivalTable(
        ranks=t.ranks, pos=t.pos.astype(np.int64), gid=t.gid.astype(np.int64), seg=t.seg,
        lateness=lateness, excess=excess, offset_ns=offset, op=t.op.astype(np.int64), op_names=t.op_names, from_completions=from_completions,
        resolution_ns=t.resolution_ns,
    )


def _completion_offsets(t: _Rows, has_comp: BOOL) -> F8:
    return _offsets(t, np.where(has_comp[t.seg], t.comp, np.nan))


def arrivals(ctx: Context) -> ArrivalTable | None:
    """Build the :class:`ArrivalTable` of the job (``None`` when nothing to compare)."""
    t = _collect(ctx)
    if t is None:
        return None
    from_completions, has_comp, offset = _basis(t)
    lateness, think = _lateness_think(t, from_completions, has_comp, offset)
    if offset is None:
        offset = _completion_offsets(t, has_comp)
    return _table(t, from_completions, lateness, _excess(t, think), offset)


def _short_group(ctx: Context, gid: int) -> str:
    g = ctx.job.groups[gid]
    desc = g.desc if g.desc and g.desc != "undefined" else f"group {g.name}"
    return f"{desc} (ranks {ctx.ranks(g.ranks)})"


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.1f} ms" if abs(ns) >= 1e5 else f"{ns / 1e3:.0f} µs"


@dataclass(frozen=True, slots=True)
class _Blame:
    """Who is blamed, from one pair of measures (``A``, ``E``) over the rows."""

    excess: F8
    threshold: float
    blamed: BOOL
    late: BOOL
    count: npt.NDArray[Any]  # blamed collectives per rank position
    total: npt.NDArray[Any]  # judged collectives per rank position
    flagged: I8  # rank positions that are stragglers
    #: per rank position: the share of its window's time its late arrivals cost
    #: (NaN where not computed), and how its lateness is sustained ("most",
    #: "recurring" or "" for neither)
    cost: F8
    sustained: dict[int, str]
    #: rank positions late often enough to stand out, but not significant
    #: (rare spikes, or too cheap): noise, named only in a note
    noise: I8
    min_cost: float
    #: per rank position: the job's span replayed as recorded and without its delay
    #: (``analyzer.replay``), in ns, where the cost came from the replay
    spans: dict[int, tuple[float, float]] = field(default_factory=dict)


def _floor(t: _Rows | ArrivalTable) -> float:
    """The smallest lateness ever blamed on arrivals: 1 ms, or three times the
    completion-time resolution."""
    return max(FLOOR_NS, 3.0 * t.resolution_ns)


def _row_floors(t: _Rows, exact_p2p: bool) -> float | F8:
    """:func:`_floor` per row where send/recv completions are exact (module doc,
    "Send/recv"): 1 ms on those rows, the polled floor on the others."""
    floor = _floor(t)
    if not exact_p2p or floor <= FLOOR_NS:
        return floor
    is_pair = np.isin(t.op, (SEND_HASH, RECV_HASH))
    return floor if not is_pair.any() else np.where(is_pair, float(FLOOR_NS), floor)


def _blame(t: _Rows, a: F8, excess: Callable[[], F8], floor: float | F8,
           min_cost: float = DEFAULT_MIN_COST, *, replay: bool = True) -> _Blame | None:
    """The straggler rule on lateness ``a`` and excess think time ``excess()`` (module
    doc), for arrivals and GPU durations alike; ``None`` when no rank stands out
    at all (noise that stands out is in ``noise``, with ``flagged`` empty).
    ``floor`` is one value or one per row (:func:`_row_floors`)."""
    # the threshold is never below ``floor``: a rank that is not even late by that much
    # MIN_BLAMED times cannot be blamed that often, so a healthy job stops here (and
    # ``excess`` is never computed)
    n_ranks = len(t.ranks)
    if np.bincount(t.pos, weights=a > floor, minlength=n_ranks).max() < MIN_BLAMED:
        return None
    e = excess()
    finite = e[~np.isnan(e)]
    if len(finite) == 0:
        return None
    mad = float(np.median(np.abs(finite - np.median(finite))))
    thr = np.maximum(floor, SIGMAS * 1.4826 * mad)  # per row where the floor is
    threshold = float(np.min(thr))
    blamed = (e > thr) & (a > thr)
    total = np.bincount(t.pos, weights=~np.isnan(e), minlength=n_ranks)
    count = np.bincount(t.pos, weights=blamed, minlength=n_ranks)
    typical = float(np.median(count))
    standing = np.flatnonzero((count >= MIN_BLAMED) & (count >= MIN_FRACTION * np.maximum(total, 1))
                              & (count > 4 * typical + 2))
    if len(standing) == 0:
        return None
    cost = np.full(n_ranks, np.nan)
    sustained: dict[int, str] = {}
    spans: dict[int, tuple[float, float]] = {}
    clock = _replay_clock(t) if replay and len(t.pos) <= MAX_ROWS else None
    for p in standing.tolist():
        cost[p], sustained[p] = _significance(t, a, e, blamed, p)
        if clock is not None:
            # what removing its delay would save (analyzer.replay), not the sum of
            # its lateness: overlapped or absorbed delays cost the job nothing. The
            # delay removed is its excess think time wherever that exceeds the
            # threshold, late there or not: the replay decides what it cost. (A
            # pipeline stage's delay shows as think time before its send and as
            # lateness at the receive after it, rarely both on one row: removing
            # min(lateness, excess) on blamed rows only saved 44 % of a job whose
            # fault-free rerun is 90 % shorter; docs/detectors.md, "costly".)
            removed = np.where((t.pos == p) & (e > thr), e, 0.0)
            before, after = replay_spans(t.pos, t.seg, *clock, np.nan_to_num(removed),
                                             tolerance_ns=2.0 * _floor(t))
            if before > 0:
                spans[p] = (before, after)
                cost[p] = max(0.0, (before - after) / before)
    keep = np.asarray([bool(sustained[p]) and cost[p] >= min_cost for p in standing.tolist()])
    return _Blame(e, threshold, blamed, (a > thr) & ~blamed, count, total, standing[keep],
                  cost, sustained, standing[~keep], min_cost, spans)


def _replay_clock(t: _Rows) -> tuple[F8, F8]:
    """Enqueue and completion times on one clock, for the replay: each rank's clock
    offset, estimated from completions (near-simultaneous on all members) where most
    collectives have them, else from arrivals, subtracted."""
    has_comp = t.seg_has_comp()
    if has_comp.mean() > 0.5:
        offset = _offsets(t, np.where(has_comp[t.seg], t.comp, np.nan))
    else:
        offset = _offsets(t, t.enq.copy())
    shift = offset[t.pos]
    # a send's completion (gloo: when the program waited on it, not when its data
    # landed) is not the pair's: the receive's completion is (analyzer.replay takes
    # a pair to complete at its latest member completion)
    comp = np.where(t.op == SEND_HASH, np.nan, t.comp)
    return t.enq - shift, comp - shift


def _significance(t: _Rows, a: F8, e: F8, blamed: BOOL, p: int) -> tuple[float, str]:
    """Whether rank position ``p``'s lateness matters (module doc, "Significance"):
    the share of its window's time its late arrivals cost, and how the lateness
    is sustained: ``"most"`` (late on most of the collectives of a group it
    shares, from its first late one on), ``"recurring"`` (late at the same point of most steps: its late
    collectives of a group recur at a regular stride) or ``""`` (neither)."""
    mine = np.flatnonzero(t.pos == p)
    judged = mine[~np.isnan(e[mine])]
    hit = blamed[judged]
    # what the job lost to it: per late collective, the smaller of how late it came
    # and how much longer it thought than its peers (both are the delay it caused)
    lost = float(np.minimum(a[judged][hit], e[judged][hit]).clip(min=0).sum())
    times = t.enq[mine]
    span = float(np.nanmax(times) - np.nanmin(times)) if len(times) > 1 else 0.0
    cost = lost / span if span > 0 else 0.0
    how = ""
    # in time order (p2p pairs are appended after the collectives' rows)
    judged = judged[np.argsort(t.enq[judged], kind="stable")]
    hit = blamed[judged]
    gids = t.gid[judged]
    for g in np.unique(gids[hit]).tolist():
        in_g = gids == g
        n_judged, late = int(in_g.sum()), np.flatnonzero(hit[in_g])
        if len(late) < MIN_BLAMED:
            continue
        # since its first late one: a rank that turned slow within the window is
        # late on most of what followed; at least MIN_RECURRING times (a few
        # spikes among a few judged collectives are no evidence)
        # most of what followed, and what followed is at least half the window:
        # a burst of spikes near the window's end is not a rank that turned slow
        since = n_judged - int(late[0])
        if len(late) >= MIN_RECURRING and len(late) >= MOST * since and 2 * since >= n_judged:
            return cost, "most"
        if _recurs(late):
            how = "recurring"
    return cost, how


def _recurs(late: IX) -> bool:
    """Whether late collectives (indices among a group's judged ones) recur at a
    regular stride: the gaps ``late[i + m] - late[i]`` at some lag ``m`` of 1 to
    ``MAX_LATE_PER_STEP`` are, for ``MOST_REGULAR`` of at least ``MIN_STRIDES`` of
    them, within 12.5 % of their median of 2 or more. Lag 1 is one late collective
    per step; lag m, m late ones per step (a transformers Trainer step: late at its
    first two collectives, gaps 1, 3, 1, 3, ...; at lag 2 every gap is 4)."""
    for m in range(1, MAX_LATE_PER_STEP + 1):
        gaps = late[m:] - late[:-m]
        if len(gaps) < MIN_STRIDES:
            break
        d = float(np.median(gaps))
        tol = max(1.0, d / 8)
        if d < 2 or np.mean(np.abs(gaps - d) <= tol) < MOST_REGULAR:
            continue
        if m == 1:
            return True
        # m late ones per step of d collectives: the late ones fall at m points of
        # the step (positions modulo d, give or take one), which scattered spikes
        # do not (their positions modulo d spread over the whole step)
        if _at_points_of_step(late, round(d), m) >= MOST_REGULAR:
            return True
    return False


def _at_points_of_step(late: IX, period: int, points: int) -> float:
    """The share of ``late`` (indices) at the ``points`` most frequent positions
    modulo ``period``, each give or take one."""
    counts = np.bincount(np.asarray(late) % period, minlength=period).astype(np.int64)
    covered = 0
    for _ in range(points):
        near = counts + np.roll(counts, 1) + np.roll(counts, -1)
        k = int(np.argmax(near))
        covered += int(near[k])
        counts[[(k - 1) % period, k, (k + 1) % period]] = 0
    return covered / max(len(late), 1)


def detect(ctx: Context) -> list[Finding]:
    """One warning per rank that consistently arrives last, at a cost that matters."""
    return _judge(ctx)[0]


def _judge(ctx: Context) -> tuple[list[Finding], list[str]]:
    """The findings, and the notes on ranks that stood out without mattering: judged
    once per context (``detect`` and ``unjudged`` both read it; judged twice, a
    healthy 16,384-rank job paid the 8.4-million-row gather twice, 2.7 s)."""
    done: tuple[list[Finding], list[str]] | None = ctx.memo.get("straggler")
    if done is None:
        done = ctx.memo["straggler"] = _judge_once(ctx)
    return list(done[0]), list(done[1])


def _judge_once(ctx: Context) -> tuple[list[Finding], list[str]]:
    t = _collect(ctx)
    if t is None:
        return [], []
    min_cost = ctx.options.straggler_min_cost
    if ctx.job.gpu_states and _has_durations(t):
        return _detect_from_durations(ctx, t)
    from_completions, has_comp, offset = _basis(t)
    if not from_completions and ctx.job.gpu_states:
        # NCCL: the CPU runs ahead of the GPU, so when an op was enqueued says
        # nothing about when the rank's GPU reached it; without completion times
        # there is nothing to judge arrivals by
        return [], []
    if from_completions:
        base, base_comp = t, has_comp
        t = _with_p2p(t)
        has_comp = t.seg_has_comp()
    a, think = _lateness_think(t, from_completions, has_comp, offset)
    # NCCL: enqueue times are the CPU's and completions the watchdog's polls, no
    # dependency graph to replay; there the cost is the lateness's share
    floor = _row_floors(t, exact_p2p=from_completions and not ctx.job.gpu_states)
    blame = _blame(t, a, lambda: _excess(t, think), floor, min_cost,
                   replay=not ctx.job.gpu_states)
    if from_completions:
        if blame is None or len(blame.flagged) == 0:
            below = None if ctx.job.gpu_states else _below_the_floor(ctx, base, base_comp)
            if below is not None:
                return below, []
        if blame is None:
            return [], []
        notes = _noise_notes(ctx, t, blame, a)
        if len(blame.flagged) == 0:
            return [], notes
        # only reported: estimated once needed, from the collectives
        offset = _completion_offsets(base, base_comp)
        return _findings(ctx, _table(t, True, a, blame.excess, offset), blame, a), notes
    assert offset is not None
    notes = [] if blame is None else _noise_notes(ctx, t, blame, a)
    if blame is not None and 0 < len(blame.flagged) <= MAX_ENQUEUE_ONLY:
        return _findings(ctx, _table(t, False, a, blame.excess, offset), blame, a), notes
    same = _same_clock(ctx, t, has_comp, offset)
    if same is not None:
        return same, notes
    if blame is None or len(blame.flagged) == 0:
        return [], notes
    # more candidates than enqueue times can tell apart: one warning naming none
    return _findings(ctx, _table(t, False, a, blame.excess, offset), blame, a), notes


def _below_the_floor(ctx: Context, t: _Rows, has_comp: BOOL) -> list[Finding] | None:
    """Completion times too coarse for the delay (module doc, "Below the floor"): the
    same collectives judged again on their enqueue times with the 1 ms floor, as
    PyTorch's gloo dumps are, naming at most ``MAX_ENQUEUE_ONLY`` rank; ``None`` when
    that names nobody (or more ranks than enqueue times can tell apart)."""
    if _floor(t) <= FLOOR_NS:
        return None  # the completions' floor is the enqueue basis's: nothing more to see
    offset = _offsets(t, t.enq.copy())
    a, think = _lateness_think(t, False, has_comp, offset)
    blame = _blame(t, a, lambda: _excess(t, think), FLOOR_NS, ctx.options.straggler_min_cost)
    if blame is None or not 0 < len(blame.flagged) <= MAX_ENQUEUE_ONLY:
        return None
    return _findings(ctx, _table(t, False, a, blame.excess, offset), blame, a,
                     below_floor=True)


def _noise_notes(ctx: Context, t: _Rows, blame: _Blame, a: F8) -> list[str]:
    """One note on the slowest rank that stood out without mattering (rare spikes,
    or lateness too cheap to name): no culprit, no action."""
    if len(blame.noise) == 0 or len(blame.flagged):
        return []
    p = max(blame.noise.tolist(), key=lambda q: float(blame.cost[q]))
    mine = (t.pos == p) & blame.blamed
    why = ("not sustained: late on few of its collectives, at no regular point of its steps"
           if not blame.sustained.get(p) else
           f"below the {_pct(blame.min_cost)} that names a straggler")
    return [f"straggler: slowest rank {int(t.ranks[p])}: late in {int(blame.count[p])} of "
            f"{int(blame.total[p])} {_judged_ops(t, p)} by {_ms(float(np.median(a[mine])))} "
            "(median), "
            f"costing the job ~{_pct(float(blame.cost[p]))} of its time; {why}, so it is "
            "read as noise (no culprit, no action)"]


def _judged_ops(t: Any, p: int) -> str:
    """What rank position ``p``'s judged rows are: collectives, or with matched
    send/recv pairs among them (``_with_p2p``), collectives and sends/receives."""
    mine = t.op[t.pos == p]
    if np.isin(mine, (SEND_HASH, RECV_HASH)).any():
        return "collectives, sends and receives"
    return "collectives"


def _pct(share: float) -> str:
    return f"{share * 100:.0f} %" if share >= 0.01 else f"{share * 100:.1f} %"


def unjudged(ctx: Context) -> list[str]:
    """The report's straggler notes when there is no straggler finding: NCCL dumps
    (GPU states) without GPU durations, where enqueue times are the CPU's and
    completion times the watchdog's discovery times (module doc), or the slowest
    rank that stood out without mattering (noise)."""
    digests = [d for d in ctx.job.digests.values() if len(d)]
    noise = _judge(ctx)[1]
    if not ctx.job.gpu_states or not digests or any(d.duration_ns is not None for d in digests):
        return noise
    return [*noise, "straggler: these NCCL dumps carry no GPU durations (PyTorch records duration_ms "
            "only with TORCH_NCCL_ENABLE_TIMING=1); without them enqueue times are the CPU's, "
            "which runs ahead of the GPU, and completion times the watchdog's ~100 ms polls, so "
            "a rank that arrives late by less than that cannot be seen"]


def _same_clock(ctx: Context, t: _Rows, has_comp: BOOL, offset: F8) -> list[Finding] | None:
    """Enqueue times only, judged again as if the hosts' clocks agreed (module doc,
    "Clocks"). Only ranks late by at least ``SAME_CLOCK_MIN_NS`` (median) count:
    ``None`` when there is none; one is named, several make one warning naming
    none."""
    zero = np.zeros(len(t.ranks))
    a, think = _lateness_think(t, False, has_comp, zero)
    # no replay: a clock offset taken for lateness replays as a delay saved once, so
    # the lateness's share stays the measure of this fallback (and two hosts off
    # stay two candidates, naming none)
    blame = _blame(t, a, lambda: _excess(t, think), _floor(t), ctx.options.straggler_min_cost,
                   replay=False)
    if blame is None or len(blame.flagged) == 0:
        return None
    keep = [p for p in blame.flagged.tolist()
            if float(np.median(a[(t.pos == p) & blame.blamed])) >= SAME_CLOCK_MIN_NS]
    if not keep:
        return None
    blame = replace(blame, flagged=np.asarray(keep, dtype=np.int64))
    return _findings(ctx, _table(t, False, a, blame.excess, offset), blame, a, same_clock=True)


def _victims(ranks: I8, pos: IX, blame: _Blame) -> list[int]:
    """Ranks late at least ``MIN_BLAMED`` times only because they waited (not flagged)."""
    count = np.bincount(pos, weights=blame.late, minlength=len(ranks))
    flagged = set(blame.flagged.tolist())
    return [int(ranks[p]) for p in np.flatnonzero(count >= MIN_BLAMED) if p not in flagged]


def _findings(ctx: Context, table: ArrivalTable, blame: _Blame, a: F8, *,
              same_clock: bool = False, below_floor: bool = False) -> list[Finding]:
    """The warnings for ``blame``'s flagged ranks (one naming none when enqueue times
    leave more than ``MAX_ENQUEUE_ONLY`` candidates)."""
    flagged, blamed, count, total = blame.flagged, blame.blamed, blame.count, blame.total
    threshold, e = blame.threshold, blame.excess
    victims = _victims(table.ranks, table.pos, blame)
    offsets = {int(table.ranks[p]): round(float(table.offset_ns[p]) / 1e6, 3)
               for p in np.argsort(-np.abs(table.offset_ns))[:8]
               if abs(table.offset_ns[p]) > threshold}
    if table.from_completions:
        basis = "completion times" + (f" (resolution {_ms(table.resolution_ns)})"
                                      if table.resolution_ns else "")
    elif below_floor:
        basis = (f"enqueue times: its delay is below the {_ms(_floor(table))} that the dumps' "
                 f"completion times (resolution {_ms(table.resolution_ns)}) can show; clock "
                 "offsets estimated from arrivals")
    elif same_clock:
        basis = "enqueue times only, taking the hosts' clocks to agree (the dumps carry no " \
                "completion times)"
    else:
        basis = ("enqueue times only (the dumps carry no completion times; clock offsets "
                 "estimated from arrivals)")
    findings: list[Finding] = []
    order = sorted(flagged.tolist(), key=lambda p: -float(np.median(a[(table.pos == p) & blamed])))
    if not table.from_completions and len(order) > MAX_ENQUEUE_ONLY:
        return [_unattributed(ctx, table, order, count, total, threshold, basis, same_clock)]
    for p in order:
        rank = int(table.ranks[p])
        mine = (table.pos == p) & blamed
        lat, exc = a[mine], e[mine]
        median, p95 = float(np.median(lat)), float(np.percentile(lat, 95))
        by_group = Counter(table.gid[mine].tolist())
        top_gid = by_group.most_common(1)[0][0]
        top_op = Counter(table.op[mine & (table.gid == top_gid)].tolist()).most_common(1)[0][0]
        groups_txt = ", ".join(f"{_short_group(ctx, g)}: {n}" for g, n in by_group.most_common(3))
        others = [v for v in victims if v != rank]
        msg = (f"rank {rank} arrives last: late in {int(count[p])} of {int(total[p])} "
               f"{_judged_ops(table, p)} "
               f"by {_ms(median)} (median; p95 {_ms(p95)}) after the other members, in {groups_txt}; "
               f"its own time between ops is {_ms(float(np.median(exc)))} longer than its peers', "
               "so the delay starts on this rank")
        if others:
            msg += (f"; rank(s) {ctx.ranks(others)} also arrive late elsewhere only because they "
                    "waited for it")
        msg += _cost_txt(rank, blame, p) + f". Judged from {basis}"
        alternative = None
        if same_clock:
            alternative = round(float(table.offset_ns[p]) / 1e6, 3)
            msg += (f": the same times would show if its host's clock alone ran {_ms(alternative * 1e6)} "
                    "ahead of the others', so check that clock (NTP) before replacing anything")
        findings.append(_finding(
            ctx, rank, msg, top_gid, table.op_names.get(int(top_op)),
            late_in=int(count[p]), collectives=int(total[p]), median=median, p95=p95,
            lat=lat, exc=exc, by_group=by_group, threshold=threshold, others=others,
            basis="completion" if table.from_completions else "enqueue",
            clock_offsets_ms={str(r): v for r, v in offsets.items()},
            clock_alternative_ms=alternative,
            cost=(float(blame.cost[p]), blame.sustained[p], blame.min_cost),
            spans=blame.spans.get(p)))
    return findings[: ctx.options.max_findings_per_kind]


def _cost_txt(rank: int, blame: _Blame, p: int) -> str:
    """The significance sentence of a straggler's message."""
    how = ("late on most of the collectives it shares" if blame.sustained[p] == "most"
           else "late again and again at a regular stride, as at the same point of every step")
    spans = blame.spans.get(p)
    what_if = "" if spans is None else (
        f"; replayed without its delay the job's span would be {_ms(spans[1])} instead of "
        f"{_ms(spans[0])}")
    return (f"; rank {rank} costs the job ~{_pct(float(blame.cost[p]))} of its time ({how}"
            f"{what_if}; a straggler is named from {_pct(blame.min_cost)})")


def _finding(ctx: Context, rank: int, msg: str, gid: int, op: str | None, *, late_in: int,
             collectives: int, median: float, p95: float, lat: F8, exc: F8,
             by_group: Counter[int], threshold: float, others: list[int], basis: str,
             cost: tuple[float, str, float],
             spans: tuple[float, float] | None = None,
             clock_offsets_ms: dict[str, Any] | None = None,
             clock_alternative_ms: float | None = None) -> Finding:
    """The straggler finding for ``rank`` (both bases: arrivals and GPU durations);
    ``cost``: the share of the job's time it costs, how its lateness is sustained
    and the least share that names a straggler."""
    evidence: dict[str, Any] = {
        "late_in": late_in,
        "collectives": collectives,
        "cost_share": round(cost[0], 4),
        "min_cost_share": cost[2],
        "sustained": cost[1],
        "lateness_ms": {"median": round(median / 1e6, 3), "p95": round(p95 / 1e6, 3),
                        "max": round(float(lat.max()) / 1e6, 3)},
        "excess_think_ms": round(float(np.median(exc)) / 1e6, 3),
        "groups": [ctx.pg(g).to_json() | {"late_in": n} for g, n in by_group.most_common(8)],
        "threshold_ms": round(threshold / 1e6, 3),
        "basis": basis,
    }
    if spans is not None:
        evidence["what_if_span_ms"] = {"as_recorded": round(spans[0] / 1e6, 3),
                                       "without_its_delay": round(spans[1] / 1e6, 3)}
    if clock_offsets_ms is not None:
        evidence["clock_offsets_ms"] = clock_offsets_ms
    if clock_alternative_ms is not None:
        # judged taking the hosts' clocks to agree: the other explanation of the
        # same times is this rank's host clock running this far ahead
        evidence["clocks"] = "assumed_to_agree"
        evidence["alternative_clock_offset_ms"] = clock_alternative_ms
    evidence["late_only_by_waiting"] = others[:32]
    return Finding(kind=FindingKind.STRAGGLER, severity=Severity.WARNING, message=msg,
                   culprit_ranks=(rank,), waiting_ranks=(), pg=ctx.pg(gid), seq=None,
                   seq_kind=None, op=op, location=None, evidence=evidence)


def _has_durations(t: _Rows) -> bool:
    """Whether some collective has every member's GPU duration (NCCL, timing on)."""
    if t.dur is None:
        return False
    known = np.bincount(t.seg, weights=(~np.isnan(t.dur)).astype(np.float64), minlength=t.n_seg)
    return bool((known == t.seg_size).any())


def _duration_lateness(t: _Rows) -> tuple[F8, F8]:
    """Per row: GPU arrival lateness ``A`` and excess think time ``E``, from durations.

    All members of a collective complete together and ``duration_ms`` runs from
    when this rank's GPU reached it, so ``A = median(duration) - duration``
    (upper median: in a two-member group, the other member). Members were also
    released together, by the group's previous collective; since then a member
    spent ``B`` in its own ops (their durations: transfers, and waits for ranks of
    other groups) and the rest of the time, the same for all, computing. So
    ``V = B + duration`` is that common time minus the member's think time, and
    ``E = median(V) - V`` its think time beyond the median member's (upper
    median of ``V``: the member that thought least). That holds when members do
    the same work between two collectives of the group (TP, DP groups): ``E`` is
    only judged where every member ran as many ops since the previous one (a
    group spanning pipeline stages, whose programs differ, mostly is not). NaN
    where unknown.
    """
    assert t.dur is not None and t.between is not None and t.n_between is not None
    known = np.bincount(t.seg, weights=(~np.isnan(t.dur)).astype(np.float64), minlength=t.n_seg)
    dur = np.where((known == t.seg_size)[t.seg], t.dur, np.nan)
    lateness = t.by_seg.median(dur, upper=True)[t.seg] - dur
    v = dur + t.between
    valid = np.bincount(t.seg, weights=(~np.isnan(v)).astype(np.float64), minlength=t.n_seg)
    lo = np.full(t.n_seg, np.inf)
    hi = np.full(t.n_seg, -np.inf)
    counted = np.nan_to_num(t.n_between, nan=-1.0)  # unknown: ``valid`` fails anyway
    np.minimum.at(lo, t.seg, counted)
    np.maximum.at(hi, t.seg, counted)
    v = np.where(((valid == t.seg_size) & (lo == hi))[t.seg], v, np.nan)
    return lateness, t.by_seg.median(v, upper=True)[t.seg] - v


def _detect_from_durations(ctx: Context, t: _Rows) -> tuple[list[Finding], list[str]]:
    """The straggler rule on NCCL dumps with GPU durations (module doc)."""
    a, e = _duration_lateness(t)
    blame = _blame(t, a, lambda: e, float(FLOOR_NS), ctx.options.straggler_min_cost,
                   replay=False)
    if blame is None:
        return [], []
    notes = _noise_notes(ctx, t, blame, a)
    flagged, blamed, count, total = blame.flagged, blame.blamed, blame.count, blame.total
    threshold = blame.threshold
    victims = _victims(t.ranks, t.pos, blame)
    gid = t.gid.astype(np.int64)
    op = t.op.astype(np.int64)
    findings: list[Finding] = []
    order = sorted(flagged.tolist(), key=lambda p: -float(np.median(a[(t.pos == p) & blamed])))
    for p in order:
        rank = int(t.ranks[p])
        mine = (t.pos == p) & blamed
        lat, exc = a[mine], e[mine]
        median, p95 = float(np.median(lat)), float(np.percentile(lat, 95))
        by_group = Counter(gid[mine].tolist())
        top_gid = by_group.most_common(1)[0][0]
        top_op = Counter(op[mine & (gid == top_gid)].tolist()).most_common(1)[0][0]
        groups_txt = ", ".join(f"{_short_group(ctx, g)}: {n}" for g, n in by_group.most_common(3))
        others = [v for v in victims if v != rank]
        msg = (f"rank {rank} arrives last: its GPU reached {int(count[p])} of {int(total[p])} "
               f"collectives {_ms(median)} (median; p95 {_ms(p95)}) after the other members, "
               f"in {groups_txt}; its GPU's time outside collective and p2p ops since the "
               f"group's previous collective is {_ms(float(np.median(exc)))} longer than its "
               "peers', so the delay starts on this rank")
        if others:
            msg += (f"; rank(s) {ctx.ranks(others)} also arrive late elsewhere only because they "
                    "waited for it")
        msg += (_cost_txt(rank, blame, p)
                + ". Judged from the GPU durations of the ops (duration_ms, timing on)")
        findings.append(_finding(
            ctx, rank, msg, top_gid, t.op_names.get(int(top_op)),
            late_in=int(count[p]), collectives=int(total[p]), median=median, p95=p95,
            lat=lat, exc=exc, by_group=by_group, threshold=threshold, others=others,
            basis="duration", cost=(float(blame.cost[p]), blame.sustained[p], blame.min_cost)))
    return findings[: ctx.options.max_findings_per_kind], notes


def _unattributed(ctx: Context, table: ArrivalTable, order: list[int], count: npt.NDArray[Any],
                  total: npt.NDArray[Any], threshold: float, basis: str,
                  same_clock: bool = False) -> Finding:
    """One warning, naming no rank, when enqueue times cannot tell the source."""
    ranks = sorted(int(table.ranks[p]) for p in order)
    return Finding(
        kind=FindingKind.STRAGGLER,
        severity=Severity.WARNING,
        message=(f"ranks {ctx.ranks(ranks)} arrive late at their collectives, but judged from "
                 f"{basis}, lateness that one slow rank passes on to its peers' other groups "
                 "cannot be told from its source"
                 + (", nor from hosts' clocks that disagree" if same_clock else "")
                 + ": no rank is named (candidates in evidence.candidates; dumps with "
                 "completion times, e.g. frforensics' own, can tell)"),
        culprit_ranks=(),
        waiting_ranks=(),
        evidence={
            "candidates": ranks,
            "late_in": {str(int(table.ranks[p])): int(count[p]) for p in order[:32]},
            "collectives": {str(int(table.ranks[p])): int(total[p]) for p in order[:32]},
            "threshold_ms": round(threshold / 1e6, 3),
            "basis": "enqueue",
        },
    )


def _member_index(members: dict[int, int] | range, rank: int) -> int:
    """``rank``'s index among a group's members, -1 when it is none of them."""
    if isinstance(members, range):
        return members.index(rank) if rank in members else -1
    return members.get(rank, -1)
