"""Find dump files, decode them in parallel, and assign ranks.

Inputs are files, directory trees, or ``.tar``/``.tar.gz``/``.tgz``/``.zip``
archives of them, whatever the file names: the format is sniffed from content.
The rank comes from the dump's content when it carries one (our frdump), else
from the file name's trailing integer (``nccl_trace_rank_3``,
``node07-nccl_trace_rank_3.pkl``, torchft's ``..._quorum_7/3``); ``prefix``
narrows the files to ``<prefix><rank>``.

In a directory walk, a file that is no dump in any format and carries no rank
number in its name (a README, an expected.json) is skipped quietly; every other
failure is a :class:`~frforensics.report.LoadProblem` and the other ranks are
still analyzed.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import re
import tarfile
import zipfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from frforensics._gc import gc_paused
from frforensics.analyzer.digest import DEFAULT_TAIL, RankDigest, digest
from frforensics.errors import DumpError, NotADumpError, UsageError
from frforensics.formats import decode_dump, native, sniff_format
from frforensics.model import GroupInfo, RankTrace, SourceFormat
from frforensics.report import LoadProblem

__all__ = ["DumpSet", "DumpSource", "digest_files", "discover", "load_dumps", "rank_from_name"]

MAX_DUMP_BYTES: Final = 4 << 30
_TRAILING_INT: Final = re.compile(r"(\d+)(?:\.[A-Za-z][A-Za-z0-9]*)*$")
_ARCHIVE_SUFFIXES: Final = (".tar", ".tar.gz", ".tgz", ".zip")


@dataclass(frozen=True, slots=True)
class DumpSource:
    """One candidate dump: a file on disk, or a member of an archive."""

    label: str  # what reports call it
    path: str | None = None  # on-disk file, read by the worker
    data: bytes | None = None  # archive member bytes
    explicit: bool = False  # named on the command line (not found by a walk)


@dataclass(slots=True)
class DumpSet:
    """Every rank's digest, plus what could not be read."""

    digests: dict[int, RankDigest] = field(default_factory=dict)
    problems: list[LoadProblem] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    companions: list[str] = field(default_factory=list)  # native dumps beside our frdump

    @property
    def ranks(self) -> list[int]:
        return sorted(self.digests)


def rank_from_name(name: str, prefix: str | None = None) -> int | None:
    """The rank a file name implies, or ``None``.

    With ``prefix``, the base name must be ``<prefix><rank>`` (an extension may
    follow); without, the trailing integer of the base name.
    """
    base = name.rstrip("/").rsplit("/", 1)[-1]
    if prefix is not None:
        if not base.startswith(prefix):
            return None
        base = base[len(prefix):]
        match = re.fullmatch(r"(\d+)(?:\.[A-Za-z][A-Za-z0-9]*)*", base)
        return int(match.group(1)) if match else None
    match = _TRAILING_INT.search(base)
    return int(match.group(1)) if match else None


def _is_archive(name: str) -> bool:
    return name.lower().endswith(_ARCHIVE_SUFFIXES)


def _archive_members(path: Path) -> Iterator[DumpSource]:
    label = str(path)
    if path.name.lower().endswith(".zip"):
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if info.is_dir() or info.file_size > MAX_DUMP_BYTES:
                    continue
                if _hidden(info.filename):
                    continue
                yield DumpSource(label=f"{label}!{info.filename}", data=zf.read(info))
        return
    with tarfile.open(path) as tf:
        for member in tf:
            if not member.isfile() or member.size > MAX_DUMP_BYTES or _hidden(member.name):
                continue
            fh = tf.extractfile(member)
            if fh is not None:
                yield DumpSource(label=f"{label}!{member.name}", data=fh.read())


def _hidden(name: str) -> bool:
    return any(part.startswith(".") for part in Path(name).parts if part not in (".", ".."))


def discover(paths: Sequence[str | os.PathLike[str]]) -> tuple[list[DumpSource], list[LoadProblem]]:
    """Expand ``paths`` into candidate dumps (directories walked, archives opened)."""
    sources: list[DumpSource] = []
    problems: list[LoadProblem] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise UsageError(f"{path}: no such file or directory")
        try:
            if path.is_dir():
                for dirpath, dirnames, filenames in os.walk(path):
                    dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                    for name in sorted(filenames):
                        if name.startswith("."):
                            continue  # temp files of atomic writes, editor files
                        full = Path(dirpath) / name
                        if _is_archive(name):
                            sources.extend(_archive_members(full))
                        else:
                            sources.append(DumpSource(label=str(full), path=str(full)))
            elif _is_archive(path.name):
                sources.extend(_archive_members(path))
            else:
                sources.append(DumpSource(label=str(path), path=str(path), explicit=True))
        except (OSError, tarfile.TarError, zipfile.BadZipFile, EOFError) as exc:
            problems.append(LoadProblem(str(path), f"cannot read archive or directory: {exc}"))
    return sources, problems


