"""Time to verdict and tail-digest size at hang time, in a real N-process gloo job on CPU.

    python bench/bench_verdict.py --ranks 8 --ops 300 [--source store|auto] [--out results/x.json]

Each rank enables the recorder (per-rank dump directories, so the elected rank
can only use the store digests), joins the default group and two halves, runs
``--ops`` steps (an all_reduce on the default group and one on its half), then
the last rank skips the final all_reduce and the others hang in it. Every rank
saves the verdict it learns; the parent reports the digest sizes, the time
from the dump flag to the verdict key (``seconds_after_flag``), the analysis
time in the child process, and the wall time from the hang to the last rank
knowing the verdict. Timings on the shared 2-core VM are indicative only.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

WORKER = """
import json, os, sys, time, threading
from datetime import timedelta
threading.Timer(float(os.environ["B_HARD_EXIT_S"]), lambda: os._exit(99)).start()
import torch
import torch.distributed as dist
import frforensics.recorder as recorder

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
root = os.environ["B_ROOT"]

def save(verdict):
    with open(os.path.join(root, f"learned_{rank}.json"), "w") as fh:
        json.dump({"verdict": verdict, "learned_at": time.time()}, fh)

recorder.add_verdict_listener(save)
recorder.enable(os.path.join(root, "dumps", f"rank{rank}"), timeout_s=float(os.environ["B_DEADLINE"]),
                store_poll_interval_s=float(os.environ["B_POLL"]),
                verdict_source=os.environ["B_SOURCE"], verdict_timeout_s=300)
dist.init_process_group("gloo", timeout=timedelta(seconds=600))
half = world // 2
lo = dist.new_group(list(range(half)))
hi = dist.new_group(list(range(half, world)))
mine = lo if rank < half else hi
t = torch.ones(16)
for step in range(int(os.environ["B_OPS"])):
    dist.all_reduce(t)
    dist.all_reduce(t, group=mine)
dist.barrier()
with open(os.path.join(root, f"ready_{rank}"), "w") as fh:
    fh.write(str(time.time()))
if rank != world - 1:
    dist.all_reduce(t)            # the last rank never enters: the others hang here
time.sleep(float(os.environ["B_HARD_EXIT_S"]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--ops", type=int, default=300)
    ap.add_argument("--source", default="store")
    ap.add_argument("--deadline", type=float, default=5.0)
    ap.add_argument("--poll", type=float, default=1.0)
    ap.add_argument("--budget", type=float, default=900.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix=f"bench_verdict_{args.ranks}_"))
    script = root / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    port = free_port()
    procs = []
    started = time.time()
    for r in range(args.ranks):
        env = {k: v for k, v in os.environ.items() if not k.startswith("FRFORENSICS_")}
        env.update(RANK=str(r), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   GLOO_SOCKET_IFNAME="lo", TORCH_CPP_LOG_LEVEL="ERROR",
                   B_ROOT=str(root), B_OPS=str(args.ops), B_SOURCE=args.source,
                   B_DEADLINE=str(args.deadline), B_POLL=str(args.poll),
                   B_HARD_EXIT_S=str(args.budget))
        log = open(root / f"rank{r}.log", "wb")  # noqa: SIM115 - the child owns it
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
        log.close()
    result: dict[str, object] = {"ranks": args.ranks, "ops_per_rank": 2 * args.ops + 1,
                                 "source": args.source, "deadline_s": args.deadline,
                                 "store_poll_s": args.poll, "root": str(root)}
    try:
        deadline = time.time() + args.budget
        while time.time() < deadline:
            learned = list(root.glob("learned_*.json"))
            if len(learned) >= args.ranks:
                break
            if any(p.poll() not in (None, 0) for p in procs):
                bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
                raise SystemExit(f"ranks {bad} exited early; see {root}")
            time.sleep(0.5)
        ready = [float((root / f"ready_{r}").read_text()) for r in range(args.ranks)
                 if (root / f"ready_{r}").exists()]
        docs = [json.loads(p.read_text()) for p in root.glob("learned_*.json")]
        verdict = docs[0]["verdict"] if docs else None
        result["startup_s"] = round(min(ready) - started, 1) if ready else None
        if verdict is not None:
            hang = max(ready)
            result.update({
                "culprit_ranks": verdict["culprit_ranks"],
                "status": verdict["status"],
                "inputs": {k: len(v) for k, v in verdict["inputs"].items()},
                "digest_bytes": verdict.get("digest_bytes"),
                "seconds_after_flag": verdict["seconds_after_flag"],
                "analysis_s": verdict.get("analysis_s"),
                "ranks_learned": len(docs),
                "hang_to_last_rank_learned_s": round(max(d["learned_at"] for d in docs) - hang, 2),
                "hang_to_verdict_key_s": round(verdict["time_ns"] / 1e9 - hang, 2),
            })
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
