"""``size_mismatch``: members of a group disagree on the size of one collective.

Rule: at the same seq of the same group (matched across ranks by
``collective_seq_id``, never by position in the ring), every member must issue
the same size. The first seq where they do not is reported; the minority are the
culprits (a tie names every rank). Severity error, status desync.

Worked example (4 ranks, default group)::

    ranks 0,1,3: all_reduce #7 of 1024 elements   rank 2: all_reduce #7 of 1000 elements
    -> size_mismatch at #7, culprit rank 2. For all_gather the inputs must agree (the
    outputs are group-size times larger). all_to_all sizes may differ: their split
    sizes are compared pairwise instead (``analyzer.splits``, our dumps only) — what
    rank i sends j must be what j expects from i — and reported here too
"""

from __future__ import annotations

from frforensics.analyzer.context import Context
from frforensics.analyzer.detectors._signatures import (
    mismatch_finding,
    mismatches_of,
    split_finding,
)
from frforensics.report import Finding, FindingKind


def detect(ctx: Context) -> list[Finding]:
    """One finding per group whose members disagree on a collective's size."""
    found = [mismatch_finding(ctx, m, FindingKind.SIZE_MISMATCH)
             for m in mismatches_of(ctx, "size")]
    found += [split_finding(ctx, m) for m in mismatches_of(ctx, "splits")]
    return found[: ctx.options.max_findings_per_kind]
