"""Crash cascades on built dump sets: only roots are culprits, first in time first.

Each job is the builder's (``JobBuilder``, 8 ranks TP×PP×DP), written as frdump files,
then the death records a real cascade leaves are written into chosen ranks' dumps
(the texts gloo and PyTorch print, see ``tests/unit/test_failures.py``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from frforensics.analyzer import AnalyzeOptions, analyze, load_dumps
from frforensics.formats import frdump
from frforensics.model import DeathInfo, DumpReason, Frame
from frforensics.report import FindingKind, Report, Severity
from frforensics.testing import JobBuilder

PEER_LOST = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
             "closed by peer [127.0.0.1]:4567. This is typically caused by a remote worker "
             "crashing. Check the logs of the remote worker before reporting an error.")
TRAIN = Frame("/job/train.py", 88, "step")


def _job() -> JobBuilder:
    return JobBuilder(world_size=8, tp=2, pp=2, dp=2, ring_size=400, seed=3).steps(12)


def _write(job: JobBuilder, out: Path) -> dict[int, Path]:
    job.build().write_frdump(out)
    paths = {}
    for path in out.iterdir():
        rank = frdump.decode(path.read_bytes()).rank
        assert rank is not None
        paths[rank] = path
    return paths


def _edit(path: Path, **changes: object) -> None:
    trace = frdump.decode(path.read_bytes())
    header = dataclasses.replace(trace.header, **changes)  # every edit is of the header
    frdump.write_atomic(path, frdump.encode(dataclasses.replace(trace, header=header)))


def _die(path: Path, message: str, *, at_ns: int | None = None,
         frames: tuple[Frame, ...] = ()) -> None:
    trace = frdump.decode(path.read_bytes())
    _edit(path, death=DeathInfo("exception", message, frames), dump_reason=DumpReason.EXCEPTION,
          dump_detail=message[:200], stale_peers=(),
          dump_time_ns=at_ns if at_ns is not None else trace.dump_time_ns)


def _analyze(out: Path, world_size: int = 8) -> Report:
    return analyze(load_dumps([out], jobs=1), options=AnalyzeOptions(world_size=world_size))


def _dead(report: Report):
    found = [f for f in report.findings if f.kind is FindingKind.DEAD_RANK]
    assert found, [f.message for f in report.findings]
    return found


def test_the_rank_its_peers_lost_is_the_culprit_not_the_peers(tmp_path):
    # rank 5 died without a dump or a heartbeat reading; ranks 4 and 1 died of
    # "Connection closed by peer": consequences
    paths = _write(_job().dead(rank=5, step=10), tmp_path)
    for r in paths:
        _edit(paths[r], stale_peers=())
    for r in (1, 4):
        _die(paths[r], PEER_LOST)
    report = _analyze(tmp_path)
    assert report.culprit_ranks == (5,), [f.message for f in report.findings]
    lead = _dead(report)[0]
    assert lead.evidence["died_in_consequence"] == [1, 4]
    assert "rank(s) 1,4 failed because rank 5 failed" in lead.message
    assert {a.rank: a.action for a in report.actions} == {5: "replace_gpu_or_host"}


def test_the_first_root_in_time_is_the_culprit_and_a_later_one_is_not(tmp_path):
    paths = _write(_job().dead(rank=5, step=10, leaves_dump=True), tmp_path)
    first = frdump.decode(paths[5].read_bytes()).dump_time_ns
    assert first
    _die(paths[5], "RuntimeError: bad batch", at_ns=first, frames=(TRAIN,))
    _die(paths[2], "ValueError: shapes differ", at_ns=first + 2_000_000_000)
    _die(paths[4], PEER_LOST, at_ns=first + 100_000_000)
    report = _analyze(tmp_path)
    assert report.culprit_ranks == (5,), [f.message for f in report.findings]
    lead = _dead(report)[0]
    assert [r["rank"] for r in lead.evidence["later_roots"]] == [2]
    assert lead.evidence["died_in_consequence"] == [4]
    act = {a.rank: a for a in report.actions}[5]
    assert act.action == "fix_code" and "/job/train.py:88" in act.detail


def test_two_roots_that_cannot_be_told_apart_are_both_named_to_inspect(tmp_path):
    paths = _write(_job().dead(rank=5, step=10, leaves_dump=True), tmp_path)
    first = frdump.decode(paths[5].read_bytes()).dump_time_ns
    assert first
    _die(paths[5], "RuntimeError: bad batch", at_ns=first)
    _die(paths[2], "ValueError: shapes differ", at_ns=first + 20_000_000)
    report = _analyze(tmp_path)
    assert set(report.culprit_ranks) == {2, 5}, [f.message for f in report.findings]
    assert {a.rank: a.action for a in report.actions} == {2: "inspect", 5: "inspect"}
    assert all("cannot be told" in f.message for f in _dead(report))


@pytest.mark.parametrize(("message", "action"), [
    ("RuntimeError: CUDA error: an illegal memory access was encountered", "replace_gpu_or_host"),
    ("RuntimeError: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO)",
     "replace_gpu_or_host"),
    ("RuntimeError: bad batch", "fix_code"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "inspect"),
])
def test_the_action_follows_the_roots_failure_class(tmp_path, message, action):
    paths = _write(_job().dead(rank=5, step=10, leaves_dump=True), tmp_path)
    _die(paths[5], message, frames=(TRAIN,))
    report = _analyze(tmp_path)
    assert report.culprit_ranks == (5,)
    assert {a.rank: a.action for a in report.actions} == {5: action}


def test_when_every_failure_is_a_consequence_no_rank_is_named(tmp_path):
    paths = _write(_job(), tmp_path)
    for r in (1, 4):
        _die(paths[r], PEER_LOST)
    report = _analyze(tmp_path)
    assert report.culprit_ranks == (), [f.message for f in report.findings]
    lead = _dead(report)[0]
    assert lead.severity is Severity.ERROR and lead.culprit_ranks == ()


def test_a_healthy_job_with_one_file_not_collected_stays_healthy_enough(tmp_path):
    paths = _write(_job(), tmp_path)
    paths[3].unlink()
    report = _analyze(tmp_path)
    assert report.culprit_ranks == ()
    assert not [f for f in report.findings if f.severity is Severity.ERROR]


def test_a_rank_lost_after_a_desync_is_a_consequence_not_a_culprit(tmp_path):
    # DDP-like: 4 ranks in one data-parallel group; rank 1 all_reduces another size,
    # gloo aborts a receiver, rank 2 (SIGABRT: "Received data size doesn't match",
    # no dump)
    job = JobBuilder(world_size=4, dp=4, seed=3).steps(12).size_mismatch(rank=1, step=10,
                                                                          group="dp")
    paths = _write(job, tmp_path)
    paths[2].unlink()
    report = _analyze(tmp_path, world_size=4)
    assert report.culprit_ranks == (1,), [f.message for f in report.findings]
    assert [f.kind for f in report.findings if f.culprit_ranks] == [FindingKind.SIZE_MISMATCH]
    victim = [f for f in report.findings if f.kind is FindingKind.MISSING_DUMP]
    assert victim and victim[0].evidence["consequence_of"] == "desync"


DATA = Path(__file__).resolve().parents[1] / "data"


def test_native_crash_dumps_name_the_missing_rank_as_the_culprit_of_a_hang_with_medium_confidence():
    # PyTorch's own gloo dumps after rank 1 os._exit'ed (tests/data/native_crash):
    # no death record, the failed op retired on some survivors only. Issue 19: the
    # missing file among ranks that all stopped at one op is evidence -> a hang
    report = analyze(load_dumps([DATA / "native_crash"], jobs=1),
                     options=AnalyzeOptions(world_size=4))
    assert report.culprit_ranks == (1,)
    assert report.status.value == "hang"
    f = report.findings[0]
    assert f.kind is FindingKind.MISSING_DUMP and f.severity is Severity.ERROR
    assert (f.op, f.seq) == ("all_reduce", 4)
    assert f.evidence["confidence"] == "medium" and f.evidence["missing"] == [1]
    assert "healthy job dumped mid-op" in f.message  # says how sure, and why not more
    assert [str(a.action) for a in report.actions] == ["inspect"]


@pytest.mark.parametrize("drop", [0, 1, 2, 3])
def test_a_healthy_native_job_dumped_mid_op_with_one_file_not_collected(tmp_path, drop):
    # The same pattern as the crash above (tests/data/native/healthy: #31 retired on
    # ranks 1, 3 only): the dumps cannot tell the two apart, so the missing rank is
    # named with medium confidence and the action is inspect, never a replacement
    import shutil

    for src in (DATA / "native" / "healthy" / "pickle").iterdir():
        if not src.name.endswith(f"_{drop}"):
            shutil.copy(src, tmp_path / src.name)
    report = analyze(load_dumps([tmp_path], jobs=1), options=AnalyzeOptions(world_size=4))
    assert report.culprit_ranks == (drop,)
    assert [f.evidence.get("confidence") for f in report.findings if f.culprit_ranks] == ["medium"]
    assert {str(a.action) for a in report.actions} == {"inspect"}


def test_a_healthy_native_job_whose_ranks_all_finished_with_one_file_missing_is_not_a_hang(tmp_path):
    # every dumped rank retired its newest op: nothing stopped there
    job = JobBuilder(world_size=4, dp=4, seed=3).steps(6).gloo_style()
    job.build().write_native(tmp_path)
    (tmp_path / "nccl_trace_rank_2").unlink()
    report = analyze(load_dumps([tmp_path], jobs=1), options=AnalyzeOptions(world_size=4))
    assert report.culprit_ranks == ()
    assert not [f for f in report.findings if f.severity is Severity.ERROR]


def test_a_missing_rank_where_every_dumped_rank_is_stuck_is_the_culprit_of_a_hang(tmp_path):
    # every survivor stuck in the same unretired op (a rank frozen or hung hard: it
    # writes nothing): the missing member is the culprit, error, with how sure
    job = JobBuilder(world_size=4, dp=4, seed=3).steps(12).gloo_style().dead(rank=2, step=8)
    job.build().write_native(tmp_path)
    report = analyze(load_dumps([tmp_path], jobs=1), options=AnalyzeOptions(world_size=4))
    assert report.culprit_ranks == (2,)
    f = report.findings[0]
    assert f.kind is FindingKind.MISSING_DUMP and f.severity is Severity.ERROR


def test_real_desync_victim_aborted_by_gloo_is_not_a_culprit():
    # sample_dumps/dtype_mismatch: rank 0 all_reduces float64; gloo aborts rank 3
    # ("Received data size doesn't match", no dump; its heartbeat goes stale).
    # Before: culprits [0, 3] (rank 3 a dead_rank); now the desync's rank only
    samples = Path(__file__).resolve().parents[2] / "sample_dumps"
    report = analyze(load_dumps([samples / "dtype_mismatch" / "frdump"], jobs=1),
                     options=AnalyzeOptions(world_size=4))
    assert report.culprit_ranks == (0,), [f.message for f in report.findings]
    victim = [f for f in report.findings if f.kind is FindingKind.MISSING_DUMP]
    assert victim and victim[0].evidence == {"ranks": [3], "consequence_of": "desync"}


@pytest.mark.parametrize(("case", "world_size"), [("tp-raise", 4), ("dp_tp-exit", 4),
                                                   ("dp_tp-raise", 4)])
def test_real_native_dumps_of_a_crashed_rank_in_tp_and_2d_jobs_name_that_rank(case, world_size):
    # tests/data/native_workloads: rank 1 raised or exited; gloo retired the op its
    # peers failed in, so "completed on some members" is no proof the op ran when a
    # member never entered it (merge.JobModel._completed_elsewhere), and a rank that
    # stopped right after an op shared with the lost rank failed because of it
    report = analyze(load_dumps([DATA / "native_workloads" / case], jobs=1),
                     options=AnalyzeOptions(world_size=world_size))
    assert report.culprit_ranks == (1,), [f.message for f in report.findings]
    assert report.status.value == "hang"
    assert [str(a.action) for a in report.actions] == ["inspect"]


def test_the_same_dumps_complete_are_not_blamed_on_the_rank_that_stopped(tmp_path):
    # dp_tp-exit without the rule: rank 3 (stopped after its dp all_gather with the
    # lost rank 1) was the missing_rank culprit; it is a consequence now
    report = analyze(load_dumps([DATA / "native_workloads" / "dp_tp-exit"], jobs=1),
                     options=AnalyzeOptions(world_size=4))
    f = report.findings[0]
    assert f.kind is FindingKind.MISSING_DUMP and f.culprit_ranks == (1,)
    assert f.evidence["basis"] == "stopped_with_missing_rank"
    assert f.evidence["confidence"] == "medium" and list(f.evidence["stopped"]) == ["3"]
    assert 3 not in report.culprit_ranks
