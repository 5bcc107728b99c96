"""``--window``: a digest cut to its newest entries is analyzed like a smaller ring."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from test_nccl_properties import FAULTS, GAPS, NCCL_ONLY, make_job, violations

from frforensics.analyzer import AnalyzeOptions, analyze
from frforensics.analyzer.digest import digest, windowed
from frforensics.analyzer.load import DumpSet
from frforensics.formats import decode_dump
from frforensics.model import OpState
from frforensics.testing import JobBuilder

WINDOW = 48


def _digests(job: object, window: int | None) -> DumpSet:
    dumps = job.dumps  # type: ignore[attr-defined]
    ds = DumpSet()
    for r in dumps.native_ranks:
        trace = decode_dump(pickle.dumps(dumps.native_doc(r), protocol=2),
                            source=f"nccl_trace_rank_{r}", rank_hint=r)
        ds.digests[r] = digest(trace, rank=r, window=window)
    return ds


def test_the_cut_keeps_unfinished_entries_and_whole_coalesced_blocks() -> None:
    job = (JobBuilder(tp=2, pp=2, dp=2, ring_size=400, seed=3).steps(6)
           .nccl(run_ahead=(1, 4), coalesce_dp="members", timing=False)
           .skip(rank=5, group="tp", step=4).build())
    for r, trace in job.traces().items():
        if trace is None:
            continue
        full = digest(trace, rank=r)
        cut = windowed(full, 20, trace.entries.record_id)
        start = len(full) - len(cut)
        assert cut.dropped == full.dropped + start
        assert cut.first_record_id == int(trace.entries.record_id[start])
        # nothing unfinished is cut
        assert (full.state[:start] == OpState.COMPLETED).all()
        assert np.array_equal(cut.seq, full.seq[start:])
        # no member is separated from its closing entry
        if full.unit is not None and cut.unit is not None:
            assert (full.unit[:start] < start).all()
            assert np.array_equal(cut.unit, full.unit[start:] - start)
        assert all(det.row == row and row + start in full.details
                   for row, det in cut.details.items())
        bound = max(20, len(full) - int(np.argmax(full.state != OpState.COMPLETED)))
        if len(cut) > bound:  # only to keep a coalesced block whole
            assert full.unit is not None and int(full.unit[start]) >= len(full) - bound


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["nccl", "gloo"])
def test_windowed_jobs_keep_every_property(mode: str) -> None:
    """Generated jobs (the property sweep's) analyzed with a 48-entry window break
    no property that the whole ring keeps: the window is a smaller ring."""
    failures = []
    for fault in FAULTS:
        if (mode, fault) in GAPS or (mode == "gloo" and fault in NCCL_ONLY):
            continue
        for seed in range(4):
            job = make_job(mode, fault, seed)
            exp = job.dumps.expected_native
            options = AnalyzeOptions(world_size=job.dumps.world_size)
            full = analyze(_digests(job, None), options=options)
            cut = analyze(_digests(job, WINDOW), options=options)
            bad = violations(cut, exp, gloo=mode == "gloo")
            if bad and not violations(full, exp, gloo=mode == "gloo"):
                failures.append(f"{job.describe()}: {bad}")
    assert not failures, "\n".join(failures)


def _cut_notes(report: dict[str, object]) -> list[str]:
    return [n for n in report["notes"] if "ring cut to its newest" in str(n)]  # type: ignore[attr-defined]


def test_the_cli_cuts_the_rings_of_a_big_job_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # without --window the local pool keeps the whole ring below AUTO_WINDOW_DUMPS dumps
    # and cuts to DASK_WINDOW from there (scaled down here: 8 dumps, a window of 48)
    from frforensics import cli

    job = JobBuilder(world_size=8, tp=4, dp=2, ring_size=200, seed=1).steps(30)
    job.skip(rank=5, group="tp", step=28).build().write_frdump(tmp_path / "d")
    monkeypatch.setattr(cli, "DASK_WINDOW", WINDOW)

    def run(*args: str) -> dict[str, object]:
        with pytest.raises(SystemExit):
            cli.main(["analyze", str(tmp_path / "d"), "--format", "json", "--jobs", "1", *args])
        report: dict[str, object] = json.loads(capsys.readouterr().out)
        assert report["culprit_ranks"] == [5]
        return report

    monkeypatch.setattr(cli, "AUTO_WINDOW_DUMPS", 9)  # one more dump than there are
    assert not _cut_notes(run())
    monkeypatch.setattr(cli, "AUTO_WINDOW_DUMPS", 8)
    assert _cut_notes(run())
    assert not _cut_notes(run("--window", "0"))  # the user's choice stands
    assert _cut_notes(run("--window", "100"))
