"""Dump time: turn the ring's raw entries into a :class:`~frforensics.model.RankTrace`.

Only here are shapes turned into strings, dtypes into PyTorch's names, code
objects into frames, and monotonic times into wall-clock nanoseconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from frforensics._atomic import write_atomic
from frforensics.model import (
    DeathInfo,
    DumpHeader,
    DumpReason,
    EntryTable,
    Frame,
    GroupInfo,
    RankTrace,
    SourceFormat,
    ThreadStack,
)
from frforensics.recorder import _ring as R
from frforensics.recorder._core import Recorder, frames_of, host_name, job_id

log = logging.getLogger("frforensics.recorder")

_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        import torch

        known = {
            torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
            torch.bfloat16: "BFloat16", torch.int64: "Long", torch.int32: "Int",
            torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte", torch.bool: "Bool",
            torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
        }
        name = known.get(dtype) or str(dtype).removeprefix("torch.")
        _DTYPE_NAMES[dtype] = name
    return name


def _reduce_name(op: Any) -> str:
    if op is None:
        return ""
    op = getattr(op, "reduceOp", op)  # an options object recorded in place of its op
    inner = getattr(op, "op", op)
    name = getattr(inner, "name", None)
    return str(name) if name else str(inner).rsplit(".", 1)[-1]


class _Strings:
    __slots__ = ("index", "items")

    def __init__(self) -> None:
        self.items: list[str] = []
        self.index: dict[str, int] = {}

    def add(self, s: str) -> int:
        i = self.index.get(s)
        if i is None:
            i = self.index[s] = len(self.items)
            self.items.append(s)
        return i


def build_trace(rec: Recorder, reason: DumpReason, detail: str,
                death: DeathInfo | None, extra_notes: Iterable[str] = ()) -> RankTrace:
    """Snapshot the ring, the groups and every thread's stack into a RankTrace."""
    mono_now = time.monotonic_ns()
    wall_now = time.time_ns()
    offset = wall_now - mono_now
    entries, dropped = rec.snapshot()
    n = len(entries)
    strings = _Strings()
    stacks: list[tuple[Frame, ...]] = []
    stack_index: dict[tuple[Frame, ...], int] = {}
    raw_stack_index: dict[tuple[Any, ...], int] = {}
    meta_cache: dict[tuple[Any, ...], tuple[int, int, int]] = {}
    thread_names = {t.ident: t.name for t in threading.enumerate()}

    def stack_of(raw_list: list[Any] | tuple[Any, ...]) -> int:
        if not raw_list:
            return -1
        raw = tuple(raw_list)
        # Keyed by code ids, not code objects: hashing a code object hashes its
        # bytecode and constants (the entries keep the codes alive meanwhile).
        key = tuple([x if type(x) is int else id(x) for x in raw])
        i = raw_stack_index.get(key)
        if i is None:
            frames = tuple(
                Frame(raw[k].co_filename, R.line_of(raw[k], raw[k + 1]),
                      getattr(raw[k], "co_qualname", raw[k].co_name))
                for k in range(0, len(raw), 2)
            )
            i = stack_index.get(frames)
            if i is None:
                i = stack_index[frames] = len(stacks)
                stacks.append(frames)
            raw_stack_index[key] = i
        return i

    def meta_of(meta: tuple[Any, ...]) -> tuple[int, int, int]:
        hit = meta_cache.get(meta)
        if hit is None:
            shapes = [list(shape) for shape, _ in meta]
            numel = 0
            for shape in shapes:
                k = 1
                for d in shape:
                    k *= int(d)
                numel += k
            dtypes = ",".join(_dtype_name(dt) for _, dt in meta)
            hit = meta_cache[meta] = (strings.add(str(shapes)), strings.add(dtypes), numel)
        return hit

    cols: dict[str, list[int]] = {name: [0] * n for name in (
        "record_id", "pg", "seq", "p2p_seq", "peer_seq", "op", "is_p2p", "peer", "root",
        "coalesced", "in_numel", "out_numel", "in_shapes", "out_shapes", "in_dtypes",
        "out_dtypes", "reduce_op", "state", "t_enqueue_ns", "t_start_ns", "t_complete_ns",
        "timeout_ms", "thread", "device", "stream", "stack", "splits")}
    for i, e in enumerate(entries):
        cols["record_id"][i] = e[R.RECORD_ID]
        cols["pg"][i] = e[R.GROUP]
        cols["seq"][i] = e[R.SEQ]
        cols["p2p_seq"][i] = e[R.P2P_SEQ]
        cols["peer_seq"][i] = e[R.PEER_SEQ]
        cols["op"][i] = strings.add(e[R.OP])
        cols["is_p2p"][i] = 1 if e[R.IS_P2P] else 0
        cols["peer"][i] = e[R.PEER]
        cols["root"][i] = e[R.ROOT]
        cols["coalesced"][i] = e[R.COALESCED]
        in_s, in_d, in_n = meta_of(e[R.INPUTS])
        out_s, out_d, out_n = meta_of(e[R.OUTPUTS])
        cols["in_shapes"][i], cols["in_dtypes"][i], cols["in_numel"][i] = in_s, in_d, in_n
        cols["out_shapes"][i], cols["out_dtypes"][i], cols["out_numel"][i] = out_s, out_d, out_n
        red = e[R.REDUCE_OP]
        cols["reduce_op"][i] = strings.add(_reduce_name(red)) if red is not None else -1
        cols["state"][i] = e[R.STATE]
        cols["t_enqueue_ns"][i] = e[R.T_ENQUEUE] + offset
        cols["t_start_ns"][i] = e[R.T_START] + offset if e[R.T_START] else 0
        cols["t_complete_ns"][i] = e[R.T_COMPLETE] + offset if e[R.T_COMPLETE] else 0
        cols["timeout_ms"][i] = e[R.TIMEOUT_MS]
        ident = e[R.THREAD]
        cols["thread"][i] = strings.add(thread_names.get(ident) or f"thread-{ident}")
        dev = e[R.DEVICE]
        cols["device"][i] = strings.add(dev) if dev else -1
        cols["stream"][i] = e[R.STREAM]
        cols["stack"][i] = stack_of(e[R.STACK])
        cols["splits"][i] = _splits_of(e, rec, strings)
    table = EntryTable.from_columns(n, {k: np.asarray(v) for k, v in cols.items()})

    threads = []
    own = os.path.dirname(os.path.abspath(__file__)) + os.sep
    for ident, frame in sys._current_frames().items():
        frames = frames_of(frame)
        # Drop the recorder's own frames on top (the dumping thread's dump call,
        # a main thread inside our excepthook or exit hook).
        k = 0
        while k < len(frames) and frames[k].file.startswith(own):
            k += 1
        frames = frames[k:]
        if ident == rec.main_ident and death is not None and death.frames:
            # The main thread died of this exception: its stack has unwound (it is
            # in our excepthook, or tearing down), and where it died is where it is.
            frames = death.frames
        threads.append(ThreadStack(
            name=thread_names.get(ident) or f"thread-{ident}",
            ident=int(ident),
            is_main=ident == rec.main_ident,
            frames=frames,
        ))
    threads.sort(key=lambda t: (not t.is_main, t.name))

    groups = tuple(
        GroupInfo(name=g.name, desc=g.desc, ranks=tuple(g.ranks), backend=g.backend)
        for g in rec.groups
    )
    notes = [f"watchdog deadline {rec.config.timeout_s:g} s; "
             f"store poll {rec.config.store_poll_interval_s:g} s"]
    if rec.store is None:
        notes.append("no store client: this dump was not coordinated with peers")
    elif rec.store_dead:
        notes.append("store unreachable at dump time: dumped locally only")
    if rec.cxx is not None:
        notes.append("recorded on the native path (recorder_path=cxx)")
    elif rec.config.recorder_path != "python" and rec.native_why:
        notes.append(f"recorded with the Python wrapper (native path: {rec.native_why})")
    notes.extend(rec.config.extra_notes)
    notes.extend(f"not recorded: {why}" for why in rec.unrecorded)
    notes.extend(extra_notes)
    from frforensics.recorder._identity import local_identity

    ident = local_identity([e[R.DEVICE] for e in entries[-64:] if e[R.DEVICE]])
    stale = rec.stale_peers() if reason is not DumpReason.API else ()
    if stale:
        stale = tuple(sorted(stale, key=lambda p: -p.age_s))
    return RankTrace(
        rank=rec.current_rank(),
        header=DumpHeader(
            source="frforensics.recorder",
            format=SourceFormat.FRDUMP,
            version="1",
            world_size=rec.world_size,
            host=host_name(),
            pid=os.getpid(),
            job_id=job_id(),
            dump_reason=reason,
            dump_detail=detail,
            dump_time_ns=time.time_ns(),
            dump_monotonic_ns=time.monotonic_ns(),
            completion_resolution_ns=rec.resolution_ns,
            dropped=dropped,
            threads=tuple(threads),
            stale_peers=stale,
            death=death,
            local_rank=ident.local_rank,
            cuda_device=ident.cuda_device,
            gpu_uuid=ident.gpu_uuid,
            pci_bus_id=ident.pci_bus_id,
        ),
        groups=groups,
        strings=tuple(strings.items),
        stacks=tuple(stacks),
        entries=table,
        notes=tuple(notes),
    )


