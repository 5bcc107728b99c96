"""Readers and writers: round trips, old versions, and hostile or broken input."""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frforensics.errors import (
    CorruptDumpError,
    NotADumpError,
    UnsafeDumpError,
    UnsupportedVersionError,
)
from frforensics.formats import decode_dump, frdump, native, sniff_format
from frforensics.model import (
    ENTRY_COLUMNS,
    DeathInfo,
    DumpHeader,
    DumpReason,
    EntryTable,
    Frame,
    GroupInfo,
    PeerHeartbeat,
    RankTrace,
    SourceFormat,
    ThreadStack,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "native"


def _native_doc(n: int = 3, *, pg_config: dict | None = None) -> dict:
    entries = []
    for i in range(n):
        entries.append({
            "frames": [{"name": "all_reduce", "filename": "/x/torch/distributed/c10d.py", "line": 10},
                       {"name": "train_step", "filename": "train.py", "line": 40 + (i % 2)}],
            "record_id": i, "pg_id": 0, "process_group": ("0", "default_pg"),
            "thread_name": "python", "thread_id": "1",
            "collective_seq_id": i + 1, "p2p_seq_id": 0, "op_id": i + 1,
            "profiling_name": "nccl:all_reduce", "time_created_ns": 1000 + i,
            "input_sizes": [[4, 4]], "input_dtypes": ["Float"],
            "output_sizes": [[4, 4]], "output_dtypes": ["Float"],
            "state": "completed" if i < n - 1 else "started",
            "time_discovered_started_ns": 1001 + i, "time_discovered_completed_ns": None,
            "retired": i < n - 1, "timeout_ms": 600000, "is_p2p": False,
        })
    return {
        "version": "2.10",
        "pg_config": pg_config if pg_config is not None else
        {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}},
        "pg_status": {},
        "entries": entries,
    }


def test_native_pickle_decodes_into_columns() -> None:
    trace = decode_dump(pickle.dumps(_native_doc()), source="nccl_trace_rank_3", rank_hint=3)
    assert trace.rank == 3 and trace.rank_from == "filename"
    assert trace.format is SourceFormat.NATIVE_PICKLE
    assert trace.groups == (GroupInfo("0", "default_pg", (0, 1, 2, 3), backend="nccl"),)
    assert trace.entries.seq.tolist() == [1, 2, 3]
    assert trace.entries.state.tolist() == [2, 2, 1]
    assert trace.entries.in_numel.tolist() == [16, 16, 16]
    assert trace.string(int(trace.entries.op[0])) == "all_reduce"
    assert len(trace.stacks) == 2  # two distinct call sites, stored once each
    assert trace.stack(int(trace.entries.stack[0]))[1] == Frame("train.py", 40, "train_step")


def test_native_json_decodes_like_the_pickle() -> None:
    doc = _native_doc()
    a = decode_dump(pickle.dumps(doc), source="a", rank_hint=0)
    b = decode_dump(json.dumps(doc).encode(), source="b", rank_hint=0)
    assert b.format is SourceFormat.NATIVE_JSON
    for name in ENTRY_COLUMNS:
        assert getattr(a.entries, name).tolist() == getattr(b.entries, name).tolist(), name


def test_gloo_empty_pg_config_leaves_membership_unknown() -> None:
    doc = _native_doc(pg_config={"": {"name": "", "desc": "", "ranks": "[]"}})
    trace = decode_dump(pickle.dumps(doc), source="x", rank_hint=0)
    assert trace.groups == (GroupInfo("0", "default_pg", None, backend="nccl"),)  # from "nccl:"


@pytest.mark.parametrize("missing", ["p2p_seq_id", "is_p2p", "thread_name", "timeout_ms",
                                     "frames", "time_discovered_started_ns", "retired"])
def test_older_schema_without_a_field_still_decodes(missing: str) -> None:
    doc = _native_doc()
    for e in doc["entries"]:
        del e[missing]
    trace = decode_dump(pickle.dumps(doc), source="x", rank_hint=1)
    assert len(trace.entries) == 3


def test_old_seq_id_field_is_read_as_collective_seq() -> None:
    doc = _native_doc()
    for e in doc["entries"]:
        e["seq_id"] = e.pop("collective_seq_id")
    doc["version"] = "2.0"
    assert decode_dump(pickle.dumps(doc), source="x", rank_hint=1).entries.seq.tolist() == [1, 2, 3]


