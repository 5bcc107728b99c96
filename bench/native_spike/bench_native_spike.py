"""What a C++ recording backend would cost per op (issue 31's route, measured).

    python bench/native_spike/bench_native_spike.py [--ops 20000] [--repeats 7]

A spike, not the recorder: ``recording_backend.cpp`` is a ``c10d::Backend`` that
wraps the real gloo backend and records every op into a preallocated ring of plain
structs (sequence id, op, element count, dtype, monotonic enqueue time, state,
and optionally the caller's 8 innermost Python frames as code references, the GIL
taken for that walk as PyTorch's own recorder does). It is returned by a backend
creator (``dist.Backend.register_backend``), so ``dist.all_reduce`` reaches it
from C++ with no Python override and no trampoline. A thread polls the newest
op's work for completion every 10 ms with the GIL released (a native watchdog's
stand-in).

Each configuration runs in its own process (what a job sees), world size 1, an
``all_reduce`` of 16 floats issued 8 frames deep; ``--repeats`` rounds interleave
the configurations; medians and min-max of the main thread's CPU per op and the
wall time per op:

* ``gloo``: plain gloo, PyTorch's recorder off (TORCH_FR_BUFFER_SIZE=0)
* ``gloo+torch_fr``: PyTorch's recorder on (2000 entries)
* ``gloo+native``: the C++ wrapper, no stacks, PyTorch's off
* ``gloo+native+stack``: the C++ wrapper with the 8-frame walk, PyTorch's off
* ``gloo+frforensics``: frforensics' recorder as shipped (the Python wrapper)

The extension is built with ``torch.utils.cpp_extension.load`` on first use and
cached per torch version (``~/.cache/frforensics/torch_extensions/<version>``, or
``TORCH_EXTENSIONS_DIR``); the build time is printed. Runs on torch 2.13 and 2.15
(the ``c10d::Backend`` virtuals it overrides are the same in both).
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
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODES = ["gloo", "gloo+torch_fr", "gloo+native", "gloo+native+stack", "gloo+frforensics"]


def build() -> Any:
    import torch
    from torch.utils.cpp_extension import load

    # one cache per torch version: an extension built against one torch's headers
    # must never be loaded by another
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(
        Path.home() / ".cache" / "frforensics" / "torch_extensions" / torch.__version__))
    return load(name="frforensics_native_spike", sources=[str(HERE / "recording_backend.cpp")],
                extra_cflags=["-O2"], verbose=False)


def _deep(depth: int, body: Any) -> Any:
    return _deep(depth - 1, body) if depth else body()


def _child(mode: str, ops: int) -> dict[str, Any]:
    import threading
    from socket import socket

    import torch
    import torch.distributed as dist

    backend = "gloo"
    ext = None
    if "native" in mode:
        ext = build()
        stacks = mode.endswith("+stack")
        made: list[Any] = []

        def creator(store: Any, rank: int, size: int, timeout: Any) -> Any:
            inner = dist.ProcessGroupGloo(store, rank, size, timeout=timeout)
            b = ext.wrap(inner, 2000, stacks)
            made.append(b)
            return b

        dist.Backend.register_backend("frnative", creator, devices=["cpu"])
        backend = "frnative"
    if "frforensics" in mode:
        import frforensics.recorder as recorder

        recorder.enable(tempfile.mkdtemp(prefix="frspike_"), timeout_s=600, save_native=False)
    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    stop = threading.Event()
    if ext is not None:
        rb = made[0]

        def watch() -> None:
            while not stop.wait(0.01):
                rb.poll()

        threading.Thread(target=watch, daemon=True).start()
    t = torch.ones(16)
    for _ in range(500):
        dist.all_reduce(t)
    cpu0, start = time.thread_time_ns(), time.perf_counter_ns()
    _deep(8, lambda: [dist.all_reduce(t) for _ in range(ops)])
    out = {"mode": mode, "wall_us": (time.perf_counter_ns() - start) / ops / 1e3,
           "cpu_us": (time.thread_time_ns() - cpu0) / ops / 1e3}
    if ext is not None:
        out["recorded"] = made[0].count()
        out["frames_newest"] = made[0].frames_of(made[0].count() - 1)
    stop.set()
    dist.destroy_process_group()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.ops)))
        return 0
    t0 = time.perf_counter()
    build()
    print(f"build (or cache hit): {time.perf_counter() - t0:.1f} s", flush=True)
    src = str(HERE.parents[1] / "src")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            env = {**os.environ, "OMP_NUM_THREADS": "1",
                   "TORCH_FR_BUFFER_SIZE": "2000" if mode == "gloo+torch_fr" else "0",
                   "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
            p = subprocess.run([sys.executable, __file__, "--child", mode, "--ops", str(args.ops)],
                               env=env, capture_output=True, text=True, timeout=600)
            if p.returncode:
                print(p.stderr[-3000:], file=sys.stderr)
                return 1
            runs[mode].append(json.loads(p.stdout.strip().splitlines()[-1]))
    base = {k: statistics.median(r[k] for r in runs["gloo"]) for k in ("cpu_us", "wall_us")}
    print(f"\n{args.repeats} interleaved rounds of {args.ops} ops, each configuration in its own "
          f"process; load {os.getloadavg()[0]:.2f}\n")
    print("| configuration | main-thread CPU µs/op (min-max) | added | wall µs/op (min-max) | added |")
    print("|---|---|---|---|---|")
    table = {}
    for mode in MODES:
        row = {}
        cells = [mode]
        for k in ("cpu_us", "wall_us"):
            vals = [r[k] for r in runs[mode]]
            med = statistics.median(vals)
            row[k] = med
            row[k + "_added"] = med - base[k]
            cells += [f"{med:.1f} ({min(vals):.1f}-{max(vals):.1f})", f"{med - base[k]:+.1f}"]
        table[mode] = row
        print("| " + " | ".join(cells) + " |")
    if args.out:
        args.out.write_text(json.dumps({"runs": runs, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
