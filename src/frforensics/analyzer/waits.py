"""The wait-for graph across process groups, its roots and its cycles.

Every rank with an unfinished op is *blocked* in its oldest unfinished op, and
waits for the peers that op needs but that have not joined it:

* a collective ``s`` of group G waits for the members of G that never entered
  ``s`` (their newest seq in G is below ``s``) or left no dump;
* a recv from B (the k-th from B in that group) waits for B when B has not
  posted its k-th send to this rank, a send likewise waits for the recv
  (``P2PPairing``): exact with per-peer numbers (our dumps) or when neither ring
  evicted the channel's beginning; otherwise aligned on completed pairs, sizes
  and completion gaps, with a stated confidence. Every pending op of a p2p batch
  is paired, so a batch waits for every peer that owes it a counterpart.

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

A claimed world too large to list (``JobModel.silent_listed`` false: four dumps
that say 2^20 ranks) is never walked per rank: a collective of the default
group waits for the members with dumps that did not enter it, as above, and for
the members without a dump as one block (``Wait.unlisted``), whose chains end
at ``WaitGraph.unlisted`` — a root standing for all of them, never a rank.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from frforensics.analyzer.digest import EntryDetail
from frforensics.analyzer.merge import RECV_HASH, SEND_HASH, JobModel
from frforensics.model import OpState
from frforensics.rankset import EMPTY, RankSet

__all__ = ["Cycle", "P2PPairing", "Root", "Wait", "WaitGraph", "build_wait_graph"]

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
    p2p: tuple[P2PPairing, ...] = ()  # every pending send/recv of the batch, paired
    #: members without a dump waited for as one block (a claimed world too large
    #: to list); they are not in ``on``
    unlisted: RankSet = EMPTY

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
    #: where chains end in ranks without a dump too many to list (``Wait.unlisted``):
    #: ``rank`` -1, kind ``no_dump``; None when no wait has such a block
    unlisted: Root | None = None
    #: the ranks of that block (every ``Wait.unlisted`` together)
    unlisted_ranks: RankSet = EMPTY


@dataclass(frozen=True, slots=True)
class P2PPairing:
    """Where the counterpart of one pending send/recv stands.

    ``index`` is the op's 1-based number on its channel (the k-th send from A to
    B, or the k-th recv at B from A) when known; ``status`` is ``posted`` (the
    peer posted the counterpart), ``not_posted``, ``no_dump`` or ``unknown``;
    ``queued`` (posted, but only as an entry queued behind the op the peer is
    blocked in: the peer is waited for), ``confidence`` is ``exact`` (per-peer numbers, or both rings still hold the
    channel's whole history), ``high`` (aligned on completed pairs, sizes and
    completion times with one clear best alignment) or ``low`` (a guess: never
    enough to accuse a rank alone).
    """

    rank: int
    row: int
    op: str
    peer: int
    index: int | None
    status: str
    confidence: str
    basis: str
    counterpart_row: int | None = None
    size_mismatch: bool = False

    def to_json(self) -> dict[str, object]:
        return {"rank": self.rank, "op": self.op, "peer": self.peer, "index": self.index,
                "counterpart": self.status, "confidence": self.confidence, "basis": self.basis,
                "size_mismatch": self.size_mismatch}


_CONFIDENCE_ORDER = ("exact", "high", "low", "unknown")


def _worst_confidence(values: list[str]) -> str:
    return max(values, key=_CONFIDENCE_ORDER.index, default="exact")


def _channel(job: JobModel, rank: int, gid: int, peer: int, op_hash: int) -> npt.NDArray[np.intp]:
    """Rows of ``rank``'s ``op_hash`` (send/recv) ops with ``peer`` in group ``gid``."""
    d = job.digests[rank]
    local = job.groups[gid].local.get(rank)
    mask = d.is_p2p.astype(bool) & (d.peer == peer) & (d.op_hash == op_hash)
    if local is not None:
        mask &= d.group == local
    return np.flatnonzero(mask)


