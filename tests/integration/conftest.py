"""Helpers for real multi-process gloo jobs on CPU (one subprocess per rank).

``run_job`` (a fixture) starts a job from a script body and returns a :class:`Job`;
every process it started is killed at the end of the test, whatever happens.
A worker script gets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` and
the prelude below: the recorder enabled (unless ``enable=False``), the default
gloo group initialized, and a hard exit after ``FRT_HARD_EXIT_S`` seconds so no
worker can outlive a test even if the parent dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

PYTHON = sys.executable

PRELUDE = """
import os, sys, threading, time
from datetime import timedelta
import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
world_size = int(os.environ["WORLD_SIZE"])
DUMP_DIR = os.environ["FRT_DUMP_DIR"]
_hard_exit = threading.Timer(float(os.environ["FRT_HARD_EXIT_S"]), lambda: os._exit(99))
_hard_exit.daemon = True
_hard_exit.start()
if os.environ.get("FRT_ENABLE", "1") == "1":
    import frforensics.recorder as recorder
    recorder.enable(
        DUMP_DIR,
        timeout_s=float(os.environ["FRT_DEADLINE_S"]),
        store_poll_interval_s=float(os.environ["FRT_STORE_POLL_S"]),
    )
if os.environ.get("FRT_INIT", "1") == "1":
    dist.init_process_group(
        os.environ.get("FRT_BACKEND", "gloo"),
        timeout=timedelta(seconds=float(os.environ["FRT_GLOO_TIMEOUT_S"])),
    )
