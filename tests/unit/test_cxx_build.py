"""The native path's build (recorder/_cxx): never makes enable() wait for good (what a
killed build left is cleared, another live build is waited for at most BUILD_WAIT_S,
then the Python wrapper records), only a whole extension is ever in place, and the
default ``recorder_path="auto"`` takes a cached build, else starts one background
build per machine and never retries a failed one on its own."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from frforensics.recorder import _cxx


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FRFORENSICS_CXX_CACHE", str(tmp_path))
    import torch

    where = _cxx.cache_dir(str(torch.__version__))
    where.mkdir(parents=True)
    monkeypatch.setattr(_cxx, "_state", {})
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return where


def _fake_cpp_load(seen):
    def cpp_load(name, sources, build_directory, **kwargs):
        stage = Path(build_directory)
        seen.append(stage)
        (stage / "lock").write_text("")  # torch's own lock, private to this build
        (stage / f"{name}.so").write_bytes(b"whole")
        return "module"
    return cpp_load


def test_a_build_happens_in_a_private_directory_and_only_the_whole_file_is_moved_in(
        cache, monkeypatch):
    import torch.utils.cpp_extension as ext

    (cache / "lock").write_text("")  # torch's FileBaton of an older layout, holder dead
    (cache / "build-killed").mkdir()  # what a build killed midway left
    (cache / "build-killed" / "recorder.o").write_text("half")
    seen: list[Path] = []
    monkeypatch.setattr(ext, "load", _fake_cpp_load(seen))
    assert _cxx._build() == ("module", "")
    assert seen[0].parent == cache and seen[0].name.startswith("build-")
    assert (cache / f"{_cxx.MODULE}.so").read_bytes() == b"whole"
    # nothing else left: the stage, the killed build's directory, the stale lock
    assert sorted(p.name for p in cache.iterdir()) == [_cxx.LOCK, f"{_cxx.MODULE}.so"]


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


# ---- recorder_path="auto"


def test_auto_takes_a_cached_build(cache, monkeypatch):
    (cache / f"{_cxx.MODULE}.so").write_bytes(b"built")
    monkeypatch.setattr(_cxx, "_import", lambda path: ("module", path.name))
    monkeypatch.setattr(_cxx, "_start_background_build", lambda where: pytest.fail("built"))
    assert _cxx.load_if_built() == (("module", f"{_cxx.MODULE}.so"), "", False)


def test_auto_starts_one_background_build_on_local_rank_0_only(cache, monkeypatch):
    started = []
    monkeypatch.setattr(_cxx, "_start_background_build",
                        lambda where: started.append(where) or True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _cxx.load_if_built() == (None, "not built on this machine yet", False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert _cxx.load_if_built() == (None, "not built on this machine yet", True)
    assert started == [cache]


def test_auto_does_not_start_a_build_while_one_runs(cache, monkeypatch):
    monkeypatch.setattr(_cxx.subprocess, "Popen", lambda *a, **k: pytest.fail("spawned"))
    fd = os.open(cache / _cxx.LOCK, os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert _cxx.load_if_built()[2] is False
    finally:
        os.close(fd)


def test_the_background_build_runs_without_the_recorder_and_its_own_session(cache,
                                                                             monkeypatch):
    calls = []
    monkeypatch.setattr(_cxx.subprocess, "Popen", lambda argv, **kw: calls.append((argv, kw)))
    monkeypatch.setenv("FRFORENSICS_ENABLE", "1")
    assert _cxx.load_if_built()[2] is True
    (argv, kw), = calls
    assert argv[1:5] == ["-m", "frforensics.recorder._cxx", "--background", "--lock-fd"]
    assert kw["start_new_session"] and "FRFORENSICS_ENABLE" not in kw["env"]
    assert kw["pass_fds"] == (int(argv[5]),)  # the build lock, handed over
    assert _cxx.load_if_built()[2] is False  # once per process
    assert kw["env"]["FRFORENSICS_CXX_CACHE"] == os.environ["FRFORENSICS_CXX_CACHE"]


def test_a_failed_background_build_is_left_for_later_jobs_and_not_retried_by_auto(
        cache, monkeypatch, capsys):
    def fail(where):
        raise RuntimeError("Error building extension: c++: not found")

    monkeypatch.setattr(_cxx, "_compile", fail)
    monkeypatch.setattr(_cxx.os, "nice", lambda n: 0)
    assert _cxx.main(["--background"]) == 1
    assert "c++: not found" in (cache / _cxx.FAILED).read_text()
    monkeypatch.setattr(_cxx, "_start_background_build", lambda where: pytest.fail("retried"))
    module, why, started = _cxx.load_if_built()
    assert module is None and not started
    assert why.startswith("an earlier build failed (building it failed (RuntimeError: "
                          "Error building extension: c++: not found)")
    # the command a user runs tries again, and a success clears the mark
    monkeypatch.setattr(_cxx, "_compile", lambda where: "module")
    assert _cxx.main([]) == 0
    assert not (cache / _cxx.FAILED).exists()
    assert "native recording path built" in capsys.readouterr().out
