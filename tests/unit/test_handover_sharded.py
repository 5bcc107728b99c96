"""A sharded state's hand-over (HSDP): who holds a lost rank's shard, and shards as DTensors.

Real DTensors on a real 2 x 2 DeviceMesh, in one process: torch's ``fake`` backend
(``torch.testing._internal.distributed.fake_pg``) gives a world of 4 without peers,
so the mesh's layout and the placements are torch's own. Runs in a subprocess (a
process group is process-wide state).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = r'''
import json, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from frforensics.recovery import _handover as h

hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
flat = init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
w = distribute_tensor(torch.arange(8.0), hsdp, [Replicate(), Shard(0)])
r = distribute_tensor(torch.arange(4.0), hsdp, [Replicate(), Replicate()])
f = distribute_tensor(torch.arange(8.0), flat, [Shard(0)])
state = {"model": {"w": w, "b": torch.ones(3)}, "step": 7}
out = {
    "peers_3": h.shard_peers(state, [3]),
    "peers_0": h.shard_peers(state, [0]),
    "peers_3_1": h.shard_peers(state, [3, 1]),
    "peers_replicated": h.shard_peers({"r": r}, [3]),
    "peers_flat": h.shard_peers({"f": f}, [2]),
    "peers_plain": h.shard_peers({"b": torch.ones(2)}, [3]),
    "groups": sorted(h.mesh_group_names(state)),
    "mesh_groups": sorted(str(hsdp.get_group(d).group_name) for d in range(2)),
}
manifest, tensors = h.flatten(state, version=7)
out["tree"] = manifest.tree
out["shapes"] = [list(t.shape) for t in manifest.tensors]
back = h.rewrap(h.unflatten(manifest, tensors), manifest, state)
out["rewrapped"] = [isinstance(back["model"]["w"], DTensor),
                    [type(p).__name__ for p in back["model"]["w"].placements],
                    list(back["model"]["w"].shape), type(back["model"]["b"]).__name__,
                    back["step"]]
plain = {"model": {"w": torch.zeros(4), "b": torch.ones(3)}, "step": 0}
out["sharded_on_one_side"] = h.sharding_mismatch(manifest, plain)
try:
    h.rewrap(h.unflatten(manifest, tensors), manifest, plain)
    out["rewrap_plain"] = "accepted"
except h.HandoverError as exc:
    out["rewrap_plain"] = str(exc)
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def out() -> dict:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[0].removeprefix("RESULT "))


def test_the_replica_peers_of_a_lost_rank_are_the_ranks_that_differ_only_on_replicated_dims(
        out: dict) -> None:
    # mesh [[0, 1], [2, 3]], (Replicate, Shard): rank 3's shard is rank 1's
    assert out["peers_3"] == {"3": [1]}
    assert out["peers_0"] == {"0": [2]}
    # both holders of one shard lost: a hole, refused in one line
    assert out["peers_3_1"] == "rank 1's shard has no replica: restore from a checkpoint"
    # replicated everywhere: every other rank holds it
    assert out["peers_replicated"] == {"3": [0, 1, 2]}
    # fully sharded: nobody else holds it
    assert out["peers_flat"] == "rank 2's shard has no replica: restore from a checkpoint"
    # nothing sharded: anyone may send
    assert out["peers_plain"] == {}
    assert out["groups"] == out["mesh_groups"]


def test_a_dtensor_travels_as_its_local_shard_and_is_wrapped_on_the_receivers_mesh(
        out: dict) -> None:
    # the DTensor is tagged "s" (a shard), its local shape (8 over 2 shards) travels
    assert out["tree"] == {"d": [["model", {"d": [["w", {"s": 0}], ["b", {"t": 1}]]}],
                                 ["step", {"v": 7}]]}
    assert out["shapes"] == [[4], [3]]
    assert out["rewrapped"] == [True, ["Replicate", "Shard"], [8], "Tensor", 7]


def test_a_shard_where_the_receiver_holds_a_plain_tensor_is_refused_before_loading(
        out: dict) -> None:
    want = ("model/w is a DTensor on one side only (the survivor's and this standby's "
            "models are sharded differently)")
    assert out["sharded_on_one_side"] == want
    assert out["rewrap_plain"] == want
