"""Discrete-event simulation of every rank's program, until no rank can progress.

The rules (the heart of the dump factory):

- Each rank runs its program, a list of instructions; an instruction is one
  collective, one coalesced block of collectives of one group (one seq for the
  block), or one batch of p2p ops posted together (``isend``/``irecv`` then wait
  on all). A rank's GPU starts its next instruction only when the current one
  has completed (the caller stream waits for each op's result).
- Enqueue time = when the rank got free + the compute before the op + jitter +
  straggler delay.
- A collective on group G with per-group number ``s`` completes when every member
  has posted its ``s``-th collective on G, all with the same op, sizes, dtypes and
  root; then it completes on every member at ``max(enqueue) + duration``. A
  mismatch never completes; neither does a collective one of whose members is
  "hung in the op" (its kernel never starts).
- A p2p op completes when the k-th send A→B meets the k-th recv at B from A, at
  ``max(both enqueues) + duration``; a batch completes when all its ops have.
- The run ends when no rank can progress: blocked ranks keep their pending
  instruction (posted, not completed) and never post anything later.
- ``kernel_hung`` ops complete on every member but the hung rank, whose kernel
  started and never finishes (its peers move on).
- NCCL mode (``run_ahead`` given): the times above are the GPU's (``t_start``);
  the CPU enqueues instruction ``i`` once the GPU finished instruction ``i - k``
  (``k`` = the rank's run-ahead depth), so ``t_enqueue <= t_start``, and a rank
  whose GPU is blocked at instruction ``pc`` has also enqueued ``pc+1 .. pc+k-1``:
  those ops are appended as *queued* (never started).

Timing is pure dataflow (maxima and sums), so the order in which ready ranks are
processed does not change any time: the result is deterministic.
"""

from __future__ import annotations

import gc
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from frforensics.testing.layout import GROUP_KINDS, Layout
from frforensics.testing.schedule import Catalog

__all__ = ["SimResult", "simulate"]

_KIND_INDEX = {k: i for i, k in enumerate(GROUP_KINDS)}


@dataclass
class SimResult:
    """What every rank posted, with times in ms since the job's start (NaN = never)."""

    ops: list[npt.NDArray[np.int32]]  # per rank: catalog spec id of each posted op
    instr_index: list[npt.NDArray[np.int32]]  # per rank: program index of each posted op
    t_enqueue: list[npt.NDArray[np.float64]]  # CPU enqueue (= GPU start outside NCCL mode)
    t_complete: list[npt.NDArray[np.float64]]
    finished: npt.NDArray[np.bool_]  # ran its whole program
    pc: npt.NDArray[np.int64]  # program index of the pending instruction (or len)
    # unfinished collectives: (gid, seq) -> [(rank, op index on that rank, spec id)]
    pending_collectives: dict[tuple[int, int], list[tuple[int, int, int]]] = field(default_factory=dict)
    # unmatched p2p ops: (src, dst, "send"|"recv") -> [(rank, op index)]
    pending_p2p: dict[tuple[int, int, str], list[tuple[int, int]]] = field(default_factory=dict)
    last_event_ms: float = 0.0
    # NCCL mode: GPU start per op (NaN = the GPU never reached it); None otherwise
    t_start: list[npt.NDArray[np.float64]] | None = None
    # NCCL mode: per rank, index of the first queued (run-ahead, never started) op
    queued_from: npt.NDArray[np.int64] | None = None


