"""CLI side of the reporters: new formats, ``--output-dir``, ``timeline``, progress bar."""

from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data" / "native"
MISSING = DATA / "missing_rank" / "pickle"


def fr(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "frforensics", *args], capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.parametrize("fmt", ["markdown", "html", "junit"])
def test_new_formats_print_on_stdout_with_the_verdicts_exit_code(fmt: str) -> None:
    proc = fr(str(MISSING), "--format", fmt)
    assert proc.returncode == 1, proc.stderr
    assert "missing_rank" in proc.stdout and "rank 2" in proc.stdout
    if fmt == "junit":
        assert ET.fromstring(proc.stdout).get("failures") == "1"


def test_output_dir_holds_every_format_and_the_timeline(tmp_path: Path) -> None:
    proc = fr(str(MISSING), "--output-dir", str(tmp_path / "ci"), "--format", "json")
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["culprit_ranks"] == [2]  # stdout unchanged
    files = sorted(p.name for p in (tmp_path / "ci").iterdir())
    assert files == ["report.html", "report.json", "report.md", "report.txt", "report.xml",
                     "timeline.json"]


def test_timeline_command_writes_chrome_trace_json(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    proc = fr("timeline", str(DATA / "cross_group" / "pickle"), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "4 rank(s)" in proc.stderr and "4 stuck op(s)" in proc.stderr
    doc = json.loads(out.read_text())
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1", "rank 2", "rank 3"}
    assert not list(tmp_path.glob(".*"))


def test_timeline_of_nothing_readable_exits_2(tmp_path: Path) -> None:
    (tmp_path / "nccl_trace_rank_0").write_bytes(b"not a dump")
    proc = fr("timeline", str(tmp_path), "-o", str(tmp_path / "t.json"))
    assert proc.returncode == 2
    assert "skipped" in proc.stderr and "Traceback" not in proc.stderr


def _run_on_a_terminal(args: list[str]) -> tuple[int, bytes, str]:
    """Run fr-analyze with stderr on a pseudo-terminal; (exit code, terminal bytes, stdout)."""
    master, slave = pty.openpty()
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="100")
    proc = subprocess.run([sys.executable, "-m", "frforensics", *args], stdout=subprocess.PIPE,
                          stderr=slave, env=env, timeout=120, check=False)
    os.close(slave)
    data = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    os.close(master)
    return proc.returncode, data, proc.stdout.decode()


@pytest.fixture
def many_dumps(tmp_path: Path) -> Path:
    for r in range(20):
        shutil.copy(DATA / "healthy" / "pickle" / f"nccl_trace_rank_{r % 4}",
                    tmp_path / f"nccl_trace_rank_{r}")
    return tmp_path


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_progress_bar_shows_on_a_terminal(many_dumps: Path) -> None:
    code, term, out = _run_on_a_terminal([str(many_dumps), "-j", "1"])
    assert code == 0
    assert b"decoding dumps" in term and b"20/20" in term
    assert "HEALTHY" in out and "decoding" not in out


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_progress_bar_is_silent_with_json_or_no_progress(many_dumps: Path) -> None:
    for extra in (["--format", "json"], ["--no-progress"]):
        code, term, _ = _run_on_a_terminal([str(many_dumps), "-j", "1", *extra])
        assert code == 0 and term == b"", extra
    assert json.loads(_run_on_a_terminal([str(many_dumps), "-f", "json"])[2])["status"] == "healthy"


def test_progress_bar_is_silent_when_piped(many_dumps: Path) -> None:
    proc = fr(str(many_dumps), "-j", "1")
    assert proc.returncode == 0
    assert proc.stderr == ""


def test_progress_bar_is_not_drawn_for_a_few_files() -> None:
    code, term, _ = _run_on_a_terminal([str(MISSING), "-j", "1"])
    assert code == 1 and term == b""
