"""Merge every rank's digest into one job: global groups, windows, frontiers.

Process groups are identified across ranks by name *and* members: hashed names
may be shared by groups with different members, so ``(name, ranks)`` is the key.
Where a dump does not say the members (PyTorch's gloo dumps never do), they are
inferred: the default group holds every rank of the job; another group holds the
ranks whose dumps name it (a rank that never used the group is then invisible,
which the report says).

Each rank's ring may have evicted its oldest entries, so ranks' windows on one
group start at different seqs; a rank is known to have *not entered* collective
``s`` of a group only when its window covers that group up to its end and its
newest seq there is below ``s``.

Where each rank is really *blocked* matters more than what it enqueued: the CPU
runs ahead of the GPU (NCCL), so a rank's ring holds ops it enqueued after the op
it is stuck in. A rank is blocked in its *earliest unfinished* op
(``blocked_row``); an op it enqueued after that and whose kernel did not start is
*queued* behind it — the rank is "in" that op only as a queued entry, so peers
waiting in it wait **for** that rank (docs/native-format.md, "the CPU runs ahead").

The world is sparse: its size is a claim (a dump's ``world_size``,
``--world-size``, the highest rank seen), so the ranks without a dump are a
:class:`~frforensics.rankset.RankSet`. When they are too many to list
(``rankset.listable``), those above the highest rank with a dump — implied by
the size claim alone — are ``JobModel.unlisted``, held only as ranges; the
holes below it stay named one by one (a dump from a higher rank proves they
existed) while they are listable. The default group's inferred members are
then a ``range``, and every pass walks the ranks with dumps, never the world.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import re
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from frforensics.analyzer.digest import RankDigest, ranks_with_other, str_hash
from frforensics.analyzer.frontiers import mark_frontiers
from frforensics.analyzer.slots import GroupSlots, build_slots
from frforensics.model import GroupInfo, OpState
from frforensics.rankset import LISTED_RANKS_FLOOR, RankSet, listable
from frforensics.report import GroupRef, format_ranks

__all__ = ["CollectiveRows", "Group", "JobModel", "build_job", "collective_rows",
           "release_collective_rows"]

SEND_HASH = str_hash("send")
RECV_HASH = str_hash("recv")


@dataclass(slots=True)
class Group:
    """A process group across the job."""

    gid: int
    name: str
    desc: str
    #: global ranks in group order; a ``range`` for a default group inferred from
    #: a world too large to list (``JobModel.silent_listed`` false)
    ranks: Sequence[int]
    ranks_known: bool
    local: dict[int, int] = field(default_factory=dict)  # rank -> index in its digest
    #: False when the members are too many to list in a job whose world is a claim
    #: the dumps do not bear out (``JobModel.unlisted``): reports give counts and ranges
    listed: bool = True
    _ref: GroupRef | None = None

    def ref(self) -> GroupRef:
        if self._ref is None:
            ranks = self.ranks
            if not self.listed and not isinstance(ranks, range):
                ranks = RankSet.of(ranks)  # rendered from spans, never per rank
            self._ref = GroupRef(self.name, self.desc, ranks, listed=self.listed)
        return self._ref

    @property
    def is_default(self) -> bool:
        return self.desc == "default_pg"


@dataclass(slots=True)
class _RankGroupView:
    coll_rows: npt.NDArray[np.intp]
    p2p_rows: npt.NDArray[np.intp]
    min_seq: int
    max_seq: int


@dataclass(slots=True)
class JobModel:
    """The merged job: digests by rank, global groups, and per-rank views."""

    digests: dict[int, RankDigest]
    #: ranks ``0 .. max(world_size, highest rank seen + 1) - 1``, never materialised
    world: range
    world_size: int | None
    groups: list[Group]
    group_of: dict[tuple[int, int], int]
    notes: list[str]
    now_known: bool
    #: some dump shows GPU progress (``started`` states): NCCL semantics apply
    gpu_states: bool = False
    #: the ranks of ``world`` without a dump
    missing: RankSet = field(default_factory=RankSet)
    #: the part of ``missing`` too many to name one by one (``rankset.listable``),
    #: held only as ranges; empty for a job whose missing ranks are listable
    unlisted: RankSet = field(default_factory=RankSet)
    #: group id -> the lowest frontier (newest collective seq) of its dumped members,
    #: for groups whose members' frontiers disagree in retirement-only dumps
    #: (``analyzer.frontiers``): seqs above it are not compared across members
    frontier_limit: dict[int, int] = field(default_factory=dict)
    #: rank -> the first row of its error path: the row after its first failed op
    #: (``analyzer.frontiers``); the signature pass does not compare rows from there
    error_from: dict[int, int] = field(default_factory=dict)
    _views: dict[tuple[int, int], _RankGroupView] = field(default_factory=dict)
    _blocked: dict[int, int | None] = field(default_factory=dict)
    _dumped: dict[int, list[int]] = field(default_factory=dict)
    _named: RankSet | None = None
    _split: dict[int, tuple[list[int], RankSet]] = field(default_factory=dict)
    _ascending: bool | None = None
    _coll: CollectiveRows | None = None
    _slots: GroupSlots | None = None

    def reset_caches(self) -> None:
        """Forget what was computed from the digests (after a pass replaced some)."""
        self._blocked.clear()
        self._coll = None
        self._slots = None

    def group_slots(self) -> GroupSlots:
        """``group_of`` as arrays, with each rank's member index (``analyzer.slots``),
        computed once."""
        if self._slots is None:
            self._slots = build_slots(self.digests, self.groups)
        return self._slots

    def members_ascending(self) -> bool:
        """True when every group's members are listed in strictly ascending rank
        order (PyTorch sorts them): then ``dumped_members`` is in rank order, and
        the rank after rank passes (``collective_rows``) see members in group order."""
        if self._ascending is None:
            self._ascending = all(
                g.ranks.step > 0 if isinstance(g.ranks, range)
                else all(a < b for a, b in zip(g.ranks, g.ranks[1:]))  # noqa: B905
                for g in self.groups)
        return self._ascending

    @property
    def missing_dumps(self) -> RankSet:
        """The ranks of the world that left no dump (ascending; sparse)."""
        return self.missing

    @property
    def silent_listed(self) -> bool:
        """True when every rank without a dump is named one by one
        (``rankset.listable``): then every pass may walk the world as a list."""
        return not self.unlisted

    @property
    def named_missing(self) -> RankSet:
        """The ranks without a dump that are named one by one (a listable number)."""
        if self._named is None:
            self._named = self.missing.minus(self.unlisted) if self.unlisted else self.missing
        return self._named

    def member_split(self, gid: int) -> tuple[list[int], RankSet]:
        """Group ``gid``'s members to judge one by one (with a dump, or named
        without one: ``named_missing``), in group order, and the rest as a block.

        A ``range`` costs the dumps and the named ranks without one; a tuple
        costs its members once.
        """
        cached = self._split.get(gid)
        if cached is not None:
            return cached
        ranks = self.groups[gid].ranks
        named = self.named_missing
        if isinstance(ranks, range) and ranks.step == 1:
            kept = sorted([*self.dumped_members(gid), *(m for m in named if m in ranks)])
            block = RankSet.difference(ranks, kept)
        else:
            kept = [m for m in ranks if m in self.digests or m in named]
            block = RankSet.of(m for m in ranks if m not in self.digests and m not in named)
        self._split[gid] = (kept, block)
        return kept, block

    def judged_one_by_one(self, gid: int) -> bool:
        """False when group ``gid``'s members without a dump are too many to
        name: a claimed world (``unlisted``), or a group listing more ranks than
        the world holds and than can be listed."""
        return not self.unlisted and self.groups[gid].listed

    def dumped_members(self, gid: int) -> list[int]:
        """The members of group ``gid`` that left a dump, in group order; costs
        the smaller of the group and the dumps (a claimed world is never walked)."""
        cached = self._dumped.get(gid)
        if cached is not None:
            return cached
        ranks = self.groups[gid].ranks
        if isinstance(ranks, range) and len(ranks) > len(self.digests):
            out = [r for r in sorted(self.digests) if r in ranks]
            if ranks.step < 0:
                out.reverse()
        else:
            out = [r for r in ranks if r in self.digests]
        self._dumped[gid] = out
        return out

    def view(self, rank: int, gid: int) -> _RankGroupView | None:
        """Rows of ``rank``'s digest in group ``gid`` (None if it has none)."""
        key = (rank, gid)
        cached = self._views.get(key)
        if cached is not None:
            return cached
        d = self.digests.get(rank)
        local = self.groups[gid].local.get(rank)
        if d is None or local is None:
            return None
        in_group = d.group == local
        p2p = d.is_p2p.astype(bool)
        coll_rows = np.flatnonzero(in_group & ~p2p)
        p2p_rows = np.flatnonzero(in_group & p2p)
        seqs = d.seq[coll_rows]
        view = _RankGroupView(
            coll_rows=coll_rows,
            p2p_rows=p2p_rows,
            min_seq=int(seqs.min()) if len(seqs) else 0,
            max_seq=int(seqs.max()) if len(seqs) else 0,
        )
        self._views[key] = view
        return view

    def window_evicted(self, rank: int) -> bool:
        """True when ``rank``'s ring lost its oldest entries."""
        d = self.digests[rank]
        return d.dropped > 0 or d.first_record_id > 0

    def entered(self, rank: int, gid: int, seq: int, *, issued_ns: int) -> str:
        """Whether ``rank`` entered collective ``seq`` of ``gid``.

        Returns ``'entered'``, ``'completed'``, ``'not_entered'``, ``'passed'``
        (evicted from its window, so done long ago) or ``'unknown'``.
        ``issued_ns`` is when the asking rank issued it (for evicted windows).
        """
        view = self.view(rank, gid)
        d = self.digests[rank]
        if view is None or len(view.coll_rows) == 0:
            if self.window_evicted(rank) and len(d) and issued_ns and \
                    int(d.t_enqueue_ns[0]) > issued_ns:
                return "unknown"
            return "not_entered"
        if seq > view.max_seq:
            return "not_entered"
        if seq < view.min_seq:
            return "passed"
        rows = view.coll_rows[d.seq[view.coll_rows] == seq]
        if len(rows) == 0:
            return "unknown"
        done = bool((d.state[rows] == OpState.COMPLETED).all())
        if done:
            return "completed"
        return "queued" if self.is_queued(rank, int(rows[0])) else "entered"

    def is_queued(self, rank: int, row: int) -> bool:
        """True when ``rank``'s unfinished entry ``row`` is only queued: the rank is
        blocked in an earlier op (``blocked_row``), ``row`` is not part of that
        op's coalesced block, and its kernel never started."""
        d = self.digests[rank]
        if int(d.state[row]) != OpState.SCHEDULED:
            return False
        blocked = self.blocked_row(rank)
        if blocked is None or row <= blocked:
            return False
        if d.unit_of(row) == d.unit_of(blocked):
            return False
        # gloo: async sends/recvs issued together progress together
        return not (not self.gpu_states and d.is_p2p[row] and d.is_p2p[blocked]
                    and not self._collective_between(rank, blocked, row))

    def _collective_between(self, rank: int, first: int, last: int) -> bool:
        d = self.digests[rank]
        between = slice(first + 1, last)
        return bool(((d.is_p2p[between] == 0) & (d.state[between] != OpState.COMPLETED)).any())

    def blocked_row(self, rank: int) -> int | None:
        """The row of ``rank``'s earliest unfinished op: where it is blocked.

        An unfinished collective that another member already completed is
        skipped in dumps whose states come from retirement only (gloo): the
        collective ran (it completes on all members or none) and this rank's
        entry only awaits its lazy retirement. In dumps whose states are read
        off CUDA events at dump time (NCCL) it is *not* skipped: an op its peers
        completed that never completed here is a kernel that never finished on
        this rank.
        """
        if rank in self._blocked:
            return self._blocked[rank]
        d = self.digests[rank]
        found: int | None = None
        closed = _superseded_groups(d)
        for row in d.pending_rows().tolist():
            if int(d.group[row]) in closed:
                continue  # abandoned by a reconfiguration of its group
            # NCCL reads states off CUDA events at dump time: a scheduled entry
            # there is real; only retirement-based states (gloo) lag
            if not d.gpu_states and not d.is_p2p[row] \
                    and int(d.state[row]) == OpState.SCHEDULED \
                    and self._completed_elsewhere(rank, row):
                continue
            found = int(row)
            break
        self._blocked[rank] = found
        return found

    def ranks_pending(self) -> list[int]:
        """The dumped ranks with an unfinished op (ascending): the only ones
        ``blocked_row`` can find blocked (one pass over every rank's states)."""
        ranks = sorted(self.digests)
        undone = ranks_with_other([self.digests[r] for r in ranks], "state", OpState.COMPLETED)
        return [ranks[i] for i in np.flatnonzero(undone).tolist()]

    def _completed_elsewhere(self, rank: int, row: int) -> bool:
        d = self.digests[rank]
        gid = self.group_of.get((rank, int(d.group[row])))
        if gid is None:
            return False
        seq = int(d.seq[row])
        dumped = self.dumped_members(gid)
        if len(dumped) < len(self.groups[gid].ranks):
            # a member left no dump: whether it entered the op is unknown, and a
            # peer's retirement may be a failure (gloo retires failed work as it
            # retires completed work), so nothing shows that the op ran
            return False
        done = False
        for member in dumped:
            if member == rank:
                continue
            view = self.view(member, gid)
            if view is None or len(view.coll_rows) == 0:
                continue
            if view.max_seq < seq:
                # a member never entered it: it cannot have run anywhere, and the
                # peers that retired it retired a failure (gloo retires failed work
                # as it retires completed work: tests/data/native_crash)
                return False
            if not view.min_seq <= seq:
                continue
            other = self.digests[member]
            rows = view.coll_rows[other.seq[view.coll_rows] == seq]
            if len(rows) and bool((other.state[rows] == OpState.COMPLETED).all()):
                done = True
        return done

    def state_in(self, rank: int, gid: int, seq: int) -> OpState | None:
        """``rank``'s (effective) state in collective ``seq`` of ``gid``, if in its ring."""
        view = self.view(rank, gid)
        if view is None or len(view.coll_rows) == 0:
            return None
        d = self.digests[rank]
        rows = view.coll_rows[d.seq[view.coll_rows] == seq]
        if len(rows) == 0:
            return None
        return OpState(int(d.state[rows].min()))

    def age_s(self, rank: int, row: int) -> float | None:
        """How long entry ``row`` of ``rank`` had been waiting at dump time."""
        d = self.digests[rank]
        if not d.dump_time_ns or not int(d.t_enqueue_ns[row]):
            return None
        return max(0.0, (d.dump_time_ns - int(d.t_enqueue_ns[row])) / 1e9)


