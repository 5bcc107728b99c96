"""The speed benchmark: fr-analyze vs torchfrtrace on identical dump sets.

::

    python bench/run.py [--sizes 256,1024,4096] [--repeat 3] [--jobs N]
                        [--torch-max 1024] [--hang-size 1024] [--big-frdump 16384]
                        [--big-hang H] [--central 100000] [--central-dask-workers 8]
                        [--no-profile]
    python bench/run.py --dask [--dask-sets 16384:2000:frdump,4096:2000:native,...] [--jobs 2]

Generates (once, under bench/data/, see ``_datasets``) healthy TP 8 × DP jobs
of each size as native pickles and converted frdumps, a 3-D TP × PP × DP job
with a hang at 256 ranks, and a big frdump set; then, for each set and each
repeat, runs in turn ``torchfrtrace`` (up to ``--torch-max`` ranks: beyond
~2048 it does not fit in 24 GiB), ``fr-analyze`` on the pickles,
``fr-analyze`` on the frdumps and the unpickle-only floor, each in a fresh
process, measuring wall time and the peak RSS of its process tree. The big
frdump sets are a healthy clone and the same job with rank ``--big-hang`` stuck
(``_datasets.write_cloned_frdumps``); ``--central N`` adds ``curve.py``'s
central-step run at N ranks × 250 entries, and (``--central-dask-workers W``)
the same set read as a cluster reads it, ``--dask`` with ``W`` workers each
holding a shard (``curve.run_dask``), whose client step the 1,000-host estimate
uses. Prints a markdown table of medians
and issue 30's targets against what was measured, and writes them, with the
raw runs and a profile of fr-analyze at the largest size, to bench/results/.

``--dask`` instead compares, on cloned healthy TP 8 × DP jobs (``RANKS:ENTRIES:FORMAT``
per set, see ``_datasets.write_cloned_*``), ``fr-analyze DIR --jobs N`` (the local
process pool) with ``fr-analyze DIR --dask ADDRESS`` against a LocalCluster of
``--jobs`` single-threaded worker processes started here: time to verdict, CPU
time and peak RSS of the *central* process (the client alone for --dask; the
whole tree, pool workers included, for the local run), and whether the
verdicts agree.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _datasets as datasets
from _measure import Run, measure

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"  # --results
VENV_BIN = Path(sys.executable).parent
TORCHFRTRACE = os.environ.get("TORCHFRTRACE", str(VENV_BIN / "torchfrtrace"))
FR_ANALYZE = [sys.executable, "-m", "frforensics"]


def _median(runs: list[Run]) -> tuple[float, float, float]:
    """Median wall seconds, peak GiB, CPU seconds."""
    return (statistics.median(r.wall_s for r in runs),
            statistics.median(r.peak_rss_bytes for r in runs) / 2**30,
            statistics.median(r.cpu_s for r in runs))


def _culprits(path: Path) -> str:
    try:
        return ",".join(map(str, json.loads(path.read_text())["culprit_ranks"])) or "none"
    except (OSError, ValueError, KeyError):
        return "?"


def _bench_set(name: str, ranks: int, native: Path | None, frdump: Path | None, *, repeat: int,
               jobs: int, torch: bool, torch_flags: list[str], results: dict[str, dict[str, Any]]) -> None:
    tools: dict[str, list[str]] = {}
    if torch and native is not None:
        tools["torchfrtrace"] = [TORCHFRTRACE, str(native), "-p", datasets.PREFIX, *torch_flags]
    if native is not None:
        tools["fr-analyze native"] = [*FR_ANALYZE, str(native), "--format", "json", "--jobs", str(jobs)]
    if frdump is not None:
        tools["fr-analyze frdump"] = [*FR_ANALYZE, str(frdump), "--format", "json", "--jobs", str(jobs)]
    if native is not None:
        floor = [sys.executable, str(ROOT / "_floor.py"), str(native), "--jobs", str(jobs)]
        tools["unpickle floor"] = floor
        tools["unpickle floor (no gc)"] = [*floor, "--no-gc"]
    runs: dict[str, list[Run]] = {tool: [] for tool in tools}
    verdicts: dict[str, str] = {}
    out = RESULTS / "last-report.json.tmp"
    for i in range(repeat):
        for tool, cmd in tools.items():  # alternate tools within each repeat
            run = measure(cmd, stdout=out if tool.startswith("fr-analyze") else None)
            runs[tool].append(run)
            if tool.startswith("fr-analyze"):
                verdicts[tool] = _culprits(out)
            print(f"  {name} [{i + 1}/{repeat}] {tool:24s} {run.wall_s:8.2f} s wall "
                  f"{run.cpu_s:8.2f} s cpu {run.peak_rss_bytes / 2**30:6.2f} GiB rc={run.returncode}",
                  flush=True)
    results[name] = {
        "ranks": ranks,
        "runs": {t: [r.__dict__ for r in rs] for t, rs in runs.items()},
        "median": {t: _median(rs) for t, rs in runs.items() if rs},
        "culprits": verdicts,
    }


def _profile(native: Path, jobs: int) -> str:
    """cProfile of the main process (merge + analysis) and of one worker's per-rank work."""
    from frforensics.analyzer import analyze, load_dumps
    from frforensics.analyzer.load import DumpSource, _decode_batch

    text = io.StringIO()
    prof = cProfile.Profile()
    started = time.perf_counter()
    prof.enable()
    dumps = load_dumps([native], jobs=jobs)
    loaded = time.perf_counter()
    analyze(dumps)
    prof.disable()
    done = time.perf_counter()
    text.write(f"main process, {len(dumps.digests)} ranks, jobs={jobs}: load {loaded - started:.2f} s "
               f"(workers decode; main waits and receives digests), analyze {done - loaded:.2f} s\n\n")
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    files = sorted(p for p in native.iterdir() if not p.name.startswith("."))[:64]
    prof = cProfile.Profile()
    prof.enable()
    _decode_batch([DumpSource(label=str(p), path=str(p)) for p in files], None, 32)
    prof.disable()
    text.write(f"\none worker, decode + digest of {len(files)} ranks, in process:\n\n")
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    return text.getvalue()


