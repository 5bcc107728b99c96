"""``fr-analyze --deadline``: the verdict of what was read in time (issue 30).

Files not read before the deadline are listed in the report's notes, and their ranks
are never named culprits (``analyzer.consequences.unread_not_culprits``): that they
"left no dump" would be the deadline's doing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from frforensics.analyzer import AnalyzeOptions, analyze, load_dumps
from frforensics.analyzer.load import DumpSet
from frforensics.report import Severity

SAMPLE = Path(__file__).resolve().parents[2] / "sample_dumps" / "missing_rank" / "frdump"


def test_a_deadline_already_past_reads_nothing_and_lists_every_file(tmp_path: Path) -> None:
    for copy in range(3):  # 12 files: the worker pool's path (8 or more files)
        shutil.copytree(SAMPLE, tmp_path / f"copy{copy}")
    for jobs in (1, 2):
        dumps = load_dumps([tmp_path], jobs=jobs, deadline_s=0.0)
        assert dumps.digests == {}
        assert len(dumps.unread) == 12 and sorted(dumps.unread_ranks) == [0, 1, 2, 3]
        assert dumps.deadline_s == 0.0


def test_a_generous_deadline_reads_everything() -> None:
    dumps = load_dumps([SAMPLE], jobs=1, deadline_s=600.0)
    assert sorted(dumps.digests) == [0, 1, 2, 3] and dumps.unread == []
    assert analyze(dumps).culprit_ranks == (2,)


def test_a_rank_whose_dump_was_not_read_in_time_is_never_the_culprit() -> None:
    full = load_dumps([SAMPLE], jobs=1)
    assert analyze(full, options=AnalyzeOptions(world_size=4)).culprit_ranks == (2,)
    partial = DumpSet(digests={r: d for r, d in full.digests.items() if r != 2},
                      unread=[str(SAMPLE / "frdump_rank_2")], unread_ranks=[2], deadline_s=1.5)
    report = analyze(partial, options=AnalyzeOptions(world_size=4))
    assert report.culprit_ranks == () and report.actions == ()
    assert all(f.severity is Severity.WARNING for f in report.findings if 2 in
               f.evidence.get("unread", ()))
    assert any("not read before the deadline" in f.message for f in report.findings)
    assert any(n.startswith("partial verdict: 1 file(s) not read within the 1.5 s deadline")
               for n in report.notes)


def test_the_cli_takes_a_deadline_and_refuses_it_with_dask() -> None:
    cmd = [sys.executable, "-m", "frforensics", "analyze", str(SAMPLE), "--format", "json",
           "--no-progress", "--deadline", "120"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["culprit_ranks"] == [2]
    bad = subprocess.run([*cmd, "--dask", "tcp://127.0.0.1:1"], capture_output=True, text=True,
                         timeout=120, check=False)
    assert bad.returncode == 2 and "--deadline does not go with --dask" in bad.stderr
