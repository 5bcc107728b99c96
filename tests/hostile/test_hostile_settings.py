"""Every numeric setting, as an ``FRFORENSICS_*`` variable and as an ``enable()`` argument,
with NaN, inf, 1e308, negative, huge and non-numeric values: one line naming the
variable (or argument) and the accepted range, and nothing else changes.

The real-process case: ``import torch`` + ``init_process_group`` with a bad
variable set still trains (one all_reduce), the recorder stays off, and stderr
holds exactly one frforensics line, naming the variable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from frforensics.recorder._config import _ENV, _NUMBERS, RecorderConfig, SettingError

BAD = ["nan", "NaN", "inf", "-inf", "1e308", "-1", "0", "1e12", "ten minutes", "0x10", "", " "]
NUMERIC_VARS = sorted(var for var, (name, _) in _ENV.items() if name in _NUMBERS)


def test_every_numeric_setting_has_one_parser_and_a_variable() -> None:
    assert {name for name, _ in _ENV.values()} >= set(_NUMBERS) - {"store_timeout_s",
                                                                   "stale_check_max_world"}


@pytest.mark.parametrize("var", NUMERIC_VARS)
@pytest.mark.parametrize("raw", BAD)
def test_a_bad_variable_is_one_line_naming_it_and_its_range(var: str, raw: str) -> None:
    name = _ENV[var][0]
    kind, lo, hi, _ = _NUMBERS[name]
    if not raw.strip():  # unset: the default
        assert RecorderConfig.from_env({var: raw}) == RecorderConfig.from_env({})
        return
    try:
        value = float(raw)
    except ValueError:
        value = None
    ok = value is not None and value == value and (lo <= value <= hi if kind is int
                                                   else lo < value <= hi)
    ok = ok and (kind is not int or float(raw).is_integer())
    if ok:  # within its range (0 stack frames, 0 stale-check ranks): accepted as given
        config = RecorderConfig.from_env({var: raw})
        assert getattr(config, name) == (int(value) if kind is int else value)  # type: ignore[arg-type]
        return
    with pytest.raises(SettingError) as err:
        RecorderConfig.from_env({var: raw})
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{var}=")
    assert ("an integer in" if kind is int else "a number of seconds in") in message


@pytest.mark.parametrize("name", sorted(_NUMBERS))
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1, 1e308, 10**400, "many", True,
                                   None, [1]])
def test_a_bad_enable_argument_is_one_value_error_naming_it(name: str, value: object) -> None:
    optional = _NUMBERS[name][3]
    if value is None and optional:
        assert getattr(RecorderConfig.build("/tmp/x", **{name: None}), name) is None
        return
    with pytest.raises(ValueError) as err:
        RecorderConfig.build("/tmp/x", **{name: value})
    assert str(err.value).startswith(f"{name}=")
    assert "\n" not in str(err.value)


def test_unknown_signal_names_its_variable() -> None:
    with pytest.raises(SettingError, match=r"^FRFORENSICS_SIGNALS='BOGUS': unknown signal"):
        RecorderConfig.from_env({"FRFORENSICS_SIGNALS": "BOGUS"})


JOB = """
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist
import frforensics.recorder as recorder
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:{port}",
                        timeout=timedelta(seconds=30))
t = torch.ones(4)
dist.all_reduce(t)
print("trained", float(t.sum()), "recorder", recorder.is_enabled())
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("var", "raw"), [("FRFORENSICS_TIMEOUT_S", "nan"),
                                          ("FRFORENSICS_STRAGGLER_INTERVAL_S", "nan"),
                                          ("FRFORENSICS_BUFFER_SIZE", "1e12"),
                                          ("FRFORENSICS_STACK_DEPTH", "-3"),
                                          ("FRFORENSICS_SIGNALS", "BOGUS")])
def test_a_bad_variable_never_touches_the_training_job(tmp_path: Path, var: str, raw: str) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FRFORENSICS_")}
    env.update({"FRFORENSICS_ENABLE": "1", "FRFORENSICS_DUMP_DIR": str(tmp_path), var: raw})
    proc = subprocess.run([sys.executable, "-c", JOB.format(port=port)], capture_output=True,
                          text=True, env=env, timeout=150, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["trained", "4.0", "recorder", "False"]
    ours = [line for line in proc.stderr.splitlines() if "frforensics" in line]
    assert len(ours) == 1, proc.stderr
    assert ours[0].startswith(f"frforensics: recorder not enabled: {var}=")
    assert "Traceback" not in proc.stderr
