"""``--format markdown``: the verdict for a GitHub step summary or a PR comment.

A heading with the status and finding kind, the headline sentence, a small
key/value table (culprits with host/pid, collective, group, code location,
waiting ranks), ranks grouped by state with rank ranges, then the findings,
load problems and notes (capped, so 10,000 ranks stay well under GitHub's 1 MiB
step-summary limit).
"""

from __future__ import annotations

from frforensics.report import Report, Severity, Status, format_ranks
from frforensics.reporting._escape import printable
from frforensics.reporting._shared import (
    MAX_STATES,
    STATUS_WORD,
    action_lines,
    culprit_code,
    culprit_label,
    rank_states,
    seq_label,
    top_finding,
)

MAX_CULPRITS = 8
MAX_FINDINGS = 20
MAX_PROBLEMS = 20

_ICON = {
    Status.HEALTHY: "✅",
    Status.DEGRADED: "⚠️",
    Status.HANG: "❌",
    Status.DESYNC: "❌",
    Status.UNREADABLE: "❌",
}


def _cell(text: str) -> str:
    """Text safe inside a table cell or a line (no raw HTML, no column breaks, no
    control characters: a dump string cannot start a line of its own)."""
    return (printable(text.replace("\\", "\\\\")).replace("|", "\\|").replace("<", "&lt;")
            .replace(">", "&gt;"))


def _code(text: str) -> str:
    return "`" + printable(text).replace("`", "'").replace("|", "\\|") + "`"


def render(report: Report) -> str:
    """The report as GitHub-flavoured markdown."""
    lines: list[str] = []
    status = report.status
    word = STATUS_WORD[status]
    top = top_finding(report)
    if status is Status.UNREADABLE:
        lines += [f"## {_ICON[status]} frforensics: {word}", "",
                  "No dump could be read.", ""]
        _problems(report, lines)
        return "\n".join(lines) + "\n"
    if top is None:
        lines += [f"## {_ICON[status]} frforensics: {word}", "",
                  f"{len(report.ranks_loaded)} rank(s) analyzed: no hang, desync or "
                  "straggler found.", ""]
    else:
        lines += [f"## {_ICON[status]} frforensics: {word} — `{top.kind.value}`", "",
                  f"**{_cell(top.message[0].upper() + top.message[1:])}**", "",
                  "| | |", "|---|---|"]
        if report.culprit_ranks:
            shown = [culprit_label(report, r) for r in report.culprit_ranks[:MAX_CULPRITS]]
            if len(report.culprit_ranks) > MAX_CULPRITS:
                shown.append(f"… {len(report.culprit_ranks) - MAX_CULPRITS} more "
                             f"({format_ranks(report.culprit_ranks)})")
            lines.append(f"| **Culprit** | {_cell(', '.join(shown))} |")
        if top.op is not None:
            lines.append(f"| **Collective** | {_code(seq_label(top))} |")
        if top.pg is not None:
            lines.append(f"| **Group** | {_cell(top.pg.label())} |")
        where = culprit_code(top)
        if where:
            lines.append(f"| **Code** | {'<br>'.join(_code(line) for line in where)} |")
        elif top.location:
            lines.append(f"| **Code** | {_code(top.location)} |")
        if top.waiting_ranks:
            lines.append(f"| **Waiting** | ranks {format_ranks(top.waiting_ranks)} |")
        actions = action_lines(report)
        if actions:
            lines.append(f"| **Action** | {'<br>'.join(_cell(a) for a in actions)} |")
        lines.append("")
    world = report.world_size if report.world_size is not None else "unknown"
    lines += [f"### Ranks ({len(report.ranks_loaded)} loaded, world size {world})", "",
              "| Ranks | Count | State at dump time |", "|---|---:|---|"]
    states = rank_states(report)
    for st in states[:MAX_STATES]:
        lines.append(f"| {_cell(st.ranks_label)} | {len(st.ranks)} | {_cell(st.state)} |")
    if len(states) > MAX_STATES:
        rest = states[MAX_STATES:]
        lines.append(f"| … | {sum(len(s.ranks) for s in rest)} | "
                     f"{len(rest)} more distinct states |")
    lines.append("")
    if report.findings:
        lines += [f"### Findings ({len(report.findings)})", ""]
        for f in report.findings[:MAX_FINDINGS]:
            mark = "✗" if f.severity is Severity.ERROR else "!"
            culprits = (f" — culprits: {format_ranks(f.culprit_ranks)}"
                        if f.culprit_ranks else "")
            lines.append(f"- {mark} **{f.kind.value}** ({f.severity.value}): "
                         f"{_cell(f.message)}{culprits}")
        if len(report.findings) > MAX_FINDINGS:
            lines.append(f"- … {len(report.findings) - MAX_FINDINGS} more")
        lines.append("")
    _problems(report, lines)
    if report.notes:
        lines += ["<details><summary>Notes</summary>", ""]
        lines += [f"- {_cell(n)}" for n in report.notes]
        lines += ["", "</details>", ""]
    return "\n".join(lines) + "\n"


def _problems(report: Report, lines: list[str]) -> None:
    if not report.load_problems:
        return
    lines += [f"<details><summary>Load problems ({len(report.load_problems)})</summary>", ""]
    for p in report.load_problems[:MAX_PROBLEMS]:
        lines.append(f"- {_code(p.path)}: {_cell(p.error)}")
    if len(report.load_problems) > MAX_PROBLEMS:
        lines.append(f"- … {len(report.load_problems) - MAX_PROBLEMS} more")
    lines += ["", "</details>", ""]
