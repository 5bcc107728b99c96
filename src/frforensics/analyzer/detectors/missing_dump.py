"""``missing_dump``: a member rank of the job left no dump.

Rule: every rank of the job (``0 .. world_size-1``; the world size from the
dumps, ``--world-size``, or the highest rank seen) should have a dump. A rank
without one that others wait on is an error (status hang, culprit that rank):
it is the end of their wait chains and nothing more is known of it; the ranks
waited on in the same op are one finding with all of them as culprits. One
nobody waits on is a warning (status degraded): the analysis is merely incomplete.
A rank whose peers saw its heartbeat stop, or that ranks dying of a lost peer
lost (``_cascade``), is reported as ``dead_rank`` instead; a member of a group
that desynced is a consequence of the desync (a warning, never a culprit).

Where every dumped rank stopped at one op: PyTorch's own gloo dumps record no
death and never a state but ``scheduled`` (retirement only). A missing member of
the collective that is every dumped rank's newest op is the culprit of a hang
(error, issue 19: a missing file among ranks that all stopped at the same op is
evidence), with how sure in ``evidence.confidence``: ``high`` when the op is
unfinished on *all* of them (they are stuck there), ``medium`` when it is
unfinished on only *some* — gloo retires a failed op as it retires a completed
one, so a crash there reads exactly like a healthy job dumped mid-op whose file
was not collected (both measured: ``tests/data/native_crash``,
``tests/data/native/healthy`` minus one file); the message says so, and that
collecting the missing file settles it. A job whose dumped ranks all finished
their newest op qualifies only when every one of them issued it inside the same
function call that each earlier time went on to another op (``medium``, evidence
``stopped_in_call``: PyTorch's dumps with stacks; a program that ran to its end
returns from its calls, ``digest.stopped_in_call``).

Worked example (PyTorch's gloo dumps with stacks; Lightning, rank 1 ``os._exit``s
after broadcast #29)::

    ranks 0,2,3: newest op barrier #30, retired, issued at _sync_ddp:213, whose 3
    earlier calls each went on to the all_reduce at _sync_ddp:214; rank 1: no file
    -> missing_dump, error, culprit 1, evidence.confidence medium

Worked example (PyTorch's gloo dumps; rank 1 ``os._exit``s before all_reduce #4)::

    ranks 0,3: newest op all_reduce #4, unretired; rank 2: #4 retired; rank 1: no file
    -> missing_dump, error, culprit 1, evidence.confidence medium

Worked example (4 ranks, rank 3's node rebooted, no dump)::

    ranks 0-2 wait in all_reduce #12 on default_pg; rank 3: no file
    -> missing_dump, error, culprit 3, waiting ranks 0-2

Too many to name: ranks without a dump are named one by one (a finding and a
culprit each) while they number at most ``max(4096, dumps loaded)``
(``rankset.listable``). Beyond that the world size is a claim that the dumps do
not bear out — most of the job's dumps were not collected, or the size is wrong
— and evicting a million GPUs on the word of one ``world_size`` field is worse
than useless: such ranks are one finding, counted and written as ranges, with
no culprit. It is still an error when dumped ranks wait on them (status hang).
Ranks without a dump that other evidence names (a p2p peer, a member of a group
listed in a dump, a stale heartbeat) keep their own findings.

Worked example (4 dumps that each say ``world_size`` 1048576; ranks 0,1,3 wait
in all_reduce #17 on default_pg, rank 2 never entered it)::

    -> missing_rank, culprit 2; missing_dump, error, no culprit:
       "1048572 ranks (4-1048575) left no dump ...", evidence silent_count 1048572
"""

from __future__ import annotations

import numpy as np

from frforensics.analyzer.context import Context
from frforensics.analyzer.detectors._cascade import cascade
from frforensics.analyzer.detectors._roots import primary_wait, since
from frforensics.analyzer.detectors._stopped import (
    stale_ranks,
    stopped_finding,
    stopped_with_missing,
)
from frforensics.analyzer.frontiers import retirement_only
from frforensics.analyzer.waits import Wait
from frforensics.model import OpState
from frforensics.rankset import LISTED_RANKS_FLOOR, RankSet
from frforensics.report import Finding, FindingKind, Severity, format_ranks


