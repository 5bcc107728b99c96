"""``p2p_deadlock``: sends and recvs that can never meet.

Rule: sends and recvs are paired per ordered pair of ranks and group — the k-th
send from A to B with the k-th recv at B from A — in global ranks
(``p2p_seq_id`` counts all of a group's p2p ops on one process, so it does not
pair them; ``analyzer.waits`` does the pairing). Three cases:

* a cycle of p2p waits: every rank of it waits for the next to post its side —
  *recv/recv* (both sides receive first), *send/send* (both send first, without
  buffering), or a longer ring. Every rank of the cycle is a culprit;
* an unmatched op: a rank waits in a send/recv whose peer is alive and not
  blocked in p2p, but never posted the counterpart: the culprit is that peer;
* a transfer both sides posted that never completed (stuck below the
  framework, or the two sides disagree on its size): reported as ``timeout``
  with ``seq_kind`` p2p, both sides named.

Pairing is exact on our dumps (per-peer numbers) and on native dumps whose rings
still hold the channel's beginning; otherwise it is aligned on completed pairs,
sizes and completion gaps and carries a confidence (``evidence.pairing``). A
low-confidence pairing never accuses one rank alone: both ends of the channel
are named and the message says the pairing is a guess.

Worked example (pipeline stages 0 -> 1 over ranks 9 and 25; rank 9 posts its
recv from 25 before its send to 25, rank 25 does the same)::

    rank 9:  recv from 25 (p2p #401) pending, its send to 25 not posted
    rank 25: recv from 9 (p2p #402) pending, its send to 9 not posted
    -> p2p_deadlock (recv/recv), culprits 9 and 25

A cycle one rank caused. Training repeats itself: the send/recv a rank posts
after a collective (a pipeline's per-step loss broadcast) are the ones it posted
after the same collective a step earlier. A rank's order is *stable* when its
two previous runs of that collective (same group and op) were each followed by
the very same send/recv (op and peer, in order). When exactly one rank of a
cycle left its stable order (``_deviation``) and every other rank of the cycle
still follows its own stable order, that rank alone is the culprit: the others
wait on a send it skipped (or a recv it moved). Anything less — a cycle in the
first steps, a rank whose order is not stable (collectives inside a step, a
varying schedule), two ranks that changed — names every rank of the cycle as
above. Real run (``scripts/workloads/pipeline.py --fault stop_send``, 4
stages, ``Schedule1F1B``; stage 1 stops sending activations at step 3)::

    rank 1, after broadcast #2:  recv from 0, send to 2, recv from 0, send to 2, ...
    rank 1, after broadcast #3:  recv from 0, recv from 0, recv from 0, recv from 2 (pending)
    rank 2, after broadcast #2:  recv from 1, send to 3, ...
    rank 2, after broadcast #3:  recv from 1 (pending)
    -> p2p_deadlock, culprit 1: "rank 1 left its previous step's order: its op 2
       after broadcast #3 is recv from rank 0 where it was send to rank 2"; rank 2 waits on it
"""

from __future__ import annotations

from typing import Any

import numpy as np

from frforensics.analyzer.context import Context
from frforensics.analyzer.detectors._roots import (
    chain_lines,
    doing,
    primary_wait,
    rank_activity,
    since,
)
from frforensics.analyzer.waits import Cycle, P2PPairing, Wait
from frforensics.report import Finding, FindingKind, Severity


def _pairings(waits: list[Wait]) -> list[P2PPairing]:
    return [p for w in waits for p in w.p2p]


def _confidence(waits: list[Wait]) -> str:
    levels = ("exact", "high", "low", "unknown")
    values = [w.confidence for w in waits] or ["exact"]
    return max(values, key=levels.index)


def _op_text(ctx: Context, p: P2PPairing) -> str:
    direction = "to" if p.op == "send" else "from"
    number = f" #{p.index}" if p.index is not None else ""
    return f"{p.op}{number} {direction} rank {p.peer}"


def _cycle_shape(cycle_waits: list[Wait]) -> str:
    ops = {p.op for w in cycle_waits for p in w.p2p if p.status == "not_posted"}
    if ops == {"recv"}:
        return "recv/recv: each waits to receive from the other before sending"
    if ops == {"send"}:
        return "send/send: each sends to the other before receiving, and nothing buffers the sends"
    return "each waits for the next to post its side"


