"""The central step's growth, 1k to 64k ranks (issue #15): one run per size.

    python bench/curve.py [--sizes 1024,4096,16384,32768,65536] [--entries 250] [--jobs 2]
                          [--dask-workers W] [--data DIR] [--results DIR]

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

``--dask-workers W`` (issue 30, item 5) adds, per size, the run a cluster makes:
``fr-analyze``'s ``--dask`` load on a ``LocalCluster`` of ``W`` single-threaded
worker processes, each holding a disjoint shard of the set as a host holds its
own ranks (contiguous blocks of ``N / W`` ranks, hard links under
``DIR/clone-<N>-<entries>/shards-<W>/<worker>``, read as ``shards-<W>/{worker}``):
the workers list, decode and digest their own shard and send the digests back
in the wire format; a fresh client process receives them and analyzes. Reported:
the workers' CPU (all of them, and the busiest one's: the slowest host), the
client's CPU receiving (connection excluded) and analyzing, its peak RSS, and
the estimate on 1,000 hosts from these figures (each host decodes its 100 ranks
on one core at the measured per-rank worker cost; 12 KiB a rank over a 10 Gb/s
link into the client; then the client's step as measured, receive and analysis
added although they overlap the workers on a real cluster).
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
from typing import Any

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


_DASK_CHILD = r"""
import json, resource, sys, time
import distributed
from frforensics.analyzer import AnalyzeOptions, analyze
from frforensics.analyzer.cluster import load_dumps_dask

from frforensics._malloc import keep_freed_memory
keep_freed_memory()  # as fr-analyze's main() does
pattern, address, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
def cpu():
    s = resource.getrusage(resource.RUSAGE_SELF)
    return s.ru_utime + s.ru_stime
client = distributed.Client(address, set_as_default=False, timeout=60)  # not timed
t0 = time.perf_counter(); s0 = cpu()
ds = load_dumps_dask([pattern], client)
t1 = time.perf_counter(); s1 = cpu()
report = analyze(ds, options=AnalyzeOptions(world_size=world))
t2 = time.perf_counter(); s2 = cpu()
print(json.dumps({
    "ranks_loaded": len(report.ranks_loaded), "status": report.status.value,
    "culprits": list(report.culprit_ranks), "problems": len(ds.problems),
    "load_wall_s": t1 - t0, "receive_cpu_s": s1 - s0,
    "analyze_wall_s": t2 - t1, "analyze_cpu_s": s2 - s1,
    "central_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
}))
client.close()
"""

#: the 1,000-host estimate's assumptions (docs/performance.md)
HOSTS = 1000
WIRE_BYTES_PER_RANK = 12 * 1024
LINK_BYTES_S = 10e9 / 8


def _shards(path: Path, world: int, workers: int) -> Path:
    """``path/../shards-<workers>/<k>``: hard links to ranks ``[k N/W, (k+1) N/W)`` (made once)."""
    root = path.parent / f"shards-{workers}"
    if (root / ".complete").exists():
        return root
    for k in range(workers):
        folder = root / str(k)
        folder.mkdir(parents=True, exist_ok=True)
        for r in range(k * world // workers, (k + 1) * world // workers):
            link = folder / f"frdump_rank_{r}"
            if not link.exists():
                os.link(path / f"frdump_rank_{r}", link)
    (root / ".complete").write_text("")
    return root


def _worker_cpu() -> float:
    import resource

    s = resource.getrusage(resource.RUSAGE_SELF)
    return float(s.ru_utime + s.ru_stime)


def _warm_worker() -> None:
    """What a decode task imports, imported before the timed run."""
    import frforensics.analyzer.cluster
    import frforensics.formats.sources  # noqa: F401


def run_dask(path: Path, world: int, workers: int) -> dict[str, Any]:
    """The ``--dask`` load of ``path`` sharded over ``workers`` workers, then the analysis."""
    import distributed

    shards = _shards(path, world, workers)
    env = dict(os.environ, PYTHONPATH=str(ROOT.parent / "src"))
    with (distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                   dashboard_address=None, silence_logs=40) as cluster,
          distributed.Client(cluster, set_as_default=False) as client):
        client.wait_for_workers(workers, timeout=300)
        client.run(_warm_worker)
        before = client.run(_worker_cpu)
        proc = subprocess.run([sys.executable, "-c", _DASK_CHILD, str(shards / "{worker}"),
                               cluster.scheduler_address, str(world)],
                              capture_output=True, text=True, env=env, check=True, timeout=3600)
        after = client.run(_worker_cpu)
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    spent = [after[a] - before[a] for a in before if a in after]
    out.update(workers=workers, workers_cpu_s=sum(spent), busiest_worker_cpu_s=max(spent))
    per_rank = out["workers_cpu_s"] / world
    out["estimate"] = {
        "hosts": HOSTS, "host_decode_s": per_rank * world / HOSTS,
        "link_s": world * WIRE_BYTES_PER_RANK / LINK_BYTES_S,
        "central_s": out["receive_cpu_s"] + out["analyze_cpu_s"]}
    out["estimate"]["total_s"] = sum(v for k, v in out["estimate"].items() if k != "hosts")
    return out


def _dask_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["", "## `--dask`, each worker holding a disjoint shard (issue 30, item 5)", "",
             "| ranks | workers | load wall s | workers CPU s (ms/rank; busiest worker s) "
             "| client receive CPU s | analyze wall / CPU s | client step CPU s | client peak GiB "
             "| verdict | estimate on 1,000 hosts: decode + link + client step = s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d, e = r["dask"], r["dask"]["estimate"]
        lines.append(
            f"| {r['ranks']:,} | {d['workers']} | {d['load_wall_s']:.1f} | {d['workers_cpu_s']:.1f} "
            f"({1e3 * d['workers_cpu_s'] / r['ranks']:.2f}; {d['busiest_worker_cpu_s']:.1f}) "
            f"| {d['receive_cpu_s']:.1f} | {d['analyze_wall_s']:.1f} / {d['analyze_cpu_s']:.1f} "
            f"| {e['central_s']:.1f} | {d['central_peak_gib']:.2f} "
            f"| {d['status']} ({d['ranks_loaded']} loaded) "
            f"| {e['host_decode_s']:.2f} + {e['link_s']:.2f} + {e['central_s']:.1f} = "
            f"{e['total_s']:.1f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,4096,16384,32768,65536")
    ap.add_argument("--entries", type=int, default=250)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--dask-workers", type=int, default=0,
                    help="also the --dask load with this many workers, each its own shard (0: no)")
    ap.add_argument("--data", type=Path, default=ROOT / "data")
    ap.add_argument("--results", type=Path, default=ROOT / "results",
                    help="folder for the tables (CI's smoke run: a temporary one)")
    args = ap.parse_args()
    from _datasets import write_cloned_frdumps

    rows = []
    for world in (int(s) for s in args.sizes.split(",")):
        path = write_cloned_frdumps(args.data / f"clone-{world}-{args.entries}" / "frdump", world,
                                    jobs=args.jobs, entries=args.entries)
        row: dict[str, Any] = {"ranks": world, "entries": args.entries,
                               **run_one(path, world, args.jobs)}
        print(json.dumps(row), flush=True)
        if args.dask_workers:
            row["dask"] = run_dask(path, world, args.dask_workers)
            print(json.dumps(row["dask"]), flush=True)
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
    if args.dask_workers:
        lines += _dask_lines(rows)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