def detect(ctx: Context) -> list[Finding]:
    """Missing dumps: errors when waited on, warnings otherwise."""
    stale = stale_ranks(ctx)
    findings: list[Finding] = []
    silent: list[int] = []
    listed = ctx.job.silent_listed
    # Too many to list: the named ones, and those other evidence makes roots.
    named = ctx.job.missing_dumps if listed else sorted({*ctx.job.named_missing, *(
        r for r, root in ctx.graph.roots.items() if root.kind == "no_dump")})
    # Ranks waited on in the same op are one finding (4 dumps of a 4096-rank job
    # made 4092 findings, each listing the default group's 4096 members)
    by_wait: dict[tuple[int, int, str, str], list[tuple[int, Wait, list[Wait], set[int]]]] = {}
    c = cascade(ctx)
    lost = {f.rank for f in c.roots if f.evidence == "no_dump"}
    victims = set(c.desync_victims)
    for rank in named:
        if rank in stale or rank in lost:
            continue  # dead_rank reports it
        if rank in victims:
            continue  # a consequence of the desync, never a culprit: said below
        root = ctx.graph.roots.get(rank)
        wait, direct = primary_wait(root) if root is not None else (None, [])
        if root is None or wait is None:
            silent.append(rank)
            continue
        key = (wait.gid, wait.seq, wait.seq_kind, wait.op)
        by_wait.setdefault(key, []).append((rank, wait, direct, set(root.waiters)))
    for members in by_wait.values():
        ranks = [m[0] for m in members]
        first = members[0][1]
        direct = [w for m in members for w in m[2]]
        waiters = sorted(set().union(*(m[3] for m in members)))
        waiting = ctx.ranks({w.rank for w in direct})
        where = f"{ctx.describe(first)}{since(direct)}"
        message = (f"rank {ranks[0]} left no dump, and ranks {waiting} wait for it in {where}: "
                   "it likely crashed, was killed, or its host died; check that host's logs"
                   if len(ranks) == 1 else
                   f"ranks {ctx.ranks(ranks)} left no dump, and ranks {waiting} wait for them "
                   f"in {where}: they likely crashed, were killed, or their hosts died; check "
                   "those hosts' logs")
        sure = "high"
        if _retired_by_some(ctx, first):
            sure = "medium"
            message += (f". How sure: medium — some rank(s) retired {first.op} #{first.seq}, and "
                        "PyTorch's gloo recorder retires a failed op as it retires a completed "
                        "one: a healthy job dumped mid-op whose file was not collected reads "
                        "the same; if the dump was only not collected, collect it and analyze "
                        "again")
        findings.append(Finding(
            kind=FindingKind.MISSING_DUMP,
            severity=Severity.ERROR,
            message=message,
            culprit_ranks=tuple(ranks),
            waiting_ranks=tuple(waiters),
            pg=ctx.pg(first.gid),
            seq=first.seq,
            seq_kind=first.seq_kind,
            op=first.op,
            location=first.location,
            # the dumps prove the others wait on it; why it left no file they cannot say
            evidence={"direct_waiters": sorted({w.rank for w in direct}), "confidence": sure,
                      "missing": list(ranks)},
        ))
    stopped = stopped_with_missing(ctx)
    blamed = sorted({m for _, _, gone in stopped.values() for m in gone
                     if m not in ctx.job.digests})
    if blamed:
        silent = [r for r in silent if r not in blamed]
        findings.append(stopped_finding(ctx, stopped, blamed))
    stop = _common_stop(ctx, silent) if silent else None
    if stop is not None:
        gid, seq, op, location, at, how, call = stop
        lost_at = sorted(r for r in silent if r in at)
        silent = [r for r in silent if r not in at]
        others = sorted(ctx.job.digests)
        findings.append(_common_stop_finding(ctx, lost_at, others, gid, seq, op, location,
                                             how, call))
    if silent:
        findings.append(Finding(
            kind=FindingKind.MISSING_DUMP,
            severity=Severity.WARNING,
            message=(f"no dump from rank(s) {ctx.ranks(silent)}; no other rank waits on them, "
                     "so the analysis is only incomplete"),
            culprit_ranks=(),
            evidence={"ranks": silent},
        ))
    if victims:
        findings.append(Finding(
            kind=FindingKind.MISSING_DUMP,
            severity=Severity.WARNING,
            message=(f"no dump from rank(s) {ctx.ranks(sorted(victims))}, members of a group "
                     "whose ranks disagreed at a collective (see the mismatch finding): gloo "
                     "aborts a rank that receives data of another size (\"Received data size "
                     "doesn't match expected size\", SIGABRT, no dump); a consequence of the "
                     "desync, not a culprit"),
            culprit_ranks=(),
            evidence={"ranks": sorted(victims), "consequence_of": "desync"},
        ))
    if not listed or ctx.graph.unlisted is not None:
        findings.extend(_unlisted(ctx, {*named, *stale}))
    return findings


