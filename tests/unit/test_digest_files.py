"""``cluster.digest_here``: the worker side of ``fr-analyze --dask`` (no Dask needed)."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

from frforensics.analyzer.cluster import digest_here
from frforensics.analyzer.digest import RankDigest
from frforensics.formats.sources import Skipped
from frforensics.report import LoadProblem

DATA = Path(__file__).resolve().parents[1] / "data" / "native" / "missing_rank" / "pickle"


def test_files_and_archive_members_are_digested_under_their_host_labels(tmp_path: Path) -> None:
    archive = tmp_path / "incident.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(DATA, arcname="incident")
    (tmp_path / "README.md").write_text("notes")
    (tmp_path / "nccl_trace_rank_7").write_bytes(b"\x80\x02garbage")
    os.mkfifo(tmp_path / "nccl_trace_rank_8")  # never opened: the one reader stats first
    files = [(f"node3:{p}", str(p), False)
             for p in (archive, tmp_path / "README.md", tmp_path / "nccl_trace_rank_7",
                       tmp_path / "nccl_trace_rank_8", tmp_path / "gone_rank_9")]
    out = digest_here(files)
    digests = [r for r in out if isinstance(r, RankDigest)]
    problems = [r for r in out if isinstance(r, LoadProblem)]
    skipped = [r.label for r in out if isinstance(r, Skipped)]
    assert sorted(d.rank for d in digests) == [0, 1, 2, 3]
    assert all(d.source.startswith(f"node3:{archive}!incident/") for d in digests)
    assert [p.path for p in problems] == [f"node3:{tmp_path}/{name}" for name in (
        "nccl_trace_rank_7", "nccl_trace_rank_8", "gone_rank_9")]
    assert "fifo" in problems[1].error.lower()
    assert skipped == [f"node3:{tmp_path}/README.md"]
