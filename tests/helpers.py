"""Helpers shared by test modules (importable as ``helpers``: pyproject's
``[tool.pytest.ini_options] pythonpath`` puts ``tests/`` on the path)."""

from __future__ import annotations

from typing import Any, Literal

from frforensics.analyzer import AnalyzeOptions, DumpSet, analyze
from frforensics.report import Report
from frforensics.testing import JobDumps


def analyze_dumps(dumps: JobDumps, fmt: Literal["frdump", "pickle", "json"] = "frdump",
                  **options: Any) -> Report:
    """The report on a synthetic job's dumps as ``fmt`` gives them (``frdump``: the
    recorder's traces; ``pickle``/``json``: PyTorch's native dump files, decoded),
    analyzed in memory with the job's world size."""
    return analyze(DumpSet.from_traces(dumps.traces(fmt)),
                   options=AnalyzeOptions(world_size=dumps.world_size, **options))