def _retired_by_some(ctx: Context, wait: Wait) -> bool:
    """Some dumped member retired the collective ``wait`` is blocked in, in dumps whose
    states come from retirement alone (PyTorch's gloo dumps): it may have run, and
    the rank without a dump merely not been collected."""
    if wait.seq_kind != "collective" or not retirement_only(ctx.job.digests[wait.rank]):
        return False
    return any(ctx.job.state_in(m, wait.gid, wait.seq) == OpState.COMPLETED
               for m in ctx.job.dumped_members(wait.gid))


def _common_stop_finding(ctx: Context, stopped: list[int], others: list[int], gid: int,
                         seq: int, op: str, location: str | None, how: str,
                         call: str | None) -> Finding:
    """The missing member(s) of the op where every dumped rank stopped: the culprit
    of a hang, with how sure (issue 19: a missing file among ranks that all stopped
    at one op is evidence). ``how`` (``_common_stop``): ``stuck``, the op is
    unfinished on every dumped rank (confidence high); ``some``, on some only
    (medium: PyTorch's gloo recorder retires a failed op as it retires a completed
    one, so a healthy job dumped mid-op whose file was not collected reads the
    same); ``mid_call``, retired on all, but every one stopped inside the call
    ``call`` (``where -> where it always went on``; medium, the same doubt)."""
    where = f"{op} #{seq} on {ctx.pg_label(gid)}"
    evidence: dict[str, object] = {}
    if how == "stuck":
        state = f"stopped at the same unfinished {where}"
        sure = ("every dumped member agrees on where the job stopped and is stuck there, so "
                "the hang is certain; that the missing rank caused it rests on its missing "
                "file")
    elif how == "mid_call" and call is not None:
        site, _, went_on = call.partition(" -> ")
        evidence["stopped_in_call"] = {"at": site, "always_went_on_to": went_on}
        state = (f"stopped at the same {where}, retired on all of them, issued at {site}: "
                 f"inside a call that each earlier time went on to {went_on}, where a program "
                 "that ran to its end does not stop")
        sure = ("medium: the dumps hold no death (PyTorch's gloo recorder records none), and "
                "a healthy job dumped in the middle of that call whose file was not collected "
                "would read the same")
    else:
        state = (f"stopped at the same {where} (unfinished on some of them, retired on the "
                 "others: gloo retires a failed op as it retires a completed one)")
        sure = ("medium: the dumps hold no death (PyTorch's gloo recorder records none), and "
                "a healthy job dumped mid-op whose file was not collected would read the same")
    return Finding(
        kind=FindingKind.MISSING_DUMP,
        severity=Severity.ERROR,
        message=(f"rank(s) {ctx.ranks(stopped)} left no dump, and every rank that did "
                 f"({ctx.ranks(others)}) {state}, of which rank(s) {ctx.ranks(stopped)} "
                 "are members: they most likely died or hung hard before or in it (a rank "
                 f"that dies hard writes nothing). How sure: {sure} — if its dump was only "
                 "not collected, collect it and analyze again"),
        culprit_ranks=tuple(stopped),
        waiting_ranks=tuple(others),
        pg=ctx.pg(gid),
        seq=seq,
        seq_kind="collective",
        op=op,
        location=location,
        evidence={"basis": "missing_dump_at_common_stop",
                  "confidence": "high" if how == "stuck" else "medium",
                  "stopped_ranks": others, "missing": stopped, **evidence},
    )


