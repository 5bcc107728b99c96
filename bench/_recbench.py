"""Helpers shared by the recorder benchmarks (``bench_recorder.py``, ``bench_recorder_jobs.py``).

Measuring inside a child process: :class:`Meter` takes, around a batch of ops,
the wall time, the main thread's CPU time, the whole process's CPU time (every
thread: gloo's workers, the recorder's watchdog), each thread's CPU time, and the
time the cyclic garbage collector ran (``gc.callbacks``), by generation. Summaries
across processes: :func:`spread` (median, min, max, quartiles) and :func:`cell`.
"""

from __future__ import annotations

import gc
import os
import socket
import statistics
import threading
import time
from typing import Any


def in_user_code(depth: int, body: Any) -> Any:
    """Run ``body`` ``depth`` frames deep: a stack like a training loop's."""
    if depth:
        return in_user_code(depth - 1, body)
    return body()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _thread_clock(tid: int) -> int:
    # Linux: the CPU-time clock of any thread of this process, by kernel thread id
    # (MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)); nanosecond resolution, where
    # /proc/<pid>/task/<tid>/stat counts 10 ms ticks.
    return ((~tid) << 3) | 6


def thread_cpu_ns() -> dict[int, int]:
    """CPU time of every live thread of this process, by kernel thread id."""
    out: dict[int, int] = {}
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            out[tid] = time.clock_gettime_ns(_thread_clock(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return out


def sched_counts(tid: int) -> dict[str, int]:
    """The scheduler's counters of one thread (``/proc/self/task/<tid>/sched``, where the
    kernel has it): switches (voluntary: it blocked, e.g. in a futex wait) and migrations."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/self/task/{tid}/sched") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("nr_voluntary_switches", "nr_involuntary_switches",
                           "se.nr_migrations"):
                    out[key.removeprefix("se.")] = int(float(value))
    except OSError:
        pass
    return out


class GcClock:
    """Time the cyclic GC runs, on whichever thread triggers it, by generation."""

    def __init__(self) -> None:
        self.ns = [0, 0, 0]
        self.count = [0, 0, 0]
        self._start: dict[int, int] = {}
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        ident = threading.get_ident()
        if phase == "start":
            self._start[ident] = time.thread_time_ns()
            return
        t0 = self._start.pop(ident, None)
        if t0 is not None:
            gen = int(info.get("generation", 2))
            self.ns[gen] += time.thread_time_ns() - t0
            self.count[gen] += 1

    def snapshot(self) -> tuple[int, int, int, int]:
        """(total ns, full-collection ns, young ns, full collections)."""
        return (sum(self.ns), self.ns[2], self.ns[0] + self.ns[1], self.count[2])


class Meter:
    """Wall, main-thread CPU, process CPU, per-thread CPU and GC time around a batch.

    ``names`` maps kernel thread ids to a label (``watchdog``, ...); other threads
    than the main one and those named are summed as ``other`` (gloo's workers).
    """

    def __init__(self, gc_clock: GcClock, names: dict[int, str] | None = None) -> None:
        self.gc = gc_clock
        self.names = dict(names or {})
        self.main = threading.main_thread().native_id
        self.totals: dict[str, float] = {}
        self.batches: list[dict[str, float]] = []
        self.ops = 0

    def start(self) -> None:
        self._threads = thread_cpu_ns()
        self._sched = sched_counts(self.main)
        self._gc = self.gc.snapshot()
        self._p = time.process_time_ns()
        self._c = time.thread_time_ns()
        self._w = time.perf_counter_ns()

    def stop(self, ops: int) -> dict[str, float]:
        w = time.perf_counter_ns() - self._w
        c = time.thread_time_ns() - self._c
        p = time.process_time_ns() - self._p
        g = self.gc.snapshot()
        threads = thread_cpu_ns()
        sched = sched_counts(self.main)
        per: dict[str, float] = {}
        for tid, ns in threads.items():
            if tid == self.main:
                continue
            label = self.names.get(tid, "other")
            per[label] = per.get(label, 0.0) + (ns - self._threads.get(tid, 0))
        batch = {"ops": float(ops), "wall_ns": float(w), "main_cpu_ns": float(c),
                 "proc_cpu_ns": float(p), "gc_ns": float(g[0] - self._gc[0]),
                 "gc_full_ns": float(g[1] - self._gc[1]), "gc_young_ns": float(g[2] - self._gc[2]),
                 "gc_full": float(g[3] - self._gc[3])}
        for label, ns in per.items():
            batch[f"thread_{label}_ns"] = float(ns)
        for key, value in sched.items():  # the main thread's, per batch
            batch[f"main_{key}"] = float(value - self._sched.get(key, 0))
        self.batches.append(batch)
        self.ops += ops
        for key, value in batch.items():
            self.totals[key] = self.totals.get(key, 0.0) + value
        return batch

    def per_op(self) -> dict[str, Any]:
        """Totals over every batch, per op in µs (what the process paid, GC included),
        the median batch's per-op figures, and the raw batches."""
        ops = max(1, self.ops)
        out: dict[str, Any] = {"ops": self.ops}
        for key, value in self.totals.items():
            if key.endswith("_ns"):
                out[key[:-3] + "_us"] = value / ops / 1e3
        out["gc_full"] = self.totals.get("gc_full", 0.0)
        for key in ("nr_voluntary_switches", "nr_involuntary_switches", "nr_migrations"):
            if f"main_{key}" in self.totals:
                out[f"main_{key}_per_op"] = self.totals[f"main_{key}"] / ops
        out["median_batch"] = {
            key[:-3] + "_us": statistics.median(b.get(key, 0.0) / b["ops"] for b in self.batches) / 1e3
            for key in ("wall_ns", "main_cpu_ns", "proc_cpu_ns")}
        out["batches"] = self.batches
        return out


def spread(values: list[float]) -> dict[str, float]:
    """Median, min, max and quartiles of ``values`` (empty: all NaN)."""
    if not values:
        nan = float("nan")
        return {"median": nan, "min": nan, "max": nan, "q1": nan, "q3": nan, "n": 0}
    vals = sorted(values)
    if len(vals) >= 4:
        q1, _, q3 = statistics.quantiles(vals, n=4)
    else:
        q1, q3 = vals[0], vals[-1]
    return {"median": statistics.median(vals), "min": vals[0], "max": vals[-1], "q1": q1,
            "q3": q3, "n": len(vals)}


def cell(s: dict[str, float], digits: int = 1, signed: bool = False) -> str:
    """``median [min–max]`` of a :func:`spread`."""
    if not s.get("n"):
        return "—"
    f = f"{{:{'+' if signed else ''}.{digits}f}}"
    return f"{f.format(s['median'])} [{f.format(s['min'])}–{f.format(s['max'])}]"


def ratio(num: dict[str, float], den: dict[str, float]) -> str:
    """Ratio of two medians; ``n/a`` when the denominator is not clearly above zero
    (its min-max range touches zero: a ratio of noise)."""
    if not num.get("n") or not den.get("n"):
        return "—"
    if den["median"] <= 0 or den["min"] <= 0:
        return "n/a"
    return f"{num['median'] / den['median']:.1f}×"
