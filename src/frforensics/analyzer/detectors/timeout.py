"""``timeout``: every member entered a collective, and it never completed.

Rule: a blocked rank that waits on nobody — every member of its group entered
the same seq — is stuck *inside* the op: a network, NCCL or device fault, or a
kernel that never ran. The least advanced members (still ``scheduled`` while
others ``started``; unfinished while others completed) are the culprits; when
all are equally stuck every member is named and the message says the fault is
below the framework. The elapsed time is compared with the op's ``timeout_ms``
where the dump time is known. Collectives already reported as mismatched are
not reported again. Severity error, status hang.

Worked example (NCCL, 4 ranks; rank 2's GPU hung)::

    ranks 0,1,3: all_reduce #88 state started    rank 2: all_reduce #88 state scheduled
    unfinished for 612 s, timeout 600 s
    -> timeout, culprit 2, waiting ranks 0,1,3
"""

from __future__ import annotations

from collections import defaultdict

from frforensics.analyzer.context import Context
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
        for member in ctx.job.groups[gid].ranks:
            if member not in states and member in ctx.job.digests \
                    and ctx.job.entered(member, gid, seq, issued_ns=0) == "completed":
                states[member] = OpState.COMPLETED
        lowest = min(states.values())
        culprits = sorted(r for r, s in states.items() if s == lowest)
        distinguishable = len(set(states.values())) > 1
        waiting = sorted(set(states) - set(culprits))
        wait = waits[0]
        ages = [w.age_s for w in waits if w.age_s is not None]
        timeout_ms = max((w.detail.timeout_ms for w in waits if w.detail is not None), default=0)
        if ages and timeout_ms:
            past = max(ages) * 1000 >= timeout_ms
            clock = (f"unfinished for {max(ages):.1f} s, "
                     f"{'past' if past else 'within'} its timeout of {timeout_ms / 1000:.0f} s")
        elif ages:
            clock = f"unfinished for {max(ages):.1f} s"
        else:
            clock = "dump time unknown, so whether it ran past its timeout could not be judged"
        if distinguishable:
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
    return findings[: ctx.options.max_findings_per_kind]
