"""p2p pairing and p2p_deadlock: synthetic pipeline jobs (verdicts stated by the
builder) and small hand-built channels whose rings evicted their beginnings."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from frforensics.analyzer import AnalyzeOptions, analyze
from frforensics.analyzer.digest import digest
from frforensics.analyzer.load import DumpSet
from frforensics.analyzer.merge import build_job
from frforensics.analyzer.waits import build_wait_graph
from frforensics.model import DumpHeader, EntryTable, GroupInfo, OpState, RankTrace, SourceFormat
from frforensics.report import FindingKind, Report, Severity
from frforensics.testing import JobBuilder
from helpers import analyze_dumps

LAYOUTS = {8: dict(tp=2, pp=2, dp=2), 16: dict(tp=2, pp=4, dp=2), 64: dict(tp=8, pp=4, dp=2)}


def job(size: int, ring: int = 2000, seed: int = 0) -> JobBuilder:
    return (JobBuilder(world_size=size, ring_size=ring, seed=seed, **LAYOUTS[size])
            .steps(24).jitter(ms=0.3))


def stage1_rank(size: int) -> int:
    lay = job(size).layout
    return lay.rank_at(tp_rank=1, dp_rank=1, pp_rank=lay.pp - 2)


@pytest.mark.parametrize("fmt", ["frdump", "pickle"])
@pytest.mark.parametrize("ring", [2000, 60])
@pytest.mark.parametrize("size", [8, 16, pytest.param(64, marks=pytest.mark.slow)])
@pytest.mark.parametrize("fault", ["p2p_recv_without_send", "p2p_swap_order"])
def test_pipeline_p2p_deadlock_names_both_stages(fault: str, size: int, ring: int, fmt: str) -> None:
    rank = stage1_rank(size)
    dumps = getattr(job(size, ring, seed=size), fault)(rank=rank, step=20).build()
    want = dumps.expected
    report = analyze_dumps(dumps, fmt)
    assert report.status.value == want.status == "hang"
    assert report.culprit_ranks == want.culprit_ranks
    top = report.findings[0]
    assert top.kind is FindingKind.P2P_DEADLOCK and top.severity is Severity.ERROR
    assert top.culprit_ranks == want.culprit_ranks and top.seq_kind == "p2p"
    assert want.group is not None and top.pg is not None
    assert (top.pg.name, top.pg.ranks) == (want.group.name, want.group.ranks)
    assert top.seq == want.seq and top.op == want.op
    assert "recv/recv" in top.message
    if fmt == "pickle" and ring < 100 and size == 8:
        # a few ops of each channel left in tiny rings: the pairing is a stated guess,
        # and a cycle names every member anyway
        assert top.evidence["pairing"] in ("exact", "high", "low")
    else:
        assert top.evidence["pairing"] in ("exact", "high")
    # every other rank only waits
    assert set(top.waiting_ranks) == set(range(size)) - set(want.culprit_ranks)


@pytest.mark.parametrize("fmt", ["frdump", "pickle"])
def test_heavy_pipeline_traffic_with_jitter_raises_nothing(fmt: str) -> None:
    dumps = (JobBuilder(world_size=64, tp=2, pp=8, dp=4, ring_size=2000, seed=5)
             .steps(12).jitter(ms=1.0).build())
    assert dumps.expected.status == "healthy"
    report = analyze_dumps(dumps, fmt)
    assert not [f for f in report.findings if f.severity is not Severity.INFO]
    assert report.culprit_ranks == ()


# ---------------------------------------------------------------- hand-built
def _trace(rank: int, ops: list[tuple[str, int, int, int, int]], *, first_record: int,
           peer_seq: bool = False) -> RankTrace:
    """ops: (op, peer, numel, state, t_complete_ms); p2p on the default group of 2 ranks."""
    strings = ("send", "recv", "Float", "")
    n = len(ops)
    cols = {
        "record_id": np.arange(first_record, first_record + n),
        "pg": np.zeros(n), "seq": np.zeros(n),
        "p2p_seq": np.arange(first_record + 1, first_record + n + 1),
        "op": [strings.index(o[0]) for o in ops], "is_p2p": np.ones(n),
        "peer": [o[1] for o in ops], "in_numel": [o[2] for o in ops],
        "out_numel": [o[2] for o in ops], "in_dtypes": np.full(n, 2), "out_dtypes": np.full(n, 2),
        "state": [o[3] for o in ops],
        "t_enqueue_ns": [1_000_000_000 + i * 10_000_000 for i in range(n)],
        "t_complete_ns": [o[4] * 1_000_000 if o[3] == OpState.COMPLETED else 0 for o in ops],
        "timeout_ms": np.full(n, 600_000),
    }
    if peer_seq:
        cols["peer_seq"] = np.arange(first_record + 1, first_record + n + 1)
    return RankTrace(rank=rank, header=DumpHeader(source=f"r{rank}", format=SourceFormat.NATIVE_PICKLE,
                                                  version="2.10"),
                     groups=(GroupInfo("0", "default_pg", (0, 1)),), strings=strings, stacks=(),
                     entries=EntryTable.from_columns(n, cols))


def _channel(sent: int, received: int, *, keep_send: int, keep_recv: int,
             sizes: list[int] | None = None, times: bool = True) -> tuple[RankTrace, RankTrace]:
    """Rank 0 sent ``sent`` ops to 1 (the last pending); rank 1 received ``received``."""
    sizes = sizes or [10 * (1 + k % 7) for k in range(sent)]
    done = OpState.COMPLETED
    send = [("send", 1, sizes[k], done if k < received else OpState.STARTED,
             5_000 + 37 * k * k if times else 0) for k in range(sent)]
    recv = [("recv", 0, sizes[k], done, 5_000 + 37 * k * k + 3 if times else 0)
            for k in range(received)]
    return (_trace(0, send[-keep_send:], first_record=sent - keep_send),
            _trace(1, recv[-keep_recv:], first_record=received - keep_recv))


def _graph(a: RankTrace, b: RankTrace) -> tuple[Report, object]:
    ds = DumpSet(digests={0: digest(a, rank=0), 1: digest(b, rank=1)})
    job_ = build_job(ds.digests, world_size=2)
    return analyze(ds, options=AnalyzeOptions(world_size=2)), build_wait_graph(job_)


def test_evicted_channel_aligned_on_completed_pairs_accuses_the_peer() -> None:
    a, b = _channel(10, 9, keep_send=6, keep_recv=4)
    report, graph = _graph(a, b)
    wait = graph.waits[0]  # type: ignore[attr-defined]
    assert [p.status for p in wait.p2p] == ["not_posted"] and wait.confidence == "high"
    assert report.culprit_ranks == (1,)
    assert report.findings[0].kind is FindingKind.P2P_DEADLOCK


def test_uncertain_pairing_never_accuses_one_rank_alone() -> None:
    # one recv left in rank 1's ring, equal sizes, no completion times: a guess
    a, b = _channel(10, 9, keep_send=3, keep_recv=1, sizes=[8] * 10, times=False)
    report, graph = _graph(a, b)
    wait = graph.waits[0]  # type: ignore[attr-defined]
    assert wait.confidence == "low"
    top = report.findings[0]
    assert top.kind is FindingKind.P2P_DEADLOCK
    assert set(top.culprit_ranks) == {0, 1}
    assert "guess" in top.message


def test_whole_rings_pair_exactly_by_position() -> None:
    a, b = _channel(5, 4, keep_send=5, keep_recv=4)
    report, graph = _graph(a, b)
    wait = graph.waits[0]  # type: ignore[attr-defined]
    assert wait.confidence == "exact" and wait.p2p[0].index == 5
    assert report.culprit_ranks == (1,)


def _last_pending(table: EntryTable) -> EntryTable:
    cols = table.columns()
    cols["state"] = cols["state"].copy()
    cols["state"][-1] = OpState.STARTED
    cols["t_complete_ns"] = cols["t_complete_ns"].copy()
    cols["t_complete_ns"][-1] = 0
    return EntryTable.from_columns(len(table), cols)


def test_posted_counterpart_is_not_a_wait_but_a_stuck_transfer() -> None:
    a, b = _channel(5, 5, keep_send=5, keep_recv=5)
    # both sides posted their 5th op, and it never completed
    a2, b2 = (replace(t, entries=_last_pending(t.entries)) for t in (a, b))
    report, graph = _graph(a2, b2)
    assert graph.waits[0].on == () and graph.waits[1].on == ()  # type: ignore[attr-defined]
    top = report.findings[0]
    assert top.kind is FindingKind.TIMEOUT and top.seq_kind == "p2p"
    assert set(top.culprit_ranks) == {0, 1}


def test_send_send_cycle_is_named() -> None:
    done = OpState.COMPLETED
    a = _trace(0, [("recv", 1, 4, done, 10), ("send", 1, 4, OpState.STARTED, 0)], first_record=0)
    b = _trace(1, [("send", 0, 4, done, 10), ("send", 0, 4, OpState.STARTED, 0)], first_record=0)
    # rank 1 sends twice while rank 0 sends once: rank 0's send waits for rank 1's recv,
    # rank 1's second send waits for rank 0's second recv
    report, _ = _graph(a, b)
    top = report.findings[0]
    assert top.kind is FindingKind.P2P_DEADLOCK and set(top.culprit_ranks) == {0, 1}
    assert "send/send" in top.message


def _stepped(rank: int, steps: list[list[tuple[str, int]]], *, pending: int = 1) -> RankTrace:
    """A 2-rank pipeline stage: each step's (op, peer) send/recv, closed by a broadcast
    (the per-step loss); the last step is the one in flight, its last ``pending`` ops
    unfinished. Per-peer numbers (frdump), so pairing is exact."""
    strings = ("send", "recv", "broadcast", "Float", "")
    rows: list[tuple[str, int, int]] = []  # (op, peer, collective seq)
    seq = 0
    for i, step in enumerate(steps):
        rows += [(op, peer, seq) for op, peer in step]
        if i < len(steps) - 1:
            seq += 1
            rows.append(("broadcast", -1, seq))
    n, counts, peer_seq, p2p_seq = len(rows), {}, [], []
    for op, peer, _ in rows:
        if op == "broadcast":
            peer_seq.append(-1)
        else:
            counts[(op, peer)] = counts.get((op, peer), 0) + 1
            peer_seq.append(counts[(op, peer)])
        p2p_seq.append(sum(1 for o, _, _ in rows[:len(p2p_seq) + 1] if o != "broadcast"))
    done = [OpState.COMPLETED] * (n - pending) + [OpState.STARTED] * pending
    cols = {
        "record_id": np.arange(n), "pg": np.zeros(n), "seq": [r[2] for r in rows],
        "p2p_seq": p2p_seq, "peer_seq": peer_seq,
        "op": [strings.index(r[0]) for r in rows], "is_p2p": [r[0] != "broadcast" for r in rows],
        "peer": [r[1] for r in rows], "in_numel": np.full(n, 8), "out_numel": np.full(n, 8),
        "in_dtypes": np.full(n, 3), "out_dtypes": np.full(n, 3), "state": done,
        "t_enqueue_ns": [1_000_000_000 + i * 10_000_000 for i in range(n)],
        "t_complete_ns": [1_000_000_000 + i * 10_000_000 + 5_000_000
                          if s == OpState.COMPLETED else 0 for i, s in enumerate(done)],
        "timeout_ms": np.full(n, 600_000),
    }
    return RankTrace(rank=rank, header=DumpHeader(source=f"r{rank}", format=SourceFormat.FRDUMP,
                                                  version="3", world_size=2),
                     groups=(GroupInfo("0", "default_pg", (0, 1)),), strings=strings, stacks=(),
                     entries=EntryTable.from_columns(n, cols))


STAGE0 = [("send", 1), ("recv", 1)]  # forward out, gradient in
STAGE1 = [("recv", 0), ("send", 0)]  # forward in, gradient out


@pytest.mark.parametrize("full_steps", [3, 6])
def test_a_cycle_one_stage_caused_by_leaving_its_step_order_names_that_stage(
        full_steps: int) -> None:
    # Stage 0 swaps its order in the step in flight (gradient first): both stages wait
    # to receive. Stage 1 does what it did in every step before; stage 0 does not.
    a = _stepped(0, [STAGE0] * full_steps + [[("recv", 1)]])
    b = _stepped(1, [STAGE1] * full_steps + [[("recv", 0)]])
    report, _ = _graph(a, b)
    top = report.findings[0]
    assert top.kind is FindingKind.P2P_DEADLOCK and top.culprit_ranks == (0,), top.message
    assert report.culprit_ranks == (0,) and top.waiting_ranks == (1,)
    assert "rank 0 left its previous step's order" in top.message
    assert "recv from rank 1 where in each of its two steps before it was send to rank 1" in top.message
    assert top.evidence["deviation"]["rank"] == 0


@pytest.mark.parametrize(("steps_a", "steps_b"), [
    # too few steps to know either stage's order: both named
    ([STAGE0, STAGE0, [("recv", 1)]], [STAGE1, STAGE1, [("recv", 0)]]),
    # both stages left their order: both named
    ([STAGE0] * 3 + [[("recv", 1)]], [[("send", 0), ("recv", 0)]] * 3 + [[("recv", 0)]]),
    # an order that was not stable (its two steps before differ): both named
    ([STAGE0, STAGE0 + STAGE0, STAGE0, [("recv", 1)]],
     [STAGE1, STAGE1 + STAGE1, STAGE1, [("recv", 0)]]),
], ids=["first-steps", "both-changed", "unstable"])
def test_a_cycle_without_one_clear_deviator_names_every_rank_of_it(
        steps_a: list[list[tuple[str, int]]], steps_b: list[list[tuple[str, int]]]) -> None:
    report, _ = _graph(_stepped(0, steps_a), _stepped(1, steps_b))
    top = report.findings[0]
    assert top.kind is FindingKind.P2P_DEADLOCK and set(top.culprit_ranks) == {0, 1}, top.message
    assert "recv/recv" in top.message and "deviation" not in top.evidence
