"""The recorder on NCCL (GPU): coverage, hang, teardown, per backend name.

Run by scripts/gpu_check.sh (``pytest -m gpu``); skipped without a CUDA device.
On torch 2.15 the backends are ``nccl2`` (what ``"nccl"`` builds), ``nccl-legacy``
and ``"cpu:gloo,cuda:nccl"``; on 2.13 ``nccl`` and ``"cpu:gloo,cuda:nccl"``.
World size 2 with >= 2 GPUs; with one GPU, world size 1 (NCCL cannot put two
ranks on one device): the hang and the teardown then hold the stream with a
sleeping kernel instead of a missing peer.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from frforensics.model import DumpReason, OpState

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
WS = 2 if NGPU >= 2 else 1
REGISTRY = hasattr(torch.distributed.Backend, "_ensure_backend_registered")
BACKENDS = (["nccl2", "nccl-legacy", "cpu:gloo,cuda:nccl"] if REGISTRY
            else ["nccl", "cpu:gloo,cuda:nccl"])
# What the inner CUDA backend must be: what torch's registered creator builds.
INNER = {"nccl2": "ProcessGroupNCCL2", "nccl-legacy": "ProcessGroupNCCL",
         "nccl": "ProcessGroupNCCL",
         "cpu:gloo,cuda:nccl": "ProcessGroupNCCL2" if REGISTRY else "ProcessGroupNCCL"}

if NGPU == 0:
    pytestmark.append(pytest.mark.skip(reason="needs a CUDA device"))

INIT = """
import json, signal
BACKEND = os.environ["FRT_GPU_BACKEND"]
dev = rank % torch.cuda.device_count()
torch.cuda.set_device(dev)
dist.init_process_group(BACKEND, timeout=timedelta(seconds=60),
                        device_id=torch.device("cuda", dev))
res = {}
"""

COVERAGE = INIT + """
x = torch.ones(1024, device="cuda")
for _ in range(5):
    dist.all_reduce(x)
torch.cuda.synchronize()
res["all_reduce_ok"] = bool(x[0].item() == world_size ** 5)
out = torch.empty(1024 * world_size, device="cuda"); dist.all_gather_into_tensor(out, x)
rs = torch.empty(1024, device="cuda")
dist.reduce_scatter_tensor(rs, torch.ones(1024 * world_size, device="cuda"))
with dist._coalescing_manager(async_ops=True) as cm:   # one coalesced block
    dist.all_reduce(torch.ones(8, device="cuda"))
    dist.all_reduce(torch.ones(8, device="cuda"))
cm.wait()
if world_size >= 2:
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    buf = torch.zeros(16, device="cuda")
    ops = [dist.P2POp(dist.isend, torch.ones(16, device="cuda"), nxt),
           dist.P2POp(dist.irecv, buf, prv)]
    for w in dist.batch_isend_irecv(ops): w.wait()   # stays batched (a coalesced block)
    res["p2p_ok"] = bool(buf.sum().item() == 16)
cpu = torch.ones(4); dist.all_reduce(cpu) if ":" in BACKEND else None
sub = dist.new_group(list(range(world_size))); dist.all_reduce(x, group=sub)
sp = dist.split_group(split_ranks=[list(range(world_size))], group_desc="split")
dist.all_reduce(x, group=sp)   # split from the bound default group (ncclCommSplit)
from torch.distributed.device_mesh import init_device_mesh
mesh = init_device_mesh("cuda", (world_size,), mesh_dim_names=("dp",))
dist.all_reduce(x, group=mesh.get_group("dp"))
res["split_type"] = type(sp).__name__
res["mesh_type"] = type(mesh.get_group("dp")).__name__
torch.cuda.synchronize(); time.sleep(0.5)   # let the watchdog read the CUDA events
pg = dist.group.WORLD
res["wrapped"] = type(pg).__name__
res["inner"] = type(pg._get_backend(torch.device("cuda"))).__name__
res["get_backend"] = dist.get_backend()
recorder.dump(detail="gpu_check")
from frforensics.formats import decode_dump
p = os.path.join(DUMP_DIR, f"frdump_rank_{rank}")
tr = decode_dump(open(p, "rb").read(), source=p); e = tr.entries
ops_ = [tr.string(int(e.op[i])) for i in range(len(e))]
res["ops"] = sorted(set(ops_))
res["devices"] = sorted({tr.string(int(e.device[i])) for i in range(len(e)) if e.device[i] >= 0})
res["states"] = sorted({int(s) for s in e.state})
res["started_stamped"] = int(sum(1 for i in range(len(e)) if e.t_start_ns[i] > 0))
res["n"] = len(e)
res["coalesced"] = int(sum(1 for o in ops_ if o == "coalesced"))
res["group_descs"] = sorted({tr.groups[int(e.pg[i])].desc for i in range(len(e))})
res["native"] = {}
for f in sorted(os.listdir(DUMP_DIR)):
    if f.startswith("nccl_trace") and f.endswith(f"_rank_{rank}"):
        res["native"][f] = len(decode_dump(open(os.path.join(DUMP_DIR, f), "rb").read(),
                                           source=f, rank_hint=rank).entries)
