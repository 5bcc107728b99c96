"""``JobDumps``: the per-rank dumps of a simulated job, in every format we read.

- :meth:`JobDumps.native_docs` — PyTorch's native flight-recorder documents
  (schema 2.10, the dict NCCL pickles), NCCL flavoured or, with
  ``JobBuilder.gloo_style()``, gloo flavoured;
- :meth:`JobDumps.write_native` — one file per rank, pickle (protocol 2, frames
  shared like c10's pickler memoizes them) or JSON (as ``_dump_fr_trace_json``);
- :meth:`JobDumps.traces` — :class:`~frforensics.model.RankTrace` in the richer
  form our recorder writes (per-peer p2p numbers, global peer/root, host, pid,
  dump reason, thread stacks at dump time, stale peers, death info);
- :meth:`JobDumps.write_frdump` — those traces as ``frdump_rank_<r>`` files.

Everything is derived from the simulation (see ``simulate``) and is deterministic
for a given seed.
"""

from __future__ import annotations

import gc
import json
import math
import multiprocessing
import os
import pickle
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from frforensics.formats import frdump
from frforensics.model import (
    NO_INDEX,
    DeathInfo,
    DumpHeader,
    DumpReason,
    EntryTable,
    Frame,
    GroupInfo,
    OpState,
    PeerHeartbeat,
    RankTrace,
    SourceFormat,
    ThreadStack,
)
from frforensics.testing.expected import Expected
from frforensics.testing.layout import GROUP_KINDS
from frforensics.testing.schedule import SITES, WIRE_NAMES, OpSpec, closing_site

if TYPE_CHECKING:
    from frforensics.testing.builder import JobSpec
    from frforensics.testing.simulate import SimResult

__all__ = ["JobDumps", "RankRecords"]

_GLOO_NAMES = {
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "all_reduce",  # as torch 2.13's gloo records it
    "barrier": "barrier",
}
_STATE_NAMES = {OpState.SCHEDULED: "scheduled", OpState.STARTED: "started", OpState.COMPLETED: "completed"}
_LAUNCH_MS = 0.012
#: ProcessGroupNCCL's watchdog loop period (kWatchdogThreadSleepMillis), ms
_WATCHDOG_MS = 100.0
_GPUS_PER_HOST = 8

_WATCHDOG = (
    Frame("/usr/local/lib/python3.12/threading.py", 359, "wait"),
    Frame("/workspace/frforensics/recorder/_watchdog.py", 141, "_run"),
    Frame("/usr/local/lib/python3.12/threading.py", 1012, "run"),
    Frame("/usr/local/lib/python3.12/threading.py", 1075, "_bootstrap_inner"),
    Frame("/usr/local/lib/python3.12/threading.py", 1032, "_bootstrap"),
)
_MEG = "/workspace/Megatron-LM/megatron"
_IDLE = (
    Frame(f"{_MEG}/training/training.py", 2101, "train"),
    Frame(f"{_MEG}/training/training.py", 846, "pretrain"),
    Frame("/workspace/Megatron-LM/pretrain_gpt.py", 301, "<module>"),
)
_STUCK: dict[str, tuple[Frame, ...]] = {
    "python": (
        Frame(f"{_MEG}/training/utils.py", 250, "reduce_max_stat_across_model_parallel_group"),
        Frame(f"{_MEG}/training/training.py", 1312, "train_step"),
        *_IDLE,
    ),
    "dataloader": (
        Frame("/usr/local/lib/python3.12/multiprocessing/connection.py", 430, "_recv_bytes"),
        Frame("/usr/local/lib/python3.12/multiprocessing/queues.py", 113, "get"),
        Frame("/usr/local/lib/python3.12/dist-packages/torch/utils/data/dataloader.py", 1284, "_try_get_data"),
        Frame("/usr/local/lib/python3.12/dist-packages/torch/utils/data/dataloader.py", 1445, "_next_data"),
        Frame("/workspace/Megatron-LM/pretrain_gpt.py", 150, "get_batch"),
        Frame(f"{_MEG}/training/training.py", 1247, "train_step"),
        *_IDLE,
    ),
}
_BACKWARD_MAIN = (
    Frame("/usr/local/lib/python3.12/dist-packages/torch/autograd/graph.py", 829, "_engine_run_backward"),
    Frame("/usr/local/lib/python3.12/dist-packages/torch/autograd/__init__.py", 353, "backward"),
    Frame(f"{_MEG}/core/pipeline_parallel/schedules.py", 396, "backward_step"),
    Frame(f"{_MEG}/training/training.py", 1247, "train_step"),
    *_IDLE,
)


@dataclass
class RankRecords:
    """One rank's recorded entries (after ring eviction), as columns."""

    spec: npt.NDArray[np.int32]
    record_id: npt.NDArray[np.int64]
    seq: npt.NDArray[np.int64]
    p2p_seq: npt.NDArray[np.int64]
    op_id: npt.NDArray[np.int64]
    peer_seq: npt.NDArray[np.int64]
    state: npt.NDArray[np.uint8]
    t_enqueue_ns: npt.NDArray[np.int64]
    t_start_ns: npt.NDArray[np.int64]  # 0 = never started
    t_complete_ns: npt.NDArray[np.int64]  # 0 = not completed
    dropped: int
    last_seq: dict[str, tuple[int, int, int]]  # kind -> (enqueued, started, completed) seq
    # NCCL mode only: 0 plain entry, 1 coalesced member, 2 closing ``coalesced`` entry
    block: npt.NDArray[np.uint8] | None = None
    retired: npt.NDArray[np.bool_] | None = None
    # where the rank is really blocked (its earliest unfinished op, a block counted by
    # its closing entry), before eviction: (group kind, seq kind, seq) or None
    blocked: tuple[str, str, int] | None = None
    duration_ms: npt.NDArray[np.float64] | None = None  # NCCL mode with timing (NaN = none)


