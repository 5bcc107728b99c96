"""What a job pays for a flight recorder: plain gloo, + PyTorch's recorder, + ours (issue 31).

    python bench/bench_recorder_jobs.py [--repeats 5] [--parts single,unpinned,job,ablate,memory]
    python bench/bench_recorder_jobs.py --smoke        # seconds: CI's check that it runs

Every configuration runs in its own process(es), as a job would see it: PyTorch's
recorder on or off is ``TORCH_FR_BUFFER_SIZE`` (2000 / 0, read at group creation),
ours is ``frforensics.recorder.enable(...)`` before ``init_process_group`` (PyTorch's
off). One *round* runs every child of every selected part once, in an order
rotated from round to round; ``--repeats`` rounds. Each figure is printed as the
median over rounds with its min–max; what a recorder *adds* is the difference to
plain gloo **within the same round** (paired), then its median and min–max.

Parts:

* ``single`` — world size 1, gloo ``dist.all_reduce`` of 16, 16 Ki and 1 Mi floats,
  issued 8 frames deep, sizes interleaved in batches inside the child. Per op:
  process CPU (every thread: gloo's workers, our watchdog), main-thread CPU, wall.
  The child's figure is its total over all batches divided by the ops (GC included:
  what the process paid), next to the median batch's.
* ``job`` — 4 processes (``RANK``/``WORLD_SIZE`` env, as torchrun's workers get),
  gloo on CPU, ``OMP_NUM_THREADS=1``: (b) small all_reduces (16 floats), per op;
  (c) a DDP step of a 2-layer ``nn.TransformerEncoder`` (d_model 64) with
  ``bucket_cap_mb=0.05`` (several buckets; the reducer calls the group from C++),
  and a tensor-parallel step (DTensor ``ColwiseParallel``/``RowwiseParallel`` on a
  stack of 12 MLP blocks: 24 small all_reduces per step) on ``init_device_mesh``;
  median step time after warm-up, and CPU per step. Figures: the mean over ranks.
* ``ablate`` — ours taken apart, world size 1, 16 floats, each variant in its own
  process (docs/recorder.md, "Overhead"): the wrapper forwarding without recording,
  no ``_push``, no stack, the pure-Python walk, the watchdog stopped, the GC off or
  frozen, the C++ entry point (what DDP's reducer pays: pybind trampoline), and
  the same over a no-op backend (our own cost, no gloo jitter).
* ``memory`` — world size 1, each configuration in its own process: the process's
  resident size (``/proc/self/statm``) after 100 ops, after 2100 (both rings full:
  2000 entries) and after 6100 (the rings evicting: the steady state), 16-float
  ``all_reduce``s 8 frames deep. What a recorder *keeps* is its growth minus plain
  gloo's in the same round; for ours also the ring alone (minus ours with a
  10-entry ring) and its Python objects (``tracemalloc`` over the fill, in a child
  of its own: tracemalloc's tables would count as resident).

Raw results: ``bench/results/recorder-jobs-<time>.json`` (and ``.md``, the tables).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _recbench import GcClock, Meter, cell, free_port, in_user_code, ratio, spread

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = ["plain", "torch_fr", "ours", "cxx"]
PIN = "@pin"  # a world-size-1 child pinned to one CPU (with all its threads)
LABELS = {"plain": "plain gloo", "torch_fr": "+ PyTorch's recorder", "ours": "+ frforensics",
          "cxx": "+ frforensics, native path"}
SIZES = [16, 16384, 1048576]
# ablation variant -> (what it is, the variant it is compared with)
ABLATIONS: dict[str, tuple[str, str]] = {
    "ours/forward": ("recorder on, wrapper forwards only (`rec.active = False`)", "plain"),
    "ours/no-push": ("records, `_push` replaced by a no-op", "ours"),
    "ours/no-stack": ("`stack_depth=0`", "ours"),
    "ours/py-walk": ("pure-Python stack walk (`FRFORENSICS_PURE_PYTHON=1`)", "ours"),
    "ours/no-watchdog": ("watchdog thread stopped (pending cleared every 100 ops)", "ours"),
    "ours/no-failcheck": ("watchdog running, its per-op `work_failed(work)` skipped", "ours"),
    "ours/slow-poll": ("watchdog polling every 1 s instead of 10 ms", "ours"),
    "ours/no-work-ref": ("a completed op goes to `pending` without its Work (no failure check)",
                         "ours"),
    "ours/short-pending": ("watchdog running, `pending` also cleared every 100 ops by the loop",
                           "ours"),
    "plain/c++entry": ("plain, called as C++ callers do: `ProcessGroup.allreduce` + wait",
                       "plain"),
    "ours/c++entry": ("ours, called at the C++ entry: through pybind's trampoline",
                      "plain/c++entry"),
    "plain/churn": ("plain, the loop also allocating a burst of 800 short-lived lists every "
                    "100 ops (a young GC each time, as a training step's tensors cause)", "plain"),
    "ours/churn": ("ours with the same churn: young GCs now promote the ring's live entries",
                   "plain/churn"),
    "ours/churn/gc-freeze": ("the same after `gc.freeze()`: torch's heap out of full "
                             "collections", "plain/churn"),
    "noop": ("no-op backend called directly (the floor)", "noop"),
    "noop+ours": ("wrapper + record over the no-op backend, watchdog running", "noop"),
    "noop+ours/forward": ("wrapper forwarding only", "noop"),
    "noop+ours/no-push": ("`_push` replaced by a no-op", "noop+ours"),
    "noop+ours/no-stack": ("`stack_depth=0`", "noop+ours"),
    "noop+ours/gc-off": ("`gc.disable()` after setup", "noop+ours"),
    "noop+ours/c++entry": ("called at the C++ entry (trampoline)", "noop+ours"),
    "noop+ours/old-bench": ("as bench_recorder.py's noop child: no watchdog, pending "
                            "cleared at 4096", "noop+ours"),
}
#: ours taken apart *unpinned* (threads free on every CPU, as a job runs): where the
#: separate-process cost comes from (docs/recorder.md, "Overhead, part by part")
UNPINNED = ["ours", "ours/no-watchdog", "ours/short-pending", "ours/no-failcheck",
            "ours/slow-poll", "ours/no-stack"]
#: plain gloo plus one idle Python thread waking every 10 ms (our watchdog's poll
#: cadence) and recording nothing: what the job part's steps owe to a waking thread
#: alone on 4 processes sharing 2 CPUs
TICK = "plain/tick"
DEPTH = 8  # user frames above each op
CHUNK = 100  # ops between two calls of the loop's hook


# ---------------------------------------------------------------- children


def _env(config: str, cpu: int | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FRFORENSICS_") and k != "BENCH_PIN_CPU"}
    if cpu is not None:  # the child pins itself (all its threads) to this CPU
        env["BENCH_PIN_CPU"] = str(cpu)
    env.update(OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR",
               TORCH_FR_BUFFER_SIZE="2000" if config.startswith("torch_fr") else "0")
    if config == "ours/py-walk":
        env["FRFORENSICS_PURE_PYTHON"] = "1"
    return env


def _enable_ours(config: str) -> None:
    import frforensics.recorder as recorder

    if os.environ.get("FRT_KEEP_TRACKED") == "1":  # the ring's entries as before the C untrack
        from frforensics.recorder import _pg, _ring

        _pg._untrack = _ring._keep_tracked

    overrides: dict[str, Any] = {}
    if config.endswith("/no-stack"):
        overrides["stack_depth"] = 0
    if config.endswith("/slow-poll"):
        overrides["poll_interval_s"] = 1.0
    if config.endswith("/ring10"):
        overrides["buffer_size"] = 10
    # "ours" is the Python wrapper, "cxx" the native path (docs/recorder-native.md);
    # never the default's machine-dependent choice
    overrides["recorder_path"] = "cxx" if config.startswith("cxx") else "python"
    recorder.enable(tempfile.mkdtemp(prefix="frbench_"), timeout_s=600, save_native=False,
                    **overrides)


def _thread_names() -> dict[int, str]:
    """Kernel thread ids of the recorder's threads, by role."""
    import threading

    names = {}
    for th in threading.enumerate():
        if th.native_id is None or th is threading.main_thread():
            continue
        if th.name.startswith("frforensics-"):
            names[th.native_id] = th.name.removeprefix("frforensics-")
        else:
            names[th.native_id] = "python"
    return names


