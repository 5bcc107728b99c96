"""The native recording path's build and load (issue 31; docs/recorder-native.md).

``recorder.cpp`` is compiled against the installed torch with
``torch.utils.cpp_extension.load`` and cached per torch version, Python version and
source hash (``~/.cache/frforensics/cxx/...``, or ``$FRFORENSICS_CXX_CACHE``): an
extension built against one torch's headers is never loaded by another.

Two ways to get it:

- :func:`load` (``recorder_path="cxx"``): imports the cached build, or builds it now
  and waits (about 20 s on a 2-core machine);
- :func:`load_if_built` (``recorder_path="auto"``, the default): imports the cached
  build, else returns ``None`` at once -- the job records with the Python wrapper --
  and starts one background build per machine (``nice`` 19, its own session, its
  output in ``build.log``) so the next job records natively. A build that failed
  leaves ``build-failed`` (its reason) and ``auto`` does not try again;
  ``frforensics-native-build`` (:func:`main`) builds in the foreground whatever an
  earlier build left, and is what a container image runs once.

Where it cannot be built (no compiler, no ninja, no headers, not CPython 3.11) the
recorder uses the Python wrapper. A build runs under an ``flock`` of our own (the
kernel releases it if its holder dies) in a private directory, and only a whole
extension is moved into place (``os.replace``), so no process ever imports half a
file; directories a killed build left are removed by the next one. A process that
waits more than :data:`BUILD_WAIT_S` for another's build records with the Python
wrapper.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
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
MODULE = "frforensics_recorder_cxx"
LOCK = "frforensics-build.lock"
FAILED = "build-failed"
LOG = "build.log"
STAGE_PREFIX = "build-"


def cache_dir(torch_version: str) -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    base = os.environ.get("FRFORENSICS_CXX_CACHE") or str(
        Path.home() / ".cache" / "frforensics" / "cxx")
    tag = f"torch-{torch_version}-py{sys.version_info[0]}{sys.version_info[1]}-{digest}"
    return Path(base) / "".join(c if c.isalnum() or c in "-._" else "_" for c in tag)


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
    machine's background build (``start_build``, local rank 0 only)."""
    with _lock:
        if "module" in _state:
            return _state["module"], _state["why"], False
        where, why = _where()
        if where is None:
            return None, why, False
        built = where / f"{MODULE}.so"
        if built.exists():
            try:
                _state["module"], _state["why"] = _import(built), ""
            except Exception as exc:
                _state["module"], _state["why"] = None, _reason("loading it failed", exc)
            return _state["module"], _state["why"], False
        failed = _failure(where)
        if failed:
            return None, (f"an earlier build failed ({failed}; `frforensics-native-build` "
                          "tries again)"), False
        if not start_build or os.environ.get("LOCAL_RANK", "0") != "0":
            return None, "not built on this machine yet", False
        started = _start_background_build(where)
        return None, "not built on this machine yet", started


def _where() -> tuple[Path | None, str]:
    if sys.implementation.name != "cpython" or sys.version_info[:2] != (3, 11):
        return None, f"the native path walks CPython 3.11 frames (this is {sys.version})"
    try:
        import torch
    except Exception as exc:  # pragma: no cover - torch is there when this runs
        return None, f"torch unavailable: {exc}"
    return cache_dir(str(torch.__version__)), ""


def _reason(what: str, exc: BaseException) -> str:
    first = str(exc).strip().splitlines()
    return f"{what} ({type(exc).__name__}: {first[0][:300] if first else ''})"


def _failure(where: Path) -> str:
    with contextlib.suppress(OSError):
        with open(where / FAILED, encoding="utf-8", errors="replace") as fh:
            lines = fh.read(400).strip().splitlines()
        return lines[0] if lines else "no reason left"
    return ""


