"""The analyzer reads PyTorch's NCCL dump semantics (docs/native-format.md, "NCCL semantics").

Hand-built native documents, one per semantic, each as ProcessGroupNCCL writes it:
coalesced members that stay ``scheduled`` behind a closing ``nccl:coalesced``
entry, a p2p batch whose closing entry says ``is_p2p=False``, ranks whose CPU ran
ahead of a blocked op, and a kernel that never finished on one rank.
"""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest

from frforensics.analyzer import AnalyzeOptions, analyze
from frforensics.analyzer.digest import digest
from frforensics.analyzer.load import DumpSet
from frforensics.formats import decode_dump
from frforensics.report import FindingKind, Report

T0 = 1_700_000_000_000_000_000
MS = 1_000_000


class Rank:
    """One rank's native NCCL document, built op by op in issue order."""

    def __init__(self, rank: int, groups: dict[str, tuple[str, list[int]]]) -> None:
        self.rank = rank
        self.groups = groups
        self.entries: list[dict[str, Any]] = []
        self.seq = dict.fromkeys(groups, 0)
        self.p2p = dict.fromkeys(groups, 0)
        self.op_id = dict.fromkeys(groups, 0)
        self.t = T0

    def _entry(self, pg: str, name: str, state: str, *, is_p2p: bool = False,
               sizes: list[list[int]] | None = None) -> dict[str, Any]:
        self.t += MS
        done = state == "completed"
        e = {
            "record_id": len(self.entries), "pg_id": list(self.groups).index(pg),
            "process_group": (pg, self.groups[pg][0]),
            "collective_seq_id": self.seq[pg], "p2p_seq_id": self.p2p[pg],
            "op_id": self.op_id[pg], "profiling_name": f"nccl:{name}",
            "time_created_ns": self.t,
            "input_sizes": sizes if sizes is not None else [[4, 4]],
            "input_dtypes": ["Float"] * (len(sizes) if sizes is not None else 1),
            "output_sizes": sizes if sizes is not None else [[4, 4]],
            "output_dtypes": ["Float"] * (len(sizes) if sizes is not None else 1),
            "state": state, "time_discovered_started_ns": self.t + MS if state != "scheduled" else None,
            "time_discovered_completed_ns": self.t + 2 * MS if done else None,
            "retired": done, "timeout_ms": 600_000, "is_p2p": is_p2p,
            "frames": [{"name": "step", "filename": "train.py", "line": 100 + len(self.entries)}],
        }
        self.entries.append(e)
        return e

    def coll(self, pg: str, state: str, name: str = "all_reduce") -> Rank:
        """A collective: ``seqCollective_++`` then one entry."""
        self.seq[pg] += 1
        self.op_id[pg] += 1
        self._entry(pg, name, state)
        return self

    def coalesced(self, pg: str, state: str, members: int = 3) -> Rank:
        """``_coalescing_manager`` block: members with null events, then ``nccl:coalesced``."""
        self.seq[pg] += 1  # once per block, at the first member
        for _ in range(members):
            self.op_id[pg] += 1
            self._entry(pg, "all_reduce", "scheduled")  # no events: scheduled forever
        self._entry(pg, "coalesced", state, sizes=[])
        return self

    def batch(self, pg: str, state: str, ops: list[tuple[str, int]]) -> Rank:
        """``batch_isend_irecv``: p2p members, then a closing entry with ``is_p2p=False``."""
        self.p2p[pg] += 1  # once per block
        me = self.groups[pg][1].index(self.rank)
        for kind, peer in ops:
            self.op_id[pg] += 1
            arrow = "->" if kind == "send" else "<-"
            self._entry(pg, f"{kind} {me}{arrow}{self.groups[pg][1].index(peer)}", "scheduled",
                        is_p2p=True)
        self._entry(pg, "coalesced", state, sizes=[])
        return self

    def doc(self) -> dict[str, Any]:
        return {
            "version": "2.10",
            "pg_config": {name: {"name": name, "desc": desc, "ranks": str(ranks)}
                          for name, (desc, ranks) in self.groups.items()},
            "pg_status": {},
            "entries": self.entries,
        }


