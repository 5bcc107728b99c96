"""cross_pg_deadlock on synthetic TP×PP×DP jobs (verdicts stated by the builder) and
on the real gloo order-inversion dumps."""

from __future__ import annotations

from pathlib import Path

import pytest

from frforensics.analyzer import AnalyzeOptions, analyze, load_dumps
from frforensics.report import FindingKind, Severity
from frforensics.testing import JobBuilder
from helpers import analyze_dumps

NATIVE = Path(__file__).resolve().parents[1] / "data" / "native"
LAYOUTS = {
    8: dict(tp=2, pp=2, dp=2),
    16: dict(tp=2, pp=2, dp=4),
    64: dict(tp=8, pp=4, dp=2),
}


def job(size: int, seed: int = 0, ring: int = 2000) -> JobBuilder:
    return JobBuilder(world_size=size, ring_size=ring, seed=seed, **LAYOUTS[size]).steps(24).jitter(ms=0.3)


#: 64-rank jobs run in the slow lane (the fast loop keeps 8 and 16 ranks)
_SLOW = pytest.mark.slow

@pytest.mark.parametrize("fmt", ["frdump", "pickle"])
@pytest.mark.parametrize(("size", "ranks"), [(8, 0), (16, 5), pytest.param(64, 17, marks=_SLOW),
                                              pytest.param(64, (0, 9), marks=_SLOW)])
def test_ranks_that_inverted_two_groups_order_are_the_culprits(
        size: int, ranks: int | tuple[int, ...], fmt: str) -> None:
    dumps = job(size, seed=size).order_inversion(ranks=ranks, step=20).build()
    want = dumps.expected
    report = analyze_dumps(dumps, fmt)
    assert report.status.value == want.status == "hang"
    assert report.culprit_ranks == want.culprit_ranks
    top = report.findings[0]
    assert top.kind is FindingKind.CROSS_PG_DEADLOCK and top.severity is Severity.ERROR
    assert top.culprit_ranks == want.culprit_ranks
    # the finding's own pg/seq is the op the first culprit issued out of order; the
    # builder's (group, seq) is one collective of the cycle: it must be there exactly
    assert want.group is not None and top.pg is not None
    cycle = {(c["pg"], tuple(c["pg_ranks"]), c["seq"]) for c in top.evidence["cycle"]}
    assert (want.group.name, want.group.ranks, want.seq) in cycle
    first = next(c for c in top.evidence["cycle"] if c["rank"] == want.culprit_ranks[0])
    assert (top.pg.name, top.seq) == (first["pg"], first["seq"])
    cycle_groups = {(g["name"], tuple(g["ranks"])) for g in top.evidence["groups"]}
    assert {(g.name, g.ranks) for g in want.groups} <= cycle_groups
    assert top.evidence["basis"] == "own_history"
    # the waiting members of the cycle are never culprits
    assert not set(top.waiting_ranks) & set(want.culprit_ranks)
    # both orders, with code locations
    assert "earlier time(s) it issued" in top.message and "kept that order" in top.message
    assert ".py:" in top.message


def test_inversion_found_when_rings_hold_only_a_few_steps() -> None:
    dumps = job(64, seed=3, ring=150).order_inversion(ranks=17, step=20).build()
    report = analyze_dumps(dumps, "pickle")
    assert report.culprit_ranks == dumps.expected.culprit_ranks


@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_real_gloo_inversion_names_the_rank_that_changed_its_order(fmt: str) -> None:
    report = analyze(load_dumps([NATIVE / "cross_group" / fmt], jobs=1),
                     options=AnalyzeOptions(world_size=4))
    # run.json: every step issues A then B; only rank 1 at step 5 issues B first
    assert report.culprit_ranks == (1,)
    top = report.findings[0]
    assert top.kind is FindingKind.CROSS_PG_DEADLOCK
    assert top.waiting_ranks == (0, 2, 3)
    assert top.pg is not None and top.pg.name == "1" and top.seq == 6
    assert {g["name"] for g in top.evidence["groups"]} == {"0", "1"}
    if fmt == "pickle":  # the JSON form carries no frames
        assert "capture_native.py:339" in top.message and "capture_native.py:342" in top.message


def test_skipped_collective_that_closes_a_cycle_blames_the_skipper() -> None:
    dumps = job(16, seed=2).skip(rank=6, group="dp", step=20).build()
    want = dumps.expected
    report = analyze_dumps(dumps, "frdump")
    kinds = {want.kind, *want.also_acceptable}
    assert report.culprit_ranks == want.culprit_ranks
    assert report.findings[0].kind.value in kinds
