"""The what-if replay (``analyzer/replay.py``) and the straggler rule that reads it."""

from __future__ import annotations

import math

import numpy as np

from frforensics.analyzer.replay import replay_spans


def _rows(enq: list[list[float]], comp: list[list[float]]) -> tuple[np.ndarray, ...]:
    pos = np.repeat(np.arange(len(enq)), [len(e) for e in enq])
    seg = np.concatenate([np.arange(len(e)) for e in enq])
    return pos, seg, np.concatenate(enq).astype(float), np.concatenate(comp).astype(float)


def test_the_worked_example_of_the_module_doc() -> None:
    # 2 ranks, 3 all_reduces; rank 1 thinks 50 ms longer before #2
    pos, seg, enq, comp = _rows([[0, 10, 70], [0, 60, 70]], [[10, 70, 90], [10, 70, 90]])
    removed = np.zeros(len(pos))
    removed[4] = 50.0  # rank 1's row at #2
    before, after = replay_spans(pos, seg, enq, comp, removed, tolerance_ns=0.0)
    assert (before, after) == (90.0, 40.0)
    # as recorded, nothing removed: the replay reproduces the recorded span
    assert replay_spans(pos, seg, enq, comp, np.zeros(len(pos)), tolerance_ns=0.0) == (90.0, 90.0)


def test_a_delay_overlapped_by_another_ranks_saves_nothing() -> None:
    # ranks 1 and 2 both think 50 ms longer before #2: removing rank 1's alone saves
    # nothing, rank 2 still holds the collective back
    enq = [[0, 10, 70], [0, 60, 70], [0, 60, 70]]
    comp = [[10, 70, 90]] * 3
    pos, seg, e, c = _rows(enq, comp)
    removed = np.zeros(len(pos))
    removed[4] = 50.0
    assert replay_spans(pos, seg, e, c, removed, tolerance_ns=0.0) == (90.0, 90.0)


def test_async_ops_follow_their_predecessors_arrival() -> None:
    # rank 0 issues #2 at 2 ms while #1 is in flight (DDP's buckets): its arrival
    # follows its own previous arrival, not #1's completion; rank 1 issues #2 30 ms
    # after #1 completed, and that 30 ms is removed
    pos, seg, enq, comp = _rows([[0, 2], [0, 40]], [[10, 45], [10, 45]])
    removed = np.zeros(len(pos))
    removed[3] = 30.0
    assert replay_spans(pos, seg, enq, comp, removed, tolerance_ns=0.0) == (45.0, 15.0)


def test_enqueue_times_only_complete_at_the_last_arrival() -> None:
    # PyTorch's gloo dumps: no completion times
    pos, seg, enq, _ = _rows([[0, 10, 70], [0, 60, 70]], [[0, 0, 0], [0, 0, 0]])
    comp = np.full(len(pos), np.nan)
    removed = np.zeros(len(pos))
    removed[4] = 50.0
    before, after = replay_spans(pos, seg, enq, comp, removed, tolerance_ns=0.0)
    assert (before, after) == (70.0, 20.0)


def test_no_rows_is_no_span() -> None:
    empty = np.zeros(0)
    got = replay_spans(empty.astype(int), empty.astype(int), empty, empty, empty)
    assert all(math.isnan(v) for v in got)


def test_a_pipeline_job_with_p2p_rows_is_judged_without_error() -> None:
    # real dumps (tests/data/native_workloads/README.md): the p2p pairs come after
    # the collectives, out of rank order; the replay's clock estimate once crashed here
    from pathlib import Path

    from frforensics.analyzer import AnalyzeOptions, analyze, load_dumps

    data = Path(__file__).resolve().parents[1] / "data" / "native_workloads" / "pipeline-slow-ours"
    report = analyze(load_dumps([data], jobs=1), options=AnalyzeOptions(world_size=4))
    assert not report.unreadable


def test_a_pipeline_stage_slow_in_its_forward_is_named_from_its_sends_and_receives() -> None:
    """Real dumps: stage 1 of a 4-stage 1F1B pipeline sleeps 40 ms in every
    microbatch's forward (tests/data/native_workloads/README.md). It read HEALTHY:
    a gloo send's completion (when the program waited on it) was taken as what
    released the next op, and the replay's 60 ms tolerance made cycles (4 rows of 5
    fell back to recorded times: 2 % saved). The job ran 10 steps in 1.82 s; the
    same job without the delay in 0.19 s: the replay says 1818 ms -> 184 ms."""
    from pathlib import Path

    from frforensics.analyzer import AnalyzeOptions, analyze, load_dumps
    from frforensics.report import FindingKind

    data = Path(__file__).resolve().parents[1] / "data" / "native_workloads" / "pipeline-slow-ours"
    report = analyze(load_dumps([data], jobs=1), options=AnalyzeOptions(world_size=4))
    assert report.culprit_ranks == (1,)
    [f] = [f for f in report.findings if f.kind is FindingKind.STRAGGLER]
    assert f.evidence["sustained"] == "recurring"
    # issue 29: the what-if saving within 20 % of the one a rerun without the delay
    # measured (1818 ms -> 192 ms of job time, README). Removing min(lateness,
    # excess) on the blamed rows only said 46 %: the stage's delay shows as think
    # time before its send and as lateness at the receive after it, rarely both.
    measured = 1 - 192 / 1818
    assert abs(f.evidence["cost_share"] - measured) <= 0.2 * measured, f.evidence



def test_a_pipeline_stage_10_ms_slow_per_microbatch_is_named_and_a_healthy_one_is_not() -> None:
    """Issue 29's case: stage 1 of the same 1F1B pipeline 10 ms slower per microbatch
    (``WL_SLOW_MS=10``, 40 ms per step; tests/data/native_workloads/README.md). Its
    lateness at sends and receives (~10 ms) is below the 30 ms floor of our polled
    completions, but a send/recv's completion is stamped when the program waits on
    it (RecordedWork.wait), not polled: those rows keep the 1 ms floor. The job's
    recorded span was 492.6 ms, the fault-free run's 90.9 ms (measured saving 81.6 %)."""
    from pathlib import Path

    from frforensics.analyzer import AnalyzeOptions, analyze, load_dumps
    from frforensics.report import FindingKind

    data = Path(__file__).resolve().parents[1] / "data" / "native_workloads"
    report = analyze(load_dumps([data / "pipeline-slow10-ours"], jobs=1),
                     options=AnalyzeOptions(world_size=4))
    assert report.culprit_ranks == (1,)
    [f] = [f for f in report.findings if f.kind is FindingKind.STRAGGLER]
    measured = 1 - 90.9 / 492.6
    assert abs(f.evidence["cost_share"] - measured) <= 0.2 * measured, f.evidence
    healthy = analyze(load_dumps([data / "pipeline-none-ours"], jobs=1),
                      options=AnalyzeOptions(world_size=4))
    assert healthy.status.value == "healthy" and healthy.culprit_ranks == ()
