"""The synthetic dump-set factory keeps the invariants real jobs keep."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from frforensics.formats import decode_dump, frdump
from frforensics.model import OpState, RankTrace
from frforensics.testing import JobBuilder, JobDumps

# The native reader keeps NCCL's spelling for these; the recorder uses the canonical one.
_NATIVE_ALIASES = {
    "_all_gather_base": "all_gather_into_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "all_reduce_barrier": "barrier",
    "allgather_into_tensor": "all_gather_into_tensor",
}


def job(**kw: int) -> JobBuilder:
    return JobBuilder(world_size=64, tp=8, pp=4, dp=2, ring_size=kw.pop("ring_size", 2000), seed=kw.pop("seed", 0))


@pytest.fixture(scope="module")
def healthy() -> JobDumps:
    return job().steps(40).jitter(ms=0.5).clock_offset(rank=3, ms=250).build()


def _entries_by_group(t: RankTrace) -> dict[tuple[str, tuple[int, ...] | None], list[int]]:
    out: dict[tuple[str, tuple[int, ...] | None], list[int]] = {}
    e = t.entries
    for i in range(len(e)):
        g = t.groups[e.pg[i]]
        out.setdefault((g.name, g.ranks), []).append(i)
    return out


def test_healthy_job_completes_every_collective_on_every_member(healthy: JobDumps) -> None:
    assert healthy.sim.finished.all()
    assert not healthy.sim.pending_collectives and not healthy.sim.pending_p2p
    assert healthy.expected.status == "healthy" and healthy.expected.culprit_ranks == ()
    for t in healthy.traces().values():
        assert (t.entries.state == OpState.COMPLETED).all()


def test_healthy_job_matches_sends_and_recvs_per_pair(healthy: JobDumps) -> None:
    sends: Counter[tuple[int, int]] = Counter()
    recvs: Counter[tuple[int, int]] = Counter()
    for r in range(healthy.world_size):
        for sid in healthy.sim.ops[r].tolist():
            spec = healthy.spec.cat.specs[sid]
            if spec.is_p2p:
                peer = healthy.layout.stage_peer(r, spec.delta)
                (sends if spec.op == "send" else recvs)[(r, peer) if spec.op == "send" else (peer, r)] += 1
    assert sends and sends == recvs


def test_seq_ids_are_contiguous_per_group_and_agree_across_members(healthy: JobDumps) -> None:
    traces = healthy.traces()
    by_key: dict[tuple[str, tuple[int, ...] | None, int], set[tuple[str, str, str]]] = {}
    for t in traces.values():
        for (name, ranks), idx in _entries_by_group(t).items():
            e = t.entries
            coll = [i for i in idx if not e.is_p2p[i]]
            seqs = e.seq[coll]
            assert (np.diff(seqs) == 1).all(), f"rank {t.rank} group {name}"
            p2p = [i for i in idx if e.is_p2p[i]]
            if p2p:
                assert (np.diff(e.p2p_seq[p2p]) == 1).all()
            for i in coll:
                key = (name, ranks, int(e.seq[i]))
                by_key.setdefault(key, set()).add(
                    (t.string(e.op[i]), t.string(e.in_shapes[i]), t.string(e.in_dtypes[i]))
                )
    assert all(len(v) == 1 for v in by_key.values())


def test_per_peer_p2p_numbers_pair_the_two_sides(healthy: JobDumps) -> None:
    traces = healthy.traces()
    sent: dict[tuple[int, int, int], int] = {}
    got: dict[tuple[int, int, int], int] = {}
    for t in traces.values():
        e = t.entries
        assert t.rank is not None
        for i in np.flatnonzero(e.is_p2p):
            op = t.string(e.op[i])
            if op == "send":
                sent[(t.rank, int(e.peer[i]), int(e.peer_seq[i]))] = int(e.t_complete_ns[i])
            else:
                got[(int(e.peer[i]), t.rank, int(e.peer_seq[i]))] = int(e.t_complete_ns[i])
    common = sent.keys() & got.keys()
    assert len(common) > 1000
    # both sides of one transfer complete at the same instant (modulo each host's clock offset)
    offsets = healthy.offsets_ms
    for a, b, k in list(common)[:2000]:
        skew = round((offsets[a] - offsets[b]) * 1e6)
        assert sent[(a, b, k)] - got[(a, b, k)] == skew


def test_ring_keeps_the_last_entries_and_windows_differ_between_ranks(healthy: JobDumps) -> None:
    starts = set()
    for r in (0, 17, 40, 63):
        rec = healthy.records(r)
        total = rec.dropped + len(rec.spec)
        assert len(rec.spec) == 2000
        assert rec.record_id[-1] == total - 1
        assert (np.diff(rec.record_id) == 1).all()
        assert (rec.spec == healthy.sim.ops[r][-2000:]).all()
        starts.add(int(rec.record_id[0]))
    assert len(starts) > 1


def test_small_ring_evicts_history() -> None:
    d = job(ring_size=100).steps(6).build()
    for r in (0, 63):
        t = d.trace(r)
        assert len(t.entries) == 100 and t.dropped > 0 and t.entries.record_id[0] == t.dropped


def _column_views(t: RankTrace) -> dict[str, list[object]]:
    e = t.entries
    ops = [t.string(i) for i in e.op]
    return {
        "record_id": e.record_id.tolist(),
        "seq": e.seq.tolist(),
        "p2p_seq": e.p2p_seq.tolist(),
        "op": [_NATIVE_ALIASES.get(o, o) for o in ops],
        "is_p2p": e.is_p2p.tolist(),
        "peer": e.peer.tolist(),
        "in_numel": e.in_numel.tolist(),
        "out_numel": e.out_numel.tolist(),
        "in_shapes": [t.string(i) for i in e.in_shapes],
        "in_dtypes": [t.string(i) for i in e.in_dtypes],
        "state": e.state.tolist(),
        "t_enqueue_ns": e.t_enqueue_ns.tolist(),
        "t_start_ns": e.t_start_ns.tolist(),
        "t_complete_ns": e.t_complete_ns.tolist(),
        "timeout_ms": e.timeout_ms.tolist(),
        "thread": [t.string(i) for i in e.thread],
        "group": [(t.groups[g].name, t.groups[g].ranks) for g in e.pg],
    }


@pytest.mark.slow  # seconds of CPU: the slow lane
@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_native_docs_decode_into_the_same_columns_as_traces(fmt: str) -> None:
    d = job().steps(24).jitter(ms=0.3).stuck(rank=21, step=22).build()
    for r in (0, 21, 22, 37, 63):
        native = decode_dump(d.native_bytes(r, fmt), source=f"rank{r}", rank_hint=r)  # type: ignore[arg-type]
        ours = d.trace(r)
        a, b = _column_views(native), _column_views(ours)
        for col in a:
            assert a[col] == b[col], (r, col)
        if fmt == "pickle":
            assert [native.stack(i) for i in native.entries.stack] == [ours.stack(i) for i in ours.entries.stack]


def test_native_pickle_shares_frames_and_holds_only_builtins(healthy: JobDumps) -> None:
    import pickletools

    data = healthy.native_bytes(5)
    names = {op.name for op, _, _ in pickletools.genops(data)}
    assert not names & {"GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "INST", "OBJ", "NEWOBJ"}
    assert "BINGET" in names or "LONG_BINGET" in names
    doc = pickle.loads(data)
    assert doc["version"] == "2.10" and isinstance(doc["pg_config"]["0"]["ranks"], str)
    assert len(doc["entries"][0]["frames"]) == 8


def test_tp_groups_share_one_name_with_different_members(healthy: JobDumps) -> None:
    a, b = healthy.native_doc(0)["pg_config"], healthy.native_doc(24)["pg_config"]
    shared = set(a) & set(b) - {"0"}
    assert len(shared) == 1
    name = shared.pop()
    assert a[name]["ranks"] != b[name]["ranks"]


def test_frdump_files_round_trip(tmp_path: Path) -> None:
    d = job().steps(8).dead(rank=9, step=6, leaves_dump=True).build()
    paths = d.write_frdump(tmp_path, jobs=2)
    assert len(paths) == 64
    back = frdump.decode((tmp_path / "frdump_rank_9").read_bytes())
    assert back.death is not None and back.rank == 9
    other = frdump.decode((tmp_path / "frdump_rank_0").read_bytes())
    assert [p.rank for p in other.stale_peers] == [9]
    assert (other.entries.seq == d.trace(0).entries.seq).all()


@pytest.mark.slow  # seconds of CPU: the slow lane
def test_same_seed_gives_identical_files(tmp_path: Path) -> None:
    one = job(seed=3).steps(6).jitter(ms=1).build()
    two = job(seed=3).steps(6).jitter(ms=1).build()
    assert one.native_bytes(7) == two.native_bytes(7)
    assert frdump.encode(one.trace(7)) == frdump.encode(two.trace(7))
    paths = one.write_native(tmp_path, jobs=2)
    assert len(paths) == 64 and paths[0].read_bytes()[:2] == b"\x80\x02"


def test_gloo_style_dumps_hide_membership_and_p2p() -> None:
    d = job().steps(6).gloo_style().build()
    doc = d.native_doc(20)
    assert doc["pg_config"] == {"": {"name": "", "desc": "", "ranks": "[]"}}
    assert all(not e["is_p2p"] and e["state"] == "scheduled" for e in doc["entries"])
    assert all(e["retired"] for e in doc["entries"])
    assert [e["record_id"] for e in doc["entries"]] == list(range(len(doc["entries"])))


# ------------------------------------------------------------------ faults


def test_skip_leaves_peers_blocked_at_the_skipped_seq() -> None:
    # the world all_gather of the last (logging) step: rank 13 skips it and finishes
    d = job().steps(20).skip(rank=13, group="default", step=19).build()
    exp = d.expected
    assert exp.status == "hang" and exp.kind == "missing_rank" and exp.culprit_ranks == (13,)
    assert exp.group is not None and exp.group.name == "0" and exp.seq_kind == "collective"
    assert d.sim.finished[13] and not d.sim.finished[np.arange(64) != 13].any()
    assert set(exp.waiting_ranks) == set(range(64)) - {13}
    for r in (0, 13, 63):
        t = d.trace(r)
        default = [i for i in range(len(t.entries)) if t.groups[t.entries.pg[i]].name == "0"]
        last = default[-1]
        if r == 13:
            assert t.entries.seq[last] == exp.seq - 1 and t.entries.state[last] == OpState.COMPLETED
        else:
            assert t.entries.seq[last] == exp.seq and t.entries.state[last] == OpState.STARTED


def test_skip_whose_next_collective_disagrees_is_a_desync_on_that_rank() -> None:
    d = job().steps(20).skip(rank=13, group="tp", step=18).build()
    exp = d.expected
    assert exp.status == "desync" and exp.kind in {"op_mismatch", "size_mismatch"}
    assert exp.culprit_ranks == (13,) and exp.group is not None and 13 in exp.group.ranks


@pytest.mark.parametrize("kind", ["op_mismatch", "size_mismatch", "dtype_mismatch"])
def test_mismatched_collective_never_completes_on_any_member(kind: str) -> None:
    d = getattr(job().steps(12), kind)(rank=9, step=10).build()
    exp = d.expected
    assert exp.status == "desync" and exp.kind == kind and exp.culprit_ranks == (9,)
    assert exp.group is not None
    members = d.sim.pending_collectives[(d.layout.group("tp", 9).gid, exp.seq)]  # type: ignore[union-attr]
    assert sorted(m for m, _, _ in members) == list(exp.group.ranks)


def test_stuck_rank_completed_its_last_op_and_its_peers_wait() -> None:
    d = job().steps(12).stuck(rank=5, step=10).build()
    exp = d.expected
    assert exp.kind == "missing_rank" and exp.culprit_ranks == (5,)
    t = d.trace(5)
    assert t.entries.state[-1] == OpState.COMPLETED
    main = t.main_thread()
    assert main is not None and "train_step" in {f.name for f in main.frames}
    assert exp.waiting_ranks and 5 not in exp.waiting_ranks


def test_hang_in_op_is_a_timeout_with_the_culprit_scheduled() -> None:
    d = job().steps(12).timeout(30_000).hang_in_op(rank=9, step=10).build()
    exp = d.expected
    assert exp.kind == "timeout" and exp.culprit_ranks == (9,) and exp.group is not None
    for r in exp.group.ranks:
        t = d.trace(r)
        pending = np.flatnonzero(t.entries.state != OpState.COMPLETED)
        want = OpState.SCHEDULED if r == 9 else OpState.STARTED
        assert t.entries.state[pending[0]] == want
        assert t.dump_time_ns is not None
        assert t.dump_time_ns - t.entries.t_enqueue_ns[pending[0]] > 30_000 * 1_000_000


@pytest.mark.slow  # seconds of CPU: the slow lane
@pytest.mark.parametrize("leaves_dump", [False, True])
def test_dead_rank_leaves_no_dump_or_a_dump_with_death_info(leaves_dump: bool) -> None:
    d = job().steps(12).dead(rank=9, step=10, leaves_dump=leaves_dump).build()
    assert 9 not in d.native_docs()
    assert (9 in d.traces()) == leaves_dump
    assert d.expected.kind == ("dead_rank" if leaves_dump else "missing_dump")
    assert d.expected_native.kind == "missing_dump"


@pytest.mark.parametrize("fault", ["p2p_recv_without_send", "p2p_swap_order"])
def test_both_sides_receiving_first_is_a_p2p_deadlock(fault: str) -> None:
    d = getattr(job().steps(12), fault)(rank=20, step=10).build()
    exp = d.expected
    assert exp.kind == "p2p_deadlock" and exp.culprit_ranks == (20, 36) and exp.seq is not None
    for r, peer in ((20, 36), (36, 20)):
        t = d.trace(r)
        pend = [i for i in np.flatnonzero(t.entries.state != OpState.COMPLETED) if t.entries.is_p2p[i]]
        assert any(t.string(t.entries.op[i]) == "recv" and t.entries.peer[i] == peer for i in pend)


def test_order_inversion_makes_a_wait_cycle_across_tp_and_dp() -> None:
    d = job().steps(12).order_inversion(ranks=20, step=10).build()
    exp = d.expected
    assert exp.kind == "cross_pg_deadlock" and exp.culprit_ranks == (20, 29)
    assert {g.desc for g in exp.groups} == {"TENSOR_MODEL_PARALLEL_GROUP", "DATA_PARALLEL_GROUP"}
    assert not d.sim.finished.any()


def test_straggler_slows_the_job_without_hanging_it() -> None:
    slow = job().steps(6).straggler(rank=20, delay_ms=4.0, from_step=0).build()
    fast = job().steps(6).build()
    assert slow.sim.finished.all() and slow.expected.kind == "straggler"
    assert slow.sim.last_event_ms > fast.sim.last_event_ms + 100


def test_expected_json_is_plain_data() -> None:
    d = job().steps(6).stuck(rank=1, step=4).build()
    from dataclasses import asdict

    assert json.loads(json.dumps(asdict(d.expected)))["culprit_ranks"] == [1]


# ------------------------------------------------------------------ NCCL mode


def nccl_job(**kw: object) -> JobBuilder:
    """A small 3-D job (tp=2, pp=2, dp=2) in NCCL mode."""
    seed = int(kw.pop("seed", 0))  # type: ignore[call-overload]
    return (JobBuilder(tp=2, pp=2, dp=2, ring_size=int(kw.pop("ring_size", 2000)), seed=seed)  # type: ignore[call-overload]
            .schedule(micro_batches=3, layers_per_stage=1, log_interval=2)
            .steps(4)
            .nccl(**kw))  # type: ignore[arg-type]


def _blocks(entries: list[dict[str, Any]]) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """(members, closing entry) of every coalesced block, in record order."""
    out: list[tuple[list[dict[str, Any]], dict[str, Any]]] = []
    for i, e in enumerate(entries):
        if e["profiling_name"] != "nccl:coalesced":
            continue
        j = i
        while j > 0 and all(entries[j - 1][k] == e[k] for k in ("process_group", "collective_seq_id", "p2p_seq_id")):
            j -= 1
        out.append((entries[j:i], e))
    return out


def test_nccl_coalesced_members_stay_scheduled_and_the_closing_entry_carries_the_block() -> None:
    d = nccl_job(coalesce_dp="members", timing=True).build()
    for r in (0, 5):
        entries = d.native_doc(r)["entries"]
        blocks = _blocks(entries)
        assert any(m[0]["is_p2p"] for m, _ in blocks) and any(not m[0]["is_p2p"] for m, _ in blocks)
        for members, closing in blocks:
            assert members
            for m in members:
                assert m["state"] == "scheduled" and m["retired"] is False
                assert m["time_discovered_started_ns"] is None and m["time_discovered_completed_ns"] is None
                assert "duration_ms" not in m
                assert (m["collective_seq_id"], m["p2p_seq_id"]) == (closing["collective_seq_id"], closing["p2p_seq_id"])
            assert closing["op_id"] == members[-1]["op_id"]
            assert [m["op_id"] for m in members] == list(range(int(members[0]["op_id"]), int(closing["op_id"]) + 1))
            assert closing["is_p2p"] is False
            assert closing["input_sizes"] == [] and closing["output_dtypes"] == []
            assert closing["state"] == "completed" and closing["retired"] is True
            assert isinstance(closing["duration_ms"], float)
            assert closing["record_id"] == members[-1]["record_id"] + 1
        # one p2p seq per batch, one collective seq per DP block
        p2p_closings = [c["p2p_seq_id"] for m, c in blocks if m[0]["is_p2p"]]
        assert p2p_closings == list(range(p2p_closings[0], p2p_closings[0] + len(p2p_closings)))


def test_nccl_fused_dp_block_is_one_coalesced_collective_entry() -> None:
    d = nccl_job(coalesce_dp="fused").build()
    entries = d.native_doc(0)["entries"]
    fused = [e for e in entries if e["profiling_name"] == "nccl:reduce_scatter_tensor_coalesced"]
    assert fused and all(len(e["input_sizes"]) == 2 and e["state"] == "completed" for e in fused)
    assert not any(e["profiling_name"] == "nccl:_reduce_scatter_base" for e in entries)
    seqs = [e["collective_seq_id"] for e in entries if e["process_group"][1] == "DATA_PARALLEL_GROUP"]
    assert seqs == sorted(set(seqs))


def test_nccl_without_timing_never_reads_started() -> None:
    d = nccl_job(timing=False, run_ahead=(3, 3)).stuck(rank=1, step=3).build()
    for r in d.native_ranks:
        doc = d.native_doc(r)
        assert all(e["state"] != "started" and e["time_discovered_started_ns"] is None for e in doc["entries"])
        assert all("duration_ms" not in e for e in doc["entries"])
        assert all(v["last_started_collective"] == -1 for v in doc["pg_status"].values())


def test_nccl_blocked_rank_has_queued_ops_after_its_blocked_op() -> None:
    d = nccl_job(timing=True, run_ahead=(4, 4)).stuck(rank=1, step=3).build()
    blocked = {r: (kind, seq) for r, _, _, kind, seq in d.expected.blocked}
    assert 1 not in blocked and blocked
    for r in blocked:
        entries = [e for e in d.native_doc(r)["entries"] if not _is_member(e)]
        first = next(i for i, e in enumerate(entries) if e["state"] != "completed")
        assert entries[first]["state"] == "started"
        queued = entries[first + 1:]
        # the CPU ran 3 instructions past the blocked one (fewer if the program ended)
        assert len(queued) <= 3 and all(e["state"] == "scheduled" and not e["retired"] for e in queued)
        assert all(e["time_created_ns"] <= entries[first]["time_discovered_started_ns"] for e in queued)


def _is_member(e: dict[str, Any]) -> bool:
    """A coalesced member (p2p batches; DP buckets with ``coalesce_dp="members"``)."""
    return bool(e["is_p2p"]) or (e["process_group"][1] == "DATA_PARALLEL_GROUP" and e["profiling_name"]
                                 in ("nccl:_reduce_scatter_base", "nccl:_all_gather_base"))


def test_nccl_kernel_hang_completes_on_peers_who_then_block_on_the_hung_rank() -> None:
    d = nccl_job(timing=True).timeout(30_000).kernel_hang(rank=3, step=2, group="tp", index=1).build()
    exp = d.expected
    assert exp.kind == "timeout" and exp.culprit_ranks == (3,) and exp.group is not None
    blocked = {r: (name, kind, seq) for r, name, _, kind, seq in exp.blocked}
    assert blocked[3] == (exp.group.name, "collective", exp.seq)
    hung = [e for e in d.native_doc(3)["entries"]
            if e["process_group"][0] == exp.group.name and e["collective_seq_id"] == exp.seq]
    assert [e["state"] for e in hung] == ["started"]
    peer = next(r for r in exp.group.ranks if r != 3)
    done = [e for e in d.native_doc(peer)["entries"]
            if e["process_group"][0] == exp.group.name and e["collective_seq_id"] == exp.seq]
    assert [e["state"] for e in done] == ["completed"]
    assert blocked[peer] != blocked[3]
    assert d.dump_time_ns(3) - hung[0]["time_created_ns"] > 30_000 * 1_000_000


def test_nccl_send_send_blocks_both_ranks_in_a_send() -> None:
    d = nccl_job().p2p_send_send(rank=2, step=2).build()
    exp = d.expected
    assert exp.kind == "p2p_deadlock" and exp.culprit_ranks == (2, 6)
    blocked = {r: kind for r, _, _, kind, _ in exp.blocked}
    assert blocked[2] == blocked[6] == "p2p"
    for r in (2, 6):
        entries = d.native_doc(r)["entries"]
        closing = next(i for i, e in enumerate(entries)
                       if e["profiling_name"] == "nccl:coalesced" and e["state"] != "completed")
        assert entries[closing - 1]["profiling_name"].startswith("nccl:send")
        assert not entries[closing - 2]["is_p2p"] or entries[closing - 2]["state"] == "scheduled"


def test_nccl_json_has_no_frames_zero_times_and_string_status() -> None:
    d = nccl_job(timing=True).stuck(rank=1, step=3).build()
    doc = json.loads(JobDumps.native_json(d.native_doc(0)))
    assert all("frames" not in e for e in doc["entries"])
    assert any(e["time_discovered_completed_ns"] == 0 for e in doc["entries"])
    assert all(isinstance(v, str) for s in doc["pg_status"].values() for v in s.values())
    assert doc["nccl_comm_state"] == {}


@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_nccl_pickle_and_json_decode_to_the_same_entries(fmt: str) -> None:
    d = nccl_job(timing=True, ring_size=60).stuck(rank=4, step=3, after=5).build()
    for r in (0, 5):
        a = decode_dump(d.native_bytes(r, "pickle"), source="a", rank_hint=r)
        b = decode_dump(d.native_bytes(r, fmt), source="b", rank_hint=r)  # type: ignore[arg-type]
        va, vb = _column_views(a), _column_views(b)
        for col in va:
            assert va[col] == vb[col], (r, col)
        assert len(a.entries) == 60 and a.entries.record_id[0] > 0  # the ring evicted


def test_nccl_healthy_job_retires_every_work_and_leaves_only_members_scheduled() -> None:
    d = nccl_job(timing=True, run_ahead=(1, 6)).build()
    assert d.expected.status == "healthy" and d.expected.blocked == ()
    for r in d.native_ranks:
        for e in d.native_doc(r)["entries"]:
            if _is_member(e):
                assert e["state"] == "scheduled" and not e["retired"]
            else:
                assert e["state"] == "completed" and e["retired"]


def test_dumps_render_from_the_frozen_spec_not_from_the_builder_after_build() -> None:
    """``JobDumps`` reads the job from its ``JobSpec``: changing the builder after
    ``build()`` (options, more faults) changes nothing in dumps already built."""
    b = JobBuilder(world_size=8, tp=2, pp=2, dp=2, seed=5).steps(6).completion_poll(2.0)
    b.hang_in_op(rank=3, step=4)
    dumps = b.build()
    before = {r: frdump.encode(t) for r, t in dumps.traces().items()}
    b.timeout(1).completion_poll(0.0).gloo_style().dead(rank=1, step=2)
    after = {r: frdump.encode(t) for r, t in dumps.traces().items()}
    assert before == after
    assert len(dumps.spec.faults) == 1 and dumps.spec.poll_ms == 2.0
    with pytest.raises(AttributeError):
        dumps.spec.poll_ms = 0.0  # type: ignore[misc]
    assert not hasattr(dumps, "builder") and not hasattr(dumps, "plan")
