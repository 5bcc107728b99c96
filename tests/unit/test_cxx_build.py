"""The native path's build never makes enable() wait for good (recorder/_cxx): a lock
file a killed build left behind is cleared, and another live build is waited for at
most BUILD_WAIT_S, then the Python wrapper records."""

from __future__ import annotations

import fcntl
import os

import pytest

from frforensics.recorder import _cxx


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FRFORENSICS_CXX_CACHE", str(tmp_path))
    import torch

    where = _cxx.cache_dir(str(torch.__version__))
    where.mkdir(parents=True)
    return where


def test_a_stale_torch_build_lock_is_removed_before_building(cache, monkeypatch):
    (cache / "lock").write_text("")  # torch's FileBaton, its holder long dead
    seen = []

    def compile_(where):
        seen.append((where / "lock").exists())
        return "built"

    monkeypatch.setattr(_cxx, "_compile", compile_)
    assert _cxx._build() == ("built", "")
    assert seen == [False]


def test_another_live_build_is_waited_for_then_given_up(cache, monkeypatch):
    monkeypatch.setattr(_cxx, "BUILD_WAIT_S", 0.3)
    monkeypatch.setattr(_cxx, "_compile", lambda where: pytest.fail("built while locked"))
    fd = os.open(cache / "frforensics-build.lock", os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a build in progress in "another process"
        module, why = _cxx._build()
    finally:
        os.close(fd)
    assert module is None and "another process has been building it for over 0.3 s" in why


def test_a_failed_build_is_one_reason(cache, monkeypatch):
    def fail(where):
        raise RuntimeError("Error building extension 'x': c++: not found\nmore")

    monkeypatch.setattr(_cxx, "_compile", fail)
    module, why = _cxx._build()
    assert module is None
    assert why == "building it failed (RuntimeError: Error building extension 'x': c++: not found)"


def test_a_link_in_place_of_the_build_lock_is_not_followed(cache, monkeypatch, tmp_path):
    target = tmp_path / "elsewhere"
    (cache / "frforensics-build.lock").symlink_to(target)
    monkeypatch.setattr(_cxx, "_compile", lambda where: pytest.fail("built through a link"))
    module, why = _cxx._build()
    assert module is None and why.startswith("building it failed (OSError") and not target.exists()
