"""Teardown: a rank told to stop (SIGTERM from torchrun's agent, SIGINT) leaves a dump,
then ends exactly as it would have; a failed op stays ``failed`` when more ops follow."""

from __future__ import annotations

import signal
import time

import pytest

from frforensics.model import DumpReason, OpState

pytestmark = [pytest.mark.slow, pytest.mark.torch215]

# Rank 0 blocks inside gloo (all_reduce on a group rank 1 never enters): only the
# watchdog thread can see a signal then. Rank 1 sleeps in Python: its handler runs.
BLOCK_AND_SLEEP = """
t = torch.ones(4)
dist.all_reduce(t)
print("ENTERING", flush=True)
if rank == 0:
    dist.all_reduce(t)
else:
    while True:
        time.sleep(0.05)
"""


def _wait_for_logs(job, marker: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        logs = [(job.log_dir / f"rank{r}.log") for r in range(job.world_size)]
        if all(p.exists() and marker in p.read_text(errors="replace") for p in logs):
            return
        time.sleep(0.1)
    raise AssertionError(f"ranks never printed {marker!r}:\n{job.logs()}")


@pytest.mark.timeout(120)
def test_sigterm_dumps_then_the_rank_dies_of_sigterm_blocked_or_not(run_job):
    job = run_job(BLOCK_AND_SLEEP, world_size=2, deadline_s=60.0)
    _wait_for_logs(job, "ENTERING", 60)
    time.sleep(0.5)  # rank 0 is inside gloo's all_reduce now
    for p in job.procs:
        p.send_signal(signal.SIGTERM)
    codes = job.wait(30)
    assert codes == [-signal.SIGTERM, -signal.SIGTERM], job.logs()
    for rank in (0, 1):
        trace = job.decode(rank)
        assert trace.dump_reason is DumpReason.SIGNAL, job.logs()
        assert "SIGTERM" in trace.dump_detail and trace.death is None
    e = job.decode(0).entries
    assert [int(s) for s in e.state] == [int(OpState.COMPLETED), int(OpState.SCHEDULED)]


@pytest.mark.timeout(120)
def test_sigint_on_a_blocked_rank_dumps_at_once_and_leaves_the_rest_to_python(run_job):
    job = run_job(BLOCK_AND_SLEEP, world_size=2, deadline_s=60.0)
    _wait_for_logs(job, "ENTERING", 60)
    time.sleep(0.5)
    sent = time.monotonic() - job.started
    job.procs[0].send_signal(signal.SIGINT)
    # It dumps within a second. A run that saw none at all (twice, 2026-12-04) had
    # pytest started as `cmd &` by a non-interactive shell: the ranks inherited
    # SIGINT ignored (conftest._interactive_signals now starts them with the
    # defaults). The reason below shows it was the signal's dump, not the hang's.
    seen = job.wait_for_dumps([0], timeout_s=15)
    assert 0 in seen, job.logs()
    trace = job.decode(0)
    assert trace.dump_reason is DumpReason.SIGNAL and "SIGINT" in trace.dump_detail, (
        f"dumped {seen[0] - sent:.1f} s after the signal: {trace.dump_reason}")
    # As without the recorder: KeyboardInterrupt waits for the main thread to
    # leave the backend call, so the rank is still blocked in all_reduce.
    assert job.procs[0].poll() is None


IGNORE_SIGINT_THEN_SLEEP = """
import signal
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as `cmd &` in a script leaves it
import frforensics.recorder as recorder
recorder.enable(DUMP_DIR, timeout_s=60.0, store_poll_interval_s=0.2)
dist.init_process_group("gloo")
t = torch.ones(4)
dist.all_reduce(t)
print("ENTERING", flush=True)
while True:
    time.sleep(0.05)
"""


@pytest.mark.timeout(120)
def test_an_ignored_sigint_stays_ignored_and_sigterm_still_dumps(run_job):
    job = run_job(IGNORE_SIGINT_THEN_SLEEP, world_size=2, deadline_s=60.0,
                  env={"FRT_ENABLE": "0", "FRT_INIT": "0"})
    _wait_for_logs(job, "ENTERING", 60)
    job.procs[0].send_signal(signal.SIGINT)
    time.sleep(2.0)  # a dump or a KeyboardInterrupt would come well within this
    assert job.procs[0].poll() is None and not job.dump_path(0).exists(), job.logs()
    job.procs[0].send_signal(signal.SIGTERM)
    assert job.wait_for_dumps([0], timeout_s=30), job.logs()
    assert "SIGTERM" in job.decode(0).dump_detail
    assert job.procs[0].wait(30) == -signal.SIGTERM


TORCHRUN_TEARDOWN = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = int(os.environ["RANK"])
t = torch.ones(4)
dist.all_reduce(t)
pair = dist.new_group([0, 1])
if rank == 2:
    time.sleep(2)
    raise RuntimeError("rank 2 fails")
if rank == 0:
    dist.all_reduce(t, group=pair)  # rank 1 never enters: blocked inside gloo
else:
    while True:
        time.sleep(0.05)
"""


@pytest.mark.timeout(150)
def test_ranks_torchrun_terminates_after_a_failure_leave_dumps(run_torchrun):
    job = run_torchrun(TORCHRUN_TEARDOWN, nproc=3, env={
        "FRFORENSICS_ENABLE": "1", "FRFORENSICS_TIMEOUT_S": "60",
        "FRFORENSICS_STORE_POLL_INTERVAL_S": "0.2"})
    codes = job.wait(120)
    assert codes[0] not in (None, 0), job.logs()
    reasons = {r: job.decode(r).dump_reason for r in range(3) if job.dump_path(r).exists()}
    assert reasons == {0: DumpReason.SIGNAL, 1: DumpReason.SIGNAL,
                       2: DumpReason.EXCEPTION}, job.logs()
    assert "SIGTERM" in job.decode(0).dump_detail


FAIL_THEN_GO_ON = """
t = torch.ones(4)
dist.all_reduce(t)
if rank == 1:
    time.sleep(4)
    os._exit(0)
errors = 0
for _ in range(3):
    try:
        dist.all_reduce(t)  # gloo's 2 s timeout, then a lost peer
    except Exception:
        errors += 1
path = recorder.dump(detail="after the errors")
print("ERRORS", errors, flush=True)
time.sleep(0.5)
os._exit(0)
"""


@pytest.mark.timeout(120)
def test_a_failed_op_followed_by_more_ops_stays_failed(run_job):
    job = run_job(FAIL_THEN_GO_ON, world_size=2, deadline_s=60.0, gloo_timeout_s=2.0)
    job.wait(60)
    assert "ERRORS 3" in (job.log_dir / "rank0.log").read_text(), job.logs()
    e = job.decode(0).entries
    assert [int(s) for s in e.state] == [int(OpState.COMPLETED)] + [int(OpState.FAILED)] * 3


FORKED_CHILD = """
t = torch.ones(4)
dist.all_reduce(t)
pid = os.fork()
if pid == 0:  # a DataLoader-like worker: inherits the recorder, then is terminated
    time.sleep(30)
    os._exit(0)
time.sleep(0.5)
os.kill(pid, signal.SIGTERM)
_, status = os.waitpid(pid, 0)
time.sleep(1.0)  # the parent's watchdog would have acted on a stray wakeup byte by now
dist.all_reduce(t)
print("CHILD", os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM,
      "DUMPS", sorted(os.listdir(DUMP_DIR)), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_a_forked_child_killed_by_sigterm_neither_dumps_nor_kills_its_parent(run_job):
    job = run_job("import signal\n" + FORKED_CHILD, world_size=1, deadline_s=60.0)
    assert job.wait(60) == [0], job.logs()
    log = (job.log_dir / "rank0.log").read_text()
    assert "CHILD True DUMPS []" in log, log
