"""Missing creation times or timeouts are unknowns, never a HEALTHY verdict (issue 12, item 3)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from frforensics.analyzer import analyze
from frforensics.analyzer.digest import digest
from frforensics.analyzer.load import DumpSet
from frforensics.formats import decode_dump
from frforensics.formats.native import decode_pickle
from frforensics.report import FindingKind, Severity, Status

SAMPLE = Path(__file__).parents[2] / "sample_dumps" / "timeout" / "native"


def _stripped(fields: tuple[str, ...]) -> DumpSet:
    ds = DumpSet()
    files = sorted(SAMPLE.glob("nccl_trace_rank_*"))
    assert files, f"sample missing: {SAMPLE}"
    for f in files:
        rank = int(f.name.rsplit("_", 1)[1])
        raw = decode_pickle(f.read_bytes(), source=f.name)  # safe decoder, no globals
        for e in raw["entries"]:
            for key in fields:
                e.pop(key, None)
        trace = decode_dump(pickle.dumps(raw), source=f.name, rank_hint=rank)
        ds.digests[rank] = digest(trace, rank=rank)
    return ds


def test_captured_gloo_timeout_is_found_with_its_fields() -> None:
    report = analyze(_stripped(()))
    assert report.status is Status.HANG
    assert report.culprit_ranks == (1,)


@pytest.mark.parametrize("fields", [("time_created_ns",), ("timeout_ms",),
                                    ("time_created_ns", "timeout_ms")])
def test_dump_without_times_or_timeouts_is_degraded_never_healthy(fields: tuple[str, ...]) -> None:
    report = analyze(_stripped(fields))
    assert report.status is not Status.HEALTHY
    incomplete = [f for f in report.findings if f.kind is FindingKind.INCOMPLETE_DUMP]
    assert incomplete and all(f.severity is Severity.WARNING for f in incomplete)
    assert {f.evidence["field"] for f in incomplete} == set(fields)
    assert all(f.evidence["ranks"] == [0, 1, 2, 3] for f in incomplete)
    assert "cannot be judged" in incomplete[0].message
    # no culprit on a guess
    assert all(f.culprit_ranks == () for f in incomplete)
