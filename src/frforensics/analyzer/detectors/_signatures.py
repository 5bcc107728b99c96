"""Shared wording of the three mismatch detectors (the comparison itself is
``analyzer.signatures``, computed before the detectors run).

The culprits are the minority. On a tie (two-member groups, even splits) the
group's *analogs* — groups with the same description and size (the other TP or
DP groups of an SPMD job), which issue the same calls at the same seq — show the
expected value: when they do (most of their members agree, and some member of
the tie used it), the members that differ from it alone are the culprits and the
others are named in the text as waiting on them. Without analog evidence every
rank of the tie is named.

Worked example (DP groups {2,10}, {3,11}, ...; rank 2 all-reduces 2621440
elements at DP #7 where rank 10 and every other DP group use 5242880)::

    -> size_mismatch at #7 on {2,10}, culprit 2 (waiting: 10): "the analogous
       groups used 5242880 elements at this seq, so rank(s) 2 deviated, not rank(s) 10"
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict

import numpy as np

from frforensics.analyzer.context import Context
from frforensics.analyzer.digest import (
    SIZE_FROM_OUTPUT,
    EntryDetail,
    compared_dtypes,
    compared_side,
)
from frforensics.analyzer.signatures import Field, Mismatch, units
from frforensics.report import Finding, FindingKind, Severity

__all__ = ["mismatch_finding", "mismatches_of", "split_finding"]


def mismatches_of(ctx: Context, field: Field) -> list[Mismatch]:
    """The signature pass's mismatches on ``field``."""
    return [m for m in ctx.mismatches if m.field == field]


def split_finding(ctx: Context, m: Mismatch) -> Finding:
    """A split mismatch (``analyzer.splits``) as a ``size_mismatch`` finding: the
    pairwise rule's culprits, every disagreeing pair in the text and evidence."""
    culprits = list(m.culprits or ())
    waiting = sorted(r for r in m.values if r not in culprits)
    shown = sorted(m.pairs, key=lambda p: (p.sender not in culprits and p.receiver
                                            not in culprits, p.sender, p.receiver))[:8]
    pieces = [f"rank {p.sender} sends rank {p.receiver} {p.sent} element(s), rank "
              f"{p.receiver} expects {p.expected}" for p in shown]
    if len(m.pairs) > len(shown):
        pieces.append(f"{len(m.pairs) - len(shown)} more pair(s)")
    details = {r: _detail_at(ctx, r, m.gid, m.seq) for r in m.values}
    op = next((det.op for det in details.values() if det is not None), "all_to_all")
    location = next((det.location for r in culprits if (det := details.get(r)) is not None
                     and det.location), None)
    who = ("rank " if len(culprits) == 1 else "ranks ") + ctx.ranks(culprits)
    msg = (f"{who}: the split sizes of {op} #{m.seq} on {ctx.pg_label(m.gid)} disagree "
           f"pairwise ({m.reason}): " + "; ".join(pieces))
    if m.later:
        msg += f" ({m.later} later all_to_all(s) of the group disagree too)"
    return Finding(
        kind=FindingKind.SIZE_MISMATCH,
        severity=Severity.ERROR,
        message=msg,
        culprit_ranks=tuple(culprits),
        waiting_ranks=tuple(waiting),
        pg=ctx.pg(m.gid),
        seq=m.seq,
        seq_kind="collective",
        op=op,
        location=location,
        evidence={
            "values": {str(r): v for r, v in sorted(m.values.items())},
            "split_pairs": [{"sender": p.sender, "receiver": p.receiver, "sent": p.sent,
                             "expected": p.expected} for p in m.pairs[:64]],
            "split_rule": m.reason,
            "later_mismatches": m.later,
            "locations": {str(r): det.location for r, det in details.items()
                          if det is not None and det.location},
        },
    )


def _detail_at(ctx: Context, rank: int, gid: int, seq: int) -> EntryDetail | None:
    d = ctx.job.digests[rank]
    local = ctx.job.groups[gid].local.get(rank)
    for detail in d.details.values():
        if detail.group == local and detail.seq == seq and not detail.is_p2p:
            return detail
    return None