def simulate(
    layout: Layout,
    cat: Catalog,
    programs: list[list[int]],
    *,
    start_ms: npt.NDArray[np.float64],
    start_counts: npt.NDArray[np.int64],
    jitter: list[list[float]],
    delay_from: dict[int, tuple[int, float]],
    hung: set[tuple[int, int]],
    kernel_hung: set[tuple[int, int]] | None = None,
    delayed: dict[int, set[int]] | None = None,
    run_ahead: list[int] | None = None,
    duration_sigma: float = 0.0,
    noise_seed: int = 0,
) -> SimResult:
    """Run ``programs`` (instruction ids per rank) to the end or to a standstill.

    ``start_counts[r, k]`` is rank ``r``'s collective count on group kind ``k``
    before the first simulated instruction (steps not simulated); ``jitter[r][i]``
    is added to instruction ``i``'s enqueue time; ``delay_from[r] = (i0, ms)``
    delays every instruction ``>= i0`` (only those in ``delayed[r]``, if given); ``hung`` holds ``(rank, instr index)``
    whose op never starts on that rank; ``kernel_hung`` holds ``(rank, instr
    index)`` whose kernel starts and never finishes while its peers complete;
    ``run_ahead[r]`` (NCCL mode) is rank ``r``'s CPU run-ahead depth (>= 1);
    ``duration_sigma`` scales each op's duration by ``exp(N(0, sigma))``, drawn per
    collective (group, seq) and per p2p pair, the same on every member.
    """
    # Millions of small tuples and lists: the cyclic GC would rescan them all on
    # every collection (quadratic); nothing here makes reference cycles.
    enabled = gc.isenabled()
    gc.disable()
    try:
        sim = _simulate(layout, cat, programs, start_ms=start_ms, start_counts=start_counts,
                        jitter=jitter, delay_from=delay_from, hung=hung,
                        kernel_hung=kernel_hung or set(), delayed=delayed,
                        scale=_duration_scales(duration_sigma, noise_seed))
        if run_ahead is not None:
            _run_ahead(sim, cat, programs, start_ms=start_ms, depth=run_ahead, delay_from=delay_from,
                       delayed=delayed)
        return sim
    finally:
        if enabled:
            gc.enable()


