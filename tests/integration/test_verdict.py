"""The verdict at hang time, in real multi-process gloo jobs (torchrun and plain processes).

Each job hangs on purpose with a 2 s watchdog deadline and a 0.2 s store poll;
the verdict must be in the job's log within ``timeout_s`` + 10 s of the hang,
agree with ``verdict.json`` and the store key, and the hook must run once.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

DEADLINE_S = 2.0
STORE_POLL_S = 0.2
STARTUP_S = 90.0  # up to 8 interpreters importing torch on 2 loaded cores

SKIP_SCRIPT = """
import os, sys, time, threading
from datetime import timedelta
threading.Timer(float(os.environ.get("FRT_HARD_EXIT_S", "150")), lambda: os._exit(99)).start()
import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=90))
rank = dist.get_rank()
t = torch.ones(8)
for step in range(1, 6):
    if rank == int(os.environ["FRT_BAD"]) and step == 3:
        continue  # this rank skips one all_reduce
    if step == 5:
        print(f"rank {rank} enters its last collective at {time.time():.3f}", flush=True)
    dist.all_reduce(t)
time.sleep(120)  # the skipping rank goes on with something else
"""

# Appends the verdict path it is given to <dump dir>/../hook_calls.
HOOK = ("{python} -c \"import sys, os; open(os.path.join(os.path.dirname(os.path.dirname("
        "sys.argv[1])), 'hook_calls'), 'a').write(sys.argv[1] + chr(10))\"")


def _verdict_env(python: str, **extra: str) -> dict[str, str]:
    return {
        "FRFORENSICS_ENABLE": "1",
        "FRFORENSICS_TIMEOUT_S": str(DEADLINE_S),
        "FRFORENSICS_STORE_POLL_INTERVAL_S": str(STORE_POLL_S),
        "FRFORENSICS_ON_VERDICT": HOOK.format(python=python),
        **extra,
    }


def _wait_for(pred: Any, timeout_s: float, what: str, logs: Any) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{logs()}")
        time.sleep(0.2)


POINTER = re.compile(r"frforensics: verdict by rank (\d+) on (\S+): (.*) — culprits \[([\d, ]*)\] "
                     r"\(([^)]*)\) — (\S+) \(store key (\S+)\)")


def _pointers(log: str) -> list[dict[str, Any]]:
    """The verdicts non-elected ranks read from the store (one log line each)."""
    return [{"elected_rank": int(m.group(1)), "headline": m.group(3),
             "culprit_ranks": [int(x) for x in m.group(4).split(",") if x.strip()],
             "actions": m.group(5), "verdict_json": m.group(6), "key": m.group(7)}
            for m in POINTER.finditer(log)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("nproc", "bad"), [(4, 2), (8, 5)])
def test_skipped_collective_gives_one_verdict_in_the_job_log(run_torchrun, nproc, bad):
    import sys

    job = run_torchrun(SKIP_SCRIPT, nproc=nproc, name=f"skip{nproc}",
                       env={"FRT_BAD": str(bad), **_verdict_env(sys.executable)})
    root = job.dump_dir.parent
    log_path = job.log_dir / "torchrun.log"

    def log() -> str:
        return log_path.read_text(errors="replace")

    _wait_for(lambda: log().count("enters its last collective") == nproc, STARTUP_S,
              "every rank in its last collective", job.logs)
    hang_started = time.monotonic()
    _wait_for(lambda: "frforensics: verdict (incident 0" in log(), DEADLINE_S + 10 + 5,
              "the verdict in the job log", job.logs)
    elapsed = time.monotonic() - hang_started
    assert elapsed <= DEADLINE_S + 10, elapsed
    _wait_for(lambda: len(_pointers(log())) == nproc - 1, 10, "one line per other rank",
              job.logs)
    text = log()
    assert text.count("frforensics: verdict (incident 0") == 1, text[-4000:]
    assert re.search(rf"HANG — missing_rank: Rank {bad} never entered all_reduce #5", text), text
    report = json.loads((job.dump_dir / "verdict.json").read_text())
    assert report["culprit_ranks"] == [bad]
    assert report["actions"][0]["rank"] == bad and report["actions"][0]["action"] == "fix_code"
    headline = (job.dump_dir / "verdict.txt").read_text().splitlines()[0]
    for pointer in _pointers(text):  # what every other rank read from the store key
        assert pointer["verdict_json"] == str(job.dump_dir / "verdict.json")
        assert pointer["culprit_ranks"] == report["culprit_ranks"]
        assert pointer["actions"] == f"rank {bad}: fix_code"
        assert pointer["headline"] == headline
        assert pointer["key"] == "frforensics/0/verdict/0"
    # the hook ran exactly once, with the verdict path
    _wait_for(lambda: (root / "hook_calls").exists(), 10, "the hook", job.logs)
    time.sleep(1.0)
    assert (root / "hook_calls").read_text().splitlines() == [str(job.dump_dir / "verdict.json")]


# Plain processes (one per rank, rank 0 hosts the TCPStore): the recorder is enabled
# in the script itself, with a listener that saves the verdict each rank learns.
PRELUDE = """
import json, signal
import frforensics.recorder as recorder

