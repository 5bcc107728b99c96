"""Markdown, HTML, JUnit and the Chrome-trace timeline: same verdict, readable at scale."""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from frforensics.analyzer import analyze, load_dumps
from frforensics.analyzer.timeline import trace_events, write_timeline, write_timeline_file
from frforensics.formats import decode_dump, read_sources
from frforensics.model import DumpHeader, EntryTable, GroupInfo, OpState, RankTrace, SourceFormat
from frforensics.report import (
    Finding,
    FindingKind,
    GroupRef,
    LoadProblem,
    RankFacts,
    RankTimeline,
    Report,
    Severity,
    TimelineOp,
)
from frforensics.reporting import FORMATS, render, write_all

DATA = Path(__file__).resolve().parents[1] / "data" / "native"
PG = GroupRef("0", "default_pg", (0, 1, 2, 3))


def _finding(kind: FindingKind = FindingKind.MISSING_RANK, *, culprits=(2,), waiting=(0, 1, 3),
             severity: Severity = Severity.ERROR, message: str | None = None) -> Finding:
    return Finding(kind=kind, severity=severity,
                   message=message or f"rank {culprits} never entered all_reduce #5",
                   culprit_ranks=tuple(culprits), waiting_ranks=tuple(waiting), pg=PG, seq=5,
                   seq_kind="collective", op="all_reduce", location="train.py:88 in step")


def _report(findings=(), *, world: int = 4, culprits=(2,), timeline=(), **kw) -> Report:
    ranks = {r: RankFacts(rank=r, host=f"node{r // 8:02d}", pid=1000 + r, dump_reason="peer_signal",
                          blocked_in=None if r in culprits else "all_reduce #5 on default_pg")
             for r in range(world)}
    return Report(world_size=world, ranks_loaded=tuple(range(world)), ranks_missing=(),
                  culprit_ranks=tuple(culprits), ranks=ranks, findings=tuple(findings),
                  timeline=tuple(timeline), **kw)


def _native_report(name: str) -> Report:
    return analyze(load_dumps([DATA / name / "pickle"], jobs=1))


class _Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _parse_html(doc: str) -> _Collect:
    p = _Collect()
    p.feed(doc)
    return p


# ------------------------------------------------------------------ registry

def test_every_cli_format_has_a_renderer() -> None:
    assert set(FORMATS) == {"text", "json", "markdown", "html", "junit"}