def _simulate(
    layout: Layout,
    cat: Catalog,
    programs: list[list[int]],
    *,
    start_ms: npt.NDArray[np.float64],
    start_counts: npt.NDArray[np.int64],
    jitter: list[list[float]],
    delay_from: dict[int, tuple[int, float]],
    hung: set[tuple[int, int]],
    kernel_hung: set[tuple[int, int]],
    delayed: dict[int, set[int]] | None,
    scale: list[float] | None = None,
) -> SimResult:
    """The simulation proper (see :func:`simulate`)."""
    ws = layout.world_size
    specs = cat.specs
    instrs = cat.instrs
    kind_of = [_KIND_INDEX[s.group] for s in specs]
    dur_of = [s.duration_ms for s in specs]
    sig_of = [s.signature for s in specs]
    coll_instr = [not any(specs[o].is_p2p for o in ins.ops) for ins in instrs]
    isig_of = [tuple(sig_of[o] for o in ins.ops) for ins in instrs]
    send_of = [s.op == "send" for s in specs]
    delta_of = [s.delta for s in specs]
    gid_of = [layout.gid_of[k].tolist() for k in GROUP_KINDS]
    gsize = [len(g.ranks) for g in layout.groups]
    stride = layout.tp * layout.dp

    ops: list[list[int]] = [[] for _ in range(ws)]
    ins_idx: list[list[int]] = [[] for _ in range(ws)]
    enq: list[list[float]] = [[] for _ in range(ws)]
    comp: list[list[float]] = [[] for _ in range(ws)]
    now = start_ms.astype(float).tolist()
    pc = [0] * ws
    counts = start_counts.astype(np.int64).tolist()
    outstanding = [0] * ws
    batch_end = [0.0] * ws
    colls: dict[tuple[int, int], list[tuple[int, int, float, int]]] = {}
    sends: dict[tuple[int, int], deque[tuple[int, int, float, int]]] = {}
    recvs: dict[tuple[int, int], deque[tuple[int, int, float, int]]] = {}
    nan = math.nan
    ready = list(range(ws - 1, -1, -1))
    last_event = 0.0
    hung_kernels: dict[tuple[int, int], list[tuple[int, int, int]]] = {}

    def finish_p2p(rank: int, tc: float) -> None:
        outstanding[rank] -= 1
        if tc > batch_end[rank]:
            batch_end[rank] = tc
        if outstanding[rank] == 0:
            now[rank] = batch_end[rank]
            pc[rank] += 1
            ready.append(rank)

    while ready:
        r = ready.pop()
        prog = programs[r]
        i = pc[r]
        if i >= len(prog):
            continue
        ins = instrs[prog[i]]
        t = now[r] + ins.compute_ms + jitter[r][i]
        d = delay_from.get(r)
        if d is not None and i >= d[0] and (delayed is None or r not in delayed or i in delayed[r]):
            t += d[1]
        if t > last_event:
            last_event = t
        base = len(ops[r])
        if coll_instr[prog[i]]:
            # one collective, or one coalesced block of one group's collectives
            sid = ins.ops[0]
            k = kind_of[sid]
            gid = gid_of[k][r]
            counts[r][k] += 1
            key = (gid, counts[r][k])
            for o in ins.ops:
                ops[r].append(o)
                ins_idx[r].append(i)
                enq[r].append(t)
                comp[r].append(nan)
            members = colls.get(key)
            if members is None:
                members = colls[key] = []
            members.append((r, base, t, i))
            if len(members) == gsize[gid]:
                sig = isig_of[prog[i]]
                ok = all(isig_of[programs[m][mi_]] == sig for m, _, _, mi_ in members)
                if ok and not any((m, mi_) in hung for m, _, _, mi_ in members):
                    tc = max(x[2] for x in members) + max(dur_of[o] for o in ins.ops) * (
                        1.0 if scale is None else scale[(gid * 7919 + key[1]) % _SCALES])
                    if tc > last_event:
                        last_event = tc
                    stalled = []
                    for m, mi, _, mi_ in members:
                        if (m, mi_) in kernel_hung:
                            stalled.append((m, mi, ops[m][mi]))
                            continue
                        for j in range(len(ins.ops)):
                            comp[m][mi + j] = tc
                        now[m] = tc
                        pc[m] += 1
                        ready.append(m)
                    del colls[key]
                    if stalled:
                        colls[key] = [(m, mi, 0.0, -1) for m, mi, _ in stalled]
                        hung_kernels[key] = stalled
            continue
        # a batch of p2p ops, posted together
        outstanding[r] = len(ins.ops)
        batch_end[r] = t
        for j, sid in enumerate(ins.ops):
            peer = r + delta_of[sid] * stride
            ops[r].append(sid)
            ins_idx[r].append(i)
            enq[r].append(t)
            comp[r].append(nan)
            me = (r, base + j, t, sid)
            if send_of[sid]:
                ch = (r, peer)
                q = recvs.get(ch)
                if q:
                    other = q.popleft()
                else:
                    sends.setdefault(ch, deque()).append(me)
                    continue
            else:
                ch = (peer, r)
                q = sends.get(ch)
                if q:
                    other = q.popleft()
                else:
                    recvs.setdefault(ch, deque()).append(me)
                    continue
            f = 1.0
            if scale is not None:  # keyed by the sending rank and its op index
                src_at = (r, base + j) if send_of[sid] else (other[0], other[1])
                f = scale[(src_at[0] * 104729 + src_at[1]) % _SCALES]
            tc = max(t, other[2]) + dur_of[sid] * f
            if tc > last_event:
                last_event = tc
            comp[r][base + j] = tc
            comp[other[0]][other[1]] = tc
            finish_p2p(other[0], tc)
            finish_p2p(r, tc)

    pending_p2p: dict[tuple[int, int, str], list[tuple[int, int]]] = {}
    for (src, dst), q in sends.items():
        if q:
            pending_p2p[(src, dst, "send")] = [(x[0], x[1]) for x in q]
    for (src, dst), q in recvs.items():
        if q:
            pending_p2p[(src, dst, "recv")] = [(x[0], x[1]) for x in q]
    return SimResult(
        ops=[np.asarray(o, dtype=np.int32) for o in ops],
        instr_index=[np.asarray(o, dtype=np.int32) for o in ins_idx],
        t_enqueue=[np.asarray(o, dtype=np.float64) for o in enq],
        t_complete=[np.asarray(o, dtype=np.float64) for o in comp],
        finished=np.asarray([pc[r] >= len(programs[r]) for r in range(ws)], dtype=bool),
        pc=np.asarray(pc, dtype=np.int64),
        pending_collectives={
            k: hung_kernels.get(k) or [(m, mi, ops[m][mi]) for m, mi, _, _ in v] for k, v in colls.items()
        },
        pending_p2p=pending_p2p,
        last_event_ms=last_event,
    )


