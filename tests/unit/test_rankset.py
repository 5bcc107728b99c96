"""RankSet: a set of ranks as disjoint ranges behaves like the sorted list it stands for."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from frforensics.rankset import LISTED_RANKS_FLOOR, RankSet, listable
from frforensics.report import GroupRef, format_ranks

rank_sets = st.sets(st.integers(min_value=0, max_value=80), max_size=60)


def _of(ranks: set[int]) -> RankSet:
    return RankSet(range(r, r + 1) for r in ranks)


@given(rank_sets, rank_sets)
def test_rank_set_is_the_sorted_set_it_stands_for(a: set[int], b: set[int]) -> None:
    s = _of(a)
    assert list(s) == sorted(a)
    assert len(s) == len(a)
    assert [s[i] for i in range(len(s))] == sorted(a)
    assert all((r in s) == (r in a) for r in range(-3, 90))
    assert list(s.minus(_of(b))) == sorted(a - b)
    assert list(s.minus(b)) == sorted(a - b)
    assert s == RankSet(reversed(s.spans))
    assert RankSet.of([*a, *a]) == s
    assert list(s.clip(range(10, 50))) == sorted(r for r in a if 10 <= r < 50)


@given(rank_sets, st.integers(min_value=0, max_value=10), st.integers(min_value=0, max_value=90))
def test_difference_from_a_range_visits_only_the_removed_ranks(
        removed: set[int], start: int, stop: int) -> None:
    universe = range(start, stop)
    assert list(RankSet.difference(universe, removed)) == [r for r in universe if r not in removed]


@given(rank_sets)
def test_ranges_are_rendered_as_the_same_list_would_be(ranks: set[int]) -> None:
    assert format_ranks(_of(ranks)) == format_ranks(sorted(ranks))
    assert format_ranks(_of(ranks), limit=2) == format_ranks(sorted(ranks), limit=2)


def test_a_claimed_world_renders_without_visiting_each_rank() -> None:
    world = range(1 << 20)
    assert format_ranks(world) == "0-1048575"
    missing = RankSet.difference(world, {0, 1, 2, 3, 9})
    assert format_ranks(missing) == "4-8,10-1048575"
    assert missing.ranges() == [[4, 8], [10, 1048575]]
    assert len(missing) == (1 << 20) - 5 and 1048575 in missing and 9 not in missing


def test_group_too_large_to_list_is_written_as_a_count_and_ranges() -> None:
    listed = GroupRef("0", "default_pg", (0, 1, 2))
    assert listed.to_json()["ranks"] == [0, 1, 2]
    big = GroupRef("0", "default_pg", range(1 << 20), listed=False)
    assert big.to_json() == {"name": "0", "desc": "default_pg", "ranks": None,
                             "ranks_count": 1 << 20, "ranks_ranges": [[0, (1 << 20) - 1]]}
    assert big.label() == "default_pg (name 0, ranks 0-1048575)"


def test_listing_bound_follows_the_dumps_loaded() -> None:
    assert listable(LISTED_RANKS_FLOOR, 4)
    assert not listable(LISTED_RANKS_FLOOR + 1, 4)
    assert listable(10_000, 10_000)
