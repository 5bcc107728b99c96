"""``incomplete_dump``: dumps that lack the fields a judgement needs.

Rule: a dump whose entries carry no creation time (``time_created_ns``) or no
timeout (``timeout_ms``) — older schemas, hand-made dumps, damage — leaves
judgements unmade: whether an op ran past its timeout, whether a member entered
a collective after its peers gave up (the rule that finds a timeout in dumps
taken after every entry was retired), which op is young. Missing fields are
unknowns, not answers: this finding names the ranks and the fields, and keeps
the status at ``degraded`` (never ``healthy``) when nothing else was found. It
names no culprit. Severity warning.

Worked example (native gloo dumps after a timeout, ``timeout_ms`` stripped)::

    ranks 0-3: every entry retired (gloo retires failed work too), no timeout_ms
    -> incomplete_dump: "rank(s) 0-3: no timeout in any entry: ops that ran past
       their timeout cannot be judged"; status degraded, exit 0
"""

from __future__ import annotations

import numpy as np

from frforensics.analyzer.context import Context
from frforensics.analyzer.digest import ranks_with_other
from frforensics.report import Finding, FindingKind, Severity

_FIELDS = (
    ("t_enqueue_ns", "time_created_ns", "no creation time"),
    ("timeout_ms", "timeout_ms", "no timeout"),
)


def detect(ctx: Context) -> list[Finding]:
    """One finding per missing field, naming the ranks whose entries all lack it."""
    findings = []
    order = sorted(ctx.job.digests)
    digests = [ctx.job.digests[r] for r in order]
    has_rows = np.fromiter((d.seq.shape[0] > 0 for d in digests), dtype=np.bool_,
                           count=len(digests))
    for column, field, what in _FIELDS:
        lacking = has_rows & ~ranks_with_other(digests, column)
        ranks = [order[i] for i in np.flatnonzero(lacking).tolist()]
        if not ranks:
            continue
        findings.append(Finding(
            kind=FindingKind.INCOMPLETE_DUMP,
            severity=Severity.WARNING,
            message=(f"rank(s) {ctx.ranks(ranks)}: {what} in any entry ({field} missing): "
                     "ops that ran past their timeout, and members that entered a collective "
                     "after their peers gave up, cannot be judged for them; the verdict may "
                     "miss a hang"),
            culprit_ranks=(),
            waiting_ranks=(),
            evidence={"field": field, "ranks": ranks},
        ))
    return findings