#: Distinct duration scales (drawn once per job; each op picks one by a hash of
#: where it is, so the scale never depends on the order ranks are simulated in).
_SCALES = 65521


def _duration_scales(sigma: float, seed: int) -> list[float] | None:
    if sigma <= 0:
        return None
    out: list[float] = np.exp(np.random.default_rng([seed, 29]).normal(0.0, sigma, _SCALES)).tolist()
    return out


def _run_ahead(
    sim: SimResult, cat: Catalog, programs: list[list[int]], *, start_ms: npt.NDArray[np.float64],
    depth: list[int], delay_from: dict[int, tuple[int, float]], delayed: dict[int, set[int]] | None,
) -> None:
    """Turn GPU times into NCCL-mode CPU enqueue times and append the queued ops.

    The CPU enqueues instruction ``i`` a little after instruction ``i - 1``
    (``_CPU_MS``) but not before the GPU completed instruction ``i - k``; never
    after the GPU started it. A blocked rank's CPU has enqueued ``k - 1``
    instructions past the one its GPU is blocked in: those ops are queued. A
    straggler's delay is its CPU's (slow Python, data loading): the GPU waited
    for the CPU, so a delayed instruction is enqueued just before it starts.
    """
    instrs = cat.instrs
    sim.t_start = []
    queued_from = np.zeros(len(programs), dtype=np.int64)
    for r, prog in enumerate(programs):
        k = max(1, depth[r])
        start = sim.t_enqueue[r]
        comp = sim.t_complete[r]
        idx = sim.instr_index[r]
        ops = sim.ops[r].tolist()
        idx_l = idx.tolist()
        # per instruction: GPU start and completion (NaN = never)
        n_ins = int(sim.pc[r]) + (0 if sim.finished[r] else 1)
        ins_start = [math.nan] * n_ins
        ins_comp = [math.nan] * n_ins
        for j, i in enumerate(idx_l):
            ins_start[i] = float(start[j])
            if not math.isnan(comp[j]):
                ins_comp[i] = float(comp[j])
        last = n_ins if sim.finished[r] else min(len(prog), n_ins - 1 + k)
        cpu = [0.0] * last
        prev = float(start_ms[r])
        slow = delay_from.get(r)
        for i in range(last):
            t = prev + _CPU_MS
            if i - k >= 0:
                t = max(t, ins_comp[i - k])
            if i < n_ins and not math.isnan(ins_start[i]):
                if slow is not None and i >= slow[0] and (delayed is None or r not in delayed or i in delayed[r]):
                    t = ins_start[i]  # the CPU was the bottleneck
                t = min(t, ins_start[i] - _LAUNCH_MS)
            cpu[i] = t
            prev = t
        extra_ops: list[int] = []
        extra_idx: list[int] = []
        for i in range(n_ins, last):
            for o in instrs[prog[i]].ops:
                extra_ops.append(o)
                extra_idx.append(i)
        queued_from[r] = len(ops)
        sim.t_start.append(np.concatenate([start, np.full(len(extra_ops), math.nan)]))
        sim.t_enqueue[r] = np.asarray([cpu[i] for i in idx_l + extra_idx], dtype=np.float64)
        sim.t_complete[r] = np.concatenate([comp, np.full(len(extra_ops), math.nan)])
        sim.ops[r] = np.asarray(ops + extra_ops, dtype=np.int32)
        sim.instr_index[r] = np.asarray(idx_l + extra_idx, dtype=np.int32)
    sim.queued_from = queued_from


#: CPU time to enqueue one op, and the launch gap between enqueue and GPU start (ms).
_CPU_MS = 0.04
_LAUNCH_MS = 0.012
