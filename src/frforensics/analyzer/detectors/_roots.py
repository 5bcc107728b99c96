"""Shared wording of the hang detectors: a root rank and the waits that name it."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from frforensics.analyzer.context import Context
from frforensics.analyzer.waits import Root, Wait

__all__ = ["doing", "primary_wait", "rank_activity", "since"]


def primary_wait(root: Root) -> tuple[Wait | None, list[Wait]]:
    """The op most ranks wait in for ``root`` (and all waits on that op).

    On a tie, the op whose waiters began waiting first: where the job first got
    stuck on this rank.
    """
    by: dict[tuple[int, int, str], list[Wait]] = defaultdict(list)
    for w in root.direct:
        if w.rank != root.rank:
            by[(w.gid, w.seq, w.seq_kind)].append(w)
    if not by:
        return None, []

    def started(waits: list[Wait]) -> int:
        times = [w.detail.t_enqueue_ns for w in waits if w.detail and w.detail.t_enqueue_ns]
        return min(times) if times else 2**63

    key = max(by, key=lambda k: (len(by[k]), -started(by[k]), -k[1]))
    return by[key][0], by[key]


def since(waits: list[Wait]) -> str:
    ages = [w.age_s for w in waits if w.age_s is not None]
    return f" for {max(ages):.1f} s" if ages else ""


def rank_activity(ctx: Context, rank: int, *, last: int = 3) -> dict[str, Any]:
    """What ``rank`` was doing at dump time: main-thread frame and last ops."""
    d = ctx.job.digests.get(rank)
    if d is None:
        return {"dump": None}
    rows = sorted(d.details)[-last:]
    ops = []
    for row in rows:
        det = d.details[row]
        gid = ctx.job.group_of.get((rank, det.group))
        ops.append({
            "op": det.op,
            "pg": None if gid is None else ctx.job.groups[gid].name,
            "seq": det.p2p_seq if det.is_p2p else det.seq,
            "seq_kind": "p2p" if det.is_p2p else "collective",
            "state": det.state.name.lower(),
            "location": det.location,
        })
    return {
        "stuck_at": d.stuck_at(),
        "dump_reason": d.dump_reason,
        "last_ops": ops,
        "blocked_in": None if rank not in ctx.graph.waits else ctx.describe(ctx.graph.waits[rank]),
    }


def doing(ctx: Context, rank: int) -> str:
    """One clause on what ``rank`` was doing at dump time."""
    d = ctx.job.digests.get(rank)
    if d is None:
        return f"rank {rank} left no dump"
    where = d.stuck_at()
    if where:
        return f"rank {rank} was at {where} at dump time"
    if d.details:
        det = d.details[max(d.details)]
        state = det.state.name.lower()
        loc = f" ({det.location})" if det.location else ""
        return f"rank {rank}'s last recorded op was {det.op} ({state}){loc}"
    return f"rank {rank} recorded no ops"
