"""PyTorch's own flight recorder keeps working under ours, each op recorded once.

gloo records itself (2.13 and 2.15). On 2.15 a backend that does not (nccl2,
nccl-lazy, plugins) is recorded by torch's ``FlightRecorderHook``, whose hooks
fire only on c10d's dispatcher path: a CPU plugin backend stands in for nccl2
here (scripts/gpu_check.sh checks nccl2 itself).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any

import pytest

from helpers import NEW_C10D_API, torch_line

pytestmark = [pytest.mark.slow, pytest.mark.torch215]

JOB = r"""
import json, os, sys, tempfile, torch, torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C import _distributed_c10d as C
from frforensics.formats import decode_dump

class PluginBackend(C.Backend):
    # A CPU backend with no flight recorder of its own (like nccl2 on 2.15).
    def allreduce(self, tensors, opts):
        fut = torch.futures.Future(); fut.set_result(tensors)
        return C._create_work_from_future(fut)
    def getBackendName(self):
        return "plugin"

def create(opts, _options):
    try:
        return PluginBackend(opts.group_rank, opts.group_size)
    except TypeError:  # 2.13: C++ backends cannot be subclassed in Python; gloo stands in
        return c10d.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size,
                                     timeout=opts.timeout)

dist.Backend.register_backend("plugin", create, extended_api=True, devices=["cpu"])
if sys.argv[1] == "on":
    import frforensics.recorder as fr
    d = fr.enable(tempfile.mkdtemp(), backends=("gloo", "plugin"), dump_on_exit="never",
                  native_stacks=os.environ.get("FRT_NATIVE_STACKS") == "1")
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:PORT", rank=0, world_size=1)
plugin = dist.new_group([0], backend="plugin")
t = torch.ones(3)
for _ in range(3):
    dist.all_reduce(t)
for _ in range(4):
    dist.all_reduce(t, group=plugin)
hooks = getattr(c10d._world, "pg_flight_recorder_hooks", {})
out = {"hook_api": hasattr(C, "FlightRecorderHook"),
       "hooked_groups": sorted(type(pg).__name__ for pg in hooks)}
def native(backend):
    try:
        raw = C._dump_fr_trace(includeStackTraces=False, backend=backend)
    except TypeError:
        raw = C._dump_fr_trace(includeStackTraces=False) if backend == "gloo" else b""
    if not raw:
        return 0
    t = decode_dump(bytes(raw), source="native", rank_hint=0)
    return len(t.entries)
out["native"] = {b: native(b) for b in ("gloo", "plugin")}
if sys.argv[1] == "on":
    path = fr.dump()
    out["ours"] = len(decode_dump(open(path, "rb").read(), source="ours").entries)
    out["files"] = sorted(f for f in os.listdir(d) if f.startswith("nccl_trace"))
    saved, stacked = {}, {}
    for f in out["files"]:
        e = decode_dump(open(os.path.join(d, f), "rb").read(), source=f, rank_hint=0).entries
        saved[f] = len(e)
        stacked[f] = int((e.stack >= 0).sum())
    out["saved"] = saved
    out["saved_with_stacks"] = stacked
print("RESULT " + json.dumps(out))
dist.destroy_process_group()
"""


def _run(mode: str, extra: dict[str, str] | None = None) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FRFORENSICS_", "TORCH_"))}
    env["FRFORENSICS_RECORDER_PATH"] = os.environ["FRFORENSICS_RECORDER_PATH"]  # tests/conftest.py
    env.update({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **(extra or {})})
    proc = subprocess.run([sys.executable, "-c", JOB.replace("PORT", str(port)), mode],
                          capture_output=True, text=True, env=env, timeout=150, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stdout + proc.stderr
    result: dict[str, Any] = json.loads(line[-1][len("RESULT "):])
    return result


@pytest.mark.timeout(240)
@pytest.mark.parametrize("line", [torch_line()], ids=lambda v: f"torch-{v}")
def test_native_recorders_see_each_op_once_as_without_the_recorder(line):
    plain, ours = _run("off"), _run("on")
    assert plain["hook_api"] == NEW_C10D_API.get(line, plain["hook_api"]), line
    # What torch records natively is the same with and without us: no op lost, none twice.
    assert ours["native"] == plain["native"], (plain, ours)
    assert ours["hooked_groups"] == ["RecordingProcessGroup"] * len(plain["hooked_groups"])
    assert ours["ours"] == 7
    if plain["hook_api"]:  # 2.15: gloo records itself, the hook records the plugin group
        assert plain["native"] == {"gloo": 3, "plugin": 4}
        assert len(plain["hooked_groups"]) == 1
        # The non-gloo backend's dump is the main one (on a GPU: the NCCL one).
        assert ours["saved"] == {"nccl_trace_rank_0": 4, "nccl_trace_gloo_rank_0": 3}
    else:  # 2.13: only gloo's own recorder exists (and gloo serves "plugin" too)
        assert plain["native"] == {"gloo": 7, "plugin": 0}
        assert plain["hooked_groups"] == []
        assert ours["saved"] == {"nccl_trace_rank_0": 7}
    # without stacks unless asked (native_stacks: ~1 s of symbolizing at hang time)
    assert set(ours["saved_with_stacks"].values()) == {0}, ours
    # with them as PyTorch's own default dump is (issue 29: where each op was issued
    # tells a rank that stopped inside a call)
    stacked = _run("on", {"FRT_NATIVE_STACKS": "1"})
    assert stacked["saved_with_stacks"] == stacked["saved"] == ours["saved"], stacked