def _table(results: dict[str, dict[str, Any]], torch_fit: tuple[float, float] | None) -> str:
    head = ("| set | ranks | torchfrtrace wall s / cpu s / GiB | fr-analyze (pickles) wall / cpu / GiB "
            "| speedup wall (cpu) | fr-analyze (frdump) wall / cpu / GiB | speedup wall (cpu) "
            "| unpickle floor wall / cpu (no-gc floor) | fr-analyze / floor, wall (cpu) "
            "[no-gc floor] | culprits (ours) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in results.items():
        med = r["median"]
        ranks = r["ranks"]
        torch = med.get("torchfrtrace")
        torch_txt = f"{torch[0]:.2f} / {torch[2]:.2f} / {torch[1]:.2f}" if torch else "—"
        torch_s = torch[0] if torch else None
        torch_cpu = torch[2] if torch else None
        if torch is None and torch_fit is not None:
            torch_s = torch_fit[0] + torch_fit[1] * ranks
            torch_cpu = None
            torch_txt = f"~{torch_s:.0f} (extrapolated wall)"
        cells = [name, str(ranks), torch_txt]
        for tool in ("fr-analyze native", "fr-analyze frdump"):
            m = med.get(tool)
            if m is None:
                cells += ["—", "—"]
                continue
            cells.append(f"{m[0]:.2f} / {m[2]:.2f} / {m[1]:.2f}")
            speed = f"{torch_s / m[0]:.1f}×" if torch_s else "—"
            if torch_cpu:
                speed += f" ({torch_cpu / m[2]:.1f}×)"
            cells.append(speed)
        floor, floor_nogc = med.get("unpickle floor"), med.get("unpickle floor (no gc)")
        ours = med.get("fr-analyze native")
        if floor and floor_nogc and ours:
            cells.append(f"{floor[0]:.2f} / {floor[2]:.2f} ({floor_nogc[0]:.2f} / {floor_nogc[2]:.2f})")
            cells.append(f"{ours[0] / floor[0]:.2f} ({ours[2] / floor[2]:.2f}) "
                         f"[{ours[0] / floor_nogc[0]:.2f} ({ours[2] / floor_nogc[2]:.2f})]")
        else:
            cells += ["—", "—"]
        cells.append(" ".join(f"{k.split()[-1]}: {v}" for k, v in r["culprits"].items()) or "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: issue 30's 1,000-host estimate: ranks a host, the wire format's worst case a
#: rank (docs/scaling.md) and the link to the driver
HOSTS, WIRE_BYTES_PER_RANK, LINK_BYTES_S = 1000, 12 * 1024, 1.25e9


def _targets(results: dict[str, dict[str, Any]], central: dict[str, Any] | None) -> str:
    """Issue 30's targets, each against what this run measured."""
    rows: list[tuple[str, str, str]] = []

    def yes(ok: bool) -> str:
        return "**yes**" if ok else "no"

    for name, r in results.items():
        m = r["median"].get("fr-analyze frdump")
        if not name.startswith("clone") or m is None:
            continue
        want = r.get("expect", "none")
        got = r["culprits"].get("fr-analyze frdump", "?")
        rows.append((f"{name}: < 30 s wall, ≤ 2 GiB peak, culprits {want}",
                     f"{m[0]:.1f} s, {m[1]:.2f} GiB, culprits {got}",
                     f"wall {yes(m[0] < 30)}, memory {yes(m[1] <= 2)}, verdict {yes(got == want)}"))
    for name, r in results.items():
        med = r["median"]
        if not name.startswith("hang3d"):
            continue
        torch, ours, floor = med.get("torchfrtrace"), med.get("fr-analyze frdump"), med.get("unpickle floor")
        if torch and ours:
            rows.append((f"{name}: ≥ 20× torchfrtrace (frdump, wall)",
                         f"{torch[0]:.2f} s / {ours[0]:.2f} s = {torch[0] / ours[0]:.1f}×",
                         yes(torch[0] / ours[0] >= 20)))
        native = med.get("fr-analyze native")
        if native and floor:
            rows.append((f"{name}: PyTorch's pickles ≤ the parallel-unpickle floor (wall)",
                         f"{native[0]:.2f} s / {floor[0]:.2f} s = {native[0] / floor[0]:.2f}",
                         yes(native[0] <= floor[0])))
    if central is not None:
        n = central["ranks"]
        step = central["receive_cpu_s"] + central["analyze_cpu_s"]
        rows.append((f"{n:,} ranks × {central['entries']} entries: central step < 10 s "
                     f"(receive + analyze CPU; verdict {central['status']})",
                     f"{step:.1f} s, peak {central['central_peak_gib']:.2f} GiB", yes(step < 10)))
        dask = central.get("dask")
        if dask is not None:  # what a cluster runs: --dask, each worker its own shard
            per_host = dask["workers_cpu_s"] / HOSTS
            step = dask["receive_cpu_s"] + dask["analyze_cpu_s"]
            how = (f"the --dask client's receive + analyze CPU as measured with "
                   f"{dask['workers']} workers each holding a shard, verdict {dask['status']}")
        else:
            per_host = central["workers_cpu_s"] / HOSTS
            how = "the local pool's central step as measured"
        wire = n * WIRE_BYTES_PER_RANK / LINK_BYTES_S
        estimate = per_host + wire + step
        rows.append((f"{n:,} ranks on {HOSTS:,} hosts: estimate < 30 s (a host decodes its "
                     f"{n // HOSTS} ranks on one core; {WIRE_BYTES_PER_RANK // 1024} KiB a rank "
                     f"over {LINK_BYTES_S * 8 / 1e9:.0f} Gb/s; {how})",
                     f"{per_host:.2f} + {wire:.2f} + {step:.1f} = {estimate:.1f} s", yes(estimate < 30)))
    lines = ["| target (issue 30) | measured | met |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def _fit(results: dict[str, dict[str, Any]]) -> tuple[float, float] | None:
    pts = [(r["ranks"], r["median"]["torchfrtrace"][0]) for n, r in results.items()
           if n.startswith("healthy") and "torchfrtrace" in r["median"]]
    if len(pts) < 2:
        return None
    xs, ys = zip(*pts, strict=True)
    slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
    return ys[0] - slope * xs[0], slope


def _bench_dask(args: argparse.Namespace) -> None:
    import distributed

    out = RESULTS / "last-report.json.tmp"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows: list[dict[str, Any]] = []
    extra = ""
    with distributed.LocalCluster(n_workers=args.jobs, threads_per_worker=1, processes=True,
                                  dashboard_address=None, silence_logs=40) as cluster:
        address = cluster.scheduler_address
        with distributed.Client(cluster, set_as_default=False) as warm:  # imports, not timed
            warm.run(_warm_worker)
        for spec in args.dask_sets.split(","):
            r_s, e_s, fmt = spec.split(":")
            ranks, entries = int(r_s), int(e_s)
            writer = datasets.write_cloned_frdumps if fmt == "frdump" else datasets.write_cloned_native
            print(f"dump set {ranks} ranks x {entries} entries, {fmt}:", flush=True)
            path = writer(args.data / f"clone-{ranks}-{entries}" / fmt, ranks, jobs=args.jobs,
                          entries=entries)
            row: dict[str, Any] = {"ranks": ranks, "entries": entries, "format": fmt}
            local = [*FR_ANALYZE, str(path), "--format", "json", "--jobs", str(args.jobs)]
            for tool, cmd in (
                ("local", local),
                ("local-w512", [*local, "--window", "512"]),
                ("dask", [*FR_ANALYZE, str(path), "--format", "json", "--dask", address]),
            ):
                run = measure(cmd, stdout=out, timeout_s=args.dask_timeout)
                row[tool] = run.__dict__
                row[f"{tool} culprits"] = _culprits(out)
                try:
                    doc = json.loads(out.read_text())
                    row[f"{tool} loaded"] = len(doc["ranks_loaded"])
                except (OSError, ValueError, KeyError):
                    row[f"{tool} loaded"] = None
                print(f"  {ranks} x {entries} {fmt:7s} {tool:6s} {run.wall_s:8.2f} s wall "
                      f"{run.cpu_s:8.2f} s cpu {run.peak_rss_bytes / 2**30:6.2f} GiB "
                      f"rc={run.returncode} loaded={row[f'{tool} loaded']}", flush=True)
            rows.append(row)
            _dask_table(rows, args, stamp, extra=extra)  # after every set: a run cut short keeps it
            if not args.no_profile and spec == args.dask_profile:
                # right after its set: a run cut short still has it
                extra = (f"\n## Profile of the central process, {ranks} × {entries} {fmt}\n\n"
                         f"```\n{_profile_dask(path, address)}```\n")
                _dask_table(rows, args, stamp, extra=extra)


def _warm_worker() -> None:
    """Import what a decode task needs, so the first timed run does not pay for it."""
    import frforensics.analyzer.cluster
    import frforensics.formats.sources  # noqa: F401


def _profile_dask(path: Path, address: str) -> str:
    """cProfile of the central process of an --dask run: streaming the digests in, then analyze."""
    import resource

    from frforensics.analyzer import analyze
    from frforensics.analyzer.cluster import load_dumps_dask

    text = io.StringIO()
    prof = cProfile.Profile()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    prof.enable()
    dumps = load_dumps_dask([str(path)], address)
    loaded = time.perf_counter()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    analyze(dumps)
    prof.disable()
    done = time.perf_counter()
    rss2 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    text.write(f"{len(dumps.digests)} ranks: load {loaded - started:.2f} s (workers decode, this "
               f"process receives and decodes the wire payloads), analyze {done - loaded:.2f} s; "
               f"peak RSS {rss0 / 2**20:.2f} GiB before, {rss1 / 2**20:.2f} GiB after the load, "
               f"{rss2 / 2**20:.2f} GiB after the analysis\n\n")
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def _dask_table(rows: list[dict[str, Any]], args: argparse.Namespace, stamp: str,
                extra: str = "") -> None:
    head = ("| ranks × entries | format | local pool, whole ring: wall s / cpu s / GiB (tree) "
            "| local pool, --window 512 | --dask (window 512): wall s / client cpu s / client GiB "
            "| ranks loaded (local, w512, dask) | same verdict |")
    lines = [head, "|---|---|---|---|---|---|---|"]

    def cell(run: dict[str, Any] | None) -> str:
        if run is None:
            return "-"
        return (f"{run['wall_s']:.2f} / {run['cpu_s']:.2f} / "
                f"{run['peak_rss_bytes'] / 2**30:.2f}")

    for r in rows:
        culprits = {r.get(f"{t} culprits") for t in ("local", "local-w512", "dask") if t in r}
        lines.append(
            f"| {r['ranks']} × {r['entries']} | {r['format']} "
            f"| {cell(r.get('local'))} | {cell(r.get('local-w512'))} | {cell(r.get('dask'))} "
            f"| {r.get('local loaded')}, {r.get('local-w512 loaded')}, {r.get('dask loaded')} "
            f"| {'yes' if len(culprits) == 1 else 'NO'} ({r.get('dask culprits')}) |")
    body = (f"fr-analyze --dask (LocalCluster, {args.jobs} worker processes) vs the local pool "
            f"(--jobs {args.jobs}), {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}, "
            f"one run each\n\n" + "\n".join(lines) + "\n" + extra)
    (RESULTS / f"bench-dask-{stamp}.md").write_text(body)
    (RESULTS / f"bench-dask-{stamp}.json").write_text(json.dumps(rows, indent=1))
    print()
    print(body)


def main() -> None:
    global RESULTS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256,1024,4096")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--torch-max", type=int, default=1024)
    ap.add_argument("--hang-size", type=int, default=1024, help="0: skip the 3-D hang set")
    ap.add_argument("--big-frdump", type=int, default=16384, help="0: skip")
    ap.add_argument("--big-hang", type=int, default=None,
                    help="the stuck rank of the big hang set (default: one 3/5 of the way in); -1: skip")
    ap.add_argument("--central", type=int, default=100_000,
                    help="ranks of the central-step run (curve.py, 250 entries); 0: skip")
    ap.add_argument("--central-dask-workers", type=int, default=8,
                    help="the central-step set read as a cluster would (curve.py --dask-workers); "
                         "0: skip")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--data", type=Path, default=ROOT / "data")
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="folder for the tables (CI's smoke run: a temporary one)")
    ap.add_argument("--dask", action="store_true", help="the --dask comparison instead")
    ap.add_argument("--dask-sets",
                    default="16384:2000:frdump,16384:500:frdump,32768:250:frdump,4096:2000:native",
                    help="RANKS:ENTRIES:FORMAT of the cloned sets for --dask (frdump or native)")
    ap.add_argument("--dask-timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--dask-profile", default="16384:2000:frdump",
                    help="the set whose central process is profiled (right after its runs)")
    args = ap.parse_args()
    RESULTS = args.results
    if args.dask:
        RESULTS.mkdir(parents=True, exist_ok=True)
        _bench_dask(args)
        return
    sizes = [int(s) for s in args.sizes.split(",") if s]
    RESULTS.mkdir(parents=True, exist_ok=True)

    print("dump sets:", flush=True)
    sets: list[tuple[str, int, Path | None, Path | None, list[str]]] = []
    expect: dict[str, str] = {}  # the culprits a set's verdict must name ("none" by default)
    for n in sizes:
        native = datasets.native_set(args.data, f"healthy-{n}", datasets.healthy_job(n), jobs=args.jobs)
        sets.append((f"healthy-{n}", n, native, datasets.converted_set(native, jobs=args.jobs), []))
    if args.hang_size:
        n = args.hang_size
        native = datasets.native_set(args.data, f"hang3d-{n}", datasets.hang_job(n), jobs=args.jobs)
        sets.append((f"hang3d-{n}", n, native, datasets.converted_set(native, jobs=args.jobs),
                     ["--allow-incomplete-ranks"]))
    if args.big_frdump:
        n = args.big_frdump
        big = datasets.write_cloned_frdumps(args.data / f"clone-{n}" / "frdump", n, jobs=args.jobs)
        sets.append((f"clone-{n} (frdump only)", n, None, big, []))
        hung = n * 3 // 5 // 8 * 8 + 5 if args.big_hang is None else args.big_hang
        if 0 <= hung < n:
            path = datasets.write_cloned_frdumps(
                args.data / f"clonehang-{n}-{datasets.ENTRIES}-{hung}" / "frdump", n, jobs=args.jobs,
                hang=hung)
            sets.append((f"clone-{n}, rank {hung} stuck (frdump only)", n, None, path, []))
            expect[sets[-1][0]] = str(hung)

    results: dict[str, dict[str, Any]] = {}
    for name, n, native_dir, frdump_dir, flags in sets:
        print(f"{name}:", flush=True)
        _bench_set(name, n, native_dir, frdump_dir, repeat=args.repeat, jobs=args.jobs,
                   torch=n <= args.torch_max, torch_flags=flags, results=results)
        default = str(datasets.HANG_RANK) if name.startswith("hang3d") else "none"
        results[name]["expect"] = expect.get(name, default)
    central = None
    if args.central:
        from curve import run_one

        path = datasets.write_cloned_frdumps(args.data / f"clone-{args.central}-250" / "frdump",
                                             args.central, jobs=args.jobs, entries=250)
        print(f"central step, {args.central} ranks x 250 entries:", flush=True)
        central = {"ranks": args.central, "entries": 250, **run_one(path, args.central, args.jobs)}
        if args.central_dask_workers:
            from curve import run_dask

            print(f"  --dask, {args.central_dask_workers} workers each holding a shard:", flush=True)
            central["dask"] = run_dask(path, args.central, args.central_dask_workers)
    table = _table(results, _fit(results)) + "\n\n" + _targets(results, central)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    header = (f"fr-analyze vs torchfrtrace, medians of {args.repeat} runs, --jobs {args.jobs}, "
              f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M')}\n\n")
    body = header + table + "\n"
    if not args.no_profile:
        largest = max((s for s in sets if s[2] is not None), key=lambda s: s[1])
        body += f"\n## Profile ({largest[0]})\n\n```\n{_profile(largest[2], args.jobs)}```\n"  # type: ignore[arg-type]
    (RESULTS / f"bench-{stamp}.md").write_text(body)
    (RESULTS / f"bench-{stamp}.json").write_text(json.dumps({**results, "central": central}, indent=1))
    print()
    print(body)


if __name__ == "__main__":
    main()
