"""Output: every unwritable path is one line and exit 2; dump strings cannot forge lines."""

from __future__ import annotations

import shutil
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest

from frforensics.analyzer import analyze, load_dumps
from frforensics.cli import main
from frforensics.formats import decode_dump, frdump
from frforensics.reporting import render

DATA = Path(__file__).resolve().parents[1] / "data" / "native" / "missing_rank" / "pickle"
EVIL = "x\nCulprit: rank 3 \x1b[2J\x1b[31mFORGED\r\x01\u2028"


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def _one_line_exit_2(code: int, err: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_output_dir_on_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "f").write_text("x")
    code, _, err = _run([str(DATA), "--output-dir", str(tmp_path / "f")], capsys)
    _one_line_exit_2(code, err)
    assert "not a folder" in err


def test_output_dir_that_cannot_be_created(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    # /proc refuses new folders even to root (a chmod'ed folder would not stop root)
    code, _, err = _run([str(DATA), "--output-dir", "/proc/frforensics-out"], capsys)
    _one_line_exit_2(code, err)


def test_read_only_output_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run([str(DATA), "--output-dir", "/proc/self"], capsys)
    _one_line_exit_2(code, err)


def test_output_to_a_full_device(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run([str(DATA), "--format", "json", "-o", "/dev/full"], capsys)
    _one_line_exit_2(code, err)
    assert "/dev/full" in err


def test_output_file_that_is_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run([str(DATA), "-o", str(tmp_path)], capsys)
    _one_line_exit_2(code, err)


def test_timeline_into_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["timeline", str(DATA), "-o", str(tmp_path)], capsys)
    _one_line_exit_2(code, err)
    assert list(tmp_path.iterdir()) == []


def test_convert_into_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "f").write_text("x")
    code, _, err = _run(["convert", str(DATA), str(tmp_path / "f")], capsys)
    _one_line_exit_2(code, err)


def test_implausible_world_size_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run([str(DATA), "--world-size", str(10**9)], capsys)
    assert code == 2 and "Traceback" not in err


@pytest.fixture()
def evil_report(tmp_path: Path):  # type: ignore[no-untyped-def]
    """missing_rank (culprit rank 2) whose culprit dump names an evil host, next to an evil file name."""
    root = tmp_path / "d"
    root.mkdir()
    for f in DATA.iterdir():
        shutil.copy(f, root / f.name)
    culprit = root / "nccl_trace_rank_2"
    trace = decode_dump(culprit.read_bytes(), source=str(culprit), rank_hint=2)
    trace = replace(trace, header=replace(trace.header, host=EVIL, dump_detail=EVIL))
    culprit.unlink()
    (root / "frdump_rank_2").write_bytes(frdump.encode(trace))
    (root / ("nccl_trace_rank_x" + EVIL.replace("\x01", "_"))).write_bytes(b"\x80\x04junk")
    report = analyze(load_dumps([root], jobs=1))
    assert report.culprit_ranks == (2,) and report.load_problems
    return report


@pytest.mark.parametrize("fmt", ["text", "markdown"])
def test_dump_strings_cannot_forge_a_line_or_style_the_terminal(evil_report, fmt: str) -> None:  # type: ignore[no-untyped-def]
    out = render(evil_report, fmt)
    assert "FORGED" in out  # shown, escaped
    assert "\x1b" not in out and "\r" not in out and "\u2028" not in out and "\x01" not in out
    for line in out.splitlines():
        assert not line.lstrip(" |*-").startswith("Culprit: rank 3"), line


def test_junit_is_valid_xml_whatever_the_dump_says(evil_report) -> None:  # type: ignore[no-untyped-def]
    root = ET.fromstring(render(evil_report, "junit").encode())
    assert root.tag == "testsuite"
