"""Shared pass of the three mismatch detectors: compare collectives across members.

For every process group, every member's collectives are reduced to one row per
seq (a coalesced unit's entries are combined), all members' rows are sorted by
seq, and each seq whose members disagree on op, dtype or size is a mismatch.
Only the *first* mismatched seq of a group is reported per kind: after one rank
desyncs, every later seq compares different calls. The culprits are the
minority. On a tie (two-member groups, even splits) every rank of the tie is
named, most likely first: the group's *analogs* — groups with the same
description and size (the other TP or DP groups of an SPMD job), which issue the
same calls at the same seq — show the expected value, and the members that differ
from it come first.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from frforensics.analyzer.context import Context
from frforensics.analyzer.digest import EntryDetail
from frforensics.report import Finding, FindingKind, Severity

Field = Literal["op", "dtype", "size"]

__all__ = ["Mismatch", "find_mismatches", "mismatch_finding"]


@dataclass(frozen=True, slots=True)
class Mismatch:
    """Members disagree at one seq of one group."""

    gid: int
    seq: int
    field: Field
    values: dict[int, str]  # rank -> what it used (op name, dtype, numel)
    later: int  # how many later seqs of the group also mismatch on this field
    raw: dict[int, int]  # rank -> the compared value (hash or numel)


def _units(ctx: Context, rank: int, gid: int) -> tuple[npt.NDArray[np.int64], ...] | None:
    view = ctx.job.view(rank, gid)
    if view is None or len(view.coll_rows) == 0:
        return None
    d = ctx.job.digests[rank]
    rows = view.coll_rows
    seq = d.seq[rows]
    op = d.op_hash[rows].astype(np.int64)
    dtype = d.dtype_hash[rows].astype(np.int64)
    size = d.size[rows]
    order = np.argsort(seq, kind="stable")
    seq, op, dtype, size = seq[order], op[order], dtype[order], size[order]
    starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
    if len(starts) != len(seq):  # coalesced units: combine their entries
        op = np.bitwise_xor.reduceat(op, starts)
        dtype = np.bitwise_xor.reduceat(dtype, starts)
        unchecked = np.minimum.reduceat(size, starts) < 0
        size = np.where(unchecked, -1, np.add.reduceat(size, starts))
        seq = seq[starts]
    ranks = np.full(len(seq), rank, dtype=np.int64)
    return seq, ranks, op, dtype, size


def find_mismatches(ctx: Context) -> list[Mismatch]:
    """Every group's first mismatch per field (op, then size, then dtype)."""
    if ctx.mismatches is not None:
        return ctx.mismatches
    found: list[Mismatch] = []
    for group in ctx.job.groups:
        parts = [u for r in group.ranks if r in ctx.job.digests
                 if (u := _units(ctx, r, group.gid)) is not None]
        if len(parts) < 2:
            continue
        seq, ranks, op, dtype, size = (np.concatenate(col) for col in zip(*parts, strict=True))
        order = np.argsort(seq, kind="stable")
        seq, ranks, op, dtype, size = seq[order], ranks[order], op[order], dtype[order], size[order]
        starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
        multi = np.diff(np.r_[starts, len(seq)]) > 1
        bad_op = multi & (np.maximum.reduceat(op, starts) != np.minimum.reduceat(op, starts))
        # PyTorch's analyzer's order: op, then size, then dtype.
        checked = np.where(size < 0, np.iinfo(np.int64).min, size)
        sized = np.minimum.reduceat(size, starts) >= 0
        bad_size = multi & ~bad_op & sized & (
            np.maximum.reduceat(checked, starts) != np.minimum.reduceat(checked, starts))
        bad_dtype = multi & ~bad_op & ~bad_size & (
            np.maximum.reduceat(dtype, starts) != np.minimum.reduceat(dtype, starts))
        for name, bad, column in (("op", bad_op, op), ("dtype", bad_dtype, dtype),
                                  ("size", bad_size, size)):
            hits = np.flatnonzero(bad)
            if len(hits) == 0:
                continue
            first = int(hits[0])
            lo = int(starts[first])
            hi = int(starts[first + 1]) if first + 1 < len(starts) else len(seq)
            raw = {int(r): int(v) for r, v in zip(ranks[lo:hi], column[lo:hi], strict=True)}
            values = {r: _render(ctx, name, r, v) for r, v in raw.items()}
            found.append(Mismatch(group.gid, int(seq[lo]), name,  # type: ignore[arg-type]
                                  values, len(hits) - 1, raw))
    ctx.mismatches = found
    return found


def _render(ctx: Context, name: str, rank: int, value: int) -> str:
    d = ctx.job.digests[rank]
    if name == "size":
        return f"{value} elements"
    if name == "op":
        return d.op_names.get(value, f"op#{value:x}")
    return f"dtype#{value:x}"


def _detail_at(ctx: Context, rank: int, gid: int, seq: int) -> EntryDetail | None:
    d = ctx.job.digests[rank]
    local = ctx.job.groups[gid].local.get(rank)
    for detail in d.details.values():
        if detail.group == local and detail.seq == seq and not detail.is_p2p:
            return detail
    return None


