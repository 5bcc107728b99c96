"""Every file frforensics writes: never through a link, one line and exit 2 when it fails.

A link to a victim file is planted at every path a writer creates (the target
itself and the temp names writers used before ``_atomic``): the victim keeps
its bytes and the target becomes a regular file. A write that fails (a 2 KiB
``RLIMIT_FSIZE`` standing for a full disk, a folder that cannot be made, a
read-only folder) is one line naming the path and exit 2, with no temp file
left behind. Writers: ``_atomic.write_atomic`` (and so ``frdump.write_atomic``,
the recorder's dumps, the verdict's ``paths.txt`` and ``<work>/frdump_rank_<r>``),
``safe_dir`` (the verdict's work folder), and the CLI's ``verdict --out-dir``,
``-o``, ``--output-dir`` and ``timeline -o``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from frforensics._atomic import WriteError, safe_dir, write_atomic
from frforensics.cli import main
from frforensics.formats import frdump

DATA = Path(__file__).resolve().parents[1] / "data" / "native" / "missing_rank" / "pickle"
VICTIM_BYTES = b"precious\n"


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM_BYTES)
    return victim


def _plant(at: Path, victim: Path) -> None:
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(victim)


def _no_temp_left(folder: Path) -> None:
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


@pytest.mark.parametrize("writer", ["write_atomic", "frdump.write_atomic"])
def test_a_link_at_the_target_is_replaced_never_followed(tmp_path: Path, writer: str) -> None:
    victim = _victim(tmp_path)
    target = tmp_path / "out" / "frdump_rank_3"
    _plant(target, victim)
    if writer == "write_atomic":
        write_atomic(target, b"new")
    else:
        frdump.write_atomic(target, b"new")
    assert victim.read_bytes() == VICTIM_BYTES
    assert not target.is_symlink() and target.read_bytes() == b"new"
    _no_temp_left(target.parent)


def test_the_verdict_work_folder_planted_as_a_link_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    work = tmp_path / "dumps" / ".frforensics_verdict" / "frforensics-0-0"
    _plant(work, elsewhere)
    with pytest.raises(WriteError, match="not a folder"):
        safe_dir(work)
    assert safe_dir(tmp_path / "dumps" / ".frforensics_verdict" / "frforensics-0-1").is_dir()


@pytest.mark.parametrize("planted", ["verdict.json", "verdict.txt", "verdict.html",
                                     ".verdict.json.tmp", ".verdict.txt.tmp"])
def test_verdict_out_dir_never_writes_through_a_planted_link(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], planted: str) -> None:
    victim = _victim(tmp_path)
    out = tmp_path / "out"
    _plant(out / planted, victim)
    code, _, _ = _run(["verdict", "--out-dir", str(out), str(DATA)], capsys)
    assert code in (0, 1)
    assert victim.read_bytes() == VICTIM_BYTES
    for name in ("verdict.json", "verdict.txt", "verdict.html"):
        assert (out / name).is_file() and not (out / name).is_symlink()


@pytest.mark.parametrize("args", [
    ["--format", "json", "-o", "{out}/report.json"],
    ["--output-dir", "{out}"],
    ["timeline", "-o", "{out}/timeline.json"],
])
def test_cli_outputs_never_write_through_a_planted_link(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    victim = _victim(tmp_path)
    out = tmp_path / "out"
    for name in ("report.json", "report.txt", "report.md", "report.html", "report.xml",
                 "timeline.json", ".report.json.tmp", ".timeline.json.tmp"):
        _plant(out / name, victim)
    argv = [a.format(out=out) for a in args]
    argv = [argv[0], str(DATA), *argv[1:]] if argv[0] == "timeline" else [str(DATA), *argv]
    code, _, err = _run(argv, capsys)
    assert code in (0, 1), err
    assert victim.read_bytes() == VICTIM_BYTES


FULL_DISK = """
import resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))
from frforensics.cli import main
main(sys.argv[1:])
"""


@pytest.mark.slow  # a real full filesystem per case: the slow lane
@pytest.mark.parametrize("args", [
    ["verdict", "--out-dir", "{out}", "{data}"],
    ["{data}", "--format", "json", "-o", "{out}/report.json"],
    ["{data}", "--output-dir", "{out}"],
    ["timeline", "{data}", "-o", "{out}/timeline.json"],
])
def test_a_full_disk_is_one_line_naming_the_path_and_exit_2(tmp_path: Path,
                                                            args: list[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    argv = [a.format(out=out, data=DATA) for a in args]
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, *argv], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(out) in lines[0] and "File too large" in lines[0]
    _no_temp_left(out)


@pytest.mark.parametrize("out_dir", ["/proc/frforensics-nope/out", "/proc/self"])
def test_verdict_into_a_folder_that_cannot_be_written_is_one_line_exit_2(
        capsys: pytest.CaptureFixture[str], out_dir: str) -> None:
    code, _, err = _run(["verdict", "--out-dir", out_dir, str(DATA)], capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and out_dir in err


def test_a_fifo_at_the_target_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "paths.txt"
    os.mkfifo(fifo)
    with pytest.raises(WriteError, match="FIFO"):
        write_atomic(fifo, "x")
