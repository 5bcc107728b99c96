"""Run a command and measure its wall time and the peak RSS of its whole process tree."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Run:
    wall_s: float
    peak_rss_bytes: int
    returncode: int
    cpu_s: float = 0.0  # user + system of the process and the children it reaped


def _tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and all its descendants (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(b")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        try:
            with open(f"/proc/{pid}/statm", "rb") as fh:
                total += int(fh.read().split()[1]) * _PAGE
        except OSError:
            pass
    return total


def measure(cmd: list[str], *, stdout: Path | None = None, interval_s: float = 0.1,
            timeout_s: float = 3600) -> Run:
    """Run ``cmd``; poll the tree's RSS every ``interval_s``; return wall, CPU time and peak.

    CPU time (user + system of the command and every child it reaped, e.g. a
    process pool's workers) is what to compare on a machine shared with other
    work: wall time there depends on what else runs.
    """
    out = open(stdout, "wb") if stdout else subprocess.DEVNULL  # noqa: SIM115
    try:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL)
        peak = 0
        while _running(proc.pid):
            peak = max(peak, _tree_rss(proc.pid))
            if time.perf_counter() - start > timeout_s:
                proc.kill()
                break
            time.sleep(interval_s)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
    finally:
        if stdout:
            out.close()  # type: ignore[union-attr]
    return Run(wall, peak, proc.returncode, usage.ru_utime + usage.ru_stime)


def _running(pid: int) -> bool:
    """True until the child exits (without reaping it: wait4 does, for its rusage)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False