def _build(wait_s: float | None = None, lock_fd: int = -1) -> tuple[Any, str]:
    """Import the cached build, or build it under the build lock (``lock_fd``: held
    already, handed over by the process that started this background build)."""
    where, why = _where()
    if where is None:
        return None, why
    wait = BUILD_WAIT_S if wait_s is None else wait_s
    built = where / f"{MODULE}.so"
    try:
        where.mkdir(parents=True, exist_ok=True)
        if built.exists():  # cached: loaded without a lock or ninja
            return _import(built), ""
        with _held(lock_fd) if lock_fd >= 0 else _exclusive(where / LOCK, wait) as mine:
            if not mine:
                return None, (f"another process has been building it for over {wait:g} s "
                              f"({where})")
            if built.exists():  # built by the process we waited for
                return _import(built), ""
            module = _compile(where)
            (where / FAILED).unlink(missing_ok=True)
            return module, ""
    except BaseException as exc:  # a compiler error is SystemExit-free but be thorough
        return None, _reason("building it failed", exc)


@contextlib.contextmanager
def _held(fd: int) -> Iterator[bool]:
    try:
        yield True
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def _compile(where: Path) -> Any:
    """Build in a private directory, then move the whole extension into place.
    Called under the build lock: any directory an earlier build left is stale."""
    from torch.utils.cpp_extension import load as cpp_load

    for old in where.glob(f"{STAGE_PREFIX}*"):
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
    (where / "lock").unlink(missing_ok=True)  # torch's own lock file, from builds before ours
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


def _start_background_build(where: Path) -> bool:
    """One build for the machine, in a process of its own that outlives the job.

    The build lock is taken here and handed to the builder (its descriptor, inherited):
    no second job or rank can start another between this check and the builder's
    start."""
    if _state.get("started"):
        return False
    fd = -1
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd = os.open(where / LOCK, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a build is under way
        # the recorder's own switch stays off in the builder (its torch import would
        # otherwise turn it on: recorder/autoload.py)
        env = {k: v for k, v in os.environ.items() if k != "FRFORENSICS_ENABLE"}
        with open(where / LOG, "ab") as log:
            subprocess.Popen(
                [sys.executable, "-m", "frforensics.recorder._cxx", "--background",
                 "--lock-fd", str(fd)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, pass_fds=(fd,), cwd=str(where), env=env)
        _state["started"] = True
    except Exception:  # never the job's problem: this job records with the Python wrapper
        return False
    finally:
        if fd >= 0:
            os.close(fd)  # the builder's copy keeps the lock until it exits
    return True


@contextlib.contextmanager
def _exclusive(path: Path, wait_s: float) -> Iterator[bool]:
    """An exclusive ``flock`` on ``path`` (released by the kernel if its holder dies),
    waited for at most ``wait_s``; yields whether it is held."""
    # never through a link: a planted one would make us create or lock another file
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o644)
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
    (a container image's build step, or after ``build-failed``); prints where, or why not.

    ``--background`` is the build ``recorder_path="auto"`` starts: lowest priority, no
    waiting for another build, a failure left in ``build-failed`` for later jobs."""
    args = list(sys.argv[1:] if argv is None else argv)
    background = "--background" in args
    lock_fd = -1
    if "--lock-fd" in args:
        with contextlib.suppress(ValueError, IndexError):
            lock_fd = int(args[args.index("--lock-fd") + 1])
    if background:
        with contextlib.suppress(OSError):
            os.nice(19)
    where, why = _where()
    if where is not None:
        if not background:
            (where / FAILED).unlink(missing_ok=True)
        module, why = _build(wait_s=0.0 if background else None, lock_fd=lock_fd)
        if module is not None:
            print(f"frforensics: native recording path built: {where / (MODULE + '.so')}")
            return 0
        if background and not why.startswith("another process"):
            with contextlib.suppress(OSError):  # whole or not at all, as the extension
                (where / f"{FAILED}.tmp").write_text(why + "\n", encoding="utf-8")
                os.replace(where / f"{FAILED}.tmp", where / FAILED)
    print(f"frforensics: the native recording path cannot be built here: {why}",
          file=sys.stderr)
    return 1