print("RESULT", json.dumps(res), flush=True)
dist.destroy_process_group()
"""

HANG = INIT + """
x = torch.ones(1024, device="cuda")
dist.all_reduce(x); torch.cuda.synchronize()
print("ENTERING", flush=True)
if world_size >= 2:
    if rank == 0:
        dist.all_reduce(x); torch.cuda.synchronize()   # rank 1 never joins
    else:
        time.sleep(40)
else:
    torch.cuda._sleep(20_000_000_000)   # holds the stream: the op never starts
    dist.all_reduce(x, async_op=True)
    torch.cuda.synchronize()
"""


def _result(job, rank: int) -> dict[str, object]:
    text = (job.log_dir / f"rank{rank}.log").read_text(errors="replace")
    lines = [x for x in text.splitlines() if x.startswith("RESULT ")]
    assert lines, job.logs()
    result: dict[str, object] = json.loads(lines[-1][len("RESULT "):])
    return result


def _env(backend: str) -> dict[str, str]:
    return {"FRT_INIT": "0", "FRT_GPU_BACKEND": backend}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_ops_are_recorded_with_stream_state_batching_and_native_dumps(run_job, backend):
    job = run_job(COVERAGE, world_size=WS, deadline_s=30.0, env=_env(backend),
                  hard_exit_s=200)
    assert job.wait(200) == [0] * WS, job.logs()
    for rank in range(WS):
        res = _result(job, rank)
        assert res["wrapped"] == "RecordingProcessGroup"
        assert res["inner"] == INNER[backend], res
        assert res["all_reduce_ok"] is True and res.get("p2p_ok", True) is True
        assert res["devices"] == [f"cuda:{rank % NGPU}"]
        assert res["states"] == [int(OpState.COMPLETED)]
        assert res["started_stamped"] > 0  # CUDA events say when the stream got there
        assert res["coalesced"] >= (2 if WS >= 2 else 1)
        assert res["native"], "torch's own dump is saved beside ours"
        assert res["split_type"] == res["mesh_type"] == "RecordingProcessGroup", res
        assert "split" in res["group_descs"], res


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_hang_dumps_before_nccl_gives_up(run_job, backend):
    job = run_job(HANG, world_size=WS, deadline_s=4.0, env=_env(backend), hard_exit_s=120)
    seen = job.wait_for_dumps(list(range(WS)), timeout_s=150)
    assert sorted(seen) == list(range(WS)), job.logs()
    trace = job.decode(0)
    assert trace.dump_reason is DumpReason.WATCHDOG_TIMEOUT, job.logs()
    last = int(trace.entries.state[len(trace.entries) - 1])
    # One GPU: the sleeping kernel holds the stream, so the op's start event never
    # ran; two: the stream reached the all_reduce, which waits for rank 1.
    assert last == int(OpState.SCHEDULED if WS == 1 else OpState.STARTED), job.logs()
    if WS >= 2:
        assert job.decode(1).dump_reason is DumpReason.PEER_SIGNAL


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_rank_blocked_in_nccl_dumps_on_sigterm_and_dies_of_it(run_job, backend):
    job = run_job(HANG, world_size=WS, deadline_s=60.0, env=_env(backend), hard_exit_s=120)
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        if "ENTERING" in (job.log_dir / "rank0.log").read_text(errors="replace"):
            break
        time.sleep(0.2)
    time.sleep(1.0)
    job.procs[0].send_signal(signal.SIGTERM)
    assert job.wait(30)[0] == -signal.SIGTERM, job.logs()
    trace = job.decode(0)
    assert trace.dump_reason is DumpReason.SIGNAL and "SIGTERM" in trace.dump_detail
