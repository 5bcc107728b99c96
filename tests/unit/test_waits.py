"""The cross-group wait-for graph: chains end at roots, cycles are found, and the
top-level culprits are the roots, never the ranks merely waiting."""

from __future__ import annotations

import pytest

from frforensics.analyzer import AnalyzeOptions, analyze
from frforensics.analyzer.context import Context
from frforensics.analyzer.detectors._roots import chain
from frforensics.analyzer.digest import digest
from frforensics.analyzer.load import DumpSet
from frforensics.analyzer.merge import build_job
from frforensics.analyzer.waits import _strongly_connected, build_wait_graph
from frforensics.testing import JobBuilder


def _ctx(dumps: object) -> tuple[Context, DumpSet]:
    ds = DumpSet()
    for r, t in dumps.traces().items():  # type: ignore[attr-defined]
        ds.digests[r] = digest(t, rank=r)
    job = build_job(ds.digests, world_size=dumps.world_size)  # type: ignore[attr-defined]
    return Context.build(job, build_wait_graph(job), AnalyzeOptions()), ds


@pytest.mark.parametrize(("size", "layout", "rank"), [
    (8, dict(tp=2, pp=2, dp=2), 3),
    (64, dict(tp=8, pp=4, dp=2), 20),
])
def test_every_chain_across_groups_ends_at_the_stuck_rank(size: int, layout: dict[str, int],
                                                          rank: int) -> None:
    dumps = JobBuilder(world_size=size, seed=1, **layout).steps(12).stuck(rank=rank, step=10).build()
    ctx, ds = _ctx(dumps)
    assert set(ctx.graph.roots) == {rank} and ctx.graph.roots[rank].kind == "free"
    assert not ctx.graph.cycles
    # everybody else is blocked, and each chain ends at the root
    assert set(ctx.graph.waits) == set(range(size)) - {rank}
    assert ctx.graph.roots[rank].waiters == set(range(size)) - {rank}
    groups_seen = set()
    for r in ctx.graph.waits:
        hops = chain(ctx, r)
        assert hops and rank in hops[-1].on
        groups_seen |= {ctx.job.groups[w.gid].desc for w in hops}
    if size == 64:
        assert len(groups_seen) >= 2  # chains cross groups
    report = analyze(ds, options=AnalyzeOptions(world_size=size))
    assert report.culprit_ranks == dumps.expected.culprit_ranks == (rank,)
    top = report.findings[0]
    assert (top.pg.name, top.pg.ranks, top.seq) == (  # type: ignore[union-attr]
        dumps.expected.group.name, dumps.expected.group.ranks, dumps.expected.seq)  # type: ignore[union-attr]
    # the explanation says what the root was doing and how others reach it
    assert "at dump time" in top.message and "last recorded op" in top.message
    assert top.evidence["culprits"][str(rank)]["threads"]


def test_cycle_members_are_found_by_tarjan_without_recursion() -> None:
    n = 50_000
    edges = {i: ((i + 1) % n,) for i in range(n)}
    edges[n] = (0,)  # a waiter outside the ring
    sccs = _strongly_connected(edges)
    big = [c for c in sccs if len(c) > 1]
    assert len(big) == 1 and sorted(big[0]) == list(range(n))


def test_order_inversion_is_a_cycle_and_its_waiters_are_not_in_it() -> None:
    dumps = (JobBuilder(world_size=64, tp=8, pp=4, dp=2, seed=2).steps(12)
             .order_inversion(ranks=17, step=10).build())
    ctx, _ = _ctx(dumps)
    assert len(ctx.graph.cycles) == 1
    cycle = ctx.graph.cycles[0]
    assert set(dumps.expected.culprit_ranks) <= set(cycle.ranks)
    assert not cycle.waiters & set(cycle.ranks)
    assert not ctx.graph.roots
