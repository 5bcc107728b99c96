"""The native recording path (``recorder_path="cxx"``, docs/recorder-native.md) records
what the Python wrapper records: one real job run both ways, the dumps compared field
by field (timestamps aside); a real hang caught and named on the native path.

The native path is built on first use (about 20 s here); where it cannot be built
these tests fail (the build's reason in the message), never skip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_recorder_coverage import EVERYTHING

from frforensics.model import DumpReason, OpState

pytestmark = [pytest.mark.slow, pytest.mark.torch215]

NOTE = "recorded on the native path (recorder_path=cxx)"
TIMES = ("t_enqueue_ns", "t_start_ns", "t_complete_ns", "duration_ns")
STRINGS = ("op", "in_shapes", "out_shapes", "in_dtypes", "out_dtypes", "reduce_op", "thread",
           "device", "splits")


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    from frforensics.recorder import _cxx

    module, why = _cxx.load()
    assert module is not None, f"the native recording path does not build here: {why}"


def _rows(trace: Any) -> list[dict[str, Any]]:
    """Every entry with its strings and stack resolved (timestamps dropped)."""
    cols = trace.entries.columns()
    out = []
    for i in range(len(trace.entries)):
        row: dict[str, Any] = {}
        for name, col in cols.items():
            if name in TIMES:
                continue
            v = int(col[i])
            if name in STRINGS:
                row[name] = trace.string(v) if v >= 0 else None
            elif name == "stack":
                row[name] = None if v < 0 else [
                    (Path(f.file).name, f.line, f.name) for f in trace.stack(v)]
            else:
                row[name] = v
        out.append(row)
    return out


def _run(run_job: Any, path: str, ws: int) -> list[Any]:
    job = run_job(EVERYTHING, world_size=ws, deadline_s=30.0, hard_exit_s=100, name=path,
                  env={"FRFORENSICS_RECORDER_PATH": path})
    codes = job.wait(100)
    assert codes == [0] * ws, job.logs()
    assert "native recording path is unavailable" not in job.logs()
    return [job.decode(r) for r in range(ws)]


@pytest.mark.timeout(240)
def test_one_job_gives_the_same_entries_on_both_paths(run_job):
    ws = 4
    python = _run(run_job, "python", ws)
    native = _run(run_job, "cxx", ws)
    for r in range(ws):
        a, b = python[r], native[r]
        assert b.dump_reason is DumpReason.API
        assert NOTE in b.notes and NOTE not in a.notes
        assert [(g.name, g.desc, g.ranks, g.backend) for g in a.groups] == [
            (g.name, g.desc, g.ranks, g.backend) for g in b.groups]
        ra, rb = _rows(a), _rows(b)
        assert len(ra) == len(rb), (r, len(ra), len(rb))
        for k, (x, y) in enumerate(zip(ra, rb, strict=True)):
            assert x == y, (r, k, {n: (x[n], y[n]) for n in x if x[n] != y[n]})
        assert all(int(s) == OpState.COMPLETED for s in b.entries.state)
        # times are real: enqueue before completion, in order of record
        e = b.entries
        assert all(int(e.t_complete_ns[i]) >= int(e.t_enqueue_ns[i]) > 0 for i in range(len(e)))
        assert list(e.t_enqueue_ns) == sorted(e.t_enqueue_ns)


HANG = r"""
t = torch.ones(8)
for step in range(5):
    dist.all_reduce(t)
if rank == 2:
    time.sleep(60)  # rank 2 never joins the next all_reduce
dist.all_reduce(t)
"""


@pytest.mark.timeout(120)
def test_a_hang_on_the_native_path_is_dumped_by_every_rank_and_named(run_job, fr_analyze):
    ws = 4
    job = run_job(HANG, world_size=ws, deadline_s=2.0, hard_exit_s=60,
                  env={"FRFORENSICS_RECORDER_PATH": "cxx"})
    job.wait_for_dumps(list(range(ws)), 40)
    traces = {r: job.decode(r) for r in range(ws)}
    for r in (0, 1, 3):
        e = traces[r].entries
        assert traces[r].dump_reason in (DumpReason.WATCHDOG_TIMEOUT, DumpReason.PEER_SIGNAL), r
        last = len(e) - 1
        assert traces[r].string(int(e.op[last])) == "all_reduce"
        assert int(e.seq[last]) == 6 and int(e.state[last]) != OpState.COMPLETED
    report = fr_analyze(job.dump_dir)
    assert report["culprit_ranks"] == [2], report
    assert all(NOTE in traces[r].notes for r in range(ws))


ALL_REDUCES = r"""
t = torch.ones(8)
for step in range(3):
    dist.all_reduce(t)
