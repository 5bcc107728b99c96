"""Dump sets for the benchmark, generated once under bench/data/ and reused.

* ``healthy-<N>``: a healthy TP 8 × DP job (no pipeline), 2000 entries per rank,
  8 frames per entry, as NCCL-style native pickles (``pg_config`` ranks filled,
  what ``torchfrtrace`` expects) — the job ``torchfrtrace`` analyzes in full.
* ``hang3d-<N>``: a TP 8 × PP 4 × DP job where one rank skips a TP collective.
* ``*/frdump``: the same dumps after ``fr-analyze convert``.
* ``clone-<N>/frdump``: a healthy TP 8 × DP job in frdump written by
  :func:`write_cloned_frdumps` (for 16,384 ranks, where simulating and pickling
  every rank would take the better part of an hour on two cores);
  ``clonehang-<N>-<E>-<H>/frdump`` the same job with rank ``H`` stuck.

A set is complete when its ``.complete`` marker exists; a half-written set is
regenerated.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from frforensics.formats import frdump
from frforensics.model import GroupInfo, RankTrace
from frforensics.testing import JobBuilder
from frforensics.testing.dumps import JobDumps

ENTRIES = 2000
STEPS = 200  # enough steps that every ring holds 2000 entries
PREFIX = "nccl_trace_rank_"
HANG_RANK = 13  # the rank of hang_job that skips a TP collective


def _fresh(path: Path) -> bool:
    if (path / ".complete").exists():
        return False
    if path.exists():
        shutil.rmtree(path)
    return True


def _done(path: Path, started: float) -> None:
    (path / ".complete").write_text(f"{time.time() - started:.1f} s\n")


def healthy_job(world: int) -> JobBuilder:
    return JobBuilder(world_size=world, tp=8, dp=world // 8, ring_size=ENTRIES, seed=0).steps(STEPS)


def hang_job(world: int) -> JobBuilder:
    return (JobBuilder(world_size=world, tp=8, pp=4, dp=world // 32, ring_size=ENTRIES, seed=0)
            .steps(STEPS).skip(rank=HANG_RANK, group="tp", step=STEPS - 2))


def native_set(root: Path, name: str, job: JobBuilder, *, jobs: int) -> Path:
    """``root/name/native``: the job's native pickles (generated once)."""
    out = root / name / "native"
    if _fresh(out):
        started = time.time()
        print(f"  generating {out} ...", flush=True)
        job.build().write_native(out, prefix=PREFIX, jobs=jobs)
        _done(out, started)
    return out


def converted_set(native: Path, *, jobs: int) -> Path:
    """``native/../frdump``: ``fr-analyze convert`` of a native set (once)."""
    out = native.parent / "frdump"
    if _fresh(out):
        started = time.time()
        print(f"  converting {native} -> {out} ...", flush=True)
        subprocess.run([sys.executable, "-m", "frforensics", "convert", str(native), str(out),
                        "--jobs", str(jobs)], check=True, stdout=subprocess.DEVNULL)
        _done(out, started)
    return out


