"""Detectors: one module per finding kind, each a pure function of the context.

Each module opens with the rule it applies and a worked multi-rank example, and
exposes ``detect(ctx) -> list[Finding]``. ``DETECTORS`` is the order they run
in: mismatches first (they mark desynced collectives, which the hang detectors
then do not report again as timeouts).
"""

from __future__ import annotations

from collections.abc import Callable

from frforensics.analyzer.context import Context
from frforensics.analyzer.detectors import (
    cross_pg_deadlock,
    dead_rank,
    dtype_mismatch,
    incomplete_dump,
    missing_dump,
    missing_rank,
    op_mismatch,
    p2p_deadlock,
    size_mismatch,
    straggler,
    timeout,
)
from frforensics.report import Finding

__all__ = ["DETECTORS"]

DETECTORS: list[Callable[[Context], list[Finding]]] = [
    op_mismatch.detect,
    size_mismatch.detect,
    dtype_mismatch.detect,
    dead_rank.detect,
    missing_dump.detect,
    missing_rank.detect,
    p2p_deadlock.detect,
    cross_pg_deadlock.detect,
    timeout.detect,
    straggler.detect,
    incomplete_dump.detect,
]