ROOT = os.path.dirname(DUMP_DIR)
MY_DIR = os.path.join(DUMP_DIR, f"rank{rank}") if os.environ.get("FRT_PER_RANK") else DUMP_DIR

def save(verdict):  # atomically: the test polls for the file and reads it at once
    path = os.path.join(ROOT, f"learned_{rank}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(verdict, fh)
    os.replace(path + ".tmp", path)

recorder.add_verdict_listener(save)
recorder.enable(MY_DIR, timeout_s=float(os.environ["FRT_DEADLINE_S"]),
                store_poll_interval_s=float(os.environ["FRT_STORE_POLL_S"]),
                verdict_source=os.environ.get("FRT_SOURCE", "auto"))
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
t = torch.ones(8)
"""

PLAIN = {"FRT_ENABLE": "0", "FRT_INIT": "0"}


def _learned(job: Any, rank: int) -> dict[str, Any] | None:
    path = job.dump_dir.parent / f"learned_{rank}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _wait_learned(job: Any, ranks: list[int], timeout_s: float) -> dict[int, dict[str, Any]]:
    _wait_for(lambda: all(_learned(job, r) is not None for r in ranks), timeout_s,
              f"ranks {ranks} to learn the verdict", job.logs)
    return {r: _learned(job, r) for r in ranks}  # type: ignore[misc]


@pytest.mark.timeout(240)
def test_per_rank_dump_dirs_give_a_verdict_from_store_digests_only(run_job):
    body = PRELUDE + """
for step in range(1, 6):
    if rank == 1 and step == 3:
        continue
    dist.all_reduce(t)
time.sleep(100)
"""
    job = run_job(body, world_size=4, deadline_s=DEADLINE_S, store_poll_s=STORE_POLL_S,
                  hard_exit_s=200, env={**PLAIN, "FRT_PER_RANK": "1"})
    learned = _wait_learned(job, [0, 1, 2, 3], STARTUP_S + DEADLINE_S + 10)
    verdict = learned[0]
    assert all(v == verdict for v in learned.values()), learned
    assert verdict["elected_rank"] == 0
    # every peer's dump lies in a directory the elected rank does not read
    assert verdict["inputs"] == {"files": [0], "digests": [1, 2, 3], "none": [],
                                 "skipped": []}, verdict
    assert verdict["culprit_ranks"] == [1]
    assert verdict["actions"][0]["action"] == "fix_code"
    report = json.loads((job.dump_dir / "rank0" / "verdict.json").read_text())
    assert report["culprit_ranks"] == verdict["culprit_ranks"]
    assert [a["rank"] for a in report["actions"]] == [1]
    assert report["ranks_loaded"] == [0, 1, 2, 3]
    assert not (job.dump_dir / "rank1" / "verdict.json").exists()


@pytest.mark.timeout(240)
def test_store_only_source_reads_no_peer_file(run_job):
    body = PRELUDE + """
for step in range(1, 6):
    if rank == 2 and step == 3:
        continue
    dist.all_reduce(t)
time.sleep(100)
"""
    job = run_job(body, world_size=4, deadline_s=DEADLINE_S, store_poll_s=STORE_POLL_S,
                  hard_exit_s=200, env={**PLAIN, "FRT_SOURCE": "store"})
    learned = _wait_learned(job, [0, 1, 2, 3], STARTUP_S + DEADLINE_S + 10)
    assert learned[0]["inputs"] == {"files": [], "digests": [0, 1, 2, 3], "none": [],
                                    "skipped": []}
    assert learned[0]["culprit_ranks"] == [2]


@pytest.mark.timeout(240)
def test_sigkilled_rank_is_named_dead_and_to_be_replaced(run_job):
    body = PRELUDE + """
for step in range(1, 4):
    dist.all_reduce(t)
if rank == 3:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(t)
time.sleep(100)
"""
    job = run_job(body, world_size=4, deadline_s=DEADLINE_S, store_poll_s=STORE_POLL_S,
                  hard_exit_s=200, env=PLAIN)
    learned = _wait_learned(job, [0], STARTUP_S + 30)
    verdict = learned[0]
    assert verdict["culprit_ranks"][:1] == [3], verdict
    act = verdict["actions"][0]
    assert (act["rank"], act["action"], act["because"]) == (3, "replace_gpu_or_host", "dead_rank")
    assert verdict["elected_rank"] == 0, verdict
    # the elected rank writes its verdict to stderr before it tells its listeners; CI
    # once read an empty rank0.log right after learned_0.json appeared, so the log is
    # polled (bounded) rather than read once
    _wait_for(lambda: "frforensics: verdict (incident 0, elected rank 0"
              in (job.log_dir / "rank0.log").read_text(errors="replace"), 20,
              "rank 0's verdict in its log", job.logs)


@pytest.mark.timeout(240)
def test_op_mismatch_verdict_says_fix_code_and_names_both_code_lines(run_job):
    body = PRELUDE + """
for step in range(1, 4):
    dist.all_reduce(t)
if rank == 1:
    out = [torch.zeros(8) for _ in range(world_size)]
    dist.all_gather(out, t)      # MISMATCH-GATHER
else:
    dist.all_reduce(t)           # MISMATCH-REDUCE
time.sleep(100)
"""
    job = run_job(body, world_size=4, deadline_s=DEADLINE_S, store_poll_s=STORE_POLL_S,
                  hard_exit_s=200, env=PLAIN)
    verdict = _wait_learned(job, [0, 1, 2, 3], STARTUP_S + DEADLINE_S + 10)[0]
    assert verdict["status"] == "desync", verdict
    assert verdict["culprit_ranks"] == [1]
    act = verdict["actions"][0]
    assert (act["rank"], act["action"], act["because"]) == (1, "fix_code", "op_mismatch")
    script = (job.dump_dir.parent / "worker.py").read_text().splitlines()
    gather = next(i for i, line in enumerate(script, 1) if "MISMATCH-GATHER" in line)
    reduce_ = next(i for i, line in enumerate(script, 1) if "MISMATCH-REDUCE" in line)
    assert f"worker.py:{gather}" in verdict["text"] and f"worker.py:{reduce_}" in verdict["text"]
    assert f"worker.py:{gather}" in act["detail"] and f"worker.py:{reduce_}" in act["detail"]


@pytest.mark.timeout(240)
def test_when_the_store_host_dies_the_others_dump_locally_and_say_why_no_verdict(run_job):
    body = PRELUDE + """
for step in range(1, 4):
    dist.all_reduce(t)
if rank == 0:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)   # rank 0's process hosts the TCPStore
dist.all_reduce(t)
time.sleep(100)
"""
    job = run_job(body, world_size=4, deadline_s=DEADLINE_S, store_poll_s=STORE_POLL_S,
                  hard_exit_s=200, env=PLAIN)

    def said_why() -> bool:
        return all("frforensics: no verdict for this hang: " in
                   (job.log_dir / f"rank{r}.log").read_text(errors="replace") for r in (1, 2, 3))

    _wait_for(said_why, STARTUP_S + 40, "ranks 1-3 to say why there is no verdict", job.logs)
    for r in (1, 2, 3):
        assert job.dump_path(r).exists()
        log = (job.log_dir / f"rank{r}.log").read_text(errors="replace")
        assert "c10d store is unreachable" in log, log[-2000:]
    assert not (job.dump_dir / "verdict.json").exists()


@pytest.mark.timeout(300)
def test_abort_after_verdict_exits_every_rank_with_the_documented_code(run_torchrun):
    import sys

    from frforensics.recorder import EXIT_VERDICT

    job = run_torchrun(SKIP_SCRIPT, nproc=4, name="abort",
                       env={"FRT_BAD": "1", "FRFORENSICS_ABORT_AFTER_VERDICT": "1",
                            **_verdict_env(sys.executable)})
    codes = job.wait(STARTUP_S + DEADLINE_S + 30)
    log = (job.log_dir / "torchrun.log").read_text(errors="replace")
    assert codes[0] is not None and codes[0] != 0, log[-3000:]
    # torchrun's error summary lists each failed worker with its exit code
    summary = dict(re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)",
                              log))
    assert summary == {str(r): str(EXIT_VERDICT) for r in range(4)}, log[-3000:]
    assert log.count("exiting with code 75 (abort_after_verdict)") == 4, log[-3000:]


@pytest.mark.timeout(300)
def test_rearm_opens_a_second_incident_with_its_own_verdict(run_job):
    body = PRELUDE + """