def _default_like(info: GroupInfo) -> bool:
    return info.desc == "default_pg"


def _reconfig_key(name: str) -> tuple[str, int]:
    """``'0@r3'`` -> ``('0', 3)``; a name without the suffix is generation -1."""
    base, sep, uuid = name.rpartition("@r")
    if sep and base and uuid.isdigit() and len(uuid) < 19:
        return base, int(uuid)
    return name, -1


def _superseded_groups(d: RankDigest) -> frozenset[int]:
    """Local indices of ``d``'s groups that a later reconfiguration replaced.

    frforensics' recovery re-forms a group over new members under a new identity,
    ``<name>@r<uuid>`` with seqs from 0 (as the backend restarts them,
    ``torch.distributed.distributed_c10d._reconfigure``): ops of the old identity
    left unfinished were abandoned by the reconfiguration, never completed, and
    are no place to be blocked in.
    """
    if len(d.groups) < 2 or not any("@r" in g.name for g in d.groups):
        return frozenset()
    newest: dict[str, int] = {}
    for g in d.groups:
        base, gen = _reconfig_key(g.name)
        newest[base] = max(newest.get(base, -1), gen)
    return frozenset(i for i, g in enumerate(d.groups)
                     if _reconfig_key(g.name)[1] < newest[_reconfig_key(g.name)[0]])


