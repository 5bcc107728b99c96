"""The native recording path's build and load (issue 31; docs/recorder-native.md).

``recorder.cpp`` is compiled against the installed torch with
``torch.utils.cpp_extension.load`` on first use and cached per torch version,
Python version and source hash (``~/.cache/frforensics/cxx/...``, or
``$FRFORENSICS_CXX_CACHE``): an extension built against one torch's headers is
never loaded by another. Where it cannot be built (no compiler, no ninja, no
headers, not CPython 3.11), :func:`load` says why once and returns ``None``; the
recorder then uses the Python wrapper.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
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


def _build() -> tuple[Any, str]:
    if sys.implementation.name != "cpython" or sys.version_info[:2] != (3, 11):
        return None, f"the native path walks CPython 3.11 frames (this is {sys.version})"
    try:
        import torch
        from torch.utils.cpp_extension import load as cpp_load
    except Exception as exc:  # pragma: no cover - torch is there when this runs
        return None, f"torch.utils.cpp_extension unavailable: {exc}"
    where = cache_dir(str(torch.__version__))
    try:
        where.mkdir(parents=True, exist_ok=True)
        # the venv's ninja (pip install ninja) when the shell did not put it on PATH
        bindir = os.path.dirname(sys.executable)
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + bindir
        module = cpp_load(name="frforensics_recorder_cxx", sources=[str(SOURCE)],
                          build_directory=str(where), extra_cflags=["-O2"], verbose=False)
    except BaseException as exc:  # a compiler error is SystemExit-free but be thorough
        first = str(exc).strip().splitlines()
        return None, f"building it failed ({type(exc).__name__}: {first[0] if first else ''})"
    return module, ""
