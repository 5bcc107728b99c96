"""frforensics-run on torch 2.15: real gloo jobs under the launcher lose a rank and go on.

Every job is started the way a user starts it — ``python -m frforensics.run`` with
torchrun's arguments — and its workers run one script: the recorder on (deadline
3 s), ``init_process_group("gloo", enable_reconfigure=True)`` with a 5 s op timeout,
``recovery.setup()``, then steps of ``all_reduce(member id + 1)`` checked against
the sum over the current members. At step 6 the victim is SIGKILLed, SIGSTOPped or
stuck in a sleep; the survivors recover and must train 20 more checked steps.

Marker ``reconfigure``: needs torch >= 2.15 (the CI's 2.15 stage); on older torch
these fail, they do not skip.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import frforensics

pytestmark = [pytest.mark.slow, pytest.mark.reconfigure, pytest.mark.timeout(180)]

WORKER = r'''
import json, os, random, signal, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import frforensics.recorder as recorder
from frforensics import recovery

MODE = os.environ["FRT_MODE"]
VICTIM = int(os.environ.get("FRT_VICTIM", "-1"))
LIVE_S = os.environ.get("FRT_LIVE_S")  # live stragglers feeding recovery.exclude_stragglers
recorder.enable(os.environ["FRT_DUMPS"], timeout_s=3.0, store_poll_interval_s=0.2,
                **({"straggler_interval_s": float(LIVE_S),
                    "on_verdict": recovery.exclude_stragglers(windows=2)} if LIVE_S else {}))
dist.init_process_group("gloo", timeout=timedelta(seconds=5), enable_reconfigure=True)
source = None
if os.environ.get("FRT_VERDICT"):
    hostile = json.loads(os.environ["FRT_VERDICT"])
    def source(timeout_s, detail):
        return hostile
opts = recovery.Options(verdict_timeout_s=25, arrival_timeout_s=8, reconfigure_timeout_s=8,
                        verdict_source=source, **json.loads(os.environ.get("FRT_OPTIONS", "{}")))
st = recovery.setup(options=opts)
me = st.me
victim = me == VICTIM or (os.environ.get("FRT_VICTIM_NODE") == "1"
                          and os.environ["LOCAL_RANK"] == "1")

def emit(**kw):
    print("RESULT " + json.dumps({"me": me, **kw}), flush=True)

step, after = 0, 0
if me in st.spares:
    g = recovery.standby(timeout_s=150)
    if not g.reconfigured:
        raise SystemExit(0)  # the job finished without needing this standby
    emit(event="admitted", rank=g.rank, world_size=g.world_size)
    t = torch.zeros(1)
    dist.broadcast(t, 0)
    step = int(t.item())
rng = random.Random(me)
while after < 20 and not (MODE == "noise" and step >= 150):
    if MODE == "slow":  # the victim is 40 % slower; rank 0 proposes its exclusion at step 8
        time.sleep(0.028 if victim else 0.02)
        if me == 0 and step == 8 and not st.history:
            emit(event="proposed", won=recovery.propose_exclusion([VICTIM], "40 % slower"))
    # The live rule reads the recorder's completion times, polled every 10 ms: lateness
    # under 3 polls (30 ms) is never blamed, so these steps are 100 ms long.
    elif MODE == "slow_live":  # 40 % slower, found by the live straggler rule
        time.sleep(0.14 if victim else 0.1)
    elif MODE == "noise":  # healthy: each rank 40 ms late on ~5 % of its steps (spikes)
        time.sleep(0.1 + (0.04 if rng.random() < 0.05 else 0.0))
    elif victim and step == 6 and not st.history:
        emit(event="victim", mode=MODE, t=time.time())
        if MODE == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif MODE == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(120)
    try:
        with recovery.guard() as g:
            x = torch.tensor([float(me + 1)])
            dist.all_reduce(x)
            expect = float(sum(m + 1 for m in recovery.state().members))
            assert x.item() == expect, (x.item(), expect)
    except recovery.RecoveryError as exc:
        emit(event="gave_up", kind=type(exc).__name__, reason=exc.reason,
             verdicts=[v.get("headline", "") for v in exc.verdicts if isinstance(v, dict)])
        raise SystemExit(3)
    if g.reconfigured:
        emit(event="reconfigured", rank=g.rank, world_size=g.world_size, excluded=g.excluded,
             step=step, failed=g.error is not None,
             verdict=g.verdict.get("headline", ""), evidence=g.verdict.get("evidence", []),
             actions=g.verdict.get("actions", []))
        t = torch.tensor([float(step)])
        dist.broadcast(t, 0)
        step, after = int(t.item()), 0
        continue
    if st.history:
        if after == 0:
            emit(event="first_step_after", t=time.time())
        after += 1
    step += 1
emit(event="done", after=after, step=step, members=recovery.state().members,
     rank=dist.get_rank(), world_size=dist.get_world_size())
st.close()
dist.destroy_process_group()  # and a normal exit: every process that finished exits 0
'''


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    src = str(Path(frforensics.__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FRFORENSICS_", "FRT_"))}
    env["FRFORENSICS_RECORDER_PATH"] = os.environ["FRFORENSICS_RECORDER_PATH"]  # tests/conftest.py
    # PYTHONFAULTHANDLER: a worker that aborts (SIGABRT at exit, issue 28's clean
    # ends) prints every thread's Python stack into the log the assertions show;
    # the exit status stays the signal's.
    env.update(OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join([src, env.get("PYTHONPATH", "")]),
               FRT_DUMPS=str(tmp / "dumps"), PYTHONWARNINGS="ignore",
               PYTHONFAULTHANDLER="1", **extra)
    return env


def _launch(tmp: Path, args: list[str], env: dict[str, str], name: str) -> subprocess.Popen[str]:
    (tmp / "worker.py").write_text(WORKER)
    (tmp / "dumps").mkdir(exist_ok=True)
    log = (tmp / f"{name}.log").open("w")
    return subprocess.Popen([sys.executable, "-m", "frforensics.run", *args,
                             str(tmp / "worker.py")], env=env, stdout=log,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen[str], timeout_s: float) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        # torch's agent starts each worker in a session of its own: SIGTERM lets the
        # agent stop them; whatever is left of the job (this test's worker.py) is
        # killed too, so a failed test leaves no process behind.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(15)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        script = proc.args[-1] if isinstance(proc.args, list) else ""
        if script:
            with contextlib.suppress(OSError):
                subprocess.run(["pkill", "-KILL", "-f", str(script)], check=False)
        proc.wait(10)
        return -9


def _log(tmp: Path, name: str = "agent") -> str:
    return (tmp / f"{name}.log").read_text(errors="replace")


def _events(text: str) -> list[dict[str, Any]]:
    """Every ``RESULT {...}`` in the log: workers share it, so two may share a line."""
    out, decoder, at = [], json.JSONDecoder(), text.find("RESULT {")
    while at >= 0:
        try:
            event, _ = decoder.raw_decode(text, at + len("RESULT "))
            out.append(event)
        except ValueError:
            pass  # cut by another process's line: not an event
        at = text.find("RESULT {", at + 1)
    return out


def _by(text: str, event: str) -> dict[int, dict[str, Any]]:
    return {e["me"]: e for e in _events(text) if e["event"] == event}


def _single(tmp: Path, mode: str, *, spares: int = 0, **extra: str) -> tuple[int, str]:
    args = ["--nproc-per-node", "4", "--standalone", "--monitor-interval", "0.1"]
    if spares:
        args += ["--spares", str(spares)]
    proc = _launch(tmp, args, _env(tmp, FRT_MODE=mode, FRT_VICTIM="3", **extra), "agent")
    code = _finish(proc, 150)
    return code, _log(tmp)


def _assert_three_train_on(text: str, members: list[int], world: int) -> None:
    done, rec = _by(text, "done"), _by(text, "reconfigured")
    for r in (0, 1, 2):
        assert r in rec and rec[r]["excluded"] == [3], text[-6000:]
        assert r in done and done[r]["after"] == 20, text[-6000:]
        assert done[r]["members"] == members and done[r]["world_size"] == world


@pytest.mark.parametrize("mode", ["kill", "stop"])
def test_a_dead_or_frozen_rank_under_frforensics_run_is_excluded_and_three_train_on(
        tmp_path: Path, mode: str) -> None:
    code, text = _single(tmp_path, mode)
    _assert_three_train_on(text, [0, 1, 2], 3)
    rec = _by(text, "reconfigured")[0]
    if mode == "kill":
        # The agent saw the death: its record is the verdict (SIGKILL: replace the host).
        assert "killed by SIGKILL" in rec["verdict"], text[-4000:]
        assert rec["actions"] == [{"rank": 3, "action": "replace_gpu_or_host",
                                   "because": "killed"}]
        assert [(e["rank"], e["signal"]) for e in rec["evidence"]] == [(3, "SIGKILL")]
    else:
        # Frozen: the agent sees nothing, the recorder's verdict names it; the agent
        # then ends the excluded, still-frozen process.
        assert "dead_rank" in rec["verdict"] or "Rank 3" in rec["verdict"], text[-4000:]
        assert "rank 3 was excluded and is still there" in text
    assert "rank 3 exited with code -9 (SIGKILL)" in text
    assert code == 0, text[-6000:]


def test_a_standby_takes_the_dead_ranks_place_and_the_world_stays_four(tmp_path: Path) -> None:
    code, text = _single(tmp_path, "kill", spares=1)
    _assert_three_train_on(text, [0, 1, 2, 4], 4)
    admitted, done = _by(text, "admitted"), _by(text, "done")
    assert admitted[4]["rank"] == 3 and admitted[4]["world_size"] == 4, text[-6000:]
    assert done[4]["after"] == 20 and done[4]["members"] == [0, 1, 2, 4]
    assert done[4]["rank"] == 3
    # the used standby is replaced by a new one, ended with the job
    assert "standby started: member id 4" in text and "standby started: member id 5" in text
    assert code == 0, text[-6000:]


def test_two_agents_keep_the_job_when_a_rank_on_the_second_node_dies(tmp_path: Path) -> None:
    port = _port()
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "frf-two",
              "--monitor-interval", "0.1"]
    first = _launch(tmp_path, common, _env(tmp_path, FRT_MODE="kill"), "node0")
    end = time.monotonic() + 60
    while time.monotonic() < end:  # the first agent hosts the rendezvous store
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.2)
    second = _launch(tmp_path, common, _env(tmp_path, FRT_MODE="kill", FRT_VICTIM_NODE="1"),
                     "node1")
    codes = [_finish(second, 150), _finish(first, 60)]
    texts = [_log(tmp_path, "node0"), _log(tmp_path, "node1")]
    text = "\n".join(texts)
    victim = _by(texts[1], "victim")
    assert len(victim) == 1, text[-6000:]
    dead = next(iter(victim))
    assert f"rank {dead} exited with code -9 (SIGKILL)" in texts[1]
    survivors = sorted({0, 1, 2, 3} - {dead})
    done, rec = _by(text, "done"), _by(text, "reconfigured")
    for r in survivors:
        assert rec[r]["excluded"] == [dead], text[-6000:]
        assert done[r]["after"] == 20 and done[r]["members"] == survivors
    assert codes == [0, 0], text[-6000:]


def _hostile(*actions: Any) -> str:
    return json.dumps({"schema": "frforensics.verdict/1", "status": "hang",
                       "headline": "HANG — hostile", "actions": list(actions)})


@pytest.mark.parametrize(("verdict", "options", "kind", "message"), [
    (_hostile(*[{"rank": r, "action": "replace_gpu_or_host"} for r in range(4)]), "{}",
     "RecoveryRefused", "would exclude every member"),
    (_hostile({"rank": 0, "action": "replace_gpu_or_host"}), '{"store_host": 0}',
     "RecoveryRefused", "rank 0 hosts the c10d store"),
    (_hostile({"rank": 3, "action": "replace_gpu_or_host"}), '{"max_exclusions": 0}',
     "RecoveryRefused", "more than max_exclusions=0"),
    (_hostile({"rank": "two", "action": "replace_gpu_or_host"}), "{}",
     "RecoveryError", "actions[0].rank is 'two'"),
], ids=["every-member", "store-host", "max-exclusions", "rank-two"])
def test_a_verdict_that_cannot_be_right_is_refused_and_nobody_exits_79(
        tmp_path: Path, verdict: str, options: str, kind: str, message: str) -> None:
    # Rank 3 is stuck in a sleep (alive: the agent sees nothing); the survivors' op
    # times out and the hostile verdict comes from the verdict source.
    code, text = _single(tmp_path, "sleep", FRT_VERDICT=verdict, FRT_OPTIONS=options)
    gave_up = _by(text, "gave_up")
    assert sorted(gave_up) == [0, 1, 2], text[-6000:]
    for ev in gave_up.values():
        assert ev["kind"] == kind and message in ev["reason"], ev
        assert ev["verdicts"] == ["HANG — hostile"]
    assert "exited with code 79" not in text and "was excluded from the job" not in text
    assert not _by(text, "reconfigured")
    # the job fails as torchrun's would: the agent fails it on the survivors' exits
    assert "failing the job as torchrun would" in text
    assert code != 0


def test_a_slow_rank_is_excluded_at_a_step_boundary_and_a_standby_takes_its_place(
        tmp_path: Path) -> None:
    code, text = _single(tmp_path, "slow", spares=1,
                         FRT_OPTIONS='{"plan_check_every": 5}')
    assert _by(text, "proposed")[0]["won"] is True, text[-6000:]
    rec = _by(text, "reconfigured")
    for r in (0, 1, 2):
        assert rec[r]["excluded"] == [3] and rec[r]["failed"] is False, text[-6000:]
        assert rec[r]["verdict"].startswith("PLANNED"), rec[r]
        # at the first check after the proposal (step 8): the check after 10 successful
        # steps, i.e. at the end of step index 9 (which the loop then redoes)
        assert rec[r]["step"] == 9, rec[r]
    assert "] step failed (" not in text  # no step failed, nothing timed out
    _assert_three_train_on(text, [0, 1, 2, 4], 4)
    admitted, done = _by(text, "admitted"), _by(text, "done")
    assert admitted[4]["rank"] == 3 and done[4]["after"] == 20, text[-6000:]
    assert "rank 3 exited with code 79" in text
    assert code == 0, text[-6000:]


LIVE = {"FRT_LIVE_S": "1.0", "FRT_OPTIONS": '{"plan_check_every": 5}'}


def test_a_rank_the_live_straggler_rule_names_in_two_windows_is_excluded_and_replaced(
        tmp_path: Path) -> None:
    # Nobody proposes by hand: the recorder's live straggler rule (every 1 s) names
    # rank 3 (40 % slower) and recovery.exclude_stragglers(windows=2) proposes it after
    # two consecutive windows; the survivors carry it out at a step boundary.
    code, text = _single(tmp_path, "slow_live", spares=1, **LIVE)
    rec = _by(text, "reconfigured")
    for r in (0, 1, 2):
        assert r in rec and rec[r]["excluded"] == [3], text[-6000:]
        assert rec[r]["failed"] is False, rec[r]
        assert rec[r]["verdict"].startswith("PLANNED — straggler in 2 consecutive"), rec[r]
        assert rec[r]["step"] % 5 == 4, rec[r]  # at a planned check, never mid-step
    assert "] step failed (" not in text  # no step failed, nothing timed out
    stragglers = json.loads((tmp_path / "dumps" / "stragglers.json").read_text())
    assert stragglers["culprit_ranks"] == [3], stragglers
    _assert_three_train_on(text, [0, 1, 2, 4], 4)
    admitted, done = _by(text, "admitted"), _by(text, "done")
    assert admitted[4]["rank"] == 3 and done[4]["after"] == 20, text[-6000:]
    assert code == 0, text[-6000:]


def test_a_healthy_job_with_noise_is_never_touched_by_the_live_exclusion(
        tmp_path: Path) -> None:
    code, text = _single(tmp_path, "noise", spares=1, **LIVE)
    done = _by(text, "done")
    assert sorted(r for r in done if r < 4) == [0, 1, 2, 3], text[-6000:]
    assert all(done[r]["step"] == 150 and done[r]["world_size"] == 4 for r in range(4)), done
    assert not _by(text, "reconfigured") and not _by(text, "admitted"), text[-6000:]
    assert not (tmp_path / "dumps" / "stragglers.json").exists()
    # the live rule did run (its windows were written), it found nothing
    assert list((tmp_path / "dumps" / ".frforensics_verdict" / "live").glob("frdump_rank_*"))
    assert code == 0, text[-6000:]
