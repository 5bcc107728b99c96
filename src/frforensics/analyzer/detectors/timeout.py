"""``timeout``: every member entered a collective, and it never completed.

Rule: a blocked rank that waits on nobody — every member of its group is *in*
the same seq — is stuck *inside* the op: a network, NCCL or device fault, or a
kernel that never ran. A member is in an op only where it is really blocked
(its earliest unfinished op) or where the op's kernel ``started`` (NCCL); a
member holding the op only as a queued entry is waited for instead
(``analyzer.waits``), so this rule never fires for it. The least advanced
members (still ``scheduled`` while others ``started``; ``started`` while others
completed — a kernel that never finished on that rank) are the culprits. Only
when every member started the op (NCCL), or, in dumps with no GPU state
(gloo), every member is blocked in it, are all named and the message says the
fault is below the framework. The elapsed time is compared with the op's ``timeout_ms``
where the dump time is known. Collectives already reported as mismatched are
not reported again. Severity error, status hang.

A second rule covers dumps taken *after* the backend's timeout fired, when every
entry is already retired (gloo marks failed work retired): members that entered
a collective more than its ``timeout_ms`` after the first member did arrived
after their peers had given up — they are the culprits.

Worked example (NCCL, 4 ranks; rank 2's GPU hung)::

    ranks 0,1,3: all_reduce #88 state started    rank 2: all_reduce #88 state scheduled
    unfinished for 612 s, timeout 600 s
    -> timeout, culprit 2, waiting ranks 0,1,3
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from frforensics.analyzer.context import Context
from frforensics.analyzer.merge import CollectiveRows, collective_rows
from frforensics.analyzer.waits import Wait
from frforensics.model import OpState
from frforensics.report import Finding, FindingKind, Severity


def detect(ctx: Context) -> list[Finding]:
    """One finding per collective that all members entered but none finished."""
    stuck: dict[tuple[int, int], list[Wait]] = defaultdict(list)
    for rank, root in ctx.graph.roots.items():
        if root.kind == "stuck_in_op" and rank in ctx.graph.waits:
            w = ctx.graph.waits[rank]
            if w.seq_kind == "collective" and (w.gid, w.seq) not in ctx.desynced:
                stuck[(w.gid, w.seq)].append(w)
    findings = []
    for (gid, seq), waits in stuck.items():
        states: dict[int, OpState] = {}
        for w in waits:
            states[w.rank] = w.detail.state if w.detail is not None else OpState.SCHEDULED
        for member in ctx.job.dumped_members(gid):
            if member not in states:
                state = ctx.job.state_in(member, gid, seq)
                if state is not None:
                    states[member] = state
        wait = waits[0]
        ages = [w.age_s for w in waits if w.age_s is not None]
        timeout_ms = max((w.detail.timeout_ms for w in waits if w.detail is not None), default=0)
        arrivals = _arrivals(ctx, gid, seq)
        late = _late_members(arrivals, timeout_ms)
        lowest = min(states.values())
        if late and len(late) < len(arrivals):
            # Members that arrived after the others had already given up.
            culprits = late
            distinguishable = True
            for r in late:
                states.setdefault(r, OpState.SCHEDULED)
        else:
            culprits = sorted(r for r, s in states.items() if s == lowest)
            distinguishable = len(set(states.values())) > 1
        waiting = sorted(set(states) - set(culprits))
        if ages and timeout_ms:
            past = max(ages) * 1000 >= timeout_ms
            clock = (f"unfinished for {max(ages):.1f} s, "
                     f"{'past' if past else 'within'} its timeout of {timeout_ms / 1000:.0f} s")
        elif ages:
            clock = f"unfinished for {max(ages):.1f} s"
        else:
            clock = "dump time unknown, so whether it ran past its timeout could not be judged"
        if late and culprits == late:
            spread = (max(arrivals[r] for r in late) - min(arrivals.values())) / 1e9
            msg = (f"rank(s) {ctx.ranks(late)} entered {ctx.describe(wait)} {spread:.1f} s after "
                   f"the first member, past its timeout of {timeout_ms / 1000:g} s: ranks "
                   f"{ctx.ranks(waiting)} had waited and failed by then ({clock})")
        elif OpState.COMPLETED in states.values():
            done = sorted(r for r, s in states.items() if s == OpState.COMPLETED)
            msg = (f"{ctx.describe(wait)} never finished on rank(s) {ctx.ranks(culprits)}: ranks "
                   f"{ctx.ranks(done)} completed it and moved on, while it stayed "
                   f"{lowest.name.lower()} there ({clock}); the fault is below the framework on "
                   f"{'that rank' if len(culprits) == 1 else 'those ranks'} (GPU, NCCL or network)")
        elif distinguishable:
            msg = (f"every member entered {ctx.describe(wait)} but it never completed ({clock}); "
                   f"rank(s) {ctx.ranks(culprits)} are the least advanced "
                   f"({lowest.name.lower()} while the others are further)")
        else:
            msg = (f"every member entered {ctx.describe(wait)} and all are stuck in it ({clock}); "
                   "no rank is behind the others, so the fault is likely below the framework "
                   "(network, NCCL, device)")
        findings.append(Finding(
            kind=FindingKind.TIMEOUT,
            severity=Severity.ERROR,
            message=msg,
            culprit_ranks=tuple(culprits),
            waiting_ranks=tuple(waiting),
            pg=ctx.pg(gid),
            seq=seq,
            seq_kind="collective",
            op=wait.op,
            location=wait.location,
            evidence={"states": {str(r): s.name.lower() for r, s in sorted(states.items())},
                      "timeout_ms": timeout_ms, "distinguishable": distinguishable},
        ))
    findings.extend(_late_entries(ctx, {(f.pg.name, f.seq) for f in findings if f.pg}))
    return findings[: ctx.options.max_findings_per_kind]


def _arrivals(ctx: Context, gid: int, seq: int) -> dict[int, int]:
    """When each member that has collective ``seq`` of ``gid`` in its ring enqueued it."""
    out: dict[int, int] = {}
    for rank in ctx.job.dumped_members(gid):
        view = ctx.job.view(rank, gid)
        if view is None or len(view.coll_rows) == 0:
            continue
        d = ctx.job.digests[rank]
        rows = view.coll_rows[d.seq[view.coll_rows] == seq]
        if len(rows) and int(d.t_enqueue_ns[rows[0]]):
            out[rank] = int(d.t_enqueue_ns[rows[0]])
    return out


def _late_members(arrivals: dict[int, int], timeout_ms: int) -> list[int]:
    """Members that entered more than ``timeout_ms`` after the first one did."""
    if not timeout_ms or len(arrivals) < 2:
        return []
    first = min(arrivals.values())
    return sorted(r for r, t in arrivals.items() if t - first > timeout_ms * 1_000_000)


def _late_entries(ctx: Context, known: set[tuple[str, int | None]]) -> list[Finding]:
    """Collectives that some member entered later than the timeout after the first.

    Every group at once (``merge.collective_rows``; the tests hold the group by
    group form as their oracle)."""
    job = ctx.job
    c = collective_rows(job)
    if len(c.seq) == 0:
        return []
    t_all, tmo_all = c.getter("t_enqueue_ns"), c.getter("timeout_ms")
    firsts: list[tuple[int, int, int]] = []
    for order in c.ordered():  # whole groups at a time, by (gid, seq), member order
        firsts += _first_late(c, order, t_all, tmo_all)
    del t_all, tmo_all
    findings: list[Finding] = []
    for g, s0, timeout_ms in firsts:
        group = job.groups[g]
        if (group.name, s0) in known or (g, s0) in ctx.desynced:
            continue
        finding = _late_finding(ctx, g, s0, timeout_ms)
        if finding is not None:
            findings.append(finding)
            if len(findings) >= ctx.options.max_findings_per_kind:
                break
    return findings


def _first_late(c: CollectiveRows, order: npt.NDArray[Any],
                t_all: Callable[[npt.NDArray[Any]], npt.NDArray[np.int64]],
                tmo_all: Callable[[npt.NDArray[Any]], npt.NDArray[np.int64]],
                ) -> list[tuple[int, int, int]]:
    """(group, seq, timeout ms) of each group's first late seq among the rows
    ``order`` (whole groups, sorted), of groups where more than one member has
    collectives: among its late rows the earliest entry (the first in member, then
    record order on a tie), as the by-group sort has it."""
    seq, gid = c.seq[order], c.gid[order]
    t = t_all(order).astype(np.int64, copy=False)
    tmo = tmo_all(order).astype(np.int64, copy=False)
    starts = np.flatnonzero(np.r_[True, (gid[1:] != gid[:-1]) | (seq[1:] != seq[:-1])])
    first_t = np.repeat(np.minimum.reduceat(t, starts), np.diff(np.r_[starts, len(seq)]))
    late = (t > 0) & (first_t > 0) & (tmo > 0) & ((t - first_t) > tmo * 1_000_000)
    hits = np.flatnonzero(late)
    if len(hits) == 0:
        return []
    group_starts = np.flatnonzero(np.r_[True, gid[1:] != gid[:-1]])
    group_ends = np.r_[group_starts[1:], len(gid)]
    hit_gid, hit_seq = gid[hits], seq[hits]
    bounds = np.flatnonzero(np.r_[True, (hit_gid[1:] != hit_gid[:-1])
                                  | (hit_seq[1:] != hit_seq[:-1]), True])
    out: list[tuple[int, int, int]] = []
    for i in np.unique(hit_gid, return_index=True)[1].tolist():
        block = hits[i:int(bounds[np.searchsorted(bounds, i, side="right")])]
        pick = int(block[int(np.argmin(t[block]))])
        g = int(gid[pick])
        lo = int(np.searchsorted(group_starts, np.searchsorted(gid, g)))
        if len(np.unique(c.at[order[group_starts[lo]:group_ends[lo]]])) < 2:
            continue  # one member has the group's collectives: nobody to be late against
        out.append((g, int(seq[pick]), int(tmo[pick])))
    return out


def _late_finding(ctx: Context, gid: int, s0: int, timeout_ms: int) -> Finding | None:
    """The late-entry finding at collective ``s0`` of ``gid`` (None: nobody late)."""
    group = ctx.job.groups[gid]
    arrivals = _arrivals(ctx, gid, s0)
    culprits = _late_members(arrivals, timeout_ms)
    if not culprits:
        return None
    on_time = sorted(set(arrivals) - set(culprits))
    delay_s = (max(arrivals[r] for r in culprits) - min(arrivals.values())) / 1e9
    timeout_s = float(timeout_ms) / 1000
    d = ctx.job.digests[culprits[0]]
    local = group.local.get(culprits[0])
    det = next((x for x in d.details.values() if x.group == local and x.seq == s0
                and not x.is_p2p), None)
    op = det.op if det is not None else d.op_names.get(
        int(d.op_hash[ctx.job.view(culprits[0], gid).coll_rows][0]), "?")  # type: ignore[union-attr]
    return Finding(
        kind=FindingKind.TIMEOUT,
        severity=Severity.ERROR,
        message=(f"rank{'s' if len(culprits) > 1 else ''} {ctx.ranks(culprits)} entered "
                 f"{op} #{s0} on {group.ref().label()} {delay_s:.1f} s after the first member, "
                 f"past its {timeout_s:g} s timeout: ranks {ctx.ranks(on_time)} had already "
                 "timed out waiting (their entries are retired as failed)"),
        culprit_ranks=tuple(culprits),
        waiting_ranks=tuple(on_time),
        pg=group.ref(),
        seq=s0,
        seq_kind="collective",
        op=op,
        location=None if det is None else det.location,
        evidence={"late_by_s": round(delay_s, 3), "timeout_ms": timeout_ms,
                  "note": "clocks of different hosts may differ; the lateness here exceeds "
                          "the timeout"},
    )
