"""The one reader: paths in, :class:`~frforensics.model.RankTrace` or load problem out.

``read_sources(paths, *, prefix, limits)`` owns everything between a path a user
typed and a decoded dump, so ``analyze``, ``convert`` and ``timeline`` treat
untrusted files alike:

* **discovery**: files, directory trees (hidden names and symlinked directories
  are not entered) and ``.tar``/``.tar.gz``/``.tgz``/``.tar.xz``/``.tar.bz2``/
  ``.zip`` archives. Only regular files are ever opened: FIFOs, sockets, device
  nodes and links to them, symlink loops, broken links and files that vanish
  are load problems, decided with ``stat`` before any ``open`` (which is
  ``O_NONBLOCK`` and re-checked with ``fstat``, so a file swapped for a FIFO in
  between cannot block the run). The same file named twice, or reached twice
  through links, is read once.
* **archives**: members are read one at a time, in chunks, within caps on the
  total expanded bytes and the ratio to the archive's size; an encrypted or
  unsupported member, or a corrupt stream, is one load problem and the walk
  goes on with the next path.
* **limits**: :class:`~frforensics.formats.limits.Limits`, checked before
  anything is allocated (see docs/security.md).
* **the rank**: from the dump's content, else the file name's trailing integer
  (:func:`rank_from_name`, plausibility-checked).
* **duplicates**: PyTorch's own dump beside ours for one rank is a companion,
  not a problem; two dumps of one format for one rank are a load problem
  (:func:`settle_duplicate` is the policy; ``read_sources`` keeps the first it
  reads, the analyzer's loader the newer).
* **errors**: :func:`read_source` is the single place where any exception a
  decoder raises becomes a :class:`~frforensics.report.LoadProblem` naming the
  file. Nothing here ever runs code from a dump.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tarfile
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Final

from frforensics.errors import DumpError, LimitExceededError, NotADumpError, UsageError
from frforensics.formats import decode_dump, sniff_format
from frforensics.formats.limits import DEFAULT_LIMITS, Limits
from frforensics.model import RankTrace, SourceFormat
from frforensics.report import LoadProblem

__all__ = [
    "DumpSource",
    "Skipped",
    "check_trace",
    "discover",
    "rank_from_name",
    "read_file",
    "read_source",
    "read_sources",
    "settle_duplicate",
]

_TRAILING_INT: Final = re.compile(r"(\d+)(?:\.[A-Za-z][A-Za-z0-9]*)*$")
_PREFIXED_INT: Final = re.compile(r"(\d+)(?:\.[A-Za-z][A-Za-z0-9]*)*")
_ZIP_SUFFIXES: Final = (".zip",)
_TAR_SUFFIXES: Final = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2")
_ZIP_METHODS: Final = frozenset({zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2,
                                 zipfile.ZIP_LZMA})
_CHUNK: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class DumpSource:
    """One candidate dump: a regular file on disk, or a member of an archive (its bytes)."""

    label: str  # what reports call it
    path: str | None = None  # on-disk file, read when decoded
    data: bytes | None = None  # archive member bytes
    explicit: bool = False  # named on the command line (not found by a walk)


@dataclass(frozen=True, slots=True)
class Skipped:
    """A file found by a walk that is no dump and claims no rank (a README): no problem."""

    label: str
    reason: str


# ------------------------------------------------------------------ names

def rank_from_name(name: str, prefix: str | None = None, *,
                   limits: Limits = DEFAULT_LIMITS) -> int | None:
    """The rank a file name implies, or ``None``.

    With ``prefix``, the base name must be ``<prefix><rank>`` (an extension may
    follow); without, the trailing integer of the base name. A number of
    ``limits.max_rank`` or more (a timestamp, a pid) is no rank.
    """
    base = name.rstrip("/").rsplit("/", 1)[-1].rsplit("!", 1)[-1]
    if prefix is not None:
        if not base.startswith(prefix):
            return None
        match = _PREFIXED_INT.fullmatch(base[len(prefix):])
    else:
        match = _TRAILING_INT.search(base)
    if match is None or len(match.group(1).lstrip("0")) > len(str(limits.max_rank)):
        return None
    rank = int(match.group(1))
    return rank if rank < limits.max_rank else None


def _hidden(name: str) -> bool:
    return any(part.startswith(".") and part not in (".", "..") for part in name.split("/"))


def _archive_kind(name: str) -> str | None:
    lower = name.lower()
    if lower.endswith(_ZIP_SUFFIXES):
        return "zip"
    if lower.endswith(_TAR_SUFFIXES):
        return "tar"
    return None


# ------------------------------------------------------------------ discovery

def _kind_word(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _stat_problem(path: str, exc: OSError) -> LoadProblem:
    if exc.errno == errno.ELOOP:
        return LoadProblem(path, "symlink loop: skipped")
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return LoadProblem(path, "vanished, or a link to nothing: skipped")
    return LoadProblem(path, f"cannot read: {exc.strerror or exc}")


def discover(
    paths: Iterable[str | os.PathLike[str]], *, limits: Limits = DEFAULT_LIMITS
) -> Iterator[DumpSource | LoadProblem]:
    """Candidate dumps under ``paths``, lazily: archives are read member by member.

    A path that does not exist at all raises :class:`UsageError` (a typo, not a
    bad dump); everything else that cannot be used is a :class:`LoadProblem`.
    """
    seen: set[tuple[int, int]] = set()
    for raw in paths:
        path = os.fspath(raw)
        try:
            st = os.stat(path)
        except OSError as exc:
            if exc.errno == errno.ENOENT and not os.path.lexists(path):
                raise UsageError(f"{path}: no such file or directory") from None
            yield _stat_problem(path, exc)
            continue
        if stat.S_ISDIR(st.st_mode):
            yield from _walk(path, seen, limits)
        else:
            yield from _candidate(path, st, seen, limits, explicit=True)


def _walk(root: str, seen: set[tuple[int, int]], limits: Limits) -> Iterator[DumpSource | LoadProblem]:
    errors: list[OSError] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=errors.append):
        while errors:
            err = errors.pop()
            yield LoadProblem(str(err.filename or dirpath), f"cannot list: {err.strerror or err}")
        # symlinked directories are not entered (os.walk's default): no loops, no escapes
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith("."):
                continue  # temp files of atomic writes, editor files
            full = os.path.join(dirpath, name)
            try:
                st = os.stat(full)
            except OSError as exc:
                yield _stat_problem(full, exc)
                continue
            if stat.S_ISDIR(st.st_mode):
                continue  # a symlink to a directory
            yield from _candidate(full, st, seen, limits, explicit=False)
    while errors:
        err = errors.pop()
        yield LoadProblem(str(err.filename or root), f"cannot list: {err.strerror or err}")


def _candidate(path: str, st: os.stat_result, seen: set[tuple[int, int]], limits: Limits,
               *, explicit: bool) -> Iterator[DumpSource | LoadProblem]:
    key = (st.st_dev, st.st_ino)
    if key in seen:
        return  # the same file named twice, or reached again through a link
    seen.add(key)
    if not stat.S_ISREG(st.st_mode):
        yield LoadProblem(path, f"{_kind_word(st.st_mode)}, not a dump file: skipped unread")
        return
    kind = _archive_kind(path)
    if kind is None:
        yield DumpSource(label=path, path=path, explicit=explicit)
    else:
        yield from _archive(path, kind, st.st_size, limits)


# ------------------------------------------------------------------ archives

class _Budget:
    """Bytes an archive may still expand to."""

    def __init__(self, label: str, archive_size: int, limits: Limits) -> None:
        self.label = label
        by_ratio = max(limits.archive_ratio_floor_bytes, archive_size * limits.max_archive_ratio)
        self.cap = min(limits.max_archive_bytes, by_ratio)
        self.used = 0

    def spend(self, n: int) -> None:
        self.used += n
        if self.used > self.cap:
            raise LimitExceededError(
                f"{self.label}: expands to more than {self.cap} bytes (limit: "
                f"{self.cap} bytes for this archive); the rest of it is not read — "
                "unpack it and pass the folder if it is genuine"
            )


def _read_member(fh: IO[bytes], label: str, declared: int, budget: _Budget,
                 limits: Limits) -> bytes:
    if declared > limits.max_file_bytes:
        raise LimitExceededError(f"{label}: {declared} bytes is too large for a dump "
                                 f"(limit {limits.max_file_bytes})")
    chunks = []
    total = 0
    while True:
        chunk = fh.read(_CHUNK)
        if not chunk:
            break
        budget.spend(len(chunk))
        total += len(chunk)
        if total > limits.max_file_bytes:
            raise LimitExceededError(f"{label}: expands past {limits.max_file_bytes} bytes, "
                                     "too large for a dump")
        chunks.append(chunk)
    return b"".join(chunks)


def _archive(path: str, kind: str, size: int, limits: Limits) -> Iterator[DumpSource | LoadProblem]:
    budget = _Budget(path, size, limits)
    try:
        if kind == "zip":
            yield from _zip_members(path, budget, limits)
        else:
            yield from _tar_members(path, budget, limits)
    except LimitExceededError as exc:
        yield LoadProblem(path, _strip_label(str(exc), path))
    except Exception as exc:  # zipfile/tarfile/zlib/lzma/bz2 raise many unrelated types
        yield LoadProblem(path, f"cannot read archive ({type(exc).__name__}: {exc}); "
                          "the members read before this point were used")


def _zip_members(path: str, budget: _Budget, limits: Limits) -> Iterator[DumpSource | LoadProblem]:
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        if len(infos) > limits.max_archive_members:
            raise LimitExceededError(f"{path}: {len(infos)} members (limit "
                                     f"{limits.max_archive_members})")
        for info in infos:
            if info.is_dir() or _hidden(info.filename):
                continue
            label = f"{path}!{info.filename}"
            if info.flag_bits & 0x1:
                yield LoadProblem(label, "encrypted zip member: skipped (no passwords are read)")
                continue
            if info.compress_type not in _ZIP_METHODS:
                yield LoadProblem(label, f"zip compression method {info.compress_type} is not "
                                  "supported: skipped (repack with deflate)")
                continue
            try:
                with zf.open(info) as fh:
                    data = _read_member(fh, label, info.file_size, budget, limits)
            except LimitExceededError as exc:
                if budget.used > budget.cap:
                    raise
                yield LoadProblem(label, _strip_label(str(exc), label))
                continue
            except Exception as exc:  # corrupt deflate/bzip2/lzma, bad CRC
                yield LoadProblem(label, f"corrupt zip member ({type(exc).__name__}: {exc})")
                continue
            yield DumpSource(label=label, data=data)


def _tar_members(path: str, budget: _Budget, limits: Limits) -> Iterator[DumpSource | LoadProblem]:
    # stream mode: one pass, no seeking, nothing extracted to disk
    with tarfile.open(path, mode="r|*") as tf:
        count = 0
        for member in tf:
            count += 1
            if count > limits.max_archive_members:
                raise LimitExceededError(f"{path}: more than {limits.max_archive_members} members")
            if not member.isfile() or _hidden(member.name):
                continue  # links, devices, FIFOs inside archives are never created
            label = f"{path}!{member.name}"
            fh = tf.extractfile(member)
            if fh is None:
                continue
            try:
                data = _read_member(fh, label, member.size, budget, limits)
            except LimitExceededError as exc:
                if budget.used > budget.cap:
                    raise
                yield LoadProblem(label, _strip_label(str(exc), label))
                continue
            yield DumpSource(label=label, data=data)


# ------------------------------------------------------------------ reading

def read_file(path: str, *, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The bytes of the regular file ``path``, within ``limits.max_file_bytes``.

    Opened ``O_NONBLOCK`` and checked with ``fstat``: a FIFO or device put in
    the file's place after discovery is refused without a read.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb", buffering=0) as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DumpError(f"{path}: {_kind_word(st.st_mode)}, not a dump file: skipped unread")
        if st.st_size > limits.max_file_bytes:
            raise LimitExceededError(f"{path}: {st.st_size} bytes is too large for a dump "
                                     f"(limit {limits.max_file_bytes})")
        if st.st_size == 0:  # empty, or a file whose size the system does not report
            chunks = []
            total = 0
            while chunk := fh.read(_CHUNK):
                total += len(chunk)
                if total > limits.max_file_bytes:
                    raise LimitExceededError(f"{path}: more than {limits.max_file_bytes} bytes")
                chunks.append(chunk)
            return b"".join(chunks)
        data = fh.read(st.st_size)  # bytes present when stat'ed; a growing file is cut there
        return data or b""


def _strip_label(message: str, label: str) -> str:
    return message[len(label) + 2:] if message.startswith(label + ": ") else message


def check_trace(trace: RankTrace, *, limits: Limits = DEFAULT_LIMITS) -> RankTrace | LoadProblem:
    """``trace``, or the load problem that makes it unusable (no rank, implausible rank)."""
    if trace.rank is None:
        return LoadProblem(trace.source, "cannot tell which rank wrote this dump (no rank in its "
                           "content or its name); rename it <prefix><rank> or pass --prefix")
    if not 0 <= trace.rank < limits.max_rank:
        return LoadProblem(trace.source, f"rank {trace.rank} is not a plausible rank "
                           f"(0 <= rank < {limits.max_rank}): the dump is damaged")
    if trace.world_size is not None and not 0 < trace.world_size <= limits.max_rank:
        return LoadProblem(trace.source, f"world size {trace.world_size} is not plausible "
                           f"(1 to {limits.max_rank}): the dump is damaged")
    return trace


def read_source(
    source: DumpSource,
    *,
    prefix: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    detail_tail: int | None = None,
) -> RankTrace | LoadProblem | Skipped:
    """Decode one candidate; every failure becomes a load problem here and nowhere else.

    ``detail_tail``: see :func:`frforensics.formats.native.to_trace` (the
    analyzer's loader passes its digest tail). A file found by a walk that is no
    dump and carries no rank in its name is :class:`Skipped`.
    """
    label = source.label
    name_rank = rank_from_name(label, prefix, limits=limits)
    if prefix is not None and name_rank is None and not source.explicit:
        return Skipped(label, f"not named {prefix}<rank>")
    quiet = name_rank is None and not source.explicit
    try:
        data = source.data if source.data is not None else read_file(str(source.path), limits=limits)
        if quiet and sniff_format(data[:64]) is None:
            return Skipped(label, "not a dump")
        trace = decode_dump(data, source=label, rank_hint=name_rank, limits=limits,
                            detail_tail=detail_tail)
        del data
        return check_trace(trace, limits=limits)
    except NotADumpError as exc:
        if quiet:
            return Skipped(label, "not a dump")
        return LoadProblem(label, _strip_label(str(exc), label))
    except DumpError as exc:
        return LoadProblem(label, _strip_label(str(exc), label))
    except OSError as exc:
        return LoadProblem(label, f"cannot read: {exc.strerror or exc}")
    except MemoryError:
        return LoadProblem(label, "out of memory while decoding: skipped")
    except RecursionError:
        return LoadProblem(label, "nests too deeply to decode: skipped")
    except Exception as exc:  # a decoder bug must cost one file, never the analysis
        return LoadProblem(label, f"cannot decode ({type(exc).__name__}: {exc}); "
                           "please report this file to frforensics")


def settle_duplicate(old_format: str, old_newest_ns: int, new_format: str,
                     new_newest_ns: int) -> tuple[bool, bool]:
    """Two dumps for one rank: ``(keep_new, companion)``.

    Our frdump beside PyTorch's own dump of the same rank (the recorder saves
    both) is a *companion*: ours says more, so it wins, and that is no problem.
    Two dumps of one kind are a real duplicate: the newer one wins, and the
    caller reports the other.
    """
    old_ours = old_format == SourceFormat.FRDUMP.value
    new_ours = new_format == SourceFormat.FRDUMP.value
    if old_ours != new_ours:
        return new_ours, True
    return new_newest_ns > old_newest_ns, False


def read_sources(
    paths: Sequence[str | os.PathLike[str]],
    *,
    prefix: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    detail_tail: int | None = None,
) -> Iterator[RankTrace | LoadProblem]:
    """Every dump under ``paths`` decoded, one at a time, or the problem that stopped it.

    Streams: a trace is yielded before the next file is read, so memory stays
    at one dump's worth. Of two dumps for one rank the first read is kept (in
    sorted path order); a second of the same format is a load problem, a
    companion of the other format is dropped quietly.
    """
    first: dict[int, tuple[str, str]] = {}
    for item in discover(paths, limits=limits):
        if isinstance(item, LoadProblem):
            yield item
            continue
        out = read_source(item, prefix=prefix, limits=limits, detail_tail=detail_tail)
        if isinstance(out, Skipped):
            continue
        if isinstance(out, LoadProblem):
            yield out
            continue
        assert out.rank is not None  # check_trace
        seen = first.get(out.rank)
        if seen is None:
            first[out.rank] = (out.format.value, out.source)
            yield out
            continue
        _keep_new, companion = settle_duplicate(seen[0], 0, out.format.value, 0)
        if not companion:
            yield LoadProblem(out.source, f"duplicate dump for rank {out.rank} (also {seen[1]}); "
                              "skipped — pass one job's (or one quorum's) directory")
