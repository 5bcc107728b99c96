"""The CLI contract: default command, JSON shape, exit codes, no tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data" / "native"


def fr(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "frforensics", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow  # seconds of CPU: the slow lane
def test_default_command_and_explicit_analyze_agree() -> None:
    a = fr(str(DATA / "missing_rank" / "pickle"), "--format", "json")
    b = fr("analyze", "--format", "json", str(DATA / "missing_rank" / "pickle"))
    assert a.returncode == b.returncode == 1
    assert json.loads(a.stdout)["culprit_ranks"] == json.loads(b.stdout)["culprit_ranks"] == [2]


def test_json_report_has_the_contract_fields() -> None:
    report = json.loads(fr(str(DATA / "missing_rank" / "pickle"), "-f", "json").stdout)
    assert report["schema"] == "frforensics.report/1"
    assert set(report) >= {"status", "world_size", "ranks_loaded", "ranks_missing",
                           "culprit_ranks", "ranks", "findings", "load_problems"}
    finding = report["findings"][0]
    assert set(finding) >= {"kind", "severity", "culprit_ranks", "waiting_ranks", "pg", "seq",
                            "seq_kind", "op", "location", "message", "evidence"}
    assert finding["pg"] == {"name": "0", "desc": "default_pg", "ranks": [0, 1, 2, 3]}
    assert finding["seq_kind"] == "collective" and finding["op"] == "all_reduce"
    assert finding["location"].endswith("in train_step")
    assert set(report["ranks"]["2"]) >= {"host", "pid", "dump_reason", "stuck_at"}


def test_healthy_job_exits_zero_and_says_so() -> None:
    proc = fr(str(DATA / "healthy" / "pickle"))
    assert proc.returncode == 0
    assert proc.stdout.startswith("HEALTHY")


def test_text_verdict_names_culprit_collective_and_code_first() -> None:
    lines = fr(str(DATA / "missing_rank" / "pickle")).stdout.splitlines()
    assert lines[0].startswith("HANG — missing_rank")
    head = "\n".join(lines[:8])
    assert "Culprit:  rank 2" in head and "all_reduce #17" in head and "train_step" in head


def test_nothing_readable_exits_two_with_a_json_report(tmp_path: Path) -> None:
    (tmp_path / "nccl_trace_rank_0").write_bytes(b"\x80\x04\x95junk")
    proc = fr(str(tmp_path), "--format", "json")
    assert proc.returncode == 2
    report = json.loads(proc.stdout)
    assert report["status"] == "unreadable" and len(report["load_problems"]) == 1
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args", [["--no-such-option", "x"], [], ["/definitely/not/here"]])
def test_usage_errors_exit_two_without_traceback(args: list[str]) -> None:
    proc = fr(*args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # seconds of CPU: the slow lane
def test_convert_then_analyze_gives_the_same_verdict(tmp_path: Path) -> None:
    proc = fr("convert", str(DATA / "missing_rank" / "pickle"), str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        f"frdump_rank_{r}" for r in range(4)]
    report = json.loads(fr(str(tmp_path / "out"), "-f", "json").stdout)
    assert report["culprit_ranks"] == [2] and report["findings"][0]["seq"] == 17


def test_convert_of_nothing_exits_two(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    assert fr("convert", str(tmp_path / "in"), str(tmp_path / "out")).returncode == 2


@pytest.mark.slow  # seconds of CPU: the slow lane
def test_window_cuts_the_rings_and_keeps_the_verdict() -> None:
    whole = json.loads(fr(str(DATA / "missing_rank" / "pickle"), "-f", "json").stdout)
    assert whole == json.loads(fr(str(DATA / "missing_rank" / "pickle"), "-f", "json",
                                  "--window", "0").stdout)
    cut = fr(str(DATA / "missing_rank" / "pickle"), "-f", "json", "--window", "4")
    report = json.loads(cut.stdout)
    assert cut.returncode == 1 and report["culprit_ranks"] == whole["culprit_ranks"] == [2]
    assert any("--window 4" in note for note in report["notes"])
    assert not any("--window" in note for note in whole["notes"])


def test_the_analysis_reports_its_phases_in_order_to_a_progress_callback() -> None:
    from frforensics.analyzer import analyze, load_dumps

    seen: list[tuple[str, int, int]] = []
    report = analyze(load_dumps([str(DATA / "missing_rank" / "pickle")]),
                     progress=lambda phase, done, total: seen.append((phase, done, total)))
    assert report.culprit_ranks == (2,)
    total = seen[0][2]
    assert [d for _, d, _ in seen] == list(range(1, total + 1))
    assert {t for _, _, t in seen} == {total}
    phases = [p for p, _, _ in seen]
    assert phases[0].startswith("merged 4 ranks, 1 groups") and phases[1] == "wait graph"
    assert "rule missing_rank" in phases and phases[-2:] == ["verdict", "timeline"]


def test_the_terminal_shows_reading_then_analyzing_with_counts_and_time_left(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from rich.console import Console

    from frforensics import cli

    out = io.StringIO()
    real = Console

    def console(**kw: object) -> Console:
        return real(file=out, force_terminal=True, width=120)

    monkeypatch.setattr("rich.console.Console", console)
    with cli._Phases(enabled=True) as phases:
        read = phases.reading("decoding dumps")
        assert read is not None
        for done in range(0, 21, 5):
            read(done, 20)
        phases.analyzing("wait graph", 2, 15)
        shown = [phases.bar.tasks[i].description for i in (0, 1)]
        counts = [(t.completed, t.total) for t in phases.bar.tasks]
    assert shown == ["decoding dumps", "analyzing: wait graph"]
    assert counts == [(20, 20), (2, 15)]
    assert "left" in out.getvalue()
    # small loads, pipes and --no-progress: nothing at all
    with cli._Phases(enabled=True) as small:
        small_read = small.reading("decoding dumps")
        assert small_read is not None
        small_read(3, 3)
        small.analyzing("wait graph", 2, 15)
        assert small.bar is None
    assert cli._Phases(enabled=False).reading("decoding dumps") is None
