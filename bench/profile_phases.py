"""Where a verdict's time and memory go, phase by phase (issue 30, item 1).

::

    python bench/profile_phases.py DIR [--jobs 2] [--window N] [--out FILE.json]

Runs what ``fr-analyze DIR --jobs N`` runs (``load_dumps`` then ``analyze``) in
this process and prints, per phase, the wall time, the CPU time (user and system)
of this process and of its worker processes, minor page faults, and this
process's peak resident size at the phase's end. The phases are the loader's
(discovery and reading/decoding/digesting in the workers, with the digests' trip
back to this process; reported as one "load" phase, its workers' CPU apart) and
the analysis's own (``analyze(..., progress=)``: the merge, the wait graph, each
rule, the verdict, the timeline), then rendering the JSON report.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any


def _sample() -> dict[str, float]:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall": time.perf_counter(), "user": me.ru_utime, "sys": me.ru_stime,
            "kids_user": kids.ru_utime, "kids_sys": kids.ru_stime,
            "minflt": float(me.ru_minflt + kids.ru_minflt), "rss_peak_mb": me.ru_maxrss / 1024}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--window", type=int, default=None,
                    help="as fr-analyze's --window (default: the whole ring, as below 8,192 dumps)")
    args = ap.parse_args()
    from frforensics._malloc import keep_freed_memory
    from frforensics.analyzer import AnalyzeOptions, analyze, load_dumps
    from frforensics.reporting import render

    keep_freed_memory()  # as fr-analyze's main() does
    marks: list[tuple[str, dict[str, float]]] = [("start", _sample())]
    dumps = load_dumps([args.path], jobs=args.jobs, window=args.window)
    marks.append((f"load ({len(dumps.digests)} ranks)", _sample()))
    report = analyze(dumps, options=AnalyzeOptions(),
                     progress=lambda phase, done, total: marks.append((phase, _sample())))
    body = render(report, "json")
    marks.append((f"render json ({len(body) // 1024} KiB)", _sample()))
    rows: list[dict[str, Any]] = []
    print(f"{args.path}: {report.status.value}, culprits {list(report.culprit_ranks)}\n")
    print("| phase | wall s | user s | sys s | workers' user s | workers' sys s "
          "| minor faults | peak RSS MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for (_, a), (name, b) in itertools.pairwise(marks):
        row = {"phase": name, **{k: round(b[k] - a[k], 3) for k in
                                 ("wall", "user", "sys", "kids_user", "kids_sys", "minflt")},
               "rss_peak_mb": round(b["rss_peak_mb"])}
        rows.append(row)
        print(f"| {name} | {row['wall']:.2f} | {row['user']:.2f} | {row['sys']:.2f} | "
              f"{row['kids_user']:.2f} | {row['kids_sys']:.2f} | {int(row['minflt']):,} | "
              f"{row['rss_peak_mb']:,} |")
    total = {k: round(marks[-1][1][k] - marks[0][1][k], 2)
             for k in ("wall", "user", "sys", "kids_user", "kids_sys")}
    print(f"\ntotal: {total}, load average {os.getloadavg()[0]:.2f}")
    if args.out:
        args.out.write_text(json.dumps({"path": args.path, "jobs": args.jobs, "rows": rows,
                                        "total": total}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
