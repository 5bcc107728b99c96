"""What several reporters need alike: the headline finding, culprit descriptions,
and ranks grouped by state (ranges, so 10,000 ranks stay a few rows)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from frforensics.rankset import RankSet
from frforensics.report import Finding, Report, Severity, Status, code_sides, format_ranks

__all__ = ["RankState", "action_lines", "code_sides", "culprit_label", "rank_states", "seq_label",
           "top_finding"]

MAX_STATES = 12


@dataclass(frozen=True, slots=True)
class RankState:
    """Ranks that were doing the same thing at dump time."""

    state: str
    #: a tuple, or the report's RankSet of ranks without a dump (too many to list)
    ranks: Sequence[int]

    @property
    def ranks_label(self) -> str:
        return format_ranks(self.ranks)


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


def rank_states(report: Report) -> list[RankState]:
    """Ranks grouped by what they were doing, biggest group first."""
    groups: dict[str, list[int]] = defaultdict(list)
    for rank, facts in report.ranks.items():
        if facts.blocked_in:
            key = f"blocked in {facts.blocked_in}"
        elif facts.stuck_at:
            key = f"not in a collective; main thread at {facts.stuck_at}"
        else:
            key = "not blocked in any recorded op"
        groups[key].append(rank)
    states = [RankState(k, tuple(sorted(v))) for k, v in groups.items()]
    if report.ranks_missing:
        missing = report.ranks_missing
        states.append(RankState("no dump", missing if isinstance(missing, RankSet)
                                else tuple(sorted(missing))))
    states.sort(key=lambda s: (-len(s.ranks), s.ranks[0]))
    return states


STATUS_WORD = {
    Status.HEALTHY: "HEALTHY",
    Status.DEGRADED: "DEGRADED",
    Status.HANG: "HANG",
    Status.DESYNC: "DESYNC",
    Status.UNREADABLE: "UNREADABLE",
}


#: ranks a drawn timeline (HTML) shows at most
TIMELINE_RANKS = 32


def timeline_ranks(report: Report, available: Collection[int], limit: int) -> list[int]:
    """The ranks a drawn timeline shows: culprits first, then a few ranks of each
    state, filled up in rank order; at most ``limit``, all from ``available``."""
    chosen: list[int] = [r for r in report.culprit_ranks if r in available][:limit // 2]
    states = rank_states(report)
    per_state = max(1, (limit - len(chosen)) // max(1, len(states)))
    for st in states:
        for r in st.ranks[:per_state]:
            if r in available and r not in chosen and len(chosen) < limit:
                chosen.append(r)
    for r in sorted(available):  # fill up, small jobs show every rank
        if len(chosen) >= limit:
            break
        if r not in chosen:
            chosen.append(r)
    chosen.sort(key=lambda r: (r not in report.culprit_ranks, r))
    return chosen