@dataclass(frozen=True)
class DumpWritten:
    """What a post-dump hook is told: the file written and the trace in it."""

    path: Path
    reason: DumpReason
    trace: RankTrace
    automatic: bool


NativeSource = Callable[[Recorder], list[tuple[str, bytes]]]
"""PyTorch's own dumps of this process: (native recorder key, bytes to save), main first."""


class DumpWriter:
    """Writes this rank's dump (and PyTorch's beside it) under the dump rules.

    The rules (docs/recorder.md, "Dumps"): an automatic exception/exit dump never
    replaces a hang dump written while the process was alive; once the death is
    known, every later dump carries it. Hooks:

    * ``settle``: called before each dump (the watchdog's final poll);
    * ``note_providers``: each returns extra notes for one dump (per-dump metadata);
    * ``post_dump_hooks``: called after each successful write, outside the lock,
      with a :class:`DumpWritten`; a raising hook is logged once and ignored;
    * ``native_source``: the installed torch's native dump (set by ``_c10d``).
    """

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.lock = threading.RLock()
        self.dumped_reasons: list[DumpReason] = []
        self.settle: Callable[[], None] | None = None
        self.note_providers: list[Callable[[DumpReason], Iterable[str]]] = []
        self.post_dump_hooks: list[Callable[[DumpWritten], None]] = []
        self.native_source: NativeSource | None = None

    def dump(self, reason: DumpReason, detail: str = "", *, death: DeathInfo | None = None,
             automatic: bool = False, native: bool = True) -> Path | None:
        """Write this rank's dump now. Never raises; returns the path or None."""
        rec = self.rec
        if not rec.owns_process():
            return None  # a forked child: the rank's dump belongs to its parent
        try:
            with self.lock:
                if automatic and reason in (DumpReason.EXCEPTION, DumpReason.EXIT):
                    if rec.hang_dump_written:
                        # Keep the hang dump: a later exception (the backend's own
                        # timeout) would replace the evidence with a less useful one.
                        return None
                    if reason is DumpReason.EXIT and rec.death is not None and (
                            rec.death.kind in ("exception", "signal")):
                        return None  # the exception/signal dump already tells how it died
                if death is not None and (rec.death is None or death.kind == "exception"):
                    rec.death = death
                from frforensics.formats import frdump

                if self.settle is not None:
                    try:
                        self.settle()
                    except Exception as exc:
                        rec.note_error("settle", exc)
                notes: list[str] = []
                for provider in list(self.note_providers):
                    try:
                        notes.extend(provider(reason))
                    except Exception as exc:
                        rec.note_error("dump note provider", exc)
                trace = build_trace(rec, reason, detail, death or rec.death, notes)
                path = write_atomic(rec.dump_path(), frdump.encode(trace), mode=0o600,
                                    make_parents=True, durable=True)
                self.dumped_reasons.append(reason)
                if rec.death is None and reason in (DumpReason.WATCHDOG_TIMEOUT,
                                                    DumpReason.PEER_SIGNAL):
                    rec.hang_dump_written = True
                with contextlib.suppress(Exception):
                    log.warning("frforensics: rank %s dumped (%s) to %s", trace.rank,
                                reason.value, path)
            written = DumpWritten(path=path, reason=reason, trace=trace, automatic=automatic)
            for hook in list(self.post_dump_hooks):
                try:
                    hook(written)
                except Exception as exc:
                    rec.note_error("post-dump hook", exc)
            # after the hooks (the verdict's hand-over): ours is what counts, and
            # PyTorch's with its stacks (``native_stacks``) costs ~1 s on a first dump
            if native and rec.config.save_native:
                self.save_native()
            return path
        except Exception as exc:
            rec.note_error("dump", exc)
            return None

    def save_native(self) -> None:
        """Save PyTorch's own flight-recorder dump beside ours (when it has one)."""
        rec = self.rec
        source = self.native_source
        if source is None:
            return
        try:
            if os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get(
                    "TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")) in ("0", ""):
                return
            for i, (key, data) in enumerate(source(rec)):
                path = rec.native_dump_path(None if i == 0 else key)
                write_atomic(path, data, mode=0o600, make_parents=True, durable=True)
        except Exception as exc:
            rec.note_error("native dump", exc)