def _dump_notes(digests: dict[int, RankDigest], *, limit: int = 6) -> list[str]:
    """What the readers noted per dump (newer versions, unknown fields, record-order
    matching), merged across ranks, and ranks whose dumps disagree on the version."""
    by_note: dict[str, list[int]] = defaultdict(list)
    versions: dict[tuple[str, str], list[int]] = defaultdict(list)
    for rank, d in sorted(digests.items()):
        for note in d.notes:
            by_note[note].append(rank)
        versions[(d.format, d.version)].append(rank)
    out = []
    for note, ranks in list(by_note.items())[:limit]:
        out.append(f"rank(s) {_ranks_text(ranks)}: {note}")
    if len(by_note) > limit:
        out.append(f"... and {len(by_note) - limit} more kinds of reader notes")
    for fmt in sorted({f for f, _ in versions}):
        seen = {v: r for (f, v), r in versions.items() if f == fmt}
        if len(seen) > 1:
            out.append(f"{fmt} dumps disagree on the schema version: " + "; ".join(
                f"{v or '(none)'} on rank(s) {_ranks_text(r)}" for v, r in sorted(seen.items())))
    return out


def _ranks_text(ranks: list[int]) -> str:
    return format_ranks(sorted(ranks))


_SHA1_NAME = re.compile(r"^[0-9a-f]{40}$")
#: salts tried: PyTorch appends a group counter (``_world.group_count`` in 2.15,
#: ``len(_world.pg_names)`` in 2.13) to the joined ranks before hashing
_MAX_SALT = 4096
#: silent ranks tried as members of a hashed group name (beyond, only the ranks seen)
_MAX_SILENT_CANDIDATES = 4096