def run(ranks: list[Rank], fmt: str = "pickle") -> Report:
    ds = DumpSet()
    for r in ranks:
        doc = r.doc()
        if fmt == "pickle":
            data = pickle.dumps(doc, protocol=4)
        else:  # as _dump_nccl_trace_json writes it: no frames, 0 for missing times
            for e in doc["entries"]:
                e.pop("frames")
                for key in ("time_discovered_started_ns", "time_discovered_completed_ns"):
                    e[key] = e[key] or 0
            data = json.dumps(doc).encode()
        trace = decode_dump(data, source=f"nccl_trace_rank_{r.rank}", rank_hint=r.rank)
        ds.digests[r.rank] = digest(trace, rank=r.rank)
    return analyze(ds, options=AnalyzeOptions(world_size=len(ranks)))


WORLD = {"0": ("default_pg", [0, 1, 2, 3])}
MESH = {"0": ("default_pg", [0, 1, 2, 3]), "tp0": ("tp", [0, 1]), "tp1": ("tp", [2, 3]),
        "dp0": ("dp", [0, 2]), "dp1": ("dp", [1, 3])}


@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_completed_coalesced_blocks_and_p2p_batches_are_healthy(fmt: str) -> None:
    ranks = []
    for r in range(4):
        rk = Rank(r, WORLD).coll("0", "completed").coalesced("0", "completed")
        peer = r ^ 1
        ops = [("send", peer), ("recv", peer)] if r % 2 == 0 else [("recv", peer), ("send", peer)]
        rk.batch("0", "completed", ops).coll("0", "completed").coalesced("0", "completed")
        ranks.append(rk)
    report = run(ranks, fmt)
    assert report.culprit_ranks == ()
    assert not [f for f in report.findings if f.severity.value == "error"], report.findings


def test_rank_missing_from_a_coalesced_block_is_the_culprit() -> None:
    ranks = [Rank(r, WORLD).coll("0", "completed").coalesced("0", "completed") for r in range(4)]
    for r in (0, 1, 3):
        ranks[r].coalesced("0", "scheduled")  # rank 2 never reaches the second block
    report = run(ranks)
    assert report.culprit_ranks == (2,)
    assert report.findings[0].kind is FindingKind.MISSING_RANK
    assert report.findings[0].seq == 3


def test_a_p2p_batch_closing_entry_never_poses_as_a_collective() -> None:
    # The batch's closing entry carries collective_seq_id 1 (the last collective)
    # on ranks 0 and 1 only: read as a collective, seq 1 would mismatch.
    ranks = [Rank(r, WORLD).coll("0", "completed") for r in range(4)]
    ranks[0].batch("0", "completed", [("send", 1)])
    ranks[1].batch("0", "completed", [("recv", 0)])
    for rk in ranks:
        rk.coll("0", "completed")
    report = run(ranks)
    assert report.findings == ()


@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_rank_that_ran_ahead_into_a_queued_op_is_waited_for_not_blamed(fmt: str) -> None:
    # Rank 3 sleeps before DP all_reduce #2 on dp1 {1,3}. Rank 1 is blocked in it,
    # and enqueued TP #2 behind it (queued). Rank 0 waits in TP #2 on tp0 {0,1}:
    # it waits *for* rank 1, whose chain ends at rank 3. Rank 2 waits in dp0 for
    # rank 0. The only culprit is 3.
    ranks = [Rank(r, MESH) for r in range(4)]
    for rk in ranks:
        tp, dp = ("tp0" if rk.rank < 2 else "tp1"), ("dp0" if rk.rank % 2 == 0 else "dp1")
        rk.coll(tp, "completed").coll(dp, "completed")
    ranks[1].coll("dp1", "scheduled").coll("tp0", "scheduled").coll("dp1", "scheduled")
    ranks[0].coll("dp0", "completed").coll("tp0", "scheduled").coll("dp0", "scheduled")
    ranks[2].coll("dp0", "completed").coll("tp1", "completed").coll("dp0", "scheduled")
    ranks[3].coll("tp1", "completed")
    report = run(ranks, fmt)
    assert report.culprit_ranks == (3,)
    assert [f.kind for f in report.findings if f.severity.value == "error"] == [
        FindingKind.MISSING_RANK]
    finding = report.findings[0]
    assert finding.pg is not None and finding.pg.ranks == (1, 3)
    assert set(finding.waiting_ranks) == {0, 1, 2}


