"""The one way frforensics writes a file: a new temp file in the target folder, renamed.

Every file the recorder, the verdict and the CLI write (dumps, tail digests,
path lists, reports, timelines) goes through :func:`write_atomic` (or
:func:`atomic_file` for a writer that streams). Why:

* a reader never sees half a file (the data is flushed — and fsynced for dumps,
  ``durable=True`` — then ``os.replace`` puts it in place in one step);
* a character device named as the target (``-o /dev/null``, ``/dev/stdout``) is
  written into, never replaced; a FIFO or socket there is refused (it could block);
* nothing is ever written *through* a link to a file: the temp file is created by
  ``tempfile.mkstemp`` (``O_CREAT|O_EXCL``, a random name: a planted link there
  makes the create fail, it is never followed) in the target's own folder, and
  ``os.replace`` replaces a link planted at the target by the file, never the
  link's target;
* a write that fails (a full disk, ``RLIMIT_FSIZE``, no such folder, no
  permission) leaves no temp file behind and raises one :class:`WriteError`
  (an ``OSError``) naming the target path, which the CLI prints as one line
  and exit code 2 and the recorder logs as one line.

This module imports nothing of frforensics: ``formats``, the recorder and the
CLI all use it (docs/security.md, "writing files").
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["WriteError", "atomic_file", "safe_dir", "write_atomic"]


class WriteError(OSError):
    """A file could not be written; ``str()`` is one line naming the target path."""

    def __init__(self, path: str | os.PathLike[str], exc: BaseException) -> None:
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        super().__init__(getattr(exc, "errno", None), f"{os.fspath(path)}: cannot write ({reason})")
        self.path = os.fspath(path)

    def __str__(self) -> str:
        return str(self.strerror)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str], *, binary: bool = False, mode: int = 0o644,
                make_parents: bool = False, durable: bool = False) -> Iterator[Any]:
    """A file object whose contents become ``path`` when the block ends without error.

    On any error (in the block or while writing) the temp file is removed, the
    target is untouched, and :class:`WriteError` names ``path``.
    """
    target = Path(path)
    tmp: str | None = None
    try:
        if make_parents:
            target.parent.mkdir(parents=True, exist_ok=True)
        device = _device(target)
        if device is not None:  # /dev/null, /dev/stdout, /dev/full: written into, never replaced
            dev: IO[Any] = os.fdopen(device, "wb") if binary else os.fdopen(
                device, "w", encoding="utf-8")
            with dev:
                yield dev
            return
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        os.fchmod(fd, mode)
        fh: IO[Any] = os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")
        with fh:
            yield fh
            fh.flush()
            if durable:  # dumps: on disk before the rename (a crash right after keeps them)
                os.fsync(fh.fileno())
        os.replace(tmp, target)
        tmp = None
    except OSError as exc:
        if isinstance(exc, WriteError):
            raise
        raise WriteError(target, exc) from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _device(target: Path) -> int | None:
    """A descriptor open for writing on ``target`` when it is a character device (through
    a link too: ``-o /dev/stdout``), ``None`` for anything to be created or replaced;
    :class:`WriteError` for a FIFO or socket (writing one can block forever)."""
    try:
        st = os.stat(target)
    except OSError:
        return None
    if stat.S_ISCHR(st.st_mode):
        return os.open(target, os.O_WRONLY)
    if stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
        raise WriteError(target, OSError("a FIFO or socket is there, not a file"))
    return None


def write_atomic(path: str | os.PathLike[str], data: bytes | str, *, mode: int = 0o644,
                 make_parents: bool = False, durable: bool = False) -> Path:
    """Write ``data`` (bytes, or text as UTF-8) to ``path`` atomically, never through a
    link; returns the path. ``durable``: fsync before the rename (dumps; reports are
    rewritten by any rerun and skip it). :class:`WriteError` (one line naming ``path``)
    on failure."""
    with atomic_file(path, binary=True, mode=mode, make_parents=make_parents,
                     durable=durable) as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


def safe_dir(path: str | os.PathLike[str]) -> Path:
    """Make ``path`` (and its parents) a folder and check that it is one of this user's
    own, not a link planted there (a peer sharing the dump folder could point the
    verdict's work folder elsewhere); :class:`WriteError` otherwise."""
    target = Path(path)
    try:
        target.mkdir(parents=True, exist_ok=True)
        st = os.lstat(target)
    except OSError as exc:
        raise WriteError(target, exc) from None
    if not stat.S_ISDIR(st.st_mode):
        raise WriteError(target, OSError("not a folder (a link or a file is there)"))
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise WriteError(target, OSError("the folder belongs to another user"))
    return target
