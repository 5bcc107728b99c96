"""Every dumped rank's local group indices as one table, for the passes over all ranks.

A digest's ``group`` column holds the rank's *local* group index (its position in
``RankDigest.groups``); the merge maps each ``(rank, local)`` to a global group id
(``JobModel.group_of``, a dict). The passes that gather every rank's rows at once
(the straggler rule's gather, ``merge.collective_rows``) need that map per row:
built from the dict with a Python call per ``(rank, local)`` it cost ~1.6 million
dict lookups at 100,000 ranks (~1.5 s in two passes). :class:`GroupSlots` is the
same map as arrays, built once per job from the groups' own ``local`` maps in a
few numpy passes, with the rank's index among the group's members beside it.

Layout: the dumped ranks ascending; rank ``i``'s slots are ``base[i] ..
base[i+1] - 1``, one per local group and one more (``-1``) that every local index
out of range falls to (a malformed row names a group the rank never listed).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

__all__ = ["GroupSlots", "build_slots"]

I4 = npt.NDArray[np.int32]
I8 = npt.NDArray[np.int64]


class _GroupLike(Protocol):
    @property
    def ranks(self) -> Sequence[int]: ...
    @property
    def local(self) -> dict[int, int]: ...


class _DigestLike(Protocol):
    @property
    def groups(self) -> Sequence[Any]: ...


@dataclass(slots=True, frozen=True)
class GroupSlots:
    """``(rank, local group)`` -> global group id and member index, as arrays."""

    ranks: list[int]  # the dumped ranks, ascending
    base: I8  # rank index -> its first slot (``len(ranks) + 1``)
    #: slot -> global group id (``group_of``); -1: none, and every rank's last slot
    gid: I4
    #: slot -> the rank's index among the group's members (-1: not one of them,
    #: or no group); a ``range`` is answered arithmetically, never listed
    member: I4
    #: slot -> a number for its global group within the rank (its local index:
    #: a global group is one slot of a rank)
    canon: I4

    @property
    def n_local(self) -> I8:
        """Rank index -> how many local groups the rank lists."""
        out: I8 = np.diff(self.base) - 1
        return out

    def local_of(self, at: npt.NDArray[np.signedinteger[Any]],
                 group: npt.NDArray[np.signedinteger[Any]],
                 dtype: type[np.signedinteger[Any]] = np.int64) -> npt.NDArray[Any]:
        """The local index of each row's slot: ``at`` its rank index, ``group`` its
        local group (out of range: the rank's last slot, ``n_local``)."""
        own = self.n_local.astype(dtype)[at]
        group = group.astype(dtype, copy=False)
        local: npt.NDArray[Any] = np.where((group >= 0) & (group < own), group, own)
        return local

    def slot_of(self, at: npt.NDArray[np.signedinteger[Any]],
                group: npt.NDArray[np.signedinteger[Any]],
                dtype: type[np.signedinteger[Any]] = np.int64) -> npt.NDArray[Any]:
        """The slot of each row (``local_of`` plus the rank's first slot)."""
        slot = self.local_of(at, group, dtype)
        slot += self.base.astype(dtype)[at]
        return slot


def build_slots(digests: Mapping[int, _DigestLike], groups: Sequence[_GroupLike]) -> GroupSlots:
    """:class:`GroupSlots` of a merged job: ``groups`` in global id order, each
    with its ``local`` map (rank -> local index); where two groups claim the same
    ``(rank, local)`` the later one holds it, as in ``JobModel.group_of``."""
    ranks = sorted(digests)
    rank_arr = np.asarray(ranks, dtype=np.int64)
    n_local = np.fromiter((len(digests[r].groups) for r in ranks), dtype=np.int64,
                          count=len(ranks))
    base = np.zeros(len(ranks) + 1, dtype=np.int64)
    np.cumsum(n_local + 1, out=base[1:])
    n_slots = int(base[-1])
    gid = np.full(n_slots, -1, dtype=np.int32)
    counts = np.fromiter((len(g.local) for g in groups), dtype=np.int64, count=len(groups))
    total = int(counts.sum())
    who = np.fromiter(itertools.chain.from_iterable(g.local.keys() for g in groups),
                      dtype=np.int64, count=total)
    local = np.fromiter(itertools.chain.from_iterable(g.local.values() for g in groups),
                        dtype=np.int64, count=total)
    owner = np.repeat(np.arange(len(groups), dtype=np.int32), counts)
    at = np.searchsorted(rank_arr, who) if len(rank_arr) else np.zeros(total, dtype=np.intp)
    ok = (at < len(ranks)) & (local >= 0)
    ok[ok] &= rank_arr[at[ok]] == who[ok]
    ok[ok] &= local[ok] < n_local[at[ok]]
    # the later group wins a slot two claim (ids ascend in ``groups`` order)
    np.maximum.at(gid, base[at[ok]] + local[ok], owner[ok])
    slot_rank = np.repeat(np.arange(len(ranks), dtype=np.int64), n_local + 1)
    member = _member_index(groups, gid, rank_arr[slot_rank] if len(ranks) else rank_arr)
    # a group's ``local`` holds one index per rank, so a global group is one slot
    # of a rank: a slot's local index numbers its global group within the rank
    canon = (np.arange(n_slots, dtype=np.int64) - base[slot_rank]).astype(np.int32)
    return GroupSlots(ranks=ranks, base=base, gid=gid, member=member, canon=canon)


def _member_index(groups: Sequence[_GroupLike], gid: I4, rank: I8) -> I4:
    """Slot -> the rank's index among its group's members (-1: none), as
    ``tuple.index`` / ``range.index`` would give it, the last index where a
    listed rank repeats (a ``{rank: index}`` dict's answer)."""
    out = np.full(len(gid), -1, dtype=np.int64)
    is_range = np.fromiter((isinstance(g.ranks, range) for g in groups), dtype=np.bool_,
                           count=len(groups))
    has = gid >= 0
    in_range = np.zeros(len(gid), dtype=np.bool_)
    in_range[has] = is_range[gid[has]]
    if in_range.any():
        ranges = [g.ranks if isinstance(g.ranks, range) else range(0) for g in groups]
        start = np.array([r.start for r in ranges], dtype=np.int64)[gid[in_range]]
        step = np.array([r.step for r in ranges], dtype=np.int64)[gid[in_range]]
        size = np.array([len(r) for r in ranges], dtype=np.int64)[gid[in_range]]
        q, rem = np.divmod(rank[in_range] - start, step)
        out[in_range] = np.where((rem == 0) & (q >= 0) & (q < size), q, -1)
    listed = has & ~in_range
    if listed.any():
        out[listed] = _listed_index(groups, is_range, gid[listed], rank[listed])
    return out.astype(np.int32)


def _listed_index(groups: Sequence[_GroupLike], is_range: npt.NDArray[np.bool_],
                  gid: I4, rank: I8) -> I8:
    """Member index of each ``(gid, rank)`` in groups whose members are a tuple."""
    tuples = np.flatnonzero(~is_range)
    sizes = np.fromiter((len(groups[g].ranks) for g in tuples.tolist()), dtype=np.int64,
                        count=len(tuples))
    total = int(sizes.sum())
    members = np.fromiter(
        itertools.chain.from_iterable(groups[g].ranks for g in tuples.tolist()),
        dtype=np.int64, count=total)
    mgid = np.repeat(tuples.astype(np.int64), sizes)
    index = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    # by (group, rank), stably: the last of equal pairs is the dict's answer
    order = np.lexsort((members, mgid))
    mg, mr = mgid[order], members[order]
    hi = _searchsorted_pairs(mg, mr, gid.astype(np.int64), rank, side="right") - 1
    found = hi >= 0
    found[found] = (mg[hi[found]] == gid[found]) & (mr[hi[found]] == rank[found])
    return np.where(found, index[order][np.maximum(hi, 0)], -1) if total else \
        np.full(len(gid), -1, dtype=np.int64)


def _searchsorted_pairs(a1: I8, a2: I8, v1: I8, v2: I8, side: Any) -> I8:
    """``searchsorted`` over pairs sorted by (a1, a2) (lexicographic)."""
    if not len(a1):
        return np.zeros(len(v1), dtype=np.int64)
    lo2, hi2 = min(int(a2.min()), int(v2.min(initial=0))), max(int(a2.max()), int(v2.max(initial=0)))
    span = hi2 - lo2 + 1
    top = max(int(a1.max()), int(v1.max(initial=0))) + 1
    if top * span < 1 << 62:
        out: I8 = np.searchsorted(a1 * span + (a2 - lo2), v1 * span + (v2 - lo2), side=side)
        return out
    # keys too wide for one int64: the group's run first, then the rank within it
    res = np.empty(len(v1), dtype=np.int64)
    for i, (g, r) in enumerate(zip(v1.tolist(), v2.tolist(), strict=True)):
        lo, hi = np.searchsorted(a1, g, side="left"), np.searchsorted(a1, g, side="right")
        res[i] = lo + np.searchsorted(a2[lo:hi], r, side=side)
    return res
