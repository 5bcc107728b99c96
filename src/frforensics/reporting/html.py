"""``--format html``: one self-contained page (no script, no external asset).

Top to bottom: the verdict (status, finding kind, headline), the culprit chain
of each error finding (who waits, in which collective of which group, for whom,
and what the culprit was doing instead; a wait cycle is drawn as a ring), ranks
grouped by state, a per-rank timeline of the collectives around the hang (inline
SVG: one row per rank, one bar per op from enqueue to completion, unfinished ops
run to the dump time in red, the op each rank is blocked in outlined), then
every finding, load problems and notes.

At 10,000 ranks the timeline draws at most ``MAX_TIMELINE_RANKS`` rows: the
culprits first, then a few ranks of each distinct state, and says how many it
left out. Tooltips (SVG ``<title>``) give each op's group, seq, sizes, state and
code location.
"""

from __future__ import annotations

import json
import zlib
from html import escape

from frforensics.report import (
    Finding,
    RankTimeline,
    Report,
    Severity,
    Status,
    TimelineOp,
    format_ranks,
)
from frforensics.reporting._shared import (
    MAX_STATES,
    STATUS_WORD,
    TIMELINE_RANKS,
    culprit_code,
    culprit_label,
    rank_states,
    seq_label,
    timeline_ranks,
    top_finding,
)

MAX_TIMELINE_RANKS = TIMELINE_RANKS
OPS_PER_RANK = 16
WINDOW_OPS = 8
MAX_FINDINGS = 20
MAX_CHAINS = 5

_PALETTE = ("#4e79a7", "#59a14f", "#9c755f", "#76b7b2", "#edc948", "#b07aa1",
            "#ff9da7", "#bab0ac", "#86bcb6", "#8cd17d")