#: SHA-1 computations allowed per job for membership recovery: a base (about
#: 0.2 s) plus a share per hash-like group name, capped (about 2 s), so that a
#: dump set full of hash-like names that no candidate reproduces stays bounded
_HASH_BUDGET = 200_000
_HASH_PER_NAME = 1_024
_HASH_CAP = 2_000_000


def hash_budget(names: int) -> int:
    """Hashes allowed for a job with ``names`` hash-like group names of unknown membership."""
    return min(_HASH_CAP, _HASH_BUDGET + _HASH_PER_NAME * names)


def _members_from_hashed_name(name: str, seen: tuple[int, ...], silent: list[int],
                              budget: list[int]) -> tuple[int, ...] | None:
    """The members of a group named by ``_hash_ranks_to_str``, when the name proves them.

    PyTorch names hashed groups ``sha1("_".join(ranks) + "_" + str(counter))``
    (``distributed_c10d._hash_ranks_to_str``; some tools hash without the counter).
    ``seen`` are the ranks whose dumps name the group; ``silent`` ranks left no
    dump and may be members too. Candidates: ``seen`` plus every silent rank,
    ``seen`` plus one silent rank, ``seen``. The counter is small (groups
    created so far), so salts are the outer loop: a group costs about
    ``(counter + 1) * candidates`` hashes. Returns the first candidate whose hash
    is the name, or None (membership stays inferred). ``budget`` holds the
    hashes still allowed in this job; once spent, membership stays inferred.
    """
    if not _SHA1_NAME.match(name):
        return None
    target = bytes.fromhex(name)
    # Candidates with silent ranks first: "0_1_2" salted "_3" is also "0_1_2_3"
    # unsalted, and a silent rank whose addition reproduces the name is a member.
    candidates: list[tuple[int, ...]] = []
    if silent and len(silent) <= _MAX_SILENT_CANDIDATES:
        candidates.append(tuple(sorted({*seen, *silent})))
        if len(silent) <= 16:
            candidates.extend(tuple(sorted({*seen, r})) for r in silent)
    candidates.append(seen)
    candidates = list(dict.fromkeys(candidates))
    if budget[0] < len(candidates):
        return None
    budget[0] -= len(candidates)
    bases = []
    for members in candidates:
        joined = "_".join(map(str, members))
        if hashlib.sha1(joined.encode(), usedforsecurity=False).digest() == target:
            return members
        bases.append((members, hashlib.sha1((joined + "_").encode(), usedforsecurity=False)))
    for salt in range(_MAX_SALT):
        if budget[0] < len(bases):
            return None
        budget[0] -= len(bases)
        tail = str(salt).encode()
        for members, base in bases:
            h = base.copy()
            h.update(tail)
            if h.digest() == target:
                return members
    return None


