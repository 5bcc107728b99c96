"""``cross_pg_deadlock``: ranks wait on each other across process groups.

Rule: a cycle in the wait-for graph that involves collectives of two or more
groups — typically ranks that issued two groups' collectives in opposite
orders, or a rank that skipped one group's collective and went on to the next.
The culprits are the cycle members whose order deviates from their peers':

1. *Peer evidence*: when a member entered its blocking op (G, s), how far it had
   got in the other group H of the cycle (its newest seq in H). Peers that also
   entered (G, s) — or seq s of an analogous group (same description and size,
   e.g. another TP group) — show how far one normally is in H (or its analog)
   at that point. A member that disagrees with the majority of them deviates.
2. Otherwise the member(s) blocked in the group the fewest ranks are blocked in
   (the majority order wins); on a tie every member of the cycle is named. Every group of the
cycle is listed in ``evidence`` with each member's op, seq and code location.

Worked example (4 ranks; A = default group, B = {0,1}; rank 1 calls B before A)::

    rank 0 waits in A all_reduce #9 for rank 1      (issued A then B)
    rank 1 waits in B all_reduce #3 for rank 0      (issued B then A: inverted)
    ranks 2,3 wait in A all_reduce #9 for rank 1
    -> cross_pg_deadlock, culprit 1 (3 ranks blocked in A, 1 in B)
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from frforensics.analyzer.context import Context
from frforensics.analyzer.merge import JobModel
from frforensics.analyzer.waits import Wait
from frforensics.report import Finding, FindingKind, Severity


def detect(ctx: Context) -> list[Finding]:
    """One finding per wait cycle that spans more than one group."""
    blocked_in = Counter(w.gid for w in ctx.graph.waits.values())
    findings: list[Finding] = []
    for cycle in ctx.graph.cycles:
        if cycle.p2p_only:
            continue
        deviants = _deviants(ctx, cycle.waits)
        score = {w.rank: blocked_in[w.gid] for w in cycle.waits}
        low = min(score.values())
        if deviants and len(deviants) < len(cycle.ranks):
            culprits = tuple(sorted(deviants))
        elif len(set(score.values())) > 1:
            culprits = tuple(sorted(r for r, s in score.items() if s == low))
        else:
            culprits = cycle.ranks
        inverted = set(culprits) != set(cycle.ranks)
        lines = [f"rank {w.rank} waits in {ctx.describe(w)} for rank(s) {ctx.ranks(w.on)}"
                 + (f" ({w.location})" if w.location else "") for w in cycle.waits]
        verdict = (f"rank(s) {ctx.ranks(culprits)} issued the groups' collectives in the "
                   "opposite order to the others" if inverted else
                   "the ranks issued the groups' collectives in opposite orders")
        first = next(w for w in cycle.waits if w.rank == culprits[0])
        groups = sorted({w.gid for w in cycle.waits})
        findings.append(Finding(
            kind=FindingKind.CROSS_PG_DEADLOCK,
            severity=Severity.ERROR,
            message=f"deadlock across {len(groups)} groups: " + "; ".join(lines[:6])
            + f" — {verdict}",
            culprit_ranks=culprits,
            waiting_ranks=tuple(sorted(cycle.waiters | (set(cycle.ranks) - set(culprits)))),
            pg=ctx.pg(first.gid),
            seq=first.seq,
            seq_kind=first.seq_kind,
            op=first.op,
            location=first.location,
            evidence={
                "groups": [ctx.pg(g).to_json() | {"blocked_ranks": blocked_in[g]} for g in groups],
                "cycle": [{"rank": w.rank, "pg": ctx.job.groups[w.gid].name, "op": w.op,
                           "seq": w.seq, "seq_kind": w.seq_kind, "waits_for": list(w.on),
                           "location": w.location} for w in cycle.waits],
                "inverted": inverted,
            },
        ))
    return findings[: ctx.options.max_findings_per_kind]


def _progress(job: JobModel, rank: int, gid_at: int, seq_at: int, gid_other: int) -> int | None:
    """``rank``'s newest seq in ``gid_other`` when it entered ``seq_at`` of ``gid_at``."""
    d = job.digests.get(rank)
    at, other = job.groups[gid_at].local.get(rank), job.groups[gid_other].local.get(rank)
    if d is None or at is None or other is None:
        return None
    coll = d.is_p2p == 0
    rows = np.flatnonzero((d.group == at) & (d.seq == seq_at) & coll)
    if len(rows) == 0:
        return None
    first = int(rows[0])
    before = (d.group[:first] == other) & coll[:first]
    if not before.any():
        return None if job.window_evicted(rank) else 0
    return int(d.seq[:first][before].max())


def _analog(job: JobModel, gid: int, rank: int) -> int | None:
    """``gid`` itself if ``rank`` is a member, else its one analog holding ``rank``."""
    group = job.groups[gid]
    if rank in group.ranks:
        return gid
    analogs = [h.gid for h in job.groups if h.gid != gid and rank in h.ranks
               and h.desc == group.desc and len(h.ranks) == len(group.ranks)]
    return analogs[0] if len(analogs) == 1 else None


def _deviants(ctx: Context, waits: list[Wait]) -> set[int]:
    """Cycle members whose progress in the other group disagrees with their peers'."""
    job = ctx.job
    by_rank = {w.rank: w for w in waits}
    out: set[int] = set()
    for w in waits:
        others = {by_rank[t].gid for t in w.on if t in by_rank} - {w.gid}
        for other in others:
            mine = _progress(job, w.rank, w.gid, w.seq, other)
            if mine is None:
                continue
            refs = []
            for q in job.digests:
                if q == w.rank:
                    continue
                g_at, g_other = _analog(job, w.gid, q), _analog(job, other, q)
                if g_at is None or g_other is None:
                    continue
                p = _progress(job, q, g_at, w.seq, g_other)
                if p is not None:
                    refs.append(p)
            if refs and mine != Counter(refs).most_common(1)[0][0]:
                out.add(w.rank)
    return out
