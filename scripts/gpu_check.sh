#!/usr/bin/env bash
# One-shot GPU check of the recorder (NCCL, CUDA events, watchdog dump).
# Needs: CUDA + NCCL, torch installed, this package installed (pip install -e .).
# Runs in < 3 minutes; prints a compact summary; exit 0 when every check passed.
#
# With >= 2 GPUs: 2 processes, one GPU each, backend "nccl".
# With 1 GPU: 2 processes with "cpu:gloo,cuda:nccl" would need two devices for NCCL,
# so world size 1 on "nccl" is used (all CUDA/NCCL paths are still exercised).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())')
if [ "$NGPU" -lt 1 ]; then echo "gpu_check: no CUDA device"; exit 2; fi
WS=$(( NGPU >= 2 ? 2 : 1 ))
OUT=${OUT:-$(mktemp -d)}
DUMPS="$OUT/gpu_dumps"; mkdir -p "$DUMPS"
cat > "$OUT/gpu_job.py" <<'PYEOF'
import json, os, sys, threading, time
from datetime import timedelta
import torch, torch.distributed as dist
import frforensics.recorder as recorder

t = threading.Timer(150, lambda: os._exit(99)); t.daemon = True; t.start()
rank = int(os.environ["RANK"]); ws = int(os.environ["WORLD_SIZE"]); dump_dir = sys.argv[1]
recorder.enable(dump_dir, timeout_s=4, store_poll_interval_s=0.2)
torch.cuda.set_device(rank)
dist.init_process_group("nccl", timeout=timedelta(seconds=60), device_id=torch.device("cuda", rank))
res = {}
x = torch.ones(1024, device="cuda")
for _ in range(5):
    dist.all_reduce(x)
torch.cuda.synchronize()
res["all_reduce_ok"] = bool(x[0].item() == ws ** 5)
out = torch.empty(1024 * ws, device="cuda"); dist.all_gather_into_tensor(out, x)
rs = torch.empty(1024, device="cuda"); dist.reduce_scatter_tensor(rs, torch.ones(1024 * ws, device="cuda"))
if ws >= 2:
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    buf = torch.zeros(16, device="cuda")
    ops = [dist.P2POp(dist.isend, torch.ones(16, device="cuda"), nxt), dist.P2POp(dist.irecv, buf, prv)]
    for w in dist.batch_isend_irecv(ops): w.wait()   # stays batched (coalesced) under the wrapper
    res["p2p_ok"] = bool(buf.sum().item() == 16)
sub = dist.new_group(list(range(ws))); dist.all_reduce(x, group=sub)
torch.cuda.synchronize(); time.sleep(0.5)   # let the watchdog stamp CUDA events
recorder.dump(detail="gpu_check")
from frforensics.formats import decode_dump
p = os.path.join(dump_dir, f"frdump_rank_{rank}")
tr = decode_dump(open(p, "rb").read(), source=p); e = tr.entries
ops_ = [tr.string(int(e.op[i])) for i in range(len(e))]
res["ops"] = sorted(set(ops_))
res["devices"] = sorted({tr.string(int(e.device[i])) for i in range(len(e)) if e.device[i] >= 0})
res["states"] = sorted({int(s) for s in e.state})
res["started_stamped"] = int(sum(1 for i in range(len(e)) if e.t_start_ns[i] > 0))
res["completed"] = int(sum(1 for s in e.state if s == 2))
res["n"] = len(e)
res["streams"] = len({int(s) for s in e.stream if s >= 0})
res["coalesced_entries"] = int(sum(1 for o in ops_ if o == "coalesced"))
res["get_backend"] = dist.get_backend()
# Watchdog: rank 0 (or the only rank) issues an all_reduce on a 1-rank-missing... with
# ws == 1 nothing can hang, so hang the stream instead: a kernel that never ends is not
# portable; use a collective only rank 0 enters when ws >= 2.
if ws >= 2:
    if rank == 0:
        dist.all_reduce(x)          # rank 1 never joins: rank 0's watchdog fires
        torch.cuda.synchronize()
    else:
        time.sleep(15)
    print("GPU_RESULT", json.dumps(res), flush=True)
    os._exit(0)
# ws == 1: hold the stream with a ~6 s sleep kernel, then all_reduce: the op stays
# unstarted (CUDA event) past the 4 s deadline and the watchdog dumps.
torch.cuda._sleep(12_000_000_000)
w = dist.all_reduce(x, async_op=True)
time.sleep(5.5)
tr = decode_dump(open(p, "rb").read(), source=p); e = tr.entries
res["watchdog_reason"] = tr.dump_reason.value
res["last_op_state_at_dump"] = int(e.state[len(e) - 1])
w.wait(); torch.cuda.synchronize()
print("GPU_RESULT", json.dumps(res), flush=True)
dist.destroy_process_group()
PYEOF
PIDS=()
PORT=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
for R in $(seq 0 $((WS-1))); do
  RANK=$R WORLD_SIZE=$WS LOCAL_RANK=$R MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT \
    timeout 170 $PY "$OUT/gpu_job.py" "$DUMPS" > "$OUT/rank$R.log" 2>&1 &
  PIDS+=($!)
done
RC=0
for P in "${PIDS[@]}"; do wait "$P" || true; done
echo "== gpu_check: world size $WS on $NGPU GPU(s): $($PY -c 'import torch; print(torch.cuda.get_device_name(0), torch.__version__, "nccl", torch.cuda.nccl.version())')"
for R in $(seq 0 $((WS-1))); do
  grep GPU_RESULT "$OUT/rank$R.log" || { echo "rank $R: no result"; tail -20 "$OUT/rank$R.log"; RC=1; }
done
$PY - "$DUMPS" "$WS" <<'PYEOF' || RC=1
import sys, os
from frforensics.formats import decode_dump
d, ws = sys.argv[1], int(sys.argv[2])
ok = True
for r in range(ws):
    p = os.path.join(d, f"frdump_rank_{r}")
    if not os.path.exists(p):
        print(f"rank {r}: NO DUMP"); ok = False; continue
    t = decode_dump(open(p, "rb").read(), source=p)
    print(f"rank {r}: reason={t.dump_reason.value} detail={t.dump_detail[:90]!r} entries={len(t.entries)} "
          f"stale={[x.rank for x in t.stale_peers]}")
    if t.dump_reason.value not in ("watchdog_timeout", "peer_signal"):
        ok = False
print("native dumps:", sorted(f for f in os.listdir(d) if f.startswith("nccl_trace")))
sys.exit(0 if ok else 1)
PYEOF
echo "== gpu_check: $([ $RC = 0 ] && echo PASS || echo FAIL) (logs in $OUT)"
exit $RC
