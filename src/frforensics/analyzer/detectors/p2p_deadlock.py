"""``p2p_deadlock``: sends and recvs that can never meet.

Rule: sends and recvs are paired per ordered pair of ranks — the k-th send from A
to B with the k-th recv at B from A — in global ranks (``p2p_seq_id`` counts all
of a group's p2p ops on one process, so it does not pair them). Two cases:

* a cycle of p2p waits: every rank of it waits for the next to post its side
  (both sides recv first, or a ring of sends without buffering);
* an unmatched op: a rank waits in a send/recv whose peer is alive and not
  blocked, but never posted the counterpart (the culprit is that peer).

On our dumps the pairing is exact (per-peer numbers); on native dumps it is
inferred from which ops are still pending, and the finding says so.

Worked example (pipeline stages 0 -> 1; both ranks post recv first)::

    rank 0: recv from 1 (pending)     rank 1: recv from 0 (pending)
    -> p2p_deadlock, culprits 0 and 1 (each waits for the other's send)
"""

from __future__ import annotations

from frforensics.analyzer.context import Context
from frforensics.analyzer.detectors._roots import doing, primary_wait, rank_activity, since
from frforensics.report import Finding, FindingKind, Severity


def detect(ctx: Context) -> list[Finding]:
    """Cycles of p2p waits, and p2p ops whose peer never posted its side."""
    findings: list[Finding] = []
    for cycle in ctx.graph.cycles:
        if not cycle.p2p_only:
            continue
        lines = [f"rank {w.rank} waits in {ctx.describe(w)}" for w in cycle.waits]
        confidence = "exact" if all(w.confidence == "exact" for w in cycle.waits) else "inferred"
        first = cycle.waits[0]
        findings.append(Finding(
            kind=FindingKind.P2P_DEADLOCK,
            severity=Severity.ERROR,
            message=(f"p2p deadlock between ranks {ctx.ranks(cycle.ranks)}: "
                     + "; ".join(lines[:6]) + " — each waits for the other to post its side"),
            culprit_ranks=cycle.ranks,
            waiting_ranks=tuple(sorted(cycle.waiters)),
            pg=ctx.pg(first.gid),
            seq=first.seq,
            seq_kind="p2p",
            op=first.op,
            location=first.location,
            evidence={"cycle": [{"rank": w.rank, "op": w.op, "pg": ctx.job.groups[w.gid].name,
                                 "p2p_seq": w.seq, "peer": None if w.detail is None else w.detail.peer,
                                 "location": w.location} for w in cycle.waits],
                      "pairing": confidence},
        ))
    for rank, root in sorted(ctx.graph.roots.items()):
        if root.kind != "free":
            continue
        wait, direct = primary_wait(root)
        if wait is None or wait.seq_kind != "p2p":
            continue
        confidence = "exact" if all(w.confidence == "exact" for w in direct) else "inferred"
        counterpart = "send" if wait.op == "recv" else "recv"
        msg = (f"rank {rank} never posted the {counterpart} matching {ctx.describe(wait)} "
               f"of rank(s) {ctx.ranks({w.rank for w in direct})}, which wait{since(direct)}; "
               f"{doing(ctx, rank)}")
        if confidence != "exact":
            msg += " (pairing inferred from pending ops: the dumps carry no per-peer numbers)"
        findings.append(Finding(
            kind=FindingKind.P2P_DEADLOCK,
            severity=Severity.ERROR,
            message=msg,
            culprit_ranks=(rank,),
            waiting_ranks=tuple(sorted(root.waiters)),
            pg=ctx.pg(wait.gid),
            seq=wait.seq,
            seq_kind="p2p",
            op=wait.op,
            location=wait.location,
            evidence={"unmatched": [{"rank": w.rank, "op": w.op, "p2p_seq": w.seq,
                                     "peer_seq": None if w.detail is None else w.detail.peer_seq}
                                    for w in direct],
                      "culprit": rank_activity(ctx, rank), "pairing": confidence},
        ))
    return findings[: ctx.options.max_findings_per_kind]
