"""The wait-for graph across process groups, its roots and its cycles.

Every rank with an unfinished op is *blocked* in its oldest unfinished op, and
waits for the peers that op needs but that have not joined it:

* a collective ``s`` of group G waits for the members of G that never entered
  ``s`` (their newest seq in G is below ``s``) or left no dump;
* a recv from B (the k-th from B in that group) waits for B when B has not
  posted its k-th send to this rank (exact with per-peer numbers, which our
  dumps carry; on native dumps, inferred: B has no matching op pending); a send
  likewise waits for the recv.

Following the edges from every blocked rank ends either at a *root* — a rank
waiting on nobody: not blocked at all (stuck in Python, or finished), dead,
without a dump, or blocked in an op every peer joined (a timeout) — or in a
*cycle* (a deadlock across groups or in p2p).

Worked example (TP groups {0,1},{2,3}, DP groups {0,2},{1,3}; rank 3 is stuck in
a data loader)::

    rank 1: DP all_reduce #50 on {1,3}   -> waits for 3 (never entered #50)
    rank 0: TP all_reduce #101 on {0,1}  -> waits for 1 (never entered #101)
    rank 2: DP all_reduce #50 on {0,2}   -> waits for 0 (never entered #50)
    rank 3: no unfinished op              -> root

    roots = {3}: every chain ends there; ranks 0, 1, 2 are only waiting.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

from frforensics.analyzer.digest import EntryDetail
from frforensics.analyzer.merge import RECV_HASH, SEND_HASH, JobModel
from frforensics.model import OpState

__all__ = ["Cycle", "Root", "Wait", "WaitGraph", "build_wait_graph"]

RootKind = Literal["free", "no_dump", "dead", "stuck_in_op"]


@dataclass(frozen=True, slots=True)
class Wait:
    """One blocked rank: the op it is blocked in and whom it waits for."""

    rank: int
    row: int
    gid: int
    seq: int
    seq_kind: str  # "collective" or "p2p"
    op: str
    on: tuple[int, ...]
    reasons: dict[int, str]
    entered: tuple[int, ...]
    age_s: float | None
    detail: EntryDetail | None
    confidence: str = "exact"

    @property
    def location(self) -> str | None:
        return None if self.detail is None else self.detail.location


@dataclass(slots=True)
class Root:
    """A rank at the end of wait chains."""

    rank: int
    kind: RootKind
    waiters: set[int] = field(default_factory=set)  # every rank whose chain ends here
    direct: list[Wait] = field(default_factory=list)  # waits that name this rank


@dataclass(slots=True)
class Cycle:
    """Ranks that wait on each other in a ring (a deadlock)."""

    ranks: tuple[int, ...]
    waits: list[Wait]
    waiters: set[int] = field(default_factory=set)

    @property
    def p2p_only(self) -> bool:
        return all(w.seq_kind == "p2p" for w in self.waits)


@dataclass(slots=True)
class WaitGraph:
    """Blocked ranks, their waits, and where the chains end."""

    waits: dict[int, Wait]
    roots: dict[int, Root]
    cycles: list[Cycle]
    young: list[int]  # ranks whose unfinished op is too recent to call a hang


def _p2p_waits(job: JobModel, rank: int, rows: list[int]) -> tuple[list[int], dict[int, str], str]:
    """Peers that have not posted the counterpart of ``rank``'s pending p2p ``rows``."""
    d = job.digests[rank]
    on: list[int] = []
    reasons: dict[int, str] = {}
    confidence = "exact"
    for row in rows:
        peer = int(d.peer[row])
        if peer < 0:
            confidence = "unknown peer"
            continue
        other = job.digests.get(peer)
        if other is None:
            on.append(peer)
            reasons[peer] = "no_dump"
            continue
        mine = int(d.op_hash[row])
        want = RECV_HASH if mine == SEND_HASH else SEND_HASH
        local = job.groups[job.group_of[(rank, int(d.group[row]))]].local.get(peer)
        match = (other.is_p2p.astype(bool)) & (other.peer == rank) & (other.op_hash == want)
        if local is not None:
            match &= other.group == local
        k = int(d.peer_seq[row])
        if k > 0 and int(other.peer_seq[match].max(initial=0)) > 0:
            posted = int(other.peer_seq[match].max(initial=0)) >= k
        elif k > 0 and not match.any() and not job.window_evicted(peer):
            posted = False
        else:
            # Native dumps carry no per-pair numbers: a counterpart still pending
            # on the peer is taken as the match.
            confidence = "inferred"
            posted = bool((match & (other.state < OpState.COMPLETED)).any())
        if not posted:
            on.append(peer)
            reasons[peer] = "not_posted"
    return on, reasons, confidence


