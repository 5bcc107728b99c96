"""What every detector sees: the merged job, the wait graph, the options."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from frforensics.analyzer.merge import JobModel
from frforensics.analyzer.signatures import Mismatch, find_mismatches
from frforensics.analyzer.splits import find_split_mismatches
from frforensics.analyzer.waits import Wait, WaitGraph
from frforensics.report import TIMELINE_RANKS, GroupRef, format_ranks

__all__ = ["AnalyzeOptions", "Context"]


@dataclass(frozen=True, slots=True)
class AnalyzeOptions:
    """Knobs of an analysis (library callers pass values, never CLI objects).

    ``hang_after_s``: an unfinished op younger than this at dump time is taken as
    in flight, not hung (applies only where the dump time is known).
    ``world_size``: the job's size when the dumps do not say (native dumps).
    ``timeline_ranks``: the most ranks a drawn timeline shows; a job of more than
    8 times as many loaded ranks gets timelines of those ranks only
    (:func:`frforensics.report.timeline_ranks` chooses them, as the HTML report does).
    ``straggler_min_cost``: the share of the job's time a rank's late arrivals
    must cost before it is named a straggler (``detectors/straggler.py``).
    """

    world_size: int | None = None
    hang_after_s: float = 1.0
    max_findings_per_kind: int = 20
    timeline_ranks: int = TIMELINE_RANKS
    straggler_min_cost: float = 0.05


@dataclass(frozen=True, slots=True)
class Context:
    """Shared input of the detectors, computed before any of them runs.

    Detectors only read it, so their order does not matter: ``mismatches`` is
    the signature pass (``analyzer.signatures``), ``desynced`` the collectives
    it found mismatched — the hang detectors do not report those again.
    """

    job: JobModel
    graph: WaitGraph
    options: AnalyzeOptions
    mismatches: tuple[Mismatch, ...] = ()
    desynced: frozenset[tuple[int, int]] = frozenset()  # (gid, seq) with a mismatch
    #: what a pass computed once for several readers of this context (the straggler
    #: rule's judgement: its finding and, when it finds none, the report's notes)
    memo: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, job: JobModel, graph: WaitGraph, options: AnalyzeOptions) -> Context:
        """The context with its shared passes computed."""
        mismatches = find_mismatches(job)
        # a group's split mismatch counts only before its first other one (after a
        # desync, later collectives pair up the wrong calls)
        first: dict[int, int] = {}
        for m in mismatches:
            first[m.gid] = min(first.get(m.gid, m.seq), m.seq)
        mismatches += tuple(m for m in find_split_mismatches(job)
                            if m.seq < first.get(m.gid, m.seq + 1))
        return cls(job, graph, options, mismatches, frozenset((m.gid, m.seq) for m in mismatches))

    def pg(self, gid: int) -> GroupRef:
        return self.job.groups[gid].ref()

    def pg_label(self, gid: int) -> str:
        # one label a group: a hang of 16,384 ranks describes a wait per rank, and
        # each description formatted its 2048-member group again (3.8 s)
        labels: dict[int, str] = self.memo.setdefault("pg_label", {})
        label = labels.get(gid)
        if label is None:
            label = labels[gid] = self.pg(gid).label()
        return label

    def describe(self, wait: Wait) -> str:
        """``'all_reduce #12 on default_pg (ranks 0-3)'``."""
        number = f"#{wait.seq}" if wait.seq_kind == "collective" else f"(p2p #{wait.seq})"
        peer = ""
        if wait.seq_kind == "p2p" and wait.detail is not None and wait.detail.peer >= 0:
            peer = f" {'to' if wait.op == 'send' else 'from'} rank {wait.detail.peer}"
        return f"{wait.op}{peer} {number} on {self.pg_label(wait.gid)}"

    @staticmethod
    def ranks(ranks: Collection[int]) -> str:
        return format_ranks(ranks)