def _align(job: JobModel, rank: int, mine: npt.NDArray[np.intp], peer: int,
           theirs: npt.NDArray[np.intp]) -> tuple[int | None, str, str]:
    """Offset ``o`` with ``theirs[i + o]`` pairing ``mine[i]``, its confidence and basis.

    Without per-peer numbers, each side's ring may have evicted the channel's
    beginning. Candidate offsets are scored on the overlap: paired ops must have
    equal sizes and agree on completion (FIFO: completed ops pair with completed
    ones), and the gaps between successive completions must agree on both sides
    (clock offsets cancel in gaps). Candidates start from the anchor that pairs
    the last completed ops of both sides.
    """
    a, b = job.digests[rank], job.digests[peer]
    a_done = a.state[mine] >= OpState.COMPLETED
    b_done = b.state[theirs] >= OpState.COMPLETED
    a_full, b_full = not job.window_evicted(rank), not job.window_evicted(peer)
    if a_full and b_full:
        return 0, "exact", "both rings hold the whole channel"
    na, nb = len(mine), len(theirs)
    a_size = (a.numel if a.numel is not None else a.size)[mine]
    b_size = (b.numel if b.numel is not None else b.size)[theirs]
    a_tc = a.t_complete_ns[mine].astype(np.float64)
    b_tc = b.t_complete_ns[theirs].astype(np.float64)
    res = max(a.completion_resolution_ns, b.completion_resolution_ns, 1_000_000)
    if a_done.any() and b_done.any():
        anchor = int(np.flatnonzero(b_done)[-1]) - int(np.flatnonzero(a_done)[-1])
        candidates = list(range(anchor - 2, anchor + 3))
    else:
        # nothing completed on one side: its first pending op pairs with the other's
        first_a = int(np.argmin(a_done)) if not a_done.all() else na
        first_b = int(np.argmin(b_done)) if not b_done.all() else nb
        anchor = first_b - first_a
        candidates = list(range(anchor - 2, anchor + 3))
    if b_full:  # theirs indices are absolute, mine start at some s >= 0: o >= 0
        candidates = [o for o in candidates if o >= 0]
    if a_full:
        candidates = [o for o in candidates if o <= 0]
    if not candidates:
        return None, "low", "no consistent alignment"
    scores: dict[int, float] = {}
    for o in candidates:
        i = np.arange(max(0, -o), min(na, nb - o))
        if len(i) == 0:
            scores[o] = -0.5
            continue
        j = i + o
        same_size = a_size[i] == b_size[j]
        same_state = a_done[i] == b_done[j]
        score = float(np.sum(same_size & same_state)) - 3.0 * float(np.sum(~same_size | ~same_state))
        both = a_done[i] & b_done[j] & (a_tc[i] > 0) & (b_tc[j] > 0)
        if both.sum() >= 2:
            ga, gb = np.diff(a_tc[i][both]), np.diff(b_tc[j][both])
            score += float(np.sum(np.abs(ga - gb) <= 2 * res)) - float(np.sum(np.abs(ga - gb) > 2 * res))
        # a completed op the other side never posted is impossible
        score -= 3.0 * float(np.sum(b_done[max(0, na + o):]))
        scores[o] = score
    ranked = sorted(scores.items(), key=lambda kv: -kv[1])
    best, best_score = ranked[0]
    runner_up = ranked[1][1] if len(ranked) > 1 else -np.inf
    overlap = min(na, nb - best) - max(0, -best)
    if best_score >= 2 and best_score - runner_up >= 2 and overlap >= 2:
        return best, "high", "aligned on completed pairs, sizes and completion gaps"
    return best, "low", "rings evicted the channel's beginning; best guess from the pending tails"


def _p2p_waits(job: JobModel, rank: int, rows: list[int]) -> list[P2PPairing]:
    """Pair each of ``rank``'s pending p2p ``rows`` with the peer's counterpart.

    Sends and recvs pair per ordered pair of ranks and group: the k-th send from A
    to B with the k-th recv at B from A. Exact with per-peer numbers (our dumps)
    or when neither ring evicted the channel; otherwise aligned (see ``_align``).
    """
    d = job.digests[rank]
    out: list[P2PPairing] = []
    aligned: dict[tuple[int, int, int], tuple[npt.NDArray[np.intp], npt.NDArray[np.intp],
                                              int | None, str, str]] = {}
    for row in rows:
        peer = int(d.peer[row])
        mine_hash = int(d.op_hash[row])
        op = d.op_names.get(mine_hash, "?")
        if peer < 0:
            out.append(P2PPairing(rank, row, op, peer, None, "unknown", "unknown",
                                  "the dump does not say the peer's global rank"))
            continue
        other = job.digests.get(peer)
        if other is None:
            out.append(P2PPairing(rank, row, op, peer, None, "no_dump", "exact", "no dump"))
            continue
        gid = job.group_of[(rank, int(d.group[row]))]
        want = RECV_HASH if mine_hash == SEND_HASH else SEND_HASH
        key = (gid, peer, mine_hash)
        if key not in aligned:
            mine = _channel(job, rank, gid, peer, mine_hash)
            theirs = _channel(job, peer, gid, rank, want)
            aligned[key] = (mine, theirs, *_align(job, rank, mine, peer, theirs))
        mine, theirs, offset, confidence, basis = aligned[key]
        k = int(d.peer_seq[row])
        their_k = other.peer_seq[theirs]
        i = int(np.searchsorted(mine, row))
        if k > 0 and (len(theirs) == 0 or int(their_k.max()) > 0):
            hit = np.flatnonzero(their_k == k)
            if len(hit):
                j = int(theirs[hit[0]])
                out.append(P2PPairing(rank, row, op, peer, k, _posted(job, peer, j), "exact",
                                      "per-peer numbers", j, _size(job, rank, row, peer, j)))
            elif len(theirs) and int(their_k.max()) > k:
                out.append(P2PPairing(rank, row, op, peer, k, "posted", "high",
                                      "the peer's ring evicted its counterpart"))
            elif job.window_evicted(peer) and len(theirs) == 0:
                out.append(P2PPairing(rank, row, op, peer, k, "not_posted", "high",
                                      "per-peer numbers; the peer's ring holds nothing of the channel"))
            else:
                out.append(P2PPairing(rank, row, op, peer, k, "not_posted", "exact",
                                      "per-peer numbers"))
            continue
        index = i + 1 if not job.window_evicted(rank) else None
        if offset is None:
            out.append(P2PPairing(rank, row, op, peer, index, "unknown", "low", basis))
            continue
        j = i + offset
        if j >= len(theirs):
            status, counterpart = "not_posted", None
        else:
            counterpart = int(theirs[j]) if j >= 0 else None
            status = "posted" if counterpart is None else _posted(job, peer, counterpart)
        mismatch = counterpart is not None and _size(job, rank, row, peer, counterpart)
        out.append(P2PPairing(rank, row, op, peer, index, status, confidence, basis,
                              counterpart, mismatch))
    return out


