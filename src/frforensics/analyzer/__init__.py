"""The analyzer: merge every rank's dump and name the rank(s) that caused a hang.

Pipeline: ``load_dumps`` (find, sniff, decode in parallel, digest) ->
``build_job`` (global groups, windows) -> ``build_wait_graph`` (who waits for
whom, roots, cycles) -> detectors (one module per finding kind) -> ``Report``.
Never imports torch.
"""

from __future__ import annotations

from frforensics.analyzer.context import AnalyzeOptions, Context
from frforensics.analyzer.detectors import DETECTORS
from frforensics.analyzer.load import DumpSet, load_dumps
from frforensics.analyzer.merge import build_job
from frforensics.analyzer.waits import build_wait_graph
from frforensics.report import Finding, FindingKind, RankFacts, Report, Severity

__all__ = ["AnalyzeOptions", "DumpSet", "analyze", "load_dumps"]

# Order of root causes at the top level: a desync explains the hang it causes.
_KIND_ORDER = [
    FindingKind.OP_MISMATCH,
    FindingKind.DTYPE_MISMATCH,
    FindingKind.SIZE_MISMATCH,
    FindingKind.DEAD_RANK,
    FindingKind.CROSS_PG_DEADLOCK,
    FindingKind.P2P_DEADLOCK,
    FindingKind.MISSING_RANK,
    FindingKind.MISSING_DUMP,
    FindingKind.TIMEOUT,
    FindingKind.STRAGGLER,
]


def analyze(dumps: DumpSet, *, options: AnalyzeOptions | None = None) -> Report:
    """Analyze a loaded :class:`DumpSet` and return the :class:`Report`."""
    options = options or AnalyzeOptions()
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
    job = build_job(dumps.digests, world_size=options.world_size)
    graph = build_wait_graph(job, hang_after_s=options.hang_after_s)
    ctx = Context(job=job, graph=graph, options=options)
    findings: list[Finding] = []
    for detector in DETECTORS:
        findings.extend(detector(ctx))
    findings.sort(key=lambda f: (f.severity is not Severity.ERROR, _KIND_ORDER.index(f.kind),
                                 -len(f.waiting_ranks)))
    notes = list(job.notes)
    if graph.young and not findings:
        notes.append(
            f"rank(s) {ctx.ranks(graph.young)} had ops in flight younger than "
            f"{options.hang_after_s:g} s at dump time: not counted as hangs"
        )
    if dumps.skipped:
        notes.append(f"skipped {len(dumps.skipped)} file(s) that are not dumps")
    return Report(
        world_size=job.world_size,
        ranks_loaded=tuple(sorted(job.digests)),
        ranks_missing=tuple(job.missing_dumps),
        culprit_ranks=_culprits(findings),
        ranks=_facts(ctx),
        findings=tuple(findings),
        load_problems=tuple(dumps.problems),
        notes=tuple(notes),
    )


def _culprits(findings: list[Finding]) -> tuple[int, ...]:
    errors = [f for f in findings if f.severity is Severity.ERROR]
    chosen = errors or [f for f in findings if f.kind is FindingKind.STRAGGLER]
    out: list[int] = []
    for finding in chosen:
        for rank in finding.culprit_ranks:
            if rank not in out:
                out.append(rank)
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
        )
    return facts
