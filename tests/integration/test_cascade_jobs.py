"""Crash cascades on real 4-rank gloo jobs: the rank that failed first is the culprit,
the ranks that lost it are listed as consequences, the action follows the failure.

One rank dies (``os._exit``, SIGKILL, an uncaught exception; one run under torchrun)
before the all_reduce of step 3; gloo then fails its peers with "Connection closed by
peer" (gloo/transport/tcp/pair.cc). Before the classifier, those peers were
``dead_rank`` culprits and the dead rank only a ``missing_dump`` warning.
"""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.torch215]

DIE = """
import signal
t = torch.ones(4)
for step in range(1, 6):
    if rank == 1 and step == 3:
        {how}
    dist.all_reduce(t)
time.sleep(30)
"""

HOW = {
    "os_exit": "os._exit(1)",
    "sigkill": "os.kill(os.getpid(), signal.SIGKILL)",
    "raise": "raise RuntimeError('bad batch')",
}


def _finding(report, kind):
    found = [f for f in report["findings"] if f["kind"] == kind]
    assert found, report
    return found[0]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("how", "action"), [
    ("os_exit", "replace_gpu_or_host"),
    ("sigkill", "replace_gpu_or_host"),
    ("raise", "fix_code"),
])
def test_the_rank_that_died_is_the_culprit_and_its_peers_are_consequences(
        run_job, fr_analyze, how, action):
    job = run_job(DIE.format(how=HOW[how]), world_size=4, deadline_s=30.0,
                  gloo_timeout_s=30.0, hard_exit_s=90.0)
    job.wait(90)
    seen = job.wait_for_dumps([0, 2, 3], timeout_s=5)
    assert set(seen) == {0, 2, 3}, job.logs()
    report = fr_analyze(job.dump_dir, "--world-size", "4")
    assert report["culprit_ranks"] == [1], report
    assert report["status"] == "hang"
    dead = _finding(report, "dead_rank")
    assert dead["culprit_ranks"] == [1]
    # the peers died of the lost connection (consequences) or still waited for rank 1
    cons = set(dead["evidence"]["died_in_consequence"])
    assert cons and cons <= {0, 2, 3}, dead
    assert cons | set(dead["waiting_ranks"]) == {0, 2, 3}, dead
    assert "failed because rank 1 failed" in dead["message"]
    assert {a["rank"]: a["action"] for a in report["actions"]} == {1: action}, report["actions"]
    if how == "raise":
        assert "worker.py" in (dead["location"] or ""), dead
    # no peer is named anywhere
    for f in report["findings"]:
        assert set(f["culprit_ranks"]) <= {1}, f


TORCHRUN_RAISE = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = int(os.environ["RANK"])
t = torch.ones(4)
for step in range(1, 6):
    if rank == 1 and step == 3:
        raise RuntimeError("bad batch")
    dist.all_reduce(t)
time.sleep(30)
"""


@pytest.mark.timeout(180)
def test_under_torchrun_a_raising_rank_is_the_culprit_not_its_peers(run_torchrun, fr_analyze):
    job = run_torchrun(TORCHRUN_RAISE, nproc=4, env={
        "FRFORENSICS_ENABLE": "1", "FRFORENSICS_TIMEOUT_S": "30",
        "FRFORENSICS_STORE_POLL_INTERVAL_S": "0.2"})
    codes = job.wait(150)
    assert codes[0] not in (None, 0), job.logs()
    assert job.dump_path(1).exists(), job.logs()
    report = fr_analyze(job.dump_dir, "--world-size", "4")
    assert report["culprit_ranks"] == [1], report
    dead = _finding(report, "dead_rank")
    assert "RuntimeError: bad batch" in dead["message"]
    others = {r for r in range(4) if r != 1 and job.dump_path(r).exists()}
    cons = set(dead["evidence"]["died_in_consequence"])
    assert cons and cons <= others, dead
    assert cons | set(dead["waiting_ranks"]) >= others, dead
    assert {a["rank"]: a["action"] for a in report["actions"]} == {1: "fix_code"}
    assert "train.py" in (dead["location"] or ""), dead


NATIVE = """
import signal
c10d = torch._C._distributed_c10d
lock = threading.Lock()
done = []


def dump():
    with lock:
        if done:
            return
        path = os.path.join(DUMP_DIR, f"nccl_trace_rank_{rank}")
        with open(path + ".tmp", "wb") as fh:
            fh.write(c10d._dump_fr_trace())
        os.replace(path + ".tmp", path)
        done.append(1)


t = torch.ones(4)
dist.all_reduce(t)
c10d._dump_fr_trace()
threading.Timer(6.0, dump).start()
try:
    for step in range(1, 6):
        if rank == 1 and step == 3:
            {how}
        dist.all_reduce(t)
    time.sleep(10)
except Exception:
    dump()
    time.sleep(0.5)
    os._exit(1)
time.sleep(10)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("how", "outcomes"), [
    # frozen: every survivor stays stuck in all_reduce #4, unretired
    ("os.kill(os.getpid(), signal.SIGSTOP)", {("hang", (1,))}),
    # dead: gloo fails the survivors at once; while #4 is unretired on any of them
    # when they dump, they stopped there and rank 1 is the culprit (confidence high
    # when on all, medium when on some: a healthy job dumped mid-op reads the same);
    # retired on all of them, nothing stopped there: the plain warning. Which one is
    # a race inside gloo; another rank is never named
    ("os._exit(1)", {("degraded", ()), ("hang", (1,))}),
])
def test_with_pytorchs_own_dumps_the_missing_rank_is_named_where_the_others_stopped(
        run_job, fr_analyze, how, outcomes):
    job = run_job(NATIVE.replace("{how}", how), world_size=4, enable=False, gloo_timeout_s=20.0,
                  hard_exit_s=60.0, env={"TORCH_FR_BUFFER_SIZE": "2000"})
    # the survivors dump at 6 s (the timer) or on their error; a frozen rank 1 never
    # exits, so wait for the three files, not for the job (60 s of CI time)
    deadline = time.monotonic() + 60
    while (time.monotonic() < deadline
           and len([p for p in job.dump_dir.glob("nccl_trace_rank_*")
                    if not p.name.endswith(".tmp")]) < 3):
        time.sleep(0.1)
    job.wait(1.0)
    job.kill()
    dumps = sorted(p.name for p in job.dump_dir.iterdir())
    assert dumps == [f"nccl_trace_rank_{r}" for r in (0, 2, 3)], job.logs()
    report = fr_analyze(job.dump_dir, "--world-size", "4")
    got = (report["status"], tuple(report["culprit_ranks"]))
    assert got in outcomes, report
    md = [f for f in report["findings"] if f["kind"] == "missing_dump"]
    assert md, report
    if got[1]:
        assert md[0]["severity"] == "error" and md[0]["op"] == "all_reduce"
        assert md[0]["evidence"]["confidence"] in ("high", "medium"), md[0]
    else:
        # #4 retired on every survivor: the plain warning
        assert md[0]["evidence"].get("ranks") == [1], md[0]
