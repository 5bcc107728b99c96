"""The state hand-over's transfer between two real gloo processes (torch 2.13 and 2.15).

Rank 0 sends a state of many dtypes and sizes in chunks far smaller than its
tensors (so tensors span chunks and chunks span tensors); rank 1 receives it from
the manifest alone and must hold the same bytes. The whole recovery path, under
frforensics-run, is in tests/integration/test_launcher.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import frforensics

pytestmark = [pytest.mark.slow, pytest.mark.torch215, pytest.mark.timeout(120)]

SCRIPT = r'''
import hashlib, os, sys
from datetime import timedelta
import torch, torch.distributed as dist
from frforensics.recovery import _handover as ho

dist.init_process_group("gloo", timeout=timedelta(seconds=30))
rank = dist.get_rank()
torch.manual_seed(0)  # both build the same state; only rank 0's is sent
state = {"big": torch.randn(3000, 7), "half": torch.randn(333).half(),
         "bf": torch.randn(5, 5).bfloat16(), "mask": torch.rand(77) > 0.5,
         "ids": torch.randint(0, 10**9, (123,)), "scalar": torch.tensor(2.5),
         "empty": torch.zeros(0, 4), "strided": torch.randn(40, 30).t(),
         "optim": {"state": {0: {"step": torch.tensor(9.0)}}, "param_groups": [{"lr": 0.1}]},
         "step": 9}
manifest, tensors = ho.flatten(state, version=9)
if rank == 0:
    sent = ho.send(tensors, dst=1, chunk_bytes=int(os.environ["CHUNK"]))
    print("SENT", sent, flush=True)
else:
    got = ho.Manifest.loads(manifest.dumps())
    out = ho.receive(got, src=0, chunk_bytes=int(os.environ["CHUNK"]))
    digest = lambda ts: hashlib.sha256(b"".join(
        t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in ts)).hexdigest()
    assert [tuple(t.shape) for t in out] == [tuple(t.shape) for t in tensors]
    assert [t.dtype for t in out] == [t.dtype for t in tensors]
    rebuilt = ho.unflatten(got, out)
    assert rebuilt["optim"]["state"][0]["step"].item() == 9.0 and rebuilt["step"] == 9
    assert torch.equal(rebuilt["strided"], state["strided"])
    print("RECEIVED", got.nbytes, digest(out) == digest(tensors), flush=True)
dist.destroy_process_group()
'''


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("chunk", [1000, 1 << 20])
def test_a_state_sent_in_chunks_arrives_byte_for_byte(tmp_path: Path, chunk: int) -> None:
    script = tmp_path / "handover.py"
    script.write_text(SCRIPT)
    src = str(Path(frforensics.__file__).resolve().parents[1])
    port = str(_port())
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "RANK": str(rank), "WORLD_SIZE": "2", "CHUNK": str(chunk),
               "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
               "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=100)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    nbytes = 3000 * 7 * 4 + 333 * 2 + 25 * 2 + 77 + 123 * 8 + 4 + 0 + 1200 * 4 + 4
    assert f"SENT {nbytes}" in outs[0], outs
    assert f"RECEIVED {nbytes} True" in outs[1], outs