def build_wait_graph(job: JobModel, *, hang_after_s: float = 1.0) -> WaitGraph:
    """Find every blocked rank's wait, then the roots and cycles of the graph."""
    waits: dict[int, Wait] = {}
    young: list[int] = []
    coll_cache: dict[tuple[int, int], dict[int, str]] = {}
    for rank, d in sorted(job.digests.items()):
        pending = d.pending_rows()
        if len(pending) == 0:
            continue
        row = int(pending[0])
        age = job.age_s(rank, row)
        if age is not None and age < hang_after_s:
            young.append(rank)
            continue
        gid = job.group_of.get((rank, int(d.group[row])))
        if gid is None:
            continue
        detail = d.detail(row)
        op = d.op_names.get(int(d.op_hash[row]), "?")
        if d.is_p2p[row]:
            p2p_rows = [int(r) for r in pending if d.is_p2p[r]]
            on, reasons, confidence = _p2p_waits(job, rank, p2p_rows)
            waits[rank] = Wait(rank, row, gid, int(d.p2p_seq[row]), "p2p", op, tuple(on),
                               reasons, (), age, detail, confidence)
            continue
        seq = int(d.seq[row])
        status = coll_cache.get((gid, seq))
        if status is None:
            status = {}
            issued = int(d.t_enqueue_ns[row])
            for member in job.groups[gid].ranks:
                if member not in job.digests:
                    status[member] = "no_dump"
                else:
                    status[member] = job.entered(member, gid, seq, issued_ns=issued)
            coll_cache[(gid, seq)] = status
        if any(s == "completed" for s in status.values()):
            # A collective completes on all members or none: a member that finished
            # it proves it ran; this rank's entry only awaits its (lazy) retirement.
            continue
        on_coll = tuple(m for m, s in status.items()
                        if m != rank and s in ("not_entered", "no_dump"))
        entered = tuple(m for m, s in status.items() if s in ("entered", "completed"))
        waits[rank] = Wait(rank, row, gid, seq, "collective", op, on_coll,
                           {m: status[m] for m in on_coll}, entered, age, detail)

    roots, cycles = _chains(job, waits)
    return WaitGraph(waits=waits, roots=roots, cycles=cycles, young=young)


def _chains(job: JobModel, waits: dict[int, Wait]) -> tuple[dict[int, Root], list[Cycle]]:
    edges = {r: w.on for r, w in waits.items()}
    sccs = _strongly_connected(edges)
    comp_of = {r: i for i, comp in enumerate(sccs) for r in comp}
    cycles: dict[int, Cycle] = {}
    for i, comp in enumerate(sccs):
        if len(comp) > 1:
            cycles[i] = Cycle(tuple(sorted(comp)), [waits[r] for r in sorted(comp)])

    roots: dict[int, Root] = {}

    def root_kind(rank: int) -> RootKind:
        d = job.digests.get(rank)
        if d is None:
            return "no_dump"
        if d.death is not None:
            return "dead"
        if rank in waits:
            return "stuck_in_op"
        return "free"

    # Terminal nodes: ranks waited on that wait on nobody, and blocked ranks
    # with no edges (every peer joined their op: a timeout candidate).
    ends: dict[int, set[tuple[str, int]]] = {}

    def reach(rank: int, seen: set[int]) -> set[tuple[str, int]]:
        if rank in ends:
            return ends[rank]
        comp = comp_of.get(rank)
        if comp is not None and comp in cycles:
            result = {("cycle", comp)}
        elif rank not in waits or not waits[rank].on:
            result = {("root", rank)}
        else:
            result = set()
            seen.add(rank)
            for nxt in waits[rank].on:
                if nxt in seen:
                    continue
                result |= reach(nxt, seen)
            seen.discard(rank)
        ends[rank] = result
        return result

    for rank, wait in waits.items():
        for end_kind, key in reach(rank, set()):
            if end_kind == "cycle":
                if rank not in cycles[key].ranks:
                    cycles[key].waiters.add(rank)
            elif key != rank or not wait.on:
                root = roots.get(key)
                if root is None:
                    root = roots[key] = Root(key, root_kind(key))
                if key != rank:
                    root.waiters.add(rank)
    for wait in waits.values():
        for target in wait.on:
            if target in roots:
                roots[target].direct.append(wait)
    # A blocked rank whose op every peer joined is a root only if the op is
    # stuck on it: record the wait itself as its direct evidence.
    for rank, root in roots.items():
        if root.kind == "stuck_in_op" and rank in waits:
            root.direct.insert(0, waits[rank])
    return roots, list(cycles.values())


def _strongly_connected(edges: dict[int, tuple[int, ...]]) -> list[list[int]]:
    """Tarjan's algorithm, iterative (10,000-rank graphs overflow recursion)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    out: list[list[int]] = []
    counter = 0
    nodes = set(edges) | {t for targets in edges.values() for t in targets}
    for start in sorted(nodes):
        if start in index:
            continue
        work: list[tuple[int, int]] = [(start, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            targets = edges.get(node, ())
            if i < len(targets):
                work.append((node, i + 1))
                nxt = targets[i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                out.append(comp)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return out


def group_waiters_by_op(waits: list[Wait]) -> dict[tuple[int, int, str], list[Wait]]:
    """Waits keyed by (group, seq, seq_kind), biggest first."""
    by: dict[tuple[int, int, str], list[Wait]] = defaultdict(list)
    for w in waits:
        by[(w.gid, w.seq, w.seq_kind)].append(w)
    return dict(sorted(by.items(), key=lambda kv: -len(kv[1])))

