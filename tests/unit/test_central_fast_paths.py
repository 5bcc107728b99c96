"""The central steps' fast paths give what their simple forms give.

The central passes that walk every (rank, group) at once give what the
group-by-group, member-by-member reference gives.

``signatures.find_mismatches`` and ``timeout._late_entries`` run over
``merge.collective_rows`` (every rank's collectives in one numpy pass, each
seq's rows in the group's member order); ``find_mismatches_by_group`` and
``_late_entries_by_group`` here are the simple forms they replaced, kept as
oracles, also on groups that list their members out of rank order. Generated jobs
(NCCL and gloo, coalesced blocks, rings that evicted entries, mismatches, late
entries) must come out the same, order of the evidence included. A batch of
digests shares its equal stacks and texts before it travels to the main
process, and comes out equal.
"""

from __future__ import annotations

import gc
import pickle
import random
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest

from frforensics._gc import gc_paused
from frforensics.analyzer import AnalyzeOptions, merge
from frforensics.analyzer.context import Context
from frforensics.analyzer.detectors.straggler import (
    _first_occurrence,
    _first_of_each,
    _release,
)
from frforensics.analyzer.detectors.timeout import _late_entries, _late_finding
from frforensics.analyzer.digest import RankDigest, digest
from frforensics.analyzer.load import _share_groups, load_dumps
from frforensics.analyzer.merge import JobModel, build_job, collective_rows
from frforensics.analyzer.signatures import (
    Mismatch,
    _bad,
    _maybe_cut,
    _render,
    _uncut,
    find_mismatches,
    units,
)
from frforensics.analyzer.slots import GroupSlots
from frforensics.analyzer.waits import build_wait_graph
from frforensics.formats import decode_dump
from frforensics.report import Finding
from frforensics.testing import JobBuilder

DATA = Path(__file__).resolve().parents[1] / "data" / "native"


def _digests(mode: str, seed: int) -> dict[int, RankDigest]:
    """One generated job's native dumps, digested in memory."""
    rng = random.Random(f"central:{mode}:{seed}")
    tp, pp, dp = rng.choice([(2, 1, 4), (4, 2, 1), (2, 2, 2), (1, 2, 4), (8, 1, 2)])
    ring = rng.choice([2000, rng.randrange(12, 48)])  # small rings evict entries
    job = (JobBuilder(tp=tp, pp=pp, dp=dp, ring_size=ring, seed=seed)
           .schedule(micro_batches=max(pp, 2), layers_per_stage=1, log_interval=2)
           .steps(3).jitter(ms=0.2))
    if mode == "nccl":
        job = job.nccl(run_ahead=(1, rng.choice([1, 2, 4])),
                       coalesce_dp=rng.choice(["members", "fused", None]),  # type: ignore[arg-type]
                       timing=rng.random() < 0.5)
    else:
        job = job.gloo_style()
    world = tp * pp * dp
    rank = rng.randrange(world)
    groups = [k for k in ("tp", "dp", "pp") if k in job.layout.kinds_present()]
    fault = rng.choice(["op_mismatch", "size_mismatch", "dtype_mismatch", "late", "healthy"])
    if fault == "late":
        # every op of one rank later than the timeout: the late-entry rule's case
        job = job.timeout(5).straggler(rank=rank, delay_ms=rng.uniform(10.0, 30.0))
    elif fault != "healthy":
        group = rng.choice(groups)
        step = rng.randrange(1, 3)
        index = rng.randrange(job.collectives_in_step(rank=rank, group=group, step=step))
        job = getattr(job, fault)(rank=rank, step=step, group=group, index=index)
    dumps = job.build()
    out: dict[int, RankDigest] = {}
    for r in dumps.native_ranks:
        trace = decode_dump(pickle.dumps(dumps.native_doc(r), protocol=2),
                            source=f"nccl_trace_rank_{r}", rank_hint=r)
        out[r] = digest(trace, rank=r)
    return out