def test_p2p_profiling_name_maps_group_ranks_to_global() -> None:
    doc = _native_doc(1, pg_config={"7": {"name": "7", "desc": "pp", "ranks": "[4, 12]"}})
    e = doc["entries"][0]
    e.update(process_group=("7", "pp"), profiling_name="nccl:recv 1<-0", is_p2p=True)
    trace = decode_dump(pickle.dumps(doc), source="x", rank_hint=12)
    assert trace.string(int(trace.entries.op[0])) == "recv"
    assert trace.entries.peer.tolist() == [4]
    assert trace.entries.is_p2p.tolist() == [1]


class _Boom:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (Path(self.path),))


def test_malicious_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"version": "2.10", "entries": [_Boom(str(marker))]})
    with pytest.raises(UnsafeDumpError, match="refused"):
        decode_dump(payload, source="evil", rank_hint=0)
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_global_reference_is_refused_at_every_protocol(protocol: int) -> None:
    payload = pickle.dumps({"version": "2.10", "entries": [], "x": Path("/")}, protocol=protocol)
    with pytest.raises(UnsafeDumpError):
        native.decode_pickle(payload, source="x")


@pytest.mark.parametrize("cut", [2, 10, 100, -1])
def test_truncated_pickle_is_a_corrupt_dump(cut: int) -> None:
    data = pickle.dumps(_native_doc())
    with pytest.raises(CorruptDumpError):
        decode_dump(data[:cut], source="x", rank_hint=0)


@pytest.mark.parametrize("doc", [
    [1, 2, 3],
    {"hello": "world"},
])
def test_pickles_that_are_no_dump_are_named_so(doc: object) -> None:
    with pytest.raises(NotADumpError):
        decode_dump(pickle.dumps(doc), source="x", rank_hint=0)


@pytest.mark.parametrize("bad_entry", [
    {"collective_seq_id": "abc"},
    {"input_sizes": [["x"]], "collective_seq_id": 1},
    {"frames": [{"name": [1]}], "collective_seq_id": 1},
])
def test_malformed_entries_are_corrupt_not_crashes(bad_entry: dict) -> None:
    doc = {"version": "2.10", "entries": [bad_entry]}
    try:
        trace = decode_dump(pickle.dumps(doc), source="x", rank_hint=0)
    except CorruptDumpError:
        return
    assert len(trace.entries) == 1  # tolerated: unknown shapes count as 0 elements


def test_unknown_bytes_are_not_a_dump() -> None:
    assert sniff_format(b"hello") is None
    with pytest.raises(NotADumpError):
        decode_dump(b"hello world", source="x", rank_hint=0)


def _trace(n: int = 5) -> RankTrace:
    rng = np.random.default_rng(0)
    columns = {name: rng.integers(0, 3, n) for name in ENTRY_COLUMNS}
    columns["stack"] = np.array([0, 1, 0, 1, -1][:n])
    frames = (Frame("train.py", 12, "step"), Frame("main.py", 3, "<module>"))
    return RankTrace(
        rank=5,
        header=DumpHeader(
            source="s",
            format=SourceFormat.FRDUMP,
            version="1",
            world_size=6,
            host="node07",
            pid=4121,
            job_id="j1",
            dump_reason=DumpReason.PEER_SIGNAL,
            dump_detail="rank 2 timed out",
            dump_time_ns=123,
            dump_monotonic_ns=45,
            completion_resolution_ns=2_000_000,
            dropped=7,
            threads=(ThreadStack("MainThread", 1, True, frames),),
            stale_peers=(PeerHeartbeat(3, 12.5),),
            death=DeathInfo("exception", "ValueError: nan", frames),
        ),
        groups=(GroupInfo("0", "default_pg", (0, 1, 2, 3, 4, 5), "gloo"),
                GroupInfo("abc", "tp", (4, 5), "nccl")),
        strings=("all_reduce", "Float", "[[4]]"),
        stacks=(frames, frames[1:]),
        entries=EntryTable.from_columns(n, columns),
        notes=("hello",),
    )


