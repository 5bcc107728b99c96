"""The central step's growth, 1k to 64k ranks (issue #15): one run per size.

    python bench/curve.py [--sizes 1024,4096,16384,32768,65536] [--entries 250] [--jobs 2]
                          [--data DIR] [--results DIR]

Each size is a healthy TP 8 × DP job in frdump (``_datasets.write_cloned_frdumps``,
rings of ``--entries`` entries, generated once under ``DIR/clone-<N>-<entries>``).
Each run is a fresh Python process that loads the set with the local pool
(``load_dumps(jobs=...)``: the pool workers decode and digest, the main process
receives the digests) and then analyzes it, and reports by phase, from
``getrusage``: the main process's CPU (``RUSAGE_SELF``: the central step,
receive + analyze) apart from the pool workers' (``RUSAGE_CHILDREN``), wall
time of each phase and the main process's peak RSS. The child keeps freed
memory for reuse as ``fr-analyze`` does (``frforensics._malloc``). On a cluster the workers'
part divides by the hosts; the main process's part is what stays central.
Writes ``bench/results/curve-<stamp>.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

_CHILD = r"""
import json, resource, sys, time
from frforensics.analyzer import AnalyzeOptions, analyze
from frforensics.analyzer.load import load_dumps

from frforensics._malloc import keep_freed_memory
keep_freed_memory()  # as fr-analyze's main() does
path, jobs, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def usage():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime
t0 = time.perf_counter(); s0, c0 = usage()
ds = load_dumps([path], jobs=jobs)
t1 = time.perf_counter(); s1, c1 = usage()
report = analyze(ds, options=AnalyzeOptions(world_size=world))
t2 = time.perf_counter(); s2, c2 = usage()
print(json.dumps({
    "ranks_loaded": len(report.ranks_loaded), "status": report.status.value,
    "culprits": list(report.culprit_ranks), "problems": len(ds.problems),
    "load_wall_s": t1 - t0, "workers_cpu_s": c1 - c0, "receive_cpu_s": s1 - s0,
    "analyze_wall_s": t2 - t1, "analyze_cpu_s": s2 - s1,
    "central_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
}))
"""


def run_one(path: Path, world: int, jobs: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT.parent / "src"))
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(jobs), str(world)],
                          capture_output=True, text=True, env=env, check=True, timeout=3600)
    out: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,4096,16384,32768,65536")
    ap.add_argument("--entries", type=int, default=250)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--data", type=Path, default=ROOT / "data")
    ap.add_argument("--results", type=Path, default=ROOT / "results",
                    help="folder for the tables (CI's smoke run: a temporary one)")
    args = ap.parse_args()
    from _datasets import write_cloned_frdumps

    rows = []
    for world in (int(s) for s in args.sizes.split(",")):
        path = write_cloned_frdumps(args.data / f"clone-{world}-{args.entries}" / "frdump", world,
                                    jobs=args.jobs, entries=args.entries)
        row = {"ranks": world, "entries": args.entries, **run_one(path, world, args.jobs)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / f"curve-{stamp}"
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [f"# Central-step curve, {args.entries} entries per rank, local pool --jobs {args.jobs}",
             "",
             f"`python bench/curve.py --sizes {args.sizes} --entries {args.entries}`, "
             f"{time.strftime('%Y-%m-%d %H:%M')}, one run per size.",
             "",
             "| ranks | load wall s | workers CPU s (ms/rank) | receive CPU s | analyze wall / CPU s "
             "| central CPU s (ms/rank) | central peak GiB | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        central = r["receive_cpu_s"] + r["analyze_cpu_s"]
        lines.append(
            f"| {r['ranks']:,} | {r['load_wall_s']:.1f} | {r['workers_cpu_s']:.1f} "
            f"({1e3 * r['workers_cpu_s'] / r['ranks']:.2f}) | {r['receive_cpu_s']:.1f} | "
            f"{r['analyze_wall_s']:.1f} / {r['analyze_cpu_s']:.1f} | {central:.1f} "
            f"({1e3 * central / r['ranks']:.2f}) | {r['central_peak_gib']:.2f} | "
            f"{r['status']} ({r['ranks_loaded']} loaded) |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