def _named_silent(digests: dict[int, RankDigest], missing: RankSet,
                  highest: int) -> RankSet:
    """The ranks without a dump to name one by one when not all of them can be.

    Evidence beyond the size claim: the holes below the highest rank with a dump
    (its dump proves they existed) and the members of groups the dumps list,
    both while listable (``rankset.listable``); failing that the holes alone;
    failing that none.
    """
    bound = max(LISTED_RANKS_FLOOR, len(digests))
    holes = missing.clip(range(highest + 1))
    if len(holes) > bound:
        return RankSet()
    named = set(holes)
    seen: set[int] = set()
    for d in digests.values():
        for info in d.groups:
            if info.ranks is None or id(info.ranks) in seen:
                continue
            seen.add(id(info.ranks))
            if len(info.ranks) > bound:
                return RankSet.of(named) if len(named) <= bound else holes
            named.update(r for r in info.ranks if r in missing)
            if len(named) > bound:
                return holes
    return RankSet.of(named)


def build_job(digests: dict[int, RankDigest], *, world_size: int | None = None) -> JobModel:
    """Merge ``digests`` into a :class:`JobModel`."""
    notes: list[str] = []
    sizes = {d.world_size for d in digests.values() if d.world_size}
    for d in digests.values():
        for g in d.groups:
            if _default_like(g) and g.ranks:
                sizes.add(len(g.ranks))
    known_size = world_size or (max(sizes) if sizes else None)
    if world_size is None and len(sizes) > 1:
        notes.append(f"dumps disagree on the world size ({sorted(sizes)}); using {known_size}")
    highest = max(digests) if digests else -1
    if known_size is None:
        world = range(highest + 1)
        notes.append(
            "world size unknown (native dumps do not record it): ranks above "
            f"{highest} would be invisible; pass --world-size to check for them"
        )
    else:
        world = range(max(known_size, highest + 1))
    missing = RankSet.difference(world, digests)
    # A world few enough ranks short is listed as before; beyond that, the ranks
    # only the size claim implies are ranges, and the default group's inferred
    # members stay a range (docs/security.md, "world size").
    listed = listable(len(missing), len(digests))
    unlisted = RankSet()
    if not listed:
        unlisted = missing.minus(_named_silent(digests, missing, highest))
    named_missing = missing.minus(unlisted)
    silent_ranks: list[int] = (list(named_missing)
                               if len(named_missing) <= _MAX_SILENT_CANDIDATES else [])

    # Key groups by (name, members); unknown members are resolved below.
    known: dict[tuple[str, tuple[int, ...]], Group] = {}
    # by identity first: a tuple's hash is not cached, and hashing the default
    # group's members for every rank is O(world^2); equal groups arrive as one
    # object (the loader, wire.WireCache)
    seen: dict[int, tuple[GroupInfo, Group]] = {}
    # then by the members' identity: each batch of digests has its own GroupInfo
    # objects, but a long membership arrives as this process's one tuple
    # (``model.progression_members``), whose hash would cost its length per batch
    # (the 100,000-rank default group in 1,563 batches: ~0.8 s)
    same_members: dict[tuple[str, int], tuple[tuple[int, ...], Group]] = {}
    unknown: dict[str, list[tuple[int, int, GroupInfo]]] = defaultdict(list)
    for rank, d in sorted(digests.items()):
        for local, info in enumerate(d.groups):
            if info.ranks is not None:
                hit = seen.get(id(info))
                if hit is not None:
                    group = hit[1]
                else:
                    group = _known_group(known, same_members, info)
                    seen[id(info)] = (info, group)
                group.local[rank] = local
                if not group.desc and info.desc:
                    group.desc = info.desc
            else:
                unknown[info.name].append((rank, local, info))

    groups: list[Group] = list(known.values())
    inferred: list[str] = []
    recovered: list[str] = []
    budget = [hash_budget(sum(1 for n in unknown if _SHA1_NAME.match(n)))]
    for name, uses in unknown.items():
        by_name = [g for g in groups if g.name == name]
        leftovers = []
        for rank, local, info in uses:
            homes = [g for g in by_name if rank in g.ranks]
            if len(homes) == 1:
                homes[0].local.setdefault(rank, local)
            else:
                leftovers.append((rank, local, info))
        if not leftovers:
            continue
        descs = {info.desc for _, _, info in leftovers if info.desc}
        desc = "default_pg" if "default_pg" in descs else (sorted(descs)[0] if descs else "")
        members: Sequence[int]
        if desc == "default_pg":
            members = tuple(world) if listed else world
        else:
            members = tuple(sorted({rank for rank, _, _ in leftovers}))
            named = _members_from_hashed_name(name, members, silent_ranks, budget)
            if named is not None:
                if named != members:
                    recovered.append(f"{name[:12]}… (ranks {format_ranks(list(named))})")
                members = named
            else:
                inferred.append(name)
        group = Group(-1, name, desc, members, False)
        for rank, local, _ in leftovers:
            group.local[rank] = local
        groups.append(group)
    if recovered:
        notes.append(
            "group membership not in the dumps (gloo) for group(s) "
            f"{', '.join(sorted(recovered)[:8])}: recovered from the hashed group name, "
            "which includes ranks that left no dump")
    if inferred:
        notes.append(
            "group membership not in the dumps (gloo) for group(s) "
            f"{', '.join(sorted(inferred)[:8])}: inferred from which ranks' dumps name them"
        )
    groups.sort(key=lambda g: (not g.is_default, g.name, _members_key(g.ranks)))
    # Listed as before: every group of a listable world no larger than the world;
    # beyond either, only groups within the listing bound.
    for grp in groups:
        grp.listed = listable(len(grp.ranks), len(digests)) or (
            not unlisted and len(grp.ranks) <= len(world))
    group_of: dict[tuple[int, int], int] = {}
    for gid, group in enumerate(groups):
        group.gid = gid
        for rank, local in group.local.items():
            group_of[(rank, local)] = gid
    notes.extend(_dump_notes(digests))
    now_known = bool(digests) and all(d.dump_time_ns for d in digests.values())
    gpu_states = any(d.gpu_states for d in digests.values())
    if digests and not now_known:
        notes.append(
            "dump time unknown for some ranks (native dumps do not record it): "
            "every unfinished op is treated as a wait, and timeouts cannot be judged exactly"
        )
    job = JobModel(
        digests=dict(digests),
        world=world,
        world_size=known_size,
        groups=groups,
        group_of=group_of,
        notes=notes,
        now_known=now_known,
        gpu_states=gpu_states,
        missing=missing,
        unlisted=unlisted,
    )
    job.notes.extend(mark_frontiers(job))
    return job


