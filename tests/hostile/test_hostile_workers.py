"""``--dask`` with a broken or hostile worker: that worker's files are load problems, never exit 3.

An in-process Dask ``LocalCluster`` reads a folder holding the four good ranks
(``hostile_corpus.GOOD``) and one more file, ``evil``; the worker function is
replaced so that the batch holding ``evil`` comes back broken (``None``, a
3-tuple, problems of the wrong shape, a payload that is no bytes, every crafted
payload of ``peer_corpus``, a forged newer duplicate of rank 0 under another
file's name). Every case: the four good ranks are read exactly as locally and
analyzed to the same verdict, and exactly one load problem names ``evil``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hostile_corpus
import peer_corpus
import pytest

from frforensics.analyzer import analyze, cluster, load_dumps, wire
from frforensics.analyzer.digest import RankDigest
from frforensics.analyzer.load import digest_paths

if os.environ.get("CI"):
    import distributed  # CI installs frforensics[dask]: a missing package fails here
else:
    distributed = pytest.importorskip("distributed")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("workers") / "dumps"
    shutil.copytree(hostile_corpus.GOOD, root)
    (root / "evil").write_bytes(b"not a dump")
    return root


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    with (distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                   dashboard_address=None, silence_logs=40) as c,
          distributed.Client(c, set_as_default=False) as cl):
        yield cl


@pytest.fixture(scope="module")
def good() -> list[RankDigest]:
    return [d for d in digest_paths([hostile_corpus.GOOD]) if isinstance(d, RankDigest)]


def _forged_rank_0(good: list[RankDigest], folder: Path) -> bytes:
    real = next(d for d in good if d.rank == 0)
    newer = (real.dump_time_ns or 0) + 10**12
    forged = dataclasses.replace(real, header=dataclasses.replace(
        real.header, dump_time_ns=newer, source=f"x:{folder}/nccl_trace_rank_0"))
    return wire.encode_batch([forged])


_CRAFTED: dict[str, bytes] = {}


def _crafted(good: list[RankDigest]) -> dict[str, bytes]:
    if not _CRAFTED:
        _CRAFTED.update(peer_corpus.payloads(good, bombs=False))
    return _CRAFTED


def _results(good: list[RankDigest], folder: Path) -> dict[str, Callable[[Any], Any]]:
    """Name -> what the replaced worker function returns for ``evil``'s batch
    (given the real result)."""
    out: dict[str, Callable[[Any], Any]] = {
        "none": lambda real: None,
        "none_and_problems": lambda real: (None, []),
        "three_tuple": lambda real: (real[0], real[1], "extra"),
        "problems_of_two": lambda real: (real[0], [("x", "y")]),
        "problem_about_another_file": lambda real: (
            real[0], [(f"x:{folder}/nccl_trace_rank_0", "gone", False)]),
        "payload_is_text": lambda real: (real[0].decode("latin-1"), real[1]),
        "payload_is_garbage": lambda real: (b"FRW1z" + bytes(100), real[1]),
        "a_list": lambda real: [real[0]],
        "an_int": lambda real: 3,
        "forged_duplicate_rank_0": lambda real: (_forged_rank_0(good, folder), []),
    }
    crafted = _crafted(good)
    for name in peer_corpus.EDITS:
        out[f"payload_{name}"] = lambda real, data=crafted[name]: (data, [])
    return out


CASES = ["none", "none_and_problems", "three_tuple", "problems_of_two",
         "problem_about_another_file", "payload_is_text", "payload_is_garbage", "a_list",
         "an_int", "forged_duplicate_rank_0", *(f"payload_{n}" for n in peer_corpus.EDITS)]


def _verdict(dumps: Any) -> dict[str, Any]:
    doc = analyze(dumps).to_json()
    return {"status": doc["status"], "culprits": doc.get("culprit_ranks"),
            "findings": sorted((f["kind"], tuple(f["culprit_ranks"])) for f in doc["findings"])}


@pytest.mark.parametrize("case", CASES)
def test_a_broken_worker_result_is_one_load_problem_for_its_files(
        monkeypatch: pytest.MonkeyPatch, client: Any, folder: Path, good: list[RankDigest],
        case: str) -> None:
    broken = _results(good, folder)[case]
    real_decode = cluster._decode_here

    def decode(items: Any, *args: Any) -> Any:
        real = real_decode(items, *args)
        if any(path.endswith("/evil") for _, path, _ in items):
            return broken(real)
        return real

    monkeypatch.setattr(cluster, "_decode_here", decode)
    dumps = cluster.load_dumps_dask([str(folder)], client)
    local = load_dumps([str(hostile_corpus.GOOD)], jobs=1)
    assert sorted(dumps.digests) == hostile_corpus.GOOD_RANKS
    for rank, d in dumps.digests.items():
        assert d.dump_time_ns == local.digests[rank].dump_time_ns
        assert d.source.endswith(f"/nccl_trace_rank_{rank}")
    assert len(dumps.problems) == 1, dumps.problems
    problem = dumps.problems[0]
    assert problem.path.endswith("/evil"), problem
    assert "\n" not in problem.error
    assert _verdict(dumps) == _verdict(local)


def test_a_broken_listing_is_one_load_problem_for_that_host(
        monkeypatch: pytest.MonkeyPatch, client: Any, folder: Path) -> None:
    monkeypatch.setattr(cluster, "_list_here", lambda paths, unit: ([("a", "b")], [], None))
    dumps = cluster.load_dumps_dask([str(folder)], client)
    assert not dumps.digests
    assert len(dumps.problems) == 1 and "not (files, problems)" in dumps.problems[0].error
