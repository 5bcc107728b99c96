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
"""

from __future__ import annotations

from typing import Any

from frforensics.analyzer.context import Context
from frforensics.analyzer.detectors._roots import (
    chain_lines,
    doing,
    primary_wait,
    rank_activity,
    since,
)
from frforensics.analyzer.waits import P2PPairing, Wait
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


def detect(ctx: Context) -> list[Finding]:
    """Cycles of p2p waits, p2p ops whose peer never posted its side, stuck transfers."""
    findings: list[Finding] = []
    for cycle in ctx.graph.cycles:
        if not cycle.p2p_only:
            continue
        lines = []
        for w in cycle.waits:
            missing = [p for p in w.p2p if p.status == "not_posted"]
            what = ", ".join(_op_text(ctx, p) for p in missing[:3]) or ctx.describe(w)
            lines.append(f"rank {w.rank} waits in {what} (p2p #{w.seq})"
                         + (f" at {w.location}" if w.location else ""))
        confidence = _confidence(cycle.waits)
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