@pytest.mark.parametrize("timing", [True, False])
def test_kernel_that_never_finished_on_one_rank_is_a_timeout_there(timing: bool) -> None:
    # all_reduce #2 completed on ranks 0, 1, 3 but never on rank 2 (started with
    # timing on; scheduled without it, as NCCL has no start event then). The
    # peers moved on and block in #3, which rank 2 holds only as queued.
    state = "started" if timing else "scheduled"
    ranks = [Rank(r, WORLD).coll("0", "completed") for r in range(4)]
    for r in (0, 1, 3):
        ranks[r].coll("0", "completed").coll("0", "scheduled")
    ranks[2].coll("0", state).coll("0", "scheduled")
    report = run(ranks)
    assert report.culprit_ranks == (2,)
    first = report.findings[0]
    assert first.kind is FindingKind.TIMEOUT
    assert first.seq == 2
    assert set(first.waiting_ranks) == {0, 1, 3}
    assert "never finished on rank(s) 2" in first.message


def test_every_member_started_and_none_finished_names_all_below_the_framework() -> None:
    ranks = [Rank(r, WORLD).coll("0", "completed").coll("0", "started") for r in range(4)]
    report = run(ranks)
    assert report.culprit_ranks == (0, 1, 2, 3)
    assert report.findings[0].kind is FindingKind.TIMEOUT
    assert "below the framework" in report.findings[0].message


def test_scheduled_member_while_others_started_is_the_least_advanced() -> None:
    ranks = [Rank(r, WORLD).coll("0", "completed") for r in range(4)]
    for r in (0, 1, 3):
        ranks[r].coll("0", "started")
    ranks[2].coll("0", "scheduled")  # its GPU never reached the kernel
    report = run(ranks)
    assert report.culprit_ranks == (2,)
    assert report.findings[0].kind is FindingKind.TIMEOUT


def test_groups_issued_in_opposite_orders_are_a_cross_group_deadlock_not_timeouts() -> None:
    # Each rank issues its two groups' collectives in an order that makes every
    # rank block in an op whose peer holds it only as queued: 0 -> 1 -> 3 -> 2 -> 0.
    # Counting queued entries as "entered", every op would look fully joined:
    # four false timeouts naming every rank.
    ranks = [Rank(0, MESH).coll("tp0", "scheduled").coll("dp0", "scheduled"),
             Rank(1, MESH).coll("dp1", "scheduled").coll("tp0", "scheduled"),
             Rank(2, MESH).coll("dp0", "scheduled").coll("tp1", "scheduled"),
             Rank(3, MESH).coll("tp1", "scheduled").coll("dp1", "scheduled")]
    report = run(ranks)
    kinds = {f.kind for f in report.findings if f.severity.value == "error"}
    assert kinds == {FindingKind.CROSS_PG_DEADLOCK}


def test_newer_schema_and_unknown_fields_are_read_and_noted() -> None:
    ranks = [Rank(r, WORLD).coll("0", "completed").coll("0", "completed") for r in range(4)]
    ds = DumpSet()
    for r in ranks:
        doc = r.doc()
        if r.rank == 3:
            doc["version"] = "2.14"
            doc["fancy_new_top"] = 1
            for e in doc["entries"]:
                e["new_entry_field"] = 7
        # JSON: entry-level unknown fields are listed by the Python reader (the C
        # pickle scanner lists top-level ones only)
        trace = decode_dump(json.dumps(doc).encode(), source=f"nccl_trace_rank_{r.rank}.json",
                            rank_hint=r.rank)
        ds.digests[r.rank] = digest(trace, rank=r.rank)
    report = analyze(ds, options=AnalyzeOptions(world_size=4))
    text = "\n".join(report.notes)
    assert report.culprit_ranks == ()
    assert "rank(s) 3: schema version 2.14 is newer" in text
    assert "entries[].new_entry_field" in text and "fancy_new_top" in text
    assert "disagree on the schema version: 2.10 on rank(s) 0-2; 2.14 on rank(s) 3" in text


def test_group_whose_seqs_never_increase_is_matched_by_record_order() -> None:
    ranks = [Rank(r, WORLD).coll("0", "completed").coll("0", "completed") for r in range(4)]
    for r in (0, 1, 3):
        ranks[r].coll("0", "scheduled")  # rank 2 never enters the third collective
    for rk in ranks:
        for e in rk.entries:
            e["collective_seq_id"] = 0
    report = run(ranks)
    assert report.culprit_ranks == (2,)
    assert report.findings[0].kind is FindingKind.MISSING_RANK
    assert any("matched by record order" in n for n in report.notes)


def _analysis(ranks: list[Rank]) -> tuple[Any, Any]:
    from frforensics.analyzer.context import Context
    from frforensics.analyzer.merge import build_job
    from frforensics.analyzer.waits import build_wait_graph
    digests = {}
    for r in ranks:
        trace = decode_dump(pickle.dumps(r.doc()), source=f"nccl_trace_rank_{r.rank}",
                            rank_hint=r.rank)
        digests[r.rank] = digest(trace, rank=r.rank)
    job = build_job(digests, world_size=len(ranks))
    graph = build_wait_graph(job)
    return Context.build(job, graph, AnalyzeOptions(world_size=len(ranks))), graph


