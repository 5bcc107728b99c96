"""``cross_pg_deadlock``: ranks wait on each other across process groups.

Rule: a cycle in the wait-for graph that involves collectives of two or more
groups — typically ranks that issued two groups' collectives in opposite
orders, or a rank that skipped one group's collective and went on to the next.
The culprits are the cycle members whose order deviates, judged by the
strongest evidence available, in this order:

1. *Own history*: a training loop repeats itself, so every op a rank issues
   was, earlier in its ring, followed by the same next op. For each cycle
   member, the op it is blocked in is compared with what followed its previous
   op (same group, op, size, dtype, peer and call site) every earlier time. A
   member blocked in an op that never followed that predecessor before, while
   other members are blocked in their usual next op, issued its groups'
   collectives out of order.
2. *Peer evidence*: when a member entered its blocking op (G, s), how far it
   had got in its own analog of the group the next member is blocked in (same
   description and size, e.g. its own DP group). Peers — the ranks of the
   cycle's groups, i.e. the same pipeline stage, whose groups number their seqs
   alike — that entered seq s of G or of an analog of G (queued entries count:
   the ring is issue order) show how far one normally is at that point; a
   member that disagrees with their majority deviates.
3. Otherwise the member(s) blocked in the kind of group (description and size)
   the fewest ranks are blocked in (the majority order wins); on a tie every
   member of the cycle is named.

The message gives both orders with their code locations; ``evidence`` lists
every group of the cycle and, per member, its blocking op, what it waits for,
and the history check.

Worked example (TP {16..23}, {24..31}; DP {17,25}, {18,26}; every step ends
with DP reduce_scatter, then TP all_reduce; ranks 17 and 26 swap the two)::

    rank 17 waits in TP all_reduce #1690 for 18  (after DP rs bucket 1 it always did rs bucket 2)
    rank 18 waits in DP reduce_scatter #102 for 26   (its usual next op)
    rank 26 waits in TP all_reduce #1690 for 25  (out of order, like 17)
    rank 25 waits in DP reduce_scatter #102 for 17   (its usual next op)
    -> cross_pg_deadlock, culprits 17 and 26; 18 and 25 only wait
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from frforensics.analyzer.context import Context
from frforensics.analyzer.digest import RankDigest
from frforensics.analyzer.merge import JobModel
from frforensics.analyzer.waits import Wait
from frforensics.report import Finding, FindingKind, Severity

__all__ = ["OrderCheck", "detect", "order_check"]


@dataclass(frozen=True, slots=True)
class OrderCheck:
    """How a rank's blocking op compares with what it issued at that point before."""

    rank: int
    seen: int  # earlier occurrences of the blocking op's predecessor
    usual: int  # of them, how many were followed by the blocking op itself
    usual_next: str | None  # what most often followed (op on group, location)
    previous: str | None  # the predecessor (op on group, location)

    @property
    def deviates(self) -> bool:
        """The blocking op never followed its predecessor before (while others did)."""
        return self.seen > 0 and self.usual == 0

    @property
    def conforms(self) -> bool:
        return self.seen > 0 and self.usual > 0

    def to_json(self) -> dict[str, Any]:
        return {"earlier_occurrences": self.seen, "followed_by_same_op": self.usual,
                "previous_op": self.previous, "usual_next_op": self.usual_next}


def _signature(d: RankDigest) -> npt.NDArray[np.int64]:
    """One row per entry: what identifies "the same op" across steps."""
    site = d.site if d.site is not None else np.zeros(len(d), dtype=np.uint32)
    numel = d.numel if d.numel is not None else d.size
    return np.stack([
        d.group.astype(np.int64), d.op_hash.astype(np.int64), numel.astype(np.int64),
        d.dtype_hash.astype(np.int64), d.peer.astype(np.int64), site.astype(np.int64),
        d.is_p2p.astype(np.int64),
    ], axis=1)


def _short_group(ctx: Context, gid: int) -> str:
    g = ctx.job.groups[gid]
    desc = g.desc if g.desc and g.desc != "undefined" else f"group {g.name}"
    return f"{desc} (ranks {ctx.ranks(g.ranks)})"


def _short_site(site: str) -> str:
    """``/a/b/file.py:12 in fn`` -> ``file.py:12 in fn`` (evidence keeps the full path)."""
    path, _, rest = site.partition(":")
    return f"{path.rsplit('/', 1)[-1]}:{rest}" if rest else site


