"""``dead_rank``: a rank whose own failure ended the job — the root of a crash cascade.

Rule: every recorded failure (a death record, a teardown signal, a heartbeat
others saw stop, a missing dump among ranks that failed of a lost peer) is
classified by :mod:`frforensics.failures` (``_cascade``). The culprit is the
rank whose *root* failure came first by the dumps' own times; a root without a
dump (heartbeat stopped, or the peer every consequence lost) is named as such.
Ranks whose failure is a *consequence* (gloo's "Connection closed by peer",
NCCL's "remote process exited", aborts, timeouts, SIGTERM from the launcher)
are never culprits: the finding lists them as having failed because the
culprit failed (message, ``evidence.consequences``). Two roots closer than
``_cascade.TIE_NS`` cannot be told apart: both are named and the message says
so (``evidence.tied``, action ``inspect``). Severity error, status hang.

Worked example (4 ranks; rank 1 raised in its loss function, its peers then
lost their connection to it)::

    rank 1 dump: reason exception, "ValueError: nan loss" at train.py:88     root
    ranks 0,2,3 dumps: "RuntimeError: ... Connection closed by peer ..."     consequence
    -> dead_rank, culprit 1 (fix_code train.py:88); "ranks 0,2-3 failed because
       rank 1 failed"
"""

from __future__ import annotations

from frforensics.analyzer.context import Context
from frforensics.analyzer.detectors._cascade import Cascade, RankFailure, cascade
from frforensics.analyzer.detectors._roots import primary_wait, since
from frforensics.analyzer.digest import user_frame
from frforensics.report import Finding, FindingKind, Severity


def detect(ctx: Context) -> list[Finding]:
    """The first root failure of the job (and those tied with it), with its consequences."""
    c = cascade(ctx)
    culprits = _named(c)
    if not culprits:
        return _consequences_only(ctx, c)
    findings: list[Finding] = []
    for i, rf in enumerate(culprits):
        findings.append(_finding(ctx, c, rf, culprits, lead=i == 0))
    return findings


def _named(c: Cascade) -> list[RankFailure]:
    """The first root, those tied with it, and every untimed root when the first is
    untimed (ranks without a dump that the others lost cannot be ordered)."""
    roots = list(c.culprits)
    if not roots:
        return []
    if c.tied:
        return [f for f in roots if f.rank in c.tied]
    if roots[0].time_ns is None:
        return [f for f in roots if f.time_ns is None]
    return roots[:1]


def _finding(ctx: Context, c: Cascade, rf: RankFailure, named: list[RankFailure], *,
             lead: bool) -> Finding:
    rank = rf.rank
    dump = ctx.job.digests.get(rank)
    root = ctx.graph.roots.get(rank)
    wait, direct = primary_wait(root) if root is not None else (None, [])
    location: str | None = None
    death = None if dump is None else dump.death
    if death is not None:
        frame = user_frame(death.frames) or (death.frames[0] if death.frames else None)
        where = f" at {frame}" if frame is not None else ""
        cause = f"its dump says it died ({death.kind}: {death.message}){where}"
        location = None if frame is None else str(frame)
    elif rf.evidence == "stale_heartbeat":
        ages = [p.age_s for x in ctx.job.digests.values() for p in x.stale_peers if p.rank == rank]
        cause = (f"it left no dump and its heartbeat had stopped for {max(ages):.1f} s "
                 "in the other ranks' view: it died without an exception")
    else:
        cause = ("it left no dump, and the other ranks failed because they lost a peer "
                 "(their own failures are consequences): it is the rank they lost")
    kind = rf.failure.cause
    msg = f"rank {rank} failed first ({kind}): {cause}"
    if wait is not None:
        msg += (f"; ranks {ctx.ranks({w.rank for w in direct})} wait for it in "
                f"{ctx.describe(wait)}{since(direct)}")
    others = [f.rank for f in named if f.rank != rank]
    if others:
        msg += (f"; rank(s) {ctx.ranks(others)} failed of their own at the same time "
                "(within 100 ms): which came first cannot be told")
    cons = [f for f in c.consequences if lead]
    later = [f for f in c.roots if f not in named] if lead else []
    if cons:
        because = " or ".join(str(f.rank) for f in named)
        msg += (f"; rank(s) {ctx.ranks([f.rank for f in cons])} failed because rank "
                f"{because} failed ({', '.join(sorted({f.failure.cause for f in cons}))}): "
                "consequences, not causes")
    if later:
        msg += (f"; rank(s) {ctx.ranks([f.rank for f in later])} failed of their own "
                "later")
    if lead and c.desync_victims:
        msg += (f"; rank(s) {ctx.ranks(c.desync_victims)} left no dump after a desync of "
                "their group")
    return Finding(
        kind=FindingKind.DEAD_RANK,
        severity=Severity.ERROR,
        message=msg,
        culprit_ranks=(rank,),
        waiting_ranks=tuple(sorted(set(root.waiters if root is not None else ())
                                   | {f.rank for f in cons})),
        pg=None if wait is None else ctx.pg(wait.gid),
        seq=None if wait is None else wait.seq,
        seq_kind=None if wait is None else wait.seq_kind,
        op=None if wait is None else wait.op,
        location=location or (None if wait is None else wait.location),
        evidence={"death": None if death is None else
                  {"kind": death.kind, "message": death.message},
                  "failure": rf.to_json(),
                  "tied": others,
                  "consequences": [f.to_json() for f in cons],
                  "failed_because_of": [f.rank for f in named],
                  "died_in_consequence": [f.rank for f in cons],
                  "later_roots": [f.to_json() for f in later]},
    )


def _consequences_only(ctx: Context, c: Cascade) -> list[Finding]:
    """Every recorded failure is a consequence and no rank is missing: the rank
    that failed first left no trace in these dumps; say so, name no one."""
    cons = [f for f in c.consequences if f.evidence in ("death",)]
    if not cons or ctx.graph.waits:
        return []  # ranks still blocked: the hang detectors follow their waits
    return [Finding(
        kind=FindingKind.DEAD_RANK,
        severity=Severity.ERROR,
        message=(f"rank(s) {ctx.ranks([f.rank for f in cons])} failed of a lost peer, an abort "
                 "or a timeout (consequences of another rank's failure), and no rank's own "
                 "failure is in the dumps: no culprit is named; collect every rank's dump "
                 "and logs"),
        culprit_ranks=(),
        waiting_ranks=tuple(f.rank for f in cons),
        evidence={"consequences": [f.to_json() for f in cons], "failed_because_of": []},
    )]