"""


def free_port() -> int:
    """A TCP port free right now on localhost."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Job:
    """A running multi-process job and where it writes."""

    procs: list[subprocess.Popen[bytes]]
    dump_dir: Path
    log_dir: Path
    started: float
    world_size: int
    extra: dict[str, Any] = field(default_factory=dict)

    def dump_path(self, rank: int) -> Path:
        return self.dump_dir / f"frdump_rank_{rank}"

    def wait_for_dumps(self, ranks: list[int], timeout_s: float) -> dict[int, float]:
        """Seconds after start at which each rank's dump appeared (missing ranks absent)."""
        seen: dict[int, float] = {}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and len(seen) < len(ranks):
            for r in ranks:
                if r not in seen and self.dump_path(r).exists():
                    seen[r] = time.monotonic() - self.started
            time.sleep(0.05)
        return seen

    def wait(self, timeout_s: float) -> list[int | None]:
        """Exit codes (None for a process still running at the deadline)."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            left = max(0.0, deadline - time.monotonic())
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=left)
        return [p.poll() for p in self.procs]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)

    def logs(self) -> str:
        parts = []
        for f in sorted(self.log_dir.glob("*.log")):
            parts.append(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def decode(self, rank: int) -> Any:
        from frforensics.formats import decode_dump

        path = self.dump_path(rank)
        return decode_dump(path.read_bytes(), source=str(path))


def _interactive_signals() -> None:
    """In the child before exec: SIGINT and SIGQUIT as a job started from a terminal has them.

    A command a non-interactive shell starts in the background (``cmd &``, as a CI
    script or a bench harness may run pytest) inherits SIGINT and SIGQUIT ignored
    (POSIX, "Shell Command Language", asynchronous lists), Python then keeps SIGINT
    ignored instead of installing ``default_int_handler``, and the recorder rightly
    leaves an ignored signal alone. The jobs here model a user's job, so they start
    with the defaults; ``test_an_ignored_sigint_stays_ignored`` covers the other case.
    """
    for sig in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    for key in list(env):
        if key.startswith(("FRFORENSICS_", "TORCHELASTIC_", "FRT_")) or key in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            del env[key]
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "TORCH_CPP_LOG_LEVEL": "ERROR", "GLOO_SOCKET_IFNAME": env.get(
                    "GLOO_SOCKET_IFNAME", "lo")})
    # FRT_RECORDER_PATH=cxx runs every job on the recorder's native path
    # (docs/recorder-native.md: the whole slow lane, one way or the other); else the
    # Python wrapper, never "auto"'s machine-dependent choice (tests/conftest.py)
    env["FRFORENSICS_RECORDER_PATH"] = os.environ.get("FRT_RECORDER_PATH") or "python"
    env.update(extra)
    return env


@pytest.fixture(scope="session", autouse=True)
def _native_path_built() -> None:
    """Under FRT_RECORDER_PATH=cxx the native path must build: a job that fell back
    to the Python wrapper would pass for the wrong reason."""
    if os.environ.get("FRT_RECORDER_PATH") == "cxx":
        from frforensics.recorder import _cxx

        module, why = _cxx.load()
        assert module is not None, f"FRT_RECORDER_PATH=cxx but the native path does not build: {why}"


@pytest.fixture
def run_job(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    """Start jobs; every process is killed when the test ends."""
    jobs: list[Job] = []

    def start(
        body: str,
        *,
        world_size: int = 4,
        deadline_s: float = 2.0,
        store_poll_s: float = 0.2,
        gloo_timeout_s: float = 60.0,
        hard_exit_s: float = 60.0,
        enable: bool = True,
        env: dict[str, str] | None = None,
        name: str = "job",
    ) -> Job:
        root = tmp_path / name
        dump_dir = root / "dumps"
        log_dir = root / "logs"
        dump_dir.mkdir(parents=True)
        log_dir.mkdir(parents=True)
        script = root / "worker.py"
        script.write_text(PRELUDE + "\n" + textwrap.dedent(body))
        port = free_port()
        base = {
            "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "FRT_DUMP_DIR": str(dump_dir), "FRT_DEADLINE_S": str(deadline_s),
            "FRT_STORE_POLL_S": str(store_poll_s), "FRT_GLOO_TIMEOUT_S": str(gloo_timeout_s),
            "FRT_HARD_EXIT_S": str(hard_exit_s), "FRT_ENABLE": "1" if enable else "0",
        }
        base.update(env or {})
        procs = []
        started = time.monotonic()
        for rank in range(world_size):
            log = open(log_dir / f"rank{rank}.log", "wb")  # noqa: SIM115 - child owns it
            procs.append(subprocess.Popen(
                [PYTHON, str(script)], env=_child_env({**base, "RANK": str(rank),
                                                        "LOCAL_RANK": str(rank)}),
                stdout=log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True,
                preexec_fn=_interactive_signals,
            ))
            log.close()
        job = Job(procs, dump_dir, log_dir, started, world_size)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.kill()


@pytest.fixture
def run_torchrun(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    """Start ``python -m torch.distributed.run`` with a script and env vars only."""
    jobs: list[Job] = []

    def start(script_text: str, *, nproc: int = 4, env: dict[str, str] | None = None,
              name: str = "torchrun") -> Job:
        root = tmp_path / name
        dump_dir = root / "dumps"
        log_dir = root / "logs"
        dump_dir.mkdir(parents=True)
        log_dir.mkdir(parents=True)
        script = root / "train.py"
        script.write_text(textwrap.dedent(script_text))
        port = free_port()
        log = open(log_dir / "torchrun.log", "wb")  # noqa: SIM115 - child owns it
        proc = subprocess.Popen(
            [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
             "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
             str(script)],
            env=_child_env({"FRFORENSICS_DUMP_DIR": str(dump_dir), **(env or {})}),
            stdout=log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True,
            preexec_fn=_interactive_signals,
        )
        log.close()
        job = Job([proc], dump_dir, log_dir, time.monotonic(), nproc)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.kill()


@pytest.fixture
def fr_analyze() -> Callable[..., dict[str, Any]]:
    """``fr_analyze(dump_dir)``: the JSON report of ``fr-analyze`` on a dump directory."""
    return analyze


def analyze(dump_dir: Path, *extra: str) -> dict[str, Any]:
    """Run ``fr-analyze DIR --format json`` and parse its report."""
    proc = subprocess.run(
        [PYTHON, "-m", "frforensics", str(dump_dir), "--format", "json", *extra],
        capture_output=True, timeout=120, check=False,
    )
    try:
        report: dict[str, Any] = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(
            f"fr-analyze exit {proc.returncode}, no JSON:\n{proc.stdout[-2000:]!r}\n"
            f"{proc.stderr[-2000:]!r}") from None
    return report
