"""Synthetic dump sets for tests and benchmarks (no torch needed).

``JobBuilder`` simulates a TP × DP × PP training job, plants faults, and yields
``JobDumps``: per-rank native flight-recorder documents and frdump traces exactly
as the ranks would have recorded them, plus ``expected``, the verdict the
scenario states by construction. See docs/builder.md.
"""

from __future__ import annotations

from frforensics.testing.builder import Fault, JobBuilder, JobSpec, Noise
from frforensics.testing.dumps import JobDumps, RankRecords
from frforensics.testing.expected import Expected, ExpectedGroup
from frforensics.testing.layout import GroupSpec, Layout
from frforensics.testing.schedule import ScheduleConfig

__all__ = [
    "Expected",
    "ExpectedGroup",
    "Fault",
    "GroupSpec",
    "JobBuilder",
    "JobDumps",
    "JobSpec",
    "Layout",
    "Noise",
    "RankRecords",
    "ScheduleConfig",
]