def _loop(call: Any, args: tuple[Any, ...], n: int, hook: Any) -> None:
    for _ in range(max(1, n // CHUNK)):
        for _ in range(CHUNK):
            call(*args)
        if hook is not None:
            hook()


def _ws1_child(config: str, sizes: list[int], batches: int, ops: int) -> dict[str, Any]:
    """World size 1: ``config``'s per-op figures for each size (see the module doc)."""
    import torch
    import torch.distributed as dist

    clock = GcClock()
    result: dict[str, Any] = {"config": config, "torch": torch.__version__}
    if config.startswith("noop"):
        call, args, rec = _noop_setup(config, torch, dist)
        sizes = sizes[:1]
        hook = _old_bench_hook(rec) if config == "noop+ours/old-bench" else None
    else:
        call, rec, hook = _gloo_setup(config, dist)
        args = ()
    if "/churn" in config:
        hook = _churn
    tensors = {n: torch.ones(n) for n in sizes}
    for n in sizes:  # warm-up (and fill the ring: the steady state)
        _loop(call, args or (tensors[n],), 2500, hook)
    if config.endswith("/gc-freeze"):
        gc.collect()
        gc.freeze()
    if config.endswith("/gc-off"):
        gc.disable()
    meters = {n: Meter(clock, _thread_names()) for n in sizes}
    for b in range(batches):
        for i in range(len(sizes)):
            n = sizes[(b + i) % len(sizes)]  # sizes interleaved, order rotated
            a = args or (tensors[n],)
            meters[n].start()
            in_user_code(DEPTH, lambda a=a: _loop(call, a, ops, hook))
            meters[n].stop(ops)
    gc.enable()
    result["sizes"] = {str(n): meters[n].per_op() for n in sizes}
    if rec is not None:
        result["recorded"] = rec.count
    if not config.startswith("noop"):
        _drop_works()
        dist.destroy_process_group()
    return result


def _memory_child(config: str, ring: int) -> dict[str, Any]:
    """Resident size after 100 ops, after the rings filled (``ring`` more) and after
    they evicted twice their size (see the module doc, ``memory``)."""
    import tracemalloc

    import torch
    import torch.distributed as dist

    call, rec, _ = _gloo_setup(config, dist)
    t = torch.ones(16)
    page = os.sysconf("SC_PAGE_SIZE")

    def settle() -> int:
        time.sleep(0.05)  # the watchdog drops the works it polled
        gc.collect()
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page

    in_user_code(DEPTH, lambda: _loop(call, (t,), 100, None))
    before = settle()
    traced = None
    # tracemalloc's own tables are resident too: only its own child counts objects
    trace = config.endswith("/traced")
    if trace:
        tracemalloc.start(1)
        base = tracemalloc.get_traced_memory()[0]
    in_user_code(DEPTH, lambda: _loop(call, (t,), ring, None))
    if trace:
        time.sleep(0.05)
        gc.collect()
        traced = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
    full = settle()
    in_user_code(DEPTH, lambda: _loop(call, (t,), 2 * ring, None))
    steady = settle()
    out = {"config": config, "rss_before": before, "fill": full - before,
           "steady": steady - before, "ring_python_bytes": traced,
           "recorded": None if rec is None else rec.count, "ring": ring,
           # the native ring is allocated whole at enable(): its size, not its growth
           "cxx_ring_bytes": None if rec is None or rec.cxx is None else rec.cxx.bytes(),
           "buffer_size": None if rec is None else rec.config.buffer_size}
    _drop_works()
    dist.destroy_process_group()
    return out


def _churn() -> None:
    """A burst of short-lived objects: 800 > gc's 700-allocation threshold, so one young
    collection while they live (as a training step's tensors cause)."""
    burst = [[] for _ in range(800)]
    del burst


def _old_bench_hook(rec: Any) -> Any:
    pending = rec.pending

    def hook() -> None:
        if len(pending) > 4096:
            pending.clear()

    return hook


def _drop_works() -> None:
    from frforensics.recorder import session

    sess = session()
    if sess is not None and sess.watchdog is not None:
        sess.watchdog.drop_works()


def _gloo_setup(config: str, dist: Any) -> tuple[Any, Any, Any]:
    """World-size-1 gloo group (recorded for ``ours*``): (the op, the recorder, a hook)."""
    if config.startswith(("ours", "cxx")):
        _enable_ours(config)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    pg = dist.group.WORLD
    rec: Any = None
    hook: Any = None
    if config.startswith("cxx"):
        from frforensics.recorder import session

        sess = session()
        assert sess is not None and sess.rec.cxx is not None, "native path not on"
        rec = sess.rec
    if config.startswith("ours"):
        from frforensics.recorder import _pg, session

        sess = session()
        assert sess is not None and sess.watchdog is not None, "recorder not on"
        assert isinstance(pg, _pg.RecordingProcessGroup), type(pg)
        rec = sess.rec
        if config == "ours/forward":
            rec.active = False
        elif config == "ours/no-push":
            _pg._push = lambda *a: None
        elif config == "ours/no-failcheck":
            from frforensics.recorder import _watchdog

            _watchdog.work_failed = lambda work: False
        elif config == "ours/no-work-ref":
            real_push = _pg._push

            def push(st: Any, pending: Any, entry: Any, work: Any) -> None:
                prev = st.last
                real_push(st, pending, entry, work)
                if prev is not None and pending and pending[-1] is prev and prev[0][13] == 2:
                    pending[-1] = (prev[0], None)

            _pg._push = push
        elif config == "ours/short-pending":
            hook = rec.pending.clear
        elif config == "ours/no-watchdog":
            sess.watchdog.stop()
            sess.watchdog.join(5)
            hook = rec.pending.clear
    call = dist.all_reduce
    if config.endswith("/c++entry"):
        entry = dist.ProcessGroup.allreduce
        opts = dist.AllreduceOptions()

        def call(t: Any) -> None:
            entry(pg, [t], opts).wait()

    return call, rec, hook


def _noop_setup(config: str, torch: Any, dist: Any) -> tuple[Any, tuple[Any, ...], Any]:
    """A no-op backend (a finished work for every all_reduce) and, for ``noop+ours*``,
    the recording wrapper over it with the recorder's own watchdog thread."""
    from frforensics.recorder import _pg
    from frforensics.recorder._core import Recorder, RecorderConfig
    from frforensics.recorder._dump import DumpWriter
    from frforensics.recorder._watchdog import Watchdog

    class _Future:
        def done(self) -> bool:
            return True

        def value(self) -> None:
            return None

    future = _Future()

    class _Done(dist.Work):  # type: ignore[misc]  # a Work: C++ callers get it back
        def is_completed(self) -> bool:
            return True

        def wait(self, timeout: Any = None) -> bool:
            return True

        def get_future(self) -> Any:
            return future

    done = _Done()

    class _Noop:
        def allreduce(self, tensors: Any, opts: Any) -> Any:
            return done

        def name(self) -> str:
            return "noop"

    t = torch.ones(16)
    opts = dist.AllreduceOptions()
    inner = _Noop()
    if config == "noop":
        return inner.allreduce, ([t], opts), None
    stack = 0 if config.endswith("/no-stack") else 8
    rec = Recorder(RecorderConfig(dump_dir=Path(tempfile.mkdtemp(prefix="frbench_")),
                                  stack_depth=stack))
    state = rec.new_group(name="0", desc="default_pg", ranks=(0,), backend="noop",
                          timeout_ms=600_000)
    pg = _pg.RecordingProcessGroup(rec, state, 0, 1, {"cpu": inner}, "cpu")
    if config != "noop+ours/old-bench":
        dog = Watchdog(rec, DumpWriter(rec))
        dog.start()
    if config.endswith("/forward"):
        rec.active = False
    elif config.endswith("/no-push"):
        _pg._push = lambda *a: None
    if config.endswith("/c++entry"):
        return dist.ProcessGroup.allreduce, (pg, [t], opts), rec
    return pg.allreduce, ([t], opts), rec


def _pieces_child(number: int) -> dict[str, Any]:
    """The hot path's pieces timed alone (``timeit``: GC off, warm caches), ns per call,
    8 user frames deep, in a process with ours on over world-size-1 gloo."""
    import timeit
    from collections import deque

    import torch
    import torch.distributed as dist

    _enable_ours("ours")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    from frforensics.recorder import _pg, session
    from frforensics.recorder import _ring as R
    from frforensics.recorder._watchdog import work_failed

    sess = session()
    assert sess is not None and sess.watchdog is not None
    pg: Any = dist.group.WORLD
    rec, st = sess.rec, pg._frf_state
    t = torch.ones(16)
    opts = dist.AllreduceOptions()
    inner = pg._frf_default
    meta = ((t.shape, t.dtype),)
    work = inner.allreduce([t], opts)
    work.wait()
    entry = pg._frf_record("all_reduce", meta, meta, opts, -1, -1, False, t)
    walk, flt = _pg._walk, rec.frame_filter
    mono = time.monotonic_ns
    cxx = dist.ProcessGroup.allreduce
    pending: deque[Any] = deque()
    fresh = [list(entry) for _ in range(number)]

    def push_all() -> None:  # _push of an op whose predecessor finished (the common case)
        for e in fresh:
            e[13] = 0
            st.last = (e, work)
            _pg._push(st, pending, e, work)
        pending.clear()

    def loop_only() -> None:
        for e in fresh:
            e[13] = 0
            st.last = (e, work)
        pending.clear()

    cases: dict[str, Any] = {
        "dist.all_reduce, ours (whole op)": lambda: dist.all_reduce(t),
        "gloo backend allreduce + wait (the wrapper's forward: pybind, no c10d dispatcher)":
            lambda: inner.allreduce([t], opts).wait(),
        "ProcessGroup.allreduce + wait on ours (C++ entry: trampoline)":
            lambda: cxx(pg, [t], opts).wait(),
        "_frf_record (counters, entry list, C walk of 8 frames, ring store)":
            lambda: pg._frf_record("all_reduce", meta, meta, opts, -1, -1, False, t),
        "C stack walk alone (8 frames)": lambda: walk(2, 8, flt),
        "pure-Python stack walk alone (8 frames)":
            lambda: R.capture_stack(sys._getframe(2), 8, flt),
        "meta tuple ((t.shape, t.dtype),)": lambda: ((t.shape, t.dtype),),
        "time.monotonic_ns()": mono,
        "gloo Work.is_completed()": work.is_completed,
        "watchdog, per op: work_failed(work) (get_future, done, value)":
            lambda: work_failed(work),
        "RecordedWork(work, entry) (p2p, reduce_scatter on gloo only)":
            lambda: _pg.RecordedWork(work, entry),
    }
    out: dict[str, Any] = {}
    for name, stmt in cases.items():
        best = in_user_code(DEPTH, lambda stmt=stmt: min(
            timeit.repeat(stmt, number=number, repeat=5, timer=time.thread_time)))
        out[name] = best / number * 1e9
    # _push, less the loop that resets its inputs
    push = in_user_code(DEPTH, lambda: min(timeit.repeat(push_all, number=1, repeat=5, timer=time.thread_time)))
    base = in_user_code(DEPTH, lambda: min(timeit.repeat(loop_only, number=1, repeat=5, timer=time.thread_time)))
    out["_push (previous op done: is_completed, stamp, append)"] = (push - base) / number * 1e9
    sess.watchdog.drop_works()
    dist.destroy_process_group()
    return {"config": "pieces", "ns": out}


def _rank_child(config: str, spec: dict[str, int]) -> dict[str, Any]:
    """One rank of the 4-process job: small all_reduces, a DDP step, a TP step."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    clock = GcClock()
    if config in ("ours", "cxx"):
        _enable_ours(config)
    if config == TICK:
        import threading

        def tick() -> None:
            while True:
                time.sleep(0.01)

        threading.Thread(target=tick, name="tick", daemon=True).start()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rec: Any = None
    if config in ("ours", "cxx"):
        from frforensics.recorder import session

        sess = session()
        assert sess is not None, "recorder not on"
        rec = sess.rec
    out: dict[str, Any] = {"config": config, "rank": rank, "torch": torch.__version__}

    def count() -> int:
        if rec is None:
            return 0
        return int(rec.cxx.count()) if rec.cxx is not None else int(rec.count)

    # (b) small all_reduces
    t = torch.ones(16)
    for _ in range(200):
        dist.all_reduce(t)
    dist.barrier()
    meter = Meter(clock, _thread_names())
    for _ in range(spec["batches"]):
        c0 = count()
        meter.start()
        in_user_code(DEPTH, lambda: _loop(dist.all_reduce, (t,), spec["ops"], None))
        meter.stop(spec["ops"])
        out["allreduce_recorded_per_op"] = (count() - c0) / spec["ops"]
    out["allreduce"] = meter.per_op()

    # (c) DDP: a small transformer, bucketed gradients (reducer -> the group, from C++)
    from torch.nn.parallel import DistributedDataParallel as DDP

    gen = torch.Generator().manual_seed(100 + rank)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, dropout=0.0,
                                       batch_first=True)
    body = nn.Sequential(nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False),
                         nn.Linear(64, 1))
    ddp = DDP(body, bucket_cap_mb=0.05)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def ddp_step() -> None:
        x = torch.randn(8, 16, 64, generator=gen)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    out["ddp"] = _steps(ddp_step, spec, clock, count)

    # (c) tensor parallel: many small all_reduces per step
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    blocks = spec["tp_blocks"]
    layers: list[nn.Module] = []
    plan: dict[str, Any] = {}
    for i in range(blocks):
        layers += [nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)]
        plan[str(3 * i)] = ColwiseParallel()
        plan[str(3 * i + 2)] = RowwiseParallel()
    mlp = parallelize_module(nn.Sequential(*layers), mesh, plan)
    tp_opt = torch.optim.SGD(mlp.parameters(), lr=0.001)
    same = torch.Generator().manual_seed(7)  # tensor parallel: the same batch everywhere

    def tp_step() -> None:
        x = torch.randn(8, 64, generator=same)
        loss = mlp(x).pow(2).mean()
        tp_opt.zero_grad(set_to_none=True)
        loss.backward()
        tp_opt.step()

    out["tp"] = _steps(tp_step, spec, clock, count)
    if rec is not None:
        _drop_works()
    dist.barrier()
    dist.destroy_process_group()
    return out


def _steps(step: Any, spec: dict[str, int], clock: GcClock, count: Any) -> dict[str, Any]:
    import torch.distributed as dist

    for _ in range(spec["warmup"]):
        step()
    dist.barrier()
    meter = Meter(clock, _thread_names())
    walls = []
    c0 = count()
    for _ in range(spec["steps"]):
        meter.start()
        in_user_code(DEPTH, step)
        walls.append(meter.stop(1)["wall_ns"] / 1e6)
    out = meter.per_op()
    out["step_ms_median"] = statistics.median(walls)
    out["recorded_per_step"] = (count() - c0) / spec["steps"]
    del out["batches"]
    out["step_ms"] = walls
    return out


# ---------------------------------------------------------------- the runner


def _run_child(args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def _run_job(config: str, spec: dict[str, int], timeout: float) -> list[dict[str, Any]]:
    env = _env(config)
    port = free_port()
    world = 4
    procs = []
    for rank in range(world):
        e = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                 LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--rank-child", config, "--spec", json.dumps(spec)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e))
    outs = []
    deadline = time.monotonic() + timeout
    try:
        for rank, p in enumerate(procs):
            so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            lines = so.strip().splitlines()
            # torch 2.13, PyTorch's recorder on gloo: a rank sometimes aborts at exit
            # ("terminate called without an active exception", 1 of 4 smoke runs),
            # after destroy_process_group and after its results were printed. Those
            # results are complete; the abort is counted and reported, not hidden.
            late_abort = (p.returncode == -6 and lines and lines[-1].startswith("{")
                          and "terminate called without an active exception" in se)
            if p.returncode != 0 and not late_abort:
                raise RuntimeError(f"job {config} rank {rank} exited {p.returncode}:\n{se[-3000:]}")
            doc = json.loads(lines[-1])
            doc["aborted_at_exit"] = bool(late_abort)
            outs.append(doc)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def _load() -> float:
    return os.getloadavg()[0]


def _tasks(parts: list[str]) -> list[tuple[str, str]]:
    tasks: list[tuple[str, str]] = []
    if "single" in parts or "ablate" in parts:  # ablations are compared with these
        tasks += [("single", c) for c in CONFIGS]
        tasks += [("single", c + PIN) for c in CONFIGS]
    if "ablate" in parts:
        tasks += [("ablate", c) for c in ABLATIONS]
        tasks.append(("ablate", "pieces"))
    if "unpinned" in parts:
        if "single" not in parts and "ablate" not in parts:
            tasks += [("single", "plain")]
        tasks += [("unpinned", c) for c in UNPINNED]
    if "job" in parts:
        tasks += [("job", c) for c in [*CONFIGS, TICK]]
    if "memory" in parts:
        tasks += [("memory", c) for c in [*CONFIGS, "ours/ring10", "ours/traced"]]
    return tasks


def _run_task(part: str, config: str, specs: dict[str, Any], round_: int) -> Any:
    if part == "job":
        return _run_job(config, specs["job"], 600)
    if part == "memory":
        return _run_child(["--child", "memory:" + config, "--spec", json.dumps(specs["memory"])],
                          _env(config), 600)
    spec = specs["pieces" if config == "pieces" else "ablate" if part == "unpinned" else part]
    # pinned children: every thread on one CPU, the same CPU for every child of a round
    cpu = round_ % (os.cpu_count() or 1) if part == "ablate" or config.endswith(PIN) else None
    env = _env("ours" if config == "pieces" else config, cpu)
    return _run_child(["--child", config.removesuffix(PIN), "--spec", json.dumps(spec)], env,
                      600)


def _rounds(tasks: list[tuple[str, str]], specs: dict[str, Any], repeats: int,
            strict: bool) -> tuple[dict[str, dict[str, list[Any]]], list[float]]:
    """Every task once per round, the order rotated from round to round; ``strict``
    (``--smoke``): one round, children side by side, a failure raised."""
    runs: dict[str, dict[str, list[Any]]] = {}
    loads: list[float] = [_load()]
    started = time.time()
    if strict:
        # the smoke (CI's check that every path runs, its figures unread): one round,
        # a child per CPU at once (136 s one at a time on 2 CPUs)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            values = list(pool.map(lambda t: _run_task(t[0], t[1], specs, 0), tasks))
        for (part, config), value in zip(tasks, values, strict=True):
            runs.setdefault(part, {}).setdefault(config, []).append(value)
        loads.append(_load())
        print(f"smoke round done ({time.time() - started:.0f} s)", file=sys.stderr)
        return runs, loads
    for r in range(repeats):
        k = (r * 7) % len(tasks)
        for part, config in tasks[k:] + tasks[:k]:  # no configuration always first
            try:
                value = _run_task(part, config, specs, r)
            except Exception as exc:
                print(f"round {r}: {part} {config} failed: {exc}", file=sys.stderr)
                value = None
            runs.setdefault(part, {}).setdefault(config, []).append(value)
            loads.append(_load())
        print(f"round {r + 1}/{repeats} done ({time.time() - started:.0f} s, "
              f"load {_load():.2f})", file=sys.stderr)
    return runs, loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--parts", default="single,unpinned,job,ablate,memory")
    parser.add_argument("--ops", type=int, default=4000, help="ops per batch (world size 1)")
    parser.add_argument("--batches", type=int, default=5, help="batches per size (world size 1)")
    parser.add_argument("--smoke", action="store_true", help="seconds: every path, tiny sizes")
    parser.add_argument("--out", type=Path, help="JSON results (default bench/results/...)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--rank-child", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    pin = os.environ.get("BENCH_PIN_CPU")
    if pin is not None and (args.child or args.rank_child):
        os.sched_setaffinity(0, {int(pin)})  # before torch starts any thread
    if args.child and args.child.startswith("memory:"):
        print(json.dumps(_memory_child(args.child.removeprefix("memory:"),
                                       json.loads(args.spec)["ops"])))
        return
    if args.child == "pieces":
        print(json.dumps(_pieces_child(json.loads(args.spec)["number"])))
        return
    if args.child:
        spec = json.loads(args.spec)
        print(json.dumps(_ws1_child(args.child, spec["sizes"], spec["batches"], spec["ops"])))
        return
    if args.rank_child:
        print(json.dumps(_rank_child(args.rank_child, json.loads(args.spec))))
        return
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - {"single", "unpinned", "job", "ablate", "memory"}
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}")
    if args.smoke:
        args.repeats, args.ops, args.batches = 1, 200, 1
    specs: dict[str, Any] = {
        "single": {"sizes": SIZES, "batches": args.batches, "ops": args.ops},
        "ablate": {"sizes": SIZES[:1], "batches": args.batches, "ops": args.ops},
        "pieces": {"number": 200 if args.smoke else 5000},
        "memory": {"ops": 2000},
        "job": ({"ops": 100, "batches": 1, "warmup": 1, "steps": 2, "tp_blocks": 2}
                if args.smoke else
                {"ops": 200, "batches": 3, "warmup": 5, "steps": 15, "tp_blocks": 12}),
    }
    started = time.time()
    runs, loads = _rounds(_tasks(parts), specs, args.repeats, strict=args.smoke)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": _torch_version(), "repeats": args.repeats, "specs": specs,
            "load_1min": {"min": min(loads), "max": max(loads),
                                      "median": statistics.median(loads)},
            "seconds": round(time.time() - started, 1), "argv": sys.argv[1:]}
    text = report(runs, meta)
    print(text)
    if not args.smoke or args.out:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = args.out or RESULTS / f"recorder-jobs-{stamp}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"meta": meta, "runs": runs}, separators=(",", ":")) + "\n")
        out.with_suffix(".md").write_text(text + "\n")
        print(f"raw results: {out}", file=sys.stderr)


def _torch_version() -> str:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                         capture_output=True, text=True, check=False)
    return out.stdout.strip()


# ---------------------------------------------------------------- the report


def _values(runs: list[Any], get: Any) -> list[float | None]:
    out: list[float | None] = []
    for run in runs:
        try:
            out.append(None if run is None else float(get(run)))
        except (KeyError, TypeError, IndexError):
            out.append(None)
    return out


def _paired(a: list[float | None], b: list[float | None]) -> list[float]:
    """Round by round ``a - b`` where both ran."""
    return [x - y for x, y in zip(a, b, strict=False) if x is not None and y is not None]


def _present(v: list[float | None]) -> list[float]:
    return [x for x in v if x is not None]


def _row3(name: str, vals: dict[str, list[float | None]], digits: int = 1) -> str:
    """plain | + PyTorch's | + ours | + ours, native path (each added) | ours/PyTorch's |
    native/PyTorch's."""
    plain = vals["plain"]
    torch_add = spread(_paired(vals["torch_fr"], plain))
    ours_add = spread(_paired(vals["ours"], plain))
    cxx_add = spread(_paired(vals.get("cxx", []), plain))
    return (f"| {name} | {cell(spread(_present(plain)), digits)} | "
            f"{cell(torch_add, digits, True)} | {cell(ours_add, digits, True)} | "
            f"{cell(cxx_add, digits, True)} | "
            f"{ratio(ours_add, torch_add)} | {ratio(cxx_add, torch_add)} |")


METRICS = [("process CPU", "proc_cpu_us"), ("main-thread CPU", "main_cpu_us"),
           ("wall", "wall_us")]


def report(runs: dict[str, dict[str, list[Any]]], meta: dict[str, Any]) -> str:
    lines = [f"# Recorder overhead: plain gloo, + PyTorch's recorder, + frforensics "
             f"(torch {meta['torch']})", "",
             f"{meta['date']}, {meta['cpus']} CPUs, load (1 min) {meta['load_1min']['min']:.2f}"
             f"–{meta['load_1min']['max']:.2f}, {meta['repeats']} interleaved rounds, "
             f"{meta['seconds']:.0f} s. Cells: median [min–max] over rounds; *added* = "
             "the configuration minus plain gloo in the same round.", ""]
    single = runs.get("single", {})
    lines += _report_single(single, pinned=False)
    lines += _report_single(single, pinned=True)
    lines += _report_unpinned(single, runs.get("unpinned", {}))
    lines += _report_job(runs.get("job", {}))
    lines += _report_ablate(single, runs.get("ablate", {}))
    lines += _report_memory(runs.get("memory", {}))
    return "\n".join(lines)


def _report_memory(mem: dict[str, list[Any]]) -> list[str]:
    if not mem:
        return []
    ring = next((r["ring"] for runs in mem.values() for r in runs if r), 0)
    lines = [f"## Memory: resident size a recorder keeps, world size 1, KiB ({ring}-entry rings)",
             "", HEADER]
    for label, key in ((f"after {ring} ops (the rings full)", "fill"),
                       (f"after {3 * ring} ops (evicting: the steady state)", "steady")):
        vals = {c: _values(mem.get(c, []), lambda r, key=key: r[key] / 1024) for c in CONFIGS}
        lines.append(_row3(label, vals, 0))
    traced = spread(_present(_values(mem.get("ours/traced", []), lambda r: r["ring_python_bytes"]
                                     and r["ring_python_bytes"] / 1024)))
    alone = spread(_paired(_values(mem.get("ours", []), lambda r: r["steady"] / 1024),
                           _values(mem.get("ours/ring10", []), lambda r: r["steady"] / 1024)))
    native = spread(_present(_values(mem.get("cxx", []), lambda r: r["cxx_ring_bytes"] / 1024)))
    lines += ["", f"Ours, the ring alone: resident, steady, minus ours with a 10-entry ring "
              f"(what the rest of the recorder keeps) {cell(alone, 0, True)} KiB; the Python "
              f"objects the fill left (`tracemalloc`, in a child of its own: its tables are "
              f"resident too) {cell(traced, 0)} KiB. The native path's ring, allocated whole "
              f"at `enable()` (so not in its growth above): {cell(native, 0)} KiB "
              f"(`Ring.bytes()`: its slots, stack arrays and any metadata on the heap).", ""]
    return lines


HEADER = ("| | plain gloo | + PyTorch's recorder (added) | + frforensics (added) | "
          "+ frforensics, native path (added) | ours / PyTorch's | native / PyTorch's |\n"
          "|---|---|---|---|---|---|---|")


def _report_single(single: dict[str, list[Any]], pinned: bool) -> list[str]:
    suffix = PIN if pinned else ""
    configs = {c: c + suffix for c in CONFIGS}
    if not any(single.get(v) for v in configs.values()):
        return []
    title = ("## World size 1, gloo `dist.all_reduce`, each process pinned to one CPU "
             "(no cross-CPU hand-off), µs per op" if pinned else
             "## World size 1, gloo `dist.all_reduce`, µs per op (what a process sees)")
    lines = [title, "", HEADER]

    def row(name: str, get: Any, digits: int = 2) -> str:
        return _row3(name, {c: _values(single.get(v, []), get) for c, v in configs.items()},
                     digits)

    for n in SIZES:
        for label, key in METRICS:
            lines.append(row(f"{n} floats: {label}", lambda r, n=n, key=key:
                             r["sizes"][str(n)][key]))
    lines.append(row("16 floats: main-thread CPU, the child's median batch",
                     lambda r: r["sizes"]["16"]["median_batch"]["main_cpu_us"]))
    lines.append(row("16 floats: of which GC (main thread)", lambda r: r["sizes"]["16"]["gc_us"]))
    lines.append(row("16 floats: main thread's voluntary context switches per op",
                     lambda r: r["sizes"]["16"].get("main_nr_voluntary_switches_per_op")))
    dogs = {c: spread(_present(_values(single.get(configs[c], []), lambda r: r["sizes"]["16"].get(
        "thread_watchdog_us", 0)))) for c in ("ours", "cxx")}
    lines += ["", f"Our watchdog thread, 16 floats, µs CPU per op: {cell(dogs['ours'], 2)} "
              f"(Python path), {cell(dogs['cxx'], 2)} (native path).", ""]
    return lines


def _report_job(job: dict[str, list[Any]]) -> list[str]:
    lines: list[str] = []
    if job:
        lines += ["## 4 processes, gloo on CPU (2 cores)", "", HEADER]

        def mean_rank(section: str, key: str, scale: float = 1.0) -> Any:
            return lambda ranks: statistics.mean(r[section][key] for r in ranks) * scale

        for label, key in METRICS:
            vals = {c: _values(job.get(c, []), mean_rank("allreduce", key)) for c in CONFIGS}
            lines.append(_row3(f"all_reduce 16 floats: {label}, µs/op", vals, 1))
        for section, name in (("ddp", "DDP step"), ("tp", "TP step")):
            vals = {c: _values(job.get(c, []), mean_rank(section, "step_ms_median"))
                    for c in CONFIGS}
            lines.append(_row3(f"{name}: time (median step), ms", vals, 2))
            for label, key in METRICS[:2]:
                vals = {c: _values(job.get(c, []), mean_rank(section, key, 1e-3))
                        for c in CONFIGS}
                lines.append(_row3(f"{name}: {label}, ms/step", vals, 2))
        lines += _report_step_target(job, mean_rank)
        per = {s: spread(_present(_values(job.get("ours", []), lambda ranks, s=s: statistics.mean(
            r[s]["recorded_per_step"] for r in ranks)))) for s in ("ddp", "tp")}
        lines += ["", f"Ops recorded per step (ours): DDP {cell(per['ddp'], 0)}, "
                  f"TP {cell(per['tp'], 0)}."]
        aborts = {c: (sum(bool(r.get("aborted_at_exit")) for run in job.get(c, []) if run
                          for r in run),
                      sum(len(run) for run in job.get(c, []) if run)) for c in CONFIGS}
        lines += ["Rank processes that aborted at exit after their results (SIGABRT, "
                  "`terminate called without an active exception`): "
                  + ", ".join(f"{LABELS[c]} {a} of {n}" for c, (a, n) in aborts.items()) + ".",
                  ""]
    return lines


def _report_step_target(job: dict[str, list[Any]], mean_rank: Any) -> list[str]:
    """Issue 31's step target, both recorders compared directly, paired by round:
    (with ours - with PyTorch's) / with PyTorch's, and in how many rounds it is <= +1 %."""
    lines = ["", "Step time with ours against with PyTorch's recorder, paired by round "
             "(issue 31's target: within 1 %), % of PyTorch's: median [min–max], rounds "
             "within +1 %:", ""]
    for config in ("ours", "cxx"):
        for section, name in (("ddp", "DDP"), ("tp", "TP")):
            for label, key, scale in (("step time", "step_ms_median", 1.0),
                                      ("process CPU", "proc_cpu_us", 1e-3)):
                ours = _values(job.get(config, []), mean_rank(section, key, scale))
                base = _values(job.get("torch_fr", []), mean_rank(section, key, scale))
                rel = [100.0 * (a - b) / b for a, b in zip(ours, base, strict=False)
                       if a is not None and b]
                within = sum(r <= 1.0 for r in rel)
                lines.append(f"- {LABELS[config]}, {name} {label}: "
                             f"{cell(spread(rel), 1, True)} % ({within} of {len(rel)})")
    for section, name in (("ddp", "DDP"), ("tp", "TP")):
        tick = _values(job.get(TICK, []), mean_rank(section, "step_ms_median"))
        plain = _values(job.get("plain", []), mean_rank(section, "step_ms_median"))
        rel = [100.0 * (a - b) / b for a, b in zip(tick, plain, strict=False)
               if a is not None and b]
        if rel:
            lines.append(f"- plain gloo + an idle thread waking every 10 ms (no recorder), "
                         f"{name} step time against plain gloo: {cell(spread(rel), 1, True)} %")
    return lines


def _report_unpinned(single: dict[str, list[Any]], unp: dict[str, list[Any]]) -> list[str]:
    if not unp or not single.get("plain"):
        return []
    lines = ["## Ours taken apart, unpinned (threads free on both CPUs), 16 floats, µs per op",
             "", "Added over plain gloo, paired by round (each cell: median [min–max]).", "",
             "| variant | wall | main-thread CPU | process CPU | main thread's voluntary "
             "switches / op |", "|---|---|---|---|---|"]

    def get(config: str, key: str) -> list[float | None]:
        runs = single.get(config) if config == "plain" else unp.get(config)
        return [r["sizes"]["16"][key] if r else None for r in runs or []]

    for config in UNPINNED:
        what = "as shipped" if config == "ours" else ABLATIONS[config][0]
        cells = [cell(spread(_paired(get(config, k), get("plain", k))), 2, True)
                 for k in ("wall_us", "main_cpu_us", "proc_cpu_us",
                           "main_nr_voluntary_switches_per_op")]
        lines.append(f"| `{config}`: {what} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _report_ablate(single: dict[str, list[Any]], abl: dict[str, list[Any]]) -> list[str]:
    lines: list[str] = []
    if abl:
        every = {**single, **abl}

        def get(config: str, key: str, median_batch: bool = False) -> list[float | None]:
            if config in CONFIGS:  # the ablations run pinned: their bases too
                config += PIN
            if median_batch:
                return _values(every.get(config, []),
                               lambda r: r["sizes"]["16"]["median_batch"][key])
            return _values(every.get(config, []), lambda r: r["sizes"]["16"].get(key, 0.0))

        lines += ["## Ours taken apart: world size 1, 16 floats, pinned to one CPU, µs per op",
                  "",
                  "Main-thread CPU per op: *batch* = the child's median batch (a rare full "
                  "GC falls outside it), *run* = the child's whole run (GC included); "
                  "Δ = minus the base variant, paired by round.", "",
                  "| variant | base | main CPU, batch | Δ batch | main CPU, run | Δ run | "
                  "GC (run) | watchdog thread |",
                  "|---|---|---|---|---|---|---|---|"]
        for config in ["plain", "ours", *ABLATIONS]:
            what, base = ABLATIONS.get(config, (LABELS.get(config, config), config))
            batch, run = get(config, "main_cpu_us", True), get(config, "main_cpu_us")
            d_batch = d_run = "—"
            if base != config:
                d_batch = cell(spread(_paired(batch, get(base, "main_cpu_us", True))), 2, True)
                d_run = cell(spread(_paired(run, get(base, "main_cpu_us"))), 2, True)
            lines.append(
                f"| `{config}`: {what} | {base if base != config else '—'} | "
                f"{cell(spread(_present(batch)), 2)} | {d_batch} | "
                f"{cell(spread(_present(run)), 2)} | {d_run} | "
                f"{cell(spread(_present(get(config, 'gc_us'))), 2)} | "
                f"{cell(spread(_present(get(config, 'thread_watchdog_us'))), 2)} |")
        pieces = [r for r in abl.get("pieces", []) if r is not None]
        if pieces:
            lines += ["", "The pieces alone (`timeit` on the main thread's CPU clock, GC off, warm caches; same process as "
                      "`ours`, 8 frames deep), ns per call:", "", "| piece | ns |", "|---|---|"]
            for name in pieces[0]["ns"]:
                vals = [p["ns"][name] for p in pieces if name in p["ns"]]
                lines.append(f"| {name} | {cell(spread(vals), 0)} |")
        lines.append("")
    return lines



if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
