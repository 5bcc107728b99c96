"""How the recorder gets into torch, on every supported torch (2.13 and 2.15 in CI).

* the wrapped group's inner backend is what torch's registered creator returns;
* each failed probe leaves a working, unrecorded job and one stderr line;
* a failing creator leaves that group to torch, unrecorded, the job working.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from helpers import NEW_C10D_API, torch_line

pytestmark = [pytest.mark.slow, pytest.mark.torch215]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: a recorded group's type: the Python wrapper's subclass, or on the native path
#: (FRT_RECORDER_PATH=cxx, tests/conftest.py) a plain ProcessGroup over recording backends
_WORLD_TYPE = ("ProcessGroup" if os.environ["FRFORENSICS_RECORDER_PATH"] == "cxx"
               else "RecordingProcessGroup")


def _run(code: str, *args: str,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("FRFORENSICS_", "TORCH_"))}
    full["FRFORENSICS_RECORDER_PATH"] = os.environ["FRFORENSICS_RECORDER_PATH"]  # tests/conftest.py
    full.update({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
                 "TORCH_CPP_LOG_LEVEL": "ERROR"})
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=full, timeout=150, check=False)


def _result(proc: subprocess.CompletedProcess[str]) -> dict[str, object]:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stdout + proc.stderr
    result: dict[str, object] = json.loads(line[-1][len("RESULT "):])
    return result


LOOKALIKE = r"""
import json, sys, tempfile, torch, torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import frforensics.recorder as fr
from frforensics.recorder import _c10d
from frforensics.formats import decode_dump

made = []
registry = hasattr(dist.Backend, "_ensure_backend_registered")
if registry:
    # 2.15: torch itself creates "gloo" through Backend._plugins["GLOO"]; replace
    # that creator with a look-alike (the real one, counted).
    dist.Backend._ensure_backend_registered("gloo")
    real = dist.Backend._plugins["GLOO"]
    name = "gloo"
    def lookalike(opts, backend_options):
        pg = real.creator_fn(opts, backend_options)
        made.append(pg)
        return pg
    dist.Backend._plugins["GLOO"] = dist.Backend._BackendPlugin(lookalike, True)
else:
    # 2.13 resolves built-in names before plugins: a look-alike under "gloo" is never
    # what torch runs, so register it under a plugin name routed through the recorder.
    name = "lookalike"
    def lookalike(opts, backend_options):
        pg = c10d.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size,
                                   timeout=opts.timeout)
        made.append(pg)
        return pg
    dist.Backend.register_backend(name, lookalike, extended_api=True, devices=["cpu"])
d = tempfile.mkdtemp()
fr.enable(d, backends=("gloo", name))
dist.init_process_group(name, init_method="tcp://127.0.0.1:PORT", rank=0, world_size=1)
pg = dist.group.WORLD
unwrap = lambda b: b.inner() if hasattr(b, "inner") else b  # the native path's wrapper
inner = unwrap(pg._get_backend(torch.device("cpu")))
t = torch.ones(4); dist.all_reduce(t)
sub = dist.new_group([0], backend="gloo")
sub_inner = unwrap(sub._get_backend(torch.device("cpu")))
dist.all_reduce(t, group=sub)
trace = decode_dump(open(fr.dump(), "rb").read(), source="x")
out = {
    "wrapped": type(pg).__name__,
    "inner_is_lookalike": any(inner is m for m in made),
    "made": len(made),
    "sub_inner_type": type(sub_inner).__name__,
    "sub_inner_is_lookalike": any(sub_inner is m for m in made),
    "ops": len(trace.entries),
    "get_backend": dist.get_backend(),
    "result": t.tolist(),
    "registry": registry,
}
print("RESULT " + json.dumps(out))
dist.destroy_process_group()
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("line", [torch_line()], ids=lambda v: f"torch-{v}")
def test_inner_backend_is_what_the_registered_creator_returns(line):
    res = _result(_run(LOOKALIKE.replace("PORT", str(free_port()))))
    assert res["registry"] == NEW_C10D_API.get(line, res["registry"]), line
    assert res["wrapped"] == _WORLD_TYPE
    assert res["inner_is_lookalike"] is True
    assert res["ops"] == 2 and res["result"] == [1.0] * 4
    if res["registry"]:  # 2.15: "gloo" is the look-alike for the subgroup too
        assert res["made"] == 2 and res["sub_inner_is_lookalike"] is True
        assert res["get_backend"] == "gloo"
    else:  # 2.13: "gloo" is 2.13's own ProcessGroupGloo, as its helper builds it
        assert res["made"] == 1 and res["sub_inner_type"] == "ProcessGroupGloo"
        assert res["get_backend"] == "lookalike"


