"""Find dump files, decode them in parallel, and digest them for analysis.

Everything about files — discovery, archives, limits, sniffing, the rank from
the name, the single place where a decoder's exception becomes a load problem —
is :mod:`frforensics.formats.sources` (``read_sources``); this module runs it in
worker processes and keeps each rank's :class:`RankDigest`.

Library API for distributed loaders (e.g. Dask workers on other hosts)::

    digest_paths(paths: Sequence[str], *, prefix: str | None = None,
                 limits: Limits = DEFAULT_LIMITS, tail: int = DEFAULT_TAIL,
                 ) -> list[RankDigest | LoadProblem]
        # on the worker: every dump under these *local* paths (files,
        # directories, archives), digested; never raises for a bad file
        # (a path that does not exist at all raises UsageError)

    digest_source(source: DumpSource, *, prefix=None, limits=DEFAULT_LIMITS,
                  tail=DEFAULT_TAIL) -> RankDigest | LoadProblem | Skipped
        # one candidate found by formats.sources.discover

    assemble(items: Iterable[RankDigest | LoadProblem | Skipped]) -> DumpSet
        # on the driver: duplicates and companions settled, as load_dumps does

Both results pickle small (a digest keeps the tail of the ring, not every
entry). ``load_dumps`` is ``assemble`` over ``digest_source`` in a local
process pool.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from typing import Final

from frforensics._gc import gc_paused
from frforensics.analyzer.digest import DEFAULT_TAIL, DetailTable, EntryDetail, RankDigest, digest
from frforensics.formats.limits import DEFAULT_LIMITS, Limits
from frforensics.formats.sources import (
    DumpSource,
    Skipped,
    discover,
    rank_from_name,
    read_source,
    settle_duplicate,
)
from frforensics.model import Frame, GroupInfo, RankTrace, ThreadStack
from frforensics.report import LoadProblem

__all__ = [
    "DumpSet",
    "DumpSource",
    "assemble",
    "digest_paths",
    "digest_source",
    "discover",
    "load_dumps",
    "rank_from_name",
]

#: Largest dump file read (kept for callers of the old constant; see ``Limits``).
MAX_DUMP_BYTES = DEFAULT_LIMITS.max_file_bytes


@dataclass(slots=True)
class DumpSet:
    """Every rank's digest, plus what could not be read."""

    digests: dict[int, RankDigest] = field(default_factory=dict)
    problems: list[LoadProblem] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    companions: list[str] = field(default_factory=list)  # native dumps beside our frdump
    #: files not read before ``load_dumps``'s deadline, and the ranks their names imply
    #: (the analysis never names those ranks culprits: ``analyzer.consequences``)
    unread: list[str] = field(default_factory=list)
    unread_ranks: list[int] = field(default_factory=list)
    #: the deadline those files missed, in seconds (None: no deadline)
    deadline_s: float | None = None

    @property
    def ranks(self) -> list[int]:
        return sorted(self.digests)

    @classmethod
    def from_traces(cls, traces: Mapping[int, RankTrace]) -> DumpSet:
        """The dump set of traces already decoded in memory (rank -> trace), each
        digested as ``load_dumps`` would (tests, benchmarks, library callers)."""
        return cls(digests={r: digest(t, rank=r) for r, t in traces.items()})

    def add(self, item: RankDigest | LoadProblem | Skipped) -> None:
        """Take one outcome: a digest (duplicates settled), a problem, or a skipped file."""
        if isinstance(item, LoadProblem):
            self.problems.append(item)
        elif isinstance(item, Skipped):
            self.skipped.append(item.label)
        else:
            _add(self, item)


def digest_source(
    source: DumpSource,
    *,
    prefix: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    tail: int = DEFAULT_TAIL,
    window: int | None = None,
) -> RankDigest | LoadProblem | Skipped:
    """Decode and digest one candidate; never raises for a bad file."""
    with gc_paused():
        out = read_source(source, prefix=prefix, limits=limits, detail_tail=tail)
        if isinstance(out, LoadProblem | Skipped):
            return out
        assert out.rank is not None  # read_source checked it
        try:
            return digest(out, rank=out.rank, tail=tail, window=window)
        except MemoryError:
            return LoadProblem(source.label, "out of memory while digesting: skipped")
        except Exception as exc:  # a digest bug must cost one file, never the analysis
            return LoadProblem(source.label, f"cannot digest ({type(exc).__name__}: {exc}); "
                               "please report this file to frforensics")


def digest_paths(
    paths: Sequence[str | os.PathLike[str]],
    *,
    prefix: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    tail: int = DEFAULT_TAIL,
    window: int | None = None,
) -> list[RankDigest | LoadProblem]:
    """Every dump under local ``paths`` digested (skipped non-dumps left out)."""
    out: list[RankDigest | LoadProblem] = []
    for item in discover(paths, limits=limits):
        result = item if isinstance(item, LoadProblem) else digest_source(
            item, prefix=prefix, limits=limits, tail=tail, window=window)
        if not isinstance(result, Skipped):
            out.append(result)
    return _share_groups(out)