def _common_stop(ctx: Context, missing: list[int]
                 ) -> tuple[int, int, str, str | None, set[int], str, str | None] | None:
    """Where every dumped rank stopped, when it is one unfinished collective that
    some of ``missing`` belong to: ``(gid, seq, op, location, those missing ranks)``.

    Each dumped rank's newest collective entry must be the same (group, seq),
    unfinished on at least one of them, and no rank may have ops younger than
    ``hang_after_s``; the last item says whether it is unfinished on *every* dumped
    rank (stuck: a hang) or only on some (PyTorch's gloo recorder retires an op that
    failed as it retires one that completed: measured, a 4-rank job whose rank 1
    ``os._exit``s before all_reduce #4 left ranks 0, 3 with #4 unretired and rank 2
    with it retired — and a healthy job dumped mid-op shows the same, see
    ``tests/data/native/healthy``). A job whose ranks all finished their last op (a
    healthy job with a file not collected) never qualifies — unless every one of them
    stopped inside the same function call that, each earlier time, went on to another
    op (``digest.stopped_in_call``; PyTorch's dumps with stacks, issue 29): how is then
    ``"mid_call"``, with that call (``"where -> where it went on"``) last; else
    ``"stuck"`` (unfinished on every dumped rank) or ``"some"``, and ``None``.
    """
    if len(ctx.job.digests) < 2 or not ctx.job.silent_listed or ctx.graph.young:
        return None
    stops: set[tuple[int, int]] = set()
    first = None
    unfinished = 0
    mid_call: set[str] = set()
    for rank, d in ctx.job.digests.items():
        rows = np.flatnonzero(d.is_p2p == 0)
        if len(rows) == 0:
            return None
        row = int(rows[-1])
        if int(d.state[d.unit_of(row)]) != OpState.COMPLETED:
            unfinished += 1
            first = (rank, row)
        elif d.stopped_in_call is not None and row == len(d) - 1:
            mid_call.add(d.stopped_in_call)
        gid = ctx.job.group_of.get((rank, int(d.group[row])))
        if gid is None:
            return None
        stops.add((gid, int(d.seq[row])))
        if len(stops) > 1:
            return None
    how = "stuck" if unfinished == len(ctx.job.digests) else "some" if unfinished else ""
    if not unfinished:
        # every rank finished its last op: nothing stopped there, unless every one
        # stopped inside the same call, where the program always went on (a program
        # that ran to its end returns from its calls: digest.stopped_in_call)
        if len(mid_call) != 1 or any(d.stopped_in_call is None
                                     for d in ctx.job.digests.values()):
            return None
        how = "mid_call"
        first = (rank, row)  # any dumped rank's newest op: the same collective on all
    gid, seq = stops.pop()
    group = ctx.job.groups[gid]
    members = set(group.ranks)
    default = group.desc == "default_pg" and ctx.job.world_size is not None
    at = {r for r in missing if r in members or (default and r < (ctx.job.world_size or 0))}
    if not at or first is None:
        return None
    d = ctx.job.digests[first[0]]
    detail = d.detail(first[1])
    op = d.op_names.get(int(d.op_hash[first[1]]), "?")
    return (gid, seq, op, None if detail is None else detail.location, at, how,
            mid_call.pop() if how == "mid_call" else None)


def _unlisted(ctx: Context, named: set[int]) -> list[Finding]:
    """The ranks without a dump too many to name: one error finding for those
    that dumped ranks wait on, one warning for the rest; counts and ranges."""
    findings: list[Finding] = []
    rest = ctx.job.unlisted.minus(named)
    block = ctx.graph.unlisted
    bound = max(LISTED_RANKS_FLOOR, len(ctx.job.digests))
    claim = (f"the world size {ctx.job.world_size} is only a claim the dumps do not bear "
             "out: most of the job's dumps were not collected, or the world size is wrong"
             if ctx.job.world_size else "ranks are implied only by the highest rank seen")
    waited = RankSet()
    if block is not None:
        waited = ctx.graph.unlisted_ranks.minus(named)
        if waited and waited[-1] >= len(ctx.job.world):
            claim = (f"a group lists ranks beyond the world of {len(ctx.job.world)}: the "
                     "dumps disagree with each other, or one is damaged")
        wait, direct = primary_wait(block)
        if wait is not None and waited:
            findings.append(Finding(
                kind=FindingKind.MISSING_DUMP,
                severity=Severity.ERROR,
                message=(f"{len(waited)} ranks ({format_ranks(waited)}) left no dump, and ranks "
                         f"{ctx.ranks({w.rank for w in direct})} wait for them in "
                         f"{ctx.describe(wait)}{since(direct)}; too many to name one by one "
                         f"(more than {bound}), so no culprit is named: {claim}. Collect "
                         "their dumps (or pass the real --world-size) and analyze again"),
                culprit_ranks=(),
                waiting_ranks=tuple(sorted(block.waiters)),
                pg=ctx.pg(wait.gid),
                seq=wait.seq,
                seq_kind=wait.seq_kind,
                op=wait.op,
                location=wait.location,
                evidence={"direct_waiters": sorted({w.rank for w in direct}),
                          "silent_count": len(waited), "silent_ranges": waited.ranges(),
                          "too_many_to_name": bound},
            ))
    quiet = rest.minus(waited)
    if quiet:
        findings.append(Finding(
            kind=FindingKind.MISSING_DUMP,
            severity=Severity.WARNING,
            message=(f"no dump from {len(quiet)} ranks ({format_ranks(quiet)}); no other rank "
                     f"waits on them, so the analysis is only incomplete ({claim})"),
            culprit_ranks=(),
            evidence={"ranks": None, "silent_count": len(quiet),
                      "silent_ranges": quiet.ranges(), "too_many_to_name": bound},
        ))
    return findings