NCCL_CREATORS = r"""
import json, torch.distributed as dist
from frforensics.recorder import _c10d
out = {}
for name in ("nccl", "nccl-legacy", "nccl2", "nccl-lazy", "gloo"):
    try:
        plugin = _c10d.registered_creator(name)
        out[name] = plugin.creator_fn.__name__ if plugin is not None else None
    except RuntimeError as exc:
        out[name] = "error: " + str(exc)
out["registry"] = hasattr(dist.Backend, "_ensure_backend_registered")
print("RESULT " + json.dumps(out))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("line", [torch_line()], ids=lambda v: f"torch-{v}")
@pytest.mark.parametrize("use_nccl2", [None, "0"])
def test_nccl_names_resolve_to_the_creator_torch_registered(use_nccl2, line):
    env = {} if use_nccl2 is None else {"TORCH_DIST_USE_NCCL2": use_nccl2}
    res = _result(_run(NCCL_CREATORS, env=env))
    assert res["registry"] == NEW_C10D_API.get(line, res["registry"]), line
    if not res["registry"]:
        # 2.13: gloo and nccl are built from their classes, as 2.13's helper does;
        # the 2.15-only names are not backends there.
        assert res["nccl"] is None and res["gloo"] is None
        assert all(str(res[n]).startswith("error: ") for n in ("nccl2", "nccl-lazy"))
        return
    # torch 2.15 distributed_c10d.py: _register_builtin_nccl_backend picks nccl2
    # unless TORCH_DIST_USE_NCCL2=0.
    assert res["nccl"] == ("_create_nccl_process_group" if use_nccl2 == "0"
                           else "_create_nccl2_process_group")
    assert res["nccl-legacy"] == "_create_nccl_process_group"
    assert res["nccl2"] == "_create_nccl2_process_group"
    assert res["nccl-lazy"] == "_create_nccl_lazy_process_group"
    assert res["gloo"] == "_create_gloo_process_group"


PROBE_FAILS = r"""
import json, sys, tempfile, torch, torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import frforensics.recorder as fr
from frforensics.recorder import _c10d

NAME = sys.argv[1]
def broken():
    raise RuntimeError("simulated: this torch differs")
_c10d.PROBES[NAME] = broken
fr.enable(tempfile.mkdtemp())
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:PORT", rank=0, world_size=1)
t = torch.ones(4); dist.all_reduce(t)
print("RESULT " + json.dumps({
    "enabled": fr.is_enabled(), "type": type(dist.group.WORLD).__name__,
    "helper_wrapped": hasattr(c10d._new_process_group_helper, "__wrapped__"),
    "result": t.tolist(), "dump": fr.dump() is not None}))
dist.destroy_process_group()
"""


def _probe_names() -> list[str]:
    try:
        from frforensics.recorder import _c10d
    except Exception as exc:  # torch missing: the test fails rather than skips
        raise AssertionError(f"cannot import the installation layer: {exc}") from exc
    return list(_c10d.PROBES)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("probe", _probe_names())
def test_a_failed_probe_leaves_the_job_working_and_unrecorded(probe):
    proc = _run(PROBE_FAILS.replace("PORT", str(free_port())), probe)
    res = _result(proc)
    assert res == {"enabled": False, "type": "ProcessGroup", "helper_wrapped": False,
                   "result": [1.0] * 4, "dump": False}
    lines = [x for x in proc.stderr.splitlines() if x.startswith("frforensics:")]
    assert len(lines) == 1 and probe in lines[0] and "simulated" in lines[0], proc.stderr
    assert "recorder off" in lines[0]


CREATOR_FAILS = r"""
import json, tempfile, torch, torch.distributed as dist
import frforensics.recorder as fr
from frforensics.recorder import _c10d
from frforensics.formats import decode_dump