def assemble(items: Iterable[RankDigest | LoadProblem | Skipped]) -> DumpSet:
    """A :class:`DumpSet` of outcomes from any number of workers."""
    result = DumpSet()
    for item in items:
        result.add(item)
    return result


def _share_groups(items: list[RankDigest | LoadProblem]) -> list[RankDigest | LoadProblem]:
    # Every rank lists the groups it belongs to, the default group with all its
    # ranks: at 16,384 ranks that is 16,384 ints per digest, 10 GB if each digest
    # kept its own copy. Equal groups share one object within a batch, which the
    # pickle carrying the batch back then stores once.
    # Keyed by the members' identity when they are large: the decoders hand out
    # one tuple per distinct membership (formats._shared), and hashing a
    # 16,384-member tuple per rank would cost O(world) each.
    # The same goes for the kept entries' stacks and texts (op, shapes, dtypes,
    # call site): equal across ranks, one object each per batch, so the main
    # process unpickles each once per batch instead of once per entry (~50
    # frames per rank, each a dataclass unpickled field by field in Python);
    # likewise equal call-site and op-name tables.
    shared: dict[tuple[object, ...], GroupInfo] = {}
    share = _Sharer()
    out: list[RankDigest | LoadProblem] = []

    def key(g: GroupInfo) -> tuple[object, ...]:
        big = g.ranks is not None and len(g.ranks) > 64
        return (g.name, g.desc, g.backend, id(g.ranks) if big else g.ranks, big)

    for item in items:
        if isinstance(item, RankDigest):
            groups = tuple(shared.setdefault(key(g), g) for g in item.groups)
            header = item.header
            if header.threads:
                header = replace(header, threads=share.threads(header.threads))
            item = replace(item, groups=groups, header=header, sites=share.table(item.sites),
                           op_names=share.table(item.op_names) or {})
        out.append(item)
    # the kept entries of the batch as one table (``DetailTable``): the main process
    # unpickles a buffer, not ~32 named tuples a rank, and builds a rank's only when
    # an analysis reads them
    digests = [i for i, item in enumerate(out) if isinstance(item, RankDigest)]
    tables = DetailTable.build([out[i].details for i in digests],  # type: ignore[union-attr]
                               stack=share.stack)
    if tables is None:  # entries a table cannot hold: shared as tuples instead
        for i in digests:
            d = out[i]
            assert isinstance(d, RankDigest)
            out[i] = replace(d, details=share.details(d.details))
        return out
    for i, details in zip(digests, tables, strict=True):
        out[i] = replace(out[i], details=details)  # type: ignore[arg-type]
    return out


class _Sharer:
    """Equal stacks and texts of a batch's digests as one object each."""

    def __init__(self) -> None:
        self._texts: dict[str, str] = {}
        self._tables: dict[tuple[tuple[int, str], ...], dict[int, str]] = {}
        self._frames: dict[tuple[str, int, str], Frame] = {}
        self._stacks: dict[tuple[tuple[str, int, str], ...], tuple[Frame, ...]] = {}
        # by identity first (a decoder shares a rank's equal stacks): the key's
        # object is kept so that its id cannot be reused within the batch
        self._by_id: dict[int, tuple[tuple[Frame, ...], tuple[Frame, ...]]] = {}

    def stack(self, frames: tuple[Frame, ...]) -> tuple[Frame, ...]:
        hit = self._by_id.get(id(frames))
        if hit is not None and hit[0] is frames:
            return hit[1]
        # keyed by the frames' fields: a Frame's own hash and == run in Python
        key = tuple([(f.file, f.line, f.name) for f in frames])
        canon = self._stacks.get(key)
        if canon is None:
            canon = self._stacks[key] = tuple(
                [self._frames.setdefault((f.file, f.line, f.name), f) for f in frames])
        self._by_id[id(frames)] = (frames, canon)
        return canon

    def details(self, details: Mapping[int, EntryDetail]) -> dict[int, EntryDetail]:
        t, stack, new = self._texts.setdefault, self.stack, tuple.__new__
        out: dict[int, EntryDetail] = {}
        for row, e in details.items():
            # unpacked whole: a field added to EntryDetail fails here, loudly
            (r, rid, grp, sq, p2p_seq, peer_seq, op, p2p, peer, root, ins, outs, ind, outd,
             red, state, t_enq, t_start, t_comp, tmo, thread, frames, loc) = e
            out[row] = new(EntryDetail, (
                r, rid, grp, sq, p2p_seq, peer_seq, t(op, op), p2p, peer, root, t(ins, ins),
                t(outs, outs), t(ind, ind), t(outd, outd), t(red, red), state, t_enq, t_start,
                t_comp, tmo, t(thread, thread), stack(frames),
                None if loc is None else t(loc, loc)))
        return out

    def table(self, table: dict[int, str] | None) -> dict[int, str] | None:
        """An equal hash -> text table (call sites, op names) as one dict a batch: the
        ranks of one program have the same ones (~4 KB a rank sent, and unpickled,
        once per rank before)."""
        if not table:
            return table
        key = tuple(table.items())
        canon = self._tables.get(key)
        if canon is None:
            t = self._texts.setdefault
            canon = self._tables[key] = {k: t(v, v) for k, v in table.items()}
        return canon

    def threads(self, threads: tuple[ThreadStack, ...]) -> tuple[ThreadStack, ...]:
        return tuple(replace(t, frames=self.stack(t.frames)) for t in threads)


