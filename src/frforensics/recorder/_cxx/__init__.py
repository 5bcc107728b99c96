"""The native recording path's build and load (issue 31; docs/recorder-native.md).

``recorder.cpp`` is compiled against the installed torch with
``torch.utils.cpp_extension.load`` and cached per machine architecture, torch
version, Python version and source hash (``~/.cache/frforensics/cxx/...``, or
``$FRFORENSICS_CXX_CACHE``): an extension built against one torch's headers is
never loaded by another.

Two ways to get it:

- :func:`load` (``recorder_path="cxx"``): imports the cached build, or builds it now
  and waits (about 20 s on a 2-core machine);
- :func:`load_if_built` (``recorder_path="auto"``, the default): imports the cached
  build, else returns ``None`` at once -- the job records with the Python wrapper --
  and starts one background build per machine (``nice`` 19, first in line for the
  OOM killer, a session of its own, its output in ``build.log``) so the next job
  records natively. A build started and left without an extension (it failed:
  ``build-failed`` says why; or it died) is not started again by ``auto`` for
  :data:`RETRY_S`; ``frforensics-native-build`` (:func:`main`) builds in the
  foreground whatever an earlier build left, and is what a container image runs
  once.

Where it cannot be built (no compiler, no ninja, no headers, not CPython 3.11) the
recorder uses the Python wrapper; nothing here raises into ``enable()``. A build
runs under an ``flock`` of our own (the kernel releases it if its holder dies) in a
private directory, and only a whole extension is moved into place
(``os.replace``), so no process ever imports half a file; directories a killed
build left are removed by the next one. The cache's files are opened without
following links and only when they are regular files (a FIFO planted there must
not block a job's start). A process that waits more than :data:`BUILD_WAIT_S` for
another's build records with the Python wrapper.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).resolve().parent / "recorder.cpp"

_lock = threading.Lock()
_state: dict[str, Any] = {}

#: how long a process waits for another one building the extension (then: Python path)
BUILD_WAIT_S = 300.0
#: how long ``auto`` leaves a machine alone after a background build left no extension
RETRY_S = 86400.0
MODULE = "frforensics_recorder_cxx"
LOCK = "frforensics-build.lock"
FAILED = "build-failed"
ATTEMPT = "build-started"
LOG = "build.log"
STAGE_PREFIX = "build-"
_SAFE = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def cache_dir(torch_version: str) -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    base = os.environ.get("FRFORENSICS_CXX_CACHE") or str(
        Path.home() / ".cache" / "frforensics" / "cxx")
    tag = (f"torch-{torch_version}-py{sys.version_info[0]}{sys.version_info[1]}-"
           f"{platform.machine() or 'unknown'}-{digest}")
    return Path(os.path.abspath(base)) / "".join(
        c if c.isalnum() or c in "-._" else "_" for c in tag)


def load() -> tuple[Any, str]:
    """``(module, "")`` once built (built now if need be), or ``(None, why)``; at most
    once per process."""
    with _lock:
        if "module" not in _state:
            _state["module"], _state["why"] = _build()
        return _state["module"], _state["why"]


def load_if_built(start_build: bool = True) -> tuple[Any, str, bool]:
    """``recorder_path="auto"``: ``(module, "", False)`` when a build is cached, else
    ``(None, why, started)`` at once; ``started`` says this process started the
    machine's background build (``start_build``, local rank 0 only). Never raises."""
    with _lock:
        if "module" in _state:
            return _state["module"], _state["why"], False
        try:
            return _if_built(start_build)
        except Exception as exc:  # an unreadable cache: the Python wrapper records
            return None, _reason("its cache is unusable", exc), False


def _if_built(start_build: bool) -> tuple[Any, str, bool]:
    where, why = _where()
    if where is None:
        return None, why, False
    built = where / f"{MODULE}.so"
    if _regular(built):
        try:
            _state["module"], _state["why"] = _import(built), ""
        except Exception as exc:
            _state["module"], _state["why"] = None, _reason(
                "loading it failed; `frforensics-native-build` builds it again", exc)
        return _state["module"], _state["why"], False
    left = _left_behind(where)
    if left:
        return None, left, False
    if not start_build or os.environ.get("LOCAL_RANK", "0") != "0":
        return None, "not built on this machine yet", False
    started = _start_background_build(where)
    return None, "being built on this machine" if started else "not built on this machine yet", \
        started