def _known_group(known: dict[tuple[str, tuple[int, ...]], Group],
                 same_members: dict[tuple[str, int], tuple[tuple[int, ...], Group]],
                 info: GroupInfo) -> Group:
    """The group ``info`` names (a new one the first time), found by its members'
    identity before their value."""
    ranks = info.ranks
    assert ranks is not None
    mark = (info.name, id(ranks))
    hit = same_members.get(mark)
    if hit is not None and hit[0] is ranks:
        return hit[1]
    key = (info.name, ranks)
    found = known.get(key)
    if found is None:
        found = known[key] = Group(-1, info.name, info.desc, ranks, True)
    same_members[mark] = (ranks, found)
    return found


@functools.total_ordering
class _members_key:
    """Orders member lists as tuples do, without copying a ``range`` into one."""

    __slots__ = ("ranks",)

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = ranks

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _members_key) and _compare(self.ranks, other.ranks) == 0

    def __lt__(self, other: _members_key) -> bool:
        return _compare(self.ranks, other.ranks) < 0

    __hash__ = None  # type: ignore[assignment]


def _compare(a: Sequence[int], b: Sequence[int]) -> int:
    """Lexicographic comparison, stopping at the first difference."""
    if isinstance(a, range) and isinstance(b, range) and a.step == b.step == 1 \
            and len(a) and len(b) and a.start == b.start:
        return (len(a) > len(b)) - (len(a) < len(b))
    for x, y in zip(a, b):  # noqa: B905 - lengths differ on purpose
        if x != y:
            return -1 if x < y else 1
    return (len(a) > len(b)) - (len(a) < len(b))


#: rows of one slice of ``CollectiveRows.ordered`` (whole groups; one group may hold
#: more): its per-row temporaries are ~100 bytes a row in the passes over it
ORDER_SLICE_ROWS = 1 << 21