def test_detectors_are_pure_so_their_order_does_not_matter() -> None:
    from frforensics.analyzer.detectors import DETECTORS
    # an op mismatch at #2 (rank 1 broadcasts), then everyone blocks in #3
    ranks = [Rank(r, WORLD).coll("0", "completed") for r in range(4)]
    for rk in ranks:
        rk.coll("0", "scheduled", "broadcast" if rk.rank == 1 else "all_reduce")
        rk.coll("0", "scheduled")
    ctx, _ = _analysis(ranks)
    forward = [f for det in DETECTORS for f in det(ctx)]
    backward = [f for det in reversed(DETECTORS) for f in det(ctx)]
    assert forward and sorted(map(repr, forward)) == sorted(map(repr, backward))
    assert {f.kind for f in forward} == {FindingKind.OP_MISMATCH}


def test_a_wait_chain_longer_than_the_recursion_limit_ends_at_its_root() -> None:
    import sys
    n = sys.getrecursionlimit() + 200
    # rank i waits in pair group {i, i+1} for rank i+1, which holds that op only
    # queued behind its own op with i+2; the last rank never issued anything
    groups = {f"p{i}": ("pair", [i, i + 1]) for i in range(n - 1)}
    ranks = []
    for i in range(n):
        mine = {f"p{i}": groups[f"p{i}"]} if i < n - 1 else {}
        if i > 0:
            mine[f"p{i - 1}"] = groups[f"p{i - 1}"]
        rk = Rank(i, mine)
        if i < n - 1:
            rk.coll(f"p{i}", "scheduled")
        if 0 < i < n - 1:
            rk.coll(f"p{i - 1}", "scheduled")
        ranks.append(rk)
    _ctx, graph = _analysis(ranks)
    assert list(graph.roots) == [n - 1]
    assert graph.roots[n - 1].waiters == set(range(n - 1))


def test_coalesced_block_whose_members_all_use_another_dtype_is_a_dtype_mismatch() -> None:
    ranks = [Rank(r, WORLD).coll("0", "completed") for r in range(4)]
    for rk in ranks:
        rk.coalesced("0", "scheduled", members=2)
        if rk.rank == 3:  # both members Half where the peers use Float
            for e in rk.entries[-3:-1]:
                e["input_dtypes"] = ["Half"]
    report = run(ranks)
    assert report.culprit_ranks == (3,)
    assert report.findings[0].kind is FindingKind.DTYPE_MISMATCH


def test_ops_abandoned_by_a_reconfiguration_are_no_place_to_be_blocked() -> None:
    # Group 0 (ranks 0-3) hung in #6; recovery excluded rank 2 and re-formed it as
    # 0@r2 (ranks 0,1,3, seqs from 0). Then rank 3 stops before 0@r2's #4.
    groups = {"0": ("default_pg", [0, 1, 2, 3]), "0@r2": ("default_pg", [0, 1, 3])}
    ranks = []
    for r in (0, 1, 3):
        rk = Rank(r, groups)
        for _ in range(5):
            rk.coll("0", "completed")
        rk.coll("0", "scheduled")  # abandoned by the reconfiguration
        for _ in range(3):
            rk.coll("0@r2", "completed")
        if r != 3:
            rk.coll("0@r2", "scheduled")
        ranks.append(rk)
    ds = DumpSet()
    for rk in ranks:
        trace = decode_dump(pickle.dumps(rk.doc()), source=f"nccl_trace_rank_{rk.rank}",
                            rank_hint=rk.rank)
        ds.digests[rk.rank] = digest(trace, rank=rk.rank)
    report = analyze(ds, options=AnalyzeOptions(world_size=4))
    assert report.culprit_ranks == (3,)
    first = report.findings[0]
    assert first.kind is FindingKind.MISSING_RANK
    assert first.pg is not None and first.pg.name == "0@r2" and first.seq == 4


def _evict(rk: Rank, keep: int) -> Rank:
    """Keep the newest ``keep`` entries, as a full ring does (record ids unchanged)."""
    rk.entries = rk.entries[-keep:]
    return rk