def mismatch_finding(ctx: Context, m: Mismatch, kind: FindingKind) -> Finding:
    """Turn a :class:`Mismatch` into its finding (minority = culprits)."""
    values = dict(m.values)  # the shared pass's result stays untouched
    classes: dict[str, list[int]] = defaultdict(list)
    for rank, value in sorted(values.items()):
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
    if tie and deviants:
        # The analogous groups single out the deviants: they alone are the
        # culprits; the members that agree with the analogs wait on them.
        culprits = deviants
        majority = sorted(r for r in values if r not in deviants)
    elif tie:
        # No analog evidence: the contract names every rank of a tie.
        culprits = sorted(r for rs in classes.values() for r in rs)
        majority = []
    else:
        majority = classes[top_value]
        culprits = sorted(r for v, rs in classes.items() if v != top_value for r in rs)

    details = {r: _detail_at(ctx, r, m.gid, m.seq) for r in values}
    if m.field == "dtype":
        for r, det in details.items():
            if det is not None:
                values[r] = compared_dtypes(det.op, det.in_dtypes, det.out_dtypes,
                                            _side(det)) or values[r]
        classes = defaultdict(list)
        for rank, value in sorted(values.items()):
            classes[value].append(rank)
        if not tie:
            top_value = values[majority[0]]
    if m.field == "size":
        for r, det in details.items():
            shapes = None if det is None else (
                det.out_shapes if _side(det) == 1 or det.op in SIZE_FROM_OUTPUT
                else det.in_shapes)
            if shapes:
                values[r] = f"{values[r]} {shapes}"
    if tie and deviants:
        # the analogs' value, as the members that agree with them show it (after the
        # dtype names and shapes are filled in above)
        top_value = next(values[r] for r, v in m.raw.items() if v == reference)
    op = None
    for r in (majority or culprits):
        det = details.get(r)
        if det is not None:
            op = det.op
            break
    if op is None:
        op = next(iter(values.values())) if m.field == "op" else None
    if m.field == "op" and not tie:
        op = "coalesced" if top_value.startswith("[") else top_value
    location = next((det.location for r in culprits if (det := details.get(r)) is not None
                     and det.location), None)
    what = {"op": "ops", "dtype": "dtypes", "size": "sizes"}[m.field]
    pieces = [f"rank{'s' if len(rs) > 1 else ''} {ctx.ranks(rs)} used {v}" for v, rs in
              sorted(classes.items(), key=lambda kv: -len(kv[1]))]
    who = ("rank " if len(culprits) == 1 else "ranks ") + ctx.ranks(culprits)
    msg = (f"{who} disagree{'s' if len(culprits) == 1 else ''} with "
           f"{'an even split of' if tie and not deviants else 'the other members on'} the "
           f"{what} of collective "
           f"#{m.seq} on {ctx.pg_label(m.gid)}: " + "; ".join(pieces))
    if m.later:
        msg += f" ({m.later} later collective(s) of the group disagree too)"
    if tie and deviants:
        msg += (f"; the analogous groups used {top_value} at this seq, so rank(s) "
                f"{ctx.ranks(deviants)} deviated, not rank(s) {ctx.ranks(majority)}")
    evidence = {
        "values": {str(r): v for r, v in sorted(values.items())},
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


_DIMS = re.compile(r"\[([\d, ]*)\]")


def _numel(shapes: str) -> int:
    """Elements of a shapes text such as ``[[4, 4], [2]]`` (0 where unreadable)."""
    total = 0
    if shapes.strip() in ("", "[]", "None"):
        return 0  # no tensors
    for dims in _DIMS.findall(shapes[:4096]):
        total += math.prod(int(d) for d in dims.replace(" ", "").split(",") if d)
    return total


def _side(det: EntryDetail) -> int:
    """``compared_side`` of a kept entry, sizes from its shapes text."""
    return compared_side(det.op, det.in_dtypes, det.out_dtypes, _numel(det.in_shapes),
                         _numel(det.out_shapes))


def _value_at(ctx: Context, rank: int, gid: int, seq: int, field: Field) -> int | None:
    unit = units(ctx.job, rank, gid)
    if unit is None:
        return None
    seqs, _, op, dtype, size = unit
    hit = np.flatnonzero(seqs == seq)
    if len(hit) == 0:
        return None
    column = {"op": op, "dtype": dtype, "size": size}[field]
    return int(column[hit[0]])


def _call_at(ctx: Context, rank: int, gid: int, seq: int) -> tuple[int | None, ...]:
    """What ``rank`` posted at ``seq`` of ``gid``: (op, dtype, size)."""
    return tuple(_value_at(ctx, rank, gid, seq, fld) for fld in ("op", "dtype", "size"))


def _analog_reference(ctx: Context, m: Mismatch) -> int | None:
    """The value of ``m.field`` in the call most members of ``m``'s analog groups
    posted at ``m.seq``, when that whole call (op, dtype and size) is one that a
    member of ``m`` posted too.

    An analog must be the same call: groups of other pipeline stages share the
    desc and size but run other calls at the same seq, and a dtype that one of
    them happens to share says nothing about which member deviated.
    """
    group = ctx.job.groups[m.gid]
    posted = {_call_at(ctx, r, m.gid, m.seq) for r in m.raw}
    votes: Counter[tuple[int | None, ...]] = Counter()
    for other in ctx.job.groups:
        if other.gid == m.gid or other.desc != group.desc or len(other.ranks) != len(group.ranks):
            continue
        for rank in ctx.job.dumped_members(other.gid):
            if rank not in m.raw:
                call = _call_at(ctx, rank, other.gid, m.seq)
                if None not in call:
                    votes[call] += 1
        if sum(votes.values()) >= 64:
            break
    if not votes:
        return None
    (best, count), *rest = votes.most_common(2)
    if rest and rest[0][1] * 2 > count:
        return None  # the analogs disagree too: no clear reference
    if best not in posted:
        return None  # the analogs ran another call at this seq: no evidence
    return best[("op", "dtype", "size").index(m.field)]
