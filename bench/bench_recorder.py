"""Per-op overhead of the recorder and its dump cost (a benchmark, not a test).

    python bench/bench_recorder.py [--ops 20000] [--repeats 5]
    python bench/bench_recorder.py --inprocess [--stack-depth 8]
    python bench/bench_recorder.py [--inprocess] --smoke   # seconds: CI's check that it runs

``--inprocess`` interleaves, in one process, plain gloo and the recorded gloo
group with the recorder's pure-Python stack walk and with the C walk
(``_fastframes``, when built), and the same over a no-op backend; it reports the
main thread's CPU per op and what each adds over its base (docs/recorder.md).

Each configuration runs in its own process (PyTorch reads TORCH_FR_BUFFER_SIZE at
group creation; the recorder is process-wide), interleaved ``--repeats`` times,
and the median per-op time is reported:

* ``gloo``: plain gloo, world size 1, PyTorch's recorder off (TORCH_FR_BUFFER_SIZE=0)
* ``gloo+torch_fr``: the same with PyTorch's built-in recorder on (2000 entries)
* ``gloo+frforensics``: ours on, PyTorch's off
* ``noop``: a no-op backend called directly (no recording) — the floor
* ``noop+frforensics``: the recording wrapper over the no-op backend: our own
  cost without any network or gloo thread hand-off

and the time and size of a dump of a full 2000-entry ring. Ops are issued 8
frames deep (like a training loop). Besides wall time per op, the main thread's
CPU time per op (``time.thread_time_ns``) is reported: on a shared machine it is
far less noisy than wall time, and it is what the recorder adds to the training
thread (the watchdog's own CPU is reported by ``--watchdog``-free design: it
polls only each group's newest op and the ops still running).

``bench_recorder_jobs.py`` supersedes these figures (docs/recorder.md, "Overhead"):
PyTorch's recorder side by side, process and thread CPU, GC accounted, multi-process
jobs, and ours taken apart. Note that this script's ``noop+frforensics`` child runs
no watchdog and lets ``pending`` grow to 4096 entries: young collections then promote
the recorder's entries and full collections of torch's heap land in its window by
chance (the figure swings, 1.5 to 12 µs per op).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

MODES = ["gloo", "gloo+torch_fr", "gloo+frforensics", "noop", "noop+frforensics"]


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _recbench import in_user_code as _in_user_code  # noqa: E402


def _child(mode: str, ops: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dump_dir = tempfile.mkdtemp(prefix="frbench_")
    result: dict[str, Any] = {"mode": mode}
    if mode.startswith("gloo"):
        if "frforensics" in mode:
            import frforensics.recorder as recorder

            recorder.enable(dump_dir, timeout_s=600, save_native=False,
                            recorder_path="python",  # this bench's subject: the wrapper
                            poll_interval_s=float(os.environ.get("BENCH_POLL_S", "0.01")))
        from socket import socket

        with socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
        t = torch.ones(16)
        for _ in range(500):
            dist.all_reduce(t)
        cpu0 = time.thread_time_ns()
        start = time.perf_counter_ns()
        _in_user_code(8, lambda: [dist.all_reduce(t) for _ in range(ops)])
        result["per_op_us"] = (time.perf_counter_ns() - start) / ops / 1e3
        result["cpu_us"] = (time.thread_time_ns() - cpu0) / ops / 1e3
        dist.destroy_process_group()
        return result
    return _noop_child(mode, ops, dump_dir, result)


def _noop_child(mode: str, ops: int, dump_dir: str, result: dict[str, Any]) -> dict[str, Any]:
    """No-op backend: a Python object answering allreduce with a finished work."""
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from frforensics.recorder import _pg
    from frforensics.recorder._core import Recorder, RecorderConfig

    class _Done:
        def is_completed(self) -> bool:
            return True

        def wait(self, timeout: Any = None) -> bool:
            return True

    done = _Done()

    class _Noop:
        def allreduce(self, tensors: Any, opts: Any) -> Any:
            return done

        def name(self) -> str:
            return "noop"

    t = torch.ones(16)
    opts = dist.AllreduceOptions()
    inner = _Noop()
    if mode == "noop":
        call = inner.allreduce
    else:
        rec = Recorder(RecorderConfig(dump_dir=Path(dump_dir)))
        state = rec.new_group(name="0", desc="default_pg", ranks=(0,), backend="noop",
                              timeout_ms=600_000)
        pg = _pg.RecordingProcessGroup(rec, state, 0, 1, {"cpu": inner}, "cpu")
        call = pg.allreduce
        rec.pending.clear()

    def user_code_depth(k: int) -> None:  # a realistic stack: a few user frames deep
        if k:
            return user_code_depth(k - 1)
        for _ in range(ops):
            call([t], opts)
            if mode != "noop" and len(rec.pending) > 4096:
                rec.pending.clear()

    for _ in range(3):
        user_code_depth(8)
    cpu0 = time.thread_time_ns()
    start = time.perf_counter_ns()
    user_code_depth(8)
    result["per_op_us"] = (time.perf_counter_ns() - start) / ops / 1e3
    result["cpu_us"] = (time.thread_time_ns() - cpu0) / ops / 1e3
    if mode == "noop+frforensics":
        from frforensics.formats import frdump
        from frforensics.model import DumpReason
        from frforensics.recorder._dump import build_trace

        assert rec.ring.count >= 2000
        timings = []
        for _ in range(5):
            t0 = time.perf_counter_ns()
            trace = build_trace(rec, DumpReason.API, "bench", None)
            data = frdump.encode(trace)
            frdump.write_atomic(Path(dump_dir) / "frdump_rank_0", data)
            timings.append((time.perf_counter_ns() - t0) / 1e6)
        result["dump_ms"] = statistics.median(timings)
        result["dump_bytes"] = len(data)
        result["dump_entries"] = len(trace.entries)
        t0 = time.perf_counter_ns()
        frdump.decode(data)
        result["decode_ms"] = (time.perf_counter_ns() - t0) / 1e6
    return result


def _inprocess(ops: int, repeats: int, stack_depth: int) -> None:
    """Plain and recorded gloo groups in one process, interleaved (see docs/recorder.md)."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "0")
    from socket import socket

    import torch
    import torch.distributed as dist

    import frforensics.recorder as recorder
    from frforensics.recorder import _c10d, _pg

    recorder.enable(tempfile.mkdtemp(prefix="frbench_"), timeout_s=600, save_native=False,
                    stack_depth=stack_depth, recorder_path="python")
    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    _c10d.uninstall()  # the next group is a plain gloo one
    plain = dist.new_group([0], backend="gloo")
    sess = recorder.session()
    assert sess is not None and sess.watchdog is not None
    rec, watchdog = sess.rec, sess.watchdog
    dog_clock = time.pthread_getcpuclockid(watchdog.ident)
    t = torch.ones(16)

    # The recording wrapper over a no-op backend: our own cost, no gloo.
    class _Done:
        def is_completed(self) -> bool:
            return True

    class _Noop:
        def allreduce(self, tensors: Any, opts: Any) -> Any:
            return done

        def name(self) -> str:
            return "noop"

    done, noop = _Done(), _Noop()
    noop_state = rec.new_group(name="noop", desc="noop", ranks=(0,), backend="noop",
                               timeout_ms=600_000)
    noop_pg = _pg.RecordingProcessGroup(rec, noop_state, 0, 1, {"cpu": noop}, "cpu")
    opts = dist.AllreduceOptions()
    fast = _pg._walk  # the C walk, or None when not built / FRFORENSICS_PURE_PYTHON=1

    def gloo_recorded() -> None:
        dist.all_reduce(t)

    def noop_recorded() -> None:
        noop_pg.allreduce([t], opts)

    # name -> (the walk the recorder uses during the batch, the op)
    cases: dict[str, tuple[Any, Any]] = {
        "plain gloo": (fast, lambda: dist.all_reduce(t, group=plain)),
        "gloo + frf (py walk)": (None, gloo_recorded),
    }
    if fast is not None:
        cases["gloo + frf (C walk)"] = (fast, gloo_recorded)
    cases["noop"] = (fast, lambda: noop.allreduce([t], opts))
    cases["noop + frf (py walk)"] = (None, noop_recorded)
    if fast is not None:
        cases["noop + frf (C walk)"] = (fast, noop_recorded)
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    wall: dict[str, list[float]] = {k: [] for k in cases}
    dog: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeats):
        for name, (walk, call) in cases.items():
            _pg._walk = walk  # switched once per batch, not per op
            for _ in range(100):
                call()
            d0 = time.clock_gettime_ns(dog_clock)
            c0 = time.thread_time_ns()
            w0 = time.perf_counter_ns()
            _in_user_code(6, lambda call=call: [call() for _ in range(ops)])
            wall[name].append((time.perf_counter_ns() - w0) / ops / 1e3)
            cpu[name].append((time.thread_time_ns() - c0) / ops / 1e3)
            dog[name].append((time.clock_gettime_ns(dog_clock) - d0) / ops / 1e3)
            rec.pending.clear()
    _pg._walk = fast
    print(f"stack_depth={stack_depth}; medians of {repeats} interleaved repeats of {ops} ops; "
          f"C walk {'built' if fast is not None else 'not used'}")
    print(f"{'configuration':<22} {'wall/op':>9} {'cpu/op':>9} {'added cpu':>10} "
          f"{'watchdog cpu/op':>16} (us)")
    for name in cases:
        base = "noop" if name.startswith("noop") else "plain gloo"
        added = statistics.median(cpu[name]) - statistics.median(cpu[base])
        print(f"{name:<22} {statistics.median(wall[name]):>9.2f} "
              f"{statistics.median(cpu[name]):>9.2f} {added:>+10.2f} "
              f"{statistics.median(dog[name]):>16.2f}")
    watchdog.drop_works()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--inprocess", action="store_true",
                        help="plain vs recorded gloo interleaved in one process (CPU per op)")
    parser.add_argument("--stack-depth", type=int, default=8)
    parser.add_argument("--smoke", action="store_true",
                        help="a seconds-long run of every path (CI: the script cannot rot)")
    args = parser.parse_args()
    if args.smoke:
        args.ops, args.repeats = 600, 1  # 4 x 600 noop ops fill the 2000-entry ring
    if args.inprocess:
        _inprocess(100 if args.smoke else min(args.ops, 3000),
                   1 if args.smoke else max(args.repeats, 9), args.stack_depth)
        return
    if args.child:
        print(json.dumps(_child(args.child, args.ops)))
        return
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR",
                       TORCH_FR_BUFFER_SIZE="2000" if mode == "gloo+torch_fr" else "0")
            env.pop("FRFORENSICS_ENABLE", None)
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--ops",
                                  str(args.ops)], capture_output=True, text=True, env=env,
                                 check=True, timeout=600)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {m: statistics.median(r["per_op_us"] for r in runs[m]) for m in MODES}
    cpu = {m: statistics.median(r["cpu_us"] for r in runs[m]) for m in MODES}
    print(f"{'configuration':<20} {'wall/op (us)':>12} {'added':>8} {'cpu/op (us)':>12} "
          f"{'added':>8}")
    base = {m: "noop" if m.startswith("noop") else "gloo" for m in MODES}
    for m in MODES:
        b = base[m]
        print(f"{m:<20} {med[m]:>12.2f} {med[m] - med[b]:>8.2f} {cpu[m]:>12.2f} "
              f"{cpu[m] - cpu[b]:>8.2f}")
    last = runs["noop+frforensics"][-1]
    dump_ms = statistics.median(r["dump_ms"] for r in runs["noop+frforensics"])
    print(f"dump of {last['dump_entries']} entries: {dump_ms:.1f} ms, "
          f"{last['dump_bytes'] / 1024:.0f} KiB; decode {last['decode_ms']:.2f} ms")


if __name__ == "__main__":
    main()
