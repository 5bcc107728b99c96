"""Sets of ranks held as sorted disjoint ranges: a world without a list per rank.

A dump's ``world_size`` (or ``--world-size``, or the highest rank seen) is a
*claim*: four dumps that say 2^20 must cost what four dumps cost. The ranks that
claim alone implies — every rank of ``0 .. world_size-1`` that left no dump — are
held as a :class:`RankSet`, whose size is the number of gaps between the ranks
with evidence, never the number of ranks (docs/security.md, "world size").

:func:`listable` is the one rule for when per-rank lists are written out:
at most ``max(LISTED_RANKS_FLOOR, ranks loaded)`` entries, so a report's size
follows the dumps read, not the size claimed.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Final, overload

__all__ = ["EMPTY", "LISTED_RANKS_FLOOR", "RankSet", "listable", "rank_ranges"]

#: Per-rank lists (ranks without a dump named one by one, members of a group
#: implied by the world size) are written out up to this many entries, or as many
#: as there are dumps when that is more; beyond it they are counts and ranges.
LISTED_RANKS_FLOOR: Final = 4096


def listable(count: int, loaded: int) -> bool:
    """True when ``count`` ranks may be listed one by one in a job with ``loaded`` dumps."""
    return count <= max(LISTED_RANKS_FLOOR, loaded)


class RankSet(Sequence[int]):
    """An immutable, sorted set of ranks stored as disjoint half-open ranges.

    ``len``, ``in`` and indexing cost O(log spans); iterating yields every rank
    in ascending order (only do it when :func:`listable` says so).
    """

    __slots__ = ("_counts", "_spans", "_starts")

    def __init__(self, spans: Iterable[range] = ()) -> None:
        merged: list[range] = []
        for span in sorted((s for s in spans if len(s)), key=lambda s: s.start):
            if span.step != 1:
                raise ValueError("RankSet spans must have step 1")
            if merged and span.start <= merged[-1].stop:
                last = merged[-1]
                merged[-1] = range(last.start, max(last.stop, span.stop))
            else:
                merged.append(span)
        self._spans: tuple[range, ...] = tuple(merged)
        self._starts = [s.start for s in merged]
        self._counts = list(itertools.accumulate(len(s) for s in merged))

    @classmethod
    def of(cls, ranks: Iterable[int]) -> RankSet:
        """The set of ``ranks`` (any order, repeats allowed)."""
        spans: list[range] = []
        start = prev = None
        for r in sorted(set(ranks)):
            if prev is not None and r == prev + 1:
                prev = r
                continue
            if start is not None and prev is not None:
                spans.append(range(start, prev + 1))
            start = prev = r
        if start is not None and prev is not None:
            spans.append(range(start, prev + 1))
        return cls(spans)

    @classmethod
    def difference(cls, universe: range, remove: Collection[int]) -> RankSet:
        """The ranks of ``universe`` (step 1) not in ``remove``; costs O(len(remove) log)."""
        spans: list[range] = []
        start = universe.start
        for r in sorted(r for r in remove if universe.start <= r < universe.stop):
            if r > start:
                spans.append(range(start, r))
            start = max(start, r + 1)
        if start < universe.stop:
            spans.append(range(start, universe.stop))
        return cls(spans)

    def minus(self, remove: Collection[int]) -> RankSet:
        """This set without the ranks of ``remove`` (a RankSet is taken span by span)."""
        cuts = (list(remove.spans) if isinstance(remove, RankSet)
                else [range(r, r + 1) for r in sorted(set(remove))])
        out: list[range] = []
        i = 0
        for span in self._spans:
            start = span.start
            while i < len(cuts) and cuts[i].stop <= start:
                i += 1
            j = i
            while j < len(cuts) and cuts[j].start < span.stop:
                if cuts[j].start > start:
                    out.append(range(start, cuts[j].start))
                start = max(start, cuts[j].stop)
                j += 1
            if start < span.stop:
                out.append(range(start, span.stop))
        return RankSet(out)

    def clip(self, within: range) -> RankSet:
        """The ranks of this set inside ``within`` (step 1)."""
        return RankSet(range(max(s.start, within.start), min(s.stop, within.stop))
                       for s in self._spans)

    @property
    def spans(self) -> tuple[range, ...]:
        """The disjoint ranges, ascending."""
        return self._spans

    def ranges(self) -> list[list[int]]:
        """``[[first, last], ...]`` (inclusive), as written in JSON."""
        return [[s.start, s.stop - 1] for s in self._spans]

    def __len__(self) -> int:
        return self._counts[-1] if self._counts else 0

    def __contains__(self, rank: object) -> bool:
        if not isinstance(rank, int):
            return False
        i = bisect.bisect_right(self._starts, rank) - 1
        return i >= 0 and rank < self._spans[i].stop

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(self._spans)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...

    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            return tuple(self[i] for i in range(start, stop, step))
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("RankSet index out of range")
        i = bisect.bisect_right(self._counts, index)
        before = self._counts[i - 1] if i else 0
        return self._spans[i].start + index - before

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RankSet):
            return self._spans == other._spans
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple((s.start, s.stop) for s in self._spans))

    def __bool__(self) -> bool:
        return bool(self._spans)

    def __repr__(self) -> str:
        return f"RankSet({self.ranges()})"


EMPTY: Final = RankSet()


def rank_ranges(ranks: Sequence[int] | Iterable[int]) -> list[range] | None:
    """The spans of ``ranks`` without visiting each rank, when it is a
    :class:`RankSet` or a step-1 ``range``; None otherwise."""
    if isinstance(ranks, RankSet):
        return list(ranks.spans)
    if isinstance(ranks, range) and ranks.step == 1:
        return [ranks] if len(ranks) else []
    return None
