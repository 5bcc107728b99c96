"""all_to_all split sizes: recorded by our recorder, checked pairwise (``analyzer/splits.py``).

The real dumps are tests/data/moe_splits (README.md there): a 4-rank MoE job whose
rank 1 dispatches one token to the wrong peer; gloo aborts the receiver (rank 2, no
dump). The rule's tie-breaks are checked on small stand-ins for the job model (the
rule reads only the fields they set), every case against the reasoning in the
module's docstring.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from frforensics.analyzer import AnalyzeOptions, analyze, load_dumps
from frforensics.analyzer.digest import _parse_splits
from frforensics.analyzer.splits import find_split_mismatches
from frforensics.model import OpState
from frforensics.report import FindingKind

DATA = Path(__file__).resolve().parents[1] / "data" / "moe_splits"


def _analyze(tmp_path: Path, source: str) -> Any:
    for f in (DATA / source).iterdir():
        shutil.copy(f, tmp_path / f.name)
    return analyze(load_dumps([tmp_path], jobs=1), options=AnalyzeOptions(world_size=4))


def test_our_dumps_name_the_rank_whose_splits_disagree_not_the_receiver_gloo_aborted(
        tmp_path: Path) -> None:
    report = _analyze(tmp_path, "ours")
    assert report.culprit_ranks == (1,), [f.message for f in report.findings]
    head = report.findings[0]
    assert head.kind is FindingKind.SIZE_MISMATCH
    assert head.seq == 22 and head.op == "all_to_all_single"
    assert {"sender": 1, "receiver": 0, "sent": 16, "expected": 24} in head.evidence["split_pairs"]
    assert "without a dump (2)" in head.evidence["split_rule"]
    assert [(a.rank, a.action) for a in report.actions] == [(1, "fix_code")]
    assert head.location is not None and "moe.py" in head.location


def test_pytorchs_dumps_carry_no_splits_so_the_rule_says_nothing(tmp_path: Path) -> None:
    report = _analyze(tmp_path, "native")
    assert not [f for f in report.findings if "split_pairs" in f.evidence]


def _job(splits: dict[int, tuple[list[int], list[int]]], *, world: int = 4,
         failed: tuple[int, ...] = ()) -> Any:
    """A job model stand-in: one all_to_all_single (seq 5, group 0) per dumped rank."""
    digests = {}
    for rank, (send, recv) in splits.items():
        digests[rank] = SimpleNamespace(
            splits={0: (tuple(send), tuple(recv))}, is_p2p=np.zeros(1, np.uint8), unit=None,
            group=np.zeros(1, np.int32), seq=np.array([5]),
            state=np.array([OpState.FAILED if rank in failed else OpState.COMPLETED]))
    group = SimpleNamespace(ranks=list(range(world)), ranks_known=True)
    return SimpleNamespace(digests=digests, groups=[group], error_from={}, frontier_limit={},
                           group_of={(r, 0): 0 for r in digests})


EVEN = ([2, 2, 2, 2], [2, 2, 2, 2])


def test_agreeing_splits_are_no_mismatch() -> None:
    uneven = {0: ([1, 2, 3, 4], [1, 1, 1, 1]), 1: ([1, 2, 3, 4], [2, 2, 2, 2]),
              2: ([1, 2, 3, 4], [3, 3, 3, 3]), 3: ([1, 2, 3, 4], [4, 4, 4, 4])}
    assert find_split_mismatches(_job(uneven)) == ()  # type: ignore[arg-type]


def test_a_sender_that_moved_a_share_disagrees_with_two_peers_and_alone_is_named() -> None:
    job = _job({0: EVEN, 1: ([3, 2, 1, 2], [2, 2, 2, 2]), 2: EVEN, 3: EVEN})
    (m,) = find_split_mismatches(job)  # type: ignore[arg-type]
    assert m.culprits == (1,) and m.field == "splits" and m.seq == 5
    assert {(p.sender, p.receiver) for p in m.pairs} == {(1, 0), (1, 2)}


def test_a_receiver_that_expects_wrong_shares_is_named_not_its_senders() -> None:
    job = _job({0: ([2, 2, 2, 2], [2, 3, 2, 1]), 1: EVEN, 2: EVEN, 3: EVEN})
    (m,) = find_split_mismatches(job)  # type: ignore[arg-type]
    assert m.culprits == (0,)


def test_a_rank_whose_share_to_itself_disagrees_is_named_alone() -> None:
    job = _job({0: EVEN, 1: EVEN, 2: ([2, 2, 3, 1], [2, 2, 2, 2]), 3: EVEN})
    (m,) = find_split_mismatches(job)  # type: ignore[arg-type]
    assert m.culprits == (2,) and "itself" in m.reason


def test_one_disagreeing_pair_with_everyone_dumped_names_both() -> None:
    # rank 1 sends rank 0 one more than 0 expects, and its input is one larger
    job = _job({0: EVEN, 1: ([3, 2, 2, 2], [2, 2, 2, 2]), 2: EVEN, 3: EVEN})
    (m,) = find_split_mismatches(job)  # type: ignore[arg-type]
    assert m.culprits == (0, 1) and "cannot tell" in m.reason


@pytest.mark.parametrize("failed", [(1,), ()])
def test_a_short_sender_beside_a_rank_without_a_dump(failed: tuple[int, ...]) -> None:
    """Rank 1 moved a share from rank 0 to rank 2, which gloo aborted (no dump)."""
    job = _job({0: EVEN, 1: ([1, 2, 3, 2], [2, 2, 2, 2]), 3: EVEN}, failed=failed)
    (m,) = find_split_mismatches(job)  # type: ignore[arg-type]
    if failed:  # the exchange went wrong on a member: the surplus reached rank 2
        assert m.culprits == (1,) and "without a dump (2)" in m.reason
    else:  # everyone completed: a receiver that gets less completes too, no telling
        assert m.culprits == (0, 1)


def test_rows_on_the_error_path_or_beyond_the_frontier_are_not_compared() -> None:
    job = _job({0: EVEN, 1: ([3, 2, 1, 2], [2, 2, 2, 2]), 2: EVEN, 3: EVEN})
    job.error_from = {1: 0}
    assert find_split_mismatches(job) == ()  # type: ignore[arg-type]
    job.error_from = {}
    job.frontier_limit = {0: 4}
    assert find_split_mismatches(job) == ()  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["", "1,2", "1,2|3", "a|b", "1,-2|3,4", "|", "1,2|3,4,5",
                                  "9" * 40 + "|1", ",|,"])
def test_untrusted_split_text_that_is_not_two_runs_of_counts_is_left_out(text: str) -> None:
    value = _parse_splits(text)
    assert value is None or (len(value[0]) == len(value[1]) and min(value[0] + value[1]) >= 0)


def test_split_text_reads_back() -> None:
    assert _parse_splits("16,24,64,24|56,24,56,24") == ((16, 24, 64, 24), (56, 24, 56, 24))


def test_pytorchs_215_dumps_never_blame_the_ranks_that_stopped_with_the_aborted_one(
        tmp_path: Path) -> None:
    """Ranks 0 and 3 stopped in #22 with rank 2 (aborted, no dump); rank 1's #23 is
    past their frontier: it cannot have run, so it does not prove #22 ran."""
    report = _analyze(tmp_path, "native-2.15")
    assert report.culprit_ranks == (2,), [f.message for f in report.findings]
    assert report.findings[0].evidence.get("confidence") == "medium"


