"""The human verdict: what a tired on-call engineer reads in ten seconds.

The first lines say the status, the culprit ranks (host and pid when known), the
collective and group, the code location, and what the others are doing; then the
findings in detail, ranks grouped by what they were doing (ranges, so 10,000
ranks stay a few lines), load problems and notes.
"""

from __future__ import annotations

import io
from collections.abc import Callable

from rich.console import Console
from rich.markup import escape

from frforensics.report import Finding, Report, Severity, Status, format_ranks
from frforensics.reporting._escape import printable
from frforensics.reporting._shared import action_lines, code_sides, culprit_code, rank_states
from frforensics.verdict import first_clause

_STATUS_STYLE = {
    Status.HEALTHY: "bold green",
    Status.DEGRADED: "bold yellow",
    Status.HANG: "bold red",
    Status.DESYNC: "bold magenta",
    Status.UNREADABLE: "bold red",
}


def _culprit_line(report: Report) -> str:
    parts = []
    for rank in report.culprit_ranks[:8]:
        facts = report.ranks.get(rank)
        where = []
        if facts is not None and facts.host:
            where.append(f"host {facts.host}")
        if facts is not None and facts.pid:
            where.append(f"pid {facts.pid}")
        parts.append(f"rank {rank}" + (f" ({', '.join(where)})" if where else ""))
    if len(report.culprit_ranks) > 8:
        parts.append(f"… {len(report.culprit_ranks) - 8} more "
                     f"({format_ranks(report.culprit_ranks)})")
    return ", ".join(parts)


def _headline(finding: Finding) -> str:
    """The finding's first clause: the verdict line stays one readable sentence
    (the one rule, ``verdict.first_clause``, which the recorder's headline uses too)."""
    return first_clause(finding.message)


def render(report: Report, *, width: int = 100, color: bool = False) -> str:
    """The report as text; ``color`` adds ANSI styles (for terminals).

    Every line goes through :func:`printable`: text from dumps and file names
    cannot start a line of its own or carry terminal escapes.
    """
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=color, no_color=not color,
                      highlight=False, emoji=False)

    def out(line: str = "") -> None:
        console.print(printable(line))

    status = report.status
    style = _STATUS_STYLE[status]
    if status is Status.UNREADABLE:
        out(f"[{style}]UNREADABLE[/] — no dump could be read")
        for p in report.load_problems[:20]:
            out(f"  {escape(p.path)}: {escape(p.error)}")
        return buf.getvalue()
    errors = [f for f in report.findings if f.severity is Severity.ERROR]
    top = errors[0] if errors else (report.findings[0] if report.findings else None)
    if top is None:
        out(f"[{style}]HEALTHY[/] — {len(report.ranks_loaded)} rank(s) analyzed, "
            "no hang, desync or straggler found")
    else:
        out(f"[{style}]{status.value.upper()}[/] — {top.kind.value}: {escape(_headline(top))}")
        if report.culprit_ranks:
            out(f"  [bold]Culprit:[/]  {escape(_culprit_line(report))}")
        if top.pg is not None:
            seq = "" if top.seq is None else (
                f" #{top.seq}" if top.seq_kind == "collective" else f" (p2p #{top.seq})")
            out(f"  [bold]Where:[/]    {escape(top.op or '?')}{seq} on {escape(top.pg.label())}")
        sides = culprit_code(top) or code_sides(top)
        if sides:
            for i, line in enumerate(sides):
                out(f"  [bold]{'Code:' if i == 0 else '':<9}[/] {escape(line)}")
        elif top.location:
            out(f"  [bold]Code:[/]     {escape(top.location)}")
        if top.waiting_ranks:
            out(f"  [bold]Waiting:[/]  ranks {format_ranks(top.waiting_ranks)}")
        for i, line in enumerate(action_lines(report)):
            out(f"  [bold]{'Action:' if i == 0 else '':<9}[/] {escape(line)}")
    out("")
    if len(report.findings) > (1 if top else 0) or (top and top.evidence):
        out("[bold]Findings[/]")
        for f in report.findings:
            mark = "✗" if f.severity is Severity.ERROR else "!"
            out(f"  {mark} [{f.severity.value}] {f.kind.value}: {escape(f.message)}")
            if f.culprit_ranks:
                out(f"      culprits: {format_ranks(f.culprit_ranks)}")
        out("")
    _rank_summary(report, out)
    if report.load_problems:
        out(f"[bold]Load problems[/] ({len(report.load_problems)})")
        for p in report.load_problems[:20]:
            out(f"  {escape(p.path)}: {escape(p.error)}")
        if len(report.load_problems) > 20:
            out(f"  … {len(report.load_problems) - 20} more")
        out("")
    if report.notes:
        out("[bold]Notes[/]")
        for note in report.notes:
            out(f"  - {escape(note)}")
    return buf.getvalue()


def _rank_summary(report: Report, out: Callable[[str], None]) -> None:
    states = rank_states(report)
    world = report.world_size if report.world_size is not None else "unknown"
    out(f"[bold]Ranks[/] ({len(report.ranks_loaded)} loaded, world size {world})")
    for st in states[:12]:
        out(f"  {format_ranks(st.ranks):<24} {escape(st.state)}")
    if len(states) > 12:
        out(f"  … {len(states) - 12} more distinct states")
    out("")