def _posted(job: JobModel, peer: int, their_row: int) -> str:
    """``posted``, or ``queued`` when the peer holds the counterpart only as an
    entry queued behind the op it is really blocked in."""
    d = job.digests[peer]
    if int(d.state[their_row]) == OpState.COMPLETED:
        return "posted"
    return "queued" if job.is_queued(peer, their_row) else "posted"


def _size(job: JobModel, rank: int, row: int, peer: int, their_row: int) -> bool:
    """True when the two sides of a transfer disagree on its size."""
    a, b = job.digests[rank], job.digests[peer]
    if a.numel is None or b.numel is None:
        return False
    return int(a.numel[row]) != int(b.numel[their_row])


def _active_p2p_rows(job: JobModel, rank: int, blocked: int) -> list[int]:
    """The pending p2p rows ``rank`` is really in: those of the blocked op's
    block, and any not merely queued behind it (``JobModel.is_queued``)."""
    d = job.digests[rank]
    return [int(r) for r in d.pending_rows().tolist()
            if d.is_p2p[r] and r >= blocked and not job.is_queued(rank, int(r))]


class _CollStatus(NamedTuple):
    """Where each member of one collective stands, and what the waits on it read
    (computed once a collective: a hang of 16,384 ranks has 2048 ranks blocked
    in each data-parallel collective, each of which read its 2048 members)."""

    status: dict[int, str]
    unlisted: RankSet
    completed: bool  # a member completed it
    unentered: bool  # a member never entered it or left no dump
    waited: tuple[int, ...]  # members not entered, without a dump or queued
    waited_set: frozenset[int]
    entered: tuple[int, ...]  # members that entered or completed it
    dumped: tuple[int, ...]  # members with a dump


def _coll_status(job: JobModel, gid: int, seq: int, issued: int) -> _CollStatus:
    status: dict[int, str] = {}
    unlisted = EMPTY
    members: Sequence[int] = job.groups[gid].ranks
    if not job.judged_one_by_one(gid):  # too many without a dump: one block
        members, unlisted = job.member_split(gid)
    for member in members:
        if member not in job.digests:
            status[member] = "no_dump"
        else:
            status[member] = job.entered(member, gid, seq, issued_ns=issued)
    values = set(status.values())
    waited = tuple(m for m, s in status.items() if s in ("not_entered", "no_dump", "queued"))
    return _CollStatus(
        status, unlisted, "completed" in values, bool({"not_entered", "no_dump"} & values),
        waited, frozenset(waited), tuple(m for m, s in status.items() if s in ("entered", "completed")),
        tuple(m for m, s in status.items() if s != "no_dump"))