def _where() -> tuple[Path | None, str]:
    if sys.implementation.name != "cpython" or sys.version_info[:2] != (3, 11):
        return None, f"the native path walks CPython 3.11 frames (this is {sys.version})"
    try:
        import torch

        return cache_dir(str(torch.__version__)), ""
    except Exception as exc:  # no torch, no home directory, an unreadable source
        return None, _reason("no place to build it", exc)


def _reason(what: str, exc: BaseException) -> str:
    first = str(exc).strip().splitlines()
    return f"{what} ({type(exc).__name__}: {first[0][:300] if first else ''})"


def _regular(path: Path) -> bool:
    """A regular file, not through a link (a FIFO or device would block or lie)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _read_small(path: Path, limit: int = 400) -> str | None:
    """At most ``limit`` bytes of a regular file, never through a link or blocking."""
    try:
        fd = os.open(path, os.O_RDONLY | _SAFE)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit).decode("utf-8", errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def _left_behind(where: Path) -> str:
    """Why ``auto`` starts no build: a recent one left no extension ("" if none did)."""
    try:
        age = time.time() - os.lstat(where / ATTEMPT).st_mtime
    except OSError:
        return ""
    if age >= RETRY_S:
        return ""
    text = _read_small(where / FAILED)
    if text is not None:
        lines = text.strip().splitlines()
        return (f"an earlier build failed ({lines[0] if lines else 'no reason left'}; "
                "`frforensics-native-build` tries again)")
    if _busy(where / LOCK):
        return "being built on this machine"
    return (f"a build started {age / 60:.0f} min ago left no extension (see {LOG}; "
            "`frforensics-native-build` tries again)")


def _build(wait_s: float | None = None, lock_fd: int = -1,
           rebuild: bool = False) -> tuple[Any, str]:
    """Import the cached build, or build it under the build lock (``lock_fd``: held
    already, handed over by the process that started this background build).
    ``rebuild``: a cached extension that does not import is built again. A failure
    is left in ``build-failed`` under the lock; a success clears it."""
    where, why = _where()
    if where is None:
        return None, why
    wait = BUILD_WAIT_S if wait_s is None else wait_s
    built = where / f"{MODULE}.so"
    try:
        where.mkdir(parents=True, exist_ok=True)
        cached = _cached(built, rebuild)
        if cached is not None:  # loaded without a lock or ninja
            return cached, ""
        with _held(lock_fd) if lock_fd >= 0 else _exclusive(where / LOCK, wait) as mine:
            if not mine:
                return None, (f"another process has been building it for over {wait:g} s "
                              f"({where})")
            cached = _cached(built, rebuild)  # built by the process we waited for
            if cached is not None:
                return cached, ""
            try:
                module = _compile(where)
            except BaseException as exc:
                _mark_failed(where, _reason("building it failed", exc))
                raise
            _unlink(where / FAILED)
            return module, ""
    except BaseException as exc:  # a compiler error is SystemExit-free but be thorough
        return None, _reason("building it failed", exc)


def _cached(built: Path, rebuild: bool) -> Any:
    if not _regular(built):
        return None
    if not rebuild:
        return _import(built)
    try:
        return _import(built)
    except Exception:
        return None  # a broken or foreign file: built again, replaced whole


def _mark_failed(where: Path, why: str) -> None:
    with contextlib.suppress(OSError):  # whole or not at all, as the extension
        fd, tmp = tempfile.mkstemp(prefix=f"{FAILED}.", dir=where)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(why[:400] + "\n")
        os.replace(tmp, where / FAILED)


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def _compile(where: Path) -> Any:
    """Build in a private directory, then move the whole extension into place.
    Called under the build lock: any directory an earlier build left is stale."""
    from torch.utils.cpp_extension import load as cpp_load

    for old in where.glob(f"{STAGE_PREFIX}*"):
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
    _unlink(where / "lock")  # torch's own lock file, from builds before ours
    # the venv's ninja (pip install ninja) when the shell did not put it on PATH
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + bindir
    stage = Path(tempfile.mkdtemp(prefix=STAGE_PREFIX, dir=where))
    try:
        module = cpp_load(name=MODULE, sources=[str(SOURCE)], build_directory=str(stage),
                          extra_cflags=["-O2"], verbose=False)
        os.replace(stage / f"{MODULE}.so", where / f"{MODULE}.so")
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return module


def _import(path: Path) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(MODULE, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _busy(path: Path) -> bool:
    """Whether another process holds the build lock (a build is under way)."""
    try:
        with _exclusive(path, 0.0) as mine:
            return not mine
    except OSError:
        return False


#: what the builder must not inherit: the recorder's switch and torch's backend
#: autoload (its ``import torch`` would run every ``torch.backends`` entry point,
#: ours included), the launcher's identity of the rank
_NOT_INHERITED = ("FRFORENSICS_ENABLE", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                  "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
                  "MASTER_PORT")


def _builder_env(where: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _NOT_INHERITED and not k.startswith("TORCHELASTIC_")}
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    env["FRFORENSICS_CXX_CACHE"] = str(where.parent)  # absolute: the builder's cwd differs
    # the package this process imports, whatever put it on this process's path
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _start_background_build(where: Path) -> bool:
    """One build for the machine, in a process of its own that outlives the job.

    The build lock is taken here and handed to the builder (its descriptor, inherited):
    no second job or rank can start another between this check and the builder's
    start. ``/bin/sh`` starts the builder in the background and exits at once, so
    the job waits for no child and is left with no zombie."""
    if _state.get("started") or not sys.executable or not os.path.isfile(sys.executable):
        return False
    fd = log = -1
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd = os.open(where / LOCK, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a build is under way
        log = os.open(where / LOG, os.O_CREAT | os.O_WRONLY | os.O_APPEND | _SAFE, 0o644)
        if not stat.S_ISREG(os.fstat(log).st_mode):
            return False
        with open(where / ATTEMPT, "w", opener=_no_follow_opener) as stamp:
            stamp.write(f"{time.time():.0f}\n")
        shell = subprocess.Popen(
            ["/bin/sh", "-c", '"$0" -m frforensics.recorder._cxx --background --lock-fd '
             f'{fd} </dev/null >&{log} 2>&1 &', sys.executable],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, pass_fds=(fd, log), cwd=str(where),
            env=_builder_env(where))
        shell.wait(timeout=10)
        _state["started"] = shell.returncode == 0
    except Exception:  # never the job's problem: this job records with the Python wrapper
        return False
    finally:
        for f in (fd, log):
            if f >= 0:
                os.close(f)  # the builder's copy keeps the lock until it exits
    return bool(_state["started"])


def _no_follow_opener(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)


@contextlib.contextmanager
def _held(fd: int) -> Iterator[bool]:
    try:
        yield True
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


@contextlib.contextmanager
def _exclusive(path: Path, wait_s: float) -> Iterator[bool]:
    """An exclusive ``flock`` on ``path`` (released by the kernel if its holder dies),
    waited for at most ``wait_s``; yields whether it is held."""
    # never through a link: a planted one would make us create or lock another file
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.2)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def main(argv: Sequence[str] | None = None) -> int:
    """``frforensics-native-build``: build the native path for the installed torch now
    (a container image's build step, or after a failed build); prints where, or why
    not. A cached extension that does not import is built again.

    ``--background`` is the build ``recorder_path="auto"`` starts: lowest priority,
    first in line for the OOM killer, no waiting for another build."""
    args = list(sys.argv[1:] if argv is None else argv)
    background = "--background" in args
    lock_fd = -1
    if "--lock-fd" in args:
        with contextlib.suppress(ValueError, IndexError):
            lock_fd = int(args[args.index("--lock-fd") + 1])
    if background:
        with contextlib.suppress(OSError):
            os.nice(19)
        # the builder, not the training job, is what a memory limit should kill
        with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as fh:
            fh.write("1000")
    module, why = _build(wait_s=0.0 if background else None, lock_fd=lock_fd,
                         rebuild=not background)
    if module is not None:
        where, _ = _where()
        print(f"frforensics: native recording path built: {where}/{MODULE}.so")
        return 0
    print(f"frforensics: the native recording path cannot be built here: {why}",
          file=sys.stderr)
    return 1
