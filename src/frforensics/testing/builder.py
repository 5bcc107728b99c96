"""``JobBuilder``: a fluent scenario builder for synthetic per-rank dump sets.

::

    job = (JobBuilder(world_size=64, tp=8, pp=4, dp=2, ring_size=2000, seed=0)
           .steps(40)
           .skip(rank=13, group="tp", step=38)
           .clock_offset(rank=3, ms=250)
           .jitter(ms=0.5))
    dumps = job.build()          # -> JobDumps (see frforensics.testing.dumps)
    dumps.expected               # the verdict stated by the scenario

Faults are planted in the ranks' programs; the simulation (see ``simulate``)
decides where every rank ends up; ``expected`` is derived from what was planted
plus the simulated end state (who posted what), never from an analyzer.

Only the steps that can reach the dumps are simulated event by event: steps
wholly evicted from every ring before the first fault are skipped, and their
counters (record ids, sequence numbers, per-peer p2p numbers) are added
analytically from the per-stage step program.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Literal

import numpy as np

from frforensics.testing.expected import Expected, ExpectedGroup
from frforensics.testing.layout import GROUP_KINDS, GroupSpec, Layout
from frforensics.testing.schedule import (
    Catalog,
    OpSpec,
    ScheduleConfig,
    barrier_instr,
    build_stage_step,
)
from frforensics.testing.simulate import SimResult, simulate

if TYPE_CHECKING:
    from frforensics.testing.dumps import JobDumps

__all__ = ["Fault", "JobBuilder", "Noise"]

_KIND_INDEX = {k: i for i, k in enumerate(GROUP_KINDS)}
_MISMATCH_KINDS = ("op_mismatch", "size_mismatch", "dtype_mismatch")


@dataclass(frozen=True, slots=True)
class Fault:
    """One planted fault (see the ``JobBuilder`` method of the same name)."""

    kind: str
    ranks: tuple[int, ...]
    step: int
    group: str = ""
    index: int = 0
    delay_ms: float = 0.0
    leaves_dump: bool = False
    groups: tuple[str, ...] = ()
    where: str = "python"
    after: int = 0


@dataclass(frozen=True, slots=True)
class Noise:
    """Everyday noise of a healthy job (``JobBuilder.noise``), each kind from what is
    measured on real clusters (docs/builder.md, "Noise"):

    * ``spiky_ranks`` ranks (drawn from the seed) are late by ``spike_ms`` (uniform)
      before ``spike_rate`` of their ops, at random: OS noise (a daemon, a page
      fault storm, Python's GC) delays one process now and then, never the same op
      of every step;
    * every collective's and p2p op's duration is scaled by ``exp(N(0,
      duration_sigma))``, the same on all members (a collective ends together):
      network contention makes the same all-reduce take 5-20 % longer or shorter;
    * each host (``host_size`` ranks) has its clock off by ``uniform(-ntp_ms,
      ntp_ms)``: NTP (chrony) keeps hosts of one LAN within about a millisecond.
    """

    spiky_ranks: int = 3
    spike_rate: float = 0.05
    spike_ms: tuple[float, float] = (2.0, 5.0)
    duration_sigma: float = 0.1
    ntp_ms: float = 1.0


@dataclass
class _Plan:
    """Programs and bookkeeping handed from the builder to the simulation."""

    layout: Layout
    cat: Catalog
    cfg: ScheduleConfig
    first_step: int
    programs: list[list[int]]
    step_starts: list[list[int]]  # per rank: program index where each simulated step starts
    prefix: list[Counter[int]]  # per stage: spec-id counts of the steps not simulated
    hung: set[tuple[int, int]] = field(default_factory=set)
    kernel_hung: set[tuple[int, int]] = field(default_factory=set)
    delayed: dict[int, set[int]] = field(default_factory=dict)  # straggler(every="step"): delayed instrs
    # per stage: instruction-id counts of the steps not simulated (NCCL mode counters)
    prefix_instrs: list[Counter[int]] = field(default_factory=list)
    delay_from: dict[int, tuple[int, float]] = field(default_factory=dict)
    # straggler(every="random"): rank -> (first delayed instr, largest delay in ms)
    random_delay: dict[int, tuple[int, float]] = field(default_factory=dict)
    dead: dict[int, bool] = field(default_factory=dict)  # rank -> leaves a dump
    stuck: dict[int, str] = field(default_factory=dict)  # rank -> where


@dataclass(frozen=True, slots=True)
class JobSpec:
    """A built job as the builder hands it to :class:`~frforensics.testing.JobDumps`:
    the options that shape its records and the planned programs, fixed once the
    faults are applied (the dumps read nothing else of the builder).

    ``cat`` is the plan's op catalog (NCCL mode adds the closing and fused
    entries' specs to it while rendering); ``programs[r]`` rank ``r``'s
    instruction ids; ``prefix[stage]`` / ``prefix_instrs[stage]`` the spec /
    instruction counts of the steps not simulated; ``hung`` the (rank, program
    position) pairs that never complete; ``dead`` rank -> whether it leaves a
    dump; ``stuck`` rank -> where its main thread is stuck.
    """

    layout: Layout
    seed: int
    ring_size: int
    gloo: bool
    #: NCCL mode (entries as ProcessGroupNCCL records them)
    nccl: bool
    #: NCCL mode, how DP gradient buckets are recorded ("members", "fused", ...)
    dp_style: str
    timing: bool
    timeout_ms: int
    start_time_ns: int
    #: the recorder's completion polling period (0: exact completion times)
    poll_ms: float
    faults: tuple[Fault, ...]
    cat: Catalog
    programs: tuple[tuple[int, ...], ...]
    prefix: tuple[Mapping[int, int], ...]
    prefix_instrs: tuple[Mapping[int, int], ...]
    hung: frozenset[tuple[int, int]]
    dead: Mapping[int, bool]
    stuck: Mapping[int, str]


class JobBuilder:
    """Describe a distributed training job and its faults, then ``build()`` its dumps.

    Ranks are laid out TP-major like Megatron (see :mod:`frforensics.testing.layout`):
    ``tp_rank = r % tp``, ``dp_rank = (r // tp) % dp``, ``pp_rank = r // (tp*dp)``.
    """

    def __init__(
        self,
        world_size: int | None = None,
        *,
        tp: int = 1,
        pp: int = 1,
        dp: int | None = None,
        ring_size: int = 2000,
        seed: int = 0,
    ) -> None:
        if dp is None:
            if world_size is None or world_size % (tp * pp):
                raise ValueError("give dp, or a world_size divisible by tp * pp")
            dp = world_size // (tp * pp)
        if world_size is not None and world_size != tp * dp * pp:
            raise ValueError(f"world_size {world_size} != tp*dp*pp = {tp * dp * pp}")
        if ring_size < 1:
            raise ValueError("ring_size must be positive")
        self.layout = Layout(tp=tp, dp=dp, pp=pp)
        self.ring_size = ring_size
        self.seed = seed
        self._steps = 10
        self._faults: list[Fault] = []
        self._offsets: dict[int, float] = {}
        self._jitter_ms = 0.0
        self._noise: Noise | None = None
        self._cfg = ScheduleConfig()
        self._barrier = True
        self._timeout_ms = 600_000
        self._dump_delay_s = 5.0
        self._poll_ms = 0.0
        self._gloo = False
        self._nccl: tuple[int, int] | None = None  # NCCL mode: run-ahead depth range
        self._coalesce_dp = False
        self._dp_style = "members"
        self._timing = False
        self.run_ahead: list[int] | None = None  # NCCL mode: each rank's depth, set by build()
        self._host_size = 8
        self._start_time_ns = 1_767_225_600_000_000_000 + seed * 1_000_000_000  # 2026-01-01
        self._cat = Catalog()

    # ------------------------------------------------------------ job shape
    def steps(self, n: int) -> JobBuilder:
        """Train for ``n`` steps (the job ends after them unless a fault hangs it)."""
        if n < 1:
            raise ValueError("steps must be at least 1")
        self._steps = n
        return self

    def schedule(self, **options: object) -> JobBuilder:
        """Change the model/step shape (fields of :class:`ScheduleConfig`)."""
        self._cfg = replace(self._cfg, **options)  # type: ignore[arg-type]
        return self

    def barrier(self, enabled: bool = True) -> JobBuilder:
        """Whether every rank's first op is a default-group barrier (default on)."""
        self._barrier = enabled
        return self

    def timeout(self, ms: int) -> JobBuilder:
        """The ``timeout_ms`` every op carries (default 600000, NCCL's)."""
        self._timeout_ms = int(ms)
        return self

    def dump_delay(self, seconds: float) -> JobBuilder:
        """Dumps are taken this long after the last event (default 5 s)."""
        self._dump_delay_s = float(seconds)
        return self

    def completion_poll(self, ms: float) -> JobBuilder:
        """Start/completion times are discovered late by up to ``ms`` (watchdog polling)."""
        self._poll_ms = float(ms)
        return self

    def gloo_style(self, enabled: bool = True) -> JobBuilder:
        """Dumps look like gloo's: native ones carry no membership, no p2p and state
        always scheduled; ours (frdump) groups of backend ``gloo`` and no start times."""
        if enabled and self._nccl is not None:
            raise ValueError("nccl() and gloo_style() exclude each other")
        self._gloo = enabled
        # one name shared by all TP groups comes from NCCL's split_group; gloo jobs
        # make each group with new_group: every TP group has its own name
        lay = self.layout
        self.layout = Layout(tp=lay.tp, dp=lay.dp, pp=lay.pp, shared_tp_name=not enabled)
        return self

    def nccl(
        self,
        *,
        run_ahead: tuple[int, int] = (1, 6),
        coalesce_dp: Literal["members", "fused", None] = "members",
        timing: bool = False,
    ) -> JobBuilder:
        """NCCL mode: dumps with PyTorch's real NCCL semantics (see docs/builder.md).

        Each rank's CPU enqueues up to ``k`` ops ahead of its GPU, ``k`` drawn per
        rank from ``run_ahead`` (inclusive); ``state`` follows the GPU. Every
        pipeline p2p batch is a ``batch_isend_irecv`` block: member entries stay
        ``scheduled`` and unretired forever, a closing ``nccl:coalesced`` entry
        with the same seq ids carries the block's state. ``coalesce_dp`` makes the
        DP gradient buckets one block: ``"members"`` recorded like the p2p batch
        (C++ coalescing), ``"fused"`` as one ``*_coalesced`` entry (the Python
        fast path), ``None`` not coalesced. ``timing``
        (``TORCH_NCCL_ENABLE_TIMING``): only then do start events exist, so only
        then can an entry read ``started`` and carry ``duration_ms``.
        """
        lo, hi = run_ahead
        if not 1 <= lo <= hi:
            raise ValueError("run_ahead must be (lo, hi) with 1 <= lo <= hi")
        if coalesce_dp not in ("members", "fused", None):
            raise ValueError("coalesce_dp must be 'members', 'fused' or None")
        if self._gloo:
            raise ValueError("nccl() and gloo_style() exclude each other")
        self._nccl = (int(lo), int(hi))
        self._coalesce_dp = coalesce_dp is not None
        self._dp_style = coalesce_dp or "members"
        self._timing = bool(timing)
        return self

    def clock_offset(self, *, rank: int, ms: float) -> JobBuilder:
        """Shift every timestamp of ``rank`` (its host's clock) by ``ms``."""
        self._check_rank(rank)
        self._offsets[rank] = float(ms)
        return self

    def jitter(self, *, ms: float) -> JobBuilder:
        """Random extra delay (|normal(0, ms)|) before each op of each rank."""
        self._jitter_ms = float(ms)
        return self

    def noise(self, noise: Noise | None = None, **changes: float) -> JobBuilder:
        """Everyday noise that must never change a verdict (:class:`Noise`): rare
        per-op spikes on a few ranks, jittery op durations, host clocks apart
        within NTP bounds. ``changes`` override :class:`Noise`'s fields."""
        base = noise or Noise()
        self._noise = replace(base, **changes) if changes else base  # type: ignore[arg-type]
        return self

    # ---------------------------------------------------------------- faults
    def skip(self, *, rank: int, group: str = "tp", step: int, index: int = 0) -> JobBuilder:
        """``rank`` does not issue its ``index``-th collective on ``group`` in ``step``."""
        return self._fault(Fault("skip", (rank,), step, group=group, index=index))

    def stuck(
        self, *, rank: int, step: int, where: Literal["python", "dataloader"] = "python", after: int = 0
    ) -> JobBuilder:
        """``rank`` stops issuing anything in ``step`` after its first ``after`` instructions.

        ``after=0``: at the start of the step (its last op completed); ``after``
        beyond the step stops before the step's last instruction. Its GPU still
        runs what the CPU enqueued before it stopped.
        """
        if after < 0:
            raise ValueError("after must be >= 0")
        return self._fault(Fault("stuck", (rank,), step, where=where, after=after))

    def op_mismatch(self, *, rank: int, step: int, group: str = "tp", index: int = 0) -> JobBuilder:
        """``rank`` issues a different collective type at one collective."""
        return self._fault(Fault("op_mismatch", (rank,), step, group=group, index=index))

    def size_mismatch(self, *, rank: int, step: int, group: str = "tp", index: int = 0) -> JobBuilder:
        """``rank`` issues one collective with a different tensor size."""
        return self._fault(Fault("size_mismatch", (rank,), step, group=group, index=index))

    def dtype_mismatch(self, *, rank: int, step: int, group: str = "tp", index: int = 0) -> JobBuilder:
        """``rank`` issues one collective with a different dtype."""
        return self._fault(Fault("dtype_mismatch", (rank,), step, group=group, index=index))

    def collectives_in_step(self, *, rank: int, group: str, step: int) -> int:
        """How many collectives ``rank`` issues on ``group`` in ``step`` (with the faults so far)."""
        plan = self._plan()
        lo, hi = self._step_range(plan, rank, step)
        cat = plan.cat
        prog = plan.programs[rank]
        return sum(1 for pos in range(lo, hi)
                   if not cat.specs[cat.instrs[prog[pos]].ops[0]].is_p2p
                   and cat.specs[cat.instrs[prog[pos]].ops[0]].group == group)

    def hang_in_op(self, *, rank: int, step: int, group: str = "dp", index: int = 0) -> JobBuilder:
        """Every member enters the collective; ``rank``'s kernel never starts (→ timeout)."""
        return self._fault(Fault("hang_in_op", (rank,), step, group=group, index=index))

    def kernel_hang(self, *, rank: int, step: int, group: str = "tp", index: int = 0) -> JobBuilder:
        """``rank``'s kernel of one collective starts and never finishes; its peers complete it.

        The peers then block at their next op that needs ``rank`` (→ ``timeout``,
        culprit ``rank``). Issue #10 point 3; needs ``nccl()``.
        """
        return self._fault(Fault("kernel_hang", (rank,), step, group=group, index=index))

    def dead(self, *, rank: int, step: int, leaves_dump: bool = False) -> JobBuilder:
        """``rank`` dies mid-``step``: no dump (or, with ``leaves_dump``, an frdump with death info)."""
        return self._fault(Fault("dead", (rank,), step, leaves_dump=leaves_dump))

    def p2p_recv_without_send(self, *, rank: int, step: int) -> JobBuilder:
        """``rank`` posts a recv from its next pipeline stage that is never sent (recv/recv)."""
        if self.layout.pp < 2 or self.layout.coords(rank)[2] == self.layout.pp - 1:
            raise ValueError("p2p faults need pp >= 2 and a rank that is not on the last stage")
        return self._fault(Fault("p2p_recv_without_send", (rank,), step))

    def p2p_swap_order(self, *, rank: int, step: int) -> JobBuilder:
        """``rank`` receives from its next stage before sending to it; both sides recv first."""
        if self.layout.pp < 2 or self.layout.coords(rank)[2] == self.layout.pp - 1:
            raise ValueError("p2p faults need pp >= 2 and a rank that is not on the last stage")
        return self._fault(Fault("p2p_swap_order", (rank,), step))

    def p2p_send_send(self, *, rank: int, step: int) -> JobBuilder:
        """``rank`` and its next-stage peer each send before receiving (batches split in two).

        ``rank`` splits its first ``send_forward_recv_backward`` batch of ``step``
        into a send then a recv; the peer splits its ``send_backward_recv_forward``
        batches the same way: both block in a send the other never receives
        (send/send, ``p2p_deadlock``, culprits both).
        """
        lay = self.layout
        if lay.pp < 2 or lay.coords(rank)[2] == lay.pp - 1:
            raise ValueError("p2p faults need pp >= 2 and a rank that is not on the last stage")
        if self._cfg.micro_batches < lay.pp:
            raise ValueError("p2p_send_send needs micro_batches >= pp (a steady 1F1B phase)")
        return self._fault(Fault("p2p_send_send", (rank, lay.stage_peer(rank, +1)), step))

    def order_inversion(
        self, *, ranks: int | tuple[int, ...], step: int, groups: tuple[str, str] = ("tp", "dp")
    ) -> JobBuilder:
        """``ranks`` issue two groups' adjacent collectives in the opposite order.

        One rank alone only delays its peers; a deadlock needs a cycle, so a single
        rank gets a partner on the same stage with another TP and DP index.
        """
        rs = (ranks,) if isinstance(ranks, int) else tuple(ranks)
        lay = self.layout
        if set(groups) != {"tp", "dp"}:
            raise ValueError("order_inversion supports groups ('tp', 'dp')")
        if lay.tp < 2 or lay.dp < 2:
            raise ValueError("order_inversion needs tp >= 2 and dp >= 2")
        if len(rs) == 1:
            t, d, s = lay.coords(rs[0])
            rs = (rs[0], lay.rank_at(tp_rank=(t + 1) % lay.tp, dp_rank=(d + 1) % lay.dp, pp_rank=s))
        return self._fault(Fault("order_inversion", rs, step, groups=tuple(groups)))

    def straggler(
        self, *, rank: int, delay_ms: float, from_step: int = 0,
        every: Literal["op", "step", "random"] = "op",
    ) -> JobBuilder:
        """``rank`` enters every op (or the first op of every step) ``delay_ms`` late
        from ``from_step`` on (no hang). In NCCL mode the delay is the CPU's: those ops
        are enqueued late, not just started late. ``every="random"``: late by a fresh
        ``uniform(0, delay_ms)`` before every op (a throttled GPU or a busy host:
        small delays that add up)."""
        if every not in ("op", "step", "random"):
            raise ValueError("every must be 'op', 'step' or 'random'")
        return self._fault(Fault("straggler", (rank,), from_step, delay_ms=float(delay_ms),
                                 where=every))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.layout.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.layout.world_size}")

    def _fault(self, fault: Fault) -> JobBuilder:
        for r in fault.ranks:
            self._check_rank(r)
        if not 0 <= fault.step < self._steps and fault.kind != "straggler":
            raise ValueError(f"step {fault.step} is outside 0..{self._steps - 1} (call steps() first)")
        if fault.group and fault.group not in self.layout.kinds_present():
            raise ValueError(f"group {fault.group!r} does not exist in this layout")
        self._faults.append(fault)
        return self

    # ----------------------------------------------------------------- build
    def build(self) -> JobDumps:
        """Simulate the job and return its dumps with the expected verdict."""
        from frforensics.testing.dumps import JobDumps

        plan = self._plan()
        lay = self.layout
        rng = np.random.default_rng(self.seed)
        start = rng.uniform(0.0, 1.0, lay.world_size) + plan.first_step * self._step_estimate(plan)
        if self._jitter_ms > 0:
            jitter = [
                np.abs(rng.normal(0.0, self._jitter_ms, len(p))).tolist() for p in plan.programs
            ]
        else:
            jitter = [[0.0] * len(p) for p in plan.programs]
        for r, (i0, ms) in plan.random_delay.items():
            drng = np.random.default_rng([self.seed, 31, r])
            extra = drng.uniform(0.0, ms, len(jitter[r]))
            extra[:i0] = 0.0
            jitter[r] = (np.asarray(jitter[r]) + extra).tolist()
        noise = self._noise
        offsets = [self._offsets.get(r, 0.0) for r in range(lay.world_size)]
        duration_sigma = 0.0
        if noise is not None:
            # its own stream: noise on or off leaves every other draw of the seed alone
            nrng = np.random.default_rng([self.seed, 23])
            spiky = nrng.choice(lay.world_size, min(noise.spiky_ranks, lay.world_size), replace=False)
            for r in spiky.tolist():
                n = len(jitter[r])
                hit = nrng.random(n) < noise.spike_rate
                extra = nrng.uniform(noise.spike_ms[0], noise.spike_ms[1], n)
                jitter[r] = (np.asarray(jitter[r]) + np.where(hit, extra, 0.0)).tolist()
            hosts = (lay.world_size + self._host_size - 1) // self._host_size
            host_off = nrng.uniform(-noise.ntp_ms, noise.ntp_ms, hosts)
            offsets = [o if r in self._offsets else o + float(host_off[r // self._host_size])
                       for r, o in enumerate(offsets)]
            duration_sigma = noise.duration_sigma
        start_counts = np.zeros((lay.world_size, len(GROUP_KINDS)), dtype=np.int64)
        stage_counts = [self._kind_counts(plan, c) for c in plan.prefix]
        for r in range(lay.world_size):
            start_counts[r] = stage_counts[int(lay.pp_rank[r])][0]
        run_ahead = None
        if self._nccl is not None:
            lo, hi = self._nccl
            run_ahead = np.random.default_rng([self.seed, 11]).integers(lo, hi + 1, lay.world_size).tolist()
        sim = simulate(
            lay,
            plan.cat,
            plan.programs,
            start_ms=start,
            start_counts=start_counts,
            jitter=jitter,
            delay_from=plan.delay_from,
            hung=plan.hung,
            kernel_hung=plan.kernel_hung,
            delayed=plan.delayed,
            run_ahead=run_ahead,
            duration_sigma=duration_sigma,
            noise_seed=self.seed,
        )
        self.run_ahead = run_ahead
        self._cat = plan.cat
        self._sim, self._start_counts = sim, start_counts
        expected = self._expected(plan, sim)
        dump_ms = sim.last_event_ms + self._dump_delay_s * 1000.0
        for f in self._faults:
            if f.kind in ("hang_in_op", "kernel_hang"):
                worst = max(
                    float(sim.t_enqueue[m][mi])
                    for v in sim.pending_collectives.values()
                    for m, mi, _ in v
                )
                dump_ms = max(dump_ms, worst + self._timeout_ms + 1000.0)
        return JobDumps(
            spec=self._spec(plan),
            sim=sim,
            expected=expected,
            dump_ms=dump_ms,
            offsets_ms=np.array(offsets),
        )

    def _spec(self, plan: _Plan) -> JobSpec:
        return JobSpec(
            layout=self.layout, seed=self.seed, ring_size=self.ring_size, gloo=self._gloo,
            nccl=self._nccl is not None, dp_style=self._dp_style, timing=self._timing,
            timeout_ms=self._timeout_ms, start_time_ns=self._start_time_ns,
            poll_ms=self._poll_ms, faults=tuple(self._faults), cat=plan.cat,
            programs=tuple(map(tuple, plan.programs)),
            prefix=tuple(MappingProxyType(c) for c in plan.prefix),
            prefix_instrs=tuple(MappingProxyType(c) for c in plan.prefix_instrs),
            hung=frozenset(plan.hung), dead=MappingProxyType(dict(plan.dead)),
            stuck=MappingProxyType(dict(plan.stuck)))

    # ------------------------------------------------------------- internals
    def _kind_counts(self, plan: _Plan, spec_counts: Counter[int]) -> tuple[list[int], ...]:
        """(collectives, p2p ops, all ops) per group kind for a spec-id multiset."""
        coll = [0] * len(GROUP_KINDS)
        p2p = [0] * len(GROUP_KINDS)
        for sid, n in spec_counts.items():
            s = plan.cat.specs[sid]
            k = _KIND_INDEX[s.group]
            if s.is_p2p:
                p2p[k] += n
            else:
                coll[k] += n
        return coll, p2p, [a + b for a, b in zip(coll, p2p, strict=True)]

    def _step_estimate(self, plan: _Plan) -> float:
        per_stage = []
        for prog in plan.programs[:: max(1, self.layout.tp * self.layout.dp)]:
            total = sum(
                plan.cat.instrs[i].compute_ms
                + max(plan.cat.specs[o].duration_ms for o in plan.cat.instrs[i].ops)
                for i in prog
            )
            per_stage.append(total / max(1, self._steps - plan.first_step))
        return 1.25 * max(per_stage) + 1.0

    def _plan(self) -> _Plan:
        lay, cfg = self.layout, self._cfg
        cat = Catalog()
        templates = [
            [
                build_stage_step(cat, cfg, stage=s, pp=lay.pp, tp=lay.tp, dp=lay.dp, log_step=log,
                                 coalesce_dp=self._coalesce_dp)
                for log in (False, True)
            ]
            for s in range(lay.pp)
        ]
        is_log = [(k + 1) % cfg.log_interval == 0 for k in range(self._steps)]
        min_ops = min(
            sum(len(cat.instrs[i].ops) for i in templates[s][0]) for s in range(lay.pp)
        )
        window = math.ceil(self.ring_size / max(1, min_ops)) + 2
        first_fault = min(
            [f.step for f in self._faults if f.kind != "straggler"] + [self._steps]
        )
        first_step = max(0, first_fault - window)
        barrier = barrier_instr(cat) if self._barrier else None

        prefix: list[Counter[int]] = []
        prefix_instrs: list[Counter[int]] = []
        stage_prog: list[list[int]] = []
        stage_starts: list[list[int]] = []
        for s in range(lay.pp):
            c: Counter[int] = Counter()
            ci: Counter[int] = Counter()
            if barrier is not None and first_step > 0:
                c.update(cat.instrs[barrier].ops)
                ci[barrier] += 1
            for k in range(first_step):
                for i in templates[s][int(is_log[k])]:
                    c.update(cat.instrs[i].ops)
                    ci[i] += 1
            prefix.append(c)
            prefix_instrs.append(ci)
            prog: list[int] = [barrier] if (barrier is not None and first_step == 0) else []
            starts = []
            for k in range(first_step, self._steps):
                starts.append(len(prog))
                prog.extend(templates[s][int(is_log[k])])
            starts.append(len(prog))
            stage_prog.append(prog)
            stage_starts.append(starts)
        programs = [stage_prog[int(lay.pp_rank[r])] for r in range(lay.world_size)]
        step_starts = [stage_starts[int(lay.pp_rank[r])] for r in range(lay.world_size)]
        plan = _Plan(lay, cat, cfg, first_step, programs, step_starts, prefix, prefix_instrs=prefix_instrs)
        for f in self._faults:
            self._apply(plan, f)
        return plan

    def _own(self, plan: _Plan, rank: int) -> list[int]:
        """Give ``rank`` its own copy of its program (before changing it)."""
        stage_prog = plan.programs[rank]
        mine = list(stage_prog)
        plan.programs[rank] = mine
        plan.step_starts[rank] = list(plan.step_starts[rank])
        return mine

    def _step_range(self, plan: _Plan, rank: int, step: int) -> tuple[int, int]:
        k = step - plan.first_step
        starts = plan.step_starts[rank]
        return starts[k], starts[k + 1]

    def _locate(self, plan: _Plan, rank: int, step: int, group: str, index: int) -> int:
        lo, hi = self._step_range(plan, rank, step)
        prog = plan.programs[rank]
        seen = 0
        for pos in range(lo, hi):
            spec = plan.cat.specs[plan.cat.instrs[prog[pos]].ops[0]]
            if not spec.is_p2p and spec.group == group:
                if seen == index:
                    return pos
                seen += 1
        raise ValueError(
            f"rank {rank} issues only {seen} collectives on {group!r} in step {step}, not {index + 1}"
        )

    def _shift_starts(self, plan: _Plan, rank: int, after: int, by: int) -> None:
        plan.step_starts[rank] = [s + by if s > after else s for s in plan.step_starts[rank]]

    def _apply(self, plan: _Plan, f: Fault) -> None:
        cat = plan.cat
        r = f.ranks[0]
        if f.kind == "straggler":
            k = max(0, f.step - plan.first_step)
            starts = plan.step_starts[r]
            if f.where == "random":  # drawn in build(), added to the jitter
                plan.random_delay[r] = (starts[min(k, len(starts) - 1)], f.delay_ms)
                return
            plan.delay_from[r] = (starts[min(k, len(starts) - 1)], f.delay_ms)
            if f.where == "step":
                plan.delayed[r] = set(starts[min(k, len(starts) - 1):-1])
        elif f.kind == "skip":
            pos = self._locate(plan, r, f.step, f.group, f.index)
            prog = self._own(plan, r)
            del prog[pos]
            self._shift_starts(plan, r, pos, -1)
        elif f.kind in _MISMATCH_KINDS:
            pos = self._locate(plan, r, f.step, f.group, f.index)
            prog = self._own(plan, r)
            spec = cat.specs[cat.instrs[prog[pos]].ops[0]]
            prog[pos] = cat.variant(prog[pos], **_mismatch_change(f.kind, spec))
        elif f.kind == "hang_in_op":
            plan.hung.add((r, self._locate(plan, r, f.step, f.group, f.index)))
        elif f.kind == "kernel_hang":
            plan.kernel_hung.add((r, self._locate(plan, r, f.step, f.group, f.index)))
        elif f.kind == "stuck":
            lo, hi = self._step_range(plan, r, f.step)
            prog = self._own(plan, r)
            del prog[min(lo + f.after, hi - 1):]
            plan.stuck[r] = f.where
        elif f.kind == "dead":
            lo, hi = self._step_range(plan, r, f.step)
            prog = self._own(plan, r)
            del prog[(lo + hi) // 2:]
            plan.dead[r] = f.leaves_dump
        elif f.kind in ("p2p_recv_without_send", "p2p_swap_order"):
            lo, hi = self._step_range(plan, r, f.step)
            prog = self._own(plan, r)
            first_send = next(
                pos for pos in range(lo, hi)
                if any(cat.specs[o].op == "send" and cat.specs[o].delta == 1 for o in cat.instrs[prog[pos]].ops)
            )
            recv = OpSpec("recv", "pp", *_act_io(cat, prog[first_send]), site="pp_extra_recv",
                          duration_ms=0.35, delta=1)
            if f.kind == "p2p_swap_order":
                # move the first recv from the next stage (at or after the send) before the send
                later = next(
                    pos for pos in range(first_send, len(prog))
                    if any(cat.specs[o].op == "recv" and cat.specs[o].delta == 1 for o in cat.instrs[prog[pos]].ops)
                )
                ins = cat.instrs[prog[later]]
                j = next(j for j, o in enumerate(ins.ops) if cat.specs[o].op == "recv" and cat.specs[o].delta == 1)
                moved = cat.specs[ins.ops[j]]
                rest = [cat.specs[o] for o in ins.ops[:j] + ins.ops[j + 1:]]
                if rest:
                    prog[later] = cat.instr(ins.compute_ms, *rest)
                else:
                    del prog[later]
                    self._shift_starts(plan, r, later, -1)
                recv = moved
            prog.insert(first_send, cat.instr(0.0, recv))
            self._shift_starts(plan, r, first_send, +1)
        elif f.kind == "p2p_send_send":
            for rr, delta, first_only in ((r, +1, True), (f.ranks[1], -1, False)):
                lo, hi = self._step_range(plan, rr, f.step)
                prog = self._own(plan, rr)
                pos = lo
                while pos < hi:
                    ins = cat.instrs[prog[pos]]
                    kinds = {(cat.specs[o].op, cat.specs[o].delta) for o in ins.ops}
                    if kinds == {("send", delta), ("recv", delta)}:
                        sends = [cat.specs[o] for o in ins.ops if cat.specs[o].op == "send"]
                        recvs = [cat.specs[o] for o in ins.ops if cat.specs[o].op == "recv"]
                        prog[pos:pos + 1] = [cat.instr(ins.compute_ms, *sends), cat.instr(0.0, *recvs)]
                        self._shift_starts(plan, rr, pos, +1)
                        hi += 1
                        if first_only:
                            break
                    pos += 1
                else:
                    if first_only:
                        raise ValueError(f"rank {rr} has no send_forward_recv_backward batch in step {f.step}")
        elif f.kind == "order_inversion":
            for rr in f.ranks:
                lo, hi = self._step_range(plan, rr, f.step)
                prog = self._own(plan, rr)
                for pos in range(lo, hi - 1):
                    a = cat.specs[cat.instrs[prog[pos]].ops[0]]
                    b = cat.specs[cat.instrs[prog[pos + 1]].ops[0]]
                    if not a.is_p2p and not b.is_p2p and {a.group, b.group} == set(f.groups):
                        prog[pos], prog[pos + 1] = prog[pos + 1], prog[pos]
                        break
                else:
                    raise ValueError(f"no adjacent {f.groups} collectives in step {f.step}")
        else:  # pragma: no cover - guarded by the methods above
            raise ValueError(f"unknown fault {f.kind}")

    # ------------------------------------------------------------ expected
    def _expected(self, plan: _Plan, sim: SimResult) -> Expected:
        if not self._faults:
            return Expected(status="healthy")
        parts = [self._expected_one(plan, sim, f) for f in self._faults]
        order = {"desync": 3, "hang": 2, "degraded": 1, "healthy": 0}
        status = max((p.status for p in parts), key=order.__getitem__)
        if len(parts) == 1:
            return parts[0]
        culprits: list[int] = []
        for p in parts:
            culprits += [r for r in p.culprit_ranks if r not in culprits]
        main = max(parts, key=lambda p: order[p.status])
        return Expected(
            status=status,
            kinds=tuple(k for p in parts for k in p.kinds),
            culprit_ranks=tuple(culprits),
            group=main.group,
            seq=main.seq,
            seq_kind=main.seq_kind,
            op=main.op,
            waiting_ranks=main.waiting_ranks,
            groups=tuple(g for p in parts for g in p.groups),
            also_acceptable=tuple(k for p in parts for k in p.also_acceptable),
            missing_dumps=tuple(r for p in parts for r in p.missing_dumps),
            notes=tuple(n for p in parts for n in p.notes),
        )

    def _group_of(self, gid: int) -> ExpectedGroup:
        g: GroupSpec = self.layout.groups[gid]
        return ExpectedGroup(g.name, g.desc, g.ranks)

    def _coll_key(self, sim: SimResult, rank: int, pos: int) -> tuple[int, int] | None:
        """(gid, seq) of the pending collective ``rank`` posted from program index ``pos``."""
        for key, members in sim.pending_collectives.items():
            for m, mi, _ in members:
                if m == rank and int(sim.instr_index[m][mi]) == pos:
                    return key
        return None

    def _waits_on(self, sim: SimResult, rank: int) -> set[int]:
        """The ranks ``rank``'s pending instruction waits for."""
        out: set[int] = set()
        for (gid, _), members in sim.pending_collectives.items():
            posted = {m for m, _, _ in members}
            if rank in posted:
                out |= set(self.layout.groups[gid].ranks) - posted
        for (src, dst, what), items in sim.pending_p2p.items():
            if any(m == rank for m, _ in items):
                out.add(dst if what == "send" else src)
        return out

    def _in_cycle(self, sim: SimResult, rank: int) -> bool:
        seen: set[int] = set()
        todo = list(self._waits_on(sim, rank))
        while todo:
            x = todo.pop()
            if x == rank:
                return True
            if x in seen:
                continue
            seen.add(x)
            todo.extend(self._waits_on(sim, x))
        return False

    def _earliest_wait_on(self, sim: SimResult, rank: int) -> tuple[int, int, str, tuple[int, ...]] | None:
        """(gid, seq, op, waiting ranks) of the earliest collective whose members wait on ``rank``."""
        best: tuple[float, int, int, str, tuple[int, ...]] | None = None
        for (gid, seq), members in sim.pending_collectives.items():
            posted = tuple(sorted(m for m, _, _ in members))
            if rank in self.layout.groups[gid].ranks and rank not in posted:
                t = min(float(sim.t_enqueue[m][mi]) for m, mi, _ in members)
                if best is None or t < best[0]:
                    best = (t, gid, seq, self._cat.specs[members[0][2]].op, posted)
        return None if best is None else best[1:]

    def _expected_one(self, plan: _Plan, sim: SimResult, f: Fault) -> Expected:
        lay = self.layout
        r = f.ranks[0]
        if f.kind == "straggler":
            return Expected(status="degraded", kinds=("straggler",), culprit_ranks=(r,),
                            notes=(f"rank {r} enters every op {f.delay_ms} ms late",))
        if f.kind == "kernel_hang":
            pos = self._locate(plan, r, f.step, f.group, f.index)
            key = self._coll_key(sim, r, pos)
            if key is None:
                raise AssertionError(f"kernel_hang: rank {r} never reached the planted collective")
            gid, seq = key
            return Expected(status="hang", kinds=("timeout",), culprit_ranks=(r,),
                            group=self._group_of(gid), seq=seq, seq_kind="collective",
                            op=plan.cat.specs[sim.pending_collectives[key][0][2]].op)
        if f.kind in _MISMATCH_KINDS or f.kind == "hang_in_op":
            pos = self._locate(plan, r, f.step, f.group, f.index)
            key = self._coll_key(sim, r, pos)
            if key is None:
                raise AssertionError(f"{f.kind}: rank {r} never reached the planted collective")
            gid, seq = key
            members = sim.pending_collectives[key]
            if f.kind == "hang_in_op":
                waiting = tuple(sorted(m for m, _, _ in members if m != r))
                return Expected(status="hang", kinds=("timeout",), culprit_ranks=(r,),
                                group=self._group_of(gid), seq=seq, seq_kind="collective",
                                op=plan.cat.specs[members[0][2]].op, waiting_ranks=waiting)
            return self._mismatch_verdict(plan, gid, seq, members, r)
        if f.kind == "skip":
            return self._skip_verdict(plan, sim, f)
        if f.kind in ("stuck", "dead"):
            wait = self._earliest_wait_on(sim, r)
            missing = (r,) if f.kind == "dead" and not f.leaves_dump else ()
            kind = "missing_rank" if f.kind == "stuck" else ("dead_rank" if f.leaves_dump else "missing_dump")
            base = Expected(status="hang", kinds=(kind,), culprit_ranks=(r,), missing_dumps=missing)
            if wait is None:
                return base
            gid, seq, op, posted = wait
            return Expected(status="hang", kinds=(kind,), culprit_ranks=(r,),
                            group=self._group_of(gid), seq=seq, seq_kind="collective", op=op,
                            waiting_ranks=posted, missing_dumps=missing)
        if f.kind in ("p2p_recv_without_send", "p2p_swap_order", "p2p_send_send"):
            peer = lay.stage_peer(r, +1)
            gid = int(lay.gid_of["pp"][r])
            return Expected(status="hang", kinds=("p2p_deadlock",), culprit_ranks=tuple(sorted((r, peer))),
                            group=self._group_of(gid), seq_kind="p2p",
                            op="send" if f.kind == "p2p_send_send" else "recv",
                            waiting_ranks=tuple(sorted((r, peer))))
        if f.kind == "order_inversion":
            gids = []
            for rr in f.ranks:
                for kind in f.groups:
                    gids.append(int(lay.gid_of[kind][rr]))
            groups = tuple(self._group_of(g) for g in dict.fromkeys(gids))
            first = int(lay.gid_of[f.groups[0]][r])
            key = next((k for k in sim.pending_collectives if k[0] == first), None)
            return Expected(status="hang", kinds=("cross_pg_deadlock",), culprit_ranks=tuple(sorted(f.ranks)),
                            group=self._group_of(first), seq=None if key is None else key[1],
                            seq_kind="collective", op="all_reduce", groups=groups)
        raise AssertionError(f.kind)

    def _mismatch_verdict(
        self, plan: _Plan, gid: int, seq: int, members: list[tuple[int, int, int]],
        planted: int | None = None,
    ) -> Expected:
        specs = plan.cat.specs
        by_sig: dict[tuple[object, ...], list[int]] = {}
        for m, _, sid in members:
            by_sig.setdefault(specs[sid].signature, []).append(m)
        classes = sorted(by_sig.values(), key=len)
        small = len(classes[0])
        culprits = tuple(sorted(m for c in classes if len(c) == small for m in c))
        # a tie (two members, an even split): the analogous groups (same desc and
        # size, SPMD) issue the planted rank's peers' call at this seq, so they
        # single out the planted rank's class (the analyzer's analog rule)
        if planted is not None and len(classes) > 1 and len(classes[-1]) == small:
            reference = self._analog_reference(plan, gid, seq)
            sig_of = {m: specs[sid].signature for m, _, sid in members}
            mine = next(c for c in classes if planted in c)
            if (reference is not None and sig_of[planted] != reference
                    and any(sig_of[m] == reference for c in classes if c is not mine for m in c)):
                culprits = tuple(sorted(mine))
        sid_of = {m: sid for m, _, sid in members}
        majority = specs[sid_of[classes[-1][0]]]
        odd = specs[sid_of[classes[0][0]]]
        if odd.op != majority.op:
            kind = "op_mismatch"
        elif odd.in_sizes != majority.in_sizes or odd.out_sizes != majority.out_sizes:
            kind = "size_mismatch"
        else:
            kind = "dtype_mismatch"
        return Expected(status="desync", kinds=(kind,), culprit_ranks=culprits,
                        group=self._group_of(gid), seq=seq, seq_kind="collective", op=majority.op,
                        waiting_ranks=tuple(sorted(m for m, _, _ in members)))

    def _analog_reference(self, plan: _Plan, gid: int, seq: int) -> tuple[object, ...] | None:
        """The signature most members of ``gid``'s analogous groups (same desc and
        size) posted at ``seq`` — clearly most (more than twice the runner-up, as
        the analyzer asks), else None; at most 64 votes, as the analyzer."""
        lay, specs, sim = self.layout, plan.cat.specs, self._sim
        group = lay.groups[gid]
        kind_name = next(k for k in GROUP_KINDS if k in lay.gid_of
                         and int(lay.gid_of[k][group.ranks[0]]) == gid)
        kind = GROUP_KINDS.index(kind_name)
        votes: Counter[tuple[object, ...]] = Counter()
        for other, g in enumerate(lay.groups):
            if other == gid or g.desc != group.desc or len(g.ranks) != len(group.ranks):
                continue
            for m in g.ranks:
                count = int(self._start_counts[m][kind])
                last = -1
                for sid, ins in zip(sim.ops[m].tolist(), sim.instr_index[m].tolist(),
                                    strict=True):
                    spec = specs[sid]
                    if ins == last or spec.is_p2p or spec.group != kind_name:
                        continue
                    last = ins
                    count += 1
                    if count == seq:
                        votes[spec.signature] += 1
                        break
            if sum(votes.values()) >= 64:
                break
        if not votes:
            return None
        (best, n), *rest = votes.most_common(2)
        return None if rest and rest[0][1] * 2 > n else best

    def _skip_verdict(self, plan: _Plan, sim: SimResult, f: Fault) -> Expected:
        r = f.ranks[0]
        gid = int(self.layout.gid_of[f.group][r])
        group = self.layout.groups[gid]
        stuck = sorted((k for k in sim.pending_collectives if k[0] == gid), key=lambda k: k[1])
        if not stuck:
            return Expected(status="healthy", notes=("the skipped collective was absorbed",))
        key = stuck[0]
        members = sim.pending_collectives[key]
        posted = {m for m, _, _ in members}
        if r in posted and len(posted) == len(group.ranks):
            v = self._mismatch_verdict(plan, gid, key[1], members, r)
            first = (r, *(m for m in v.culprit_ranks if m != r)) if r in v.culprit_ranks else v.culprit_ranks
            note = (f"rank {r} skipped one collective on {f.group}: its next one met its peers' "
                    f"seq {key[1]} and disagreed",)
            return replace(v, culprit_ranks=first, notes=note)
        also = ("cross_pg_deadlock",) if self._in_cycle(sim, r) else ()
        return Expected(status="hang", kinds=("missing_rank",), culprit_ranks=(r,),
                        group=self._group_of(gid), seq=key[1], seq_kind="collective",
                        op=plan.cat.specs[members[0][2]].op, waiting_ranks=tuple(sorted(posted)),
                        also_acceptable=also)


def _act_io(cat: Catalog, instr_id: int) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...], tuple[str, ...], tuple[str, ...]]:
    s = cat.specs[cat.instrs[instr_id].ops[0]]
    return s.in_sizes, s.out_sizes, s.in_dtypes, s.out_dtypes


def _mismatch_change(kind: str, spec: OpSpec) -> dict[str, object]:
    if kind == "op_mismatch":
        new = "all_gather_into_tensor" if spec.op != "all_gather_into_tensor" else "all_reduce"
        return {"op": new, "reduce_op": "" if new != "all_reduce" else "sum", "root": -1}
    if kind == "size_mismatch":
        def shrink(shapes: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
            return tuple((max(1, s[0] // 2) if s[0] > 1 else 2, *s[1:]) for s in shapes)
        return {"in_sizes": shrink(spec.in_sizes), "out_sizes": shrink(spec.out_sizes)}
    flip = {"BFloat16": "Float", "Float": "BFloat16", "Long": "Int"}
    return {
        "in_dtypes": tuple(flip.get(d, "Float") for d in spec.in_dtypes),
        "out_dtypes": tuple(flip.get(d, "Float") for d in spec.out_dtypes),
    }

