"""One analysis: detectors over the merged job, then the findings ordered, the
consequences of a root cause dropped, culprits, per-rank facts, actions and the
drawn timeline put together into the :class:`~frforensics.report.Report`
(``frforensics.analyzer.analyze``, re-exported by the package's facade).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from frforensics._gc import gc_paused
from frforensics.analyzer.actions import derive_actions
from frforensics.analyzer.consequences import culprits_of, settle
from frforensics.analyzer.context import AnalyzeOptions, Context
from frforensics.analyzer.detectors import DETECTORS, straggler, timeout
from frforensics.analyzer.load import DumpSet
from frforensics.analyzer.merge import build_job, release_collective_rows
from frforensics.analyzer.waits import build_wait_graph
from frforensics.model import OpState
from frforensics.report import (
    Finding,
    FindingKind,
    RankFacts,
    RankTimeline,
    Report,
    Severity,
    TimelineOp,
    timeline_ranks,
)

__all__ = ["analyze"]

# Order of root causes at the top level: a desync explains the hang it causes.
_KIND_ORDER = [
    FindingKind.OP_MISMATCH,
    FindingKind.SIZE_MISMATCH,
    FindingKind.DTYPE_MISMATCH,
    FindingKind.DEAD_RANK,
    FindingKind.CROSS_PG_DEADLOCK,
    FindingKind.P2P_DEADLOCK,
    FindingKind.MISSING_RANK,
    FindingKind.MISSING_DUMP,
    FindingKind.TIMEOUT,
    FindingKind.STRAGGLER,
    FindingKind.INCOMPLETE_DUMP,
]


#: ``progress(phase, done, total)``: the analysis's phases as they end (merge, wait
#: graph, signature pass, each rule, verdict, timeline); ``phase`` names the one just done.
Progress = Callable[[str, int, int], None]


def analyze(dumps: DumpSet, *, options: AnalyzeOptions | None = None,
            progress: Progress | None = None) -> Report:
    """Analyze a loaded :class:`DumpSet` and return the :class:`Report`.

    ``progress``, when given, is called after each phase (for a display: the CLI's
    progress bar on a terminal)."""
    # the digests are millions of long-lived objects at scale: a collection
    # rescans them all (20 % of the analysis at 4096 ranks); no cycles are made
    with gc_paused():
        return _analyze(dumps, options or AnalyzeOptions(), progress or _no_progress)


def _no_progress(phase: str, done: int, total: int) -> None:
    return None


#: phases besides the rules: merge, wait graph, signature pass, verdict, timeline
_FIXED_PHASES = 5


#: the last rule that reads ``merge.collective_rows`` (the signature pass reads them
#: before any rule): the rows are dropped after it, before the straggler rule's
#: gather; a reader put later recomputes them (slower, never wrong)
_LAST_ROWS_READER = DETECTORS.index(timeout.detect)


def _analyze(dumps: DumpSet, options: AnalyzeOptions, progress: Progress) -> Report:
    if not dumps.digests:
        return Report(
            world_size=options.world_size,
            ranks_loaded=(),
            ranks_missing=(),
            culprit_ranks=(),
            ranks={},
            findings=(),
            load_problems=tuple(dumps.problems),
            notes=("no readable dump found",),
            unreadable=True,
        )
    total = len(DETECTORS) + _FIXED_PHASES
    job = build_job(dumps.digests, world_size=options.world_size)
    progress(f"merged {len(job.digests)} ranks, {len(job.groups)} groups", 1, total)
    graph = build_wait_graph(job, hang_after_s=options.hang_after_s)
    progress("wait graph", 2, total)
    ctx = Context.build(job, graph, options)
    progress("signature pass", 3, total)
    findings: list[Finding] = []
    for i, detector in enumerate(DETECTORS):
        findings.extend(detector(ctx))
        if i == _LAST_ROWS_READER:
            release_collective_rows(job)
        progress(f"rule {detector.__module__.rsplit('.', 1)[-1]}", 4 + i, total)
    findings, beside = settle(ctx, findings, unread=dumps.unread_ranks)
    findings.sort(key=lambda f: (f.severity is not Severity.ERROR, _KIND_ORDER.index(f.kind),
                                 -len(f.waiting_ranks)))
    notes = list(job.notes)
    notes.extend(beside)
    if not any(f.kind is FindingKind.STRAGGLER for f in findings):
        notes.extend(straggler.unjudged(ctx))
    if graph.young and not findings:
        notes.append(
            f"rank(s) {ctx.ranks(graph.young)} had ops in flight younger than "
            f"{options.hang_after_s:g} s at dump time: not counted as hangs"
        )
    if dumps.companions:
        notes.append(f"used frforensics' dump where PyTorch's own dump of the same rank lay "
                     f"beside it ({len(dumps.companions)} file(s))")
    if dumps.unread:
        shown = ", ".join(sorted(dumps.unread)[:8]) + (" ..." if len(dumps.unread) > 8 else "")
        notes.append(f"partial verdict: {len(dumps.unread)} file(s) not read within the "
                     f"{dumps.deadline_s:g} s deadline ({shown}); their ranks are not named "
                     "culprits; analyze again without --deadline for the whole job")
    if dumps.skipped:
        notes.append(f"skipped {len(dumps.skipped)} file(s) that are not dumps")
    culprits = culprits_of(findings)
    facts = _facts(ctx)
    report = Report(
        world_size=job.world_size,
        ranks_loaded=tuple(sorted(job.digests)),
        # too many to list: the report holds them as ranges (rankset.listable)
        ranks_missing=tuple(job.missing_dumps) if job.silent_listed else job.missing_dumps,
        culprit_ranks=culprits,
        ranks=facts,
        findings=tuple(findings),
        load_problems=tuple(dumps.problems),
        notes=tuple(notes),
        actions=derive_actions(ctx, findings, culprits, facts),
    )
    # Only the HTML report draws timelines, of at most options.timeline_ranks ranks:
    # a large job builds them for those ranks only (half a million ops at 16k ranks)
    progress("verdict", total - 1, total)
    ranks = None
    if len(job.digests) > 8 * options.timeline_ranks:
        ranks = timeline_ranks(report, job.digests, options.timeline_ranks)
    report = replace(report, timeline=_timeline(ctx, ranks))
    progress("timeline", total, total)
    return report


def _timeline(ctx: Context, ranks: list[int] | None = None) -> tuple[RankTimeline, ...]:
    """Each rank's (or each of ``ranks``') kept entries (last ones and unfinished
    ones), for drawn timelines."""
    out: list[RankTimeline] = []
    # Labels per group and locations per stack are computed once: at 16k ranks
    # the timeline holds half a million ops sharing a few hundred of each.
    labels: dict[int, tuple[str, str]] = {}
    locations: dict[int, str | None] = {}
    for rank in sorted(ctx.job.digests) if ranks is None else sorted(ranks):
        d = ctx.job.digests[rank]
        wait = ctx.graph.waits.get(rank)
        ops: list[TimelineOp] = []
        for row, det in sorted(d.details.items()):
            gid = ctx.job.group_of.get((rank, det.group))
            if gid is None:
                name, label = str(det.group), f"group {det.group}"
            else:
                if gid not in labels:
                    ref = ctx.pg(gid)
                    labels[gid] = (ref.name, ref.label())
                name, label = labels[gid]
            key = id(det.frames)
            if key not in locations:
                locations[key] = det.location
            ops.append(TimelineOp(
                group=name,
                group_label=label,
                seq=det.p2p_seq if det.is_p2p else det.seq,
                seq_kind="p2p" if det.is_p2p else "collective",
                op=det.op,
                state=OpState(det.state).name.lower(),
                t_enqueue_ns=det.t_enqueue_ns,
                t_start_ns=det.t_start_ns,
                t_complete_ns=det.t_complete_ns,
                peer=det.peer,
                in_shapes=det.in_shapes,
                in_dtypes=det.in_dtypes,
                location=locations[key],
                blocking=wait is not None and wait.row == row,
            ))
        out.append(RankTimeline(rank=rank, dump_time_ns=d.dump_time_ns, ops=tuple(ops)))
    return tuple(out)


def _facts(ctx: Context) -> dict[int, RankFacts]:
    facts: dict[int, RankFacts] = {}
    for rank, d in ctx.job.digests.items():
        wait = ctx.graph.waits.get(rank)
        stuck = d.stuck_at()
        if stuck is None and wait is not None:
            stuck = wait.location
        facts[rank] = RankFacts(
            rank=rank,
            host=d.host,
            pid=d.pid,
            dump_reason=d.dump_reason,
            stuck_at=stuck,
            blocked_in=None if wait is None else ctx.describe(wait),
            source=d.source,
            format=d.format,
            local_rank=d.local_rank,
            cuda_device=d.cuda_device,
            gpu_uuid=d.gpu_uuid,
            pci_bus_id=d.pci_bus_id,
        )
    return facts
