"""straggler: a rank that consistently arrives last, found through clock offsets,
jitter and the lateness it spreads to its peers; healthy jobs raise nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from frforensics.analyzer import AnalyzeOptions, analyze, load_dumps
from frforensics.report import FindingKind, Severity
from frforensics.testing import JobBuilder
from helpers import analyze_dumps

NATIVE = Path(__file__).resolve().parents[1] / "data" / "native"
LAYOUTS = {8: dict(tp=2, pp=2, dp=2), 64: dict(tp=8, pp=4, dp=2)}


def job(size: int, seed: int = 0) -> JobBuilder:
    return JobBuilder(world_size=size, ring_size=2000, seed=seed, **LAYOUTS[size]).steps(20).jitter(ms=0.5)


@pytest.mark.parametrize("fmt", ["frdump", "pickle"])
@pytest.mark.parametrize(("size", "rank", "delay_ms"), [(8, 3, 15.0), (64, 37, 4.0), (64, 5, 25.0)])
def test_consistently_late_rank_is_the_straggler_despite_clock_offsets(
        size: int, rank: int, delay_ms: float, fmt: str) -> None:
    # the straggler's host clock runs 300 ms behind, another host's 250 ms ahead
    other = (rank + 8) % size
    dumps = (job(size, seed=size + rank).straggler(rank=rank, delay_ms=delay_ms)
             .clock_offset(rank=rank, ms=-300).clock_offset(rank=other, ms=250).build())
    want = dumps.expected
    report = analyze_dumps(dumps, fmt)
    assert report.status.value == want.status == "degraded"
    assert report.exit_code == 0
    assert report.culprit_ranks == want.culprit_ranks == (rank,)
    stragglers = [f for f in report.findings if f.kind is FindingKind.STRAGGLER]
    assert [f.culprit_ranks for f in stragglers] == [(rank,)]
    f = stragglers[0]
    assert f.severity is Severity.WARNING
    late = f.evidence["lateness_ms"]
    assert delay_ms * 0.8 <= late["median"] <= late["p95"]
    assert f.evidence["excess_think_ms"] == pytest.approx(delay_ms, rel=0.2)
    # its TP peers, late elsewhere only because they waited for it, are not blamed
    assert f.evidence["late_only_by_waiting"]
    assert rank not in f.evidence["late_only_by_waiting"]


def test_completion_polling_resolution_is_tolerated() -> None:
    dumps = job(64, seed=9).straggler(rank=12, delay_ms=10).completion_poll(ms=2).build()
    report = analyze_dumps(dumps, "frdump")
    assert report.culprit_ranks == (12,)


@pytest.mark.parametrize("fmt", ["frdump", "pickle"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_jittery_job_with_clock_offsets_raises_nothing(seed: int, fmt: str) -> None:
    dumps = (job(64, seed=seed).jitter(ms=2.0).clock_offset(rank=3, ms=250)
             .clock_offset(rank=40, ms=-120).completion_poll(ms=1).build())
    assert dumps.expected.status == "healthy"
    report = analyze_dumps(dumps, fmt)
    assert report.findings == () and report.culprit_ranks == ()


def test_straggler_is_a_warning_beside_a_hang_and_never_a_root() -> None:
    dumps = job(64, seed=4).straggler(rank=9, delay_ms=10).stuck(rank=20, step=18).build()
    report = analyze_dumps(dumps, "frdump")
    assert report.status.value == "hang"
    assert report.culprit_ranks == (20,)


@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_real_gloo_straggler_from_enqueue_times_only(fmt: str) -> None:
    report = analyze(load_dumps([NATIVE / "straggler" / fmt], jobs=1),
                     options=AnalyzeOptions(world_size=4))
    assert report.status.value == "degraded" and report.culprit_ranks == (1,)
    f = report.findings[0]
    assert f.kind is FindingKind.STRAGGLER and f.evidence["basis"] == "enqueue"
    assert 250 <= f.evidence["lateness_ms"]["median"] <= 350  # the script sleeps 300 ms


@pytest.mark.parametrize("scenario", ["healthy", "missing_rank", "timeout"])
def test_real_gloo_runs_without_a_straggler_raise_none(scenario: str) -> None:
    report = analyze(load_dumps([NATIVE / scenario / "pickle"], jobs=1),
                     options=AnalyzeOptions(world_size=4))
    assert not [f for f in report.findings if f.kind is FindingKind.STRAGGLER]


@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("layout", ["member", "sorted"])
def test_segment_medians_match_a_plain_sort_with_nans_and_uneven_sizes(layout: str, upper: bool) -> None:
    import numpy as np

    from frforensics.analyzer.detectors.straggler import _Layout, _member_layout

    rng = np.random.default_rng(7)
    counts = rng.integers(0, 12, size=300)
    seg = np.repeat(np.arange(300), counts)
    col = np.concatenate([rng.permutation(c) for c in counts])
    shuffle = rng.permutation(len(seg))
    seg, col = seg[shuffle], col[shuffle]
    values = rng.normal(size=len(seg))
    values[rng.random(len(seg)) < 0.2] = np.nan
    built = (_member_layout(seg, col, np.bincount(seg, minlength=300)) if layout == "member"
             else _Layout.sorted_by(seg, 300))
    assert built is not None
    got = built.median(values, upper=upper)
    for s in range(300):
        v = np.sort(values[(seg == s) & ~np.isnan(values)])
        want = v[len(v) // 2 if upper else (len(v) - 1) // 2] if len(v) else np.nan
        assert got[s] == want or (np.isnan(got[s]) and np.isnan(want))


def test_only_each_ranks_recent_window_is_judged(monkeypatch: pytest.MonkeyPatch) -> None:
    # 20 steps fill ~1900 entries per rank; the rank turns slow for the last 3 steps
    dumps = job(8, seed=21).straggler(rank=6, delay_ms=15.0, from_step=17).build()
    report = analyze_dumps(dumps, "frdump")
    assert report.culprit_ranks == (6,)
    total = report.findings[0].evidence["collectives"]
    from frforensics.analyzer.detectors import straggler

    assert total <= straggler.WINDOW
    # a window of 2 entries holds too few collectives to blame anyone (3 needed);
    # the whole ring holds more collectives than the default window
    monkeypatch.setattr(straggler, "WINDOW", 2)
    assert analyze_dumps(dumps, "frdump").culprit_ranks == ()
    monkeypatch.setattr(straggler, "WINDOW", 10**6)
    whole = analyze_dumps(dumps, "frdump")
    assert whole.culprit_ranks == (6,)
    assert whole.findings[0].evidence["collectives"] > total


@pytest.mark.parametrize("late", [False, True], ids=["healthy", "straggler"])
def test_a_job_is_judged_once_for_the_finding_and_the_notes(
        late: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # detect() and unjudged() (the report's notes when there is no finding) read one
    # judgement: judged twice, a healthy 16,384-rank job paid the gather twice
    from frforensics.analyzer.detectors import straggler

    calls: list[int] = []
    judge = straggler._judge_once
    monkeypatch.setattr(straggler, "_judge_once", lambda ctx: calls.append(1) or judge(ctx))
    b = job(8, seed=4)
    dumps = (b.straggler(rank=5, delay_ms=15.0) if late else b).build()
    report = analyze_dumps(dumps, "frdump")
    assert report.culprit_ranks == ((5,) if late else ())
    assert len(calls) == 1


@pytest.mark.parametrize("span_ns", [10**9, 2**61], ids=["lifted", "rank-by-rank"])
def test_release_times_match_a_per_rank_running_max(span_ns: int) -> None:
    """The all-ranks running max, and its rank-by-rank fallback past int64 offsets."""
    import numpy as np

    from frforensics.analyzer.detectors.straggler import _release

    rng = np.random.default_rng(3)
    sizes = np.array([5, 0, 7, 1, 4], dtype=np.int64)  # an empty rank in the middle
    at = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    t_complete = rng.integers(1, span_ns, size=len(at), dtype=np.int64)
    done = rng.random(len(at)) < 0.6
    want = np.full(len(at), np.nan)
    for i in range(len(at)):
        earlier = [t_complete[j] for j in range(i) if at[j] == at[i] and done[j]]
        if earlier:
            want[i] = float(max(earlier))
    got = _release(at, t_complete, done, sizes)
    assert np.array_equal(got, want, equal_nan=True)


def gloo_job(seed: int) -> JobBuilder:
    # PyTorch's gloo recorder: enqueue times only, no send/recv, hashed group names
    return JobBuilder(tp=2, pp=1, dp=4, ring_size=2000, seed=seed).steps(12).jitter(ms=0.3).gloo_style()


def test_gloo_straggler_late_at_every_op_is_named_taking_clocks_to_agree() -> None:
    # late at every op: estimated clock offsets absorb it, so the rank is judged
    # again as if the hosts' clocks agreed, and named with the clock as the alternative
    report = analyze_dumps(gloo_job(3).straggler(rank=5, delay_ms=20.0).build(), "pickle")
    assert report.culprit_ranks == (5,) and report.status.value == "degraded"
    f = report.findings[0]
    assert f.kind is FindingKind.STRAGGLER and f.evidence["clocks"] == "assumed_to_agree"
    assert 15 <= f.evidence["alternative_clock_offset_ms"] <= 25
    assert "check that clock" in f.message
    assert [(a.rank, a.action) for a in report.actions] == [(5, "inspect")]


def test_gloo_lateness_below_any_clock_doubt_names_no_one() -> None:
    # 4 ms: hosts' clocks may well disagree by that much, so no rank is named
    report = analyze_dumps(gloo_job(4).straggler(rank=2, delay_ms=4.0).build(), "pickle")
    assert report.culprit_ranks == () and report.findings == ()


def test_gloo_hosts_whose_clocks_disagree_name_no_one() -> None:
    # a healthy job, two hosts' clocks off (rank 6's behind, so its TP peer 7 looks
    # late): taken as agreeing, the clocks make two ranks late, and enqueue times
    # cannot tell a source from its victims or from a clock: one warning names none
    dumps = gloo_job(5).clock_offset(rank=1, ms=80).clock_offset(rank=6, ms=-40).build()
    assert dumps.expected.status == "healthy"
    report = analyze_dumps(dumps, "pickle")
    assert report.culprit_ranks == () and report.actions == ()
    assert [f.evidence["candidates"] for f in report.findings] == [[1, 7]]
    assert "clocks that disagree" in report.findings[0].message


def test_gloo_lone_host_clock_ahead_is_reported_as_a_clock_question() -> None:
    # The one case enqueue times cannot settle: a healthy job whose one host clock runs
    # 50 ms ahead reads exactly like a rank late by 50 ms at every op. It is named, but
    # only to inspect, with its clock as the other explanation (docs/detectors.md)
    dumps = gloo_job(6).clock_offset(rank=3, ms=50).build()
    report = analyze_dumps(dumps, "pickle")
    assert report.culprit_ranks == (3,)
    assert [(a.rank, a.action) for a in report.actions] == [(3, "inspect")]
    assert "clock alone ran 50" in report.findings[0].message


def _analyze(dumps, **options: float):
    return analyze_dumps(dumps, "frdump", **options)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_rare_spikes_on_a_few_ranks_are_noise_with_no_culprit(seed: int) -> None:
    # 2-5 ms before 5 % of the ops of 3 ranks: the rule before significance named
    # one of them (seeds 1 and 2: ranks 5 and 3)
    dumps = job(8, seed=seed).noise().build()
    assert dumps.expected.status == "healthy"
    report = _analyze(dumps)
    assert report.findings == () and report.culprit_ranks == () and report.actions == ()
    for note in report.notes:
        if "slowest rank" in note:
            assert "no culprit, no action" in note


@pytest.mark.parametrize(("delay_ms", "every"), [(50.0, "op"), (3.0, "random")],
                         ids=["50ms-every-op", "random-0-3ms"])
def test_a_sustained_straggler_is_named_alone_among_noisy_ranks(delay_ms: float, every: str) -> None:
    dumps = job(64, seed=5).noise(spiky_ranks=6).straggler(rank=13, delay_ms=delay_ms,
                                                          every=every).build()  # type: ignore[arg-type]
    report = _analyze(dumps)
    assert report.culprit_ranks == (13,)
    [f] = [f for f in report.findings if f.kind is FindingKind.STRAGGLER]
    assert f.evidence["sustained"] in ("most", "recurring")
    assert f.evidence["cost_share"] >= f.evidence["min_cost_share"] == 0.05
    assert "rank 13 costs the job ~" in f.message
    assert [a.action for a in report.actions] == ["replace_gpu_or_host"]


def test_the_share_of_the_job_a_straggler_must_cost_is_an_option() -> None:
    dumps = job(8, seed=5).straggler(rank=6, delay_ms=3.0, every="random").build()
    cost = _analyze(dumps).findings[0].evidence["cost_share"]
    assert 0.05 < cost < 0.9
    report = _analyze(dumps, straggler_min_cost=0.9)
    assert report.findings == () and report.culprit_ranks == ()
    [note] = [n for n in report.notes if "slowest rank 6" in n]
    assert "below the 90 % that names a straggler" in note


def test_a_slow_pipeline_stage_is_named_from_its_sends_and_recvs() -> None:
    # pipeline only: the stages share no collective but the first barrier and the log
    # steps' all-reduces, so without send/recv the rule had nothing to judge (healthy)
    dumps = (JobBuilder(tp=1, pp=4, dp=1, seed=3).steps(20).jitter(ms=0.2).noise(spiky_ranks=1)
             .straggler(rank=2, delay_ms=40.0).build())
    report = _analyze(dumps)
    assert report.culprit_ranks == (2,)
    [f] = report.findings
    assert f.evidence["groups"][0]["desc"] == "PIPELINE_MODEL_PARALLEL_GROUP"
    assert f.evidence["excess_think_ms"] == pytest.approx(40.0, rel=0.2)


def test_a_stride_of_several_late_collectives_per_step_is_recurring_but_spikes_are_not() -> None:
    import numpy as np

    from frforensics.analyzer.detectors.straggler import _recurs

    # a 1F1B stage: late at 5 of every 17 ops (gaps 9, 3, 1, 3, 1: lag 5 is 17)
    step = [0, 8, 11, 12, 15, 16]
    late = np.array(sorted({17 * k + s for k in range(10) for s in step[1:]}))
    assert _recurs(late)
    # a transformers Trainer step: its first two collectives of 4
    assert _recurs(np.array([4 * k + s for k in range(10) for s in (2, 3)]))
    # spikes at random, 25 of 400: regular enough in lag-8 sums, at no points of a step
    rng = np.random.default_rng(5)
    for _ in range(20):
        assert not _recurs(np.sort(rng.choice(400, size=25, replace=False)))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("delay_ms", [5.0, 15.0])
def test_a_delay_below_the_completion_floor_is_named_from_enqueue_times(delay_ms: float,
                                                                       seed: int) -> None:
    # our recorder on gloo: completions polled every 10 ms put the floor at 30 ms; a
    # rank 5-15 ms late at every step is below it, yet costs the job a large share of
    # its time: its enqueue times (1 ms floor, as PyTorch's gloo dumps are judged) name it
    dumps = (job(8, seed=seed).gloo_style().straggler(rank=3, delay_ms=delay_ms)
             .completion_poll(ms=10).build())
    report = _analyze(dumps)
    assert report.culprit_ranks == (3,)
    [f] = [f for f in report.findings if f.kind is FindingKind.STRAGGLER]
    assert f.evidence["basis"] == "enqueue"
    assert "below the 30.0 ms that the dumps' completion times" in f.message
    assert f.evidence["cost_share"] >= 0.05


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("size", [8, 64])
def test_noise_below_the_completion_floor_names_no_one(size: int, seed: int) -> None:
    # the enqueue-time second look is the same rule (sustained, costly): spikes and
    # jitter under coarse completions stay unnamed
    dumps = (job(size, seed=seed).gloo_style().jitter(ms=2.0).noise(spiky_ranks=3)
             .clock_offset(rank=1, ms=80).completion_poll(ms=10).build())
    assert dumps.expected.status == "healthy"
    report = _analyze(dumps)
    assert report.culprit_ranks == () and report.actions == ()
    assert not [f for f in report.findings if f.kind is FindingKind.STRAGGLER]
