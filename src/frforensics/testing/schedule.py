"""What each rank of a simulated job issues: an op catalog and per-stage step programs.

A step of a Megatron-like 3-D job, per pipeline stage ``s`` of ``P``, with ``M``
micro-batches and ``L`` transformer layers per stage (1F1B schedule, as
``forward_backward_pipelining_without_interleaving``)::

    warmup forwards (P-s-1 of them), then 1F1B steady state, then cooldown backwards
      forward  = [recv_fwd]  (TP broadcast of the batch on first/last stage)
                 2 TP all_reduce per layer  (+2 vocab-parallel loss all_reduce on the last stage)
                 [send_fwd]
      backward = [recv_bwd]  2 TP all_reduce per layer (autograd thread)  [send_bwd]
      p2p ops of one call are posted together (isend/irecv batch, waited as a unit):
      send_forward_recv_backward, send_backward_recv_forward, ...
    then: DP reduce_scatter of gradient buckets, TP + PP all_reduce of the grad norm,
          DP all_gather of parameter buckets (distributed optimizer)
    every ``log_interval`` steps: DP all_reduce of the loss (last stage) and a
          world all_gather (every rank)

An *instruction* is what a rank waits on as a unit: one collective, or one batch
of p2p ops. Each op points into the :class:`Catalog` of distinct op specs
(op, group kind, sizes, dtypes, call site); call sites give realistic 8-frame
Megatron-like Python stacks, innermost first, shared across steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Final

from frforensics.model import Frame

__all__ = ["SITES", "Catalog", "Instr", "OpSpec", "ScheduleConfig", "build_stage_step", "closing_site"]

_TORCH: Final = "/usr/local/lib/python3.12/dist-packages/torch"
_MEG: Final = "/workspace/Megatron-LM/megatron"
_C10D: Final = f"{_TORCH}/distributed/distributed_c10d.py"
_LOGGER: Final = f"{_TORCH}/distributed/c10d_logger.py"

_C10D_LINES: Final = {
    "all_reduce": ("all_reduce", 2950),
    "broadcast": ("broadcast", 2843),
    "all_gather_into_tensor": ("all_gather_into_tensor", 4100),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", 4602),
    "send": ("isend", 2530),
    "recv": ("irecv", 2578),
    "barrier": ("barrier", 4890),
}

_TRAIN: Final = (
    (f"{_MEG}/training/training.py", 1247, "train_step"),
    (f"{_MEG}/training/training.py", 2073, "train"),
)
_SCHED: Final = f"{_MEG}/core/pipeline_parallel/schedules.py"
_P2P: Final = f"{_MEG}/core/pipeline_parallel/p2p_communication.py"


def _site(c10d_op: str, *tail: tuple[str, int, str]) -> tuple[Frame, ...]:
    name, line = _C10D_LINES[c10d_op]
    frames = [Frame(_C10D, line, name), Frame(_LOGGER, 81, "wrapper")]
    frames += [Frame(f, ln, n) for f, ln, n in tail]
    if len(frames) != 8:
        raise AssertionError(f"site has {len(frames)} frames, expected 8")
    return tuple(frames)


_FWD_TAIL: Final = (
    (f"{_MEG}/core/transformer/transformer_block.py", 549, "forward"),
    (f"{_SCHED}", 275, "forward_step"),
)
_BWD_TAIL: Final = ((f"{_TORCH}/autograd/function.py", 307, "apply"),)

#: call site -> (frames innermost first, thread name). Backward collectives come
#: from the autograd engine's thread, as in real jobs.
SITES: Final[dict[str, tuple[tuple[Frame, ...], str]]] = {
    "tp_fwd_attn": (
        _site(
            "all_reduce",
            (f"{_MEG}/core/tensor_parallel/mappings.py", 31, "_reduce"),
            (f"{_MEG}/core/tensor_parallel/mappings.py", 299, "forward"),
            (f"{_MEG}/core/tensor_parallel/layers.py", 1063, "forward"),
            (f"{_MEG}/core/transformer/attention.py", 745, "forward"),
            *_FWD_TAIL,
        ),
        "python",
    ),
    "tp_fwd_mlp": (
        _site(
            "all_reduce",
            (f"{_MEG}/core/tensor_parallel/mappings.py", 31, "_reduce"),
            (f"{_MEG}/core/tensor_parallel/mappings.py", 299, "forward"),
            (f"{_MEG}/core/tensor_parallel/layers.py", 1063, "forward"),
            (f"{_MEG}/core/transformer/mlp.py", 151, "forward"),
            *_FWD_TAIL,
        ),
        "python",
    ),
    "tp_bwd_attn": (
        _site(
            "all_reduce",
            (f"{_MEG}/core/tensor_parallel/layers.py", 512, "backward"),
            (f"{_TORCH}/autograd/function.py", 307, "apply"),
            (f"{_MEG}/core/tensor_parallel/mappings.py", 31, "_reduce"),
            (f"{_MEG}/core/tensor_parallel/mappings.py", 264, "backward"),
            *_BWD_TAIL,
            (f"{_TORCH}/autograd/graph.py", 829, "_engine_run_backward"),
        ),
        "pt_autograd_0",
    ),
    "tp_bwd_mlp": (
        _site(
            "all_reduce",
            (f"{_MEG}/core/tensor_parallel/layers.py", 512, "backward"),
            (f"{_TORCH}/autograd/function.py", 307, "apply"),
            (f"{_MEG}/core/tensor_parallel/mappings.py", 31, "_reduce"),
            (f"{_MEG}/core/tensor_parallel/mappings.py", 228, "backward"),
            *_BWD_TAIL,
            (f"{_TORCH}/autograd/graph.py", 829, "_engine_run_backward"),
        ),
        "pt_autograd_0",
    ),
    "tp_bcast": (
        _site(
            "broadcast",
            (f"{_MEG}/core/tensor_parallel/data.py", 95, "broadcast_data"),
            ("/workspace/Megatron-LM/pretrain_gpt.py", 154, "get_batch"),
            ("/workspace/Megatron-LM/pretrain_gpt.py", 231, "forward_step"),
            (f"{_SCHED}", 275, "forward_step"),
            (f"{_SCHED}", 1781, "forward_backward_pipelining_without_interleaving"),
            _TRAIN[0],
        ),
        "python",
    ),
    "tp_xent": (
        _site(
            "all_reduce",
            (f"{_MEG}/core/tensor_parallel/cross_entropy.py", 131, "forward"),
            (f"{_TORCH}/autograd/function.py", 575, "apply"),
            (f"{_MEG}/core/tensor_parallel/cross_entropy.py", 232, "vocab_parallel_cross_entropy"),
            (f"{_MEG}/core/models/common/language_module/language_module.py", 70, "compute_language_model_loss"),
            (f"{_MEG}/core/models/gpt/gpt_model.py", 334, "forward"),
            (f"{_SCHED}", 275, "forward_step"),
        ),
        "python",
    ),
    "dp_rs": (
        _site(
            "reduce_scatter_tensor",
            (f"{_MEG}/core/distributed/param_and_grad_buffer.py", 402, "start_grad_sync"),
            (f"{_MEG}/core/distributed/param_and_grad_buffer.py", 437, "finish_grad_sync"),
            (f"{_MEG}/core/distributed/distributed_data_parallel.py", 446, "finish_grad_sync"),
            (f"{_MEG}/core/distributed/finalize_model_grads.py", 288, "finalize_model_grads"),
            (f"{_SCHED}", 1894, "forward_backward_pipelining_without_interleaving"),
            _TRAIN[0],
        ),
        "python",
    ),
    "dp_ag": (
        _site(
            "all_gather_into_tensor",
            (f"{_MEG}/core/distributed/param_and_grad_buffer.py", 316, "start_param_sync"),
            (f"{_MEG}/core/optimizer/distrib_optimizer.py", 1859, "_param_all_gather"),
            (f"{_MEG}/core/optimizer/distrib_optimizer.py", 1932, "step_with_ready_grads"),
            (f"{_MEG}/core/optimizer/optimizer.py", 476, "step"),
            _TRAIN[0],
            _TRAIN[1],
        ),
        "python",
    ),
    "norm_tp": (
        _site(
            "all_reduce",
            (f"{_MEG}/core/optimizer/clip_grads.py", 109, "get_grad_norm_fp32"),
            (f"{_MEG}/core/optimizer/optimizer.py", 252, "get_grad_norm"),
            (f"{_MEG}/core/optimizer/optimizer.py", 265, "clip_grad_norm"),
            (f"{_MEG}/core/optimizer/optimizer.py", 470, "step"),
            _TRAIN[0],
            _TRAIN[1],
        ),
        "python",
    ),
    "norm_pp": (
        _site(
            "all_reduce",
            (f"{_MEG}/core/optimizer/clip_grads.py", 115, "get_grad_norm_fp32"),
            (f"{_MEG}/core/optimizer/optimizer.py", 252, "get_grad_norm"),
            (f"{_MEG}/core/optimizer/optimizer.py", 265, "clip_grad_norm"),
            (f"{_MEG}/core/optimizer/optimizer.py", 470, "step"),
            _TRAIN[0],
            _TRAIN[1],
        ),
        "python",
    ),
    "loss_dp": (
        _site(
            "all_reduce",
            (f"{_MEG}/training/utils.py", 243, "average_losses_across_data_parallel_group"),
            ("/workspace/Megatron-LM/pretrain_gpt.py", 201, "loss_func"),
            (f"{_SCHED}", 293, "forward_step"),
            (f"{_SCHED}", 1781, "forward_backward_pipelining_without_interleaving"),
            _TRAIN[0],
            _TRAIN[1],
        ),
        "python",
    ),
    "world_ag": (
        _site(
            "all_gather_into_tensor",
            (f"{_MEG}/training/utils.py", 421, "report_memory_and_throughput"),
            (f"{_MEG}/training/training.py", 1562, "training_log"),
            _TRAIN[1],
            (f"{_MEG}/training/training.py", 846, "pretrain"),
            ("/workspace/Megatron-LM/pretrain_gpt.py", 301, "<module>"),
            ("<frozen runpy>", 88, "_run_code"),
        ),
        "python",
    ),
    "barrier": (
        _site(
            "barrier",
            (f"{_MEG}/training/initialize.py", 329, "_initialize_distributed"),
            (f"{_MEG}/training/initialize.py", 92, "initialize_megatron"),
            (f"{_MEG}/training/training.py", 744, "pretrain"),
            ("/workspace/Megatron-LM/pretrain_gpt.py", 301, "<module>"),
            ("<frozen runpy>", 88, "_run_code"),
            ("<frozen runpy>", 198, "_run_module_as_main"),
        ),
        "python",
    ),
}

for _name, _caller in (
    ("send_forward", 1813),
    ("recv_forward", 1779),
    ("send_backward", 1840),
    ("recv_backward", 1872),
    ("send_forward_recv_backward", 1820),
    ("send_backward_recv_forward", 1846),
):
    for _op in ("send", "recv"):
        SITES[f"pp_{_name}_{_op}"] = (
            _site(
                _op,
                (_P2P, 318, "_p2p_ops"),
                (_P2P, 413, "_communicate"),
                (_P2P, 540 + len(_name), _name),
                (_SCHED, _caller, "forward_backward_pipelining_without_interleaving"),
                _TRAIN[0],
                _TRAIN[1],
            ),
            "python",
        )

# ``pp_extra_recv`` is used by the p2p fault that posts a recv nobody sends to.
SITES["pp_extra_recv"] = (
    _site(
        "recv",
        (_P2P, 318, "_p2p_ops"),
        (_P2P, 413, "_communicate"),
        (_P2P, 571, "recv_backward"),
        (_SCHED, 1750, "forward_backward_pipelining_without_interleaving"),
        _TRAIN[0],
        _TRAIN[1],
    ),
    "python",
)

_CONTEXTLIB: Final = "/usr/local/lib/python3.12/contextlib.py"


def closing_site(site: str) -> str:
    """The call site of the ``nccl:coalesced`` entry that closes a block of ``site`` ops.

    The closing entry is recorded when ``_coalescing_manager`` exits (it calls
    ``_end_coalescing``), so its two innermost frames are that context manager's
    and the rest is the caller's stack (sites that differ only in their two
    innermost frames, like a batch's send and recv, share one closing site).
    """
    return _CLOSING[site]


_CLOSING: Final[dict[str, str]] = {}
_closing_by_frames: dict[tuple[Frame, ...], str] = {}
for _name in list(SITES):
    _frames, _thread = SITES[_name]
    _end = (Frame(_C10D, 3825, "_coalescing_manager"), Frame(_CONTEXTLIB, 148, "__exit__"), *_frames[2:])
    if _end not in _closing_by_frames:
        _closing_by_frames[_end] = f"{_name}/end"
        SITES[f"{_name}/end"] = (_end, _thread)
    _CLOSING[_name] = _closing_by_frames[_end]
del _closing_by_frames

#: op name as PyTorch's NCCL backend spells it in ``profiling_name``.
WIRE_NAMES: Final = {
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "all_gather_into_tensor": "_all_gather_base",
    "reduce_scatter_tensor": "_reduce_scatter_base",
    "send": "send",
    "recv": "recv",
    "barrier": "all_reduce_barrier",
    "coalesced": "coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
    "all_reduce_coalesced": "allreduce_coalesced",
    "all_gather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
}

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class OpSpec:
    """One distinct op a rank may issue (everything but its timing and counters)."""

    op: str  # canonical name: all_reduce, broadcast, all_gather_into_tensor, ...
    group: str  # group kind: default, tp, dp, pp
    in_sizes: tuple[Shape, ...]
    out_sizes: tuple[Shape, ...]
    in_dtypes: tuple[str, ...]
    out_dtypes: tuple[str, ...]
    site: str
    duration_ms: float
    delta: int = 0  # p2p: pipeline-stage distance to the peer (+1 next stage)
    root: int = -1  # broadcast: group-local root
    reduce_op: str = ""

    @property
    def is_p2p(self) -> bool:
        return self.op in ("send", "recv")

    @property
    def signature(self) -> tuple[object, ...]:
        """What all members of a collective must agree on for it to complete."""
        return (self.op, self.in_sizes, self.out_sizes, self.in_dtypes, self.out_dtypes, self.root)


@dataclass(frozen=True, slots=True)
class Instr:
    """A unit a rank waits on: one collective or one p2p batch, after some compute."""

    compute_ms: float
    ops: tuple[int, ...]  # catalog ids, posted together


@dataclass
class Catalog:
    """Interned op specs and instructions shared by every rank."""

    specs: list[OpSpec] = field(default_factory=list)
    instrs: list[Instr] = field(default_factory=list)
    _spec_ids: dict[OpSpec, int] = field(default_factory=dict)
    _instr_ids: dict[Instr, int] = field(default_factory=dict)

    def spec(self, spec: OpSpec) -> int:
        i = self._spec_ids.get(spec)
        if i is None:
            i = self._spec_ids[spec] = len(self.specs)
            self.specs.append(spec)
        return i

    def instr(self, compute_ms: float, *specs: OpSpec) -> int:
        ins = Instr(compute_ms, tuple(self.spec(s) for s in specs))
        i = self._instr_ids.get(ins)
        if i is None:
            i = self._instr_ids[ins] = len(self.instrs)
            self.instrs.append(ins)
        return i

    def variant(self, instr_id: int, **changes: object) -> int:
        """An instruction like ``instr_id`` whose (single) op has ``changes`` applied."""
        ins = self.instrs[instr_id]
        specs = [replace(self.specs[o], **changes) for o in ins.ops]  # type: ignore[arg-type]
        return self.instr(ins.compute_ms, *specs)


@dataclass(frozen=True, slots=True)
class ScheduleConfig:
    """Shape of the simulated model and its step."""

    micro_batches: int = 8
    layers_per_stage: int = 2
    seq_len: int = 2048
    micro_batch_size: int = 1
    hidden: int = 4096
    grad_buckets: tuple[int, ...] = (25_165_824, 16_777_216)  # numel per DP bucket
    log_interval: int = 10
    fwd_layer_ms: float = 1.2
    bwd_layer_ms: float = 2.4
    optimizer_ms: float = 6.0
    data_ms: float = 1.5


def build_stage_step(
    cat: Catalog, cfg: ScheduleConfig, *, stage: int, pp: int, tp: int, dp: int, log_step: bool,
    coalesce_dp: bool = False,
) -> list[int]:
    """The instruction ids of one training step on pipeline stage ``stage``.

    With ``coalesce_dp`` the DP reduce_scatter (and all_gather) of the gradient
    buckets is one coalesced block (Megatron's ``_coalescing_manager`` around the
    per-bucket calls): one instruction holding one op per bucket.
    """
    P, M = pp, cfg.micro_batches
    act: Shape = (cfg.seq_len, cfg.micro_batch_size, cfg.hidden)
    bf16, f32, i64 = ("BFloat16",), ("Float",), ("Long",)
    first, last = stage == 0, stage == P - 1
    out: list[int] = []
    # compute time accumulated since the last instruction, charged to the next one
    pending = [cfg.data_ms]

    def add(*specs: OpSpec) -> None:
        out.append(cat.instr(round(pending[0], 6), *specs))
        pending[0] = 0.0

    def coll(op: str, group: str, site: str, ins: Shape, outs: Shape, dt: tuple[str, ...], dur: float,
             root: int = -1) -> OpSpec:
        red = "sum" if op in ("all_reduce", "reduce_scatter_tensor", "barrier") else ""
        return OpSpec(op, group, (ins,), (outs,), dt, dt, site, dur, root=root, reduce_op=red)

    def p2p(op: str, call: str, delta: int) -> OpSpec:
        return OpSpec(op, "pp", (act,), (act,), bf16, bf16, f"pp_{call}_{op}", 0.35, delta=delta)

    def tp_ar(site: str, shape: Shape = act, dt: tuple[str, ...] = bf16, dur: float = 0.45) -> None:
        if tp > 1:
            add(coll("all_reduce", "tp", site, shape, shape, dt, dur))

    def forward() -> None:
        if (first or last) and tp > 1:
            n = cfg.micro_batch_size * cfg.seq_len * 3
            add(coll("broadcast", "tp", "tp_bcast", (n,), (n,), i64, 0.08, root=0))
        for _ in range(cfg.layers_per_stage):
            pending[0] += cfg.fwd_layer_ms * 0.4
            tp_ar("tp_fwd_attn")
            pending[0] += cfg.fwd_layer_ms * 0.6
            tp_ar("tp_fwd_mlp")
        if last:
            pending[0] += cfg.fwd_layer_ms * 0.5
            tok: Shape = (cfg.seq_len, cfg.micro_batch_size)
            tp_ar("tp_xent", tok, f32, 0.05)
            tp_ar("tp_xent", tok, f32, 0.05)

    def backward() -> None:
        for _ in range(cfg.layers_per_stage):
            pending[0] += cfg.bwd_layer_ms * 0.6
            tp_ar("tp_bwd_mlp")
            pending[0] += cfg.bwd_layer_ms * 0.4
            tp_ar("tp_bwd_attn")

    def batch(call: str, *ops: tuple[str, int]) -> None:
        specs = [p2p(op, call, delta) for op, delta in ops if 0 <= stage + delta < P]
        if specs:
            add(*specs)

    warmup = min(P - stage - 1, M)
    remaining = M - warmup
    for _ in range(warmup):
        batch("recv_forward", ("recv", -1))
        forward()
        batch("send_forward", ("send", +1))
    if remaining > 0:
        batch("recv_forward", ("recv", -1))
    for i in range(remaining):
        forward()
        batch("send_forward_recv_backward", ("send", +1), ("recv", +1))
        backward()
        if i == remaining - 1:
            batch("send_backward", ("send", -1))
        else:
            batch("send_backward_recv_forward", ("send", -1), ("recv", -1))
    for _ in range(warmup):
        batch("recv_backward", ("recv", +1))
        backward()
        batch("send_backward", ("send", -1))
    if log_step and last and dp > 1:
        add(coll("all_reduce", "dp", "loss_dp", (1,), (1,), f32, 0.05))
    if dp > 1:
        rs = [coll("reduce_scatter_tensor", "dp", "dp_rs", (n,), (n // dp,), f32, 2.0 + n / 1e7)
              for n in cfg.grad_buckets]
        if coalesce_dp:
            add(*rs)
        else:
            for spec in rs:
                add(spec)
    pending[0] += 0.3
    tp_ar("norm_tp", (1,), f32, 0.03)
    if P > 1:
        add(coll("all_reduce", "pp", "norm_pp", (1,), (1,), f32, 0.03))
    pending[0] += cfg.optimizer_ms
    if dp > 1:
        ag = [coll("all_gather_into_tensor", "dp", "dp_ag", (n // dp,), (n,), bf16, 1.0 + n / 2e7)
              for n in cfg.grad_buckets]
        if coalesce_dp:
            add(*ag)
        else:
            for spec in ag:
                add(spec)
    if log_step:
        pending[0] += 0.5
        add(coll("all_gather_into_tensor", "default", "world_ag", (1,), (tp * dp * pp,), f32, 0.2))
    return out


def barrier_instr(cat: Catalog) -> int:
    """The default-group barrier each rank issues first (``nccl:all_reduce_barrier``)."""
    return cat.instr(
        0.0, OpSpec("barrier", "default", ((1,),), ((1,),), ("Float",), ("Float",), "barrier", 0.5,
                    reduce_op="sum")
    )