def find_mismatches_by_group(job: JobModel) -> tuple[Mismatch, ...]:
    """The oracle of :func:`find_mismatches`: group by group, member by member (``units``)."""
    found: list[Mismatch] = []
    for group in job.groups:
        parts = [u for r in job.dumped_members(group.gid)
                 if (u := units(job, r, group.gid)) is not None]
        if len(parts) < 2:
            continue
        seq, ranks, op, dtype, size = (np.concatenate(col) for col in zip(*parts, strict=True))
        order = np.argsort(seq, kind="stable")
        seq, ranks, op, dtype, size = seq[order], ranks[order], op[order], dtype[order], size[order]
        starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
        bad_op, bad_size, bad_dtype = _bad(starts, op, dtype, size)
        for name, bad, column in (("op", bad_op, op), ("dtype", bad_dtype, dtype),
                                  ("size", bad_size, size)):
            hits = np.flatnonzero(bad)
            if len(hits) == 0:
                continue
            first = int(hits[0])
            lo = int(starts[first])
            hi = int(starts[first + 1]) if first + 1 < len(starts) else len(seq)
            raw = {int(r): int(v) for r, v in zip(ranks[lo:hi], column[lo:hi], strict=True)}
            values = {r: _render(job, name, r, v, group.gid, int(seq[lo])) for r, v in raw.items()}
            found.append(Mismatch(group.gid, int(seq[lo]), name,  # type: ignore[arg-type]
                                  values, len(hits) - 1, raw))
    return tuple(found)


def _late_entries_by_group(ctx: Context, known: set[tuple[str, int | None]]) -> list[Finding]:
    """The oracle of :func:`_late_entries`: group by group, member by member."""
    findings: list[Finding] = []
    for group in ctx.job.groups:
        cols = []
        for rank in ctx.job.dumped_members(group.gid):
            view = ctx.job.view(rank, group.gid)
            if view is None or len(view.coll_rows) == 0:
                continue
            d = ctx.job.digests[rank]
            rows = view.coll_rows
            cols.append((d.seq[rows], np.full(len(rows), rank), d.t_enqueue_ns[rows],
                         d.timeout_ms[rows]))
        if len(cols) < 2:
            continue
        seq, ranks, t, tmo = (np.concatenate(c) for c in zip(*cols, strict=True))
        order = np.lexsort((t, seq))
        seq, ranks, t, tmo = seq[order], ranks[order], t[order], tmo[order]
        starts = np.flatnonzero(np.r_[True, seq[1:] != seq[:-1]])
        first_t = np.repeat(t[starts], np.diff(np.r_[starts, len(seq)]))
        late = (t > 0) & (first_t > 0) & (tmo > 0) & ((t - first_t) > tmo * 1_000_000)
        hits = np.flatnonzero(late)
        if len(hits) == 0:
            continue
        s0 = int(seq[hits[0]])
        if (group.name, s0) in known or (group.gid, s0) in ctx.desynced:
            continue
        finding = _late_finding(ctx, group.gid, s0, int(tmo[hits[0]]))
        if finding is None:
            continue
        findings.append(finding)
        if len(findings) >= ctx.options.max_findings_per_kind:
            break
    return findings


def _said(ms: tuple[Mismatch, ...]) -> list[object]:
    return [(m.gid, m.seq, m.field, list(m.values.items()), m.later, list(m.raw.items()))
            for m in ms]


def _context(digests: dict[int, RankDigest]) -> Context:
    job = build_job(digests)
    return Context.build(job, build_wait_graph(job, hang_after_s=1.0), AnalyzeOptions())


def _assert_same(job: JobModel, ctx: Context) -> None:
    assert _said(find_mismatches(job)) == _said(find_mismatches_by_group(job))
    fast = [f.to_json() for f in _late_entries(ctx, set())]
    slow = [f.to_json() for f in _late_entries_by_group(ctx, set())]
    assert fast == slow


