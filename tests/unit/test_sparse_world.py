"""A world-size claim far beyond the dumps (2^20 ranks) leaves the verdict alone.

Synthetic TP×PP×DP jobs with a planted fault, analyzed with their real world
size and with ``--world-size 1048576``: the claim adds ranks that left no dump
(``rankset.listable`` says too many to name), which must never change who is
blamed — only add a ``missing_dump`` statement with a count and no culprit.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from frforensics.analyzer import AnalyzeOptions, analyze, load_dumps
from frforensics.rankset import RankSet
from frforensics.report import FindingKind
from frforensics.testing import JobBuilder

CLAIM = 1 << 20

FAULTS: dict[str, Callable[[JobBuilder], JobBuilder]] = {
    "dead_no_dump": lambda j: j.dead(rank=6, step=2),
    "skip_tp": lambda j: j.skip(rank=5, group="tp", step=3),
    "p2p_recv_without_send": lambda j: j.p2p_recv_without_send(rank=4, step=2),
    "hang_in_op": lambda j: j.hang_in_op(rank=4, step=2, group="dp"),
}


@pytest.mark.parametrize("style", ["pickle", "gloo_pickle", "frdump"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_claimed_world_keeps_the_culprits_of_the_real_one(fault: str, style: str,
                                                         tmp_path: Path) -> None:
    job = JobBuilder(world_size=16, tp=4, pp=2, dp=2, ring_size=400, seed=16).steps(5)
    if style == "gloo_pickle":
        job.gloo_style()
    FAULTS[fault](job)
    dumps = job.build()
    out = tmp_path / style
    if style == "frdump":
        dumps.write_frdump(out)
    else:
        dumps.write_native(out, fmt="pickle")
    real = analyze(load_dumps([out], jobs=1), options=AnalyzeOptions(world_size=16))
    claimed = analyze(load_dumps([out], jobs=1), options=AnalyzeOptions(world_size=CLAIM))
    assert claimed.culprit_ranks == real.culprit_ranks
    assert claimed.exit_code == real.exit_code
    assert claimed.status == real.status
    assert isinstance(claimed.ranks_missing, RankSet)
    assert list(claimed.ranks_missing.clip(range(16))) == list(real.ranks_missing)
    assert len(claimed.ranks_missing) == CLAIM - 16 + len(real.ranks_missing)
    extra = list(claimed.findings)
    for f in real.findings:
        same = [g for g in extra if (g.kind, g.culprit_ranks, g.seq) == (f.kind, f.culprit_ranks, f.seq)]
        assert same, (f, extra)
        extra.remove(same[0])
    assert extra and all(f.kind is FindingKind.MISSING_DUMP and not f.culprit_ranks for f in extra)
    assert sum(f.evidence["silent_count"] for f in extra) == CLAIM - 16