def _op_text(ctx: Context, d: RankDigest, row: int) -> str:
    gid = ctx.job.group_of.get((d.rank, int(d.group[row])))
    group = "?" if gid is None else _short_group(ctx, gid)
    op = d.op_names.get(int(d.op_hash[row]), "?")
    where = ""
    if d.site is not None and d.sites is not None:
        loc = d.sites.get(int(d.site[row]))
        where = f" at {_short_site(loc)}" if loc else ""
    return f"{op} on {group}{where}"


MAX_CONTEXT = 64


def order_check(ctx: Context, wait: Wait) -> OrderCheck | None:
    """Compare ``wait``'s op with what followed the same ops earlier on that rank.

    The context is the longest run of ops just before the blocking one that also
    occurred earlier in the ring (up to ``MAX_CONTEXT`` ops): a layer loop repeats
    one op many times, and only the ops around it say which repetition this is.
    """
    d = ctx.job.digests.get(wait.rank)
    p = wait.row
    if d is None or p < 1:
        return None
    _, ids = np.unique(_signature(d)[: p + 1], axis=0, return_inverse=True)
    ids = ids.reshape(-1)
    cand = np.flatnonzero(ids[: p - 1] == ids[p - 1])  # earlier ends of the context
    if len(cand) == 0:
        return OrderCheck(wait.rank, 0, 0, None, _op_text(ctx, d, p - 1))
    for h in range(1, min(MAX_CONTEXT, p)):
        ok = cand >= h
        longer = cand[ok][ids[cand[ok] - h] == ids[p - 1 - h]]
        if len(longer) == 0:
            break
        cand = longer
    nxt = cand + 1
    same = ids[nxt] == ids[p]
    common = Counter(ids[nxt].tolist()).most_common(1)[0][0]
    row = int(nxt[np.flatnonzero(ids[nxt] == common)[0]])
    return OrderCheck(wait.rank, len(cand), int(same.sum()), _op_text(ctx, d, row),
                      _op_text(ctx, d, p - 1))


def detect(ctx: Context) -> list[Finding]:
    """One finding per wait cycle that spans more than one group."""
    kind_of = {g.gid: (g.desc, len(g.ranks)) for g in ctx.job.groups}
    blocked_in = Counter(kind_of[w.gid] for w in ctx.graph.waits.values())
    findings: list[Finding] = []
    for cycle in ctx.graph.cycles:
        if cycle.p2p_only:
            continue
        checks = {w.rank: order_check(ctx, w) for w in cycle.waits}
        history = {r for r, c in checks.items() if c is not None and c.deviates}
        conforming = {r for r, c in checks.items() if c is not None and c.conforms}
        basis: str
        if history and conforming:
            culprits = tuple(sorted(history))
            basis = "own_history"
        else:
            deviants = _deviants(ctx, cycle.waits)
            score = {w.rank: blocked_in[kind_of[w.gid]] for w in cycle.waits}
            low = min(score.values())
            if deviants and len(deviants) < len(cycle.ranks):
                culprits = tuple(sorted(deviants))
                basis = "peers"
            elif len(set(score.values())) > 1:
                culprits = tuple(sorted(r for r, s in score.items() if s == low))
                basis = "majority"
            else:
                culprits = cycle.ranks
                basis = "none"
        inverted = set(culprits) != set(cycle.ranks)
        by_rank = {w.rank: w for w in cycle.waits}
        orders = _orders(ctx, culprits, checks, by_rank, conforming) if basis == "own_history" else ""
        if inverted:
            verdict = (f"rank(s) {ctx.ranks(culprits)} issued two groups' collectives in the "
                       "opposite order to the others")
        else:
            verdict = ("the ranks issued the groups' collectives in opposite orders, and the "
                       "dumps do not tell which order is the intended one")
        first = by_rank[culprits[0]]
        groups = sorted({w.gid for w in cycle.waits})
        waiting = sorted(cycle.waiters | (set(cycle.ranks) - set(culprits)))
        msg = f"deadlock across {len(groups)} groups: {verdict}" + (f". {orders}" if orders else "")
        msg += ". Cycle: " + _ring(ctx, cycle.waits)
        if cycle.waiters:
            msg += f"; {len(cycle.waiters)} more rank(s) wait on it"
        findings.append(Finding(
            kind=FindingKind.CROSS_PG_DEADLOCK,
            severity=Severity.ERROR,
            message=msg,
            culprit_ranks=culprits,
            waiting_ranks=tuple(waiting),
            pg=ctx.pg(first.gid),
            seq=first.seq,
            seq_kind=first.seq_kind,
            op=first.op,
            location=first.location,
            evidence={
                "groups": [ctx.pg(g).to_json() | {"blocked_ranks": sum(
                    1 for w in ctx.graph.waits.values() if w.gid == g)} for g in groups],
                "cycle": [{"rank": w.rank, "pg": ctx.job.groups[w.gid].name,
                           "pg_ranks": ctx.pg(w.gid).to_json()["ranks"], "op": w.op,
                           "seq": w.seq, "seq_kind": w.seq_kind, "waits_for": list(w.on),
                           "location": w.location,
                           "order": _check_json(checks[w.rank])}
                          for w in cycle.waits],
                "inverted": inverted,
                "basis": basis,
            },
        ))
    return findings[: ctx.options.max_findings_per_kind]


