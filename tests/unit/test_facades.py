"""The packages' public faces: ``frforensics.analyzer``, ``frforensics.recorder`` and
``frforensics.testing`` re-export names whose logic lives in named modules, and their
``__all__`` is pinned here (as httpx pins its own): a name added, dropped or renamed
fails until this list says so. ``recorder.enable(dump_dir, config=None, **overrides)``
takes a ``RecorderConfig`` and overrides checked against its fields."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

PINNED: dict[str, list[str]] = {
    "frforensics.analyzer": ["AnalyzeOptions", "DumpSet", "analyze", "load_dumps"],
    "frforensics.recorder": [
        "EXIT_NO_VERDICT",
        "EXIT_VERDICT",
        "RecorderConfig",
        "RecorderVerdicts",
        "Session",
        "SettingError",
        "add_verdict_listener",
        "disable",
        "dump",
        "enable",
        "is_enabled",
        "last_verdict",
        "note_reconfigure",
        "rearm",
        "request_verdict",
        "session",
        "wait_verdict",
    ],
    "frforensics.testing": [
        "Expected",
        "ExpectedGroup",
        "Fault",
        "GroupSpec",
        "JobBuilder",
        "JobDumps",
        "JobSpec",
        "Layout",
        "Noise",
        "RankRecords",
        "ScheduleConfig",
    ],
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_a_facade_exports_exactly_its_pinned_names(name: str) -> None:
    assert importlib.import_module(name).__all__ == PINNED[name]


@pytest.mark.parametrize("name", sorted(PINNED))
def test_every_exported_name_resolves(name: str) -> None:
    module = importlib.import_module(name)
    namespace: dict[str, Any] = {}
    exec(f"from {name} import *", namespace)  # what a star import gets
    for export in module.__all__:
        assert getattr(module, export) is namespace[export], export


@pytest.mark.parametrize("name", sorted(PINNED))
def test_a_facade_defines_no_function_or_class_of_its_own(name: str) -> None:
    module = importlib.import_module(name)
    own = [key for key, value in vars(module).items()
           if (inspect.isfunction(value) or inspect.isclass(value))
           and value.__module__ == name]
    assert own == []


def test_enable_refuses_a_keyword_that_is_no_setting_naming_it(tmp_path: Path) -> None:
    from frforensics import recorder

    with pytest.raises(TypeError, match="unexpected keyword argument 'timeout'"):
        recorder.enable(tmp_path, timeout=5)
    with pytest.raises(TypeError, match="'dump_dir'"):
        recorder.enable(tmp_path, dump_dir=tmp_path)
    assert not recorder.is_enabled()


@pytest.mark.parametrize(("name", "value"), [("timeout_s", -1), ("buffer_size", "many"),
                                             ("dump_on_exit", "sometimes"),
                                             ("verdict_source", "ether")])
def test_enable_refuses_a_bad_value_as_the_config_does(tmp_path: Path, name: str,
                                                       value: object) -> None:
    from frforensics import recorder
    from frforensics.recorder import RecorderConfig

    with pytest.raises(ValueError) as built:
        RecorderConfig.build(tmp_path, **{name: value})
    for config in (None, RecorderConfig.build(tmp_path)):
        with pytest.raises(type(built.value)) as got:
            recorder.enable(tmp_path, config, **{name: value})
        assert str(got.value) == str(built.value)
    assert not recorder.is_enabled()


def test_enable_refuses_a_config_that_is_not_a_recorder_config(tmp_path: Path) -> None:
    from frforensics import recorder

    with pytest.raises(TypeError, match="RecorderConfig"):
        recorder.enable(tmp_path, {"timeout_s": 5})  # type: ignore[arg-type]


_JOB = r"""
import json, sys
import torch, torch.distributed as dist
from frforensics import recorder
from frforensics.recorder import RecorderConfig

out, store = sys.argv[1], sys.argv[2]
base = RecorderConfig.build("/elsewhere", timeout_s=9, buffer_size=64, stack_depth=3)
where = recorder.enable(out, base, buffer_size=128, backends=["GLOO"], verdict=False)
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
dist.all_reduce(torch.ones(4))
path = recorder.dump()
cfg = recorder.session().rec.config
print(json.dumps({"where": str(where), "dump": str(path), "timeout_s": cfg.timeout_s,
                  "buffer_size": cfg.buffer_size, "stack_depth": cfg.stack_depth,
                  "backends": list(cfg.wrap_backends), "verdict": cfg.verdict,
                  "enabled": recorder.is_enabled()}))
dist.destroy_process_group()
recorder.disable()
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_enable_takes_a_config_with_overrides_in_a_real_job(tmp_path: Path) -> None:
    out = tmp_path / "dumps"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FRFORENSICS_", "TORCH_"))}
    env["FRFORENSICS_RECORDER_PATH"] = os.environ["FRFORENSICS_RECORDER_PATH"]  # tests/conftest.py
    env.update({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    proc = subprocess.run([sys.executable, "-c", _JOB, str(out), str(tmp_path / "store")],
                          capture_output=True, text=True, env=env, timeout=100, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"where": str(out.resolve()), "dump": str(out.resolve() / "frdump_rank_0"),
                   "timeout_s": 9.0, "buffer_size": 128, "stack_depth": 3,
                   "backends": ["gloo"], "verdict": False, "enabled": True}
    assert (out / "frdump_rank_0").stat().st_size > 0