def _decode_batch(batch: list[DumpSource], prefix: str | None, tail: int,
                  limits: Limits = DEFAULT_LIMITS,
                  window: int | None = None) -> list[RankDigest | LoadProblem | Skipped]:
    done = [digest_source(source, prefix=prefix, limits=limits, tail=tail, window=window)
            for source in batch]
    skipped = [d for d in done if isinstance(d, Skipped)]
    return [*_share_groups([d for d in done if not isinstance(d, Skipped)]), *skipped]


def _executor(jobs: int) -> Executor:
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    # forked from a process whose collector is paused (load_dumps): workers turn
    # it back on, and pause it per dump themselves, so garbage with cycles is
    # still collected between dumps
    return ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=gc.enable)


def cap_jobs(jobs: int | None) -> int:
    """Worker processes to use: ``jobs`` (default: every core), never more than the cores."""
    cores = os.cpu_count() or 1
    return max(1, min(jobs or cores, cores))


def load_dumps(
    paths: Sequence[str | os.PathLike[str]],
    *,
    prefix: str | None = None,
    jobs: int | None = None,
    tail: int = DEFAULT_TAIL,
    progress: Callable[[int, int], None] | None = None,
    limits: Limits = DEFAULT_LIMITS,
    window: int | None = None,
    deadline_s: float | None = None,
    window_from: int = 0,
) -> DumpSet:
    """Discover and decode every dump under ``paths`` into a :class:`DumpSet`.

    ``jobs`` worker processes decode in parallel (default and most: the
    machine's cores); ``progress(done, total)`` is called as files finish;
    ``window``: see :func:`frforensics.analyzer.digest.windowed`, applied only
    when at least ``window_from`` dump files are found on disk (the CLI's
    default: the whole ring for a small job, a window at scale). ``deadline_s``:
    stop decoding that many seconds after the call (give or take one small batch
    of files); what was not read is in ``DumpSet.unread``, for a partial verdict.
    """
    # The collector stays off for the whole load: digests arriving from the
    # workers are hundreds of thousands of long-lived objects, and every
    # collection would rescan all of them (nothing here makes reference cycles).
    with gc_paused(settle=True):
        end = None if deadline_s is None else time.monotonic() + deadline_s
        out = _load(paths, prefix=prefix, jobs=cap_jobs(jobs), tail=tail, progress=progress,
                    limits=limits, window=window, end=end, window_from=window_from)
        out.deadline_s = deadline_s
        return out


def _load(
    paths: Sequence[str | os.PathLike[str]],
    *,
    prefix: str | None,
    jobs: int,
    tail: int,
    progress: Callable[[int, int], None] | None,
    limits: Limits,
    window: int | None = None,
    end: float | None = None,
    window_from: int = 0,
) -> DumpSet:
    result = DumpSet()
    # archive members stream by before the count is known: a window that depends
    # on the count is for the files on disk only
    streamed_window = window if not window_from else None
    # Archive members arrive as bytes, one at a time: they are decoded here as
    # they stream by, so an archive never sits in memory whole. Files on disk
    # (cheap to describe) go to the workers.
    on_disk: list[DumpSource] = []
    streamed = 0
    for item in discover(paths, limits=limits):
        if isinstance(item, LoadProblem):
            result.problems.append(item)
        elif item.data is not None and end is not None and time.monotonic() > end:
            _unread(result, item, prefix, limits)
        elif item.data is not None:
            result.add(digest_source(item, prefix=prefix, limits=limits, tail=tail,
                                     window=streamed_window))
            streamed += 1
            if progress:
                progress(streamed, streamed)
        else:
            on_disk.append(item)
    total = streamed + len(on_disk)
    done = streamed
    if len(on_disk) < window_from:
        window = None
    taken: set[int] = set()
    for i, out in _decode_all(on_disk, prefix=prefix, jobs=jobs, tail=tail, limits=limits,
                              window=window, end=end):
        result.add(out)
        taken.add(i)
        done += 1
        if progress:
            progress(done, total)
    if end is not None:
        for i, source in enumerate(on_disk):
            if i not in taken:
                _unread(result, source, prefix, limits)
    return result


