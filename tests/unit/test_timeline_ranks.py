"""A large job builds drawn timelines only for the ranks the HTML report shows."""

from __future__ import annotations

from frforensics.analyzer import AnalyzeOptions, analyze
from frforensics.analyzer.digest import digest
from frforensics.analyzer.load import DumpSet
from frforensics.report import TIMELINE_RANKS
from frforensics.reporting import html
from frforensics.testing import JobBuilder


def _dumps() -> DumpSet:
    job = (JobBuilder(world_size=512, tp=8, dp=64, ring_size=60, seed=1).steps(3)
           .skip(rank=300, group="tp", step=2).build())
    ds = DumpSet()
    for r, trace in job.traces().items():
        ds.digests[r] = digest(trace, rank=r)
    return ds


def test_large_job_timeline_holds_the_shown_ranks_and_draws_the_same() -> None:
    ds = _dumps()
    cut = analyze(ds)
    assert 300 in cut.culprit_ranks
    shown = {t.rank for t in cut.timeline}
    assert len(shown) == TIMELINE_RANKS and set(cut.culprit_ranks) <= shown
    full = analyze(ds, options=AnalyzeOptions(timeline_ranks=10**6))  # every rank's timeline
    assert len(full.timeline) == 512
    assert html.render(cut) == html.render(full)
