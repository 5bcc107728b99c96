"""CPU of the central step by phase: what the main process of ``fr-analyze`` does.

::

    python bench/central_phases.py DIR WORLD_SIZE [--jobs 2] [--window 512] [--json OUT]

Runs ``load_dumps(DIR, jobs, window)`` then ``analyze`` in this process and
prints, as one JSON line, ``getrusage(RUSAGE_SELF)`` CPU seconds (this process
only, every thread: the pool workers are not counted) of the load (receiving
and unpickling the digests, discovery) and of ``analyze``, split by pass
(``build_job``, the wait graph, the context = the signature pass, each
detector, facts, timeline), the pool workers' CPU (``RUSAGE_CHILDREN``), the
peak RSS, and a hash of the ``--format json`` report (``--json OUT`` writes it)
to check that a change leaves the verdict byte-identical. Used for
docs/scaling.md ("The central step"). The allocator keeps freed memory as
``fr-analyze``'s ``main()`` sets it (``frforensics._malloc``; figures from before
6 December's sixth session were taken without it, so their first analysis paid
the page faults of every big temporary).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import frforensics.analyzer._analyze as A
import frforensics.analyzer.context as C
from frforensics._malloc import keep_freed_memory
from frforensics.analyzer import AnalyzeOptions, analyze, load_dumps
from frforensics.reporting import render


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    keep_freed_memory()  # as fr-analyze's main() does
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("world_size", type=int)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    phases: dict[str, float] = {}

    def timed(label: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def g(*a: Any, **k: Any) -> Any:
            c0 = _cpu()
            try:
                return f(*a, **k)
            finally:
                phases[label] = phases.get(label, 0.0) + _cpu() - c0
        return g

    A.build_job = timed("build_job", A.build_job)  # type: ignore[attr-defined]
    A.build_wait_graph = timed("wait_graph", A.build_wait_graph)  # type: ignore[attr-defined]
    A._timeline = timed("timeline", A._timeline)  # type: ignore[attr-defined]
    A._facts = timed("facts", A._facts)  # type: ignore[attr-defined]
    build = C.Context.build
    C.Context.build = timed("context (signature pass)", build)  # type: ignore[method-assign]
    A.DETECTORS[:] = [timed(d.__module__.rsplit(".", 1)[-1], d)  # type: ignore[attr-defined]
                      for d in A.DETECTORS]  # type: ignore[attr-defined]

    c0, w0 = _cpu(), time.time()
    dumps = load_dumps([args.dir], jobs=args.jobs, window=args.window or None)
    c1, w1 = _cpu(), time.time()
    report = analyze(dumps, options=AnalyzeOptions(world_size=args.world_size))
    c2 = _cpu()
    doc = render(report, "json")
    if args.json:
        with open(args.json, "w") as f:
            f.write(doc)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({
        "load_main_cpu_s": round(c1 - c0, 2), "load_wall_s": round(w1 - w0, 1),
        "analyze_cpu_s": round(c2 - c1, 2),
        "analyze_phases_cpu_s": {k: round(v, 2) for k, v in phases.items()},
        "workers_cpu_s": round(children.ru_utime + children.ru_stime, 1),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "report_sha256": hashlib.sha256(doc.encode()).hexdigest()[:16],
    }))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
