"""``missing_rank``: a rank never entered a collective that its peers wait in.

Rule: follow the wait-for graph (``analyzer.waits``) from every blocked rank to
the end of its chain. A chain that ends at a rank that is alive (it left a dump),
not dead, and not blocked in any op — stuck in Python, a data loader, a sleep, or
simply past the loop — names that rank. Ranks that are merely waiting, also in
other groups, are never culprits. Severity error, status hang.

Worked example (TP {0,1},{2,3}; DP {0,2},{1,3}; rank 3 sleeps in a data loader)::

    rank 1 waits in DP all_reduce #50 on {1,3} for rank 3
    rank 0 waits in TP all_reduce #101 on {0,1} for rank 1 (blocked in DP)
    rank 2 waits in DP all_reduce #50 on {0,2} for rank 0 (blocked in TP)
    -> missing_rank, culprit 3, pg {1,3}, seq 50, waiting ranks 0-2
"""

from __future__ import annotations

from frforensics.analyzer.context import Context
from frforensics.analyzer.detectors._roots import (
    culprit_at,
    doing,
    primary_wait,
    rank_activity,
    since,
)
from frforensics.analyzer.detectors._stopped import stopped_finding, stopped_with_missing
from frforensics.report import Finding, FindingKind, Severity


def detect(ctx: Context) -> list[Finding]:
    """One finding per collective that alive, unblocked ranks never entered."""
    merged: dict[tuple[int, int], list[int]] = {}
    # stopped with a rank that left no dump (PyTorch's gloo dumps): missing_dump
    # names that rank, and this one failed because of it
    lost = stopped_with_missing(ctx)
    for rank, root in sorted(ctx.graph.roots.items()):
        if root.kind != "free" or rank in lost:
            continue
        wait, _ = primary_wait(root)
        if wait is None or wait.seq_kind != "collective":
            continue
        merged.setdefault((wait.gid, wait.seq), []).append(rank)
    findings = []
    # ranks with a dump that never entered the op those stopped after (the ones
    # without a dump are missing_dump's)
    entered_not = sorted({m for _, _, gone in lost.values() for m in gone
                          if m in ctx.job.digests})
    if entered_not and all(all(m in ctx.job.digests for m in gone) for _, _, gone in lost.values()):
        findings.append(stopped_finding(ctx, lost, entered_not))
    for (gid, seq), culprits in merged.items():
        roots = [ctx.graph.roots[r] for r in culprits]
        direct = [w for root in roots for w in primary_wait(root)[1]]
        wait = direct[0]
        waiters = sorted(set().union(*(root.waiters for root in roots)) - set(culprits))
        direct_ranks = sorted({w.rank for w in direct})
        who = "rank" + ("s " if len(culprits) > 1 else " ") + ctx.ranks(culprits)
        msg = (f"{who} never entered {ctx.describe(wait)}; ranks {ctx.ranks(direct_ranks)} "
               f"wait in it{since(direct)}")
        if len(waiters) > len(direct_ranks):
            msg += f" (and {len(waiters) - len(direct_ranks)} more rank(s) wait on them in turn)"
        msg += "; " + "; ".join(doing(ctx, r) for r in culprits[:3])
        findings.append(Finding(
            kind=FindingKind.MISSING_RANK,
            severity=Severity.ERROR,
            message=msg,
            culprit_ranks=tuple(culprits),
            waiting_ranks=tuple(waiters),
            pg=ctx.pg(gid),
            seq=seq,
            seq_kind="collective",
            op=wait.op,
            location=wait.location,
            evidence={
                "direct_waiters": direct_ranks,
                "culprits": {str(r): rank_activity(ctx, r) for r in culprits[:8]},
                "chains": _chains(ctx, waiters[:8]),
                "culprit_code": {str(r): at for r in culprits[:8]
                                 if (at := culprit_at(ctx, r)) is not None},
            },
        ))
    return findings[: ctx.options.max_findings_per_kind]


def _chains(ctx: Context, ranks: list[int]) -> dict[str, list[str]]:
    """For a few waiting ranks, the chain of waits down to the root."""
    out: dict[str, list[str]] = {}
    for rank in ranks:
        chain: list[str] = []
        seen: set[int] = set()
        cur = rank
        while cur in ctx.graph.waits and cur not in seen and len(chain) < 16:
            seen.add(cur)
            w = ctx.graph.waits[cur]
            if not w.on:
                break
            chain.append(f"rank {cur} waits in {ctx.describe(w)} for rank(s) {ctx.ranks(w.on)}")
            cur = w.on[0]
        out[str(rank)] = chain
    return out
