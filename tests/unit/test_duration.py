"""PyTorch's ``duration_ms`` (NCCL, timing on): read by every reader alike, carried by
frdump and the digest, and used by the straggler detector on NCCL dumps."""

from __future__ import annotations

import copy
import json
import math
import pickle
from collections import Counter
from typing import Any

import msgpack
import numpy as np
import pytest

from frforensics.analyzer import AnalyzeOptions, analyze
from frforensics.analyzer.digest import digest
from frforensics.analyzer.load import DumpSet
from frforensics.errors import CorruptDumpError
from frforensics.formats import decode_dump, frdump, native
from frforensics.model import RankTrace
from frforensics.report import Report

# ---------------------------------------------------------------- readers

#: duration_ms as written -> ns read (-1: unknown): PyTorch writes a float of ms;
#: anything else is damage and reads as unknown, never as a failed load
DURATIONS: list[tuple[Any, int]] = [
    (1.5, 1_500_000), (0.0005, 500), (0.0, 0), (3, 3_000_000), (2.25e-7, 0), (7.5e-7, 1),
    (None, -1), (True, -1), ("5", -1), ([1.0], -1), (math.nan, -1), (math.inf, -1),
    (-math.inf, -1), (-1.0, -1), (1e300, -1), (2**70, -1), (4.7e12, -1), (-(2**70), -1),
]


def _entry(i: int, duration: Any = "absent") -> dict[str, Any]:
    e: dict[str, Any] = {
        "frames": [{"name": "step", "filename": "train.py", "line": 12}],
        "record_id": i, "pg_id": 0, "process_group": ("0", "default_pg"),
        "thread_name": "python", "thread_id": "1",
        "collective_seq_id": i + 1, "p2p_seq_id": 0, "op_id": i + 1,
        "profiling_name": "nccl:all_reduce", "time_created_ns": 1000 + i,
        "input_sizes": [[4, 4]], "input_dtypes": ["Float"],
        "output_sizes": [[4, 4]], "output_dtypes": ["Float"],
        "state": "completed", "time_discovered_started_ns": 2000 + i,
        "time_discovered_completed_ns": 3000 + i, "retired": True, "timeout_ms": 600000,
        "is_p2p": False,
    }
    if duration != "absent":
        e["duration_ms"] = duration
    return e


def _doc(entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg",
                                                   "ranks": "[0, 1]"}},
            "pg_status": {}, "entries": entries}


def _durations(trace: RankTrace) -> list[int]:
    return trace.entries.duration_ns.tolist()  # type: ignore[no-any-return]