def build_wait_graph(job: JobModel, *, hang_after_s: float = 1.0) -> WaitGraph:
    """Find every blocked rank's wait, then the roots and cycles of the graph.

    Each rank is judged where it is really blocked (``JobModel.blocked_row``:
    its earliest unfinished op); ops it enqueued after that are queue, and a
    member that holds the awaited collective only as a queued entry is waited
    *for* (status ``queued``), so the chain continues from where it is blocked.
    """
    waits: dict[int, Wait] = {}
    young: list[int] = []
    coll_cache: dict[tuple[int, int], _CollStatus] = {}
    for rank in job.ranks_pending():
        blocked = job.blocked_row(rank)
        if blocked is None:
            continue
        d = job.digests[rank]
        row = blocked
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
            pairings = _p2p_waits(job, rank, _active_p2p_rows(job, rank, row))
            reasons: dict[int, str] = {}
            for pairing in pairings:
                if pairing.status in ("not_posted", "no_dump", "queued"):
                    reasons.setdefault(pairing.peer, pairing.status)
            confidence = _worst_confidence([x.confidence for x in pairings])
            waits[rank] = Wait(rank, row, gid, int(d.p2p_seq[row]), "p2p", op, tuple(reasons),
                               reasons, (), age, detail, confidence, tuple(pairings))
            continue
        seq = int(d.seq[row])
        coll = coll_cache.get((gid, seq))
        if coll is None:
            coll = coll_cache[(gid, seq)] = _coll_status(job, gid, seq, int(d.t_enqueue_ns[row]))
        if coll.completed and (d.gpu_states or not coll.unentered):
            # A collective completes on all members or none: members that finished
            # it prove it ran. This rank's entry is ``started`` (blocked_row skips
            # the scheduled ones that only await retirement): its kernel never
            # finished here — stuck in the op, waiting on nobody. Not so in
            # retirement-only states (gloo) when a member never entered it or left
            # no dump: it cannot have run (or nothing shows it did), and the peers
            # may have retired a failure (merge.JobModel._completed_elsewhere); this
            # rank waits on that member.
            waits[rank] = Wait(rank, row, gid, seq, "collective", op, (), {},
                               coll.dumped, age, detail)
            continue
        on_coll = coll.waited if rank not in coll.waited_set else tuple(
            m for m in coll.waited if m != rank)
        waits[rank] = Wait(rank, row, gid, seq, "collective", op, on_coll,
                           {m: coll.status[m] for m in on_coll}, coll.entered, age, detail,
                           unlisted=coll.unlisted)

    roots, cycles = _chains(job, waits)
    graph = WaitGraph(waits=waits, roots=roots, cycles=cycles, young=young)
    blocks = {w.unlisted for w in waits.values() if w.unlisted}
    if blocks:
        graph.unlisted_ranks = RankSet(s for b in blocks for s in b.spans)
        graph.unlisted = _unlisted_root(waits)
    return graph


#: the end of chains that wait on a block of unlisted ranks without a dump
_UNLISTED = -1


def _unlisted_root(waits: dict[int, Wait]) -> Root:
    """The root standing for every unlisted rank without a dump: its waiters are
    the ranks whose chains end there (iteratively, as ``_chains``)."""
    root = Root(_UNLISTED, "no_dump")
    root.direct = [w for w in waits.values() if w.unlisted]
    # every rank whose chain reaches a waiter of the block reaches the block
    reached = {w.rank for w in root.direct}
    back: dict[int, list[int]] = defaultdict(list)
    for r, w in waits.items():
        for t in w.on:
            back[t].append(r)
    todo = list(reached)
    while todo:
        cur = todo.pop()
        for prev in back.get(cur, ()):
            if prev not in reached:
                reached.add(prev)
                todo.append(prev)
    root.waiters = reached
    return root


def _chains(job: JobModel, waits: dict[int, Wait]) -> tuple[dict[int, Root], list[Cycle]]:
    edges = {r: w.on for r, w in waits.items()}
    sccs = _strongly_connected(edges)
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

    # Where each rank's chains end: a cycle, or a terminal node (a rank waited on
    # that waits on nobody, or a blocked rank with no edges: every peer joined
    # its op, a timeout candidate). Tarjan emits components in reverse
    # topological order, so every successor's ends are known when a component
    # is reached: no recursion (a 2,000-rank chain is one pass).
    ends: dict[int, frozenset[tuple[str, int]]] = {}
    for i, comp in enumerate(sccs):
        if i in cycles:
            result = frozenset({("cycle", i)})
            for r in comp:
                ends[r] = result
            continue
        r = comp[0]
        if r in waits and not waits[r].on and waits[r].unlisted:
            ends[r] = frozenset({("unlisted", _UNLISTED)})
            continue
        if r not in waits or not waits[r].on:
            ends[r] = frozenset({("root", r)})
            continue
        acc: set[tuple[str, int]] = set()
        for nxt in waits[r].on:
            if nxt != r:
                acc |= ends[nxt]
        ends[r] = frozenset(acc)

    for rank, wait in waits.items():
        for end_kind, key in ends[rank]:
            if end_kind == "cycle":
                if rank not in cycles[key].ranks:
                    cycles[key].waiters.add(rank)
            elif end_kind == "unlisted":
                continue  # WaitGraph.unlisted
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

