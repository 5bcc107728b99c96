#!/usr/bin/env python3
"""Capture PyTorch's *native* flight-recorder dumps from real gloo jobs on CPU.

Usage::

    python scripts/capture_native.py OUTDIR [--scenario NAME ...] [--list]

For each scenario this runs a real multi-process ``gloo`` job (world size 4,
one subprocess per rank, rendezvous through a ``FileStore`` in a temporary
directory) with ``TORCH_FR_BUFFER_SIZE`` set and a short gloo timeout, injects
one fault, and has every rank write PyTorch's own dumps:

* ``OUTDIR/<scenario>/pickle/nccl_trace_rank_<rank>`` from
  ``torch._C._distributed_c10d._dump_fr_trace()`` (pickle bytes), and
* ``OUTDIR/<scenario>/json/nccl_trace_rank_<rank>.json`` from
  ``torch._C._distributed_c10d._dump_fr_trace_json()``.

gloo has no dumping watchdog, and a main thread blocked in ``work.wait()``
cannot dump, so each rank starts a daemon thread that dumps after a fixed delay
measured from the start of its step loop, while the main thread is (possibly)
blocked. A rank that raises dumps from its ``except`` handler if the thread
has not dumped yet. ``OUTDIR/<scenario>/run.json`` records what each rank did
(timings, exceptions, exit codes), which is the ground truth behind the
hand-written ``EXPECTED.md`` / ``expected.json`` of the test data.
Everything is bounded: workers leave with ``os._exit`` after a per-scenario
deadline, and the parent kills any worker still alive after its own deadline.
Only torch and the standard library are used.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WORLD_SIZE = 4
GLOO_TIMEOUT_S = 6.0


@dataclass(frozen=True)
class Scenario:
    """How one job runs and when its ranks dump."""

    name: str
    description: str
    buffer_size: int = 2000
    world_size: int = WORLD_SIZE
    dump_delay_s: float | None = 3.0  # None: dump at the end, from the main thread
    linger_s: float = 9.0  # no rank exits before t0 + linger (peers time out first)
    deadline_s: float = 40.0  # parent kills workers still alive after this
    dump_on_error: bool = False  # a rank that raises before the timer dumps at once


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario("healthy", "all ranks run 10 steps; dump at the end", dump_delay_s=None, linger_s=0.0),
        Scenario("missing_rank", "rank 2 skips the all_reduce of step 5, then idles"),
        Scenario("op_mismatch", "step 5: rank 1 calls all_gather where the others call all_reduce"),
        Scenario("size_mismatch", "step 5: rank 3 all_reduces 7 elements where the others use 4"),
        Scenario(
            "dtype_mismatch",
            "step 5: rank 0 all_reduces float64 where the others use float32",
            dump_on_error=True,
        ),
        Scenario(
            "timeout",
            "step 5: rank 1 sleeps 8 s (> 6 s timeout) before its all_reduce; dumps at 10 s, "
            "after rank 1 entered and the others timed out",
            dump_delay_s=10.0,
            linger_s=12.0,
        ),
        Scenario(
            "timeout_early_dump",
            "step 5: rank 1 sleeps 8 s (> 6 s timeout) before its all_reduce; dumps at 3 s, "
            "while rank 1 still sleeps",
        ),
        Scenario(
            "straggler",
            "rank 1 sleeps 0.3 s before every step (no fault); 8 steps; dump at the end",
            dump_delay_s=None,
            linger_s=0.0,
        ),
        Scenario(
            "new_group",
            "groups [0,1] and [2,3] plus default; step 5: rank 3 skips its subgroup all_reduce "
            "and goes on to the default-group all_reduce",
        ),
        Scenario(
            "cross_group",
            "A=default [0-3], B=new_group([0,1]); step 5: rank 0 issues A then B, rank 1 B then A",
        ),
        Scenario(
            "p2p",
            "send/recv ring each step (0->1, 2->3); step 5: rank 0 skips its send, rank 1 waits in "
            "recv from 0, ranks 0,2,3 go on to the next all_reduce",
        ),
        Scenario(
            "small_ring",
            "TORCH_FR_BUFFER_SIZE=16, 50 steps of one all_reduce; rank 2 skips the last one",
            buffer_size=16,
        ),
    ]
}


# --------------------------------------------------------------------------- worker


class Worker:
    """One rank of one scenario (runs in its own subprocess)."""

    def __init__(self, scenario: Scenario, rank: int, store_path: str, outdir: str) -> None:
        self.sc = scenario
        self.rank = rank
        self.world = scenario.world_size
        self.store_path = store_path
        self.outdir = outdir
        self.t0 = time.monotonic()
        self.events: list[dict[str, Any]] = []
        self.dump_lock = threading.Lock()
        self.dumped = threading.Event()
        self.dump_info: dict[str, Any] = {}

    # -- bookkeeping
    def log(self, msg: str, **extra: Any) -> None:
        ev = {"t_s": round(time.monotonic() - self.t0, 3), "thread": threading.current_thread().name, "msg": msg}
        ev.update(extra)
        self.events.append(ev)
        print(f"[{self.sc.name} r{self.rank} {ev['t_s']:7.3f}s] {msg}", file=sys.stderr, flush=True)

    def dump(self, why: str) -> None:
        """Write PyTorch's own dumps once (first caller wins)."""
        import torch

        c10d = torch._C._distributed_c10d
        with self.dump_lock:
            if self.dumped.is_set():
                return
            pk = c10d._dump_fr_trace()
            js = c10d._dump_fr_trace_json()
            pdir = os.path.join(self.outdir, "pickle")
            jdir = os.path.join(self.outdir, "json")
            os.makedirs(pdir, exist_ok=True)
            os.makedirs(jdir, exist_ok=True)
            for path, data in (
                (os.path.join(pdir, f"nccl_trace_rank_{self.rank}"), pk),
                (os.path.join(jdir, f"nccl_trace_rank_{self.rank}.json"), js),
            ):
                tmp = path + ".tmp"
                with open(tmp, "wb") as fh:
                    fh.write(data if isinstance(data, bytes) else data.encode())
                os.replace(tmp, path)
            self.dump_info = {"why": why, "t_s": round(time.monotonic() - self.t0, 3), "time_ns": time.time_ns()}
            self.dumped.set()
        self.log(f"dumped ({why})", pickle_bytes=len(pk), json_bytes=len(js))

    def _dump_later(self, delay: float) -> None:
        remaining = self.t0 + delay - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        try:
            self.dump(f"timer {delay:g}s")
        except Exception as exc:  # never let the thread die silently
            self.log(f"dump failed: {exc!r}")

    def idle_until_dumped(self) -> None:
        """A rank that left the job on purpose: stay alive (not in a collective) until dumped."""
        self.log("idle (not in any collective)")
        self.dumped.wait(timeout=self.sc.linger_s + 5)

    # -- main
    def run(self) -> int:
        import datetime

        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"file://{self.store_path}",
            rank=self.rank,
            world_size=self.world,
            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S),
        )
        body: Callable[[], None] = getattr(self, "scenario_" + self.sc.name)
        # The first pickle dump holding an entry pays a one-off cost (~1 s, 2-3 s
        # with 4 ranks on 2 cores: stack symbolization set-up); pay it before the
        # step loop so the timed dump is prompt. This is why every dump starts
        # with a gloo:barrier entry (collective_seq_id 1).
        import torch

        dist.barrier()
        warm = time.monotonic()
        torch._C._distributed_c10d._dump_fr_trace()
        self.log(f"warm-up dump took {time.monotonic() - warm:.2f} s (discarded)")
        self.t0 = time.monotonic()
        self.log("step loop begins")
        if self.sc.dump_delay_s is not None:
            threading.Thread(
                target=self._dump_later, args=(self.sc.dump_delay_s,), name="fr-dumper", daemon=True
            ).start()
        rc = 0
        try:
            body()
            self.log("steps finished")
        except Exception as exc:
            rc = 3
            self.log(f"exception {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                     exc_type=type(exc).__name__, exc=str(exc)[:2000])
            if self.sc.dump_on_error and not self.dumped.is_set():
                # a crash before the timer (dtype mismatch): dump now, from the handler
                self.dump("except handler")
        if self.sc.dump_delay_s is None:
            self.dump("end of steps")
        # nobody leaves before its dump and before the linger time (so peers
        # time out on their own instead of seeing a closed connection)
        self.dumped.wait(timeout=max(0.0, self.t0 + (self.sc.dump_delay_s or 0) + 2 - time.monotonic()))
        rest = self.t0 + self.sc.linger_s - time.monotonic()
        if rest > 0:
            time.sleep(rest)
        self.log("exit", rc=rc)
        return rc

    # -- the training-like step and the scenarios
    def train_step(self, step: int, grad_numel: int = 4, dtype: Any = None, op: str = "all_reduce") -> None:
        """A training-like step: all_reduce grads, broadcast a param, all_gather a metric."""
        import torch
        import torch.distributed as dist

        dtype = dtype or torch.float32
        grad = torch.full((grad_numel,), float(self.rank + step), dtype=dtype)
        if op == "all_reduce":
            dist.all_reduce(grad)
        elif op == "all_gather":
            out = [torch.empty_like(grad) for _ in range(self.world)]
            dist.all_gather(out, grad)
        elif op == "skip":
            return
        param = torch.zeros(3)
        dist.broadcast(param, src=0)
        metric = torch.tensor([float(self.rank)])
        gathered = [torch.empty(1) for _ in range(self.world)]
        dist.all_gather(gathered, metric)

    def scenario_healthy(self) -> None:
        for step in range(10):
            self.train_step(step)

    def scenario_missing_rank(self) -> None:
        for step in range(10):
            if step == 5 and self.rank == 2:
                self.log("skipping the all_reduce of step 5 and leaving the loop")
                self.idle_until_dumped()
                return
            self.train_step(step)

    def scenario_op_mismatch(self) -> None:
        for step in range(10):
            op = "all_gather" if (step == 5 and self.rank == 1) else "all_reduce"
            if step == 5:
                self.log(f"step 5 issues {op}")
            self.train_step(step, op=op)

    def scenario_size_mismatch(self) -> None:
        for step in range(10):
            numel = 7 if (step == 5 and self.rank == 3) else 4
            if step == 5:
                self.log(f"step 5 all_reduce numel={numel}")
            self.train_step(step, grad_numel=numel)

    def scenario_dtype_mismatch(self) -> None:
        import torch

        for step in range(10):
            dtype = torch.float64 if (step == 5 and self.rank == 0) else torch.float32
            if step == 5:
                self.log(f"step 5 all_reduce dtype={dtype}")
            self.train_step(step, dtype=dtype)

    def _sleepy(self) -> None:
        for step in range(10):
            if step == 5 and self.rank == 1:
                self.log("sleeping 8 s in Python before the all_reduce of step 5")
                time.sleep(8.0)
                self.log("woke up, entering the all_reduce of step 5")
            self.train_step(step)

    def scenario_timeout(self) -> None:
        self._sleepy()

    def scenario_timeout_early_dump(self) -> None:
        self._sleepy()

    def scenario_straggler(self) -> None:
        for step in range(8):
            if self.rank == 1:
                time.sleep(0.3)
            self.train_step(step)

    def scenario_new_group(self) -> None:
        import torch
        import torch.distributed as dist

        g01 = dist.new_group([0, 1])
        g23 = dist.new_group([2, 3])
        mine = g01 if self.rank in (0, 1) else g23
        for step in range(10):
            self.train_step(step)
            local = torch.ones(2)
            if step == 5 and self.rank == 3:
                self.log("skipping the subgroup [2,3] all_reduce of step 5")
            else:
                dist.all_reduce(local, group=mine)
        # a final default-group op: ranks 0,1,3 reach it, rank 2 is stuck in [2,3]
        dist.all_reduce(torch.ones(1))

    def scenario_cross_group(self) -> None:
        import torch
        import torch.distributed as dist

        gb = dist.new_group([0, 1])
        for step in range(10):
            self.train_step(step)
            a = torch.ones(2)
            b = torch.ones(2)
            if self.rank in (0, 1):
                if step == 5 and self.rank == 1:
                    self.log("step 5: issuing B ([0,1]) before A (default)")
                    dist.all_reduce(b, group=gb)
                    dist.all_reduce(a)
                else:
                    dist.all_reduce(a)
                    dist.all_reduce(b, group=gb)
            else:
                dist.all_reduce(a)

    def scenario_p2p(self) -> None:
        import torch
        import torch.distributed as dist

        for step in range(10):
            self.train_step(step)
            buf = torch.full((2,), float(step))
            if self.rank in (0, 2):
                if step == 5 and self.rank == 0:
                    self.log("step 5: skipping the send to rank 1")
                else:
                    dist.send(buf, dst=self.rank + 1)
            else:
                if step == 5 and self.rank == 1:
                    self.log("step 5: recv from rank 0 (no matching send)")
                dist.recv(buf, src=self.rank - 1)

    def scenario_small_ring(self) -> None:
        import torch
        import torch.distributed as dist

        for step in range(50):
            if step == 49 and self.rank == 2:
                self.log("skipping the last all_reduce (step 49)")
                self.idle_until_dumped()
                return
            dist.all_reduce(torch.full((2,), float(step)))


def worker_main(name: str, rank: int, store_path: str, outdir: str) -> None:
    sc = SCENARIOS[name]
    w = Worker(sc, rank, store_path, outdir)
    rc = 4
    try:
        rc = w.run()
    except BaseException as exc:  # report, never hang
        w.log(f"worker failed: {exc!r}", tb=traceback.format_exc()[-2000:])
    finally:
        try:
            with open(os.path.join(outdir, f".events_rank_{rank}.json"), "w") as fh:
                json.dump({"rank": rank, "dump": w.dump_info, "events": w.events}, fh, indent=1)
        finally:
            sys.stderr.flush()
            os._exit(rc)  # skip interpreter/PG teardown, which can block on a broken gloo group


# --------------------------------------------------------------------------- parent


def run_scenario(sc: Scenario, outroot: str) -> dict[str, Any]:
    outdir = os.path.join(outroot, sc.name)
    if os.path.isdir(outdir):
        for sub in ("pickle", "json"):
            shutil.rmtree(os.path.join(outdir, sub), ignore_errors=True)
    os.makedirs(outdir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f"frcap_{sc.name}_")
    store = os.path.join(tmp, "store")
    env = dict(os.environ)
    env["TORCH_FR_BUFFER_SIZE"] = str(sc.buffer_size)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    procs = []
    stderr_other: dict[int, list[str]] = {}
    started = time.monotonic()
    try:
        for rank in range(sc.world_size):
            # the child inherits the file; our handle closes right after the spawn
            with open(os.path.join(tmp, f"stderr_{rank}"), "w") as errf:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, os.path.abspath(__file__), "--worker", sc.name, str(rank), store, outdir],
                        env=env,
                        stderr=errf,
                    )
                )
        codes: dict[int, int | str] = {}
        for rank, p in enumerate(procs):
            left = sc.deadline_s - (time.monotonic() - started)
            try:
                codes[rank] = p.wait(timeout=max(0.1, left))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
                codes[rank] = "killed after deadline"
        for rank in range(sc.world_size):
            # what the worker printed that is not our own event log: C++ aborts
            # (gloo::EnforceNotMet), warnings; also echoed to our stderr
            try:
                with open(os.path.join(tmp, f"stderr_{rank}"), errors="replace") as fh:
                    text = fh.read()
            except OSError:
                text = ""
            sys.stderr.write(text)
            other = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(f"[{sc.name} r")]
            stderr_other[rank] = other[-20:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    ranks = []
    for rank in range(sc.world_size):
        path = os.path.join(outdir, f".events_rank_{rank}.json")
        try:
            with open(path) as fh:
                ranks.append(json.load(fh))
            os.remove(path)
        except OSError:
            ranks.append({"rank": rank, "events": [], "dump": {}})
        ranks[-1]["exit_code"] = codes.get(rank)
        ranks[-1]["stderr_other"] = stderr_other.get(rank, [])
    import torch  # only for the version stamp

    record = {
        "scenario": sc.name,
        "description": sc.description,
        "torch": torch.__version__,
        "world_size": sc.world_size,
        "TORCH_FR_BUFFER_SIZE": sc.buffer_size,
        "gloo_timeout_s": GLOO_TIMEOUT_S,
        "dump_delay_s": sc.dump_delay_s,
        "wall_s": round(time.monotonic() - started, 2),
        "ranks": ranks,
    }
    with open(os.path.join(outdir, "run.json"), "w") as fh:
        json.dump(record, fh, indent=1)
        fh.write("\n")
    return record


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker_main(argv[1], int(argv[2]), argv[3], argv[4])
        return 0  # not reached
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", nargs="?")
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="repeatable; default: all")
    ap.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = ap.parse_args(argv)
    if args.list:
        for sc in SCENARIOS.values():
            print(f"{sc.name:20s} {sc.description}")
        return 0
    if not args.outdir:
        ap.error("OUTDIR is required")
    for name in args.scenario or list(SCENARIOS):
        rec = run_scenario(SCENARIOS[name], args.outdir)
        codes = {r["rank"]: r["exit_code"] for r in rec["ranks"]}
        print(f"{name}: {rec['wall_s']} s, exit codes {codes}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