def _segments(ctx: Context, rank: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]],
                                                str] | None:
    """This rank's p2p ops (op, peer) since its last collective, and its step before:
    those after the previous run of the same collective (same group and op) up to
    the next collective — when the run before that was followed by the very same
    ops (the order is stable); None otherwise."""
    d = ctx.job.digests.get(rank)
    if d is None or not len(d):
        return None
    coll = np.flatnonzero(d.is_p2p == 0)
    if len(coll) < 3:
        return None
    last = int(coll[-1])
    same = coll[:-1][(d.group[coll[:-1]] == d.group[last]) & (d.op_hash[coll[:-1]] == d.op_hash[last])]
    if len(same) < 2:
        return None

    def ops(lo: int, hi: int) -> list[tuple[int, int]]:
        return [(int(d.op_hash[r]), int(d.peer[r])) for r in range(lo + 1, hi) if d.is_p2p[r]]

    def step_after(start: int) -> list[tuple[int, int]]:
        return ops(start, int(coll[coll > start][0]))

    then, before = step_after(int(same[-1])), step_after(int(same[-2]))
    if not then or then != before:
        return None
    name = f"{d.op_names.get(int(d.op_hash[last]), 'collective')} #{int(d.seq[last])}"
    return ops(last, len(d)), then, name


def _deviation(ctx: Context, rank: int) -> str | bool | None:
    """How ``rank`` left its previous step's order (text), False when it follows it,
    None when there is nothing to compare (module doc)."""
    seg = _segments(ctx, rank)
    if seg is None:
        return None
    now, then, name = seg
    d = ctx.job.digests[rank]

    def text(op: tuple[int, int]) -> str:
        kind = d.op_names.get(op[0], "p2p")
        return f"{kind} {'to' if kind == 'send' else 'from'} rank {op[1]}"

    for i, op in enumerate(now):
        if i >= len(then):
            return (f"after {name} it posted {len(now)} send/recv where each of its two steps "
                    f"before posted {len(then)}")
        if op != then[i]:
            return (f"its op {i + 1} after {name} is {text(op)} where in each of its two steps "
                    f"before it was {text(then[i])}")
    return False


def _one_deviator(ctx: Context, cycle: Cycle) -> tuple[int, str] | None:
    """The one rank of ``cycle`` that left its own previous step's order while every
    other rank follows its own (module doc); None otherwise."""
    left: list[tuple[int, str]] = []
    for r in cycle.ranks:
        how = _deviation(ctx, r)
        if how is None:
            return None
        if how is not False:
            left.append((r, str(how)))
    return left[0] if len(left) == 1 else None


def detect(ctx: Context) -> list[Finding]:
    """Cycles of p2p waits, p2p ops whose peer never posted its side, stuck transfers."""
    findings: list[Finding] = []
    for cycle in ctx.graph.cycles:
        if not cycle.p2p_only:
            continue
        confidence = _confidence(cycle.waits)
        deviator = _one_deviator(ctx, cycle) if confidence in ("exact", "high") else None
        if deviator is not None:
            findings.append(_deviated(ctx, cycle, *deviator, confidence))
            continue
        lines = []
        for w in cycle.waits:
            missing = [p for p in w.p2p if p.status == "not_posted"]
            what = ", ".join(_op_text(ctx, p) for p in missing[:3]) or ctx.describe(w)
            lines.append(f"rank {w.rank} waits in {what} (p2p #{w.seq})"
                         + (f" at {w.location}" if w.location else ""))
        first = cycle.waits[0]
        msg = (f"p2p deadlock between ranks {ctx.ranks(cycle.ranks)} ({_cycle_shape(cycle.waits)}): "
               + "; ".join(lines[:6]))
        if confidence not in ("exact", "high"):
            msg += " (pairing inferred: the rings evicted the channels' beginnings)"
        if cycle.waiters:
            msg += f"; {len(cycle.waiters)} more rank(s) wait on them in turn"
        findings.append(Finding(
            kind=FindingKind.P2P_DEADLOCK,
            severity=Severity.ERROR,
            message=msg,
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
                      "ops": [p.to_json() for p in _pairings(cycle.waits)][:32],
                      "pairing": confidence},
        ))
    for rank, root in sorted(ctx.graph.roots.items()):
        if root.kind not in ("free", "stuck_in_op"):
            continue
        if root.kind == "stuck_in_op":
            findings.extend(_stuck(ctx, rank))
            continue
        wait, direct = primary_wait(root)
        if wait is None or wait.seq_kind != "p2p":
            continue
        confidence = _confidence(direct)
        unmatched = [p for w in direct for p in w.p2p if p.peer == rank and p.status == "not_posted"]
        counterpart = "send" if wait.op == "recv" else "recv"
        ops = "; ".join(f"rank {p.rank} waits in {p.op}{'' if p.index is None else f' #{p.index}'} "
                        f"{'to' if p.op == 'send' else 'from'} rank {rank}" for p in unmatched[:4])
        msg = (f"rank {rank} never posted the {counterpart} matching {ctx.describe(wait)}"
               f" ({ops or 'see evidence'}){since(direct)}; {doing(ctx, rank)}")
        waiters = {w.rank for w in direct}
        if confidence in ("exact", "high"):
            culprits: tuple[int, ...] = (rank,)
        else:
            culprits = (rank, *sorted(waiters))
            msg += (f". The pairing is a guess (confidence {confidence}: the rings evicted the "
                    "channel's beginning), so both ends are named")
        chain = chain_lines(ctx, sorted(root.waiters - waiters)[:1])
        if chain:
            msg += "; further waits: " + "; ".join(chain[:3])
        findings.append(Finding(
            kind=FindingKind.P2P_DEADLOCK,
            severity=Severity.ERROR,
            message=msg,
            culprit_ranks=culprits,
            waiting_ranks=tuple(sorted(root.waiters - set(culprits))),
            pg=ctx.pg(wait.gid),
            seq=wait.seq,
            seq_kind="p2p",
            op=wait.op,
            location=wait.location,
            evidence={"unmatched": [p.to_json() for p in unmatched][:32],
                      "culprit": rank_activity(ctx, rank), "pairing": confidence},
        ))
    return findings[: ctx.options.max_findings_per_kind]


