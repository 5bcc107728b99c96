"""What-if replay: the job's span with some of its ranks' delays removed (issue 29).

A straggler costs the job what removing its delay would save, not the sum of its
lateness: a rank late at a collective delays its peers only where they would
otherwise not have waited for someone else, and a delay overlapped by another
rank's is not saved at all. So the recorded dependency graph is replayed:

* a collective completes when its last member arrives, plus its recorded service
  time (recorded completion minus recorded last arrival, never below 0; without
  completion times, as in PyTorch's gloo dumps, none);
* a rank arrives at its next op its recorded gap after what released it: the
  previous op's completion when it was issued after its own completion of it (a
  blocking call), or the previous op's arrival when it was issued while that was in
  flight (async ops, DDP's buckets);
* the rank's first op in the window arrives when it was recorded.

Replayed once as recorded (``removed`` all zero: the replay reproduces the
recorded span, up to clock-offset error) and once with the suspect's excess think
time removed wherever it stands out (the caller, ``straggler._blame``); the saving
is the difference.
Times are on one clock: the caller subtracts each rank's estimated clock offset.

Worked example (2 ranks, 3 all_reduces, rank 1 thinks 50 ms longer before #2)::

    as recorded: #1 done at 10, #2 at 70 (rank 1 arrives 60), #3 at 90   span 90 ms
    rank 1's 50 ms removed: #2 done at 20, #3 at 40                      span 40 ms
    -> saving 50 ms, 56 % of the span

Rows are (rank, collective) pairs in rank order, record order within a rank, of
collectives every member recorded (``straggler._Rows``); the replay starts when
every rank's window has begun (each ring covers its own stretch of time) and the
span runs from there. One Python step per row, so the caller bounds how many rows it
replays (``MAX_ROWS``).
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = ["MAX_ROWS", "replay_spans"]

#: rows replayed at most (about 1 s of Python); above, the caller keeps its estimate
MAX_ROWS: Final = 1_000_000

F8 = npt.NDArray[np.float64]


def replay_spans(pos: npt.NDArray[np.integer], seg: npt.NDArray[np.integer], enq: F8,
                 comp: F8, removed: F8, *, tolerance_ns: float = 2e6) -> tuple[float, float]:
    """The span as recorded and with ``removed`` (ns per row) taken off each row's
    gap; ``(nan, nan)`` when nothing completed. ``tolerance_ns``: how much later than
    the next enqueue a completion may be stamped and still have released it (the
    completion times' resolution: a watcher stamps them after the call returned)."""
    if len(seg) == 0:
        return float("nan"), float("nan")
    # rank after rank, in enqueue order within a rank (p2p pairs may be appended)
    by_rank = np.lexsort((enq, pos))
    pos, seg, enq, comp, removed = pos[by_rank], seg[by_rank], enq[by_rank], comp[by_rank], \
        removed[by_rank]
    # from the time every rank's window has begun: each rank's ring covers its own
    # stretch of time (a rank issuing more ops holds a shorter one), and before its
    # first row a rank's arrivals are unknown
    firsts = np.r_[True, pos[1:] != pos[:-1]]
    common = float(enq[firsts].max())
    inside = enq >= common
    pos, seg, enq, comp, removed = pos[inside], seg[inside], enq[inside], comp[inside], \
        removed[inside]
    if len(seg) == 0:
        return float("nan"), float("nan")
    n_seg = int(seg.max()) + 1
    last = np.full(n_seg, -np.inf)
    np.maximum.at(last, seg, enq)
    # no completion times (PyTorch's gloo dumps: enqueue times only): a collective
    # is taken to complete at its last arrival
    comp = np.where(np.isnan(comp), last[seg], comp)
    done = np.full(n_seg, -np.inf)
    np.maximum.at(done, seg, np.where(np.isnan(comp), -np.inf, comp))
    finished = np.isfinite(done)
    service = np.zeros(n_seg)
    service[finished] = np.maximum(done[finished] - last[finished], 0.0)
    # each row's predecessor on its rank, and whether it was issued after that
    # predecessor completed (a blocking gap) or while it was in flight
    prev = np.arange(len(seg)) - 1
    first = np.r_[True, pos[1:] != pos[:-1]]
    prev[first] = -1
    j = np.maximum(prev, 0)
    pdone = np.where(prev >= 0, done[seg[j]], np.nan)
    penq = np.where(prev >= 0, enq[j], np.nan)
    # issued after its own completion of the predecessor (its own clock: the
    # collective's completion on another member may read a little later)
    own = np.where(prev >= 0, comp[j], np.nan)
    order = np.argsort(enq, kind="stable")
    start = common
    # The widest tolerance whose dependencies the recorded times do not contradict:
    # a row read as blocking on a predecessor that completed up to ``tolerance``
    # after it was issued may make a cycle (a pipeline stage posts its next receive
    # before its previous one is stamped done: rows 4 of 5 then fell back to recorded
    # times and the replay saved 2 % of a 40 ms-per-microbatch straggler's 85 %);
    # halved until every row is placed in dependency order, else the first kept.
    tol = tolerance_ns
    chosen = None
    while True:
        after = (prev >= 0) & np.isfinite(pdone) & ~np.isnan(own) & (enq >= own - tol)
        # the gap after a blocking predecessor counts from the collective's completion
        # (slightly negative where this member's completion read earlier)
        gap = np.where(after, enq - pdone, enq - penq)
        base, stuck = _run(order, prev, after, gap, seg, enq, service, finished, n_seg, None)
        if chosen is None or not stuck:
            chosen = (after, gap, base)
        if not stuck or tol < _MIN_TOLERANCE_NS:
            break
        tol /= 2
    after, gap, base = chosen
    what_if, _ = _run(order, prev, after, gap, seg, enq, service, finished, n_seg, removed)
    return base - start, what_if - start


#: the narrowest tolerance tried (``replay_spans``)
_MIN_TOLERANCE_NS: Final = 1e6


def _run(order: npt.NDArray[np.intp], prev: npt.NDArray[np.intp], after: npt.NDArray[np.bool_],
         gap: F8, seg: npt.NDArray[np.integer], enq: F8, service: F8,
         finished: npt.NDArray[np.bool_], n_seg: int, removed: F8 | None) -> tuple[float, int]:
    """One replay (:class:`_Replay`): the end of the last completed collective, and
    how many rows the dependency order could not reach."""
    r = _Replay(prev, after, gap, seg, enq, service, finished, n_seg, removed)
    return r.run(order), r.stuck


class _Replay:
    """One replay, in dependency order (Kahn's algorithm): a row is placed once its
    rank's previous row is, and, after a blocking predecessor, once that
    predecessor's collective has completed; a collective completes once its last
    member is placed. Rows left over (a dependency the recorded times contradict,
    from clock error) are placed in recorded arrival order against the recorded
    completions."""

    def __init__(self, prev: npt.NDArray[np.intp], after: npt.NDArray[np.bool_], gap: F8,
                 seg: npt.NDArray[np.integer], enq: F8, service: F8,
                 finished: npt.NDArray[np.bool_], n_seg: int, removed: F8 | None) -> None:
        n = len(seg)
        self.prev: list[int] = prev.tolist()
        self.after: list[bool] = after.tolist()
        self.gap: list[float] = gap.tolist()
        self.seg: list[int] = seg.tolist()
        self.enq: list[float] = enq.tolist()
        self.cut: list[float] = [0.0] * n if removed is None else removed.tolist()
        self.members = np.bincount(seg, minlength=n_seg).tolist()
        self.service, self.finished = service.tolist(), finished.tolist()
        self.arrive: list[float | None] = [None] * n
        self.arrived = [0] * n_seg
        self.latest = [-np.inf] * n_seg
        self.complete: list[float | None] = [None] * n_seg
        self.succ = [-1] * n  # the next row of the same rank
        self.waiting: list[list[int]] = [[] for _ in range(n_seg)]  # blocked on a collective
        self.pending = [0] * n
        for i, j in enumerate(self.prev):
            if j >= 0:
                self.succ[j] = i
                self.pending[i] += 1
                if self.after[i]:
                    self.pending[i] += 1
                    self.waiting[self.seg[j]].append(i)
        self.end = -np.inf
        self.stuck = 0  # rows the dependency order could not reach (``run``)

    def run(self, order: npt.NDArray[np.intp]) -> float:
        self._drain([i for i, p in enumerate(self.pending) if p == 0])
        self.stuck = sum(a is None for a in self.arrive)
        for i in order.tolist():  # what the dependency order could not reach
            if self.arrive[i] is None:
                self._drain([i])
        if self.end > -np.inf:
            return float(self.end)
        placed = [a for a in self.arrive if a is not None]
        return float(max(placed)) if placed else float("nan")

    def _drain(self, ready: list[int]) -> None:
        while ready:
            i = ready.pop()
            if self.arrive[i] is None:
                ready.extend(self._place(i, self._time_of(i)))

    def _time_of(self, i: int) -> float:
        j = self.prev[i]
        if j < 0:
            return self.enq[i]
        pj = self.arrive[j]
        pj = self.enq[j] if pj is None else pj
        if self.after[i]:
            c = self.complete[self.seg[j]]
            base = (self.enq[i] - self.gap[i]) if c is None else c  # else: as recorded
            t = base + self.gap[i] - self.cut[i]
        else:
            t = pj + self.gap[i] - self.cut[i]
        return max(t, pj)  # a rank never issues its ops out of order

    def _place(self, i: int, t: float) -> list[int]:
        self.arrive[i] = t
        freed = []
        k = self.succ[i]
        if k >= 0:
            self.pending[k] -= 1
            if self.pending[k] == 0:
                freed.append(k)
        s = self.seg[i]
        self.latest[s] = max(self.latest[s], t)
        self.arrived[s] += 1
        if self.arrived[s] == self.members[s]:
            done = self.latest[s] + self.service[s]
            self.complete[s] = done
            if self.finished[s]:
                self.end = max(self.end, done)
            for k in self.waiting[s]:
                self.pending[k] -= 1
                if self.pending[k] == 0:
                    freed.append(k)
        return freed
