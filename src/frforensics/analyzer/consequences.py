"""Which findings are consequences of another: the one place the report's findings are
settled after the rules ran (issue 29: "one module decides what is a consequence").

Per rank, a failure is classified once, as its own or as following another's, by
:mod:`frforensics.failures` and the crash cascade (``detectors/_cascade.py``), which
the rules read; a rank lost to a desync is a consequence there too. What is left is
between findings, and is decided here, in this order:

1. :func:`explained_by_desync` — a hang in a group at or after a seq where its
   members desynced is the desync's consequence (later collectives pair up the
   wrong calls), not another culprit;
2. :func:`torn_down_mid_call` — a rank that never entered the op its peers wait in,
   beside a member that left no dump, while it was one op behind, in the middle of a
   call that always went on to another op, was caught there when the job was torn
   down after that member's death: a note, not a second culprit;
3. :func:`hidden_p2p_roots` — a rank that may only be blocked in a send/recv the
   dumps do not show (PyTorch's gloo recorder) is never named beside a certain
   culprit, and alone it is a candidate, not a culprit;
4. :func:`stragglers_beside_errors` — a straggler beside a hang or desync is a note:
   around a fault the ranks' arrival times say more about the fault than a GPU;
5. :func:`unread_not_culprits` — a rank whose dump was there but not read in time
   (``fr-analyze --deadline``) is never a culprit: that it "left no dump" is the
   deadline's doing. A finding that named only such ranks becomes a warning.

:func:`culprits_of` then reads the report's culprits off what is left: the error
findings' culprits, in order, or the stragglers' when there is no error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from frforensics.analyzer.context import Context
from frforensics.model import OpState
from frforensics.report import Finding, FindingKind, Severity

__all__ = ["culprits_of", "explained_by_desync", "hidden_p2p_roots", "settle",
           "stragglers_beside_errors", "torn_down_mid_call"]


def settle(ctx: Context, findings: list[Finding], *,
           unread: Sequence[int] = ()) -> tuple[list[Finding], list[str]]:
    """The findings less the consequences of others, and the notes they became;
    ``unread``: ranks whose dumps were not read before a deadline."""
    findings = explained_by_desync(findings)
    findings, torn = torn_down_mid_call(ctx, findings, unread)
    findings = hidden_p2p_roots(ctx, findings)
    findings, notes = stragglers_beside_errors(findings)
    return unread_not_culprits(ctx, findings, unread), torn + notes


def unread_not_culprits(ctx: Context, findings: list[Finding],
                        unread: Sequence[int]) -> list[Finding]:
    """No rank in ``unread`` is a culprit; a finding left with none is a warning."""
    if not unread:
        return findings
    gone = set(unread)
    out = []
    for f in findings:
        hit = sorted(gone.intersection(f.culprit_ranks))
        if not hit:
            out.append(f)
            continue
        left = tuple(r for r in f.culprit_ranks if r not in gone)
        note = (f"rank(s) {ctx.ranks(hit)}: the dump was not read before the deadline, so "
                "it is not named (read it again without --deadline): ")
        out.append(replace(
            f, culprit_ranks=left, message=note + f.message,
            severity=f.severity if left else Severity.WARNING,
            evidence={**f.evidence, "unread": hit}))
    return out


_DESYNC = {FindingKind.OP_MISMATCH, FindingKind.DTYPE_MISMATCH, FindingKind.SIZE_MISMATCH}
_HANG_IN_GROUP = {FindingKind.MISSING_RANK, FindingKind.TIMEOUT, FindingKind.P2P_DEADLOCK}


def explained_by_desync(findings: list[Finding]) -> list[Finding]:
    """Drop hangs in a group at or after a seq where its members desynced.

    Once members disagree at seq s, later collectives of the group pair up the
    wrong calls, so ranks stop at different seqs: those stops are consequences
    of the desync, not more culprits.
    """
    first: dict[tuple[str, Sequence[int] | None], int] = {}
    for f in findings:
        if f.kind in _DESYNC and f.pg is not None and f.seq is not None:
            key = (f.pg.name, f.pg.ranks)
            first[key] = min(first.get(key, f.seq), f.seq)
    if not first:
        return findings
    kept = []
    for f in findings:
        if (f.kind in _HANG_IN_GROUP and f.pg is not None and f.seq is not None
                and f.seq_kind == "collective"
                and (f.pg.name, f.pg.ranks) in first and f.seq >= first[(f.pg.name, f.pg.ranks)]):
            continue
        kept.append(f)
    return kept


def torn_down_mid_call(ctx: Context, findings: list[Finding], unread: Sequence[int] = ()
                       ) -> tuple[list[Finding], list[str]]:
    """Never name a rank the launcher's teardown caught between two ops of one call.

    A ``missing_rank`` culprit R is dropped (a note says why) when all of these hold:

    * the ranks waiting in the op R never entered (collective ``s`` of group G) also
      wait there for a member that left no dump and is named for it (``missing_dump``
      or ``dead_rank``): a death, which makes the launcher terminate every other rank
      (torchrun: SIGTERM to the whole group as soon as one worker exits);
    * R's newest op is G's collective ``s - 1``, finished: it was one op behind, not
      stuck anywhere the others were not;
    * R stopped inside a call that each earlier time went on to another op
      (``digest.stopped_in_call``: PyTorch's dumps with stacks, ours): it was between
      two ops a library issues back to back, where a running program spends
      microseconds — the place a SIGTERM lands on a slower rank, not one it hangs in.

    Measured (CI, 6 December): Lightning, rank 1 exits after barrier #30; ranks 0, 2
    enter #31 while rank 3, still in ``_sync_ddp`` between its barrier (line 213) and
    its all_reduce (214), is terminated by torchrun; PyTorch's dumps (no dump reason)
    named rank 3 beside rank 1. A rank stuck in its own code between two ops of one
    call while, independently, a member died without a dump would be missed: two
    faults at once, where naming a healthy rank on a teardown's timing is the
    likelier error. Ours carry their dump reason (``dead_rank`` settles it there).
    A rank whose dump was there but not read before a deadline (``unread``) is no
    death: it never counts as the member that left no dump.
    """
    skip = set(unread)
    lost = {r for f in findings
            if f.severity is Severity.ERROR
            and f.kind in (FindingKind.MISSING_DUMP, FindingKind.DEAD_RANK)
            for r in f.culprit_ranks if r not in ctx.job.digests and r not in skip}
    if not lost:
        return findings, []
    kept: list[Finding] = []
    notes: list[str] = []
    for f in findings:
        torn, dead = _torn_down(ctx, f, lost)
        if not torn:
            kept.append(f)
            continue
        left = tuple(r for r in f.culprit_ranks if r not in torn)
        note = (f"rank(s) {ctx.ranks(torn)} not named: one op behind, stopped inside a call "
                "that always went on to another op, while the ranks waiting for them also "
                f"wait for rank(s) {ctx.ranks(dead)}, which left no dump: most "
                "likely terminated there when the job was torn down after that death")
        notes.append(f"{note} ({f.kind.value}: {f.message})")
        if left:
            kept.append(replace(f, culprit_ranks=left, message=f"{note}; {f.message}",
                                evidence={**f.evidence, "torn_down": torn}))
    return kept, notes


def _torn_down(ctx: Context, f: Finding, lost: set[int]) -> tuple[list[int], list[int]]:
    """The culprits of ``f``, a ``missing_rank``, that :func:`torn_down_mid_call` drops,
    and the ranks of ``lost`` its waiters wait for there."""
    if (f.kind is not FindingKind.MISSING_RANK or f.seq_kind != "collective" or f.seq is None
            or f.evidence.get("basis") is not None):
        return [], []
    waits = [ctx.graph.waits[w] for w in f.evidence.get("direct_waiters", ())
             if w in ctx.graph.waits]
    waits = [w for w in waits if w.seq == f.seq and w.seq_kind == "collective"]
    dead = sorted(lost.intersection(r for w in waits for r in w.on))
    if not waits or not dead:
        return [], []
    gid = waits[0].gid
    torn = []
    for rank in f.culprit_ranks:
        d = ctx.job.digests.get(rank)
        if d is None or d.stopped_in_call is None or len(d) == 0:
            continue
        row = len(d) - 1
        if (int(d.is_p2p[row]) == 0 and ctx.job.group_of.get((rank, int(d.group[row]))) == gid
                and int(d.seq[row]) == f.seq - 1
                and int(d.state[d.unit_of(row)]) == OpState.COMPLETED):
            torn.append(rank)
    return torn, dead


def hidden_p2p_roots(ctx: Context, findings: list[Finding]) -> list[Finding]:
    """Never name a rank that may only be blocked in a send/recv the dumps do not show.

    PyTorch's gloo recorder skips send/recv: a rank blocked in a pipeline recv
    looks idle, exactly like a rank stuck in Python. A ``missing_rank`` culprit
    that issued such unrecorded ops (``RankDigest.unrecorded_ops``) is therefore
    uncertain. Where another error finding names certain culprits, the uncertain
    ones are dropped (they are most likely that fault's waiters); otherwise they
    stay, with no culprit named, their ranks listed as candidates.
    """
    def uncertain(f: Finding) -> bool:
        return f.kind is FindingKind.MISSING_RANK and any(
            ctx.job.digests[r].unrecorded_ops > 0 for r in f.culprit_ranks
            if r in ctx.job.digests)

    shaky = [f for f in findings if uncertain(f)]
    if not shaky:
        return findings
    certain = [f for f in findings if f.severity is Severity.ERROR and not uncertain(f)
               and f.culprit_ranks]
    if certain:
        return [f for f in findings if not uncertain(f)]
    candidates = sorted({r for f in shaky for r in f.culprit_ranks})
    lead = (f"no culprit named (gloo dumps do not record send/recv, and rank(s) "
            f"{ctx.ranks(candidates)} issued some: each may be blocked in one, waiting for "
            "another, so the dumps cannot tell which of them is the root; candidates in "
            "evidence.candidates): ")
    return [replace(f, culprit_ranks=(), message=lead + f.message,
                    evidence={**{k: v for k, v in f.evidence.items() if k != "culprit_code"},
                              "candidates": candidates, "hidden_p2p": True})
            if uncertain(f) else f
            for f in findings]


def stragglers_beside_errors(findings: list[Finding]) -> tuple[list[Finding], list[str]]:
    """A straggler beside a hang or desync is a note, not a culprit.

    Around a hang or a desync the ranks stop at different points, run ahead or
    wait out the failure, so their arrival times say more about the fault than
    about a slow GPU: a rank that looks late there is not named beside the root
    cause (issue 20: noisy ranks were added as second and third culprits beside
    real mismatches). The straggler's text stays in the notes.
    """
    if not any(f.severity is Severity.ERROR for f in findings):
        return findings, []
    kept = [f for f in findings if f.kind is not FindingKind.STRAGGLER]
    notes = [f"straggler not named beside the error finding(s) (arrival times around a hang "
             f"or desync are distorted): {f.message}"
             for f in findings if f.kind is FindingKind.STRAGGLER]
    return kept, notes


def culprits_of(findings: list[Finding]) -> tuple[int, ...]:
    errors = [f for f in findings if f.severity is Severity.ERROR]
    chosen = errors or [f for f in findings if f.kind is FindingKind.STRAGGLER]
    out: list[int] = []
    for finding in chosen:
        for rank in finding.culprit_ranks:
            if rank not in out:
                out.append(rank)
    return tuple(out)