def mismatch_finding(ctx: Context, m: Mismatch, kind: FindingKind) -> Finding:
    """Turn a :class:`Mismatch` into its finding (minority = culprits)."""
    classes: dict[str, list[int]] = defaultdict(list)
    for rank, value in sorted(m.values.items()):
        classes[value].append(rank)
    counts = Counter({v: len(rs) for v, rs in classes.items()})
    ranked = counts.most_common()
    top_value, top_count = ranked[0]
    tie = len(ranked) > 1 and ranked[1][1] == top_count
    reference = _analog_reference(ctx, m) if tie else None
    majority: list[int]
    deviants: list[int] = []
    if reference is not None and any(v == reference for v in m.raw.values()):
        deviants = [r for r, v in sorted(m.raw.items()) if v != reference]
    if tie:
        # The contract names every rank of a tie; analog evidence only orders
        # them (most likely first).
        culprits = deviants + sorted(r for rs in classes.values() for r in rs
                                     if r not in deviants)
        majority = []
    else:
        majority = classes[top_value]
        culprits = sorted(r for v, rs in classes.items() if v != top_value for r in rs)
    if tie and deviants:
        top_value = next(m.values[r] for r, v in m.raw.items() if v == reference)

    details = {r: _detail_at(ctx, r, m.gid, m.seq) for r in m.values}
    if m.field == "dtype":
        for r, det in details.items():
            if det is not None:
                m.values[r] = det.in_dtypes or m.values[r]
        classes = defaultdict(list)
        for rank, value in sorted(m.values.items()):
            classes[value].append(rank)
        if not tie:
            top_value = m.values[majority[0]]
    if m.field == "size":
        for r, det in details.items():
            if det is not None and det.in_shapes:
                m.values[r] = f"{m.values[r]} {det.in_shapes}"
    op = None
    for r in (majority or culprits):
        det = details.get(r)
        if det is not None:
            op = det.op
            break
    if op is None:
        op = next(iter(m.values.values())) if m.field == "op" else None
    if m.field == "op" and not tie:
        op = top_value
    location = next((det.location for r in culprits if (det := details.get(r)) is not None
                     and det.location), None)
    what = {"op": "ops", "dtype": "dtypes", "size": "sizes"}[m.field]
    pieces = [f"rank{'s' if len(rs) > 1 else ''} {ctx.ranks(rs)} used {v}" for v, rs in
              sorted(classes.items(), key=lambda kv: -len(kv[1]))]
    who = ("rank " if len(culprits) == 1 else "ranks ") + ctx.ranks(culprits)
    msg = (f"{who} disagree{'s' if len(culprits) == 1 else ''} with "
           f"{'an even split of' if tie else 'the other members on'} the {what} of collective "
           f"#{m.seq} on {ctx.pg_label(m.gid)}: " + "; ".join(pieces))
    if m.later:
        msg += f" ({m.later} later collective(s) of the group disagree too)"
    if tie and deviants:
        msg += (f"; the analogous groups used {top_value} at this seq, so rank(s) "
                f"{ctx.ranks(deviants)} most likely deviated")
    ctx.desynced.add((m.gid, m.seq))
    evidence = {
        "values": {str(r): v for r, v in sorted(m.values.items())},
        "later_mismatches": m.later,
        "most_likely_by_analog_groups": deviants,
        "locations": {str(r): det.location for r, det in details.items()
                      if det is not None and det.location},
    }
    return Finding(
        kind=kind,
        severity=Severity.ERROR,
        message=msg,
        culprit_ranks=tuple(culprits),
        waiting_ranks=tuple(sorted(majority)),
        pg=ctx.pg(m.gid),
        seq=m.seq,
        seq_kind="collective",
        op=op,
        location=location,
        evidence=evidence,
    )


def _value_at(ctx: Context, rank: int, gid: int, seq: int, field: Field) -> int | None:
    unit = _units(ctx, rank, gid)
    if unit is None:
        return None
    seqs, _, op, dtype, size = unit
    hit = np.flatnonzero(seqs == seq)
    if len(hit) == 0:
        return None
    column = {"op": op, "dtype": dtype, "size": size}[field]
    return int(column[hit[0]])


def _analog_reference(ctx: Context, m: Mismatch) -> int | None:
    """The value most members of ``m``'s analog groups used at ``m.seq``."""
    group = ctx.job.groups[m.gid]
    votes: Counter[int] = Counter()
    for other in ctx.job.groups:
        if other.gid == m.gid or other.desc != group.desc or len(other.ranks) != len(group.ranks):
            continue
        for rank in other.ranks:
            if rank in ctx.job.digests and rank not in m.raw:
                value = _value_at(ctx, rank, other.gid, m.seq, m.field)
                if value is not None:
                    votes[value] += 1
        if sum(votes.values()) >= 64:
            break
    if not votes:
        return None
    (best, count), *rest = votes.most_common(2)
    if rest and rest[0][1] * 2 > count:
        return None  # the analogs disagree too: no clear reference
    return best
