"""Rooted and uneven collectives are compared on what every member must agree on.

A real 4-rank gloo job (torch 2.13 CPU) runs every rooted or uneven op —
scatter, gather, reduce, broadcast, all_to_all with uneven splits, the
``_base``/``_into_tensor`` forms and their coalesced forms — then a DTensor
``parallelize_module`` step on ``init_device_mesh("cpu", (4,))`` (which hands
out the initial weights with ``scatter`` from rank 0). Each rank leaves our
recorder's dump and PyTorch's own (pickle and JSON). A healthy job is HEALTHY
from every source; a scatter whose chunk rank 2 receives as int32 (the same
bytes, so gloo does not notice) is a dtype mismatch naming rank 2 alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

PYTHON = sys.executable

ROOTED = r"""
import json
import warnings
warnings.simplefilter("ignore")
import torch.nn as nn
from torch._C import _distributed_c10d as C

ws = world_size
fault = os.environ.get("FRT_FAULT", "")
t = torch.full((4,), float(rank + 1))

# scatter from rank 0: only the root has inputs
dtype = torch.int32 if fault == "scatter_dtype" and rank == 2 else torch.float32
sc = torch.zeros(4, dtype=dtype)
dist.scatter(sc, [torch.full((4,), float(i)) for i in range(ws)] if rank == 0 else None, src=0)
# gather to rank 1: only the root has outputs
dist.gather(t, [torch.zeros(4) for _ in range(ws)] if rank == 1 else None, dst=1)
x = t.clone(); dist.reduce(x, dst=2)
x = t.clone(); dist.broadcast(x, src=3)
# all_to_all with uneven splits: rank r sends r+1 elements to every peer
ins = [rank + 1] * ws
outs = [p + 1 for p in range(ws)]
a2a_out = torch.zeros(sum(outs))
dist.all_to_all_single(a2a_out, torch.full((sum(ins),), float(rank)), outs, ins)
# the list form: gloo requires even sizes ("invalid tensor size at index 1")
dist.all_to_all([torch.zeros(2) for _ in range(ws)], [torch.full((2,), float(rank))] * ws)
big = torch.zeros(4 * ws); dist.all_gather_into_tensor(big, t)
dist.all_gather([torch.zeros(4) for _ in range(ws)], t)
rs = torch.zeros(4); dist.reduce_scatter_tensor(rs, torch.ones(4 * ws))
rs2 = torch.zeros(4); dist.reduce_scatter(rs2, [torch.ones(4) for _ in range(ws)])
with dist._coalescing_manager(async_ops=False):
    dist.all_gather_into_tensor(torch.zeros(4 * ws), t)
    dist.all_gather_into_tensor(torch.zeros(2 * ws), t[:2])
with dist._coalescing_manager(async_ops=False):
    dist.reduce_scatter_tensor(torch.zeros(4), torch.ones(4 * ws))
    dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(2 * ws))

# DTensor tensor parallel: parallelize_module scatters the weights from rank 0
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)
mesh = init_device_mesh("cpu", (ws,))
torch.manual_seed(0)
model = parallelize_module(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), mesh,
                           {"0": ColwiseParallel(), "2": RowwiseParallel()})
if fault == "tp_hang" and rank == 3:
    time.sleep(120)  # rank 3 hangs before the forward; its peers block in its all_reduce
model(torch.ones(2, 8)).sum().backward()
dist.barrier()

recorder.dump()
native = os.path.join(os.path.dirname(DUMP_DIR), "native")
for kind, raw in (("pickle", C._dump_fr_trace()), ("json", C._dump_fr_trace_json())):
    os.makedirs(os.path.join(native, kind), exist_ok=True)
    name = f"nccl_trace_rank_{rank}" + (".json" if kind == "json" else "")
    data = raw if isinstance(raw, bytes) else raw.encode()
    with open(os.path.join(native, kind, name), "wb") as fh:
        fh.write(data)
dist.destroy_process_group()
"""


def _analyze(path: Path) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run([PYTHON, "-m", "frforensics", str(path), "--format", "json",
                           "--world-size", "4"],
                          capture_output=True, text=True, timeout=120, check=False)
    try:
        return proc.returncode, json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(f"no JSON (exit {proc.returncode}): {proc.stderr[-2000:]}") from None


def _sources(job_dir: Path) -> dict[str, Path]:
    native = job_dir / "native"
    return {"frdump": job_dir / "dumps", "native-pickle": native / "pickle",
            "native-json": native / "json"}


def _run(run_job: Any, fault: str) -> Path:
    job = run_job(ROOTED, world_size=4, deadline_s=60.0, hard_exit_s=150,
                  env={"FRT_FAULT": fault, "TORCH_FR_BUFFER_SIZE": "2000"},
                  name=fault or "healthy")
    codes = job.wait(150)
    assert codes == [0] * 4, job.logs()
    return job.dump_dir.parent


@pytest.mark.timeout(420)
def test_healthy_rooted_uneven_and_tensor_parallel_job_is_healthy_from_every_source(run_job):
    job_dir = _run(run_job, "")
    for source, path in _sources(job_dir).items():
        assert len(list(path.iterdir())) >= 4, (source, sorted(path.iterdir()))
        code, report = _analyze(path)
        assert (code, report["status"], report["culprit_ranks"]) == (0, "healthy", []), (
            source, [f["message"] for f in report["findings"]])


@pytest.mark.timeout(420)
def test_a_scatter_chunk_of_another_dtype_names_the_rank_that_received_it(run_job):
    job_dir = _run(run_job, "scatter_dtype")
    for source, path in _sources(job_dir).items():
        code, report = _analyze(path)
        kinds = [f["kind"] for f in report["findings"]]
        assert (code, report["status"], report["culprit_ranks"]) == (1, "desync", [2]), (
            source, [f["message"] for f in report["findings"]])
        finding = next(f for f in report["findings"] if f["kind"] == "dtype_mismatch")
        assert finding["op"] == "scatter" and finding["culprit_ranks"] == [2], (source, kinds)


@pytest.mark.timeout(420)
def test_a_rank_hung_in_a_tensor_parallel_job_is_the_missing_rank(run_job):
    # before rooted ops were compared on what members agree on, the weights'
    # scatter hid this behind a dtype DESYNC blaming rank 0
    job = run_job(ROOTED, world_size=4, deadline_s=10.0, hard_exit_s=150,
                  env={"FRT_FAULT": "tp_hang"}, name="tp_hang")
    arrived = job.wait_for_dumps([0, 1, 2, 3], timeout_s=120)
    assert sorted(arrived) == [0, 1, 2, 3], job.logs()
    job.kill()
    code, report = _analyze(job.dump_dir)
    assert (code, report["status"], report["culprit_ranks"]) == (1, "hang", [3]), (
        [f["message"] for f in report["findings"]])
    assert report["findings"][0]["kind"] == "missing_rank"
