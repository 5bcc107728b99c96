"""Shared wording of the hang detectors: a root rank and the waits that name it."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from frforensics.analyzer.context import Context
from frforensics.analyzer.waits import Root, Wait

__all__ = ["chain", "chain_lines", "doing", "primary_wait", "rank_activity", "since"]


def primary_wait(root: Root) -> tuple[Wait | None, list[Wait]]:
    """The op most ranks wait in for ``root`` (and all waits on that op).

    A collective wins over p2p waits (a rank missing from a collective is a
    ``missing_rank``, whatever p2p peers also wait on it); then the op whose
    waiters began waiting first — where the job first got stuck on this rank —
    and on equal times the one with the most waiters.
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

    key = max(by, key=lambda k: (k[2] == "collective", -started(by[k]), len(by[k]), -k[1]))
    return by[key][0], by[key]


def since(waits: list[Wait]) -> str:
    ages = [w.age_s for w in waits if w.age_s is not None]
    return f" for {max(ages):.1f} s" if ages else ""


def chain(ctx: Context, rank: int, *, limit: int = 16) -> list[Wait]:
    """The waits from ``rank`` down to the end of its chain (first waited-on rank each hop)."""
    out: list[Wait] = []
    seen: set[int] = set()
    cur = rank
    while cur in ctx.graph.waits and cur not in seen and len(out) < limit:
        seen.add(cur)
        w = ctx.graph.waits[cur]
        if not w.on:
            break
        out.append(w)
        cur = w.on[0]
    return out


def chain_lines(ctx: Context, ranks: list[int]) -> list[str]:
    """One line per hop of the chains from ``ranks``: who waits in what for whom."""
    lines: list[str] = []
    for rank in ranks:
        for w in chain(ctx, rank):
            line = f"rank {w.rank} waits in {ctx.describe(w)} for rank(s) {ctx.ranks(w.on)}"
            if line not in lines:
                lines.append(line)
    return lines


def _threads(ctx: Context, rank: int, *, frames: int = 4) -> list[dict[str, Any]]:
    d = ctx.job.digests.get(rank)
    if d is None:
        return []
    return [{"name": t.name, "main": t.is_main, "frames": [str(f) for f in t.frames[:frames]]}
            for t in d.threads[:8]]


def rank_activity(ctx: Context, rank: int, *, last: int = 3) -> dict[str, Any]:
    """What ``rank`` was doing at dump time: main-thread frame, thread stacks, last ops."""
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
        "threads": _threads(ctx, rank),
    }


def culprit_at(ctx: Context, rank: int) -> str | None:
    """Where ``rank`` itself was, for the headline's ``Code:`` line: its main thread
    at dump time with its caller, else where its newest recorded op was issued."""
    d = ctx.job.digests.get(rank)
    if d is None:
        return None
    where = d.stuck_at()
    if where:
        for t in d.threads:
            if t.is_main and len(t.frames) > 1:
                callers = [f for f in t.frames[1:2] if str(f) != where]
                if callers:
                    return f"{where} (called from {callers[0]})"
        return where
    if d.details:
        det = d.details[max(d.details)]
        if det.location:
            number = f"p2p #{det.p2p_seq}" if det.is_p2p else f"#{det.seq}"
            return f"{det.location} (its newest recorded op, {det.op} {number}: it stopped after it)"
    return None


def doing(ctx: Context, rank: int) -> str:
    """One clause on what ``rank`` was doing at dump time: where its main thread
    was (with the frames above it) and its last recorded op."""
    d = ctx.job.digests.get(rank)
    if d is None:
        return f"rank {rank} left no dump"
    parts = []
    where = d.stuck_at()
    if where:
        clause = f"rank {rank} was at {where} at dump time"
        for t in d.threads:
            if t.is_main and len(t.frames) > 1:
                callers = [f for f in t.frames[1:3] if str(f) != where]
                if callers:
                    clause += " (called from " + ", ".join(str(f) for f in callers) + ")"
                break
        parts.append(clause)
    if d.details:
        det = d.details[max(d.details)]
        state = det.state.name.lower()
        loc = f" at {det.location}" if det.location else ""
        gid = ctx.job.group_of.get((rank, det.group))
        group = "" if gid is None else f" on {ctx.job.groups[gid].desc or ctx.job.groups[gid].name}"
        number = f" (p2p #{det.p2p_seq})" if det.is_p2p else f" #{det.seq}"
        parts.append(f"{'its' if where else f'rank {rank}' + chr(39) + 's'} last recorded op was "
                     f"{det.op}{number}{group} ({state}){loc}")
    if not parts:
        return f"rank {rank} recorded no ops"
    return "; ".join(parts)
