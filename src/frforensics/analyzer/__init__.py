"""The analyzer: merge every rank's dump and name the rank(s) that caused a hang.

Pipeline: ``load_dumps`` (find, sniff, decode in parallel, digest) ->
``build_job`` (global groups, windows) -> ``build_wait_graph`` (who waits for
whom, roots, cycles) -> detectors (one module per finding kind) -> ``Report``.
Never imports torch.
"""

from __future__ import annotations

from frforensics.analyzer._analyze import analyze
from frforensics.analyzer.context import AnalyzeOptions
from frforensics.analyzer.load import DumpSet, load_dumps

__all__ = ["AnalyzeOptions", "DumpSet", "analyze", "load_dumps"]