# ------------------------------------------------------------------ decoding

@dataclass(frozen=True, slots=True)
class _Outcome:
    label: str
    digest: RankDigest | None = None
    error: str | None = None
    quiet: bool = False  # a non-dump file found by a walk: skip without a problem


def _decode_one(source: DumpSource, prefix: str | None, tail: int) -> _Outcome:
    name_rank = rank_from_name(source.label, prefix)
    if prefix is not None and name_rank is None and not source.explicit:
        return _Outcome(source.label, quiet=True)
    try:
        if source.data is not None:
            data = source.data
        else:
            assert source.path is not None
            size = os.path.getsize(source.path)
            if size > MAX_DUMP_BYTES:
                raise NotADumpError(f"{source.label}: {size} bytes is too large for a dump")
            with open(source.path, "rb") as fh:
                data = fh.read()
        if sniff_format(data[:64]) is None and name_rank is None and not source.explicit:
            return _Outcome(source.label, quiet=True)
        trace = _decode_for_digest(data, source=source.label, rank_hint=name_rank, tail=tail)
        del data
        if trace.rank is None:
            return _Outcome(
                source.label,
                error="cannot tell which rank wrote this dump (no rank in its content or its "
                "name); rename it <prefix><rank> or pass --prefix",
            )
        return _Outcome(source.label, digest=digest(trace, rank=trace.rank, tail=tail))
    except NotADumpError as exc:
        quiet = name_rank is None and not source.explicit
        return _Outcome(source.label, error=_strip_label(str(exc), source.label), quiet=quiet)
    except DumpError as exc:
        return _Outcome(source.label, error=_strip_label(str(exc), source.label))
    except OSError as exc:
        return _Outcome(source.label, error=f"cannot read: {exc.strerror or exc}")
    except MemoryError:
        return _Outcome(source.label, error="out of memory while decoding")


def _decode_for_digest(data: bytes, *, source: str, rank_hint: int | None, tail: int) -> RankTrace:
    """``decode_dump``, but native dumps resolve stacks and shapes only where the digest looks.

    The digest keeps full details of the last ``tail`` entries and the unfinished
    ones; :func:`native.to_trace` with ``detail_tail`` builds exactly those (see
    its docstring), which halves the cost of reading a native pickle.
    """
    fmt = sniff_format(data[:64])
    if fmt is SourceFormat.NATIVE_PICKLE:
        return native.pickle_to_trace(data, source=source, rank=rank_hint, detail_tail=tail)
    if fmt is SourceFormat.NATIVE_JSON:
        doc = native.decode_json(data, source=source)
    else:
        return decode_dump(data, source=source, rank_hint=rank_hint)
    return native.to_trace(doc, source=source, fmt=fmt, rank=rank_hint, detail_tail=tail)


def _strip_label(message: str, label: str) -> str:
    return message[len(label) + 2:] if message.startswith(label + ": ") else message


def _decode_batch(batch: list[DumpSource], prefix: str | None, tail: int) -> list[_Outcome]:
    out = []
    # Every rank lists the groups it belongs to, the default group with all its
    # ranks: at 16,384 ranks that is 16,384 ints per digest, 10 GB if each digest
    # kept its own copy. Equal groups share one object within a batch, which the
    # pickle carrying the batch back then stores once.
    shared: dict[GroupInfo, GroupInfo] = {}
    for source in batch:
        with gc_paused():
            outcome = _decode_one(source, prefix, tail)
        if outcome.digest is not None:
            groups = tuple(shared.setdefault(g, g) for g in outcome.digest.groups)
            outcome = replace(outcome, digest=replace(outcome.digest, groups=groups))
        out.append(outcome)
    return out


