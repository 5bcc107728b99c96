"""``missing_dump``: a member rank of the job left no dump.

Rule: every rank of the job (``0 .. world_size-1``; the world size from the
dumps, ``--world-size``, or the highest rank seen) should have a dump. A rank
without one that others wait on is an error (status hang, culprit that rank):
it is the end of their wait chains and nothing more is known of it. One nobody
waits on is a warning (status degraded): the analysis is merely incomplete.
A rank whose peers saw its heartbeat stop is reported as ``dead_rank`` instead.

Worked example (4 ranks, rank 3's node rebooted, no dump)::

    ranks 0-2 wait in all_reduce #12 on default_pg; rank 3: no file
    -> missing_dump, error, culprit 3, waiting ranks 0-2
"""

from __future__ import annotations

from frforensics.analyzer.context import Context
from frforensics.analyzer.detectors._roots import primary_wait, since
from frforensics.report import Finding, FindingKind, Severity


def stale_ranks(ctx: Context) -> set[int]:
    """Ranks whose heartbeat some other rank's dump reports as stale."""
    return {p.rank for d in ctx.job.digests.values() for p in d.stale_peers}


def detect(ctx: Context) -> list[Finding]:
    """Missing dumps: errors when waited on, warnings otherwise."""
    stale = stale_ranks(ctx)
    findings: list[Finding] = []
    silent: list[int] = []
    for rank in ctx.job.missing_dumps:
        if rank in stale:
            continue  # dead_rank reports it
        root = ctx.graph.roots.get(rank)
        wait, direct = primary_wait(root) if root is not None else (None, [])
        if root is None or wait is None:
            silent.append(rank)
            continue
        waiters = sorted(root.waiters)
        findings.append(Finding(
            kind=FindingKind.MISSING_DUMP,
            severity=Severity.ERROR,
            message=(f"rank {rank} left no dump, and ranks {ctx.ranks({w.rank for w in direct})} "
                     f"wait for it in {ctx.describe(wait)}{since(direct)}: it likely crashed, "
                     "was killed, or its host died; check that host's logs"),
            culprit_ranks=(rank,),
            waiting_ranks=tuple(waiters),
            pg=ctx.pg(wait.gid),
            seq=wait.seq,
            seq_kind=wait.seq_kind,
            op=wait.op,
            location=wait.location,
            evidence={"direct_waiters": sorted({w.rank for w in direct})},
        ))
    if silent:
        findings.append(Finding(
            kind=FindingKind.MISSING_DUMP,
            severity=Severity.WARNING,
            message=(f"no dump from rank(s) {ctx.ranks(silent)}; no other rank waits on them, "
                     "so the analysis is only incomplete"),
            culprit_ranks=(),
            evidence={"ranks": silent},
        ))
    return findings