@pytest.fixture(params=["one slice", "slices of 5 rows"])
def slices(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The all-group passes over one slice of rows, then over slices of whole
    groups of ~5 rows (at 16,384 ranks they go 2 million rows at a time)."""
    if request.param != "one slice":
        monkeypatch.setattr(merge, "ORDER_SLICE_ROWS", 5)


@pytest.mark.usefixtures("slices")
@pytest.mark.parametrize("mode", ["nccl", "gloo"])
def test_all_group_passes_agree_with_the_per_group_reference(mode: str) -> None:
    seen = {"mismatch": 0, "late": 0, "evicted": 0}
    for seed in range(14):
        digests = _digests(mode, seed)
        ctx = _context(digests)
        assert ctx.job.members_ascending()
        _assert_same(ctx.job, ctx)
        seen["mismatch"] += bool(find_mismatches_by_group(ctx.job))
        seen["late"] += bool(_late_entries_by_group(ctx, set()))
        seen["evicted"] += any(ctx.job.window_evicted(r) and not d.whole_oldest
                               for r, d in digests.items())
    # the draw covers what the fast paths must get right (not vacuously equal)
    assert all(seen.values()), seen


def test_passes_agree_on_the_recorded_timeout_and_small_ring_dumps() -> None:
    for case in ("timeout", "small_ring", "op_mismatch", "size_mismatch"):
        ds = load_dumps([DATA / case / "pickle"], jobs=1)
        ctx = _context(ds.digests)
        _assert_same(ctx.job, ctx)
    ds = load_dumps([DATA / "timeout" / "pickle"], jobs=1)
    assert _late_entries(_context(ds.digests), set()), "the recorded late entry is found"


@pytest.mark.parametrize(("mode", "seed"), [("nccl", s) for s in range(6)] + [("gloo", 1), ("gloo", 4)])
def test_collective_rows_are_every_members_view(mode: str, seed: int) -> None:
    # with and without p2p rows (pp > 1), so both ways of taking the rows are checked
    digests = _digests(mode, seed)
    job = build_job(digests)
    c = collective_rows(job)
    for gid in range(len(job.groups)):
        for rank in job.dumped_members(gid):
            view = job.view(rank, gid)
            i = c.ranks.index(rank)
            lo, hi = int(c.offsets[i]), int(c.offsets[i + 1])
            mine = c.take[lo:hi][c.gid[lo:hi] == gid] - sum(len(digests[r]) for r in c.ranks[:i])
            expected = [] if view is None else view.coll_rows.tolist()
            assert mine.tolist() == expected
    # ordered by (group, seq), rank then record order within
    keys = list(zip(c.gid[c.order].tolist(), c.seq[c.order].tolist(), c.at[c.order].tolist(),
                    c.take[c.order].tolist(), strict=True))
    assert keys == sorted(keys)


@pytest.mark.parametrize("permute", [False, True])
def test_ordered_slices_hold_whole_groups_and_make_the_one_order(permute: bool) -> None:
    digests = _digests("nccl", 3)
    if permute:
        digests = _permuted(digests, random.Random(3))
    c = collective_rows(build_job(digests))
    whole = c.order
    assert len(whole) == len(c.seq) and len(list(c.ordered())) == 1
    keep = np.random.default_rng(3).random(len(c.seq)) < 0.8
    for kept in (None, keep):
        one = np.concatenate(list(c.ordered(kept)))
        parts = list(c.ordered(kept, max_rows=5))
        assert len(parts) > 3
        assert np.array_equal(np.concatenate(parts), one)
        groups = [set(c.gid[p].tolist()) for p in parts]
        assert all(a.isdisjoint(b) for i, a in enumerate(groups) for b in groups[i + 1:])
    assert np.array_equal(np.concatenate(list(c.ordered(keep))), whole[keep[whole]])


def _permuted(digests: dict[int, RankDigest], rng: random.Random) -> dict[int, RankDigest]:
    """The same dumps with every group of several members listing them in a random
    order (the same order, one tuple, in every rank's dump)."""
    orders: dict[tuple[int, ...], tuple[int, ...]] = {}
    out = {}
    for r, d in digests.items():
        groups = []
        for g in d.groups:
            if g.ranks is not None and len(g.ranks) > 1:
                key = tuple(sorted(g.ranks))
                if key not in orders:
                    members = list(key)
                    while len(members) > 1 and tuple(members) == key:
                        rng.shuffle(members)
                    orders[key] = tuple(members)
                g = replace(g, ranks=orders[key])
            groups.append(g)
        out[r] = replace(d, groups=tuple(groups))
    return out


@pytest.mark.usefixtures("slices")
def test_members_listed_out_of_rank_order_agree_with_the_per_group_reference() -> None:
    # (NCCL dumps list members; PyTorch's gloo dumps list none, nothing to permute)
    seen = {"mismatch": 0, "late": 0}
    for seed in range(14):
        digests = _permuted(_digests("nccl", seed), random.Random(seed))
        ctx = _context(digests)
        assert not ctx.job.members_ascending()
        _assert_same(ctx.job, ctx)
        seen["mismatch"] += bool(find_mismatches_by_group(ctx.job))
        seen["late"] += bool(_late_entries_by_group(ctx, set()))
    assert all(seen.values()), seen


def test_collective_rows_come_in_member_order_when_members_are_listed_out_of_order() -> None:
    job = build_job(_permuted(_digests("nccl", 5), random.Random(5)))
    assert not job.members_ascending()
    c = collective_rows(job)
    position = {g: {r: i for i, r in enumerate(job.dumped_members(g))}
                for g in range(len(job.groups))}
    # ordered by (group, seq), member then record order within
    keys = [(g, s, position[g][c.ranks[a]], t) for g, s, a, t in zip(
        c.gid[c.order].tolist(), c.seq[c.order].tolist(), c.at[c.order].tolist(),
        c.take[c.order].tolist(), strict=True)]
    assert keys == sorted(keys)


def _same_digest(a: RankDigest, b: RankDigest) -> None:
    for f in fields(RankDigest):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype
            assert np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


def test_a_batch_shares_equal_stacks_and_texts_and_changes_nothing() -> None:
    digests = _digests("nccl", 2)
    for d in digests.values():  # every rank's own copies, as separate decodes give
        assert d.details
    shared = _share_groups(list(digests.values()))
    frames: dict[tuple[str, int, str], int] = {}
    for before, after in zip(digests.values(), shared, strict=True):
        assert isinstance(after, RankDigest)
        _same_digest(before, after)
        for det in after.details.values():
            for f in det.frames:
                assert frames.setdefault((f.file, f.line, f.name), id(f)) == id(f)
        for t in after.threads:
            for f in t.frames:
                assert frames.setdefault((f.file, f.line, f.name), id(f)) == id(f)
    # equal call-site and op-name tables (in the same order): one dict for the
    # batch; a rank's table keeps its order
    for name in ("sites", "op_names"):
        tables = [getattr(d, name) for d in shared if isinstance(d, RankDigest)]
        assert all(tables), name
        for i, table in enumerate(tables):
            same = [t for t in tables if list(t.items()) == list(table.items())]
            assert len(same) > 1 or name == "op_names", name
            assert all(t is same[0] for t in same), name
            assert table is not getattr(list(digests.values())[i], name)
    # and the batch travels back to the main process whole
    back = pickle.loads(pickle.dumps(shared, protocol=pickle.HIGHEST_PROTOCOL))
    for before, after in zip(digests.values(), back, strict=True):
        _same_digest(before, after)


@pytest.mark.parametrize("protocol", [2, 4, pickle.HIGHEST_PROTOCOL])
def test_digests_pickle_back_equal_with_writable_columns(protocol: int) -> None:
    digests = list(_digests("gloo", 1).values())
    empty = replace(digests[0], **{f.name: getattr(digests[0], f.name)[:0] for f in fields(RankDigest)
                                   if isinstance(getattr(digests[0], f.name), np.ndarray)},
                    details={})
    for d in [*digests, empty]:
        back = pickle.loads(pickle.dumps(d, protocol=protocol))
        _same_digest(d, back)
        for f in fields(RankDigest):
            v = getattr(back, f.name)
            if isinstance(v, np.ndarray):
                # writable, as unpickled arrays are, but a one-value column
                # (``digest.compact``): a read-only view of its value, as before
                assert v.flags.aligned, f.name
                one = len(v) > 1 and getattr(d, f.name).strides == (0,)
                assert v.flags.writeable != one, f.name


def _first_of_each_by_group(at: np.ndarray, canon: np.ndarray, key: np.ndarray) -> np.ndarray:
    """``straggler._first_of_each`` one group number at a time (the reference)."""
    first = np.ones(len(key), dtype=np.bool_)
    for j in np.unique(canon).tolist():
        idx = np.flatnonzero(canon == j)  # group j of every rank, rank after rank
        if len(idx) < 2:
            continue
        k, a = key[idx], at[idx]
        same_rank = a[1:] == a[:-1]
        first[idx[1:]] = ~same_rank | (k[1:] != k[:-1])
        for bad in np.unique(a[1:][same_rank & (k[1:] < k[:-1])]).tolist():
            mine = idx[a == bad]
            first[mine] = _first_occurrence(key[mine])
    return first


@pytest.mark.parametrize("groups", [4, 40_000], ids=["few-groups", "more-than-int16-groups"])
def test_straggler_first_of_each_agrees_with_the_group_by_group_form(groups: int) -> None:
    rng = np.random.default_rng(7)
    for trial in range(200):
        n = int(rng.integers(0, 60))
        at = np.sort(rng.integers(0, 5, n)).astype(np.int64)
        canon = rng.integers(0, 4, n).astype(np.int64) * (groups // 4)
        # keys mostly rising per (rank, group), repeated (coalesced), sometimes falling
        key = (canon * 1000 + np.cumsum(rng.integers(0, 2, n))).astype(np.int64)
        if trial % 3 == 0 and n:
            key[rng.integers(0, n, 3)] -= 5
        assert np.array_equal(_first_of_each(at, canon, key),
                              _first_of_each_by_group(at, canon, key)), trial


def _release_reference(at: np.ndarray, t_complete: np.ndarray, done: np.ndarray,
                       sizes: np.ndarray) -> np.ndarray:
    """Latest completion among each row's earlier entries on its rank, row by row."""
    out = np.full(len(at), np.nan)
    for i in range(len(at)):
        earlier = [int(t_complete[j]) for j in range(i) if at[j] == at[i] and done[j]]
        if earlier:
            out[i] = float(max(earlier))
    return out


def test_straggler_release_times_are_the_latest_earlier_completion_per_rank() -> None:
    rng = np.random.default_rng(11)
    for trial in range(150):
        sizes = rng.integers(0, 6, int(rng.integers(1, 6))).astype(np.int64)
        at = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
        n = len(at)
        t_complete = (1_700_000_000_000_000_000 + rng.integers(0, 10**9, n)).astype(np.int64)
        done = rng.random(n) < 0.7
        got = _release(at, t_complete, done, sizes)
        assert np.array_equal(got, _release_reference(at, t_complete, done, sizes),
                              equal_nan=True), trial


def test_a_settled_pause_leaves_its_objects_old_and_the_collector_as_it_was() -> None:
    was = gc.isenabled()
    gc.enable()
    try:
        gc.collect()
        with gc_paused(settle=True):
            kept = [[i] for i in range(10_000)]  # long-lived containers
            assert not gc.isenabled()
        assert gc.isenabled() and gc.get_freeze_count() == 0
        assert gc.get_count()[0] < 100  # nothing young left to scan
        assert any(x is kept[0] for x in gc.get_objects(generation=2))
        # a caller's own freeze is left alone
        gc.freeze()
        frozen = gc.get_freeze_count()
        with gc_paused(settle=True):
            more = [[i] for i in range(100)]
        # settling would have unfrozen everything (count 0); frozen objects may still
        # die meanwhile (reference counting frees them), so the count is not exact
        assert frozen > 0 and gc.get_freeze_count() > frozen // 2 and more
        gc.unfreeze()
    finally:
        if not was:
            gc.disable()


def test_collective_rows_are_dropped_after_their_last_reader() -> None:
    # _analyze drops merge.collective_rows after the timeout rule, before the straggler
    # rule's gather (half a GiB at 16,384 ranks); no rule after it reads them (a reader
    # there would recompute them: never wrong, but the memory would be back)
    import inspect

    from frforensics.analyzer import _analyze
    from frforensics.analyzer.detectors import DETECTORS, timeout

    assert DETECTORS[_analyze._LAST_ROWS_READER] is timeout.detect
    assert "collective_rows" in inspect.getsource(timeout)
    for detector in DETECTORS[_analyze._LAST_ROWS_READER + 1:]:
        assert "collective_rows" not in inspect.getsource(inspect.getmodule(detector)), detector


def _uncut_by_rank(job: JobModel, c: merge.CollectiveRows) -> np.ndarray:
    """``signatures._uncut``'s rank-by-rank form, kept as its oracle: every rank whose
    ring evicted entries, every group it is on, ``_maybe_cut`` on its oldest seq."""
    keep = np.ones(len(c.seq), dtype=np.bool_)
    base = 0
    for i, rank in enumerate(c.ranks):
        d = job.digests[rank]
        lo, hi = int(c.offsets[i]), int(c.offsets[i + 1])
        start, base = base, base + len(d)
        if d.whole_oldest or not job.window_evicted(rank) or lo == hi:
            continue
        gids = c.gid[lo:hi]
        for gid in sorted({g for g in (job.group_of.get((rank, local), -1)
                                       for local in range(len(d.groups))) if g >= 0}):
            on = gids == gid
            if not on.any():
                continue
            rows = c.take[lo:hi][on].astype(np.intp) - start
            min_seq = int(c.seq[lo:hi][on].min())
            if _maybe_cut(job, rank, rows, min_seq):
                keep[lo:hi] &= ~(on & (c.seq[lo:hi] == min_seq))
    return keep


@pytest.mark.parametrize("mode", ["nccl", "gloo"])
def test_the_ring_cut_check_in_one_pass_agrees_with_the_rank_by_rank_form(mode: str) -> None:
    cut = evicted = 0
    rng = random.Random(f"uncut:{mode}")
    for seed in range(14):
        digests = _digests(mode, seed)
        for variant in (digests, _permuted(digests, rng)):
            job = _context(variant).job
            c = collective_rows(job)
            fast, slow = _uncut(job, c), _uncut_by_rank(job, c)
            assert np.array_equal(np.ones(len(c.seq), dtype=np.bool_) if fast is None else fast,
                                  slow), seed
            cut += int((~slow).sum())
            evicted += any(job.window_evicted(r) and not d.whole_oldest
                           for r, d in variant.items())
    for case in ("timeout", "small_ring", "op_mismatch", "size_mismatch"):
        job = _context(load_dumps([DATA / case / "pickle"], jobs=1).digests).job
        c = collective_rows(job)
        fast = _uncut(job, c)
        assert np.array_equal(np.ones(len(c.seq), dtype=np.bool_) if fast is None else fast,
                              _uncut_by_rank(job, c)), case
    # not vacuously equal: rings that evicted entries, and (NCCL's coalesced blocks:
    # gloo's dumps hold no closing entries to cut) oldest seqs left out
    assert evicted and (cut or mode == "gloo"), (evicted, cut)


def _slots_reference(job: JobModel) -> tuple[list[int], list[int], list[int]]:
    """gid, member index and canonical local index per slot, as the loops had them."""
    gids: list[int] = []
    members: list[int] = []
    canons: list[int] = []
    index = [g.ranks if isinstance(g.ranks, range) else {r: i for i, r in enumerate(g.ranks)}
             for g in job.groups]
    for rank in sorted(job.digests):
        lut = [job.group_of.get((rank, i), -1) for i in range(len(job.digests[rank].groups))]
        for g in lut:
            m = index[g] if g >= 0 else None
            if isinstance(m, range):
                members.append(m.index(rank) if rank in m else -1)
            else:
                members.append(-1 if m is None else m.get(rank, -1))
        gids.extend([*lut, -1])
        members.append(-1)
        canons.extend([lut.index(g) for g in lut] + [len(lut)])
    return gids, members, canons


def _check_slots(slots: GroupSlots, job: JobModel) -> None:
    gids, members, canons = _slots_reference(job)
    assert slots.ranks == sorted(job.digests)
    assert slots.gid.tolist() == gids
    assert slots.member.tolist() == members
    got = slots.canon.tolist()
    # a slot with no group is never read for its canonical number
    assert [c for c, g in zip(got, gids, strict=True) if g >= 0] == \
        [c for c, g in zip(canons, gids, strict=True) if g >= 0]


@pytest.mark.parametrize("mode", ["nccl", "gloo"])
def test_slots_agree_with_the_dict_form_on_generated_jobs(mode: str) -> None:
    rng = random.Random(f"slots:{mode}")
    for seed in range(10):
        digests = _digests(mode, seed)
        for variant in (digests, _permuted(digests, rng)):
            job = build_job(variant)
            _check_slots(job.group_slots(), job)


def test_slots_agree_on_recorded_dumps() -> None:
    for case in ("timeout", "small_ring", "op_mismatch", "size_mismatch"):
        job = build_job(load_dumps([DATA / case / "pickle"], jobs=1).digests)
        _check_slots(job.group_slots(), job)


@pytest.mark.parametrize("mode", ["nccl", "gloo"])
def test_ranks_with_other_agrees_with_a_check_per_rank(mode: str) -> None:
    """``digest.ranks_with_other`` (the wait graph's pending ranks, the incomplete-dump
    rule): one-value columns (``compact``) and empty ones included, in any mix."""
    from frforensics.analyzer.digest import compact, ranks_with_other
    from frforensics.model import OpState

    rng = random.Random(f"other:{mode}")
    seen = set()
    for seed in range(6):
        ds = list(_digests(mode, seed).values())
        ds = [rng.choice([d, compact(d), replace(d, state=d.state[:0], timeout_ms=d.timeout_ms[:0],
                                                 t_enqueue_ns=d.t_enqueue_ns[:0])])
              for d in ds]
        for name, value in (("state", OpState.COMPLETED), ("timeout_ms", 0), ("t_enqueue_ns", 0),
                            ("state", OpState.FAILED)):
            want = [bool((getattr(d, name) != value).any()) for d in ds]
            assert ranks_with_other(ds, name, value).tolist() == want, (seed, name)
            same = [bool((getattr(d, name) == value).any()) for d in ds]
            assert ranks_with_other(ds, name, value, same=True).tolist() == same, (seed, name)
            seen.update(want)
    assert seen == {True, False}
    assert ranks_with_other([], "state").tolist() == []