def test_write_all_writes_every_format_and_the_timeline_beside_it(tmp_path: Path) -> None:
    report = _native_report("missing_rank")
    written = write_all(report, tmp_path / "out")
    names = sorted(p.name for p in written)
    assert names == ["report.html", "report.json", "report.md", "report.txt", "report.xml"]
    summary = write_timeline_file([DATA / "missing_rank" / "pickle"], tmp_path / "out" / "timeline.json")
    assert summary.ranks == [0, 1, 2, 3]
    assert json.loads((tmp_path / "out" / "report.json").read_text())["culprit_ranks"] == [2]
    trace = json.loads((tmp_path / "out" / "timeline.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1, 2, 3}
    assert not list((tmp_path / "out").glob(".*"))  # no temp files left


# ------------------------------------------------------------------ markdown

def test_markdown_leads_with_verdict_culprit_collective_group_and_code() -> None:
    md = render(_native_report("missing_rank"), "markdown")
    lines = md.splitlines()
    assert lines[0] == "## ❌ frforensics: HANG — `missing_rank`"
    assert lines[2].startswith("**Rank 2 never entered all_reduce #17")
    assert "| **Culprit** | rank 2 |" in md
    assert "| **Collective** | `all_reduce #17` |" in md
    assert "| **Group** | default_pg (name 0, ranks 0-3) |" in md
    # where the culprit was first (issue 29), then the op it never joined
    assert "| **Code** | `rank 2: /work/main/scripts/capture_native.py:253 in train_step" in md
    assert "never joined all_reduce #17, called at /work/main/scripts/capture_native.py:243 in train_step" in md
    assert "| 0-1,3 | 3 | blocked in all_reduce #17 on default_pg (name 0, ranks 0-3) |" in md


def test_markdown_keeps_table_cells_intact_when_text_has_pipes_and_tags() -> None:
    f = _finding(message="x | y <script>alert(1)</script>")
    md = render(_report([f]), "markdown")
    assert "<script>" not in md
    assert "x \\| y &lt;script&gt;" in md


def test_markdown_of_a_healthy_job_says_so() -> None:
    md = render(_native_report("healthy"), "markdown")
    assert md.startswith("## ✅ frforensics: HEALTHY")
    assert "no hang, desync or straggler found" in md


def test_markdown_of_ten_thousand_ranks_stays_short() -> None:
    world = 10_000
    culprits = tuple(range(0, world, 7))  # 1429 scattered culprits
    findings = [_finding(culprits=(c,), waiting=tuple(range(world))) for c in culprits[:500]]
    md = render(_report(findings, world=world, culprits=culprits), "markdown")
    assert len(md.encode()) < 64_000
    assert "1421 more" in md  # culprits beyond the first 8 are summarized
    assert "… 480 more" in md  # findings beyond 20
    assert md.count("\n| ") < 40


# ------------------------------------------------------------------ junit

def test_junit_has_a_failing_case_per_error_finding_and_passes_warnings() -> None:
    findings = [_finding(),
                _finding(FindingKind.STRAGGLER, culprits=(3,), waiting=(),
                         severity=Severity.WARNING, message="rank 3 is late")]
    root = ET.fromstring(render(_report(findings), "junit"))
    assert root.tag == "testsuite" and root.get("tests") == "2" and root.get("failures") == "1"
    cases = root.findall("testcase")
    assert cases[0].get("classname") == "frforensics.missing_rank"
    assert cases[0].get("name") == ("missing_rank: ranks 2 in all_reduce #5 on "
                                    "default_pg (name 0, ranks 0-3)")
    failure = cases[0].find("failure")
    assert failure is not None and failure.get("type") == "missing_rank"
    assert "code: train.py:88 in step" in (failure.text or "")
    assert cases[1].find("failure") is None
    assert "rank 3 is late" in (cases[1].findtext("system-out") or "")


def test_junit_of_a_healthy_job_is_one_passing_case() -> None:
    root = ET.fromstring(render(_native_report("healthy"), "junit"))
    assert root.get("failures") == "0"
    (case,) = root.findall("testcase")
    assert case.get("name") == "verdict" and case.find("failure") is None


def test_junit_of_unreadable_dumps_fails() -> None:
    report = Report(world_size=None, ranks_loaded=(), ranks_missing=(), culprit_ranks=(),
                    ranks={}, findings=(), load_problems=(LoadProblem("a", "bad magic"),),
                    unreadable=True)
    root = ET.fromstring(render(report, "junit"))
    assert root.get("failures") == "1"
    assert "a: bad magic" in (root.find("testcase/failure").text or "")  # type: ignore[union-attr]


# ------------------------------------------------------------------ html

def test_html_is_one_self_contained_document() -> None:
    doc = render(_native_report("cross_group"), "html")
    parsed = _parse_html(doc)
    tags = {t for t, _ in parsed.tags}
    assert "script" not in tags and "link" not in tags and "img" not in tags
    for _, attrs in parsed.tags:
        assert "src" not in attrs and "href" not in attrs
    assert "@import" not in doc and "url(" not in doc


def test_html_escapes_text_from_the_dumps() -> None:
    f = _finding(message="<img src=x onerror=alert(1)>")
    doc = render(_report([f]), "html")
    assert "<img" not in doc and "&lt;img src=x" in doc


def test_html_marks_the_op_each_waiting_rank_is_blocked_in() -> None:
    doc = render(_native_report("missing_rank"), "html")
    rects = [a for t, a in _parse_html(doc).tags if t == "rect" and "op" in (a.get("class") or "")]
    blocking = sorted((a["data-rank"], a["data-seq"]) for a in rects
                      if "blocking" in (a.get("class") or ""))
    assert blocking == [("0", "17"), ("1", "17"), ("3", "17")]
    assert {a["data-rank"] for a in rects} == {"0", "1", "2", "3"}


def _timeline_for(world: int) -> tuple[RankTimeline, ...]:
    base = 1_700_000_000_000_000_000
    out = []
    for r in range(world):
        ops = tuple(TimelineOp(group="0", group_label="default_pg", seq=s, seq_kind="collective",
                               op="all_reduce", state="completed", t_enqueue_ns=base + s * 1000,
                               t_start_ns=0, t_complete_ns=base + s * 1000 + 500)
                    for s in range(1, 33))
        out.append(RankTimeline(rank=r, dump_time_ns=base + 10**9, ops=ops))
    return tuple(out)


def test_html_of_ten_thousand_ranks_draws_a_bounded_timeline() -> None:
    world = 10_000
    report = _report([_finding(culprits=(4321,), waiting=tuple(r for r in range(world)
                                                               if r != 4321))],
                     world=world, culprits=(4321,), timeline=_timeline_for(world))
    doc = render(report, "html")
    rows = [a for t, a in _parse_html(doc).tags if t == "g" and a.get("class") == "rank-row"]
    assert 1 < len(rows) <= 32
    assert rows[0]["data-rank"] == "4321"
    assert "9968 more rank(s) not drawn" in doc
    assert len(doc.encode()) < 1_500_000


# ------------------------------------------------------------------ timeline

def _trace(entries: dict[str, list[int]], *, dump_time_ns: int | None) -> RankTrace:
    strings = ("all_reduce", "send", "[[4]]", "Float")
    n = len(entries["seq"])
    cols: dict[str, list[int]] = {"op": [0] * n, "in_shapes": [2] * n, "in_dtypes": [3] * n,
                                  "record_id": list(range(n)), "pg": [0] * n, **entries}
    return RankTrace(rank=1, header=DumpHeader(source="x", format=SourceFormat.FRDUMP, version="1",
                                               host="node1", pid=42, dump_time_ns=dump_time_ns),
                     groups=(GroupInfo("0", "default_pg", (0, 1)),), strings=strings, stacks=(),
                     entries=EntryTable.from_columns(n, cols))


def test_timeline_marks_the_unfinished_op_stuck_until_the_dump() -> None:
    s = 1_000_000_000
    trace = _trace({"seq": [1, 2], "state": [OpState.COMPLETED, OpState.STARTED],
                    "t_enqueue_ns": [s, 2 * s], "t_start_ns": [s, 2 * s],
                    "t_complete_ns": [s + 5000, 0]}, dump_time_ns=7 * s)
    events = trace_events(trace, 1)
    meta = {e["name"]: e["args"]["name"] for e in events if e["ph"] == "M" and "name" in e["args"]}
    assert meta["process_name"] == "rank 1 [node1, pid 42]"
    assert meta["thread_name"] == "default_pg 0 (ranks 0-1)"
    ops = [e for e in events if e["ph"] == "X"]
    assert [o["name"] for o in ops] == ["all_reduce #1", "all_reduce #2 [STUCK]"]
    assert ops[0]["ts"] == 1_000_000.0 and ops[0]["dur"] == 5.0
    assert ops[1]["dur"] == 5_000_000.0  # 2 s -> dump at 7 s
    assert ops[1]["args"]["state"] == "started" and ops[1]["args"]["in_shapes"] == "[[4]]"
    instants = [e for e in events if e["ph"] == "i"]
    assert [i["name"] for i in instants] == ["stuck: all_reduce #2", "dump: unknown"]
    assert instants[0]["ts"] == 7_000_000.0


def test_timeline_puts_overlapping_ops_of_one_group_on_separate_lanes() -> None:
    s = 1_000_000_000
    trace = _trace({"seq": [1, 2], "state": [OpState.COMPLETED] * 2,
                    "t_enqueue_ns": [s, s + 100], "t_start_ns": [s, s + 100],
                    "t_complete_ns": [s + 1000, s + 2000]}, dump_time_ns=None)
    ops = [e for e in trace_events(trace, 1) if e["ph"] == "X"]
    assert ops[0]["tid"] != ops[1]["tid"]


def test_timeline_of_native_dumps_is_valid_chrome_trace_json() -> None:
    buf = io.StringIO()
    summary = write_timeline(read_sources([DATA / "cross_group" / "pickle"]), buf)
    doc = json.loads(buf.getvalue())
    assert summary.ranks == [0, 1, 2, 3] and summary.stuck == 4
    events = doc["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert complete and all({"ts", "dur", "pid", "tid", "args"} <= set(e) for e in complete)
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert (0, "undefined 1 (ranks ?)") in threads and (0, "default_pg 0 (ranks ?)") in threads
    stuck = sorted((e["pid"], e["name"]) for e in complete if e["name"].endswith("[STUCK]"))
    assert stuck == [(0, "all_reduce #25 [STUCK]"), (1, "all_reduce #6 [STUCK]"),
                     (2, "all_reduce #25 [STUCK]"), (3, "all_reduce #25 [STUCK]")]
    # one tid per group, the same on every rank
    tids = {(e["args"]["group"], e["tid"]) for e in complete}
    assert len({g for g, _ in tids}) == len(tids)


def test_timeline_reports_bad_files_and_goes_on(tmp_path: Path) -> None:
    src = DATA / "missing_rank" / "pickle"
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "nccl_trace_rank_9").write_bytes(b"\x80\x04garbage")
    buf = io.StringIO()
    summary = write_timeline(read_sources([tmp_path]), buf)
    assert summary.ranks == [0, 1, 2, 3]
    assert [p for p, _ in summary.problems] == [str(tmp_path / "nccl_trace_rank_9")]
    assert json.loads(buf.getvalue())["otherData"]["problems"]


@pytest.mark.parametrize("name", ["healthy", "missing_rank", "cross_group", "dtype_mismatch"])
def test_every_format_names_the_same_culprits(name: str) -> None:
    report = _native_report(name)
    culprits = ", ".join(f"rank {r}" for r in report.culprit_ranks)
    for fmt in ("markdown", "html"):
        out = render(report, fmt)
        if culprits:
            assert culprits in out, fmt
    trace_ranks = {decode_dump(p.read_bytes(), source=str(p), rank_hint=int(p.name[-1])).rank
                   for p in (DATA / name / "pickle").iterdir()}
    assert set(report.ranks_loaded) == trace_ranks
