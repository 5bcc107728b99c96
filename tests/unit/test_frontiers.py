"""Frontiers and error paths (``analyzer/frontiers.py``) on real dumps of both sources.

The dumps are tests/data/native_frontiers (README.md there): a real 4-rank gloo job
under torchrun whose rank 1 leaves early, raises, or dies while the survivors' error
handlers issue new collectives in different orders. Each verdict must name rank 1
alone, from our dumps and from PyTorch's.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from frforensics.analyzer import AnalyzeOptions, analyze, load_dumps
from frforensics.model import OpState
from frforensics.report import FindingKind, Report

DATA = Path(__file__).resolve().parents[1] / "data" / "native_frontiers"
SOURCES = {"ours": "frdump_rank_", "native": "nccl_trace_rank_"}


def _report(tmp_path: Path, case: str, source: str) -> Report:
    for src in (DATA / case).iterdir():
        if src.name.startswith(SOURCES[source]):
            shutil.copy(src, tmp_path / src.name)
    return analyze(load_dumps([tmp_path], jobs=1), options=AnalyzeOptions(world_size=4))


@pytest.mark.parametrize("source", sorted(SOURCES))
@pytest.mark.parametrize("case", ["stop", "raise", "errpath"])
def test_rank_1_alone_is_the_culprit(tmp_path: Path, case: str, source: str) -> None:
    report = _report(tmp_path, case, source)
    assert report.culprit_ranks == (1,), [f.message for f in report.findings]
    assert report.status.value == "hang"
    # the survivors' error-path collectives are never read as a desync
    assert not [f for f in report.findings if f.kind is FindingKind.OP_MISMATCH]


def test_a_rank_that_left_early_is_never_healthy_from_pytorchs_dumps(tmp_path: Path) -> None:
    # every entry retired: rank 1's newest op is #7, its peers retired #8, which
    # cannot have run without rank 1 (PyTorch's gloo recorder retires a failure)
    report = _report(tmp_path, "stop", "native")
    f = report.findings[0]
    assert f.kind is FindingKind.MISSING_RANK and f.culprit_ranks == (1,)
    assert (f.op, f.seq) == ("all_reduce", 8)
    assert set(f.waiting_ranks) == {0, 2, 3}
    assert any("read as failed" in n for n in report.notes)


def test_retired_ops_beyond_a_members_frontier_are_marked_failed(tmp_path: Path) -> None:
    from frforensics.analyzer.merge import build_job

    for src in (DATA / "stop").iterdir():
        if src.name.startswith("nccl_trace"):
            shutil.copy(src, tmp_path / src.name)
    dumps = load_dumps([tmp_path], jobs=1)
    job = build_job(dumps.digests, world_size=4)
    assert job.frontier_limit == {0: 7}
    for rank in (0, 2, 3):
        d = job.digests[rank]
        assert [int(s) for s in d.seq[d.state == OpState.FAILED]] == [8]
        assert rank not in job.error_from  # nothing after the failed op: no error path
    assert not (job.digests[1].state == OpState.FAILED).any()
    # the loaded digests themselves are untouched
    assert not any((d.state == OpState.FAILED).any() for d in dumps.digests.values())


def test_the_error_path_is_cut_from_the_comparison_in_our_dumps(tmp_path: Path) -> None:
    from frforensics.analyzer.merge import build_job
    from frforensics.analyzer.signatures import find_mismatches, units

    for src in (DATA / "errpath").iterdir():
        if src.name.startswith("frdump"):
            shutil.copy(src, tmp_path / src.name)
    job = build_job(load_dumps([tmp_path], jobs=1).digests, world_size=4)
    # ranks 0 and 2 failed in #8, then called barrier / broadcast as #9
    for rank in (0, 2):
        d = job.digests[rank]
        first = int(d.seq[job.error_from[rank] - 1])
        assert first == 8 and int(d.state[job.error_from[rank] - 1]) == OpState.FAILED
        got = units(job, rank, 0)
        assert got is not None and int(got[0].max()) == 8
    assert find_mismatches(job) == ()


def test_the_headline_code_line_says_where_the_culprit_is_then_the_op() -> None:
    # issue 29: on the shipped missing_rank sample, rank 2 idles in make_samples.py's
    # idle(), called from missing_rank(); its peers wait in step_all_reduce
    from frforensics.reporting.text import render

    sample = Path(__file__).resolve().parents[2] / "sample_dumps" / "missing_rank"
    text = render(analyze(load_dumps([sample], jobs=1)), width=400)
    code = [line for line in text.splitlines() if line.startswith("  Code:")]
    assert len(code) == 1
    assert "rank 2: " in code[0] and "make_samples.py:199 in idle" in code[0]
    assert "(called from " in code[0] and ":90 in missing_rank)" in code[0]
    after = text.splitlines()[text.splitlines().index(code[0]) + 1]
    assert "never joined all_reduce #5" in after and "make_samples.py:73 in step_all_reduce" in after


# Issue 29, case 3: Lightning DDP, rank 1 os._exit(1)s between two ops and leaves no
# dump (tests/data/native_frontiers/README.md, "A rank that dies between ops").

def _native(case: str) -> dict[int, dict[str, Any]]:
    from frforensics.formats.native import decode_pickle

    return {int(p.name.rsplit("_", 1)[1]): decode_pickle(p.read_bytes())
            for p in sorted((DATA / case).iterdir()) if p.name.startswith("nccl_trace_rank_")}


def test_lightning_survivors_read_as_a_healthy_prefix_in_pytorchs_dumps() -> None:
    # Why PyTorch's dumps cannot name rank 1: the survivors' failed barrier #30 is
    # retired, and their dumps are the healthy run's first 30 entries in every field
    # but the creation time (and the process-local thread id) - what a healthy job
    # dumped between #30 and #31, with rank 1's file not collected, would hold.
    died, healthy = _native("lightning_exit"), _native("lightning_none")
    assert sorted(died) == [0, 2, 3]
    for rank, doc in died.items():
        entries = doc["entries"]
        assert [(e["collective_seq_id"], e["profiling_name"], e["retired"])
                for e in entries[-2:]] == [(29, "gloo:broadcast", True), (30, "gloo:barrier", True)]
        assert doc["pg_status"]["0"]["last_completed_collective"] == 30
        prefix = healthy[rank]["entries"][:len(entries)]
        own = ("time_created_ns", "thread_id")
        strip = [{k: v for k, v in e.items() if k not in own} for e in entries]
        assert strip == [{k: v for k, v in e.items() if k not in own} for e in prefix]


@pytest.mark.parametrize("case", ["lightning_exit", "lightning_stacks/exit"])
def test_lightning_dead_rank_never_gets_a_survivor_named(tmp_path: Path, case: str) -> None:
    # a wrong culprit is worse than none: today no culprit (a missing_dump warning
    # naming rank 1); a rule that names someone may name rank 1 alone
    report = _report(tmp_path, case, "native")
    assert set(report.culprit_ranks) <= {1}, [f.message for f in report.findings]
    assert report.status.value != "healthy"
    missing = [f for f in report.findings if f.kind is FindingKind.MISSING_DUMP]
    assert missing and (1 in missing[0].culprit_ranks or missing[0].evidence.get("ranks") == [1])


def test_lightning_dead_rank_from_our_dumps_is_rank_1(tmp_path: Path) -> None:
    report = _report(tmp_path, "lightning_exit", "ours")
    assert report.culprit_ranks == (1,), [f.message for f in report.findings]
    assert report.findings[0].kind is FindingKind.DEAD_RANK


@pytest.mark.parametrize("case", ["lightning_none", "lightning_stacks/none"])
def test_lightning_healthy_runs_stay_healthy(tmp_path: Path, case: str) -> None:
    report = _report(tmp_path, case, "native")
    assert report.status.value == "healthy" and report.culprit_ranks == ()
    assert report.findings == ()


def test_lightning_survivors_stopped_inside_one_call_in_pytorchs_own_dumps() -> None:
    # The signal the dumps above lack (the recorder saves PyTorch's dumps without
    # stack traces): PyTorch's default dump has them, and there every survivor's
    # newest op is sync_dist's barrier (_sync_ddp, line 213), each earlier instance of
    # which was followed by the all_reduce at line 214 of the same call. A finished
    # job stops after a call returned: the healthy run's newest op is the backward's
    # all_reduce, followed before by the next step's broadcast (another function).
    def frame(e: dict[str, Any]) -> tuple[str, int]:
        f = e["frames"][2]  # under torch.distributed's own two frames
        return f["name"], f["line"]

    for case, stop, after in (("lightning_stacks/exit", ("_sync_ddp", 213), ("_sync_ddp", 214)),
                              ("lightning_stacks/none", ("backward", 623),
                               ("_broadcast_sigterm_tensor", 265))):
        for doc in _native(case).values():
            entries = doc["entries"]
            assert frame(entries[-1]) == stop
            earlier = [i for i, e in enumerate(entries[:-1]) if e["frames"] == entries[-1]["frames"]]
            assert len(earlier) >= 3
            assert {frame(entries[i + 1]) for i in earlier} == {after}


def test_lightning_dead_rank_is_named_where_the_survivors_stopped_inside_one_call(
        tmp_path: Path) -> None:
    # PyTorch's own default dumps (stacks on): every survivor's newest op, retired, was
    # issued inside _sync_ddp, which each earlier time went on to the all_reduce at
    # line 214: a program that ran to its end does not stop there (digest.stopped_in_call)
    report = _report(tmp_path, "lightning_stacks/exit", "native")
    assert report.status.value == "hang" and report.culprit_ranks == (1,)
    [f] = report.findings
    assert f.kind is FindingKind.MISSING_DUMP and f.evidence["confidence"] == "medium"
    call = f.evidence["stopped_in_call"]
    assert call["at"].endswith("distributed.py:213 in _sync_ddp")
    assert call["always_went_on_to"].endswith("distributed.py:214 in _sync_ddp")
    assert [(a.rank, a.action) for a in report.actions] == [(1, "inspect")]
    # without stacks (the same death, dumps saved without them) nothing says so
    (tmp_path / "no_stacks").mkdir()
    assert _report(tmp_path / "no_stacks", "lightning_exit", "native").culprit_ranks == ()


@pytest.mark.parametrize("case", ["lightning_stacks/none", "lightning_none"])
def test_a_finished_job_with_a_file_missing_is_not_read_as_stopped_in_a_call(
        tmp_path: Path, case: str) -> None:
    # the healthy run's newest op is the backward's all_reduce, after which the call
    # returned each earlier time: no rank is named for its missing file on that ground
    from frforensics.analyzer import AnalyzeOptions, analyze, load_dumps

    for drop in range(4):
        keep = tmp_path / f"{case.replace('/', '-')}-{drop}"
        keep.mkdir()
        for p in (DATA / case).iterdir():
            if p.name.startswith("nccl_trace_rank_") and not p.name.endswith(f"_{drop}"):
                (keep / p.name).write_bytes(p.read_bytes())
        report = analyze(load_dumps([keep]), options=AnalyzeOptions(world_size=4))
        assert not any("stopped_in_call" in f.evidence for f in report.findings)


def _raced(out: Path, like_seq: int, *, stacks: bool = True, rank_1: bool = False,
           unread: tuple[int, ...] = ()) -> Report:
    """``lightning_stacks/exit`` as CI saw it once (6 December): ranks 0, 2 went on to
    collective #31 (a copy of their #``like_seq``, unretired) while rank 3, slower, was
    terminated in ``_sync_ddp`` between barrier #30 and its all_reduce. ``stacks=False``
    strips every frame; ``rank_1=True`` gives rank 1 a dump too, rank 0's as rank 1's;
    ``unread``: ranks whose files a deadline left unread (``DumpSet.unread_ranks``)."""
    import copy
    import pickle

    from frforensics.formats.native import decode_pickle

    out.mkdir()
    for p in sorted((DATA / "lightning_stacks" / "exit").iterdir()):
        doc = decode_pickle(p.read_bytes())
        entries = doc["entries"]
        rank = int(p.name.rsplit("_", 1)[1])
        if rank in (0, 2):
            e = copy.deepcopy(next(e for e in entries if e["collective_seq_id"] == like_seq))
            e.update(collective_seq_id=31, op_id=31, record_id=entries[-1]["record_id"] + 1,
                     retired=False, time_created_ns=entries[-1]["time_created_ns"] + 3_000_000)
            entries.append(e)
            doc["pg_status"]["0"]["last_enqueued_collective"] = 31
        if not stacks:
            for e in entries:
                e["frames"] = []
        (out / p.name).write_bytes(pickle.dumps(doc))
        if rank == 0 and rank_1:
            doc["rank"] = 1
            (out / "nccl_trace_rank_1").write_bytes(pickle.dumps(doc))
    dumps = load_dumps([out], jobs=1)
    dumps.unread_ranks = list(unread)
    return analyze(dumps, options=AnalyzeOptions(world_size=4))


@pytest.mark.parametrize(("like_seq", "op"), [(27, "all_reduce"), (29, "broadcast")])
def test_a_rank_torn_down_between_two_ops_of_one_call_is_not_named_beside_the_dead_one(
        tmp_path: Path, like_seq: int, op: str) -> None:
    # rank 3 never entered #31, but it is one op behind, mid-call (_sync_ddp:213, which
    # always went on to :214), and ranks 0, 2 wait in #31 for rank 1 too, which left no
    # dump: the teardown after rank 1's death caught it there (consequences.py)
    report = _raced(tmp_path / "race", like_seq)
    assert report.culprit_ranks == (1,), [f.message for f in report.findings]
    [f] = [f for f in report.findings if f.severity.value == "error"]
    assert f.kind is FindingKind.MISSING_DUMP and (f.op, f.seq) == (op, 31)
    assert any(n.startswith("rank(s) 3 not named: one op behind") for n in report.notes)


@pytest.mark.parametrize(("stacks", "rank_1"), [(False, False), (True, True)])
def test_a_rank_stopped_mid_call_is_named_without_a_death_or_without_its_call(
        tmp_path: Path, stacks: bool, rank_1: bool) -> None:
    # no stacks to show it stopped mid-call, or no member that left no dump (every
    # other rank waits in #31 for it alone): nothing says a teardown caught it there
    report = _raced(tmp_path / "race", 27, stacks=stacks, rank_1=rank_1)
    assert report.culprit_ranks == ((3,) if rank_1 else (3, 1)), [
        f.message for f in report.findings]
    assert any(f.kind is FindingKind.MISSING_RANK and f.culprit_ranks == (3,)
               for f in report.findings)


def test_a_rank_whose_file_a_deadline_left_unread_is_no_death_to_excuse_another(
        tmp_path: Path) -> None:
    # rank 1's file was there but not read in time (fr-analyze --deadline): it is no
    # death, so rank 3, stopped mid-call, is named; rank 1 is never a culprit
    report = _raced(tmp_path / "race", 27, unread=(1,))
    assert report.culprit_ranks == (3,), [f.message for f in report.findings]
