"""``load.digest_files``: the worker side of a loader on another host (``fr-analyze --dask``)."""

from __future__ import annotations

import tarfile
from pathlib import Path

from frforensics.analyzer.load import digest_files

DATA = Path(__file__).resolve().parents[1] / "data" / "native" / "missing_rank" / "pickle"


def test_files_and_archive_members_are_digested_under_their_host_labels(tmp_path: Path) -> None:
    archive = tmp_path / "incident.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(DATA, arcname="incident")
    (tmp_path / "README.md").write_text("notes")
    (tmp_path / "nccl_trace_rank_7").write_bytes(b"\x80\x02garbage")
    files = [(f"node3:{p}", str(p), False)
             for p in (archive, tmp_path / "README.md", tmp_path / "nccl_trace_rank_7")]
    digests, problems, skipped = digest_files(files)
    assert sorted(d.rank for d in digests) == [0, 1, 2, 3]
    assert all(d.source.startswith(f"node3:{archive}!incident/") for d in digests)
    assert [p.path for p in problems] == [f"node3:{tmp_path}/nccl_trace_rank_7"]
    assert skipped == [f"node3:{tmp_path}/README.md"]
    # equal groups are one object in the batch (sent once)
    default = [g for d in digests for g in d.groups if g.desc == "default_pg"]
    assert len({id(g) for g in default}) == 1