_STATUS_COLOR = {
    Status.HEALTHY: "#2e7d32",
    Status.DEGRADED: "#b26a00",
    Status.HANG: "#c62828",
    Status.DESYNC: "#8e24aa",
    Status.UNREADABLE: "#c62828",
}

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;
max-width:1200px}
h1{font-size:22px;margin:0 0 8px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.badge{display:inline-block;color:#fff;padding:2px 10px;border-radius:4px;font-weight:700}
.headline{font-size:16px;margin:8px 0 12px}
table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #ddd;padding:4px 8px;
text-align:left;vertical-align:top;font-size:14px}th{background:#f5f5f5}
code{background:#f3f3f3;padding:1px 4px;border-radius:3px;font-size:13px}
.chain{display:flex;flex-wrap:wrap;align-items:center;gap:6px;margin:8px 0}
.node{border:1px solid #bbb;border-radius:6px;padding:6px 10px;background:#fafafa;font-size:14px}
.node.culprit{border-color:#c62828;background:#fdecea;font-weight:600}
.node.op{background:#eef3fb;border-color:#4e79a7}
.arrow{font-size:18px;color:#777}
.muted{color:#777;font-size:13px}
svg text{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:11px}
.legend span{display:inline-block;margin-right:14px;font-size:13px}
.sw{display:inline-block;width:12px;height:12px;vertical-align:middle;margin-right:4px}
pre{background:#f7f7f7;padding:8px;overflow:auto;font-size:12px;max-height:300px}
"""


def _ranks(ranks: tuple[int, ...] | list[int]) -> str:
    return escape(format_ranks(ranks))


def _color(group: str) -> str:
    return _PALETTE[zlib.crc32(group.encode()) % len(_PALETTE)]


def render(report: Report) -> str:
    """The report as one self-contained HTML document."""
    status = report.status
    top = top_finding(report)
    title = f"frforensics: {STATUS_WORD[status]}"
    body: list[str] = []
    badge = (f'<span class="badge" id="status" style="background:{_STATUS_COLOR[status]}">'
             f"{STATUS_WORD[status]}</span>")
    if status is Status.UNREADABLE:
        body.append(f"<h1>{badge} no dump could be read</h1>")
    elif top is None:
        body.append(f"<h1>{badge} {len(report.ranks_loaded)} rank(s) analyzed</h1>")
        body.append('<p class="headline" id="headline">No hang, desync or straggler found.</p>')
    else:
        title += f" — {top.kind.value}"
        body.append(f'<h1>{badge} <code id="kind">{escape(top.kind.value)}</code></h1>')
        body.append(f'<p class="headline" id="headline">'
                    f"{escape(top.message[0].upper() + top.message[1:])}</p>")
        body.append(_summary_table(report, top))
    errors = [f for f in report.findings if f.severity is Severity.ERROR]
    if errors:
        body.append("<h2>Culprit chain</h2>")
        for f in errors[:MAX_CHAINS]:
            body.append(_chain(report, f))
        if len(errors) > MAX_CHAINS:
            body.append(f'<p class="muted">… {len(errors) - MAX_CHAINS} more error findings '
                        "below</p>")
    body.append(_states(report))
    body.append(_timeline_section(report))
    body.append(_findings(report))
    if report.load_problems:
        items = "".join(f"<li><code>{escape(p.path)}</code>: {escape(p.error)}</li>"
                        for p in report.load_problems[:50])
        more = (f"<li>… {len(report.load_problems) - 50} more</li>"
                if len(report.load_problems) > 50 else "")
        body.append(f"<h2>Load problems ({len(report.load_problems)})</h2><ul>{items}{more}</ul>")
    if report.notes:
        items = "".join(f"<li>{escape(n)}</li>" for n in report.notes)
        body.append(f"<h2>Notes</h2><ul>{items}</ul>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}</title><style>{_CSS}</style></head>"
            f"<body>{''.join(body)}</body></html>\n")


def _summary_table(report: Report, top: Finding) -> str:
    rows = []
    if report.culprit_ranks:
        shown = ", ".join(culprit_label(report, r) for r in report.culprit_ranks[:8])
        if len(report.culprit_ranks) > 8:
            shown += f", … ({format_ranks(report.culprit_ranks)})"
        rows.append(("Culprit", f'<span id="culprits">{escape(shown)}</span>'))
    if top.op is not None:
        rows.append(("Collective", f"<code>{escape(seq_label(top))}</code>"))
    if top.pg is not None:
        rows.append(("Group", escape(top.pg.label())))
    where = culprit_code(top)
    if where:
        rows.append(("Code", "<br>".join(f"<code>{escape(line)}</code>" for line in where)))
    elif top.location:
        rows.append(("Code", f"<code>{escape(top.location)}</code>"))
    if top.waiting_ranks:
        rows.append(("Waiting", f"ranks {_ranks(top.waiting_ranks)}"))
    return "<table>" + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def _culprit_state(report: Report, rank: int) -> str:
    facts = report.ranks.get(rank)
    if rank in report.ranks_missing or facts is None:
        return "left no dump"
    if facts.blocked_in:
        return f"blocked in {facts.blocked_in}"
    if facts.stuck_at:
        return f"not in a collective; main thread at {facts.stuck_at}"
    reason = facts.dump_reason if facts.dump_reason not in (None, "unknown") else None
    return "not blocked in any recorded op" + (f"; dumped on {reason}" if reason else "")


def _chain(report: Report, f: Finding) -> str:
    cycle = f.evidence.get("cycle") if isinstance(f.evidence, dict) else None
    parts: list[str] = [f'<div class="chain" data-kind="{escape(f.kind.value)}">']
    if isinstance(cycle, list) and cycle and all(isinstance(c, dict) for c in cycle):
        for i, step in enumerate(cycle[:16]):
            if i:
                parts.append('<span class="arrow">→</span>')
            op = f"{step.get('op', '?')} #{step.get('seq', '?')} on group {step.get('pg', '?')}"
            waits = step.get("waits_for") or step.get("peer")
            waits_txt = (f" waits for rank(s) {_ranks(list(waits))}"
                         if isinstance(waits, list) else "")
            parts.append(f'<div class="node culprit">rank {escape(str(step.get("rank")))}'
                         f'<br><span class="muted">in {escape(op)}{waits_txt}</span></div>')
        parts.append('<span class="arrow">↺</span>')
        parts.append(f'<span class="muted">({escape(f.kind.value)}: a wait cycle)</span>')
    else:
        if f.waiting_ranks:
            parts.append(f'<div class="node">ranks {_ranks(f.waiting_ranks)}'
                         '<br><span class="muted">wait</span></div>')
            parts.append('<span class="arrow">→</span>')
        if f.op is not None or f.pg is not None:
            where = escape(seq_label(f)) if f.op is not None else ""
            group = f"<br><span class=\"muted\">on {escape(f.pg.label())}</span>" if f.pg else ""
            parts.append(f'<div class="node op"><code>{where}</code>{group}</div>')
            parts.append('<span class="arrow">→</span>')
        for rank in f.culprit_ranks[:8]:
            parts.append(f'<div class="node culprit">{escape(culprit_label(report, rank))}'
                         f'<br><span class="muted">{escape(_culprit_state(report, rank))}'
                         "</span></div>")
        if len(f.culprit_ranks) > 8:
            parts.append(f'<div class="node culprit">… ranks {_ranks(f.culprit_ranks)}</div>')
        parts.append(f'<span class="muted">({escape(f.kind.value)})</span>')
    parts.append("</div>")
    return "".join(parts)


def _states(report: Report) -> str:
    world = report.world_size if report.world_size is not None else "unknown"
    states = rank_states(report)
    rows = "".join(f"<tr><td>{escape(s.ranks_label)}</td><td>{len(s.ranks)}</td>"
                   f"<td>{escape(s.state)}</td></tr>" for s in states[:MAX_STATES])
    if len(states) > MAX_STATES:
        rest = states[MAX_STATES:]
        rows += (f"<tr><td>…</td><td>{sum(len(s.ranks) for s in rest)}</td>"
                 f"<td>{len(rest)} more distinct states</td></tr>")
    return (f"<h2>Ranks ({len(report.ranks_loaded)} loaded, world size {world})</h2>"
            "<table><tr><th>Ranks</th><th>Count</th><th>State at dump time</th></tr>"
            f"{rows}</table>")


def _pick_ranks(report: Report) -> tuple[list[RankTimeline], int]:
    """Culprits first, then a few ranks of each state; at most MAX_TIMELINE_RANKS."""
    by_rank = {t.rank: t for t in report.timeline}
    chosen = timeline_ranks(report, by_rank, MAX_TIMELINE_RANKS)
    # (a large job's report holds timelines of the shown ranks only: count the loaded)
    return [by_rank[r] for r in chosen], max(len(by_rank), len(report.ranks_loaded)) - len(chosen)


def _op_end(op: TimelineOp, now_ns: int) -> int:
    if op.t_complete_ns > 0:
        return op.t_complete_ns
    if op.state in ("scheduled", "started"):
        return now_ns
    return 0


def _timeline_section(report: Report) -> str:
    head = "<h2>Timeline of collectives around the hang</h2>"
    if not report.timeline:
        return head + '<p class="muted">The dumps hold no recorded ops.</p>'
    rows, hidden = _pick_ranks(report)
    recent: dict[int, list[TimelineOp]] = {}
    for t in rows:
        ops = [o for o in t.ops if o.t_enqueue_ns > 0]
        tail = ops[-OPS_PER_RANK:]
        tail += [o for o in ops[:-OPS_PER_RANK] if o.state in ("scheduled", "started")]
        recent[t.rank] = sorted(tail, key=lambda o: o.t_enqueue_ns)
    if not any(recent.values()):
        return head + '<p class="muted">The dumps carry no op timestamps to draw.</p>'
    now_ns = max([t.dump_time_ns or 0 for t in rows]
                 + [max(o.t_enqueue_ns, o.t_complete_ns) for ops in recent.values() for o in ops])
    # The window opens at the WINDOW_OPS-th newest op of the rank that reached it
    # first: the hang and what led to it, not the whole ring (older ops are clipped).
    starts = [[o.t_enqueue_ns for o in ops][-WINDOW_OPS:] for ops in recent.values() if ops]
    t0 = min(st[0] for st in starts)
    span = max(1, now_ns - t0)
    label_w, width, row_h = 90, 1000, 22
    plot_w = width - label_w - 10
    height = 30 + row_h * len(rows)

    def x(t: int) -> float:
        return label_w + plot_w * (t - t0) / span

    svg: list[str] = [f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" '
                      f'height="{height}" viewBox="0 0 {width} {height}" role="img" '
                      'aria-label="per-rank timeline of collectives">']
    for i in range(5):  # time axis, seconds before the dump
        tick = t0 + span * i // 4
        svg.append(f'<line x1="{x(tick):.1f}" y1="14" x2="{x(tick):.1f}" y2="{height}" '
                   'stroke="#eee"/>')
        anchor = "end" if i == 4 else "middle"
        svg.append(f'<text x="{x(tick):.1f}" y="11" text-anchor="{anchor}" fill="#777">'
                   f"{(tick - now_ns) / 1e9:+.3g} s</text>")
    groups: dict[str, str] = {}
    for idx, t in enumerate(rows):
        y = 20 + idx * row_h
        culprit = t.rank in report.culprit_ranks
        svg.append(f'<g class="rank-row" data-rank="{t.rank}">')
        style = ' fill="#c62828" font-weight="bold"' if culprit else ' fill="#222"'
        star = " ★" if culprit else ""
        svg.append(f'<text class="rank-label" x="4" y="{y + 14}"{style}>rank {t.rank}{star}</text>')
        svg.append(f'<line x1="{label_w}" y1="{y + 10}" x2="{width - 10}" y2="{y + 10}" '
                   'stroke="#ddd"/>')
        for op in recent[t.rank]:
            end = _op_end(op, now_ns)
            if max(end, op.t_enqueue_ns) < t0:
                continue  # wholly before the window
            x1 = x(max(op.t_enqueue_ns, t0))
            w = max(2.0, (x(end) - x1) if end else 2.0)
            pending = op.state in ("scheduled", "started")
            groups[op.group_label] = _color(op.group)
            fill = "#e53935" if pending else _color(op.group)
            cls = "op pending" if pending else "op"
            if op.blocking:
                cls += " blocking"
            stroke = ' stroke="#000" stroke-width="2"' if op.blocking else ""
            number = f"#{op.seq}" if op.seq_kind == "collective" else f"p2p #{op.seq}"
            peer = f" peer {op.peer}" if op.peer >= 0 else ""
            tip = (f"rank {t.rank}: {op.op}{peer} {number} on {op.group_label}\n"
                   f"state: {op.state}{' (blocked here)' if op.blocking else ''}\n"
                   f"sizes: {op.in_shapes} {op.in_dtypes}\n"
                   f"enqueued {(op.t_enqueue_ns - now_ns) / 1e9:+.3f} s"
                   + (f", took {(op.t_complete_ns - op.t_enqueue_ns) / 1e6:.3f} ms"
                      if op.t_complete_ns else "")
                   + (f"\n{op.location}" if op.location else ""))
            svg.append(f'<rect class="{cls}" data-rank="{t.rank}" data-op="{escape(op.op)}" '
                       f'data-seq="{op.seq}" data-group="{escape(op.group)}" '
                       f'x="{x1:.1f}" y="{y + 3}" width="{w:.1f}" height="14" rx="2" '
                       f'fill="{fill}" fill-opacity="0.85"{stroke}>'
                       f"<title>{escape(tip)}</title></rect>")
            if w > 60:
                label = f"{op.op} {number}"
                if w > 200:
                    label += f" on {op.group_label.split(' (')[0]}"
                svg.append(f'<text x="{x1 + 3:.1f}" y="{y + 14}" fill="#fff" '
                           f'pointer-events="none">{escape(label)}</text>')
        svg.append("</g>")
    svg.append("</svg>")
    legend = "".join(f'<span><i class="sw" style="background:{c}"></i>{escape(g)}</span>'
                     for g, c in sorted(groups.items()))
    legend += ('<span><i class="sw" style="background:#e53935"></i>unfinished at dump time'
               '</span><span><i class="sw" style="border:2px solid #000"></i>'
               "blocked in (per the analysis)</span>")
    note = (f'<p class="muted">{hidden} more rank(s) not drawn; every rank\'s state is in the '
            "table above.</p>" if hidden else "")
    return (head + '<p class="muted">One row per rank, one bar per op from enqueue to '
            "completion (wall clocks; seconds before the newest dump). Hover a bar for details."
            f"</p><div class=\"legend\">{legend}</div>{''.join(svg)}{note}")


def _findings(report: Report) -> str:
    if not report.findings:
        return ""
    items = []
    for f in report.findings[:MAX_FINDINGS]:
        mark = "✗" if f.severity is Severity.ERROR else "!"
        culprits = (f" — culprits: ranks {_ranks(f.culprit_ranks)}" if f.culprit_ranks else "")
        evidence = ""
        if f.evidence:
            text = json.dumps(dict(f.evidence), indent=1, default=str)
            if len(text) > 8000:
                text = text[:8000] + "\n…"
            evidence = f"<details><summary>evidence</summary><pre>{escape(text)}</pre></details>"
        items.append(f'<li class="finding" data-kind="{escape(f.kind.value)}">{mark} '
                     f"<b>{escape(f.kind.value)}</b> ({f.severity.value}): "
                     f"{escape(f.message)}{culprits}{evidence}</li>")
    if len(report.findings) > MAX_FINDINGS:
        items.append(f"<li>… {len(report.findings) - MAX_FINDINGS} more</li>")
    return f"<h2>Findings ({len(report.findings)})</h2><ul>{''.join(items)}</ul>"
