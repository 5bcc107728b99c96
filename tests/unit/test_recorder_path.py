"""Choosing the recorder's path (``recorder_path``: the Python wrapper or the native
one, docs/recorder-native.md), and the one view of both rings the dump reads."""

from __future__ import annotations

import pytest

from frforensics.recorder import _enable
from frforensics.recorder import _ring as R
from frforensics.recorder._config import RecorderConfig
from frforensics.recorder._core import Recorder


def test_the_setting_takes_auto_python_or_cxx_only(tmp_path):
    assert RecorderConfig.build(tmp_path).recorder_path == "auto"
    assert RecorderConfig.build(tmp_path, recorder_path="python").recorder_path == "python"
    assert RecorderConfig.build(tmp_path, recorder_path="cxx").recorder_path == "cxx"
    with pytest.raises(ValueError, match="recorder_path"):
        RecorderConfig.build(tmp_path, recorder_path="c++")
    env = {"FRFORENSICS_RECORDER_PATH": "CXX", "FRFORENSICS_DUMP_DIR": str(tmp_path)}
    assert RecorderConfig.from_env(env).recorder_path == "cxx"
    with pytest.raises(ValueError, match="recorder_path"):
        RecorderConfig.from_env({**env, "FRFORENSICS_RECORDER_PATH": "rust"})


def test_enable_reads_the_variable_unless_told_and_ignores_a_bad_one(tmp_path, monkeypatch,
                                                                      capsys):
    monkeypatch.setenv("FRFORENSICS_RECORDER_PATH", "cxx")
    assert _enable._config(tmp_path, None, {}).recorder_path == "cxx"
    # the argument wins over the variable
    assert _enable._config(tmp_path, None, {"recorder_path": "python"}).recorder_path == "python"
    monkeypatch.setenv("FRFORENSICS_RECORDER_PATH", "fortran")
    assert _enable._config(tmp_path, None, {}).recorder_path == "auto"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "FRFORENSICS_RECORDER_PATH='fortran' ignored" in err


def _entry(rid: int, t: int, op: str) -> list:
    e = [0] * R.N_SLOTS
    e[R.RECORD_ID], e[R.T_ENQUEUE], e[R.OP] = rid, t, op
    return e


class _NativeRing:
    def __init__(self, entries: list, dropped: int) -> None:
        self.entries, self.dropped = entries, dropped

    def snapshot(self, only_rid: int = -1) -> tuple[list, int]:
        return [list(e) for e in self.entries], self.dropped


def test_the_snapshot_merges_both_rings_by_enqueue_time(tmp_path):
    rec = Recorder(RecorderConfig.build(tmp_path, buffer_size=4))
    for rid, t in enumerate((10, 30, 50)):
        rec.ring.slots[rid] = _entry(rid, t, "py")
    rec.ring.count = rec.count = 3
    assert [e[R.OP] for e in rec.snapshot()[0]] == ["py"] * 3
    rec.cxx = _NativeRing([_entry(7, 20, "cxx"), _entry(8, 60, "cxx")], dropped=7)
    entries, dropped = rec.snapshot()
    assert [(e[R.OP], e[R.T_ENQUEUE]) for e in entries] == [
        ("py", 10), ("cxx", 20), ("py", 30), ("py", 50), ("cxx", 60)]
    # numbered again in that order, after every entry either ring overwrote
    assert dropped == 7 and [e[R.RECORD_ID] for e in entries] == [7, 8, 9, 10, 11]
    # only the native ring recorded (the normal case on the native path): as it is
    rec.ring = R.Ring(4)
    entries, dropped = rec.snapshot()
    assert dropped == 7 and [e[R.RECORD_ID] for e in entries] == [7, 8]
