"""Every way a job talks to a process group is recorded, with PyTorch's seq semantics,
and results are unchanged (each rank checks its own results in the job itself)."""

from __future__ import annotations

import json

import pytest

from frforensics.model import DumpReason, OpState

pytestmark = [pytest.mark.slow, pytest.mark.torch215]

EVERYTHING = r"""
import json
import warnings
warnings.simplefilter("ignore", FutureWarning)
import torch.nn as nn
import torch.distributed._functional_collectives as funcol

ws = world_size
results = {}
t = torch.full((4,), float(rank + 1))

# --- dist.* collectives
x = t.clone(); dist.all_reduce(x); results["all_reduce"] = x.tolist()
x = t.clone(); dist.broadcast(x, src=1); results["broadcast"] = x.tolist()
x = t.clone(); dist.reduce(x, dst=0)
out = [torch.zeros(4) for _ in range(ws)]; dist.all_gather(out, t)
results["all_gather"] = [o[0].item() for o in out]
big = torch.zeros(4 * ws); dist.all_gather_into_tensor(big, t)
results["all_gather_into_tensor"] = big[::4].tolist()
rs = torch.zeros(4); dist.reduce_scatter_tensor(rs, torch.ones(4 * ws)); results["rst"] = rs.tolist()
rs2 = torch.zeros(4); dist.reduce_scatter(rs2, [torch.ones(4) for _ in range(ws)])
results["reduce_scatter"] = rs2.tolist()
a2a = torch.zeros(ws); dist.all_to_all_single(a2a, torch.full((ws,), float(rank)))
results["all_to_all_single"] = a2a.tolist()
# uneven (MoE dispatch): rank r sends r+1 elements to every peer
a2v = torch.zeros(sum(i + 1 for i in range(ws)))
dist.all_to_all_single(a2v, torch.full((ws * (rank + 1),), float(rank)),
                       output_split_sizes=[i + 1 for i in range(ws)],
                       input_split_sizes=[rank + 1] * ws)
a2l = [torch.zeros(2) for _ in range(ws)]
dist.all_to_all(a2l, [torch.full((2,), float(rank)) for _ in range(ws)])
g_out = [torch.zeros(4) for _ in range(ws)] if rank == 0 else None
dist.gather(t, g_out, dst=0)
sc = torch.zeros(4)
dist.scatter(sc, [torch.full((4,), float(i)) for i in range(ws)] if rank == 0 else None, src=0)
results["scatter"] = sc.tolist()
dist.barrier()
objs = [None] * ws; dist.all_gather_object(objs, {"r": rank}); results["objs"] = [o["r"] for o in objs]
dist.monitored_barrier(timeout=timedelta(seconds=30))  # get_backend() still says gloo

# --- p2p: send/recv, isend/irecv, batch_isend_irecv (ring)
nxt, prv = (rank + 1) % ws, (rank - 1) % ws
buf = torch.zeros(4)
if rank % 2 == 0:
    dist.send(t, nxt); dist.recv(buf, prv)
else:
    dist.recv(buf, prv); dist.send(t, nxt)
results["recv"] = buf[0].item()
reqs = [dist.isend(t, nxt), dist.irecv(buf, prv)]
for r_ in reqs: r_.wait()
ops = [dist.P2POp(dist.isend, t, nxt), dist.P2POp(dist.irecv, buf, prv)]
for r_ in dist.batch_isend_irecv(ops): r_.wait()
results["batch_recv"] = buf[0].item()

# --- new_group (ranks 0,1 only)
sub = dist.new_group([0, 1])
if rank in (0, 1):
    x = t.clone(); dist.all_reduce(x, group=sub); results["sub"] = x.tolist()

# --- coalescing manager
with dist._coalescing_manager(async_ops=False):
    for _ in range(2):
        dist.all_reduce(t.clone())

# --- functional collectives
y = funcol.all_reduce(t, "sum", dist.group.WORLD); results["funcol_ar"] = y.tolist()
z = funcol.all_gather_tensor(t, 0, dist.group.WORLD); results["funcol_ag"] = z.shape[0]
w = funcol.reduce_scatter_tensor(torch.ones(4 * ws), "sum", 0, dist.group.WORLD)
results["funcol_rs"] = w.tolist()

# --- DDP (the reducer's allreduce comes from C++)
torch.manual_seed(0)
model = nn.Linear(4, 2)
ddp = nn.parallel.DistributedDataParallel(model)
loss = ddp(torch.ones(3, 4) * (rank + 1)).sum(); loss.backward()
results["ddp_grad"] = model.weight.grad[0, 0].item()

# --- DTensor and FSDP2
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Shard, Replicate
mesh = init_device_mesh("cpu", (ws,))
dt = distribute_tensor(torch.arange(8.0).reshape(4, 2) if rank == 0 else torch.zeros(4, 2), mesh, [Shard(0)])
results["dtensor_full"] = dt.redistribute(mesh, [Replicate()]).to_local().sum().item()
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
fm = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
fully_shard(fm[0]); fully_shard(fm[1]); fully_shard(fm)
fm(torch.ones(2, 4)).sum().backward()
results["fsdp_ok"] = True

dist.barrier()
with open(os.path.join(DUMP_DIR, f"results_{rank}.json"), "w") as fh:
    json.dump(results, fh)
recorder.dump()
dist.destroy_process_group()
"""