def _deviated(ctx: Context, cycle: Cycle, rank: int, how: str, confidence: str) -> Finding:
    """A p2p cycle one rank caused by leaving its previous step's order."""
    mine = next(w for w in cycle.waits if w.rank == rank)
    others = [w for w in cycle.waits if w.rank != rank]
    lines = []
    for w in others:
        missing = [p for p in w.p2p if p.status == "not_posted"]
        what = ", ".join(_op_text(ctx, p) for p in missing[:3]) or ctx.describe(w)
        lines.append(f"rank {w.rank} waits in {what} (p2p #{w.seq})")
    msg = (f"rank {rank} left its previous step's order of send/recv: {how}; "
           + "; ".join(lines[:5]) + f" — every other rank of the cycle follows its own previous "
           f"step, so they wait on rank {rank}; {doing(ctx, rank)}")
    waiting = sorted({w.rank for w in others} | set(cycle.waiters))
    return Finding(
        kind=FindingKind.P2P_DEADLOCK,
        severity=Severity.ERROR,
        message=msg,
        culprit_ranks=(rank,),
        waiting_ranks=tuple(waiting),
        pg=ctx.pg(mine.gid),
        seq=mine.seq,
        seq_kind="p2p",
        op=mine.op,
        location=mine.location,
        evidence={"deviation": {"rank": rank, "how": how},
                  "cycle": [{"rank": w.rank, "op": w.op, "pg": ctx.job.groups[w.gid].name,
                             "p2p_seq": w.seq, "peer": None if w.detail is None else w.detail.peer,
                             "location": w.location} for w in cycle.waits],
                  "ops": [p.to_json() for p in _pairings(cycle.waits)][:32],
                  "culprit": rank_activity(ctx, rank), "pairing": confidence},
    )


def _stuck(ctx: Context, rank: int) -> list[Finding]:
    """A p2p batch whose every counterpart was posted, yet it never completed."""
    wait = ctx.graph.waits.get(rank)
    if wait is None or wait.seq_kind != "p2p" or not wait.p2p:
        return []
    posted = [p for p in wait.p2p if p.status == "posted"]
    if not posted or len(posted) != len(wait.p2p):
        return []
    peers = sorted({p.peer for p in posted})
    if any(p < rank and p in ctx.graph.roots and ctx.graph.roots[p].kind == "stuck_in_op"
           for p in peers):
        return []  # reported once, from the lowest rank of the transfer
    mismatched = [p for p in posted if p.size_mismatch]
    what = "; ".join(_op_text(ctx, p) for p in posted[:4])
    evidence: dict[str, Any] = {"ops": [p.to_json() for p in posted][:32],
                                "pairing": _confidence([wait])}
    if mismatched:
        msg = (f"rank {rank} and rank(s) {ctx.ranks(peers)} both posted their sides of {what}, "
               "but disagree on its size, so it can never complete")
    else:
        msg = (f"rank {rank} and rank(s) {ctx.ranks(peers)} both posted their sides of {what} "
               f"and it never completed{since([wait])}: the fault is likely below the "
               "framework (network, NCCL, device)")
    return [Finding(
        kind=FindingKind.TIMEOUT,
        severity=Severity.ERROR,
        message=msg,
        culprit_ranks=tuple(sorted({rank, *peers})),
        waiting_ranks=(),
        pg=ctx.pg(wait.gid),
        seq=wait.seq,
        seq_kind="p2p",
        op=wait.op,
        location=wait.location,
        evidence=evidence,
    )]
