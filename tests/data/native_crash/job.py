"""The job behind these dumps: 4 gloo ranks, PyTorch's own flight recorder, rank 1 faults.

``python job.py RANK HOW OUTDIR STOREFILE`` (HOW: exit, kill, stop, raise) for RANK in
0..3 (``TORCH_FR_BUFFER_SIZE=2000``, ``GLOO_SOCKET_IFNAME=lo``). Each rank dumps
``torch._C._distributed_c10d._dump_fr_trace()`` from its ``except`` handler, or from a
timer 4 s after the warm-up all_reduce, whichever comes first.
"""

import datetime
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist


def main() -> None:
    rank, how, out, store = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=20))
    c10d = torch._C._distributed_c10d
    lock = threading.Lock()
    done: list[str] = []

    def dump(why: str) -> None:
        with lock:
            if done:
                return
            path = os.path.join(out, f"nccl_trace_rank_{rank}")
            with open(path + ".tmp", "wb") as fh:
                fh.write(c10d._dump_fr_trace())
            os.replace(path + ".tmp", path)
            done.append(why)

    t = torch.ones(4)
    dist.all_reduce(t)
    c10d._dump_fr_trace()  # pay the first dump's set-up cost before the loop
    threading.Timer(4.0, lambda: dump("timer")).start()
    try:
        for step in range(1, 6):
            if rank == 1 and step == 3:
                if how == "exit":
                    os._exit(1)
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if how == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                if how == "raise":
                    raise RuntimeError("bad batch")
            dist.all_reduce(t)
        time.sleep(6)
    except Exception as exc:
        print(rank, "EXC", type(exc).__name__, str(exc)[:200], flush=True)
        dump("except")
        time.sleep(0.5)
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    main()
