"""Print the verdict of a 64-rank NCCL job (TP 4 x PP 4 x DP 4) for each planted fault.

The jobs come from the synthetic builder's NCCL mode (``frforensics.testing``:
run-ahead, coalesced DP blocks whose members stay ``scheduled``, batched
pipeline p2p, watchdog discovery times; docs/builder.md), dumped as PyTorch's
native pickles, and analyzed in-process. ``docs/detectors.md`` shows this
script's output. Usage: ``python scripts/nccl_examples.py``.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

from frforensics.analyzer import AnalyzeOptions, analyze
from frforensics.analyzer.digest import digest
from frforensics.analyzer.load import DumpSet
from frforensics.formats import decode_dump
from frforensics.reporting import text
from frforensics.testing import JobBuilder

Plant = Callable[[JobBuilder], JobBuilder]

FAULTS: dict[str, Plant] = {
    "missing_rank (stuck in Python)": lambda j: j.stuck(rank=37, step=1, after=5),
    "op_mismatch": lambda j: j.op_mismatch(rank=21, step=1, group="dp", index=0),
    "size_mismatch": lambda j: j.size_mismatch(rank=5, step=1, group="tp", index=1),
    "dtype_mismatch": lambda j: j.dtype_mismatch(rank=50, step=1, group="tp", index=0),
    "timeout (kernel hang)": lambda j: j.kernel_hang(rank=42, step=1, group="tp", index=2),
    "missing_dump (crashed rank)": lambda j: j.dead(rank=13, step=1),
    "p2p_deadlock (recv/recv)": lambda j: j.p2p_swap_order(rank=17, step=1),
    "p2p_deadlock (send/send)": lambda j: j.p2p_send_send(rank=6, step=1),
    "cross_pg_deadlock": lambda j: j.order_inversion(ranks=33, step=1),
    "straggler (timing on: duration_ms)": lambda j: j.straggler(rank=27, delay_ms=20.0),
}
#: jobs dumped with timing on (``TORCH_NCCL_ENABLE_TIMING``): only they carry ``duration_ms``
TIMED = frozenset({"straggler (timing on: duration_ms)"})


def main() -> None:
    for title, plant in FAULTS.items():
        job = (JobBuilder(tp=4, pp=4, dp=4, ring_size=2000, seed=7)
               .schedule(micro_batches=5, layers_per_stage=1, log_interval=2)
               .steps(3).jitter(ms=0.2)
               .nccl(run_ahead=(1, 4), coalesce_dp="members", timing=title in TIMED))
        dumps = plant(job).build()
        ds = DumpSet()
        for r in dumps.native_ranks:
            data = pickle.dumps(dumps.native_doc(r), protocol=2)
            ds.digests[r] = digest(decode_dump(data, source=f"nccl_trace_rank_{r}", rank_hint=r),
                                   rank=r)
        report = analyze(ds, options=AnalyzeOptions(world_size=dumps.world_size))
        planted = dumps.expected_native.culprit_ranks
        print(f"### {title} — planted root(s) {list(planted)}\n")
        print("```")
        print(text.render(report, width=100).split("\nFindings")[0].rstrip())
        print("```\n")


if __name__ == "__main__":
    main()