def _expected(rank: int, ws: int) -> dict[str, object]:
    total = float(sum(range(1, ws + 1)))
    return {
        "all_reduce": [total] * 4,
        "broadcast": [2.0] * 4,
        "all_gather": [float(r + 1) for r in range(ws)],
        "all_gather_into_tensor": [float(r + 1) for r in range(ws)],
        "rst": [float(ws)] * 4,
        "reduce_scatter": [float(ws)] * 4,
        "all_to_all_single": [float(r) for r in range(ws)],
        "scatter": [float(rank)] * 4,
        "objs": list(range(ws)),
        "recv": float((rank - 1) % ws + 1),
        "batch_recv": float((rank - 1) % ws + 1),
        "funcol_ar": [total] * 4,
        "funcol_ag": 4 * ws,
        "funcol_rs": [float(ws)] * 4,
        "dtensor_full": 28.0,
        "fsdp_ok": True,
    }


@pytest.mark.timeout(120)
def test_every_api_is_recorded_with_pytorch_seq_semantics_and_results_unchanged(run_job):
    ws = 4
    job = run_job(EVERYTHING, world_size=ws, deadline_s=30.0, hard_exit_s=100)
    codes = job.wait(100)
    assert codes == [0] * ws, job.logs()
    ddp_grads = set()
    for r in range(ws):
        results = json.loads((job.dump_dir / f"results_{r}.json").read_text())
        expected = _expected(r, ws)
        for key, value in expected.items():
            assert results[key] == value, (r, key, results[key], job.logs())
        ddp_grads.add(results["ddp_grad"])
        if r in (0, 1):
            assert results["sub"] == [3.0] * 4
    assert len(ddp_grads) == 1  # DDP averaged the gradients through the wrapper

    traces = [job.decode(r) for r in range(ws)]
    for r, trace in enumerate(traces):
        assert trace.dump_reason is DumpReason.API
        assert trace.rank == r
        e = trace.entries
        ops = [trace.string(int(e.op[i])) for i in range(len(e))]
        for op in ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                   "reduce_scatter_tensor", "reduce_scatter", "all_to_all_single", "gather",
                   "scatter", "barrier", "send", "recv", "all_reduce_coalesced",
                   "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced"):
            assert op in ops, (r, op, sorted(set(ops)))
        # all_to_all split sizes (issue 29): elements sent to each member | expected from each
        splits = [trace.string(int(e.splits[i])) for i in range(len(e))
                  if ops[i] in ("all_to_all_single", "all_to_all")]
        assert splits == [",".join(["1"] * ws) + "|" + ",".join(["1"] * ws),
                          ",".join([str(r + 1)] * ws) + "|" + ",".join(str(i + 1) for i in range(ws)),
                          ",".join(["2"] * ws) + "|" + ",".join(["2"] * ws)], (r, splits)
        # DDP's reducer (from C++), DTensor and FSDP2 issue ops attributed to the user's line.
        worker = (job.dump_dir.parent / "worker.py").read_text().splitlines()
        for marker, want in (("loss.backward()", "all_reduce"),
                             ("dt.redistribute", "all_gather_into_tensor_coalesced"),
                             ("fm(torch.ones(2, 4)).sum().backward()",
                              "reduce_scatter_tensor")):
            line = next(i + 1 for i, text in enumerate(worker) if marker in text)
            hits = {ops[i] for i in range(len(e))
                    if (frames := trace.stack(int(e.stack[i])))
                    and frames[0].file.endswith("worker.py") and frames[0].line == line}
            assert want in hits, (marker, hits)
        assert all(int(s) == OpState.COMPLETED for s in e.state), ops
        by_group: dict[int, list[int]] = {}
        for i in range(len(e)):
            if not e.is_p2p[i] and ops[i] != "coalesced" and int(e.coalesced[i]) < 0:
                by_group.setdefault(int(e.pg[i]), []).append(int(e.seq[i]))
        # +1 per collective per group (a coalesced block takes one number, shared).
        for seqs in by_group.values():
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), seqs
        default = trace.groups[0]
        assert default.desc == "default_pg" and default.ranks == tuple(range(ws))
        assert default.backend == "gloo"
        assert any(g.ranks == (0, 1) for g in trace.groups) == (r in (0, 1))
        # p2p: peers are global ranks, peer_seq counts per peer and direction.
        sends = [(int(e.peer[i]), int(e.peer_seq[i])) for i in range(len(e)) if ops[i] == "send"]
        assert sends == [((r + 1) % ws, k) for k in (1, 2, 3)], sends
        recvs = [(int(e.peer[i]), int(e.peer_seq[i])) for i in range(len(e)) if ops[i] == "recv"]
        assert recvs == [((r - 1) % ws, k) for k in (1, 2, 3)], recvs
        p2p = [int(e.p2p_seq[i]) for i in range(len(e)) if e.is_p2p[i]]
        assert p2p == list(range(1, len(p2p) + 1))
    # The same op carries the same seq on every rank: the matcher's premise.
    signatures = []
    for trace in traces:
        e = trace.entries
        signatures.append([
            (trace.groups[int(e.pg[i])].ranks, int(e.seq[i]), trace.string(int(e.op[i])))
            for i in range(len(e)) if not e.is_p2p[i] and trace.groups[int(e.pg[i])].ranks
            == tuple(range(ws))
        ])
    assert all(s == signatures[0] for s in signatures), [len(s) for s in signatures]
    # PyTorch's own dump is saved beside ours, with gloo's pg_config repaired.
    from frforensics.formats import decode_dump

    native = job.dump_dir / "nccl_trace_rank_0"
    assert native.exists()
    nt = decode_dump(native.read_bytes(), source=str(native), rank_hint=0)
    assert any(g.ranks == tuple(range(ws)) for g in nt.groups), nt.groups


