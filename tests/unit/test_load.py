"""Finding dumps whatever their layout, and surviving bad files."""

from __future__ import annotations

import shutil
import tarfile
import zipfile
from pathlib import Path

import pytest

from frforensics.analyzer.load import load_dumps, rank_from_name
from frforensics.errors import UsageError

DATA = Path(__file__).resolve().parents[1] / "data" / "native" / "missing_rank" / "pickle"


@pytest.mark.parametrize(("name", "prefix", "rank"), [
    ("nccl_trace_rank_3", None, 3),
    ("dumps/node07-gpu2_nccl_trace_rank_13.pkl", None, 13),
    ("comm_lib_trace_rank_0", None, 0),
    ("frdump_rank_4095", None, 4095),
    ("job_quorum_7/12", None, 12),
    ("nccl_trace_rank_3", "nccl_trace_rank_", 3),
    ("node12_nccl_trace_rank_3", "nccl_trace_rank_", None),
    ("README.md", None, None),
])
def test_rank_comes_from_the_trailing_number(name: str, prefix: str | None, rank: int | None) -> None:
    assert rank_from_name(name, prefix) == rank


def _copy(dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in DATA.iterdir():
        shutil.copy(f, dst / f.name)
    return dst


def test_directory_tree_with_notes_and_temp_files(tmp_path: Path) -> None:
    root = _copy(tmp_path / "job" / "host-a")
    (root / "README.md").write_text("# notes")
    (root / "expected.json").write_text('{"kind": "x"}')
    (root / ".nccl_trace_rank_9.tmp").write_bytes(b"\x80\x02partial")
    dumps = load_dumps([tmp_path / "job"], jobs=1)
    assert dumps.ranks == [0, 1, 2, 3]
    assert dumps.problems == []
    assert len(dumps.skipped) == 2


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
def test_archives_are_read_in_place(tmp_path: Path, kind: str) -> None:
    archive = tmp_path / f"incident.{kind}"
    if kind == "zip":
        with zipfile.ZipFile(archive, "w") as zf:
            for f in DATA.iterdir():
                zf.write(f, f"incident/{f.name}")
    else:
        with tarfile.open(archive, "w:gz") as tf:
            tf.add(DATA, arcname="incident")
    dumps = load_dumps([archive], jobs=1)
    assert dumps.ranks == [0, 1, 2, 3]


def test_bad_rank_file_is_a_problem_and_the_rest_is_analyzed(tmp_path: Path) -> None:
    root = _copy(tmp_path / "d")
    (root / "nccl_trace_rank_1").write_bytes(b"\x80\x04garbage")
    (root / "nccl_trace_rank_2").write_bytes(b"")
    dumps = load_dumps([root], jobs=1)
    assert dumps.ranks == [0, 3]
    assert sorted(Path(p.path).name for p in dumps.problems) == ["nccl_trace_rank_1",
                                                                  "nccl_trace_rank_2"]


def test_duplicate_rank_keeps_one_and_says_so(tmp_path: Path) -> None:
    _copy(tmp_path / "a")
    (tmp_path / "b").mkdir()
    shutil.copy(DATA / "nccl_trace_rank_1", tmp_path / "b" / "nccl_trace_rank_1")
    dumps = load_dumps([tmp_path], jobs=1)
    assert dumps.ranks == [0, 1, 2, 3]
    assert len(dumps.problems) == 1 and "duplicate dump for rank 1" in dumps.problems[0].error


def test_parallel_decode_gives_the_same_result(tmp_path: Path) -> None:
    for i in range(3):
        _copy(tmp_path / f"q{i}")
    serial = load_dumps([tmp_path / "q0"], jobs=1)
    parallel = load_dumps([tmp_path / "q0"], jobs=2)
    assert serial.ranks == parallel.ranks
    for r in serial.ranks:
        assert serial.digests[r].seq.tolist() == parallel.digests[r].seq.tolist()


def test_missing_path_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        load_dumps([tmp_path / "nope"])


def test_pytorch_dump_beside_ours_is_no_duplicate(tmp_path: Path) -> None:
    from frforensics.analyzer.convert import convert_dumps

    root = _copy(tmp_path / "d")
    convert_dumps([DATA], root, jobs=1)  # frdump_rank_<r> next to nccl_trace_rank_<r>
    dumps = load_dumps([root], jobs=1)
    assert dumps.ranks == [0, 1, 2, 3]
    assert dumps.problems == []
    assert all(d.format == "frdump" for d in dumps.digests.values())
    assert len(dumps.companions) == 4


def test_a_file_that_kills_its_reader_is_one_problem_and_the_rest_are_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that dies (the OOM killer, a crash in a C reader) broke the whole pool:
    every batch in flight was lost and ``fr-analyze`` ended in an internal error. Now
    the lost batches' files are read again one at a time and only the killer is lost.
    (The workers are forked: the stand-in for a fatal file reaches them.)"""
    import os
    import signal

    from frforensics.analyzer import load
    from frforensics.testing import JobBuilder
    JobBuilder(world_size=16, tp=2, dp=8, ring_size=40, seed=1).steps(4).build() \
        .write_frdump(tmp_path / "d", jobs=1)
    expected = load_dumps([tmp_path / "d"], jobs=1)
    real = load.digest_source

    def fatal(source: load.DumpSource, **kw: object) -> object:
        if source.label.endswith("_rank_5"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(source, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(load, "digest_source", fatal)
    got = load_dumps([tmp_path / "d"], jobs=2)
    assert sorted(got.digests) == [r for r in range(16) if r != 5]
    assert [(p.path.rsplit("/", 1)[-1], p.error) for p in got.problems] == [
        ("frdump_rank_5", load.READER_DIED)]
    for r in got.digests:
        assert got.digests[r].seq.tolist() == expected.digests[r].seq.tolist()