class _Tables:
    """Per-job tables shared by every rank: strings, stacks, per-spec columns."""

    def __init__(self, dumps: JobDumps) -> None:
        cat = dumps.spec.cat
        strings: list[str] = []
        index: dict[str, int] = {}

        def s(x: str) -> int:
            i = index.get(x)
            if i is None:
                i = index[x] = len(strings)
                strings.append(x)
            return i

        site_names = list(SITES)
        self.stacks = tuple(SITES[n][0] for n in site_names)
        site_index = {n: i for i, n in enumerate(site_names)}
        specs = cat.specs
        n = len(specs)
        self.kind = np.array([GROUP_KINDS.index(p.group) for p in specs], dtype=np.int32)
        self.is_p2p = np.array([p.is_p2p for p in specs], dtype=bool)
        self.is_send = np.array([p.op == "send" for p in specs], dtype=bool)
        self.delta = np.array([p.delta for p in specs], dtype=np.int32)
        self.root = np.array([p.root for p in specs], dtype=np.int32)
        self.op = np.array([s(p.op) for p in specs], dtype=np.int32)
        self.in_shapes = np.array([s(str([list(x) for x in p.in_sizes])) for p in specs], dtype=np.int32)
        self.out_shapes = np.array([s(str([list(x) for x in p.out_sizes])) for p in specs], dtype=np.int32)
        self.in_dtypes = np.array([s(",".join(p.in_dtypes)) for p in specs], dtype=np.int32)
        self.out_dtypes = np.array([s(",".join(p.out_dtypes)) for p in specs], dtype=np.int32)
        self.reduce_op = np.array([s(p.reduce_op) if p.reduce_op else NO_INDEX for p in specs], dtype=np.int32)
        self.thread = np.array([s(SITES[p.site][1]) for p in specs], dtype=np.int32)
        self.stack = np.array([site_index[p.site] for p in specs], dtype=np.int32)
        self.in_numel = np.array([sum(int(np.prod(x)) for x in p.in_sizes) for p in specs], dtype=np.int64)
        self.out_numel = np.array([sum(int(np.prod(x)) for x in p.out_sizes) for p in specs], dtype=np.int64)
        self.devices = [s(f"cuda:{i}") for i in range(_GPUS_PER_HOST)]
        self.strings = tuple(strings)
        del n
        # native: one shared dict per frame (c10's pickler memoizes them the same way)
        frame_dicts: dict[Frame, dict[str, Any]] = {}
        self.native_frames: list[list[dict[str, Any]]] = []
        for p in specs:
            fl = []
            for fr in SITES[p.site][0]:
                d = frame_dicts.get(fr)
                if d is None:
                    d = frame_dicts[fr] = {"name": fr.name, "filename": fr.file, "line": fr.line}
                fl.append(d)
            self.native_frames.append(fl)


