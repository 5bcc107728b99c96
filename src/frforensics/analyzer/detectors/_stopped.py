"""Where ranks stopped beside ranks without a dump: shared by ``missing_dump`` and
``missing_rank`` (rules never import each other; pyproject's import contract).

``stopped_with_missing`` finds the ranks at the end of wait chains that stopped right
after an op shared with ranks that left no dump (PyTorch's gloo dumps), and
``stopped_finding`` is the finding naming those ranks (``missing_dump`` for ranks
without a dump, ``missing_rank`` for ranks whose dump never reached the op).
"""

from __future__ import annotations

import numpy as np

from frforensics.analyzer.context import Context
from frforensics.analyzer.detectors._cascade import cascade
from frforensics.model import OpState, SourceFormat
from frforensics.report import Finding, FindingKind, Severity

__all__ = ["stale_ranks", "stopped_finding", "stopped_with_missing"]


def stale_ranks(ctx: Context) -> set[int]:
    """Ranks whose heartbeat some other rank's dump reports as stale."""
    return {p.rank for d in ctx.job.digests.values() for p in d.stale_peers}


def stopped_with_missing(ctx: Context) -> dict[int, tuple[int, int, tuple[int, ...]]]:
    """Ranks at the end of wait chains that stopped right after an op shared with
    ranks that left no dump: ``{rank: (gid, row, those ranks)}``.

    Only in PyTorch's own gloo dumps (states from retirement alone, no death and no
    exception recorded): there a retired op may have *failed* — gloo retires failed
    work as it retires completed work (torch-2.13-facts.md) — so a rank that others
    wait on, whose newest collective is retired, the newest of its group on every
    dumped member (the group went no further: else it ran), and was shared with a
    rank that left no dump (or whose dump never reached it), most likely stopped
    because that rank died in it (measured: the 2-D ``dp_tp`` job of
    scripts/workloads, rank 1 ``os._exit``s; rank 3's dp all_gather with rank 1 is
    retired, rank 3 never enters its tp all_reduce, and rank 2 waits there). The
    missing rank is the culprit, not the one that stopped. Never for a rank that
    issued ops its dump does not record (gloo's send/recv: a pipeline stage's newest
    recorded collective may be a setup op long before it stopped; measured on the
    property sweep, ``tests/unit/test_nccl_properties.py``, gloo crashed_rank).
    """
    out: dict[int, tuple[int, int, tuple[int, ...]]] = {}
    if not ctx.job.silent_listed:
        return out
    # a rank lost to a desync (gloo aborts a receiver of the wrong size) or one the
    # cascade names already is not this rule's to blame
    missing = set(ctx.job.missing_dumps) - set(cascade(ctx).desync_victims) - stale_ranks(ctx)
    seen: dict[tuple[int, int], tuple[int, ...]] = {}
    for rank, root in ctx.graph.roots.items():
        d = ctx.job.digests.get(rank)
        if root.kind != "free" or d is None or d.gpu_states \
                or d.header.format is SourceFormat.FRDUMP or d.unrecorded_ops > 0:
            # (ops the dump does not record — gloo's send/recv — may follow its
            # newest collective: where the rank stopped is unknown)
            continue
        rows = np.flatnonzero(d.is_p2p == 0)
        if len(rows) == 0:
            continue
        row = int(rows[-1])
        if int(d.state[d.unit_of(row)]) != OpState.COMPLETED:
            continue
        gid = ctx.job.group_of.get((rank, int(d.group[row])))
        if gid is None:
            continue
        seq = int(d.seq[row])
        gone = seen.get((gid, seq))
        if gone is None:
            gone = seen[(gid, seq)] = _absent_from(ctx, gid, seq, missing)
        if gone:
            out[rank] = (gid, row, gone)
    return out


def _absent_from(ctx: Context, gid: int, seq: int, missing: set[int]) -> tuple[int, ...]:
    """The members of ``gid`` absent from its collective ``seq`` — without a dump
    (of ``missing``), or with one that never reached it — when no dumped member
    went past it (else the group went on: it ran); one pass over the group's
    dumped members."""
    ranks = ctx.job.groups[gid].ranks
    members = ranks if isinstance(ranks, range) else set(ranks)
    absent = {m for m in missing if m in members}
    for m in ctx.job.dumped_members(gid):
        view = ctx.job.view(m, gid)
        if view is None or len(view.coll_rows) == 0:
            continue
        if view.max_seq > seq and _went_past(ctx, m, view.coll_rows, seq):
            return ()
        if view.max_seq < seq:
            absent.add(m)
    return tuple(sorted(absent))


def _went_past(ctx: Context, rank: int, rows: np.ndarray, seq: int) -> bool:
    """Whether ``rank`` holds an op of the group past ``seq`` that is not one the
    frontier pass read as failed: ops retired beyond a fellow member's newest one
    cannot have run (``analyzer.frontiers``), so they do not show that ``seq`` ran
    (measured: torch 2.15, the MoE job's rank 1 retired all_to_all #23 while ranks 0
    and 3 stopped in #22 with rank 2, which gloo had aborted); an op it waits in, or
    one that completed, does."""
    d = ctx.job.digests[rank]
    later = rows[d.seq[rows] > seq]
    if d.unit is not None:
        later = d.unit[later]
    return bool((d.state[later] != OpState.FAILED).any())


def stopped_finding(ctx: Context, stopped: dict[int, tuple[int, int, tuple[int, ...]]],
                     blamed: list[int]) -> Finding:
    """The ranks that the ranks others wait on stopped with (see
    :func:`stopped_with_missing`): culprits of a hang, confidence medium —
    ``missing_dump`` for ranks without a dump, ``missing_rank`` for ranks whose
    dump never reached the op."""
    first = min(stopped)
    gid, row, _ = stopped[first]
    d = ctx.job.digests[first]
    op = d.op_names.get(int(d.op_hash[row]), "?")
    detail = d.detail(row)
    waiters = sorted(set().union(*(ctx.graph.roots[r].waiters for r in stopped)) | set(stopped))
    direct = sorted({w.rank for r in stopped for w in ctx.graph.roots[r].direct})
    halted = ctx.ranks(sorted(stopped))
    dumped = all(r in ctx.job.digests for r in blamed)
    where = f"{op} #{int(d.seq[row])} on {ctx.pg_label(gid)}"
    what = f"never entered {where}" if dumped else "left no dump"
    return Finding(
        kind=FindingKind.MISSING_RANK if dumped else FindingKind.MISSING_DUMP,
        severity=Severity.ERROR,
        message=(f"rank(s) {ctx.ranks(blamed)} {what}; rank(s) {halted}, which ranks "
                 f"{ctx.ranks(direct)} wait for, stopped right after {where} with them (retired: gloo retires "
                 f"a failed op as it retires a completed one), so rank(s) {halted} most "
                 f"likely failed because rank(s) {ctx.ranks(blamed)} failed there. How sure: "
                 "medium — PyTorch's gloo recorder records no death and no exception; "
                 + ("if the dumps were taken at different times, dump again"
                    if dumped else "if the missing dump was only not collected, collect it "
                    "and analyze again")),
        culprit_ranks=tuple(blamed),
        waiting_ranks=tuple(waiters),
        pg=ctx.pg(gid),
        seq=int(d.seq[row]),
        seq_kind="collective",
        op=op,
        location=None if detail is None else detail.location,
        evidence={"basis": "stopped_with_missing_rank", "confidence": "medium",
                  "stopped": {str(r): ctx.pg_label(g) for r, (g, _, _) in sorted(stopped.items())},
                  "missing": blamed, "direct_waiters": direct},
    )