def save_k(verdict):
    path = os.path.join(ROOT, f"learned_{rank}_{verdict['incident']}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(verdict, fh)
    os.replace(path + ".tmp", path)

recorder.add_verdict_listener(save_k)
for step in range(1, 5):
    if rank == 2 and step == 3:
        continue                      # incident 0: rank 2 skips one
    dist.all_reduce(t)
if rank == 2:
    assert recorder.wait_verdict(60) is not None
    dist.all_reduce(t)                # ... and catches up once the verdict is out
assert recorder.wait_verdict(60, incident=0)["culprit_ranks"] == [2]
assert recorder.rearm() == 1
dist.all_reduce(t)                    # everyone re-armed and in step again
for step in range(1, 4):
    if rank == 1 and step == 2:
        continue                      # incident 1: rank 1 skips one
    dist.all_reduce(t)
time.sleep(100)
"""
    job = run_job(body, world_size=4, deadline_s=DEADLINE_S, store_poll_s=STORE_POLL_S,
                  hard_exit_s=250, env=PLAIN)
    root = job.dump_dir.parent

    def learned(k: int) -> bool:
        return all((root / f"learned_{r}_{k}.json").exists() for r in range(4))

    _wait_for(lambda: learned(1), STARTUP_S + 60, "both incidents' verdicts", job.logs)
    first = json.loads((root / "learned_0_0.json").read_text())
    second = json.loads((root / "learned_3_1.json").read_text())
    assert (first["incident"], first["culprit_ranks"]) == (0, [2])
    # the rings still hold incident 0 (rank 2 entered #4 late): the new culprit leads
    assert (second["incident"], second["culprit_ranks"][0]) == (1, 1), second
    assert second["actions"][0]["rank"] == 1 and second["actions"][0]["because"] == "missing_rank"
    log0 = (job.log_dir / "rank0.log").read_text()
    assert "frforensics: verdict (incident 1" in log0, log0[-3000:]


STRAGGLE = PRELUDE.replace("verdict_source=", "straggler_interval_s=float(os.environ['FRT_LIVE_S']), "
                                              "verdict_source=") + """
print(f"training starts at {time.time():.3f}", flush=True)
for step in range(int(os.environ["FRT_STEPS"])):
    # every rank works 10 ms per step; the slow one 50 ms: late at every collective
    time.sleep(0.05 if rank == int(os.environ["FRT_SLOW"]) else 0.01)
    dist.all_reduce(t)
dist.barrier()
print(f"training ends at {time.time():.3f}", flush=True)
time.sleep(5)
"""
LIVE_S = 3.0


def _straggler_lines(job: Any) -> list[str]:
    out = []
    for r in range(job.world_size):
        out += [line for line in (job.log_dir / f"rank{r}.log").read_text(errors="replace")
                .splitlines() if "frforensics: straggler:" in line]
    return out


@pytest.mark.timeout(240)
def test_live_straggler_is_named_within_two_intervals(run_job):
    job = run_job(STRAGGLE, world_size=4, deadline_s=30.0, store_poll_s=STORE_POLL_S,
                  hard_exit_s=200, env={**PLAIN, "FRT_LIVE_S": str(LIVE_S), "FRT_STEPS": "400",
                                        "FRT_SLOW": "2"})
    log0 = job.log_dir / "rank0.log"
    _wait_for(lambda: "training starts" in log0.read_text(errors="replace"), STARTUP_S,
              "training", job.logs)
    started = time.monotonic()
    _wait_for(lambda: bool(_straggler_lines(job)), 2 * LIVE_S + 12, "a straggler line",
              job.logs)
    named_after = time.monotonic() - started
    lines = _straggler_lines(job)
    assert len(lines) == 1 and "rank 2 arrives last" in lines[0], lines
    doc = json.loads((job.dump_dir / "stragglers.json").read_text())
    assert doc["culprit_ranks"] == [2]
    assert doc["actions"][0]["action"] == "replace_gpu_or_host"
    # 2 intervals, plus the analysis child's start on this loaded VM
    assert named_after <= 2 * LIVE_S + 12, named_after


@pytest.mark.timeout(240)
def test_a_healthy_job_never_prints_a_straggler_line(run_job):
    job = run_job(STRAGGLE, world_size=4, deadline_s=30.0, store_poll_s=STORE_POLL_S,
                  hard_exit_s=200, env={**PLAIN, "FRT_LIVE_S": str(LIVE_S), "FRT_STEPS": "600",
                                        "FRT_SLOW": "-1"})
    log0 = job.log_dir / "rank0.log"
    _wait_for(lambda: "training ends" in log0.read_text(errors="replace"), STARTUP_S + 40,
              "the end of training", job.logs)
    time.sleep(LIVE_S + 1)
    assert _straggler_lines(job) == [], job.logs()
    assert not (job.dump_dir / "stragglers.json").exists()
    # the live analysis did run: its window files exist
    assert list((job.dump_dir / ".frforensics_verdict" / "live").glob("frdump_rank_*")), job.logs()