@dataclass(slots=True)
class CollectiveRows:
    """Every dumped rank's collective entries on its groups: the rows of every
    ``view(rank, gid).coll_rows``, concatenated rank after rank (ascending), in
    record order within a rank; ``order`` sorts them by (group, seq), then by the
    group's member order (rank order where members are listed ascending, as PyTorch
    lists them), then record order.

    For the passes that look at every (rank, group): one numpy pass over all
    ranks instead of a Python call per (rank, group) (~49,000 at 16,384 ranks).
    """

    ranks: list[int]  # the dumped ranks, ascending
    at: npt.NDArray[np.int32]  # row -> index into ``ranks``
    gid: npt.NDArray[np.int32]  # row -> global group id
    offsets: npt.NDArray[np.int64]  # rank index -> its first row here (len(ranks) + 1)
    #: row -> index into the concatenated digests' columns; this, ``seq`` and
    #: ``order`` are int32 where their values fit (int64 otherwise)
    take: npt.NDArray[np.signedinteger[Any]]
    seq: npt.NDArray[np.signedinteger[Any]]
    #: row -> its group's local index on its rank (int8 where the ranks' group
    #: counts allow): a number per group within a rank, for sorts that need rows
    #: by (rank, group) and can take them by group then rank (a radix sort)
    local: npt.NDArray[np.signedinteger[Any]]
    digests: list[RankDigest]
    job: JobModel
    _order: list[npt.NDArray[np.signedinteger[Any]]] | None = None

    @property
    def order(self) -> npt.NDArray[np.intp]:
        """Every row by (gid, seq), then member order, then record order (the
        passes over many ranks take it a slice at a time: ``ordered``)."""
        parts = list(self.ordered())
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.intp)

    def getter(self, name: str) -> Callable[[npt.NDArray[Any]], npt.NDArray[Any]]:
        """``get(rows)``: digest column ``name`` at these rows, for a pass that
        gathers it slice by slice (``ordered``): the concatenated column, held
        once, or, where every digest holds one value (``digest.compact``: one
        timeout), a value per rank."""
        parts = [getattr(d, name) for d in self.digests]
        if parts and all(len(p) < 2 or p.strides[0] == 0 for p in parts):
            dtype = np.result_type(*parts)
            per = np.array([p[0] if len(p) else 0 for p in parts], dtype=dtype)
            return lambda rows: per[self.at[rows]]
        full = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if full.dtype == np.int64:
            full = _narrow(full)  # int32 where the values fit: callers widen a slice
        if len(self.take) == len(full):  # every row taken (``_collective_rows``): take[i] == i
            return lambda rows: full[rows]
        return lambda rows: full[self.take[rows]]

    def ordered(self, keep: npt.NDArray[np.bool_] | None = None,
                max_rows: int | None = None) -> Iterator[npt.NDArray[np.intp]]:
        """The rows (those ``keep`` keeps), whole groups at a time, each slice of
        about ``max_rows`` rows or one group, sorted by (gid, seq), then the group's
        member order, then record order. A pass over the slices holds per-row
        temporaries of one slice, never a sort of every row (at 16,384 ranks, 32.8
        million rows: the sort alone was 0.8 GB). ``max_rows``: ``ORDER_SLICE_ROWS``.

        The slices of every row are sorted once and kept (4 bytes a row where the
        row numbers fit int32): the signature pass and the timeout rule both walk
        them, and ``keep``'s rows are those slices filtered (the sort is stable)."""
        if max_rows is not None:
            yield from self._ordered(keep, max_rows)
            return
        if self._order is None:
            self._order = [_narrow(o) for o in self._ordered(None, ORDER_SLICE_ROWS)]
        for o in self._order:
            part = o if keep is None else o[keep[o]]
            if len(part):
                yield part.astype(np.intp, copy=False)

    def _ordered(self, keep: npt.NDArray[np.bool_] | None,
                 max_rows: int) -> Iterator[npt.NDArray[np.intp]]:
        gid = self.gid if keep is None else self.gid[keep]
        counts = np.bincount(gid) if len(gid) else np.zeros(0, dtype=np.int64)
        del gid
        ends = np.cumsum(counts)
        g0 = 0
        while g0 < len(counts):
            done = int(ends[g0 - 1]) if g0 else 0
            # the groups up to ``max_rows`` rows after ``done``, at least one
            g1 = max(g0 + 1, int(np.searchsorted(ends, done + max_rows, side="right")))
            if int(ends[g1 - 1]) > done:
                yield self._sorted(g0, g1, keep)
            g0 = g1

    def _sorted(self, g0: int, g1: int,
                keep: npt.NDArray[np.bool_] | None) -> npt.NDArray[np.intp]:
        mask = (self.gid >= g0) & (self.gid < g1)
        if keep is not None:
            mask &= keep
        rows = np.flatnonzero(mask)  # rank after rank, record order within
        del mask
        gid, seq = self.gid[rows].astype(np.int64), self.seq[rows].astype(np.int64)
        lo, span = int(seq.min()), int(seq.max()) - int(seq.min()) + 1
        if (g1 - g0) * span < 1 << 62:
            order = rows[np.argsort((gid - g0) * span + (seq - lo), kind="stable")]
        else:
            order = rows[np.lexsort((seq, gid))]
        if not self.job.members_ascending():
            order = _in_member_order(self.job, self.ranks, self.at, self.gid, self.seq, order)
        return order


