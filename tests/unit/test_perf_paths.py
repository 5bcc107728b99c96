"""Fast paths give the same answers as the straightforward ones (no timing here)."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from frforensics.analyzer.digest import RankDigest, digest
from frforensics.analyzer.load import load_dumps
from frforensics.errors import CorruptDumpError
from frforensics.formats import native
from frforensics.model import ENTRY_COLUMNS, RankTrace, SourceFormat
from frforensics.testing import JobBuilder

DATA = Path(__file__).resolve().parents[1] / "data" / "native"
_STRING_COLUMNS = {"op", "in_shapes", "out_shapes", "in_dtypes", "out_dtypes", "reduce_op",
                   "thread", "device"}


def _resolved(trace: RankTrace, rows: list[int] | None = None) -> dict[str, Any]:
    """Every column with string and stack indices replaced by what they name."""
    out: dict[str, Any] = {"groups": trace.groups}
    for name in ENTRY_COLUMNS:
        values = getattr(trace.entries, name).tolist()
        if rows is not None:
            values = [values[r] for r in rows]
        if name in _STRING_COLUMNS:
            values = [trace.string(v) for v in values]
        elif name == "stack":
            values = [trace.stack(v) for v in values]
        out[name] = values
    return out


def _general(doc: Any, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> RankTrace:
    def irregular(*_: object) -> None:
        raise native._Irregular

    with monkeypatch.context() as m:
        m.setattr(native, "_columns_bulk", irregular)
        return native.to_trace(doc, source="x", fmt=SourceFormat.NATIVE_PICKLE, rank=0, **kw)


def _fast(doc: Any, **kw: Any) -> RankTrace:
    return native.to_trace(doc, source="x", fmt=SourceFormat.NATIVE_PICKLE, rank=0, **kw)


def _captured_docs() -> list[tuple[str, Any]]:
    docs = []
    for path in sorted(DATA.glob("*/*/nccl_trace_rank_*")):
        data = path.read_bytes()
        doc = native.decode_pickle(data) if data[:1] == b"\x80" else native.decode_json(data)
        docs.append((str(path.relative_to(DATA)), doc))
    return docs


@pytest.fixture(scope="module")
def builder_docs() -> list[dict[str, Any]]:
    job = (JobBuilder(world_size=16, tp=4, pp=2, dp=2, ring_size=300, seed=3).steps(12)
           .skip(rank=5, group="tp", step=11).jitter(ms=0.5))
    dumps = job.build()
    return [pickle.loads(dumps.native_bytes(r)) for r in dumps.native_ranks[:6]]


@pytest.mark.skipif(not DATA.exists(), reason="no captured native dumps")
def test_column_reader_matches_entry_reader_on_captured_torch_dumps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = _captured_docs()
    assert docs
    for name, doc in docs:
        assert _resolved(_fast(doc)) == _resolved(_general(doc, monkeypatch)), name


def test_column_reader_matches_entry_reader_on_builder_dumps(
    builder_docs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    for doc in builder_docs:
        fast = _fast(doc)
        assert _resolved(fast) == _resolved(_general(doc, monkeypatch))
        assert (fast.entries.in_numel > 0).any() and (fast.entries.stack >= 0).all()


def test_matching_view_digests_like_the_full_trace(builder_docs: list[dict[str, Any]]) -> None:
    for doc in builder_docs:
        full = digest(_fast(doc), rank=0, tail=8)
        view = digest(_fast(doc, detail_tail=8), rank=0, tail=8)
        _assert_same_digest(full, view)


def test_matching_view_resolves_only_kept_entries(builder_docs: list[dict[str, Any]]) -> None:
    doc = builder_docs[0]
    view = _fast(doc, detail_tail=8)
    full = _fast(doc)
    n = len(view.entries)
    kept = sorted(set(range(n - 8, n)) | set(np.flatnonzero(full.entries.state < 2).tolist()))
    assert _resolved(view, kept) == _resolved(full, kept)
    others = np.setdiff1d(np.arange(n), kept)
    assert (view.entries.in_shapes[others] == -1).all()
    assert (view.entries.stack == full.entries.stack).all()  # stacks stay complete


def _assert_same_digest(a: RankDigest, b: RankDigest) -> None:
    for name in RankDigest.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y), name
        else:
            assert x == y, name


def _doc(n: int = 4) -> dict[str, Any]:
    frames = [{"name": "f", "filename": "a.py", "line": 1}, {"name": "g", "filename": "b.py", "line": 2}]
    entries = [{
        "frames": list(frames), "record_id": i, "pg_id": 0, "process_group": ("0", "default_pg"),
        "thread_name": "python", "collective_seq_id": i + 1, "p2p_seq_id": 0,
        "profiling_name": "nccl:all_reduce", "time_created_ns": 10 + i,
        "input_sizes": [[4, 4]], "input_dtypes": ["Float"], "output_sizes": [[4, 4]],
        "output_dtypes": ["Float"], "state": "completed", "time_discovered_started_ns": 11 + i,
        "time_discovered_completed_ns": 12 + i, "retired": True, "timeout_ms": 1000,
        "is_p2p": False,
    } for i in range(n)]
    return {"version": "2.10", "pg_config": {}, "entries": entries}


@pytest.mark.parametrize("sizes", [
    [[True, 4]],            # bools are not dims
    [[2.5, 4]],             # nor floats
    [[4], [[2]]],           # nested deeper than shapes
    [[2**40, 2**40]],       # products past int64
    [[-1, 4]],              # negative dims (the entry reader decides)
    [[]],                   # a scalar
    [],                     # no tensors
    "abc",                  # not a list
    [{"a": 1}],             # shape that is a dict
], ids=repr)
def test_odd_shapes_read_the_same_on_both_paths(sizes: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = _doc()
    doc["entries"][2]["input_sizes"] = sizes
    try:
        general = _resolved(_general(copy.deepcopy(doc), monkeypatch))
    except CorruptDumpError:
        with pytest.raises(CorruptDumpError):
            _fast(doc)
        return
    assert _resolved(_fast(doc)) == general


def test_hostile_shape_never_multiplies_a_string() -> None:
    doc = _doc()
    doc["entries"][1]["input_sizes"] = [["x", 10**12]]  # "x" * 10**12 would exhaust memory
    trace = _fast(doc)
    assert trace.entries.in_numel[1] == 0


@pytest.mark.parametrize("change", [
    {"process_group": ["0", "default_pg"]},     # JSON spells tuples as lists
    {"process_group": None, "pg_id": 0},       # no tuple: pg_id
    {"collective_seq_id": None, "seq_id": 7},  # older field name
    {"frames": None},
    {"state": ["odd"]},                         # unhashable
], ids=repr)
def test_irregular_entries_fall_back_to_the_entry_reader(
    change: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = _doc()
    doc["entries"][1].update(change)
    assert _resolved(_fast(doc)) == _resolved(_general(copy.deepcopy(doc), monkeypatch))


def test_missing_key_in_one_entry_falls_back() -> None:
    doc = _doc()
    del doc["entries"][3]["is_p2p"]
    trace = _fast(doc)
    assert len(trace.entries) == 4


def test_loader_digests_native_and_converted_dumps_alike(tmp_path: Path) -> None:
    dumps = (JobBuilder(world_size=16, tp=4, pp=2, dp=2, ring_size=200, seed=1).steps(8)
             .stuck(rank=6, step=7).build())
    dumps.write_native(tmp_path / "native", jobs=1)
    native_set = load_dumps([tmp_path / "native"], jobs=2)
    one_by_one = load_dumps([tmp_path / "native"], jobs=1)
    assert sorted(native_set.digests) == sorted(one_by_one.digests) == dumps.native_ranks
    for rank, d in native_set.digests.items():
        _assert_same_digest(d, one_by_one.digests[rank])
