"""Frontiers and error paths: where each rank stopped, and what it did after it failed.

A shared pass of the merge (``build_job`` runs it once; the detectors only read
its result on the :class:`~frforensics.analyzer.merge.JobModel`). Two facts:

**Frontiers (PyTorch's gloo dumps).** A member's *frontier* in a group is the
newest collective seq its dump holds there. PyTorch's gloo recorder has no
failure state: it marks an entry ``retired`` when its work ends, successfully or
not, and ``pg_status.last_completed_collective`` advances on a failure too
(measured, torch 2.13: ranks 0, 2, 3 all-reduce #6 after rank 1 raised and left;
the op fails with "Connection closed by peer", is retired, and
``last_completed_collective`` reads 6 on all three; torch-2.13-facts.md). A
collective runs only when every member enters it, so an entry retired at a seq
beyond another dumped member's frontier cannot have completed: it failed (or was
abandoned). Those entries are marked ``FAILED`` here, and the group's lowest
frontier (``JobModel.frontier_limit``) bounds what the rules compare across its
members. Only in dumps whose states come from retirement alone (PyTorch's
pickles and JSON without GPU progress); our own dumps record failures, and
NCCL's states are read off CUDA events.

Worked example (PyTorch's gloo dumps; rank 1 leaves the loop early)::

    rank 1: newest all_reduce #7 (retired); ranks 0, 2, 3: #8 retired
    -> #8 marked failed on 0, 2, 3; frontier_limit[default_pg] = 7
    -> the wait graph sees 0, 2, 3 stopped in #8 waiting for rank 1: missing_rank, rank 1

**Error paths (every dump).** What a rank issued after its own first failed op
is its error path — a framework's error handling (Lightning's SIGTERM-flag
broadcast, a logging barrier) issues new collectives in whatever order each
survivor reaches them — never the program's order: ``JobModel.error_from``
holds, per rank, the first row after its first failed op, and the rules that
compare ops across ranks (the signature pass: op, size, dtype) do not read rows
from there on.

Worked example (our dumps; rank 1 ``os._exit``s; ranks 0, 2, 3 fail in all_reduce
#8, then rank 0 calls barrier, ranks 2, 3 broadcast, as seq #9)::

    error_from = {0: row of #9, 2: row of #9, 3: row of #9}
    -> #9 is not compared: no op_mismatch; rank 1 is the dead rank
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from frforensics.analyzer.digest import ranks_with_other
from frforensics.model import OpState, SourceFormat
from frforensics.report import format_ranks

if TYPE_CHECKING:
    from frforensics.analyzer.digest import RankDigest
    from frforensics.analyzer.merge import JobModel

__all__ = ["mark_frontiers", "retirement_only"]


def retirement_only(d: RankDigest) -> bool:
    """The digest's states come from retirement alone: PyTorch's own dump of a
    gloo group (no failure state, no GPU progress)."""
    return d.header.format is not SourceFormat.FRDUMP and not d.gpu_states


def mark_frontiers(job: JobModel) -> list[str]:
    """Mark retired entries beyond a group's lowest frontier as failed (module
    doc), set ``job.frontier_limit`` and ``job.error_from``; the notes to add."""
    notes: list[str] = []
    if any(retirement_only(d) for d in job.digests.values()):
        notes.extend(_mark(job))
    error_from: dict[int, int] = {}
    ranks = list(job.digests)
    failing = ranks_with_other([job.digests[r] for r in ranks], "state", OpState.FAILED,
                               same=True)
    for i in np.flatnonzero(failing).tolist():
        rank, d = ranks[i], job.digests[ranks[i]]
        failed = np.flatnonzero(d.state == OpState.FAILED)
        if len(failed) and int(failed[0]) + 1 < len(d):
            error_from[rank] = int(failed[0]) + 1
    job.error_from = error_from
    return notes


def _mark(job: JobModel) -> list[str]:
    limit: dict[int, int] = {}
    for group in job.groups:
        fronts = {}
        for m in job.dumped_members(group.gid):
            view = job.view(m, group.gid)
            if view is not None and len(view.coll_rows):
                fronts[m] = view.max_seq
        if len(fronts) >= 2 and min(fronts.values()) != max(fronts.values()):
            limit[group.gid] = min(fronts.values())
    job.frontier_limit = limit
    if not limit:
        return []
    marked: dict[int, int] = {}
    for rank, d in list(job.digests.items()):
        if not retirement_only(d):
            continue
        beyond = np.zeros(len(d), dtype=np.bool_)
        for local in range(len(d.groups)):
            gid = job.group_of.get((rank, local))
            if gid is None or gid not in limit:
                continue
            view = job.view(rank, gid)
            if view is None:
                continue
            rows = view.coll_rows[d.seq[view.coll_rows] > limit[gid]]
            beyond[rows] = True
        beyond &= d.state == OpState.COMPLETED
        if not beyond.any():
            continue
        state = d.state.copy()
        state[beyond] = OpState.FAILED
        details = {row: (det._replace(state=OpState.FAILED) if beyond[row] else det)
                   for row, det in d.details.items()}
        job.digests[rank] = replace(d, state=state, details=details)
        marked[rank] = int(beyond.sum())
    job.reset_caches()
    if not marked:
        return []
    ranks = sorted(marked)
    return [f"PyTorch's gloo dumps record no failure (a failed op is retired as a completed "
            f"one is): {sum(marked.values())} retired collective(s) on rank(s) "
            f"{format_ranks(ranks)} lie beyond a fellow member's newest op, so they cannot have "
            f"run: read as failed"]

