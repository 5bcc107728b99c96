"""Recovery on torch 2.15: real gloo jobs on CPU that lose a rank and keep training.

Every job: ``init_process_group("gloo", enable_reconfigure=True)``, the recorder on
(watchdog deadline 3 s: past the 2 s heartbeat staleness), the gloo op timeout 5 s (how the survivors leave the
blocked collective, docs/recovery.md), ``recovery.setup()``, then steps of
``all_reduce(member id + 1)`` checked against the sum over the current members.
The verdict is the job's own (the recorder's verdict at hang time, issue 13);
one test takes it from the shared dump directory instead (``verdict_from_dump_dir``).

These need torch >= 2.15 (marker ``reconfigure``: deselected by default, run by
the 2.15 CI stage with ``-m reconfigure``); on older torch they fail, they do not skip.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.reconfigure, pytest.mark.timeout(150)]

BODY = r"""
import json, signal
from frforensics import recovery

SCENARIO = os.environ["FRT_SCENARIO"]
SPARES = int(os.environ.get("FRT_SPARES", "0"))
ACTIVE = world_size - SPARES
dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ["FRT_OP_TIMEOUT_S"])),
                        enable_reconfigure=True)
# "job": the recorder's own verdict at hang time (issue 13, the default);
# "dir": fr-analyze on the shared dump directory (verdict_from_dump_dir).
source = (recovery.verdict_from_dump_dir(DUMP_DIR, world_size=ACTIVE)
          if os.environ["FRT_SOURCE"] == "dir" else None)
if SCENARIO == "second" and rank == 3:
    def source(timeout_s, detail):  # dies once the recovery has begun
        os.kill(os.getpid(), signal.SIGKILL)
opts = recovery.Options(verdict_timeout_s=25, arrival_timeout_s=8, reconfigure_timeout_s=8)
rec = recovery.setup(spares=SPARES, options=opts, source=source)  # the Recovery this job holds
RELEASE = os.path.join(os.path.dirname(DUMP_DIR), "release")

def emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)

step, after, t_fail = 0, 0, None
if rank in rec.spares:
    g = rec.standby(timeout_s=60)
    if not g.reconfigured:
        raise SystemExit(0)  # the job finished without needing this standby
    emit(event="admitted", rank=g.rank, world_size=g.world_size)
    t = torch.zeros(1)
    dist.broadcast(t, 0)  # the step the others are at
    step, after = int(t.item()), 0
