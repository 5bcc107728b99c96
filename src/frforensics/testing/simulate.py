"""Discrete-event simulation of every rank's program, until no rank can progress.

The rules (the heart of the dump factory):

- Each rank runs its program, a list of instructions; an instruction is one
  collective or one batch of p2p ops posted together (``isend``/``irecv`` then
  wait on all). A rank posts its next instruction only when the current one has
  completed.
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
    t_enqueue: list[npt.NDArray[np.float64]]
    t_complete: list[npt.NDArray[np.float64]]
    finished: npt.NDArray[np.bool_]  # ran its whole program
    pc: npt.NDArray[np.int64]  # program index of the pending instruction (or len)
    # unfinished collectives: (gid, seq) -> [(rank, op index on that rank, spec id)]
    pending_collectives: dict[tuple[int, int], list[tuple[int, int, int]]] = field(default_factory=dict)
    # unmatched p2p ops: (src, dst, "send"|"recv") -> [(rank, op index)]
    pending_p2p: dict[tuple[int, int, str], list[tuple[int, int]]] = field(default_factory=dict)
    last_event_ms: float = 0.0


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
) -> SimResult:
    """Run ``programs`` (instruction ids per rank) to the end or to a standstill.

    ``start_counts[r, k]`` is rank ``r``'s collective count on group kind ``k``
    before the first simulated instruction (steps not simulated); ``jitter[r][i]``
    is added to instruction ``i``'s enqueue time; ``delay_from[r] = (i0, ms)``
    delays every instruction ``>= i0``; ``hung`` holds ``(rank, instr index)``
    whose op never starts on that rank.
    """
    # Millions of small tuples and lists: the cyclic GC would rescan them all on
    # every collection (quadratic); nothing here makes reference cycles.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _simulate(layout, cat, programs, start_ms=start_ms, start_counts=start_counts,
                         jitter=jitter, delay_from=delay_from, hung=hung)
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
) -> SimResult:
    """The simulation proper (see :func:`simulate`)."""
    ws = layout.world_size
    specs = cat.specs
    instrs = cat.instrs
    kind_of = [_KIND_INDEX[s.group] for s in specs]
    dur_of = [s.duration_ms for s in specs]
    sig_of = [s.signature for s in specs]
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
        if d is not None and i >= d[0]:
            t += d[1]
        if t > last_event:
            last_event = t
        base = len(ops[r])
        if len(ins.ops) == 1 and not specs[ins.ops[0]].is_p2p:
            sid = ins.ops[0]
            k = kind_of[sid]
            gid = gid_of[k][r]
            counts[r][k] += 1
            key = (gid, counts[r][k])
            ops[r].append(sid)
            ins_idx[r].append(i)
            enq[r].append(t)
            comp[r].append(nan)
            members = colls.get(key)
            if members is None:
                members = colls[key] = []
            members.append((r, base, t, i))
            if len(members) == gsize[gid]:
                sig = sig_of[sid]
                ok = all(sig_of[ops[m][mi]] == sig for m, mi, _, _ in members)
                if ok and not any((m, mi_) in hung for m, _, _, mi_ in members):
                    tc = max(x[2] for x in members) + dur_of[sid]
                    if tc > last_event:
                        last_event = tc
                    for m, mi, _, _ in members:
                        comp[m][mi] = tc
                        now[m] = tc
                        pc[m] += 1
                        ready.append(m)
                    del colls[key]
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
            tc = max(t, other[2]) + dur_of[sid]
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
        pending_collectives={k: [(m, mi, ops[m][mi]) for m, mi, _, _ in v] for k, v in colls.items()},
        pending_p2p=pending_p2p,
        last_event_ms=last_event,
    )