@pytest.mark.timeout(120)
def test_torchrun_with_env_vars_only_names_the_rank_that_skipped(run_torchrun, fr_analyze):
    script = """
    import os, time, threading
    import torch, torch.distributed as dist

    timer = threading.Timer(60, lambda: os._exit(99))
    timer.daemon = True
    timer.start()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(8)
    for step in range(1, 6):
        if rank == 2 and step == 3:
            continue
        dist.all_reduce(t)
    time.sleep(50)
    """
    job = run_torchrun(script, nproc=4, env={
        "FRFORENSICS_ENABLE": "1", "FRFORENSICS_TIMEOUT_S": "2",
        "FRFORENSICS_STORE_POLL_INTERVAL_S": "0.2",
    })
    seen = job.wait_for_dumps([0, 1, 2, 3], 60)
    assert sorted(seen) == [0, 1, 2, 3], job.logs()
    assert max(seen.values()) - min(seen.values()) < 4.0, seen
    trace = job.decode(2)
    assert trace.dump_reason is DumpReason.PEER_SIGNAL
    assert trace.job_id  # torchrun's run id
    report = fr_analyze(job.dump_dir)
    assert report["culprit_ranks"][:1] == [2], report
    finding = next(f for f in report["findings"] if 2 in f.get("culprit_ranks", []))
    assert finding["kind"] == "missing_rank"
    assert finding["seq"] == 5 and finding["pg"]["ranks"] == [0, 1, 2, 3]
