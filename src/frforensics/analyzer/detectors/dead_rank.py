"""``dead_rank``: a rank died — its own dump says so, or its heartbeat stopped.

Rule: a dump written because the process was dying (an uncaught exception, or an
exit while it still had unfinished ops or peers waiting on it) names that rank;
so does a rank without a dump whose heartbeat the other ranks' watchdogs saw go
stale. Severity error, status hang (its peers can never finish).

When one rank dies hard, its peers often die a moment later of the lost
connection ("Connection closed by peer"): their own dumps say they died too,
but they are victims. A death whose message is a peer-loss error, in a job where
some rank's heartbeat went stale, is folded into that rank's finding as a
consequence rather than named as another culprit.

Worked example (4 ranks; rank 1 raised in its loss function)::

    rank 1 dump: reason exception, "ValueError: nan loss" at train.py:88
    ranks 0,2,3 wait in all_reduce #40 on default_pg for rank 1
    -> dead_rank, culprit 1, waiting ranks 0,2,3
"""

from __future__ import annotations

import re

from frforensics.analyzer.context import Context
from frforensics.analyzer.detectors._roots import primary_wait, since
from frforensics.analyzer.detectors.missing_dump import stale_ranks
from frforensics.report import Finding, FindingKind, Severity


def detect(ctx: Context) -> list[Finding]:
    """Ranks that died, with the waits that depend on them."""
    findings: list[Finding] = []
    candidates: list[int] = []
    for rank, d in sorted(ctx.job.digests.items()):
        if d.death is None:
            continue
        waited_on = rank in ctx.graph.roots
        if d.death.kind == "exit" and not waited_on and len(d.pending_rows()) == 0:
            continue  # a clean exit at the end of the job
        candidates.append(rank)
    stale = stale_ranks(ctx)
    candidates += [r for r in sorted(stale) if r in ctx.job.missing_dumps]
    victims: list[int] = []
    if stale:
        victims = [r for r in candidates if r not in stale and _died_of_peer_loss(ctx, r)]
        candidates = [r for r in candidates if r not in victims]
    # The stalest heartbeat first: the rank that went silent first.
    age = {p.rank: p.age_s for d in ctx.job.digests.values() for p in d.stale_peers}
    candidates.sort(key=lambda r: -age.get(r, -1.0))
    for rank in candidates:
        dump = ctx.job.digests.get(rank)
        root = ctx.graph.roots.get(rank)
        wait, direct = primary_wait(root) if root is not None else (None, [])
        if dump is not None and dump.death is not None:
            frames = dump.death.frames
            where = f" at {frames[0]}" if frames else ""
            cause = f"its dump says it died ({dump.death.kind}: {dump.death.message}){where}"
            location = str(frames[0]) if frames else None
        else:
            ages = [p.age_s for x in ctx.job.digests.values() for p in x.stale_peers if p.rank == rank]
            cause = (f"it left no dump and its heartbeat had stopped for {max(ages):.1f} s "
                     "in the other ranks' view")
            location = None
        msg = f"rank {rank} is dead: {cause}"
        if wait is not None:
            msg += (f"; ranks {ctx.ranks({w.rank for w in direct})} wait for it in "
                    f"{ctx.describe(wait)}{since(direct)}")
        consequences = victims if rank == candidates[0] else []
        if consequences:
            msg += (f"; rank(s) {ctx.ranks(consequences)} then died of the lost connection "
                    "(their dumps say so): consequences, not causes")
        findings.append(Finding(
            kind=FindingKind.DEAD_RANK,
            severity=Severity.ERROR,
            message=msg,
            culprit_ranks=(rank,),
            waiting_ranks=tuple(sorted(set(root.waiters if root is not None else ())
                                       | set(consequences))),
            pg=None if wait is None else ctx.pg(wait.gid),
            seq=None if wait is None else wait.seq,
            seq_kind=None if wait is None else wait.seq_kind,
            op=None if wait is None else wait.op,
            location=location or (None if wait is None else wait.location),
            evidence={"death": None if dump is None or dump.death is None else
                      {"kind": dump.death.kind, "message": dump.death.message},
                      "died_in_consequence": consequences},
        ))
    return findings


_PEER_LOSS = re.compile(
    r"connection (closed|reset|refused)|closed by peer|broken pipe|peer .*(died|lost|closed)"
    r"|communicator was aborted|remote process exited",
    re.IGNORECASE,
)


def _died_of_peer_loss(ctx: Context, rank: int) -> bool:
    dump = ctx.job.digests.get(rank)
    return dump is not None and dump.death is not None and bool(
        _PEER_LOSS.search(dump.death.message))
