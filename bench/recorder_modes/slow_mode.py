"""The unpinned slow mode of the recorder (docs/recorder.md, "Overhead"): one process,
world size 1, 12 batches of 5,000 gloo ``all_reduce``s of 16 floats, 8 frames deep,
after a warm-up; prints the median, min and max wall and the main thread's CPU per op.

    python bench/recorder_modes/slow_mode.py plain|ours [variant]

Variants of ``ours``:

* ``drop`` — an op found finished when its group's next op is issued never reaches
  ``pending`` (so the watchdog reads no result of it);
* ``nofail`` — the watchdog's per-op ``work_failed`` replaced by ``False``;
* ``exc`` — ``work_failed`` as ``Work.exception()`` (deprecated: warns once);
* ``slow`` / ``fast`` — the watchdog polling every 1 s / 1 ms.

A run stays in one mode for its life: run each several times, alternating.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _recbench import free_port, in_user_code


def _variant(name: str) -> dict[str, Any]:
    from frforensics.recorder import _pg, _watchdog

    if name == "drop":
        mono = _pg._mono

        def push(st: Any, pending: Any, entry: Any, work: Any) -> None:
            prev = st.last
            st.last = (entry, work)
            if prev is not None and prev[0][13] < 2:
                if prev[1].is_completed():
                    prev[0][16] = mono()
                    prev[0][13] = 2
                else:
                    pending.append(prev)

        _pg._push = push
    elif name == "nofail":
        _watchdog.work_failed = lambda w: False
    elif name == "exc":
        _watchdog.work_failed = lambda w: w.exception() is not None
    return {"slow": {"poll_interval_s": 1.0}, "fast": {"poll_interval_s": 0.001}}.get(name, {})


def main() -> None:
    import torch
    import torch.distributed as dist

    config = sys.argv[1]
    variant = sys.argv[2] if len(sys.argv) > 2 else ""
    if config == "ours":
        import frforensics.recorder as recorder

        recorder.enable(tempfile.mkdtemp(prefix="slowmode_"), timeout_s=600, save_native=False,
                        **_variant(variant))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    t = torch.ones(16)

    def loop(n: int) -> None:
        for _ in range(n):
            dist.all_reduce(t)

    in_user_code(8, lambda: loop(3000))
    wall: list[float] = []
    cpu: list[float] = []
    for _ in range(12):
        t0, c0 = time.perf_counter(), time.thread_time()
        in_user_code(8, lambda: loop(5000))
        wall.append((time.perf_counter() - t0) / 5000 * 1e6)
        cpu.append((time.thread_time() - c0) / 5000 * 1e6)
    print(f"{config} {variant or '-'}: wall median {statistics.median(wall):.1f} min "
          f"{min(wall):.1f} max {max(wall):.1f} us/op, main-thread CPU median "
          f"{statistics.median(cpu):.1f} us/op")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
