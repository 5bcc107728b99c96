"""The native recording path's build and load (issue 31; docs/recorder-native.md).

``recorder.cpp`` is compiled against the installed torch with
``torch.utils.cpp_extension.load`` on first use and cached per torch version,
Python version and source hash (``~/.cache/frforensics/cxx/...``, or
``$FRFORENSICS_CXX_CACHE``): an extension built against one torch's headers is
never loaded by another. Where it cannot be built (no compiler, no ninja, no
headers, not CPython 3.11), :func:`load` says why once and returns ``None``; the
recorder then uses the Python wrapper.

A cached build is imported directly (no lock, no ninja). A build runs under an
``flock`` of our own, which the kernel releases if its holder dies; torch's own lock
file (``FileBaton``), which a process killed mid-build leaves behind and which would
make every later ``load`` wait forever, is removed under it. A process that waits
more than :data:`BUILD_WAIT_S` for another's build records with the Python wrapper.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).resolve().parent / "recorder.cpp"

_lock = threading.Lock()
_state: dict[str, Any] = {}


def cache_dir(torch_version: str) -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    base = os.environ.get("FRFORENSICS_CXX_CACHE") or str(
        Path.home() / ".cache" / "frforensics" / "cxx")
    tag = f"torch-{torch_version}-py{sys.version_info[0]}{sys.version_info[1]}-{digest}"
    return Path(base) / "".join(c if c.isalnum() or c in "-._" else "_" for c in tag)


def load() -> tuple[Any, str]:
    """``(module, "")`` once built, or ``(None, why)``; built at most once per process."""
    with _lock:
        if "module" not in _state:
            _state["module"], _state["why"] = _build()
        return _state["module"], _state["why"]


#: how long a process waits for another one building the extension (then: Python path)
BUILD_WAIT_S = 300.0
MODULE = "frforensics_recorder_cxx"


def _build() -> tuple[Any, str]:
    if sys.implementation.name != "cpython" or sys.version_info[:2] != (3, 11):
        return None, f"the native path walks CPython 3.11 frames (this is {sys.version})"
    try:
        import torch
    except Exception as exc:  # pragma: no cover - torch is there when this runs
        return None, f"torch unavailable: {exc}"
    where = cache_dir(str(torch.__version__))
    built = where / f"{MODULE}.so"
    try:
        where.mkdir(parents=True, exist_ok=True)
        if built.exists():  # cached: loaded without torch's build lock or ninja
            return _import(built), ""
        with _exclusive(where / "frforensics-build.lock", BUILD_WAIT_S) as mine:
            if not mine:
                return None, (f"another process has been building it for over {BUILD_WAIT_S:g} s "
                              f"({where})")
            if built.exists():  # built by the process we waited for
                return _import(built), ""
            # torch's own lock file (FileBaton) left by a process killed while building:
            # nobody else builds while we hold ours, so it is stale and would make
            # torch wait forever
            (where / "lock").unlink(missing_ok=True)
            return _compile(where), ""
    except BaseException as exc:  # a compiler error is SystemExit-free but be thorough
        first = str(exc).strip().splitlines()
        return None, f"building it failed ({type(exc).__name__}: {first[0] if first else ''})"


def _compile(where: Path) -> Any:
    from torch.utils.cpp_extension import load as cpp_load

    # the venv's ninja (pip install ninja) when the shell did not put it on PATH
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + bindir
    return cpp_load(name=MODULE, sources=[str(SOURCE)], build_directory=str(where),
                    extra_cflags=["-O2"], verbose=False)


def _import(path: Path) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(MODULE, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