class JobDumps:
    """The dumps of one simulated job; see the module docstring."""

    def __init__(
        self,
        *,
        spec: JobSpec,
        sim: SimResult,
        expected: Expected,
        dump_ms: float,
        offsets_ms: npt.NDArray[np.float64],
    ) -> None:
        #: what the builder planned (``JobSpec``): the only thing read of it
        self.spec = spec
        self.sim = sim
        self.expected = expected
        self.dump_ms = dump_ms
        self.offsets_ms = offsets_ms
        self.seed = spec.seed
        self.layout = spec.layout
        self.world_size = self.layout.world_size
        self.ring_size = spec.ring_size
        self.gloo = spec.gloo
        self.timeout_ms = spec.timeout_ms
        self.t0_ns = spec.start_time_ns
        self._tables: _Tables | None = None
        self._prefix_cache: dict[int, dict[str, Any]] = {}
        self._watchdog_rank: int | Literal[False] | None = False
        self.nccl = spec.nccl
        # NCCL mode: instruction id -> spec id of its closing ``coalesced`` entry, or
        # of the one ``*_coalesced`` entry that stands for the whole block (fast path)
        self._closing: dict[int, int] = {}
        self._fused: dict[int, int] = {}
        self.timing = spec.timing
        if self.nccl:
            cat = spec.cat
            for iid, ins in enumerate(list(cat.instrs)):
                specs = [cat.specs[o] for o in ins.ops]
                first = specs[0]
                p2p = any(sp.is_p2p for sp in specs)
                if not p2p and len(specs) > 1 and spec.dp_style == "fused":
                    self._fused[iid] = cat.spec(replace(
                        first, op=f"{first.op}_coalesced",
                        in_sizes=tuple(x for sp in specs for x in sp.in_sizes),
                        out_sizes=tuple(x for sp in specs for x in sp.out_sizes),
                        in_dtypes=tuple(x for sp in specs for x in sp.in_dtypes),
                        out_dtypes=tuple(x for sp in specs for x in sp.out_dtypes)))
                elif p2p or len(specs) > 1:
                    self._closing[iid] = cat.spec(OpSpec(
                        "coalesced", first.group, (), (), (), (), closing_site(first.site), 0.0))
        blocked = []
        for r in self.native_ranks:
            b = self._blocked_nccl(r) if self.nccl else self.records(r).blocked
            if b is not None:
                g = self.layout.group(b[0], r)
                assert g is not None
                blocked.append((r, g.name, g.ranks, b[1], b[2]))
        self.expected = replace(expected, blocked=tuple(blocked))
        expected = self.expected
        if expected.seq_kind == "p2p" and expected.seq is None and expected.culprit_ranks:
            # the p2p number of the first culprit's pending recv, from its own counters
            r = expected.culprit_ranks[0]
            b = self.records(r).blocked
            if b is not None and b[1] == "p2p":
                self.expected = replace(expected, seq=b[2])

    # ------------------------------------------------------------ what ranks
    @property
    def dumping_ranks(self) -> list[int]:
        """Ranks that leave an frdump (every rank but the dead ones without a dump)."""
        return [r for r in range(self.world_size) if self.spec.dead.get(r, True)]

    @property
    def native_ranks(self) -> list[int]:
        """Ranks that leave a native dump (dead ranks never do)."""
        return [r for r in range(self.world_size) if r not in self.spec.dead]

    @property
    def expected_native(self) -> Expected:
        """The verdict on the native dumps: a dead rank's death info is not there."""
        exp = self.expected
        if "dead_rank" not in exp.kinds:
            return exp
        dead = tuple(r for r in self.spec.dead)
        kinds = tuple("missing_dump" if k == "dead_rank" else k for k in exp.kinds)
        return replace(exp, kinds=kinds, missing_dumps=dead)

    @property
    def tables(self) -> _Tables:
        if self._tables is None:
            self._tables = _Tables(self)
        return self._tables

    # --------------------------------------------------------------- records
    def _prefix(self, stage: int) -> dict[str, Any]:
        """Counters accumulated by the steps that were not simulated, per stage."""
        hit = self._prefix_cache.get(stage)
        if hit is not None:
            return hit
        cat = self.spec.cat
        nk = len(GROUP_KINDS)
        coll, p2p = [0] * nk, [0] * nk
        peer: dict[tuple[str, int], int] = {}
        records = 0
        for sid, n in self.spec.prefix[stage].items():
            spec = cat.specs[sid]
            k = GROUP_KINDS.index(spec.group)
            if spec.is_p2p:
                p2p[k] += n
                key = (spec.op, spec.delta)
                peer[key] = peer.get(key, 0) + n
                if not self.gloo:
                    records += n
            else:
                coll[k] += n
                records += n
        hit = self._prefix_cache[stage] = {"coll": coll, "p2p": p2p, "peer": peer, "records": records}
        return hit

    def records(self, rank: int) -> RankRecords:
        """The rank's recorded entries: counters, states and times, after eviction."""
        return self._records_nccl(rank) if self.nccl else self._records(rank)

    def _blocked_nccl(self, rank: int) -> tuple[str, str, int] | None:
        """NCCL mode: (group kind, seq kind, seq) of the instruction the GPU is blocked in."""
        sim = self.sim
        if sim.finished[rank] or rank in self.spec.dead:
            return None
        cat = self.spec.cat
        pc = int(sim.pc[rank])
        prog = self.spec.programs[rank][: pc + 1]
        last = cat.instrs[prog[-1]]
        first = cat.specs[last.ops[0]]
        p2p = any(cat.specs[o].is_p2p for o in last.ops)
        pre = self._prefix_nccl(int(self.layout.pp_rank[rank]))
        n = pre["p2p" if p2p else "coll"][GROUP_KINDS.index(first.group)]
        for iid in prog:
            ins = cat.instrs[iid]
            if cat.specs[ins.ops[0]].group == first.group and (
                    any(cat.specs[o].is_p2p for o in ins.ops) == p2p):
                n += 1
        return (first.group, "p2p" if p2p else "collective", n)

    def _records(self, rank: int) -> RankRecords:
        t = self.tables
        sim = self.sim
        sids = sim.ops[rank].astype(np.int64)
        n = len(sids)
        pre = self._prefix(int(self.layout.pp_rank[rank]))
        kind = t.kind[sids]
        p2p = t.is_p2p[sids]
        seq = np.zeros(n, dtype=np.int64)
        p2p_seq = np.zeros(n, dtype=np.int64)
        op_id = np.zeros(n, dtype=np.int64)
        peer_seq = np.full(n, NO_INDEX, dtype=np.int64)
        for k in range(len(GROUP_KINDS)):
            m = kind == k
            if not m.any():
                continue
            seq[m] = (np.cumsum(m & ~p2p) + pre["coll"][k])[m]
            p2p_seq[m] = (np.cumsum(m & p2p) + pre["p2p"][k])[m]
            op_id[m] = (np.cumsum(m) + pre["coll"][k] + pre["p2p"][k])[m]
        if p2p.any():
            sends = t.is_send[sids]
            delta = t.delta[sids]
            for op_name, is_s in (("send", True), ("recv", False)):
                for d in (-1, 1):
                    m = p2p & (sends == is_s) & (delta == d)
                    if m.any():
                        peer_seq[m] = (np.cumsum(m) + pre["peer"].get((op_name, d), 0))[m]
        enq = sim.t_enqueue[rank]
        comp = sim.t_complete[rank]
        done = ~np.isnan(comp)
        state = np.where(done, OpState.COMPLETED, OpState.STARTED).astype(np.uint8)
        idx = sim.instr_index[rank]
        for r_, pos in self.spec.hung:
            if r_ == rank:
                state[(idx == pos) & ~done] = OpState.SCHEDULED
        off = self.offsets_ms[rank]
        poll = self.spec.poll_ms
        if poll > 0:
            rng = np.random.default_rng([self.seed, rank, 7])
            d_start = rng.uniform(0.0, poll, n)
            d_comp = rng.uniform(0.0, poll, n)
        else:
            d_start = d_comp = np.zeros(n)
        t_enq = self._ns(enq + off)
        started = state != OpState.SCHEDULED
        t_start = np.where(started, self._ns(enq + off + _LAUNCH_MS + d_start), 0)
        t_comp = np.where(done, self._ns(np.where(done, comp, 0.0) + off + d_comp), 0)
        t_start = np.where(done, np.minimum(t_start, t_comp), t_start)
        last_seq: dict[str, tuple[int, int, int]] = {}
        for k, name in enumerate(GROUP_KINDS):
            m = (kind == k) & ~p2p
            c0 = pre["coll"][k]
            if self.gloo:
                # gloo's pg_status counts every op, p2p included (its work seq_ is the
                # op count): last_enqueued runs ahead of the recorded collectives
                m = kind == k
                c0 = pre["coll"][k] + pre["p2p"][k]
                counter = op_id
            else:
                counter = seq
            if not m.any() and c0 == 0:
                continue
            enq_s = int(counter[m].max()) if m.any() else c0
            st_m = m & started
            co_m = m & done
            last_seq[name] = (
                enq_s,
                int(counter[st_m].max()) if st_m.any() else c0,
                int(counter[co_m].max()) if co_m.any() else c0,
            )
        pend = np.flatnonzero(state != OpState.COMPLETED)
        blocked = None
        if len(pend) and rank not in self.spec.dead:
            j = int(pend[0])
            blocked = (GROUP_KINDS[int(kind[j])], "p2p" if p2p[j] else "collective",
                       int(p2p_seq[j] if p2p[j] else seq[j]))
        record_id = pre["records"] + np.arange(n, dtype=np.int64)
        keep = np.arange(n)
        if self.gloo:
            keep = keep[~p2p]
            record_id = pre["records"] + np.arange(len(keep), dtype=np.int64)
        dropped = pre["records"] + max(0, len(keep) - self.ring_size)
        keep = keep[-self.ring_size:]
        record_id = record_id[-self.ring_size:]
        return RankRecords(
            spec=sids[keep].astype(np.int32),
            record_id=record_id,
            seq=seq[keep],
            p2p_seq=p2p_seq[keep],
            op_id=op_id[keep],
            peer_seq=peer_seq[keep],
            state=state[keep],
            t_enqueue_ns=t_enq[keep],
            t_start_ns=t_start[keep],
            t_complete_ns=t_comp[keep],
            dropped=dropped,
            last_seq=last_seq,
            blocked=blocked,
        )

    def _prefix_nccl(self, stage: int) -> dict[str, Any]:
        """NCCL-mode counters of the steps not simulated: one seq per block."""
        key = -1 - stage
        hit = self._prefix_cache.get(key)
        if hit is not None:
            return hit
        cat = self.spec.cat
        nk = len(GROUP_KINDS)
        coll, p2p, ops = [0] * nk, [0] * nk, [0] * nk
        peer: dict[tuple[str, int], int] = {}
        records = 0
        for iid, n in self.spec.prefix_instrs[stage].items():
            ins = cat.instrs[iid]
            first = cat.specs[ins.ops[0]]
            k = GROUP_KINDS.index(first.group)
            is_p2p = any(cat.specs[o].is_p2p for o in ins.ops)
            if is_p2p:
                p2p[k] += n
            else:
                coll[k] += n
            if iid in self._fused:
                ops[k] += n
                records += n
            else:
                ops[k] += n * len(ins.ops)
                records += n * (len(ins.ops) + (1 if iid in self._closing else 0))
            for o in ins.ops:
                spec = cat.specs[o]
                if spec.is_p2p:
                    pk = (spec.op, spec.delta)
                    peer[pk] = peer.get(pk, 0) + n
        hit = self._prefix_cache[key] = {"coll": coll, "p2p": p2p, "ops": ops, "peer": peer,
                                         "records": records}
        return hit

    def _records_nccl(self, rank: int) -> RankRecords:
        """NCCL mode: entries as ProcessGroupNCCL records them (see docs/builder.md).

        A block (a ``batch_isend_irecv`` p2p batch, or a coalesced DP block) is its
        member entries, recorded without CUDA events (``scheduled``, never
        retired, no times), then the closing ``coalesced`` entry with the block's
        state; all share one ``collective_seq_id`` and one ``p2p_seq_id``, the
        closing entry repeats the last member's ``op_id`` and has ``is_p2p=False``.
        A fused block (``coalesce_dp="fused"``) is one ``*_coalesced`` entry.
        ``state`` follows the GPU (``started`` only with timing);
        ``time_discovered_*`` are when the watchdog retired the work, or the dump
        time for works not retired yet. ``last_seq`` holds ``pg_status``: the
        seq of the last enqueued/started/retired work, p2p works counting their
        p2p seq (``work.seq_``).
        """
        cat = self.spec.cat
        sim = self.sim
        assert sim.t_start is not None
        prog = self.spec.programs[rank]
        pre = self._prefix_nccl(int(self.layout.pp_rank[rank]))
        coll = list(pre["coll"])
        p2pc = list(pre["p2p"])
        opc = list(pre["ops"])
        peer = dict(pre["peer"])
        records = pre["records"]
        sids = sim.ops[rank].tolist()
        idx = sim.instr_index[rank].tolist()
        enq = sim.t_enqueue[rank].tolist()
        st = sim.t_start[rank].tolist()
        comp = sim.t_complete[rank].tolist()
        never_start = {pos for r_, pos in self.spec.hung if r_ == rank}
        timing = self.timing
        off = float(self.offsets_ms[rank])
        dump_ms = self.dump_time_ms(rank) - off
        # the watchdog polls every _WATCHDOG_MS with a per-rank phase: it retires a
        # completed work (and stamps its discovery times) at its next poll
        phase = ((rank * 40503) % 997) / 997.0 * _WATCHDOG_MS
        last_poll = math.floor((dump_ms - phase) / _WATCHDOG_MS) * _WATCHDOG_MS + phase

        def poll_after(t: float) -> float:
            return math.ceil((t - phase) / _WATCHDOG_MS) * _WATCHDOG_MS + phase

        c_spec: list[int] = []
        c_seq: list[int] = []
        c_p2p: list[int] = []
        c_op: list[int] = []
        c_peer: list[int] = []
        c_state: list[int] = []
        c_enq: list[float] = []
        c_start: list[float] = []  # discovered, ms (NaN = never)
        c_comp: list[float] = []
        c_block: list[int] = []
        c_retired: list[bool] = []
        c_dur: list[float] = []
        nk = len(GROUP_KINDS)
        # pg_status per group kind: seq of the last enqueued / started / retired work
        status = [[pre["coll"][k], -1 if not timing else pre["coll"][k], pre["coll"][k]] for k in range(nk)]
        touched = [bool(pre["coll"][k] or pre["p2p"][k]) for k in range(nk)]
        blocked: tuple[str, str, int] | None = None
        nan = math.nan
        j = 0
        n = len(sids)

        def row(spec: int, k: int, state: int, t_enq: float, t_s: float, t_c: float, block: int,
                retired: bool, dur: float) -> None:
            c_spec.append(spec)
            c_seq.append(coll[k])
            c_p2p.append(p2pc[k])
            c_op.append(opc[k])
            c_state.append(state)
            c_enq.append(t_enq)
            c_start.append(t_s)
            c_comp.append(t_c)
            c_block.append(block)
            c_retired.append(retired)
            c_dur.append(dur)

        while j < n:
            i = idx[j]
            end = j
            while end < n and idx[end] == i:
                end += 1
            ins_id = prog[i]
            ops = sids[j:end]
            first = cat.specs[ops[0]]
            k = GROUP_KINDS.index(first.group)
            is_p2p = any(cat.specs[o].is_p2p for o in ops)
            if is_p2p:
                p2pc[k] += 1
            else:
                coll[k] += 1
            work_seq = p2pc[k] if is_p2p else coll[k]
            t0 = enq[j]
            gpu_started = not math.isnan(st[j]) and i not in never_start
            done = not math.isnan(comp[j])
            started = gpu_started and timing
            state = OpState.COMPLETED if done else (OpState.STARTED if started else OpState.SCHEDULED)
            retired = done and poll_after(comp[j]) <= last_poll
            if done:
                d_comp = poll_after(comp[j]) if retired else dump_ms
                d_start = d_comp if timing else nan
            else:
                d_comp = nan
                d_start = dump_ms if started else nan
            dur = comp[j] - st[j] if (timing and retired) else nan
            closing = self._closing.get(ins_id)
            fused = self._fused.get(ins_id)
            if fused is not None:
                opc[k] += 1
                c_peer.append(NO_INDEX)
                row(fused, k, state, t0, d_start, d_comp, 0, retired, dur)
            else:
                for o in ops:
                    spec = cat.specs[o]
                    opc[k] += 1
                    if spec.is_p2p:
                        pk = (spec.op, spec.delta)
                        peer[pk] = peer.get(pk, 0) + 1
                        c_peer.append(peer[pk])
                    else:
                        c_peer.append(NO_INDEX)
                    if closing is None:
                        row(o, k, state, t0, d_start, d_comp, 0, retired, dur)
                    else:
                        row(o, k, OpState.SCHEDULED, t0, nan, nan, 1, False, nan)
                if closing is not None:
                    c_peer.append(NO_INDEX)
                    row(closing, k, state, t0 + 0.002, d_start, d_comp, 2, retired, dur)
            if blocked is None and not done and rank not in self.spec.dead:
                blocked = (first.group, "p2p" if is_p2p else "collective", work_seq)
            touched[k] = True
            status[k][0] = work_seq
            if started:
                status[k][1] = work_seq
            if retired:
                status[k][2] = work_seq
            j = end
        total = len(c_spec)
        keep = slice(max(0, total - self.ring_size), total)
        start_arr = np.asarray(c_start[keep])
        comp_arr = np.asarray(c_comp[keep])
        start_ns = self._ns(np.nan_to_num(start_arr + off, nan=0.0))
        comp_ns = self._ns(np.nan_to_num(comp_arr + off, nan=0.0))
        return RankRecords(
            spec=np.asarray(c_spec[keep], dtype=np.int32),
            record_id=records + np.arange(total, dtype=np.int64)[keep],
            seq=np.asarray(c_seq[keep], dtype=np.int64),
            p2p_seq=np.asarray(c_p2p[keep], dtype=np.int64),
            op_id=np.asarray(c_op[keep], dtype=np.int64),
            peer_seq=np.asarray(c_peer[keep], dtype=np.int64),
            state=np.asarray(c_state[keep], dtype=np.uint8),
            t_enqueue_ns=self._ns(np.asarray(c_enq[keep]) + off),
            t_start_ns=np.where(np.isnan(start_arr), 0, start_ns),
            t_complete_ns=np.where(np.isnan(comp_arr), 0, comp_ns),
            dropped=records + max(0, total - self.ring_size),
            last_seq={GROUP_KINDS[k]: (v[0], v[1], v[2]) for k, v in enumerate(status) if touched[k]},
            block=np.asarray(c_block[keep], dtype=np.uint8),
            retired=np.asarray(c_retired[keep], dtype=bool),
            blocked=blocked,
            duration_ms=np.asarray(c_dur[keep], dtype=np.float64),
        )

    def _ns(self, ms: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
        return self.t0_ns + np.rint(np.asarray(ms) * 1e6).astype(np.int64)

    # ------------------------------------------------------- per-rank facts
    def host(self, rank: int) -> str:
        """The rank's host name (8 GPUs per host)."""
        return f"node{rank // _GPUS_PER_HOST:04d}"

    def pid(self, rank: int) -> int:
        """The rank's process id (deterministic)."""
        return 4000 + (rank * 7919 + self.seed * 104729) % 60000

    def dump_time_ms(self, rank: int) -> float:
        """When ``rank`` dumped, in ms on its own clock (peers follow within ~0.2 s)."""
        spread = ((rank * 2654435761) % 1000) / 1000.0 * 200.0
        return float(self.dump_ms + spread + self.offsets_ms[rank])

    def dump_time_ns(self, rank: int) -> int:
        """When ``rank`` dumped, on its own clock (peers follow the first within ~0.2 s)."""
        return int(self._ns(np.array([self.dump_time_ms(rank)]))[0])

    def _pending_spec(self, rank: int) -> int | None:
        sim = self.sim
        if sim.finished[rank] or rank in self.spec.stuck or rank in self.spec.dead:
            return None
        comp = sim.t_complete[rank]
        pend = np.flatnonzero(np.isnan(comp))
        return int(sim.ops[rank][pend[0]]) if len(pend) else None

    def _first_watchdog(self) -> int | None:
        if self._watchdog_rank is not False:
            return self._watchdog_rank
        best: tuple[float, int] | None = None
        for r in range(self.world_size):
            comp = self.sim.t_complete[r]
            pend = np.flatnonzero(np.isnan(comp))
            if len(pend):
                t = float(self.sim.t_enqueue[r][pend[0]])
                if best is None or t < best[0]:
                    best = (t, r)
        self._watchdog_rank = None if best is None else best[1]
        return self._watchdog_rank

    def threads(self, rank: int) -> tuple[ThreadStack, ...]:
        """Thread stacks at dump time: where the rank's threads are stuck."""
        main_ident = 139_800_000_000_000 + rank * 4096
        watchdog = ThreadStack("frforensics-watchdog", main_ident + 1, False, _WATCHDOG)
        if rank in self.spec.stuck:
            return (ThreadStack("MainThread", main_ident, True, _STUCK[self.spec.stuck[rank]]), watchdog)
        sid = self._pending_spec(rank)
        if sid is None:
            return (ThreadStack("MainThread", main_ident, True, _IDLE), watchdog)
        frames, thread = SITES[self.spec.cat.specs[sid].site]
        if thread == "python":
            return (ThreadStack("MainThread", main_ident, True, frames), watchdog)
        return (
            ThreadStack("MainThread", main_ident, True, _BACKWARD_MAIN),
            ThreadStack(thread, main_ident + 2, False, frames),
            watchdog,
        )

    def _death_ms(self, rank: int) -> float:
        comp = self.sim.t_complete[rank]
        done = comp[~np.isnan(comp)]
        return (float(done.max()) if len(done) else 0.0) + 3.0

    # ---------------------------------------------------------------- traces
    def trace(self, rank: int) -> RankTrace:
        """``rank``'s dump in frforensics' own (recorder) form."""
        t = self.tables
        lay = self.layout
        rec = self.records(rank)
        kinds = [k for k in GROUP_KINDS if lay.gid_of[k][rank] >= 0]
        # our recorder on gloo (a real dump, tests/data/native_frontiers): its groups
        # say backend "gloo" and no op has a start time (gloo has no start event)
        backend = "gloo" if self.gloo else "nccl"
        groups = tuple(
            GroupInfo(g.name, g.desc, g.ranks, backend=backend)
            for g in (lay.groups[int(lay.gid_of[k][rank])] for k in kinds)
        )
        pg_of_kind = np.full(len(GROUP_KINDS), NO_INDEX, dtype=np.int32)
        for i, k in enumerate(kinds):
            pg_of_kind[GROUP_KINDS.index(k)] = i
        sids = rec.spec
        n = len(sids)
        stride = lay.tp * lay.dp
        p2p = t.is_p2p[sids]
        peer = np.where(p2p, rank + t.delta[sids] * stride, NO_INDEX).astype(np.int32)
        root = np.full(n, NO_INDEX, dtype=np.int32)
        has_root = t.root[sids] >= 0
        if has_root.any():
            for j in np.flatnonzero(has_root).tolist():
                spec = self.spec.cat.specs[int(sids[j])]
                root[j] = lay.groups[int(lay.gid_of[spec.group][rank])].ranks[spec.root]
        entries = EntryTable.from_columns(
            n,
            {
                "record_id": rec.record_id,
                "pg": pg_of_kind[t.kind[sids]],
                "seq": rec.seq,
                "p2p_seq": rec.p2p_seq,
                "peer_seq": rec.peer_seq,
                "op": t.op[sids],
                "is_p2p": p2p.astype(np.uint8),
                "peer": peer,
                "root": root,
                "in_numel": t.in_numel[sids],
                "out_numel": t.out_numel[sids],
                "in_shapes": t.in_shapes[sids],
                "out_shapes": t.out_shapes[sids],
                "in_dtypes": t.in_dtypes[sids],
                "out_dtypes": t.out_dtypes[sids],
                "reduce_op": t.reduce_op[sids],
                "state": rec.state,
                "t_enqueue_ns": rec.t_enqueue_ns,
                "t_start_ns": np.zeros_like(rec.t_start_ns) if self.gloo else rec.t_start_ns,
                "t_complete_ns": rec.t_complete_ns,
                "timeout_ms": np.full(n, self.timeout_ms, dtype=np.int64),
                "thread": t.thread[sids],
                "device": np.full(n, t.devices[rank % _GPUS_PER_HOST], dtype=np.int32),
                "stream": np.full(n, 7 + (rank % _GPUS_PER_HOST), dtype=np.int64),
                "stack": t.stack[sids],
            },
        )
        dead = rank in self.spec.dead
        first = self._first_watchdog()
        if dead:
            reason, detail = DumpReason.EXCEPTION, "uncaught exception in the training loop"
        elif first is None:
            reason, detail = DumpReason.API, "dump requested at the end of the job"
        elif rank == first:
            reason, detail = DumpReason.WATCHDOG_TIMEOUT, "op unfinished past the watchdog deadline"
        else:
            reason, detail = DumpReason.PEER_SIGNAL, f"rank {first} signalled a dump"
        dump_ns = (
            int(self._ns(np.array([self._death_ms(rank) + self.offsets_ms[rank]]))[0])
            if dead else self.dump_time_ns(rank)
        )
        stale = tuple(
            PeerHeartbeat(d, round((self.dump_ms - self._death_ms(d)) / 1000.0, 3))
            for d in sorted(self.spec.dead) if d != rank
        )
        death = None
        if dead:
            sid = self._pending_spec(rank)
            nxt = self.spec.programs[rank][-1] if self.spec.programs[rank] else None
            site = self.spec.cat.specs[self.spec.cat.instrs[nxt].ops[0]].site if nxt is not None else "barrier"
            del sid
            death = DeathInfo(
                "exception",
                "RuntimeError: CUDA error: an illegal memory access was encountered",
                SITES[site][0],
            )
        return RankTrace(
            rank=rank,
            header=DumpHeader(
                source=f"<synthetic rank {rank}>",
                format=SourceFormat.FRDUMP,
                version=str(frdump.VERSION),
                world_size=self.world_size,
                host=self.host(rank),
                pid=self.pid(rank),
                job_id=f"synthetic-{self.seed}",
                dump_reason=reason,
                dump_detail=detail,
                dump_time_ns=dump_ns,
                dump_monotonic_ns=dump_ns - self.t0_ns + 10_000_000_000,
                completion_resolution_ns=int(self.spec.poll_ms * 1e6),
                dropped=rec.dropped,
                threads=() if dead else self.threads(rank),
                stale_peers=() if dead else stale,
                death=death,
            ),
            groups=groups,
            strings=t.strings,
            stacks=t.stacks,
            entries=entries,
        )

    def traces(self, fmt: Literal["frdump", "pickle", "json"] = "frdump") -> dict[int, RankTrace]:
        """Every dumping rank's :class:`RankTrace`: the frdump form, or (``pickle``,
        ``json``) what decoding that rank's native dump file gives (native ranks only)."""
        if fmt == "frdump":
            return {r: self.trace(r) for r in self.dumping_ranks}
        from frforensics.formats import decode_dump

        return {r: decode_dump(self.native_bytes(r, fmt), source=f"nccl_trace_rank_{r}",
                               rank_hint=r) for r in self.native_ranks}

    # ---------------------------------------------------------------- native
    def native_doc(self, rank: int) -> dict[str, Any]:
        """``rank``'s native flight-recorder document (what PyTorch pickles)."""
        t = self.tables
        lay = self.layout
        cat = self.spec.cat
        rec = self.records(rank)
        backend = "gloo" if self.gloo else "nccl"
        kinds = [k for k in GROUP_KINDS if lay.gid_of[k][rank] >= 0]
        pg_id_of = {k: i for i, k in enumerate(kinds)}
        groups = {k: lay.groups[int(lay.gid_of[k][rank])] for k in kinds}
        stage = int(lay.pp_rank[rank])
        tid_main = str(139_800_000_000_000 + rank * 4096)
        tid_bwd = str(139_800_000_000_000 + rank * 4096 + 2)
        names: dict[int, str] = {}

        def profiling(sid: int) -> str:
            p = names.get(sid)
            if p is None:
                spec = cat.specs[sid]
                if spec.op == "send":
                    p = f"{backend}:send {stage}->{stage + spec.delta}"
                elif spec.op == "recv":
                    p = f"{backend}:recv {stage}<-{stage + spec.delta}"
                elif self.gloo:
                    p = f"gloo:{_GLOO_NAMES[spec.op]}"
                else:
                    p = f"nccl:{WIRE_NAMES[spec.op]}"
                names[sid] = p
            return p

        pg_tuple = {k: (g.name, g.desc) for k, g in groups.items()}
        entries = []
        states = rec.state.tolist()
        retired_col = rec.retired.tolist() if rec.retired is not None else None
        durations = rec.duration_ms.tolist() if rec.duration_ms is not None else None
        for i, sid in enumerate(rec.spec.tolist()):
            spec = cat.specs[sid]
            st = states[i]
            done = st == OpState.COMPLETED
            thread = SITES[spec.site][1]
            if self.gloo:
                state_name, t_s, t_c = "scheduled", None, None
            elif retired_col is not None:
                # NCCL mode: discovery times are their own columns (0 = never discovered)
                state_name = _STATE_NAMES[OpState(st)]
                t_s = int(rec.t_start_ns[i]) or None
                t_c = int(rec.t_complete_ns[i]) or None
                done = retired_col[i]
            else:
                state_name = _STATE_NAMES[OpState(st)]
                t_s = int(rec.t_start_ns[i]) if st != OpState.SCHEDULED else None
                t_c = int(rec.t_complete_ns[i]) if done else None
            entries.append(
                {
                    "frames": list(t.native_frames[sid]),
                    "record_id": int(rec.record_id[i]),
                    "pg_id": pg_id_of[spec.group],
                    "process_group": pg_tuple[spec.group],
                    "thread_name": "python" if thread == "python" else thread,
                    "thread_id": tid_main if thread == "python" else tid_bwd,
                    "collective_seq_id": int(rec.seq[i]),
                    "p2p_seq_id": 0 if self.gloo else int(rec.p2p_seq[i]),
                    "op_id": int(rec.op_id[i]),
                    "profiling_name": profiling(sid),
                    "time_created_ns": int(rec.t_enqueue_ns[i]),
                    **({} if durations is None or math.isnan(durations[i])
                       else {"duration_ms": round(durations[i], 6)}),
                    "input_sizes": [list(s) for s in spec.in_sizes],
                    "input_dtypes": list(spec.in_dtypes),
                    "output_sizes": [list(s) for s in spec.out_sizes],
                    "output_dtypes": list(spec.out_dtypes),
                    "state": state_name,
                    "time_discovered_started_ns": t_s,
                    "time_discovered_completed_ns": t_c,
                    "retired": done,
                    "timeout_ms": self.timeout_ms,
                    "is_p2p": spec.is_p2p,
                }
            )
        if self.gloo:
            pg_config: dict[str, dict[str, str]] = {"": {"name": "", "desc": "", "ranks": "[]"}}
        else:
            pg_config = {g.name: {"name": g.name, "desc": g.desc, "ranks": str(list(g.ranks))}
                         for g in groups.values()}
        pg_status = {
            str(pg_id_of[k]): {
                "last_enqueued_collective": v[0],
                "last_started_collective": -1 if self.gloo else v[1],
                "last_completed_collective": v[2],
            }
            for k, v in rec.last_seq.items()
        }
        return {
            "version": "2.10",
            "pg_config": pg_config,
            "comm_lib_version": "" if self.gloo else "2.27.5",
            "pg_status": pg_status,
            "entries": entries,
        }

    def native_docs(self) -> dict[int, dict[str, Any]]:
        """Every live rank's native document."""
        return {r: self.native_doc(r) for r in self.native_ranks}

    @staticmethod
    def native_json(doc: dict[str, Any]) -> bytes:
        """A native document as ``_dump_fr_trace_json`` writes it (no frames, sorted keys)."""
        out: dict[str, Any] = {k: v for k, v in doc.items() if k != "entries"}
        out["nccl_comm_state"] = {}
        out["pg_status"] = {k: {a: str(b) for a, b in v.items()} for k, v in doc["pg_status"].items()}
        entries = []
        for e in doc["entries"]:
            e2 = {k: v for k, v in e.items() if k != "frames"}
            e2["process_group"] = list(e["process_group"])
            for key in ("time_discovered_started_ns", "time_discovered_completed_ns"):
                if e2[key] is None:
                    e2[key] = 0
            entries.append(e2)
        if entries:
            out["entries"] = entries
        return json.dumps(out, sort_keys=True, separators=(", ", ": ")).encode()

    def native_bytes(self, rank: int, fmt: Literal["pickle", "json"] = "pickle") -> bytes:
        """``rank``'s native dump file content."""
        doc = self.native_doc(rank)
        if fmt == "json":
            return self.native_json(doc)
        return pickle.dumps(doc, protocol=2)

    # --------------------------------------------------------------- writing
    def write_native(
        self,
        directory: str | os.PathLike[str],
        *,
        fmt: Literal["pickle", "json"] = "pickle",
        prefix: str = "nccl_trace_rank_",
        jobs: int | None = None,
    ) -> list[Path]:
        """Write one native dump per live rank (``<prefix><rank>``), in parallel."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        ranks = self.native_ranks
        return self._parallel(ranks, ("native", str(out), fmt, prefix), jobs)

    def write_frdump(
        self, directory: str | os.PathLike[str], *, prefix: str = "frdump_rank_", jobs: int | None = None
    ) -> list[Path]:
        """Write one frdump per dumping rank (``frdump_rank_<rank>``), atomically, in parallel."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        return self._parallel(self.dumping_ranks, ("frdump", str(out), "", prefix), jobs)

    def _parallel(self, ranks: list[int], task: tuple[str, str, str, str], jobs: int | None) -> list[Path]:
        jobs = jobs or min(len(os.sched_getaffinity(0)), 16)
        _ = self.tables  # build once, before forking
        if jobs <= 1 or len(ranks) < 16 or "fork" not in multiprocessing.get_all_start_methods():
            return [_write_one(self, r, task) for r in ranks]
        global _SHARED
        _SHARED = self
        chunks = [ranks[i::jobs] for i in range(jobs)]
        ctx = multiprocessing.get_context("fork")
        try:
            with ctx.Pool(jobs) as pool:
                parts = pool.starmap(_write_chunk, [(c, task) for c in chunks])
        finally:
            _SHARED = None
        return sorted((Path(p) for part in parts for p in part), key=lambda p: p.name)


_SHARED: JobDumps | None = None


def _write_one(dumps: JobDumps, rank: int, task: tuple[str, str, str, str]) -> Path:
    what, directory, fmt, prefix = task
    path = Path(directory) / f"{prefix}{rank}"
    if what == "native":
        data = dumps.native_bytes(rank, "json" if fmt == "json" else "pickle")
        path.write_bytes(data)
        return path
    return frdump.write_atomic(path, frdump.encode(dumps.trace(rank)))


def _write_chunk(ranks: list[int], task: tuple[str, str, str, str]) -> list[str]:
    dumps = _SHARED
    if dumps is None:  # pragma: no cover - only reached if fork did not carry the global
        raise RuntimeError("no job to write")
    gc.disable()  # many short-lived dicts, no cycles: skip the collector's rescans
    return [str(_write_one(dumps, r, task)) for r in ranks]
