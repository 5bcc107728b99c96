"""``dtype_mismatch``: members of a group disagree on the dtype of one collective.

Rule: at the same seq of the same group (matched across ranks by
``collective_seq_id``, never by position in the ring), every member must issue
the same dtype. The first seq where they do not is reported; the minority are the
culprits (a tie names every rank). Severity error, status desync.

Worked example (4 ranks, default group)::

    ranks 0-2: all_reduce #7 of Float   rank 3: all_reduce #7 of Double
    -> dtype_mismatch at #7, culprit rank 3
"""

from __future__ import annotations

from frforensics.analyzer.context import Context
from frforensics.analyzer.detectors._signatures import mismatch_finding, mismatches_of
from frforensics.report import Finding, FindingKind


def detect(ctx: Context) -> list[Finding]:
    """One finding per group whose members disagree on a collective's dtype."""
    return [
        mismatch_finding(ctx, m, FindingKind.DTYPE_MISMATCH)
        for m in mismatches_of(ctx, "dtype")
    ][: ctx.options.max_findings_per_kind]