def collective_rows(job: JobModel) -> CollectiveRows:
    """:class:`CollectiveRows` of ``job``, computed once (a rank's rows on a group
    count only when the rank is one of the group's members, as ``dumped_members``
    has it)."""
    if job._coll is None:
        job._coll = _collective_rows(job)
    return job._coll


def release_collective_rows(job: JobModel) -> None:
    """Drop ``job``'s :class:`CollectiveRows` once its readers are done (``_analyze``
    after the last of them): half a GiB of row indices at 16,384 ranks that the
    straggler rule's gather would otherwise pile on. A later reader recomputes them."""
    job._coll = None


def _narrow(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """``a`` as int32 when every value fits (the row index arrays of 32 million rows
    at 16,384 ranks: half the memory); int64 otherwise."""
    if a.dtype == np.int32 or len(a) == 0:
        return a.astype(np.int32, copy=False)
    lo, hi = int(a.min()), int(a.max())
    return a.astype(np.int32) if lo >= -(1 << 31) and hi < (1 << 31) else a.astype(np.int64)


def _collective_rows(job: JobModel) -> CollectiveRows:
    slots = job.group_slots()
    ranks = slots.ranks
    digests = [job.digests[r] for r in ranks]
    # a rank's rows on a group count only when it is one of the group's members
    lut = np.where(slots.member >= 0, slots.gid, -1).astype(np.int32)
    sizes = np.fromiter((d.seq.shape[0] for d in digests), dtype=np.int64, count=len(digests))
    # every per-row temporary here is int32 where the values allow (32.8 million
    # rows at 16,384 ranks: each int64 column is 262 MB)
    slot_t: type[np.signedinteger[Any]] = np.int32 if len(lut) < (1 << 31) else np.int64
    at_all = np.repeat(np.arange(len(ranks), dtype=np.int32), sizes)
    group = (np.concatenate([d.group for d in digests]) if len(at_all)
             else np.zeros(0, dtype=slot_t))
    local_all = slots.local_of(at_all, group, slot_t)
    del group
    gid_all: npt.NDArray[np.int32] = lut[local_all + slots.base.astype(slot_t)[at_all]]
    keep = gid_all >= 0
    if ranks_with_other(digests, "is_p2p", 0).any():  # (no column where no rank has p2p)
        keep &= np.concatenate([d.is_p2p for d in digests]) == 0
    top = int(slots.n_local.max(initial=0))
    local_t = np.int8 if top < 127 else np.int16 if top < 32767 else slot_t
    seq_all = np.concatenate([d.seq for d in digests]) if len(at_all) else np.zeros(0, np.int64)
    if keep.all():  # every row a collective of a group the rank is a member of
        take = _narrow(np.arange(len(keep)))
        at, gid, local, seq = at_all, gid_all, local_all.astype(local_t), _narrow(seq_all)
    else:
        take = _narrow(np.flatnonzero(keep))
        at, gid, local = at_all[take], gid_all[take], local_all[take].astype(local_t)
        seq = _narrow(seq_all[take])
    del at_all, gid_all, local_all, keep, seq_all
    offsets = np.searchsorted(at, np.arange(len(ranks) + 1, dtype=np.int32)).astype(np.int64)
    return CollectiveRows(ranks=ranks, at=at, gid=gid, offsets=offsets, take=take, seq=seq,
                          local=local, digests=digests, job=job)


def _in_member_order(job: JobModel, ranks: list[int], at: npt.NDArray[np.int32],
                     gid: npt.NDArray[np.int32], seq: npt.NDArray[np.int64],
                     order: npt.NDArray[np.intp]) -> npt.NDArray[np.intp]:
    """``order`` with the rows of each (group, seq) in the group's member order
    (``dumped_members``), record order kept within a rank: gathered once, for
    groups that list their members out of rank order (PyTorch never does)."""
    g = gid[order]
    rank_of = np.asarray(ranks, dtype=np.int64)[at[order]]
    pos = np.zeros(len(order), dtype=np.int64)
    bounds = np.flatnonzero(np.r_[True, g[1:] != g[:-1], True]).tolist()
    for lo, hi in itertools.pairwise(bounds):
        members = np.asarray(job.dumped_members(int(g[lo])), dtype=np.int64)
        sorter = np.argsort(members, kind="stable")
        pos[lo:hi] = sorter[np.searchsorted(members, rank_of[lo:hi], sorter=sorter)]
    kept: npt.NDArray[np.intp] = order[np.lexsort((pos, seq[order], g))]
    return kept