def digest_files(
    files: Sequence[tuple[str, str, bool]], *, prefix: str | None = None, tail: int = DEFAULT_TAIL,
) -> tuple[list[RankDigest], list[LoadProblem], list[str]]:
    """Digest local files, for a loader on another host (``analyzer.cluster``).

    ``files`` are ``(label, path, explicit)``; archives are opened here, their
    members labelled ``label!member``. Returns the digests (equal groups
    shared), the load problems and the labels of skipped non-dumps; never
    raises for a bad file.
    """
    sources: list[DumpSource] = []
    problems: list[LoadProblem] = []
    for label, path, explicit in files:
        if not _is_archive(path):
            sources.append(DumpSource(label=label, path=path, explicit=explicit))
            continue
        try:
            members, bad = discover([path])
        except UsageError as exc:
            problems.append(LoadProblem(label, str(exc)))
            continue
        sources.extend(replace(m, label=label + m.label[len(path):]) for m in members)
        problems.extend(replace(p, path=label + p.path[len(path):]) for p in bad)
    digests: list[RankDigest] = []
    skipped: list[str] = []
    for out in _decode_batch(sources, prefix, tail):
        if out.digest is not None:
            digests.append(out.digest)
        elif out.quiet:
            skipped.append(out.label)
        else:
            problems.append(LoadProblem(out.label, out.error or "unreadable"))
    return digests, problems, skipped


def _executor(jobs: int) -> Executor:
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    # forked from a process whose collector is paused (load_dumps): workers turn
    # it back on, and pause it per dump themselves, so garbage with cycles is
    # still collected between dumps
    return ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=gc.enable)


def load_dumps(
    paths: Sequence[str | os.PathLike[str]],
    *,
    prefix: str | None = None,
    jobs: int | None = None,
    tail: int = DEFAULT_TAIL,
    progress: Callable[[int, int], None] | None = None,
) -> DumpSet:
    """Discover and decode every dump under ``paths`` into a :class:`DumpSet`.

    ``jobs`` worker processes decode in parallel (default: the machine's cores);
    ``progress(done, total)`` is called as files finish.
    """
    # The collector stays off for the whole load: digests arriving from the
    # workers are hundreds of thousands of long-lived objects, and every
    # collection would rescan all of them (nothing here makes reference cycles).
    with gc_paused():
        return _load(paths, prefix=prefix, jobs=jobs, tail=tail, progress=progress)


def _load(
    paths: Sequence[str | os.PathLike[str]],
    *,
    prefix: str | None,
    jobs: int | None,
    tail: int,
    progress: Callable[[int, int], None] | None,
) -> DumpSet:
    sources, problems = discover(paths)
    result = DumpSet(problems=problems)
    total = len(sources)
    jobs = max(1, jobs or os.cpu_count() or 1)
    outcomes: list[_Outcome] = []
    if jobs == 1 or total < 8:
        for i, source in enumerate(sources):
            outcomes.append(_decode_one(source, prefix, tail))
            if progress:
                progress(i + 1, total)
    else:
        # Batches amortize the per-task overhead; several per worker keep cores busy.
        size = max(1, min(64, total // (jobs * 4) or 1))
        batches = [sources[i:i + size] for i in range(0, total, size)]
        done = 0
        with _executor(jobs) as pool:
            for batch_out in pool.map(_decode_batch, batches, [prefix] * len(batches),
                                      [tail] * len(batches)):
                outcomes.extend(batch_out)
                done += len(batch_out)
                if progress:
                    progress(done, total)
    for out in outcomes:
        if out.digest is None:
            if out.quiet:
                result.skipped.append(out.label)
            else:
                result.problems.append(LoadProblem(out.label, out.error or "unreadable"))
            continue
        _add(result, out.digest)
    return result


def _add(result: DumpSet, new: RankDigest) -> None:
    old = result.digests.get(new.rank)
    if old is None:
        result.digests[new.rank] = new
        return
    if (old.format == "frdump") != (new.format == "frdump"):
        # The recorder saves PyTorch's own dump beside ours: ours says more (states,
        # times, peers, stacks at dump time), so it wins and the pair is no problem.
        keep, drop = (old, new) if old.format == "frdump" else (new, old)
        result.digests[new.rank] = keep
        result.companions.append(drop.source)
        return
    keep, drop = (new, old) if new.newest_time_ns > old.newest_time_ns else (old, new)
    result.digests[new.rank] = keep
    result.problems.append(
        LoadProblem(
            drop.source,
            f"duplicate dump for rank {new.rank} (also {keep.source}); using the newer one — "
            "pass one job's (or one quorum's) directory to analyze it alone",
        )
    )