def test_oldest_plain_collective_of_an_evicted_ring_is_still_compared() -> None:
    # Every ring evicted everything before all_reduce #3. Rank 2 used Half in #3,
    # then blocked in #4 with the others. #3 is one plain entry per rank: nothing
    # of it was evicted, so its dtypes compare. Skipped as "possibly a coalesced
    # block cut in two", #3 is unchecked on ranks 1 and 2 (whose windows reach
    # #4) and the hang at #4 reads as a timeout naming every rank.
    ranks = [Rank(r, WORLD).coll("0", "completed").coll("0", "completed") for r in range(4)]
    for rk in ranks:
        rk.coll("0", "scheduled")
        if rk.rank == 2:
            rk.entries[-1]["input_dtypes"] = ["Half"]
        if rk.rank in (1, 2):
            rk.coll("0", "scheduled")
        _evict(rk, 2 if rk.rank in (1, 2) else 1)
    report = run(ranks)
    assert report.culprit_ranks == (2,)
    assert report.findings[0].kind is FindingKind.DTYPE_MISMATCH
    assert report.findings[0].seq == 3


def test_evicted_oldest_block_cut_in_two_is_not_compared() -> None:
    # Rank 3's ring kept only the last member and the closing entry of block #2,
    # all it holds of the group; its peers hold the whole block. Compared, the cut
    # block differs (one member where the others have three): a false op
    # mismatch naming rank 3.
    ranks = [Rank(r, WORLD).coll("0", "completed").coalesced("0", "completed") for r in range(4)]
    _evict(ranks[3], 2)
    report = run(ranks)
    assert report.culprit_ranks == ()
    assert not [f for f in report.findings if f.severity.value == "error"], report.findings


def test_ring_holding_one_block_of_a_group_is_not_matched_by_record_order() -> None:
    # Ring eviction left one coalesced block of the group in every ring: its
    # entries share one seq because PyTorch bumps the seq once per block, not
    # because the dump's seqs never increase. Renumbered by record order, the
    # members become separate collectives that stay ``scheduled``, and every rank
    # looks blocked in the first member, all "stuck in it": a timeout naming
    # every rank where only rank 1's GPU is behind (scheduled; the others started).
    ranks = [Rank(r, WORLD).coll("0", "completed").coalesced("0", "completed") for r in range(4)]
    for rk in ranks:
        rk.coalesced("0", "scheduled" if rk.rank == 1 else "started")
        _evict(rk, 4)  # the last block only
    report = run(ranks)
    assert not any("record order" in n for n in report.notes), report.notes
    assert report.culprit_ranks == (1,)
    assert report.findings[0].kind is FindingKind.TIMEOUT
    assert report.findings[0].seq == 3


def test_p2p_batch_closing_entries_are_no_collectives_matched_by_record_order() -> None:
    # A group used only for p2p batches: every closing entry says is_p2p=False
    # with the unchanged collective seq 0. They are the batches', not collectives
    # whose seqs never increase.
    groups = {**WORLD, "pp0": ("pp", [0, 1]), "pp1": ("pp", [2, 3])}
    ranks = []
    for r in range(4):
        rk = Rank(r, groups).coll("0", "completed")
        pg, peer = ("pp0" if r < 2 else "pp1"), r ^ 1
        ops = [("send", peer), ("recv", peer)] if r % 2 == 0 else [("recv", peer), ("send", peer)]
        rk.batch(pg, "completed", ops).batch(pg, "completed", ops).coll("0", "completed")
        ranks.append(rk)
    report = run(ranks)
    assert not any("record order" in n for n in report.notes), report.notes
    assert report.findings == ()


def test_evicted_rings_oldest_block_after_an_older_kept_record_is_whole_and_compared() -> None:
    # Every ring evicted the group's block #1 and kept two default-group ops
    # recorded before block #2, so block #2's members (recorded back to back
    # before its closing entry) are all there. Rank 3's members use Half. Not
    # compared, every member "started" #2 and none finished: a timeout naming all.
    groups = {**WORLD, "dp": ("dp", [0, 1, 2, 3])}
    ranks = []
    for r in range(4):
        rk = Rank(r, groups).coalesced("dp", "completed")
        rk.coll("0", "completed").coll("0", "completed").coalesced("dp", "started")
        if r == 3:
            for e in rk.entries[-4:-1]:
                e["input_dtypes"] = ["Half"]
        ranks.append(_evict(rk, 6))
    report = run(ranks)
    assert report.culprit_ranks == (3,)
    assert report.findings[0].kind is FindingKind.DTYPE_MISMATCH
    assert report.findings[0].seq == 2
