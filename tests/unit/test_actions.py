"""``actions``: one per culprit rank, with its identity and what the finding implies.

The scenarios are synthetic jobs (``JobBuilder``) and the real sample dumps; the
expected action per finding kind is the rule of docs/detectors.md, stated here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from frforensics.analyzer import AnalyzeOptions, analyze, load_dumps
from frforensics.formats import frdump
from frforensics.report import Report
from frforensics.reporting import render
from frforensics.testing import JobBuilder

SAMPLES = Path(__file__).resolve().parents[2] / "sample_dumps"


def _report(job: JobBuilder, tmp_path: Path) -> Report:
    out = tmp_path / "dumps"
    job.build().write_frdump(out)
    return analyze(load_dumps([out], jobs=1), options=AnalyzeOptions(world_size=8))


def _job() -> JobBuilder:
    return JobBuilder(world_size=8, tp=2, pp=2, dp=2, ring_size=400, seed=3).steps(12)


@pytest.mark.parametrize(("plant", "culprit", "action", "because"), [
    (lambda j: j.op_mismatch(rank=5, step=10), 5, "fix_code", "op_mismatch"),
    (lambda j: j.size_mismatch(rank=5, step=10), 5, "fix_code", "size_mismatch"),
    (lambda j: j.dtype_mismatch(rank=5, step=10), 5, "fix_code", "dtype_mismatch"),
    (lambda j: j.stuck(rank=5, step=10, where="python"), 5, "fix_code", "missing_rank"),
    (lambda j: j.stuck(rank=5, step=10, where="dataloader"), 5, "inspect", "missing_rank"),
    (lambda j: j.dead(rank=5, step=10), 5, "replace_gpu_or_host", "dead_rank"),
    # its dump says "CUDA error: an illegal memory access": its own hardware error
    (lambda j: j.dead(rank=5, step=10, leaves_dump=True), 5, "replace_gpu_or_host",
     "dead_rank"),
    (lambda j: j.p2p_recv_without_send(rank=0, step=10), 0, "fix_code", "p2p_deadlock"),
])
def test_each_culprit_gets_the_action_its_finding_implies(tmp_path, plant, culprit, action,
                                                           because):
    report = _report(plant(_job()), tmp_path)
    assert culprit in report.culprit_ranks, [f.message for f in report.findings]
    act = {a.rank: a for a in report.actions}[culprit]
    assert (act.action, act.because) == (action, because), act
    assert act.detail


def test_there_is_one_action_per_culprit_in_culprit_order(tmp_path):
    report = _report(_job().op_mismatch(rank=5, step=10), tmp_path)
    assert [a.rank for a in report.actions] == list(report.culprit_ranks)


def test_a_healthy_job_has_no_actions(tmp_path):
    report = _report(_job(), tmp_path)
    assert report.actions == () and report.to_json()["actions"] == []


@pytest.mark.parametrize(("sample", "expected"), [
    ("missing_rank", {2: "fix_code"}),
    ("op_mismatch", {1: "fix_code"}),
    ("size_mismatch", {3: "fix_code"}),
    ("cross_pg_deadlock", {1: "fix_code"}),
    ("p2p_deadlock", {0: "fix_code", 1: "fix_code"}),
    ("straggler", {3: "replace_gpu_or_host"}),
    # rank 1 slept 5 s before the collective: it entered after its peers gave up
    ("timeout", {1: "inspect"}),
    # rank 1 raised ValueError in the program's own code (make_samples.py:152)
    ("dead_rank", {1: "fix_code"}),
])
def test_real_sample_dumps_get_the_documented_actions(sample, expected):
    report = analyze(load_dumps([SAMPLES / sample / "frdump"], jobs=1),
                     options=AnalyzeOptions(world_size=4))
    got = {a.rank: a.action for a in report.actions}
    assert got == expected, [(a.rank, a.action, a.because) for a in report.actions]
    doc = json.loads(render(report, "json"))
    assert [a["rank"] for a in doc["actions"]] == doc["culprit_ranks"]
    for a in doc["actions"]:
        assert set(a) == {"rank", "action", "host", "local_rank", "cuda_device", "gpu_uuid",
                          "pci_bus_id", "because", "detail"}
        assert a["host"] == doc["ranks"][str(a["rank"])]["host"]
        assert a["cuda_device"] is None and a["gpu_uuid"] is None  # CPU job


def test_every_member_stuck_inside_the_op_means_replace(tmp_path):
    report = _report(_job().hang_in_op(rank=5, step=10), tmp_path)
    act = {a.rank: a for a in report.actions}
    assert act and all(a.because == "timeout" for a in act.values()), report.actions
    assert 5 in act and act[5].action == "replace_gpu_or_host"


def test_identity_recorded_in_the_dump_reaches_the_action(tmp_path):
    out = tmp_path / "dumps"
    job = _job().dead(rank=5, step=10)
    job.build().write_frdump(out)
    for path in out.iterdir():
        trace = frdump.decode(path.read_bytes())
        r = trace.rank
        assert r is not None
        trace = dataclasses.replace(trace, header=dataclasses.replace(
            trace.header, local_rank=r % 4, cuda_device=r % 4, gpu_uuid=f"GPU-0000-{r}",
            pci_bus_id=f"0000:{r:02x}:00.0"))
        frdump.write_atomic(path, frdump.encode(trace))
    report = analyze(load_dumps([out], jobs=1), options=AnalyzeOptions(world_size=8))
    # rank 5 left no dump: nothing is known of its GPU
    dead = {a.rank: a for a in report.actions}[5]
    assert dead.gpu_uuid is None and dead.action == "replace_gpu_or_host"
    doc = report.to_json()
    assert doc["ranks"]["3"]["gpu_uuid"] == "GPU-0000-3"
    assert doc["ranks"]["3"]["pci_bus_id"] == "0000:03:00.0"
    assert doc["ranks"]["3"]["local_rank"] == 3


def test_identity_round_trips_through_frdump_and_older_dumps_read_as_null(tmp_path):
    job = _job()
    out = tmp_path / "d"
    job.build().write_frdump(out)
    path = next(out.iterdir())
    trace = frdump.decode(path.read_bytes())
    assert (trace.local_rank, trace.cuda_device, trace.gpu_uuid, trace.pci_bus_id) == (
        None, None, None, None)
    gpu = dataclasses.replace(trace, header=dataclasses.replace(
        trace.header, local_rank=2, cuda_device=2, gpu_uuid="GPU-abc", pci_bus_id="0000:1b:00.0"))
    back = frdump.decode(frdump.encode(gpu))
    assert (back.local_rank, back.cuda_device, back.gpu_uuid, back.pci_bus_id) == (
        2, 2, "GPU-abc", "0000:1b:00.0")


def test_text_and_markdown_show_the_action(tmp_path):
    report = _report(_job().op_mismatch(rank=5, step=10), tmp_path)
    text = render(report, "text")
    assert "Action:" in text and "fix_code" in text
    md = render(report, "markdown")
    assert "**Action**" in md and "fix_code" in md
