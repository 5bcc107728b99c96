"""The pytest plugin, end to end: a distributed test that hangs on purpose, run by a
real pytest (a subprocess) with the plugin, leaves dumps, a markdown verdict and an
HTML report naming the culprit; without opting in the plugin does nothing.

The hanging test spawns four gloo ranks with plain torch code (no frforensics
import: the recorder comes from the environment the plugin sets); rank 2 skips
the third all_reduce. pytest-timeout stops the test after 40 s; the ranks'
recorder deadline is 2 s, so their dumps are in long before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow]

WORKER = """
import os, threading, time
from datetime import timedelta
threading.Timer(60, lambda: os._exit(3)).start()   # never outlive the test run
import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
t = torch.ones(4)
for step in range(1, 6):
    if rank == 2 and step == 3:
        continue            # the bug: rank 2 skips one all_reduce
    dist.all_reduce(t)
time.sleep(60)
"""

HANGING_TEST = '''
import os, signal, socket, subprocess, sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("worker.py")


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world=4):
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_port()), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    return [subprocess.Popen([sys.executable, str(WORKER)], env=dict(env, RANK=str(r)),
                             start_new_session=True) for r in range(world)]


@pytest.mark.frforensics
@pytest.mark.timeout(25)  # the workers start, hang and dump well inside it
def test_training_step_finishes():
    procs = _spawn()
    try:
        for p in procs:
            assert p.wait() == 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.mark.frforensics
def test_marked_but_passing():
    assert os.environ["FRFORENSICS_ENABLE"] == "1"
    assert Path(os.environ["FRFORENSICS_DUMP_DIR"]).is_dir()


def test_not_opted_in():
    assert "FRFORENSICS_ENABLE" not in os.environ
'''


def _run_pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    (tmp_path / "test_dist.py").write_text(HANGING_TEST)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FRFORENSICS_", "PYTEST_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env["FRFORENSICS_RECORDER_PATH"] = os.environ["FRFORENSICS_RECORDER_PATH"]  # tests/conftest.py
    env["GITHUB_STEP_SUMMARY"] = str(tmp_path / "step_summary.md")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA",
         "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_dist.py"), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False)


@pytest.mark.timeout(300)
def test_hanging_distributed_test_leaves_dumps_and_reports_naming_the_culprit(tmp_path):
    art = tmp_path / "artifacts"
    proc = _run_pytest(tmp_path, "--frforensics-artifacts", str(art),
                       "--frforensics-deadline", "2", "--frforensics-settle", "5")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "1 failed, 2 passed" in out, out
    assert "Timeout" in out, out
    # The verdict is attached to the failing test's report.
    assert "frforensics" in out and "HANG — missing_rank" in out, out
    assert "Culprit:  rank 2" in out, out

    folder = art / "test_dist.py_test_training_step_finishes"
    dumps = sorted(p.name for p in (folder / "dumps").iterdir())
    assert [d for d in dumps if d.startswith("frdump_rank_")] == [
        f"frdump_rank_{r}" for r in range(4)], dumps
    report = json.loads((folder / "report.json").read_text())
    assert report["culprit_ranks"] == [2], report
    top = report["findings"][0]
    # rank 2's four all_reduces pair with the others' #1-#4; they wait alone in #5
    assert (top["kind"], top["op"], top["seq"]) == ("missing_rank", "all_reduce", 5), top
    md = (folder / "report.md").read_text()
    assert md.startswith("## ❌ frforensics: HANG — `missing_rank`"), md
    assert "| **Culprit** | rank 2" in md
    html = (folder / "report.html").read_text()
    assert '<span id="culprits">rank 2' in html
    assert 'class="rank-row" data-rank="2"' in html
    trace = json.loads((folder / "timeline.json").read_text())
    assert any(e.get("name", "").endswith("[STUCK]") for e in trace["traceEvents"])
    # GitHub step summary: the markdown under the test's id.
    summary = (tmp_path / "step_summary.md").read_text()
    assert "### `test_dist.py::test_training_step_finishes`" in summary
    assert "`missing_rank`" in summary
    # Passing tests leave nothing behind.
    assert sorted(p.name for p in art.iterdir()) == [folder.name]


@pytest.mark.timeout(120)
def test_plugin_is_inert_without_the_flag_or_marker(tmp_path):
    (tmp_path / "test_plain.py").write_text(
        "import os\n\ndef test_plain():\n    assert 'FRFORENSICS_ENABLE' not in os.environ\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FRFORENSICS_")}
    env["FRFORENSICS_RECORDER_PATH"] = os.environ["FRFORENSICS_RECORDER_PATH"]  # tests/conftest.py
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--rootdir",
         str(tmp_path), "-c", os.devnull, str(tmp_path / "test_plain.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "frforensics-artifacts").exists()
