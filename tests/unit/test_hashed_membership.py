"""Gloo dumps carry no group membership; a hashed group name can prove it.

PyTorch names hashed groups ``sha1("_".join(ranks) + "_" + str(counter))``
(``distributed_c10d._hash_ranks_to_str``, torch 2.13 and 2.15). When a member
left no dump (it crashed), the group inferred from the other dumps lacks it, and
the peers waiting for it look like they are all stuck together.
"""

from __future__ import annotations

import hashlib
import pickle

import pytest

from frforensics.analyzer import AnalyzeOptions, analyze
from frforensics.analyzer.digest import digest
from frforensics.analyzer.load import DumpSet
from frforensics.formats import decode_dump
from frforensics.report import FindingKind

T0 = 1_700_000_000_000_000_000


def _dump(rank: int, group: str, pending: bool) -> bytes:
    entries = []
    for seq in (1, 2, 3):
        done = seq < 3 or not pending
        entries.append({
            "record_id": seq - 1, "pg_id": 1, "process_group": (group, "DATA_PARALLEL_GROUP"),
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq,
            "profiling_name": "gloo:all_reduce", "time_created_ns": T0 + seq * 10**6,
            "input_sizes": [[4]], "input_dtypes": ["Float"], "output_sizes": [[4]],
            "output_dtypes": ["Float"], "state": "scheduled", "time_discovered_started_ns": None,
            "time_discovered_completed_ns": None, "retired": done, "timeout_ms": 5000,
            "is_p2p": False, "frames": [],
        })
    doc = {"version": "2.10", "pg_config": {"": {"name": "", "desc": "", "ranks": "[]"}},
           "pg_status": {}, "entries": entries}
    return pickle.dumps(doc)


@pytest.mark.parametrize("salt", ["_3", "_17", ""])
def test_crashed_member_is_recovered_from_the_hashed_group_name(salt: str) -> None:
    members = [0, 1, 2, 3, 4, 5]
    name = hashlib.sha1(("_".join(map(str, members)) + salt).encode()).hexdigest()
    ds = DumpSet()
    for r in members[:-1]:  # rank 5 crashed: no dump
        trace = decode_dump(_dump(r, name, pending=True), source=f"t_{r}", rank_hint=r)
        ds.digests[r] = digest(trace, rank=r)
    report = analyze(ds, options=AnalyzeOptions(world_size=6))
    assert report.culprit_ranks == (5,)
    assert report.findings[0].kind is FindingKind.MISSING_DUMP
    assert any("recovered from the hashed group name" in n for n in report.notes)


def test_a_name_that_no_candidate_reproduces_keeps_the_inferred_membership() -> None:
    name = hashlib.sha1(b"0_1_2_3_4_99_7").hexdigest()
    ds = DumpSet()
    for r in range(5):
        trace = decode_dump(_dump(r, name, pending=False), source=f"t_{r}", rank_hint=r)
        ds.digests[r] = digest(trace, rank=r)
    report = analyze(ds, options=AnalyzeOptions(world_size=6))
    assert any("inferred from which ranks' dumps name them" in n for n in report.notes)
    assert report.culprit_ranks == ()


def test_membership_recovery_spends_a_bounded_number_of_hashes_per_job() -> None:
    from frforensics.analyzer.merge import _HASH_CAP, _members_from_hashed_name, hash_budget
    allowed = hash_budget(1000)
    assert allowed <= _HASH_CAP
    budget = [allowed]
    tried = 0
    for i in range(1000):  # hash-like names that no candidate reproduces
        before = budget[0]
        assert _members_from_hashed_name(f"{i:040x}", tuple(range(8)), list(range(8, 24)),
                                         budget) is None
        tried += before - budget[0]
    assert tried <= allowed and budget[0] < 18


def test_late_groups_of_a_many_group_job_are_still_recovered() -> None:
    """Salts are tried in counter order: group N costs about N hashes per candidate,
    so a job with hundreds of groups stays within its budget (the CI failure of
    2026-12-01: a 36-group job spent the old per-name full salt sweep)."""
    from frforensics.analyzer.merge import _members_from_hashed_name, hash_budget
    groups = 400
    budget = [hash_budget(groups)]
    for counter in range(groups):
        members = (counter % 97, 100 + counter)
        name = hashlib.sha1(("_".join(map(str, members)) + f"_{counter}").encode()).hexdigest()
        seen = members[:1]  # the second member crashed: no dump
        assert _members_from_hashed_name(name, seen, [100 + counter, 999], budget) == members
    assert budget[0] > 0