def write_cloned_frdumps(out: Path, world: int, *, jobs: int, entries: int = ENTRIES,
                         hang: int | None = None) -> Path:
    """A healthy TP 8 × DP job of ``world`` ranks in frdump, by cloning one simulated rank.

    Every rank of a healthy TP × DP job runs the same program; the builder
    simulates a 64-rank job and each rank here is one of its ranks re-labelled:
    its rank, host, pid and group memberships (TP group ``r // 8``, DP group
    ``r % 8``) are those of rank ``r`` of the big job. Entries, names and stacks
    are identical to the simulated rank's.

    ``hang=H``: rank ``H`` stops issuing ops two steps before the end (the
    builder's ``stuck``) and the rest of the job waits on it, as the 64-rank
    template simulates it for its rank ``H % 8``: the ranks of ``H``'s TP group
    are the template's TP group 0 (which holds the stuck rank), every other TP
    group is a copy of the template's TP group 1 (a TP group whose DP peer in
    TP group 0 stopped). A rank's behaviour depends only on whether its TP
    group holds the stuck rank and on its DP index, and the big job's DP group
    ``d`` holds one rank of the first kind and the rest of the second, as the
    template's did, so the clone is a consistent job whose one culprit is ``H``.
    """
    if not _fresh(out):
        return out
    started = time.time()
    print(f"  generating {out} (cloned{'' if hang is None else f', rank {hang} stuck'}) ...", flush=True)
    out.mkdir(parents=True)
    template = _template(entries, None if hang is None else hang % 8).traces()

    def source(r: int) -> int:
        if hang is None:
            return r % 64
        return (0 if r // 8 == hang // 8 else 8) + r % 8

    def write(r: int) -> None:
        (out / f"frdump_rank_{r}").write_bytes(frdump.encode(_clone(template[source(r)], r, world)))

    _fan_out(world, jobs, write)
    _done(out, started)
    return out


def _fan_out(world: int, jobs: int, write: Callable[[int], None]) -> None:
    """``write(r)`` for every rank, in ``jobs`` forked children (rank ``r`` in child ``r % jobs``)."""
    pids = []
    for chunk in (range(i, world, jobs) for i in range(jobs)):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            try:
                for r in chunk:
                    write(r)
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)


def _template(entries: int, stuck: int | None = None) -> JobDumps:
    """The simulated 64-rank job clones are made of (rings of ``entries`` entries).

    ``stuck=h``: its rank ``h`` stops issuing two steps before the end.
    """
    steps = max(10, STEPS * entries // ENTRIES)
    job = JobBuilder(world_size=64, tp=8, dp=8, ring_size=entries, seed=0).steps(steps)
    if stuck is not None:
        job = job.stuck(rank=stuck, step=steps - 2, after=3)
    return job.build()


def write_cloned_native(out: Path, world: int, *, jobs: int, entries: int = ENTRIES) -> Path:
    """:func:`write_cloned_frdumps` as NCCL-style native pickles (``nccl_trace_rank_<r>``).

    Each rank is a simulated 64-rank job's rank ``r % 64`` with its groups'
    members (``pg_config``) those of rank ``r`` of the big TP 8 × DP job; names
    stay (groups are told apart by name *and* members).
    """
    if not _fresh(out):
        return out
    started = time.time()
    print(f"  generating {out} (cloned native) ...", flush=True)
    out.mkdir(parents=True)
    template = _template(entries)
    docs = template.native_docs()

    def write(r: int) -> None:
        doc = dict(docs[r % 64])
        config = {}
        for name, g in doc["pg_config"].items():
            if g["desc"] == "default_pg":
                ranks = list(range(world))
            elif "TENSOR" in g["desc"]:
                ranks = list(range(r // 8 * 8, r // 8 * 8 + 8))
            else:
                ranks = list(range(r % 8, world, 8))
            config[name] = {**g, "ranks": str(ranks)}
        doc["pg_config"] = config
        (out / f"{PREFIX}{r}").write_bytes(pickle.dumps(doc, protocol=2))

    _fan_out(world, jobs, write)
    _done(out, started)
    return out


def _hashed(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()


def _clone(t: RankTrace, rank: int, world: int) -> RankTrace:
    tp_group = rank // 8
    dp_index = rank % 8
    groups = []
    for g in t.groups:
        if g.desc == "default_pg" or g.ranks is None:
            groups.append(GroupInfo(g.name, g.desc, tuple(range(world)), g.backend))
        elif "TENSOR" in g.desc:
            ranks = tuple(range(tp_group * 8, tp_group * 8 + 8))
            groups.append(GroupInfo(_hashed(f"tp{tp_group}"), g.desc, ranks, g.backend))
        else:  # the data-parallel group
            ranks = tuple(range(dp_index, world, 8))
            groups.append(GroupInfo(_hashed(f"dp{dp_index}"), g.desc, ranks, g.backend))
    return replace(t, rank=rank, groups=tuple(groups),
                   header=replace(t.header, world_size=world, host=f"node{rank // 8:05d}",
                                  pid=10_000 + rank))
