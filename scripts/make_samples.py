#!/usr/bin/env python3
"""Produce ``sample_dumps/``: real 4-rank gloo jobs on CPU, one per failure kind.

Usage::

    .venv/bin/python scripts/make_samples.py [--out sample_dumps] [KIND ...]

Each scenario starts four processes (this script with ``--worker KIND``), with
the frforensics recorder enabled (2 s watchdog deadline, 0.2 s store poll) and a
gloo group, and injects one fault at step 3. Every rank's recorder dump lands in
``<out>/<kind>/frdump/frdump_rank_<r>``. Each rank also saves PyTorch's own
flight-recorder dump, unmodified (``torch._C._distributed_c10d._dump_fr_trace()``
with ``TORCH_FR_BUFFER_SIZE=2000``), to ``<out>/<kind>/native/nccl_trace_rank_<r>``
as soon as its recorder dump exists (a daemon thread: the main thread may be
blocked in gloo). Everything is bounded: a worker leaves with ``os._exit`` after
``HARD_EXIT_S``, the parent kills what is left once the dumps are in, or after
``SCENARIO_DEADLINE_S``.

The expected verdicts (``<out>/<kind>/expected.json``) are written by hand from
what the scenario bodies below do; this script never writes them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

WORLD_SIZE = 4
DEADLINE_S = 2.0  # recorder watchdog deadline
STORE_POLL_S = 0.2
GLOO_TIMEOUT_S = 30.0
HARD_EXIT_S = 25.0
SCENARIO_DEADLINE_S = 60.0
FAULT_STEP = 3

KINDS = (
    "healthy", "missing_rank", "op_mismatch", "size_mismatch", "dtype_mismatch", "timeout",
    "dead_rank", "p2p_deadlock", "cross_pg_deadlock", "straggler", "missing_dump",
)

# Per scenario: (gloo timeout s, ranks expected to leave a dump).
SETTINGS: dict[str, tuple[float, tuple[int, ...]]] = {
    "timeout": (3.0, (0, 1, 2, 3)),
    # gloo aborts rank 3 (C++ terminate: "Received data size doesn't match expected
    # size") when rank 0's float64 data arrives: it never writes a dump.
    "dtype_mismatch": (GLOO_TIMEOUT_S, (0, 1, 2)),
    # rank 2 writes its dumps where nobody collects them (its node's local disk)
    "missing_dump": (GLOO_TIMEOUT_S, (0, 1, 3)),
}

# Per scenario: ranks whose dump directory is not the collected one.
UNCOLLECTED: dict[str, tuple[int, ...]] = {"missing_dump": (2,)}

# PyTorch's recorder cannot produce a usable native set for these (see their README).
NO_NATIVE = frozenset({"dead_rank"})

# --------------------------------------------------------------------------- worker side
# Everything below runs inside one rank. Module-level names keep the code
# locations in the dumps readable (scripts/make_samples.py:LINE in <function>).

rank = -1


def step_all_reduce(t):  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    dist.all_reduce(t)


def healthy(dist, torch):  # type: ignore[no-untyped-def]
    t = torch.ones(4)
    for _ in range(1, 11):
        step_all_reduce(t)
    dist.barrier()
    finish_with_api_dump()


def missing_rank(dist, torch):  # type: ignore[no-untyped-def]
    t = torch.ones(4)
    for step in range(1, 6):
        if rank == 2 and step == FAULT_STEP:
            continue  # rank 2 skips the all_reduce of step 3 ...
        step_all_reduce(t)
    idle()  # ... so it finishes its loop one all_reduce early and idles


def op_mismatch(dist, torch):  # type: ignore[no-untyped-def]
    t = torch.ones(4)
    for step in range(1, 6):
        if rank == 1 and step == FAULT_STEP:
            out = [torch.zeros(4) for _ in range(WORLD_SIZE)]
            dist.all_gather(out, t)  # rank 1 all_gathers where the others all_reduce
        else:
            step_all_reduce(t)
    idle()


def size_mismatch(dist, torch):  # type: ignore[no-untyped-def]
    t = torch.ones(4)
    for step in range(1, 6):
        if rank == 3 and step == FAULT_STEP:
            step_all_reduce(torch.ones(7))  # rank 3 reduces 7 elements, the others 4
        else:
            step_all_reduce(t)
    idle()


def dtype_mismatch(dist, torch):  # type: ignore[no-untyped-def]
    t = torch.ones(4)
    for step in range(1, 6):
        if rank == 0 and step == FAULT_STEP:
            step_all_reduce(torch.ones(4, dtype=torch.float64))  # rank 0: float64
        else:
            step_all_reduce(t)
    idle()


def timeout(dist, torch):  # type: ignore[no-untyped-def]
    # gloo timeout 3 s, recorder deadline 2 s would fire first, so the recorder
    # deadline is raised to 20 s for this scenario: the backend gives up first,
    # the training loop catches the error and asks the recorder for a dump.
    import frforensics.recorder as recorder

    t = torch.ones(4)
    for step in range(1, 6):
        if rank == 1 and step == FAULT_STEP:
            time.sleep(5.0)  # rank 1 arrives 5 s late, past the 3 s timeout
        try:
            step_all_reduce(t)
        except RuntimeError as exc:
            recorder.dump("api", f"caught: {str(exc)[:200]}")
            idle()
            return


def dead_rank(dist, torch):  # type: ignore[no-untyped-def]
    t = torch.ones(4)
    for step in range(1, 6):
        if rank == 1 and step == FAULT_STEP:
            compute_loss()
        step_all_reduce(t)
    idle()


def compute_loss() -> None:
    raise ValueError("loss is NaN")  # uncaught: rank 1's main thread dies here


def p2p_deadlock(dist, torch):  # type: ignore[no-untyped-def]
    t = torch.ones(4)
    for step in range(1, 6):
        if rank in (0, 1):
            peer = 1 - rank
            if rank == 0 and step != FAULT_STEP:
                dist.send(t, peer)
                dist.recv(t, peer)
            elif rank == 0:
                dist.recv(t, peer)  # step 3: rank 0 receives first, as rank 1 does
                dist.send(t, peer)
            else:
                dist.recv(t, peer)
                dist.send(t, peer)
        step_all_reduce(t)
    idle()


def cross_pg_deadlock(dist, torch):  # type: ignore[no-untyped-def]
    pair = dist.new_group([0, 1])
    t = torch.ones(4)
    for step in range(1, 6):
        if rank == 1 and step == FAULT_STEP:
            dist.all_reduce(t, group=pair)  # rank 1: pair first, then default
            step_all_reduce(t)
        else:
            step_all_reduce(t)  # everyone else: default first, then pair
            if rank in (0, 1):
                dist.all_reduce(t, group=pair)
    idle()


def straggler(dist, torch):  # type: ignore[no-untyped-def]
    t = torch.ones(4)
    for _ in range(1, 11):
        if rank == 3:
            time.sleep(0.3)  # rank 3 is 0.3 s late to every step
        step_all_reduce(t)
    dist.barrier()
    finish_with_api_dump()


def missing_dump(dist, torch):  # type: ignore[no-untyped-def]
    # a healthy run (as ``healthy``); only rank 2's dumps are never collected: its
    # dump directory (SAMPLE_DUMP_DIR) is its node's local disk, not the shared one
    t = torch.ones(4)
    for _ in range(1, 11):
        step_all_reduce(t)
    dist.barrier()
    finish_with_api_dump()


def idle() -> None:
    """Stay alive, outside any collective, until the parent stops the job."""
    time.sleep(HARD_EXIT_S)


def finish_with_api_dump() -> None:
    import frforensics.recorder as recorder

    recorder.dump("api", "end of run")
    time.sleep(1.0)  # the native copy is written by the watcher thread


def _save_native_when_dumped(dump_dir: Path, native_dir: Path) -> None:
    """PyTorch's own dump, unmodified, once this rank's recorder dump exists."""
    import torch

    ours = dump_dir / f"frdump_rank_{rank}"
    while not ours.exists():
        time.sleep(0.05)
    data = torch._C._distributed_c10d._dump_fr_trace()
    native_dir.mkdir(parents=True, exist_ok=True)
    tmp = native_dir / f".nccl_trace_rank_{rank}.tmp"
    tmp.write_bytes(bytes(data))
    os.replace(tmp, native_dir / f"nccl_trace_rank_{rank}")


def worker(kind: str) -> None:
    global rank
    rank = int(os.environ["RANK"])
    hard = threading.Timer(HARD_EXIT_S, lambda: os._exit(0))
    # In dead_rank the process must really end when its main thread dies (as a
    # training script does); elsewhere the timer only bounds the worker's life.
    hard.daemon = kind == "dead_rank"
    hard.start()
    dump_dir = Path(os.environ["SAMPLE_DUMP_DIR"])
    dump_dir.mkdir(parents=True, exist_ok=True)
    import torch
    import torch.distributed as dist

    import frforensics.recorder as recorder

    recorder.enable(dump_dir, timeout_s=float(os.environ["SAMPLE_DEADLINE_S"]),
                    store_poll_interval_s=STORE_POLL_S, save_native=False)
    dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ["SAMPLE_GLOO_S"])))
    threading.Thread(target=_save_native_when_dumped,
                     args=(dump_dir, Path(os.environ["SAMPLE_NATIVE_DIR"])), daemon=True).start()
    globals()[kind](dist, torch)


# --------------------------------------------------------------------------- parent side


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_scenario(kind: str, out: Path) -> bool:
    """Run one scenario; True when every expected rank left both dumps."""
    gloo_s, dumping = SETTINGS.get(kind, (GLOO_TIMEOUT_S, (0, 1, 2, 3)))
    deadline_s = 20.0 if kind == "timeout" else DEADLINE_S
    target = out / kind
    with tempfile.TemporaryDirectory(prefix=f"frsample-{kind}-") as tmp:
        dump_dir = Path(tmp) / "dumps"
        native_dir = Path(tmp) / "native"
        dump_dir.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FRFORENSICS_", "TORCH_"))}
        env.update({"WORLD_SIZE": str(WORLD_SIZE), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1",
                    "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_CPP_LOG_LEVEL": "ERROR",
                    "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"),
                    "SAMPLE_DUMP_DIR": str(dump_dir), "SAMPLE_NATIVE_DIR": str(native_dir),
                    "SAMPLE_DEADLINE_S": str(deadline_s), "SAMPLE_GLOO_S": str(gloo_s),
                    "PYTHONUNBUFFERED": "1"})
        procs = []
        logs = []
        local = Path(tmp) / "uncollected"
        for r in range(WORLD_SIZE):
            log = open(Path(tmp) / f"rank{r}.log", "wb")  # noqa: SIM115 - closed below
            logs.append(log)
            dirs = {}
            if r in UNCOLLECTED.get(kind, ()):
                dirs = {"SAMPLE_DUMP_DIR": str(local / "dumps"),
                        "SAMPLE_NATIVE_DIR": str(local / "native")}
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", kind],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r), **dirs}, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True))
        started = time.monotonic()
        want = [dump_dir / f"frdump_rank_{r}" for r in dumping]
        natives = [native_dir / f"nccl_trace_rank_{r}" for r in dumping]
        ok = False
        try:
            while time.monotonic() - started < SCENARIO_DEADLINE_S:
                if all(p.exists() for p in want):
                    ok = True
                    break
                time.sleep(0.1)
            # A rank that is dying may not live to save PyTorch's dump: wait a little.
            until = time.monotonic() + 20.0
            while ok and time.monotonic() < until and not all(p.exists() for p in natives):
                time.sleep(0.1)
            time.sleep(0.5)
        finally:
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
            for log in logs:
                log.close()
        if not ok:
            print(f"{kind}: dumps missing after {SCENARIO_DEADLINE_S:g} s", file=sys.stderr)
            for f in sorted(Path(tmp).glob("rank*.log")):
                print(f"--- {f.name}\n{f.read_text(errors='replace')[-2000:]}", file=sys.stderr)
            return False
        for sub in ("frdump", "native"):
            shutil.rmtree(target / sub, ignore_errors=True)
        shutil.copytree(dump_dir, target / "frdump",
                        ignore=shutil.ignore_patterns(".*"))
        if native_dir.exists() and kind not in NO_NATIVE:
            shutil.copytree(native_dir, target / "native", ignore=shutil.ignore_patterns(".*"))
    print(f"{kind}: ok ({time.monotonic() - started:.1f} s)")
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kinds", nargs="*", choices=[*KINDS, []], metavar="KIND")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent
                        / "sample_dumps")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return 0
    failed = [k for k in (args.kinds or KINDS) if not run_scenario(k, args.out)]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