def _check_json(check: OrderCheck | None) -> dict[str, Any] | None:
    return None if check is None else check.to_json()


def _orders(ctx: Context, culprits: tuple[int, ...], checks: dict[int, OrderCheck | None],
            by_rank: dict[int, Wait], conforming: set[int]) -> str:
    """Both orders, with code locations: the deviants' and the one they broke."""
    parts = []
    for r in culprits[:2]:
        c = checks[r]
        if c is None:
            continue
        now = _op_text(ctx, ctx.job.digests[r], by_rank[r].row)
        parts.append(f"Rank {r} issued {now} right after {c.previous}; the {c.seen} earlier "
                     f"time(s) it issued {c.usual_next} next")
    if len(culprits) > 2:
        parts.append(f"ranks {ctx.ranks(culprits[2:])} likewise")
    others = sorted(conforming)
    if others:
        parts.append(f"rank(s) {ctx.ranks(others)} kept that order and wait")
    return ". ".join(parts)


def _ring(ctx: Context, waits: list[Wait]) -> str:
    """``17 (all_reduce #715 on TP) -> 18 (...) -> ... -> 17``, following the edges."""
    by_rank = {w.rank: w for w in waits}
    start = min(by_rank)
    out: list[str] = []
    cur, seen = start, set()
    while cur in by_rank and cur not in seen and len(out) < 8:
        seen.add(cur)
        w = by_rank[cur]
        out.append(f"{cur} ({w.op} #{w.seq} on {_short_group(ctx, w.gid)})")
        cur = next((t for t in w.on if t in by_rank), start)
    return " waits for ".join(out) + f" waits for {cur}" + ("" if len(out) < 8 else " …")


def _progress(job: JobModel, rank: int, gid_at: int, seq_at: int, gid_other: int) -> int | None:
    """``rank``'s newest seq in ``gid_other`` when it entered ``seq_at`` of ``gid_at``."""
    d = job.digests.get(rank)
    at, other = job.groups[gid_at].local.get(rank), job.groups[gid_other].local.get(rank)
    if d is None or at is None or other is None:
        return None
    coll = d.is_p2p == 0
    rows = np.flatnonzero((d.group == at) & (d.seq == seq_at) & coll)
    if len(rows) == 0:
        return None
    first = int(rows[0])
    before = (d.group[:first] == other) & coll[:first]
    if not before.any():
        return None if job.window_evicted(rank) else 0
    return int(d.seq[:first][before].max())


def _analog(job: JobModel, gid: int, rank: int) -> int | None:
    """``gid`` itself if ``rank`` is a member, else its one analog holding ``rank``."""
    group = job.groups[gid]
    if rank in group.ranks:
        return gid
    analogs = [h.gid for h in job.groups if h.gid != gid and rank in h.ranks
               and h.desc == group.desc and len(h.ranks) == len(group.ranks)]
    return analogs[0] if len(analogs) == 1 else None


def _deviants(ctx: Context, waits: list[Wait]) -> set[int]:
    """Cycle members whose progress in the other group disagrees with their peers'."""
    job = ctx.job
    by_rank = {w.rank: w for w in waits}
    # References: ranks of the cycle's own groups. Analogs elsewhere (another
    # pipeline stage) number their groups' seqs differently, and outvote them.
    pool = sorted(set().union(*(job.dumped_members(w.gid) for w in waits)))
    out: set[int] = set()
    for w in waits:
        others = set()
        for t in w.on:
            if t in by_rank and by_rank[t].gid != w.gid:
                mine = _analog(job, by_rank[t].gid, w.rank)
                if mine is not None and mine != w.gid:
                    others.add(mine)
        for other in others:
            progress = _progress(job, w.rank, w.gid, w.seq, other)
            if progress is None:
                continue
            refs = []
            for q in pool:
                if q == w.rank:
                    continue
                g_at, g_other = _analog(job, w.gid, q), _analog(job, other, q)
                if g_at is None or g_other is None:
                    continue
                p = _progress(job, q, g_at, w.seq, g_other)
                if p is not None:
                    refs.append(p)
            if refs and progress != Counter(refs).most_common(1)[0][0]:
                out.add(w.rank)
    return out
