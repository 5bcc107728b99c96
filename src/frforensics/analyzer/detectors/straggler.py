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

Dumps without completion times (PyTorch's gloo recorder) fall back to enqueue
times: per-rank clock offsets are estimated as each rank's median arrival
offset, and a member's previous release as the last arrival at its previous
collective. Per-rank clock offsets are always estimated (from completions when
known, which are near-simultaneous on all members) and reported in evidence.
Everything is vectorized: thousands of ranks × 2000 entries take well under a
second.

Worked example (4 ranks, default group; rank 1 sleeps 300 ms before each step)::

    step k:  all_reduce #3k+2: ranks 0,2,3 enqueue at t, rank 1 at t+300 ms
             all_reduce #3k+3, #3k+4: everyone enqueues within 1 ms
    -> straggler, rank 1, late in 8 of 24 collectives by 300 ms (median, p95)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from frforensics.analyzer.context import Context
from frforensics.model import OpState
from frforensics.report import Finding, FindingKind, Severity

__all__ = ["ArrivalTable", "arrivals", "detect"]

FLOOR_NS: Final = 1_000_000  # lateness below 1 ms is never worth a warning
SIGMAS: Final = 8.0
MIN_BLAMED: Final = 3
MIN_FRACTION: Final = 0.05

F8 = npt.NDArray[np.float64]
I8 = npt.NDArray[np.int64]
BOOL = npt.NDArray[np.bool_]


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


def _seg_median(seg: I8, values: F8, n_seg: int, *, upper: bool = False) -> F8:
    """Lower (or upper) median of ``values`` per segment id (NaN values are ignored).

    Which one matters for two-member groups, where it picks the other member:
    lateness compares a member with the one that waited longest, excess think
    time with the one that thought least.
    """
    out = np.full(n_seg, np.nan)
    ok = ~np.isnan(values)
    if not ok.any():
        return out
    s, v = seg[ok], values[ok]
    order = np.lexsort((v, s))
    s, v = s[order], v[order]
    counts = np.bincount(s, minlength=n_seg)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    has = counts > 0
    mid = counts[has] // 2 if upper else (counts[has] - 1) // 2
    out[has] = v[starts[has] + mid]
    return out


def arrivals(ctx: Context) -> ArrivalTable | None:
    """Build the :class:`ArrivalTable` of the job (``None`` when nothing to compare)."""
    job = ctx.job
    ranks = sorted(job.digests)
    if len(ranks) < 2:
        return None
    gsize = np.array([len(g.ranks) for g in job.groups] + [0], dtype=np.int64)
    parts: dict[str, list[npt.NDArray[Any]]] = {k: [] for k in
                                                ("key", "pos", "enq", "comp", "rel", "prev", "op")}
    op_names: dict[int, str] = {}
    max_seq = 1
    for d in job.digests.values():
        if len(d):
            max_seq = max(max_seq, int(d.seq.max()) + 2)
    resolution = 0
    for at, rank in enumerate(ranks):
        d = job.digests[rank]
        if not len(d):
            continue
        resolution = max(resolution, d.completion_resolution_ns)
        lut = np.array([job.group_of.get((rank, i), -1) for i in range(len(d.groups))] + [-1],
                       dtype=np.int64)
        local = np.where((d.group >= 0) & (d.group < len(d.groups)), d.group, len(d.groups))
        gid = lut[local]
        comp = np.where(d.state >= OpState.COMPLETED, d.t_complete_ns, 0).astype(np.float64)
        comp[comp <= 0] = np.nan
        # release: the latest completion among earlier entries, never after this enqueue
        prev_max = np.fmax.accumulate(np.concatenate(([np.nan], comp[:-1])))
        enq = d.t_enqueue_ns.astype(np.float64)
        rel = np.fmin(prev_max, enq)
        rows = np.flatnonzero((d.is_p2p == 0) & (gid >= 0) & (d.t_enqueue_ns > 0))
        if len(rows) == 0:
            continue
        key = gid[rows] * max_seq + d.seq[rows]
        _, first = np.unique(key, return_index=True)  # coalesced: one row per unit
        rows = np.sort(rows[first])
        key = gid[rows] * max_seq + d.seq[rows]
        prev = np.concatenate(([-1], key[:-1]))  # previous collective of this rank
        parts["key"].append(key)
        parts["pos"].append(np.full(len(rows), at, dtype=np.int64))
        parts["enq"].append(enq[rows])
        parts["comp"].append(comp[rows])
        parts["rel"].append(rel[rows])
        parts["prev"].append(prev)
        parts["op"].append(d.op_hash[rows].astype(np.int64))
        op_names.update(d.op_names)
    if not parts["key"]:
        return None
    key = np.concatenate(parts["key"])
    pos = np.concatenate(parts["pos"])
    enq = np.concatenate(parts["enq"])
    comp = np.concatenate(parts["comp"])
    rel = np.concatenate(parts["rel"])
    prev = np.concatenate(parts["prev"])
    op = np.concatenate(parts["op"])

    uniq, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
    full = counts == gsize[uniq // max_seq]
    keep = full[inverse] & (counts[inverse] > 1)
    if not keep.any():
        return None
    # re-number the kept segments densely
    kept_keys = uniq[full & (counts > 1)]
    key, pos, enq, comp, rel, prev, op = (
        key[keep], pos[keep], enq[keep], comp[keep], rel[keep], prev[keep], op[keep])
    seg = np.searchsorted(kept_keys, key)
    n_seg = len(kept_keys)
    gid = kept_keys[seg] // max_seq
    n_ranks = len(ranks)

    comp_known = np.bincount(seg, weights=(~np.isnan(comp)).astype(np.float64), minlength=n_seg)
    seg_size = np.bincount(seg, minlength=n_seg)
    seg_has_comp = comp_known == seg_size
    from_completions = bool(seg_has_comp.mean() > 0.5)

    offset = np.zeros(n_ranks)
    base = np.where(seg_has_comp[seg], comp, np.nan) if from_completions else enq.copy()
    for _ in range(3):  # a few rounds: groups overlap, so offsets settle across the job
        shifted = base - offset[pos]
        resid = shifted - _seg_median(seg, shifted, n_seg)[seg]
        step = _seg_median(pos, resid, n_ranks)
        offset += np.nan_to_num(step)
    offset -= np.median(offset)

    if from_completions:
        wait = np.where(seg_has_comp[seg], comp - enq, np.nan)
        lateness = _seg_median(seg, wait, n_seg, upper=True)[seg] - wait
        think = enq - rel
    else:
        arrive = enq - offset[pos]
        lateness = arrive - _seg_median(seg, arrive, n_seg)[seg]
        last_arrival = np.full(n_seg + 1, np.nan)
        np.fmax.at(last_arrival, seg, arrive)
        pseg = np.searchsorted(kept_keys, prev)
        found = (prev >= 0) & (pseg < n_seg) & (kept_keys[np.minimum(pseg, n_seg - 1)] == prev)
        released = np.where(found, last_arrival[np.where(found, pseg, n_seg)], np.nan)
        think = arrive - released
    valid = ~np.isnan(think)
    valid_count = np.bincount(seg, weights=valid.astype(np.float64), minlength=n_seg)
    think = np.where((valid_count == seg_size)[seg], think, np.nan)
    excess = think - _seg_median(seg, think, n_seg)[seg]
    return ArrivalTable(
        ranks=np.asarray(ranks, dtype=np.int64), pos=pos, gid=gid, seg=seg,
        lateness=lateness, excess=excess, offset_ns=offset, op=op, op_names=op_names,
        from_completions=from_completions, resolution_ns=resolution,
    )


def _short_group(ctx: Context, gid: int) -> str:
    g = ctx.job.groups[gid]
    desc = g.desc if g.desc and g.desc != "undefined" else f"group {g.name}"
    return f"{desc} (ranks {ctx.ranks(g.ranks)})"


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.1f} ms" if abs(ns) >= 1e5 else f"{ns / 1e3:.0f} µs"


def detect(ctx: Context) -> list[Finding]:
    """One warning per rank that consistently arrives last."""
    table = arrivals(ctx)
    if table is None:
        return []
    e, a = table.excess, table.lateness
    finite = e[~np.isnan(e)]
    if len(finite) == 0:
        return []
    mad = float(np.median(np.abs(finite - np.median(finite))))
    threshold = max(FLOOR_NS, 3.0 * table.resolution_ns, SIGMAS * 1.4826 * mad)
    blamed = (e > threshold) & (a > threshold)
    late = (a > threshold) & ~blamed
    n_ranks = len(table.ranks)
    total = np.bincount(table.pos, weights=~np.isnan(e), minlength=n_ranks)
    count = np.bincount(table.pos, weights=blamed, minlength=n_ranks)
    typical = float(np.median(count))
    flagged = np.flatnonzero((count >= MIN_BLAMED) & (count >= MIN_FRACTION * np.maximum(total, 1))
                             & (count > 4 * typical + 2))
    if len(flagged) == 0:
        return []
    victims_count = np.bincount(table.pos, weights=late, minlength=n_ranks)
    victims = [int(table.ranks[p]) for p in np.flatnonzero(victims_count >= MIN_BLAMED)
               if p not in set(flagged.tolist())]
    offsets = {int(table.ranks[p]): round(float(table.offset_ns[p]) / 1e6, 3)
               for p in np.argsort(-np.abs(table.offset_ns))[:8]
               if abs(table.offset_ns[p]) > threshold}
    basis = ("completion times" + (f" (resolution {_ms(table.resolution_ns)})"
                                   if table.resolution_ns else "")
             if table.from_completions else
             "enqueue times only (the dumps carry no completion times; clock offsets "
             "estimated from arrivals)")
    findings: list[Finding] = []
    order = sorted(flagged.tolist(), key=lambda p: -float(np.median(a[(table.pos == p) & blamed])))
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
        msg = (f"rank {rank} arrives last: late in {int(count[p])} of {int(total[p])} collectives "
               f"by {_ms(median)} (median; p95 {_ms(p95)}) after the other members, in {groups_txt}; "
               f"its own time between ops is {_ms(float(np.median(exc)))} longer than its peers', "
               "so the delay starts on this rank")
        if others:
            msg += (f"; rank(s) {ctx.ranks(others)} also arrive late elsewhere only because they "
                    "waited for it")
        msg += f". Judged from {basis}"
        findings.append(Finding(
            kind=FindingKind.STRAGGLER,
            severity=Severity.WARNING,
            message=msg,
            culprit_ranks=(rank,),
            waiting_ranks=(),
            pg=ctx.pg(top_gid),
            seq=None,
            seq_kind=None,
            op=table.op_names.get(int(top_op)),
            location=None,
            evidence={
                "late_in": int(count[p]),
                "collectives": int(total[p]),
                "lateness_ms": {"median": round(median / 1e6, 3), "p95": round(p95 / 1e6, 3),
                                "max": round(float(lat.max()) / 1e6, 3)},
                "excess_think_ms": round(float(np.median(exc)) / 1e6, 3),
                "groups": [ctx.pg(g).to_json() | {"late_in": n} for g, n in by_group.most_common(8)],
                "threshold_ms": round(threshold / 1e6, 3),
                "basis": "completion" if table.from_completions else "enqueue",
                "clock_offsets_ms": {str(r): v for r, v in offsets.items()},
                "late_only_by_waiting": others[:32],
            },
        ))
    return findings[: ctx.options.max_findings_per_kind]
