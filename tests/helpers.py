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


def torch_line() -> str:
    """The installed torch's release line (``"2.13"``, ``"2.15"``), from its package
    metadata (torch is not imported). Tests whose expectations differ by line take it
    as a parameter, so the test id says which branch ran (``[torch-2.13]``)."""
    from importlib.metadata import version

    return ".".join(version("torch").split(".")[:2])


#: whether the line has the new c10d APIs (``Backend._ensure_backend_registered``,
#: ``FlightRecorderHook``): 2.15 does, 2.13 does not; other lines are not in CI
NEW_C10D_API = {"2.13": False, "2.15": True}