def _unread(result: DumpSet, source: DumpSource, prefix: str | None, limits: Limits) -> None:
    """``source`` was not read before the deadline: listed, and its rank (by name) kept."""
    result.unread.append(source.label)
    rank = rank_from_name(source.label, prefix, limits=limits)
    if rank is not None and rank not in result.unread_ranks:
        result.unread_ranks.append(rank)


def _decode_all(sources: list[DumpSource], *, prefix: str | None, jobs: int, tail: int,
                limits: Limits, window: int | None = None, end: float | None = None,
                ) -> Iterator[tuple[int, RankDigest | LoadProblem | Skipped]]:
    """(index in ``sources``, outcome) of each source decoded, in order; after ``end``
    (monotonic) no more (the batches in flight are cancelled, or finish unread)."""
    def late() -> bool:
        return end is not None and time.monotonic() > end

    if jobs == 1 or len(sources) < 8:
        for i, source in enumerate(sources):
            if late():
                return
            yield i, digest_source(source, prefix=prefix, limits=limits, tail=tail,
                                   window=window)
        return
    # Batches amortize the per-task overhead; several per worker keep cores busy;
    # a bounded window of batches in flight keeps results from piling up. Under a
    # deadline the batches are small, so the last one read ends close to it.
    size = max(1, min(8 if end is not None else 64, len(sources) // (jobs * 4) or 1))
    batches = deque(range(i, min(i + size, len(sources))) for i in range(0, len(sources), size))
    pool = _executor(jobs)
    try:
        flight: deque[tuple[range, Future[list[RankDigest | LoadProblem | Skipped]]]] = deque()
        while batches or flight:
            while batches and len(flight) < 4 * jobs and not late():
                rows = batches.popleft()
                flight.append((rows, pool.submit(_decode_batch, [sources[i] for i in rows],
                                                 prefix, tail, limits, window)))
            if late():
                return
            rows, future = flight.popleft()
            try:
                done = future.result()
            except BrokenProcessPool:
                # a worker died (killed for memory, a crash in a C reader): every batch in
                # flight is lost with it; each of their files is read again alone, so the
                # one that kills its reader is one load problem and the rest are read
                pool.shutdown(wait=False, cancel_futures=True)
                lost = [rows, *(r for r, _ in flight)]
                flight.clear()
                for r in lost:
                    yield from _one_at_a_time(sources, r, prefix, tail, limits, window, late)
                pool = _executor(jobs)
                continue
            yield from zip(rows, done, strict=True)
    finally:
        # past the deadline, nothing waits for the batches still queued
        pool.shutdown(wait=end is None, cancel_futures=end is not None)


#: said of a file whose reader's process died (``_one_at_a_time``)
READER_DIED: Final = ("its reader's process died (killed, out of memory, or a crash in a "
                      "reader): skipped; the other files were read")


def _one_at_a_time(sources: list[DumpSource], rows: range, prefix: str | None, tail: int,
                   limits: Limits, window: int | None, late: Callable[[], bool],
                   ) -> Iterator[tuple[int, RankDigest | LoadProblem | Skipped]]:
    """Each of ``rows`` decoded in a worker of its own, one after another: a file whose
    worker dies is a :class:`LoadProblem`, and the next file gets a new worker."""
    pool = _executor(1)
    try:
        for i in rows:
            if late():
                return
            try:
                out = pool.submit(_decode_batch, [sources[i]], prefix, tail, limits,
                                  window).result()
            except BrokenProcessPool:
                pool.shutdown(wait=False, cancel_futures=True)
                pool = _executor(1)
                out = [LoadProblem(sources[i].label, READER_DIED)]
            yield from ((i, item) for item in out)
    finally:
        pool.shutdown(wait=True)


def _add(result: DumpSet, new: RankDigest) -> None:
    old = result.digests.get(new.rank)
    if old is None:
        result.digests[new.rank] = new
        return
    keep_new, companion = settle_duplicate(old.format, old.newest_time_ns, new.format,
                                           new.newest_time_ns)
    keep, drop = (new, old) if keep_new else (old, new)
    result.digests[new.rank] = keep
    if companion:
        # The recorder saves PyTorch's own dump beside ours: ours says more (states,
        # times, peers, stacks at dump time), so it wins and the pair is no problem.
        result.companions.append(drop.source)
        return
    result.problems.append(
        LoadProblem(
            drop.source,
            f"duplicate dump for rank {new.rank} (also {keep.source}); using the newer one — "
            "pass one job's (or one quorum's) directory to analyze it alone",
        )
    )
