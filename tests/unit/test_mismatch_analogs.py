"""Culprits follow the evidence: in a tie, the side the analogous groups single out.

A size or dtype mismatch in a 2-member DP group is an even split: by the
members alone either could be wrong. The other DP groups of the SPMD job issue
the same call at the same seq; when they all used one value, the member that
used another alone is the culprit, and its partner is named in the text as
waiting on it. Without analogs (a job with a single DP group) both are named.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from frforensics.analyzer import AnalyzeOptions, analyze, load_dumps
from frforensics.report import Report, Severity
from frforensics.testing import JobBuilder


def _analyze(job: JobBuilder, tmp_path: Path, fmt: str) -> Report:
    dumps = job.build()
    out = tmp_path / fmt
    if fmt == "frdump":
        dumps.write_frdump(out)
    else:
        dumps.write_native(out, fmt=fmt)
    return analyze(load_dumps([out], jobs=1),
                   options=AnalyzeOptions(world_size=int(job.layout.world_size)))


@pytest.mark.parametrize("fmt", ["frdump", "pickle"])
@pytest.mark.parametrize("kind", ["size_mismatch", "dtype_mismatch"])
def test_analogous_groups_single_out_the_member_that_deviated_in_a_two_member_group(
        kind: str, fmt: str, tmp_path: Path) -> None:
    # TP 8 x DP 2 over 16 ranks: DP groups {0,8}, {1,9}, ..., {2,10}, ...
    job = getattr(JobBuilder(world_size=16, tp=8, pp=1, dp=2).steps(6), kind)(
        rank=2, step=3, group="dp")
    report = _analyze(job, tmp_path, fmt)
    errors = [f for f in report.findings if f.severity is Severity.ERROR]
    assert [f.kind.value for f in errors] == [kind], [f.message for f in errors]
    finding = errors[0]
    assert finding.pg is not None and finding.pg.ranks == (2, 10)
    assert finding.culprit_ranks == (2,) and report.culprit_ranks == (2,)
    assert finding.waiting_ranks == (10,)
    assert "so rank(s) 2 deviated, not rank(s) 10" in finding.message, finding.message
    assert finding.evidence["most_likely_by_analog_groups"] == [2]
    assert [a.rank for a in report.actions] == [2]


def test_without_analogous_groups_both_members_of_a_tie_are_named(tmp_path: Path) -> None:
    # one DP group only ({0,1}): nothing singles either member out
    job = JobBuilder(world_size=2, tp=1, pp=1, dp=2).steps(6).size_mismatch(
        rank=1, step=3, group="dp")
    assert job.build().expected.culprit_ranks == (0, 1)
    report = _analyze(job, tmp_path, "frdump")
    errors = [f for f in report.findings if f.severity is Severity.ERROR]
    assert [(f.kind.value, f.culprit_ranks) for f in errors] == [("size_mismatch", (0, 1))]
    assert "deviated" not in errors[0].message