fr.enable(tempfile.mkdtemp())
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:PORT", rank=0, world_size=1)
real = _c10d.make_inner
def failing(*a, **k):
    raise RuntimeError("simulated creator failure")
_c10d.make_inner = failing
sub = dist.new_group([0], backend="gloo")
_c10d.make_inner = real
t = torch.ones(4); dist.all_reduce(t, group=sub); dist.all_reduce(t)
trace = decode_dump(open(fr.dump(), "rb").read(), source="x")
print("RESULT " + json.dumps({
    "enabled": fr.is_enabled(), "world": type(dist.group.WORLD).__name__,
    "sub": type(sub).__name__, "result": t.tolist(), "recorded_ops": len(trace.entries),
    "groups": len(trace.groups), "notes": [n for n in trace.notes if "not recorded" in n]}))
dist.destroy_process_group()
"""


@pytest.mark.timeout(150)
def test_a_failing_creator_leaves_that_group_to_torch_unrecorded():
    proc = _run(CREATOR_FAILS.replace("PORT", str(free_port())))
    res = _result(proc)
    assert res["enabled"] is True
    assert res["world"] == _WORLD_TYPE and res["sub"] == "ProcessGroup"
    assert res["result"] == [1.0] * 4
    assert res["recorded_ops"] == 1 and res["groups"] == 1
    assert len(res["notes"]) == 1 and "simulated creator failure" in res["notes"][0]
    lines = [x for x in proc.stderr.splitlines() if "not recorded" in x]
    assert len(lines) == 1 and lines[0].startswith("frforensics: group "), proc.stderr


SPLIT = """
import json
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
out = {}
try:
    pair = dist.split_group(split_ranks=[[0, 1]], group_desc="pair")
    alone = dist.split_group(split_ranks=[[0], [1]], group_desc="alone")
except RuntimeError as exc:  # 2.13 splits only groups bound to an accelerator
    out["error"] = str(exc)
else:
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t, group=pair)
    u = funcol.all_reduce(torch.ones(2), "sum", pair)
    v = torch.ones(2); dist.all_reduce(v, group=alone)
    out.update(type=type(pair).__name__, pair=t.tolist(), funcol=u.tolist(),
               alone=v.tolist(), backend=dist.get_backend(pair),
               resolved=c10d._resolve_process_group(pair.group_name) is pair)
    recorder.dump(detail="split")
print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(180)
def test_split_group_groups_are_recorded_and_work(run_job):
    job = run_job(SPLIT, world_size=2, deadline_s=30.0)
    assert job.wait(150) == [0, 0], job.logs()
    results = []
    for rank in (0, 1):
        text = (job.log_dir / f"rank{rank}.log").read_text()
        results.append(json.loads(text.split("RESULT ", 1)[1].splitlines()[0]))
    if "error" in results[0]:
        # torch 2.13 refuses to split a CPU-only default group; the recorder
        # changes nothing about that (it records split groups where torch makes them).
        assert "No device associated with the default pg" in results[0]["error"]
        return
    # the Python path's wrapper is a ProcessGroup subclass; the native path's group a
    # plain ProcessGroup over its recording backends (FRT_RECORDER_PATH=cxx)
    kind = "ProcessGroup" if os.environ.get("FRT_RECORDER_PATH") == "cxx" else \
        "RecordingProcessGroup"
    for rank, res in enumerate(results):
        assert res == {"type": kind, "pair": [3.0, 3.0],
                       "funcol": [2.0, 2.0], "alone": [1.0, 1.0], "backend": "gloo",
                       "resolved": True}, res
        trace = job.decode(rank)
        groups = {g.desc: g for g in trace.groups}
        assert groups["pair"].ranks == (0, 1) and groups["alone"].ranks == (rank,)
        e = trace.entries
        ops = [(trace.groups[int(e.pg[i])].desc, trace.string(int(e.op[i])), int(e.seq[i]))
               for i in range(len(e))]
        assert ops == [("pair", "all_reduce", 1), ("pair", "all_reduce", 2),
                       ("alone", "all_reduce", 1)], ops
