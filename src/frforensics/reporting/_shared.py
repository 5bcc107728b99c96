"""What several reporters need alike: the headline finding, culprit descriptions.

Ranks grouped by state and the timeline rank choice are functions of a
:class:`~frforensics.report.Report` (``frforensics.report``: the analyzer chooses
which ranks get a timeline with the same rule); re-exported here."""

from __future__ import annotations

from frforensics.report import (
    TIMELINE_RANKS,
    Finding,
    RankState,
    Report,
    Severity,
    Status,
    code_sides,
    culprit_code,
    format_ranks,
    rank_states,
    timeline_ranks,
)

__all__ = ["TIMELINE_RANKS", "RankState", "action_lines", "code_sides", "culprit_code", "culprit_label",
           "rank_states", "seq_label", "timeline_ranks", "top_finding"]

MAX_STATES = 12


def top_finding(report: Report) -> Finding | None:
    """The finding the headline tells: the first error, else the first finding."""
    errors = [f for f in report.findings if f.severity is Severity.ERROR]
    if errors:
        return errors[0]
    return report.findings[0] if report.findings else None


def culprit_label(report: Report, rank: int) -> str:
    """``'rank 3 (host node07, pid 4121)'``."""
    facts = report.ranks.get(rank)
    where = []
    if facts is not None and facts.host:
        where.append(f"host {facts.host}")
    if facts is not None and facts.pid:
        where.append(f"pid {facts.pid}")
    return f"rank {rank}" + (f" ({', '.join(where)})" if where else "")


def action_lines(report: Report, *, limit: int = 4) -> list[str]:
    """``'rank 3: replace_gpu_or_host (host node07, cuda:3, GPU-…) — because timeout'``.

    Several culprits with the same action and no GPU identity share one line.
    """
    lines: list[str] = []
    plain: dict[tuple[str, str], list[int]] = {}
    for a in report.actions:
        ident = [x for x in (f"host {a.host}" if a.host else "",
                             f"cuda:{a.cuda_device}" if a.cuda_device is not None else "",
                             a.gpu_uuid or "", a.pci_bus_id or "") if x]
        if a.cuda_device is None and a.gpu_uuid is None:
            plain.setdefault((a.action, a.because), []).append(a.rank)
            continue
        lines.append(f"rank {a.rank}: {a.action} ({', '.join(ident)}) — {a.because}")
    for (action, because), ranks in plain.items():
        hosts = sorted({a.host for a in report.actions if a.rank in ranks and a.host})
        where = f" (host {', '.join(hosts[:4])}{', …' if len(hosts) > 4 else ''})" if hosts else ""
        lines.append(f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}: "
                     f"{action}{where} — {because}")
    if len(lines) > limit:
        lines = [*lines[:limit], f"… {len(lines) - limit} more (see the JSON report's actions)"]
    return lines


def seq_label(finding: Finding) -> str:
    """``'all_reduce #17'`` or ``'send (p2p #3)'``."""
    op = finding.op or "?"
    if finding.seq is None:
        return op
    return f"{op} #{finding.seq}" if finding.seq_kind != "p2p" else f"{op} (p2p #{finding.seq})"


STATUS_WORD = {
    Status.HEALTHY: "HEALTHY",
    Status.DEGRADED: "DEGRADED",
    Status.HANG: "HANG",
    Status.DESYNC: "DESYNC",
    Status.UNREADABLE: "UNREADABLE",
}
