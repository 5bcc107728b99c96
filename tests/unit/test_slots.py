"""``analyzer.slots`` on hand-made memberships: ranges, repeated members, slots two
groups claim, local indices a rank never listed. (Against the dict-and-loop form it
replaced, on generated and recorded jobs: ``test_central_fast_paths.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from frforensics.analyzer.slots import build_slots


@dataclass
class _G:
    ranks: tuple[int, ...] | range
    local: dict[int, int] = field(default_factory=dict)


@dataclass
class _D:
    groups: tuple[object, ...]


def test_ranges_repeats_shared_slots_and_strangers() -> None:
    digests = {r: _D((None,) * 4) for r in (0, 3, 5, 9)}
    groups = [
        _G(range(0, 1 << 40), {0: 0, 3: 0, 5: 0, 9: 0}),  # a claimed world: never listed
        _G(range(9, -1, -3), {0: 1, 3: 1, 9: 1, 5: 1}),  # a negative step; 5 not a member
        _G((5, 3, 5, 0), {5: 2, 3: 2, 0: 2}),  # 5 listed twice: its last index
        _G((9, 3), {9: 2, 3: 3}),  # rank 3's local 3 ...
        _G((3, 9), {3: 3, 9: 3}),  # ... claimed again by a later group: the later wins
        _G((9,), {9: 7, 8: 0}),  # a local index the rank never listed; a rank with no dump
    ]
    s = build_slots(digests, groups)
    assert s.base.tolist() == [0, 5, 10, 15, 20]
    assert s.gid.tolist() == [0, 1, 2, -1, -1,  0, 1, 2, 4, -1,  0, 1, 2, -1, -1,  0, 1, 3, 4, -1]
    assert s.member.tolist() == [0, 3, 3, -1, -1,  3, 2, 1, 0, -1,  5, -1, 2, -1, -1,
                                 9, 0, 0, 1, -1]
    rows_at = np.array([1, 1, 1, 3, 0], dtype=np.int32)
    assert s.slot_of(rows_at, np.array([2, 7, -1, 3, 0])).tolist() == [7, 9, 9, 18, 0]


def test_a_group_listed_twice_by_a_rank_is_one_slot() -> None:
    # the merge keeps one local index per rank and group (``Group.local``): the
    # rank's other listing of it is no group, and never shares its number
    digests = {0: _D((None,) * 3), 1: _D((None,) * 3)}
    groups = [_G((0, 1), {0: 2, 1: 0}), _G((0, 1), {0: 0, 1: 1})]
    s = build_slots(digests, groups)
    assert s.gid.tolist() == [1, -1, 0, -1, 0, 1, -1, -1]
    assert s.canon.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]


def test_an_empty_job() -> None:
    s = build_slots({}, [])
    assert s.ranks == [] and s.gid.tolist() == [] and s.base.tolist() == [0]