recorder.dump()
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_where_it_cannot_be_built_the_python_wrapper_records_said_once(run_job, tmp_path):
    # a fresh cache and a compiler that always fails: the build fails as on a machine
    # without one
    job = run_job(ALL_REDUCES, world_size=2, deadline_s=30.0, hard_exit_s=100,
                  env={"FRFORENSICS_RECORDER_PATH": "cxx", "CXX": "/bin/false",
                       "FRFORENSICS_CXX_CACHE": str(tmp_path / "cache")})
    assert job.wait(100) == [0, 0], job.logs()
    for r in range(2):
        log = (job.log_dir / f"rank{r}.log").read_text()
        assert log.count("the native recording path is unavailable: building it failed") == 1, log
        trace = job.decode(r)
        assert NOTE not in trace.notes
        ops = [trace.string(int(i)) for i in trace.entries.op]
        assert ops == ["all_reduce"] * 3, ops


OUTLIVED = r"""
import frforensics.recorder as recorder
recorder.enable(DUMP_DIR, timeout_s=2.0, store_poll_interval_s=0.2, buffer_size=16,
                recorder_path="cxx")
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
side = dist.new_group([0, 1])
dist.all_reduce(torch.ones(4))
if rank == 0:  # an all_reduce rank 1 never joins, issued from a thread
    threading.Thread(target=lambda: dist.all_reduce(torch.ones(4)), daemon=True).start()
    time.sleep(0.3)
for _ in range(64):  # meanwhile the other group's ops overwrite the 16-entry ring 4 times
    dist.all_reduce(torch.ones(4), group=side)
time.sleep(40)
"""


@pytest.mark.timeout(120)
def test_a_hang_outlived_by_a_whole_ring_of_newer_ops_still_fires(run_job):
    job = run_job(OUTLIVED, world_size=2, hard_exit_s=60, enable=False,
                  env={"FRT_INIT": "0"})
    job.wait_for_dumps([0, 1], 40)
    trace = job.decode(0)
    assert trace.dump_reason is DumpReason.WATCHDOG_TIMEOUT, (trace.dump_reason, job.logs())
    assert "all_reduce" in trace.dump_detail and "seq 2" in trace.dump_detail, trace.dump_detail
    e = trace.entries
    assert len(e) == 16  # the ring itself holds only the newest 16 (all on the side group)


SET_TIMEOUT = r"""
import warnings
import torch.distributed.distributed_c10d as c10d
with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)  # torch warns where it changes nothing
    # 2.15: dist.set_timeout (_set_pg_timeout is its deprecated name); 2.13: only this
    getattr(dist, "set_timeout", c10d._set_pg_timeout)(timedelta(seconds=1))
t = torch.ones(4)
dist.all_reduce(t)
if rank == 0:
    t0 = time.monotonic()
    try:
        dist.all_reduce(t)  # rank 1 never joins: gloo gives up after the new 1 s, not 60 s
    except RuntimeError:
        print(f"GAVE UP after {time.monotonic() - t0:.1f} s", flush=True)
    os._exit(0)
time.sleep(15)
os._exit(0)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["python", "cxx"])
def test_a_live_groups_timeout_set_through_torch_takes_on_both_paths(run_job, path):
    # dist.breakpoint(timeout_s=...) sets every group's timeout: on 2.13 torch changes
    # only ProcessGroupGloo/NCCL backends, which the native path wraps; on 2.15 the
    # group's setTimeout reaches every backend, ours forwarding it
    job = run_job(SET_TIMEOUT, world_size=2, deadline_s=60.0, hard_exit_s=60, name=path,
                  env={"FRFORENSICS_RECORDER_PATH": path})
    assert job.wait(60) == [0, 0], job.logs()
    log = (job.log_dir / "rank0.log").read_text()
    gave_up = [float(line.split()[3]) for line in log.splitlines() if line.startswith("GAVE UP")]
    assert gave_up and gave_up[0] < 10.0, log
