"""The one reader (formats.sources): discovery, archives, limits, names, duplicates."""

from __future__ import annotations

import io
import os
import shutil
import time
import zipfile
from pathlib import Path

import pytest

from frforensics.analyzer.load import assemble, cap_jobs, digest_paths, load_dumps
from frforensics.errors import DumpError
from frforensics.formats import read_sources, sources
from frforensics.formats.limits import Limits
from frforensics.formats.sources import DumpSource, rank_from_name, read_file, read_source
from frforensics.model import RankTrace
from frforensics.report import LoadProblem

DATA = Path(__file__).resolve().parents[1] / "data" / "native" / "missing_rank" / "pickle"


def _copy(dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in DATA.iterdir():
        shutil.copy(f, dst / f.name)
    return dst


@pytest.mark.parametrize(("name", "rank"), [
    ("nccl_trace_rank_1048575", 1048575),
    ("nccl_trace_rank_1048576", None),  # limits.max_rank = 2**20
    ("nccl_trace_rank_10000000", None),
    ("dump_20261201101500", None),  # a timestamp
    ("nccl_trace_rank_" + "9" * 400, None),  # never parsed into a huge int
    ("x.zip!inner/nccl_trace_rank_5", 5),
])
def test_huge_trailing_numbers_are_no_ranks(name: str, rank: int | None) -> None:
    assert rank_from_name(name) == rank


def test_same_file_passed_twice_is_not_its_own_duplicate(tmp_path: Path) -> None:
    root = _copy(tmp_path / "d")
    os.symlink(root / "nccl_trace_rank_1", root / "nccl_trace_rank_1.link")
    dumps = load_dumps([root / "nccl_trace_rank_0", root, root], jobs=1)
    assert dumps.ranks == [0, 1, 2, 3]
    assert dumps.problems == []


def test_fifo_is_a_problem_and_is_never_opened(tmp_path: Path) -> None:
    root = _copy(tmp_path / "d")
    os.mkfifo(root / "nccl_trace_rank_7")
    start = time.monotonic()
    items = list(read_sources([root, root / "nccl_trace_rank_7"]))
    assert time.monotonic() - start < 10
    problems = [i for i in items if isinstance(i, LoadProblem)]
    assert [Path(p.path).name for p in problems] == ["nccl_trace_rank_7"]
    assert "FIFO" in problems[0].error
    assert sorted(i.rank for i in items if isinstance(i, RankTrace)) == [0, 1, 2, 3]


def test_a_fifo_swapped_in_after_discovery_does_not_block(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "f")
    with pytest.raises(DumpError, match="FIFO"):
        read_file(str(tmp_path / "f"))


def test_links_to_devices_loops_and_nothing_are_problems(tmp_path: Path) -> None:
    root = _copy(tmp_path / "d")
    os.symlink("/dev/zero", root / "nccl_trace_rank_4")
    os.symlink("nccl_trace_rank_6", root / "nccl_trace_rank_5")
    os.symlink("nccl_trace_rank_5", root / "nccl_trace_rank_6")
    os.symlink("nowhere", root / "nccl_trace_rank_7")
    dumps = load_dumps([root], jobs=1)
    assert dumps.ranks == [0, 1, 2, 3]
    errors = {Path(p.path).name: p.error for p in dumps.problems}
    assert "device" in errors["nccl_trace_rank_4"]
    assert "loop" in errors["nccl_trace_rank_5"] and "loop" in errors["nccl_trace_rank_6"]
    assert "nothing" in errors["nccl_trace_rank_7"]


def _zip(path: Path, members: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)


def test_corrupt_zip_member_costs_that_member_only(tmp_path: Path) -> None:
    members = {f.name: f.read_bytes() for f in sorted(DATA.iterdir())}
    archive = tmp_path / "a.zip"
    _zip(archive, {"nccl_trace_rank_9": members["nccl_trace_rank_0"] * 3, **members})
    blob = bytearray(archive.read_bytes())
    for i in range(60, 200):  # inside the first member's deflate stream
        blob[i] ^= 0x33
    archive.write_bytes(bytes(blob))
    dumps = load_dumps([archive], jobs=1)
    assert dumps.ranks == [0, 1, 2, 3]
    assert [p.path.rsplit("!", 1)[1] for p in dumps.problems] == ["nccl_trace_rank_9"]


def test_archive_past_its_expansion_budget_is_one_problem(tmp_path: Path) -> None:
    archive = tmp_path / "bomb.zip"
    _zip(archive, {"nccl_trace_rank_7": bytes(4 << 20), "nccl_trace_rank_8": bytes(4 << 20)})
    limits = Limits(archive_ratio_floor_bytes=1 << 20, max_archive_ratio=10)
    items = list(sources.discover([archive], limits=limits))
    assert len(items) == 1 and isinstance(items[0], LoadProblem)
    assert "expands to more than" in items[0].error


def test_oversized_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    big = tmp_path / "nccl_trace_rank_0"
    with open(big, "wb") as fh:
        fh.truncate(1 << 30)  # sparse: costs nothing on disk
    out = read_source(DumpSource(str(big), path=str(big)), limits=Limits(max_file_bytes=1 << 20))
    assert isinstance(out, LoadProblem) and "too large" in out.error


def test_any_decoder_exception_becomes_a_load_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a: object, **_k: object) -> RankTrace:
        raise KeyError("surprise")

    monkeypatch.setattr(sources, "decode_dump", boom)
    path = str(DATA / "nccl_trace_rank_0")
    out = read_source(DumpSource(path, path=path))
    assert isinstance(out, LoadProblem) and "KeyError" in out.error


def test_digest_paths_is_the_per_worker_entry_point(tmp_path: Path) -> None:
    root = _copy(tmp_path / "d")
    (root / "nccl_trace_rank_9").write_bytes(b"\x80\x04junk")
    (root / "README.md").write_text("notes")
    items = digest_paths([str(root)])
    dumps = assemble(items)
    assert dumps.ranks == [0, 1, 2, 3]
    assert [Path(p.path).name for p in dumps.problems] == ["nccl_trace_rank_9"]
    assert dumps.ranks == load_dumps([root], jobs=1).ranks


def test_jobs_are_capped_to_the_cores() -> None:
    assert cap_jobs(10_000) == (os.cpu_count() or 1)
    assert cap_jobs(None) == (os.cpu_count() or 1)
    assert cap_jobs(1) == 1


def test_archives_are_read_one_member_at_a_time(tmp_path: Path) -> None:
    archive = tmp_path / "a.zip"
    _zip(archive, {f.name: f.read_bytes() for f in DATA.iterdir()})
    stream = sources.discover([archive])
    first = next(stream)
    assert isinstance(first, DumpSource) and first.data is not None
    assert "!" in first.label  # the rest is not read yet
    assert len(list(stream)) == 3


def test_streamed_timeline_and_convert_share_the_reader(tmp_path: Path) -> None:
    from frforensics.analyzer.convert import convert_dumps
    from frforensics.analyzer.timeline import write_timeline

    root = _copy(tmp_path / "d")
    os.mkfifo(root / "nccl_trace_rank_7")
    out = io.StringIO()
    summary = write_timeline(read_sources([root]), out)
    assert summary.ranks == [0, 1, 2, 3] and len(summary.problems) == 1
    result = convert_dumps([root], tmp_path / "out")
    assert len(result.written) == 4 and [Path(p).name for p, _ in result.failed] == [
        "nccl_trace_rank_7"]