tp = None
if SCENARIO == "subgroup":
    pairs = [rec.new_group([0, 1]), rec.new_group([2, 3])]
    tp = pairs[rank // 2]
    tp_members = [[0, 1], [2, 3]][rank // 2]
TOTAL = 5 + 20
while step < TOTAL or (rec.history and after < 20):
    if SCENARIO in ("twice", "spare_twice") and rank == 3 and len(rec.history) == 1 \
            and step == 10:
        os.kill(os.getpid(), signal.SIGSTOP)       # a second host hangs after the recovery
    if rank == 2 and step == 5:
        if SCENARIO in ("stop", "subgroup", "spare", "second", "twice", "spare_twice"):
            os.kill(os.getpid(), signal.SIGSTOP)   # the host freezes: nothing runs in it
        elif SCENARIO == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif SCENARIO == "python":
            time.sleep(60)                          # a bug: busy in the program's own code
    t0 = time.monotonic()
    try:
        with rec.guard() as g:
            x = torch.tensor([float(rank + 1)])
            if step == 5 and t_fail is None:
                t_fail = time.time()
            dist.all_reduce(x)
            expect = float(sum(m + 1 for m in rec.members))
            assert x.item() == expect, (x.item(), expect)
            if tp is not None:
                y = torch.tensor([float(rank + 1)])
                dist.all_reduce(y, group=tp)
                alive = [m for m in tp_members if m in rec.members]
                assert y.item() == float(sum(m + 1 for m in alive)), (y.item(), alive)
    except recovery.RecoveryError as exc:
        emit(event="refused" if isinstance(exc, recovery.RecoveryRefused) else "failed",
             kind=type(exc).__name__, reason=exc.reason,
             verdicts=[v.get("headline", "") for v in exc.verdicts],
             actions=[a.get("action") for v in exc.verdicts for a in v.get("actions", [])],
             seconds=time.monotonic() - t0)
        end = time.monotonic() + 30
        while not os.path.exists(RELEASE) and time.monotonic() < end:
            time.sleep(0.1)   # rank 0 hosts the store: keep it until the test is done
        raise SystemExit(3)
    if g.reconfigured:
        emit(event="reconfigured", rank=g.rank, world_size=g.world_size, excluded=g.excluded,
             recovery_s=g.seconds, since_fail_s=time.time() - t_fail,
             verdict=g.verdict.get("headline", ""),
             actions=[[a.get("rank"), a.get("action")] for a in g.verdict.get("actions", [])])
        t = torch.tensor([float(step)])
        dist.broadcast(t, 0)
        step, after = int(t.item()), 0
        continue
    if rec.history:
        if after == 0:
            emit(event="first_step_after", since_fail_s=time.time() - t_fail)
        after += 1
    step += 1
if SCENARIO == "stop" and rank == 0:
    recorder.dump("api", "after recovery")  # the test reads the group identities in it
emit(event="done", after=after, members=rec.members,
     recoveries=[h["excluded"] for h in rec.history],
     rank=dist.get_rank(), world_size=dist.get_world_size(), group_rank=rec.rank,
     tp_size=tp.size() if tp is not None else None)
rec.close()
end = time.monotonic() + 30
while not os.path.exists(RELEASE) and time.monotonic() < end:
    time.sleep(0.1)   # rank 0 hosts the store: keep it until the test is done
dist.destroy_process_group()  # and a normal exit: every process that finished exits 0
"""


def _results(job: Any, rank: int) -> list[dict[str, Any]]:
    log = job.log_dir / f"rank{rank}.log"
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("RESULT "):
            out.append(json.loads(line[len("RESULT "):]))
    return out


def _event(job: Any, rank: int, name: str) -> dict[str, Any] | None:
    return next((r for r in _results(job, rank) if r["event"] == name), None)


def _wait_events(job: Any, ranks: list[int], name: str, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if all(_event(job, r, name) is not None for r in ranks):
            return
        if any(p.poll() not in (None, 0) for i, p in enumerate(job.procs) if i in ranks):
            break
        time.sleep(0.2)
    missing = [r for r in ranks if _event(job, r, name) is None]
    if missing:
        raise AssertionError(f"ranks {missing} never reported {name!r}\n{job.logs()}")


def _start(run_job: Any, scenario: str, world_size: int = 4, spares: int = 0,
           source: str = "job") -> Any:
    return run_job(BODY, world_size=world_size, deadline_s=3.0, store_poll_s=0.2,
                   hard_exit_s=120.0,
                   env={"FRT_INIT": "0", "FRT_SCENARIO": scenario, "FRT_OP_TIMEOUT_S": "5",
                        "FRT_SPARES": str(spares), "FRT_SOURCE": source},
                   name=scenario)


def _release(job: Any) -> None:
    (Path(job.dump_dir).parent / "release").write_text("")


def _assert_group_of_three(job: Any) -> None:
    for r, new_rank in ((0, 0), (1, 1), (3, 2)):
        rec = _event(job, r, "reconfigured")
        assert rec is not None, job.logs()
        assert rec["excluded"] == [2]
        assert (rec["rank"], rec["world_size"]) == (new_rank, 3)
        assert ["2", "replace_gpu_or_host"] in [[str(a), b] for a, b in rec["actions"]]
        # the op timeout (5 s) + verdict + reconfigure, well inside the bound
        assert rec["since_fail_s"] < 5 + 25
        done = _event(job, r, "done")
        assert done is not None and done["after"] == 20
        assert done["members"] == [0, 1, 3]
        assert (done["rank"], done["world_size"]) == (new_rank, 3)
        assert done["group_rank"] == new_rank  # Recovery.rank agrees with the backend


def _assert_recorder_split_the_group(job: Any) -> None:
    """Ops before the change stay in group 0, ops after it are in 0@r2, seq from 1."""
    trace = job.decode(0)
    by_name = {g.name: (i, g) for i, g in enumerate(trace.groups)}
    assert set(by_name) >= {"0", "0@r2"}, [g.name for g in trace.groups]
    old_i, old = by_name["0"]
    new_i, new = by_name["0@r2"]
    assert old.ranks == (0, 1, 2, 3) and new.ranks == (0, 1, 3)
    assert new.desc == old.desc
    pg, seq = trace.entries.pg, trace.entries.seq
    old_seqs = sorted(int(q) for g, q in zip(pg, seq, strict=True) if g == old_i)
    new_seqs = sorted(int(q) for g, q in zip(pg, seq, strict=True) if g == new_i)
    # 6 steps tried before (5 done, the 6th failed), then the check all_reduce,
    # the step broadcast and 20 steps in the new group, numbered from 1 again.
    assert old_seqs[-1] == 6
    assert new_seqs[0] == 1 and len(new_seqs) == 22
    assert any("members [0, 1, 2, 3] -> [0, 1, 3] (now 0@r2)" in n for n in trace.notes)


@pytest.mark.parametrize("source", [pytest.param("job", marks=pytest.mark.native_rerun), "dir"])
def test_frozen_rank_is_excluded_and_the_other_three_train_on(run_job: Any, source: str) -> None:
    job = _start(run_job, "stop", source=source)
    try:
        _wait_events(job, [0, 1, 3], "done", 90)
        _assert_group_of_three(job)
        _assert_recorder_split_the_group(job)
        # The frozen host comes back: it is told it was excluded and exits.
        os.kill(job.procs[2].pid, signal.SIGCONT)
        assert job.procs[2].wait(timeout=20) == 79, job.logs()
        assert "was excluded from the job" in (job.log_dir / "rank2.log").read_text()
    finally:
        _release(job)
    assert job.wait(30)[0] == 0


@pytest.mark.native_rerun
def test_killed_rank_is_excluded_and_the_other_three_train_on(run_job: Any) -> None:
    job = _start(run_job, "kill")
    try:
        _wait_events(job, [0, 1, 3], "done", 90)
        _assert_group_of_three(job)
        assert job.procs[2].wait(timeout=5) == -signal.SIGKILL
    finally:
        _release(job)


@pytest.mark.native_rerun
def test_standby_joins_and_the_world_stays_four(run_job: Any) -> None:
    job = _start(run_job, "spare", world_size=5, spares=1)
    try:
        _wait_events(job, [0, 1, 3, 4], "done", 90)
        admitted = _event(job, 4, "admitted")
        # the standby takes the excluded rank's place (group rank 2): every
        # survivor keeps its group rank
        assert admitted is not None and (admitted["rank"], admitted["world_size"]) == (2, 4)
        for r in (0, 1, 3, 4):
            done = _event(job, r, "done")
            assert done is not None and done["members"] == [0, 1, 4, 3], job.logs()
            assert done["world_size"] == 4
        for r in (0, 1, 3):
            assert _event(job, r, "done")["after"] == 20  # type: ignore[index]
        os.kill(job.procs[2].pid, signal.SIGCONT)
        assert job.procs[2].wait(timeout=20) == 79, job.logs()
    finally:
        _release(job)


@pytest.mark.native_rerun
def test_a_hang_after_a_standby_took_a_place_names_the_rank_that_hung(run_job: Any) -> None:
    # Rank 2 freezes, the standby (member 4) takes its place; then rank 3 freezes.
    # The standby's default group must carry the members' post-change identity
    # (0@r2): under its old name its ops stood beside the members' ops from before
    # the change, and the second verdict read a deadlock across two groups naming
    # healthy ranks 0, 1 and 4 (a refusal: every member).
    job = _start(run_job, "spare_twice", world_size=5, spares=1)
    try:
        _wait_events(job, [0, 1, 4], "done", 120)
        for r in (0, 1, 4):
            done = _event(job, r, "done")
            assert done is not None and done["members"] == [0, 1, 4], job.logs()
            assert done["recoveries"][-1] == [3] and done["world_size"] == 3
        for r in (0, 1):
            assert _event(job, r, "done")["recoveries"] == [[2], [3]]  # type: ignore[index]
            second = [e for e in _results(job, r) if e["event"] == "reconfigured"][-1]
            assert second["actions"] == [[3, "replace_gpu_or_host"]], second
        for r in (2, 3):
            os.kill(job.procs[r].pid, signal.SIGCONT)
        assert [job.procs[r].wait(timeout=20) for r in (2, 3)] == [79, 79], job.logs()
    finally:
        _release(job)


@pytest.mark.native_rerun
def test_subgroup_with_the_culprit_is_reformed_and_the_other_keeps_working(
        run_job: Any) -> None:
    job = _start(run_job, "subgroup")
    try:
        _wait_events(job, [0, 1, 3], "done", 90)
        _assert_group_of_three(job)
        assert _event(job, 0, "done")["tp_size"] == 2  # type: ignore[index]
        assert _event(job, 1, "done")["tp_size"] == 2  # type: ignore[index]
        assert _event(job, 3, "done")["tp_size"] == 1  # type: ignore[index]
        os.kill(job.procs[2].pid, signal.SIGCONT)
        assert job.procs[2].wait(timeout=20) == 79, job.logs()
    finally:
        _release(job)


def test_rank_busy_in_python_is_a_code_bug_and_nobody_is_excluded(run_job: Any) -> None:
    job = _start(run_job, "python")
    try:
        _wait_events(job, [0, 1, 3], "refused", 90)
        for r in (0, 1, 3):
            ev = _event(job, r, "refused")
            assert ev is not None and ev["kind"] == "RecoveryRefused"
            assert "fix_code" in ev["reason"] and "fix_code" in ev["actions"]
            assert ev["verdicts"] and ev["verdicts"][0]
            assert _event(job, r, "reconfigured") is None
    finally:
        _release(job)
    codes = job.wait(20)
    assert [codes[r] for r in (0, 1, 3)] == [3, 3, 3], job.logs()


def test_second_rank_dying_during_recovery_fails_bounded_with_the_verdicts(
        run_job: Any) -> None:
    job = _start(run_job, "second")
    try:
        _wait_events(job, [0, 1], "failed", 90)
        for r in (0, 1):
            ev = _event(job, r, "failed")
            assert ev is not None and ev["kind"] == "RecoveryFailed", job.logs()
            assert "rank 3" in ev["reason"] and "did not arrive" in ev["reason"]
            # the incident's verdict and the next one (rearm + request_verdict)
            assert len(ev["verdicts"]) == 2 and all(ev["verdicts"])
            assert "dead_rank" in ev["verdicts"][0]
            assert ev["seconds"] < 25 + 8 + 8 + 10
    finally:
        _release(job)


@pytest.mark.native_rerun
def test_a_second_hang_after_recovery_is_recovered_from_too(run_job: Any) -> None:
    job = _start(run_job, "twice")
    try:
        _wait_events(job, [0, 1], "done", 120)
        for r in (0, 1):
            done = _event(job, r, "done")
            assert done is not None and done["members"] == [0, 1], job.logs()
            assert done["recoveries"] == [[2], [3]]
            assert (done["rank"], done["world_size"]) == (r, 2)
            assert done["after"] == 20
        for r in (2, 3):
            os.kill(job.procs[r].pid, signal.SIGCONT)
        assert [job.procs[r].wait(timeout=20) for r in (2, 3)] == [79, 79], job.logs()
    finally:
        _release(job)
