"""The native path's build (recorder/_cxx): never makes enable() wait for good (what a
killed build left is cleared, another live build is waited for at most BUILD_WAIT_S,
then the Python wrapper records), only a whole extension is ever in place, and the
default ``recorder_path="auto"`` takes a cached build, else starts one background
build per machine and never retries a failed one on its own."""

from __future__ import annotations

import fcntl
import os
import sys
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
    assert _cxx.load_if_built() == (None, "being built on this machine", True)
    assert started == [cache]


def test_auto_does_not_start_a_build_while_one_runs(cache, monkeypatch):
    monkeypatch.setattr(_cxx.subprocess, "Popen", lambda *a, **k: pytest.fail("spawned"))
    fd = os.open(cache / _cxx.LOCK, os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert _cxx.load_if_built()[2] is False
    finally:
        os.close(fd)


class _Shell:
    returncode = 0

    def __init__(self, calls, argv, **kw):
        calls.append((argv, kw))

    def wait(self, timeout=None):
        return 0


def test_the_background_build_is_handed_the_lock_and_inherits_no_recorder_or_rank(
        cache, monkeypatch):
    calls: list = []
    monkeypatch.setattr(_cxx.subprocess, "Popen", lambda argv, **kw: _Shell(calls, argv, **kw))
    for name, value in (("FRFORENSICS_ENABLE", "1"), ("RANK", "0"), ("MASTER_PORT", "1"),
                        ("TORCHELASTIC_RUN_ID", "x")):
        monkeypatch.setenv(name, value)
    assert _cxx.load_if_built()[2] is True
    (argv, kw), = calls
    assert argv[0] == "/bin/sh" and argv[3] == sys.executable
    lock_fd, log_fd = kw["pass_fds"]
    assert f"--background --lock-fd {lock_fd} " in argv[2] and f">&{log_fd} " in argv[2]
    assert argv[2].rstrip().endswith("&")  # sh leaves it running and exits: no zombie
    env = kw["env"]
    assert kw["start_new_session"] and env["TORCH_DEVICE_BACKEND_AUTOLOAD"] == "0"
    assert not {"FRFORENSICS_ENABLE", "RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} & set(env)
    assert env["FRFORENSICS_CXX_CACHE"] == str(cache.parent)
    assert (cache / _cxx.ATTEMPT).is_file()
    assert _cxx.load_if_built()[2] is False  # once per process


def test_a_relative_cache_setting_is_made_absolute(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FRFORENSICS_CXX_CACHE", "rel/cache")
    assert _cxx.cache_dir("2.13.0").parent == tmp_path / "rel" / "cache"


def test_a_failed_background_build_is_left_for_later_jobs_and_not_retried_by_auto(
        cache, monkeypatch, capsys):
    def fail(where):
        raise RuntimeError("Error building extension: c++: not found")

    (cache / _cxx.ATTEMPT).write_text("")  # what the process that started it leaves
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


def test_a_build_that_died_is_not_restarted_until_a_day_later(cache, monkeypatch):
    (cache / _cxx.ATTEMPT).write_text("")  # started, then nothing: no extension, no reason
    started = []
    monkeypatch.setattr(_cxx, "_start_background_build",
                        lambda where: started.append(where) or True)
    module, why, _ = _cxx.load_if_built()
    assert module is None and why.startswith("a build started 0 min ago left no extension")
    assert started == []
    monkeypatch.setattr(_cxx, "RETRY_S", 0.0)
    assert _cxx.load_if_built()[2] is True


def test_a_cached_extension_that_does_not_load_is_built_again_by_the_command(cache,
                                                                            monkeypatch):
    (cache / f"{_cxx.MODULE}.so").write_bytes(b"not an ELF file")
    module, why, _ = _cxx.load_if_built()
    assert module is None and why.startswith("loading it failed; `frforensics-native-build`")
    built = []
    monkeypatch.setattr(_cxx, "_compile", lambda where: built.append(where) or "module")
    assert _cxx.main([]) == 0 and built == [cache]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("name", [_cxx.FAILED, _cxx.LOG, f"{_cxx.MODULE}.so"])
def test_a_fifo_planted_in_the_cache_never_blocks_a_jobs_start(cache, monkeypatch, name):
    os.mkfifo(cache / name)
    (cache / _cxx.ATTEMPT).write_text("")
    monkeypatch.setattr(_cxx, "RETRY_S", 0.0 if name == _cxx.LOG else 86400.0)
    monkeypatch.setattr(_cxx.subprocess, "Popen", lambda *a, **k: pytest.fail("spawned"))
    module, _why, started = _cxx.load_if_built()
    assert module is None and not started


def test_a_link_in_place_of_the_log_is_not_followed(cache, monkeypatch, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    (cache / _cxx.LOG).symlink_to(victim)
    monkeypatch.setattr(_cxx.subprocess, "Popen", lambda *a, **k: pytest.fail("spawned"))
    assert _cxx.load_if_built()[2] is False
    assert victim.read_text() == "mine\n"


def test_an_unusable_cache_is_a_reason_never_an_exception(monkeypatch, tmp_path):
    monkeypatch.setattr(_cxx, "_state", {})
    monkeypatch.setenv("FRFORENSICS_CXX_CACHE", str(tmp_path / ("x" * 300)))
    # a name too long for the file system: every step fails with OSError, none raises
    module, why, started = _cxx.load_if_built()
    assert module is None and not started and why == "not built on this machine yet", why
    module, why = _cxx.load()
    assert module is None and "OSError" in why, why