def test_the_recorder_writes_elements_per_member_from_rows_and_even_splits() -> None:
    from frforensics.recorder._dump import _split_elems

    assert _split_elems((6, 4), (1, 2, 3), 3) == [4, 8, 12]  # rows x row size
    assert _split_elems((6, 4), (), 3) == [8, 8, 8]  # empty: even, as c10d does
    assert _split_elems((7, 4), (), 3) is None  # an even split that does not divide
    assert _split_elems((), (), 3) is None  # a 0-d tensor has no rows
    assert _split_elems((6,), (), 0) is None  # a group of unknown size


def test_the_splits_a_digest_keeps_are_bounded_newest_first() -> None:
    import dataclasses

    from frforensics.analyzer import digest as dg
    from frforensics.formats import decode_dump
    from frforensics.model import EntryTable

    trace = decode_dump((DATA / "ours" / "frdump_rank_0").read_bytes(), source="r0")
    n = len(trace.entries)
    strings = list(trace.strings)
    wide = ",".join(["1"] * 20000)
    first = len(strings)
    strings += [f"{wide},{i}|{wide},{i}" for i in range(n)]  # a distinct 40k-value pair per row
    cols = trace.entries.columns()
    cols["splits"] = np.arange(first, first + n, dtype=np.int32)
    big = dataclasses.replace(trace, strings=tuple(strings),
                              entries=EntryTable.from_columns(n, cols))
    kept = dg._splits(big)
    assert kept is not None and max(kept) == n - 1  # the newest rows are kept
    assert sum(2 * len(v[0]) for v in kept.values()) <= dg._MAX_SPLIT_VALUES + 2 * 20001
    assert len(kept) < n