_ALL_TO_ALL: Final = frozenset({"all_to_all", "all_to_all_single"})


def _splits_of(e: list[Any], rec: Any, strings: Any) -> int:
    """The ``splits`` column of one entry (``model.ENTRY_COLUMNS``): the elements it
    sends each member and expects from each, ``"s0,s1,..|r0,r1,.."``; -1 for any op but
    all_to_all(_single), and where the sizes cannot be told (a group of unknown size,
    dims that do not divide)."""
    op = e[R.OP]
    if op not in _ALL_TO_ALL:
        return -1
    send: list[int] | None
    recv: list[int] | None
    try:
        if op == "all_to_all":  # one tensor per member each way: their sizes are the splits
            send = [_numel(shape) for shape, _ in e[R.INPUTS]]
            recv = [_numel(shape) for shape, _ in e[R.OUTPUTS]]
        else:
            size = len(rec.groups[e[R.GROUP]].ranks or ())
            given = e[R.SPLITS] if len(e) > R.SPLITS else ((), ())
            send = _split_elems(e[R.INPUTS][0][0], given[0], size)
            recv = _split_elems(e[R.OUTPUTS][0][0], given[1], size)
        if send is None or recv is None:
            return -1
        return int(strings.add(",".join(map(str, send)) + "|" + ",".join(map(str, recv))))
    except Exception:  # a dump never fails on one odd entry
        return -1


def _numel(shape: Any) -> int:
    k = 1
    for d in shape:
        k *= int(d)
    return k


def _split_elems(shape: Any, splits: Any, size: int) -> list[int] | None:
    """Elements per member of one side of an all_to_all_single: ``splits`` rows of dim
    0 (empty: an even split over ``size`` members, as c10d does), times a row's size."""
    dims = [int(d) for d in shape]
    if not dims:
        return None
    row = _numel(dims[1:])
    if splits:
        return [int(k) * row for k in splits]
    if size <= 0 or dims[0] % size:
        return None
    return [dims[0] // size * row] * size
