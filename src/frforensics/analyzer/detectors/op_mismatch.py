"""``op_mismatch``: members of a group disagree on the op of one collective.

Rule: at the same seq of the same group (matched across ranks by
``collective_seq_id``, never by position in the ring), every member must issue
the same op. The first seq where they do not is reported; the minority are the
culprits (a tie names every rank). Severity error, status desync.

Worked example (4 ranks, default group)::

    rank 0: all_reduce #7   rank 1: all_reduce #7   rank 2: broadcast #7   rank 3: all_reduce #7
    -> op_mismatch at #7, culprit rank 2 (the minority); ranks 0, 1, 3 hang in #7
"""

from __future__ import annotations

from frforensics.analyzer.context import Context
from frforensics.analyzer.detectors._signatures import mismatch_finding, mismatches_of
from frforensics.report import Finding, FindingKind


def detect(ctx: Context) -> list[Finding]:
    """One finding per group whose members disagree on a collective's op."""
    return [
        mismatch_finding(ctx, m, FindingKind.OP_MISMATCH)
        for m in mismatches_of(ctx, "op")
    ][: ctx.options.max_findings_per_kind]