def test_frdump_round_trip_keeps_everything() -> None:
    trace = _trace()
    back = frdump.decode(frdump.encode(trace), source="s")
    for name in ENTRY_COLUMNS:
        assert getattr(back.entries, name).tolist() == getattr(trace.entries, name).tolist()
    assert back.groups == trace.groups and back.stacks == trace.stacks
    assert back.threads == trace.threads and back.death == trace.death
    assert (back.rank, back.world_size, back.host, back.pid, back.job_id) == (5, 6, "node07", 4121, "j1")
    assert back.dump_reason is DumpReason.PEER_SIGNAL and back.dropped == 7
    assert back.stale_peers == trace.stale_peers and back.notes == ("hello",)
    assert back.completion_resolution_ns == 2_000_000


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 2**40), st.integers(0, 3), st.integers(-1, 9)),
                max_size=50))
def test_frdump_round_trip_property(rows: list[tuple[int, int, int]]) -> None:
    n = len(rows)
    table = EntryTable.from_columns(n, {
        "seq": [r[0] for r in rows], "state": [r[1] for r in rows], "peer": [r[2] for r in rows]})
    trace = RankTrace(rank=0, header=DumpHeader(source="p", format=SourceFormat.FRDUMP,
                                                version="1"),
                      groups=(), strings=(), stacks=(), entries=table)
    back = frdump.decode(frdump.encode(trace))
    assert back.entries.seq.tolist() == [r[0] for r in rows]
    assert back.entries.state.tolist() == [r[1] for r in rows]
    assert back.entries.peer.tolist() == [r[2] for r in rows]


def test_newer_frdump_version_names_the_upgrade() -> None:
    import msgpack

    data = frdump.MAGIC + msgpack.packb({"format": frdump.FORMAT_NAME, "version": frdump.VERSION + 1})
    with pytest.raises(UnsupportedVersionError, match="upgrade"):
        frdump.decode(data, source="x")


@pytest.mark.parametrize("cut", [9, 50, 200, -3])
def test_truncated_frdump_is_corrupt(cut: int) -> None:
    data = frdump.encode(_trace())
    with pytest.raises(CorruptDumpError):
        frdump.decode(data[:cut], source="x")


def test_frdump_column_of_wrong_length_is_corrupt() -> None:
    import msgpack

    doc = msgpack.unpackb(frdump.encode(_trace())[len(frdump.MAGIC):], raw=False)
    doc["entries"]["columns"]["seq"][1] = doc["entries"]["columns"]["seq"][1][:-8]
    with pytest.raises(CorruptDumpError, match="seq"):
        frdump.decode(frdump.MAGIC + msgpack.packb(doc, use_bin_type=True), source="x")


def test_write_atomic_leaves_no_temp_file(tmp_path: Path) -> None:
    path = frdump.write_atomic(tmp_path / "d" / "frdump_rank_0", b"abc")
    assert path.read_bytes() == b"abc"
    assert [p.name for p in path.parent.iterdir()] == ["frdump_rank_0"]


def test_converted_2000_entry_dump_decodes_fast() -> None:
    """Not a timing assertion (machines are noisy): a sanity bound 50x the target."""
    doc = _native_doc(2000)
    trace = decode_dump(pickle.dumps(doc), source="x", rank_hint=0)
    data = frdump.encode(trace)
    start = time.perf_counter()
    back = frdump.decode(data)
    assert len(back.entries) == 2000
    assert time.perf_counter() - start < 0.05


@pytest.mark.skipif(not DATA.exists(), reason="no captured native dumps")
def test_every_captured_torch_dump_decodes() -> None:
    files = [p for p in DATA.glob("*/*/nccl_trace_rank_*")]
    assert files
    for path in files:
        trace = decode_dump(path.read_bytes(), source=str(path), rank_hint=0)
        assert trace.version.startswith("2.")


def test_version_1_frdump_with_list_ranks_still_reads() -> None:
    import msgpack

    doc = msgpack.unpackb(frdump.encode(_trace())[len(frdump.MAGIC):], raw=False)
    doc["version"] = 1
    for g in doc["groups"]:
        g["ranks"] = np.frombuffer(g["ranks"], dtype="<i4").tolist()
    back = frdump.decode(frdump.MAGIC + msgpack.packb(doc, use_bin_type=True), source="v1")
    assert back.groups == _trace().groups and back.version == "1"