def _read_all_ways(doc: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    data = pickle.dumps(doc, protocol=2)
    out = {}
    if native.scanner_available():
        out["scanner"] = _durations(native.pickle_to_trace(data, source="f", rank=0))
    monkeypatch.setenv("FRFORENSICS_PICKLE_SCAN", "0")
    out["unpickler"] = _durations(native.pickle_to_trace(data, source="f", rank=0))
    monkeypatch.delenv("FRFORENSICS_PICKLE_SCAN")
    finite = all(not isinstance(v, float) or math.isfinite(v) for e in doc["entries"]
                 for v in [e.get("duration_ms")])
    if finite:  # JSON has no NaN or infinity
        out["json"] = _durations(decode_dump(json.dumps(doc).encode(), source="f", rank_hint=0))
    return out


def test_every_reader_gives_the_same_duration_for_every_value(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert native.scanner_available(), "the C scanner must be compiled for this comparison"
    entries = [_entry(i, v) for i, (v, _) in enumerate(DURATIONS)] + [_entry(len(DURATIONS))]
    expected = [ns for _, ns in DURATIONS] + [-1]
    got = _read_all_ways(_doc(entries), monkeypatch)
    assert got["scanner"] == expected
    assert got["unpickler"] == expected
    # the entry-at-a-time reader (an entry lacking a field the bulk reader needs)
    irregular = copy.deepcopy(entries)
    del irregular[0]["timeout_ms"]
    assert _read_all_ways(_doc(irregular), monkeypatch)["unpickler"] == expected
    finite = [(_entry(i, v), ns) for i, (v, ns) in enumerate(DURATIONS)
              if not isinstance(v, float) or math.isfinite(v)]
    assert _read_all_ways(_doc([e for e, _ in finite]), monkeypatch)["json"] == [
        ns for _, ns in finite]


def test_random_float_durations_read_alike_in_c_and_python(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 1 << 63, 3000, dtype=np.int64).view(np.float64)  # any double
    values = [*bits.tolist(), *(rng.exponential(20.0, 3000)).tolist()]
    got = _read_all_ways(_doc([_entry(i, v) for i, v in enumerate(values)]), monkeypatch)
    assert got["scanner"] == got["unpickler"]
    assert sum(ns >= 0 for ns in got["scanner"]) > 3000  # the fuzz reached real durations


def test_dumps_without_duration_read_unknown() -> None:
    trace = decode_dump(pickle.dumps(_doc([_entry(0), _entry(1)]), protocol=2), source="f",
                        rank_hint=0)
    assert _durations(trace) == [-1, -1]
    assert digest(trace, rank=0).duration_ns is None


def test_frdump_carries_durations_and_reads_older_files_as_unknown() -> None:
    trace = decode_dump(pickle.dumps(_doc([_entry(0, 1.5), _entry(1)]), protocol=2),
                        source="f", rank_hint=0)
    data = frdump.encode(trace)
    assert _durations(frdump.decode(data, source="s")) == [1_500_000, -1]
    doc = msgpack.unpackb(data[len(frdump.MAGIC):], raw=False, strict_map_key=False)
    del doc["entries"]["columns"]["duration_ns"]  # a file written before the column
    old = frdump.MAGIC + msgpack.packb(doc, use_bin_type=True)
    assert _durations(frdump.decode(old, source="s")) == [-1, -1]
    for bad in (-2, 1 << 62):
        doc["entries"]["columns"]["duration_ns"] = ["<i8", np.array([bad, 0], "<i8").tobytes()]
        with pytest.raises(CorruptDumpError, match="duration_ns"):
            frdump.decode(frdump.MAGIC + msgpack.packb(doc, use_bin_type=True), source="s")


def test_coalesced_members_take_their_closing_entrys_duration() -> None:
    members = [_entry(i) for i in range(3)]
    for i, e in enumerate(members):  # recorded without events: scheduled, never retired
        e.update(collective_seq_id=5, op_id=5 + i, state="scheduled", retired=False,
                 time_discovered_started_ns=None, time_discovered_completed_ns=None,
                 profiling_name="nccl:reduce_scatter_tensor")
    closing = _entry(3, 2.5)
    closing.update(collective_seq_id=5, op_id=7, profiling_name="nccl:coalesced",
                   input_sizes=[], output_sizes=[], input_dtypes=[], output_dtypes=[])
    trace = decode_dump(pickle.dumps(_doc([_entry(9, 0.25), *members, closing]), protocol=2),
                        source="f", rank_hint=0)
    d = digest(trace, rank=0)
    assert d.duration_ns is not None
    assert d.duration_ns.tolist() == [250_000, 2_500_000, 2_500_000, 2_500_000, 2_500_000]


# ---------------------------------------------------------------- straggler

#: 2 x 2 grid: TP groups {0, 1} and {2, 3}, DP groups {0, 2} and {1, 3}
GROUPS = {"tp0": (0, 1), "tp1": (2, 3), "dp0": (0, 2), "dp1": (1, 3)}
STEP = ("tp", "tp", "dp")  # two TP all_reduces, then the DP gradient all_reduce
T0_NS = 1_800_000_000_000_000_000


def _straggler_job(*, steps: int = 6, delay_ms: float = 20.0, timing: bool = True
                   ) -> dict[int, dict[str, Any]]:
    """Native NCCL dumps of a 4-rank job whose rank 0 computes ``delay_ms`` longer
    before every op, worked out by hand: each GPU reaches an op ``compute`` after
    its previous op completed (plus the delay on rank 0), an op completes on all
    members ``transfer`` after the last one reached it, ``duration_ms`` is
    completion minus this rank's arrival, the CPU runs 3 ms ahead (rank 0's CPU is
    the bottleneck: it enqueues just before its GPU starts), and the watchdog
    discovers completions at its next 100 ms poll.

    Per step, rank 1 waits ~20 ms in each TP all_reduce for rank 0, so it reaches its
    DP all_reduce ~40 ms after rank 3; rank 2 waits ~60 ms in the DP all_reduce for
    rank 0 and so reaches the next TP all_reduce ~20 ms after rank 3: both are late
    by far more than any threshold, only because they waited for rank 0.
    """
    compute, transfer = 1.0, 0.5
    free = [0.0] * 4
    seqs: Counter[str] = Counter()
    entries: dict[int, list[dict[str, Any]]] = {r: [] for r in range(4)}
    for _ in range(steps):
        for kind in STEP:
            for name, members in GROUPS.items():
                if not name.startswith(kind):
                    continue
                seqs[name] += 1
                arrive = {r: free[r] + compute + (delay_ms if r == 0 else 0.0) for r in members}
                done = max(arrive.values()) + transfer
                for r in members:
                    free[r] = done
                    e = _entry(len(entries[r]))
                    poll = math.ceil(done / 100.0) * 100.0
                    e.update(pg_id=list(GROUPS).index(name) + 1, process_group=(name, name),
                             collective_seq_id=seqs[name], op_id=seqs[name],
                             time_created_ns=T0_NS + round((arrive[r] - (0.01 if r == 0 else 3.0))
                                                           * 1e6),
                             time_discovered_completed_ns=T0_NS + round(poll * 1e6),
                             time_discovered_started_ns=(T0_NS + round(poll * 1e6)) if timing
                             else None)
                    if timing:
                        e["duration_ms"] = round(done - arrive[r], 6)
                    entries[r].append(e)
    return {r: {"version": "2.10",
                "pg_config": {name: {"name": name, "desc": name, "ranks": str(list(members))}
                              for name, members in GROUPS.items()},
                "pg_status": {}, "entries": es} for r, es in entries.items()}


def _analyze(docs: dict[int, dict[str, Any]], fmt: str) -> Report:
    traces = {r: decode_dump(json.dumps(doc).encode() if fmt == "json"
                             else pickle.dumps(doc, protocol=2),
                             source=f"nccl_trace_rank_{r}", rank_hint=r)
              for r, doc in docs.items()}
    return analyze(DumpSet.from_traces(traces), options=AnalyzeOptions(world_size=4))


@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_nccl_straggler_is_found_from_gpu_durations_and_its_waiters_are_not(fmt: str) -> None:
    report = _analyze(_straggler_job(), fmt)
    assert report.culprit_ranks == (0,)
    first = report.findings[0]
    assert first.kind.value == "straggler" and first.culprit_ranks == (0,)
    assert first.evidence["basis"] == "duration"
    assert first.evidence["late_in"] >= 3 * 6 - 2  # every collective but the first of a group
    assert 19.0 <= first.evidence["lateness_ms"]["median"] <= 61.0
    # ranks 1 and 2 are late by 20-40 ms in every step, only because they waited for rank 0
    assert set(first.evidence["late_only_by_waiting"]) == {1, 2}
    assert [f for f in report.findings if f.kind.value == "straggler"] == [first]


def test_nccl_straggler_verdict_is_the_same_from_pickle_json_and_the_python_reader(
        monkeypatch: pytest.MonkeyPatch) -> None:
    docs = _straggler_job(steps=4, delay_ms=15.0)
    verdicts = [_analyze(docs, "pickle"), _analyze(docs, "json")]
    monkeypatch.setenv("FRFORENSICS_PICKLE_SCAN", "0")
    verdicts.append(_analyze(docs, "pickle"))
    assert {(v.status.value, v.culprit_ranks) for v in verdicts} == {("degraded", (0,))}


def test_nccl_dumps_without_timing_never_blame_a_waiter() -> None:
    """Without ``duration_ms`` the watchdog's discovery times and the CPU's enqueue
    times cannot time arrivals: rank 0 may go unnamed, but no other rank is named."""
    report = _analyze(_straggler_job(timing=False), "pickle")
    assert set(report.culprit_ranks) <= {0}
    assert all(f.evidence.get("basis") != "duration" for f in report.findings)


def test_a_healthy_nccl_job_with_durations_has_no_straggler() -> None:
    report = _analyze(_straggler_job(delay_ms=0.0), "pickle")
    assert report.culprit_ranks == ()
    assert not [f for f in report.findings if f.kind.value == "straggler"]
