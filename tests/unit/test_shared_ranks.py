"""Equal group memberships decode to one tuple per process, within a bound."""

from __future__ import annotations

import pytest

from frforensics import _members as _shared
from frforensics.formats.frdump import _group_ranks
from frforensics.formats.limits import DEFAULT_LIMITS
from frforensics.formats.native import _parse_ranks


def test_equal_memberships_of_two_dumps_are_one_tuple() -> None:
    raw = {"arith": [0, 1, 16384]}
    first = _group_ranks(dict(raw), "a", DEFAULT_LIMITS)
    second = _group_ranks({"arith": [0, 1, 16384]}, "b", DEFAULT_LIMITS)
    assert first == tuple(range(16384))
    assert first is second
    packed = (b"\x00\x00\x00\x00" b"\x02\x00\x00\x00") * 40
    assert _group_ranks(packed, "a", DEFAULT_LIMITS) is _group_ranks(bytes(packed), "b",
                                                                      DEFAULT_LIMITS)


def test_the_cache_holds_a_bounded_number_of_members() -> None:
    for start in range(3 * _shared._SLOTS):
        assert _group_ranks({"arith": [start, 1, 100_000]}, "x", DEFAULT_LIMITS) == tuple(
            range(start, start + 100_000))
    assert len(_shared._cache) <= _shared._SLOTS
    assert _shared._held[0] <= _shared._MEMBERS
    assert _shared._held[0] == sum(len(v or ()) for v in _shared._cache.values())


def test_a_malformed_membership_is_never_cached_as_valid() -> None:
    import pytest

    from frforensics.errors import CorruptDumpError
    for _ in range(2):
        with pytest.raises(CorruptDumpError):
            _group_ranks({"arith": [0, 0, 100]}, "x", DEFAULT_LIMITS)
    text = "[" + ", ".join(map(str, range(200))) + "]"
    assert _parse_ranks(text) == tuple(range(200))


def test_a_large_progression_travels_as_three_ints_and_lands_as_one_shared_tuple() -> None:
    import pickle

    from frforensics.model import GroupInfo

    world = GroupInfo("0", "default_pg", tuple(range(70_000)), "nccl")
    dp = GroupInfo("3", "dp", tuple(range(3, 3 + 8 * 500, 8)), "nccl")
    odd = GroupInfo("4", "x", (7, *range(100, 200)), "nccl")  # not a progression
    small = GroupInfo("5", "tp", (0, 1, 2, 3), "nccl")
    data = pickle.dumps([world, dp, odd, small], protocol=4)
    assert len(data) < 2_000  # the 70,000 members are not in it
    first, second = pickle.loads(data), pickle.loads(data)
    assert first == [world, dp, odd, small]
    # every batch received rebuilds the same one tuple, not a copy per batch
    assert first[0].ranks is second[0].ranks and first[1].ranks is second[1].ranks


def test_a_bad_progression_is_refused() -> None:
    from frforensics.model import _group_in_progression

    for start, step, count in ((0, 0, 100), (-1, 1, 100), (0, 1, 1 << 30), (0, 1.5, 100)):
        with pytest.raises(ValueError):
            _group_in_progression("0", "", start, step, count, "")  # type: ignore[arg-type]
