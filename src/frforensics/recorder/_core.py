"""The recorder's process-wide state: config, ring, groups, store client, dumping."""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from frforensics.model import DeathInfo, DumpReason, Frame, PeerHeartbeat
from frforensics.recorder import _ring as R

log = logging.getLogger("frforensics.recorder")

FLAG_KEY = "dump_flag"


@dataclass(frozen=True)
class RecorderConfig:
    """Settings of :func:`frforensics.recorder.enable` (see its docstring)."""

    dump_dir: Path
    timeout_s: float = 600.0
    buffer_size: int = 2000
    poll_interval_s: float = 0.01
    store_poll_interval_s: float = 1.0
    stack_depth: int = 8
    heartbeat_stale_s: float | None = None
    dump_signals: tuple[int, ...] = ()
    dump_on_exception: bool = True
    dump_on_exit: str = "auto"
    save_native: bool = True
    wrap_backends: tuple[str, ...] = ("gloo", "nccl")
    cuda_events: bool = True
    store_timeout_s: float = 5.0
    stale_check_max_world: int = 4096
    extra_notes: tuple[str, ...] = field(default=())


class Recorder:
    """Everything one process records; one instance while enabled."""

    def __init__(self, config: RecorderConfig) -> None:
        self.config = config
        self.active = True
        self.ring = R.Ring(config.buffer_size)
        self.count = 0
        self.stack_depth = max(0, int(config.stack_depth))
        self.frame_filter = R.FrameFilter(R.default_skip_prefixes())
        self.wrap_backends = config.wrap_backends
        self.pending: collections.deque[tuple[list[Any], Any]] = collections.deque()
        self.groups: list[Any] = []  # GroupState, by index
        self._block_counter = 0
        self.store: Any = None
        self.store_dead = False
        self.rank: int | None = None
        self.world_size: int | None = None
        self.dump_lock = threading.RLock()
        self.dumped_reasons: list[DumpReason] = []
        # A watchdog/peer-signal dump written while the process was alive: the
        # hang's evidence, which a later exception (the backend's own timeout)
        # or exit dump must not replace.
        self.hang_dump_written = False
        # How this process died (uncaught exception in the main thread, exit with
        # ops unfinished), once known: every later dump carries it, so a peer's
        # dump flag or the watchdog cannot erase the death (docs/recorder.md).
        self.death: DeathInfo | None = None
        self.last_stale: tuple[PeerHeartbeat, ...] = ()  # the last successful reading
        self.errors_logged: set[str] = set()
        self.main_ident = threading.main_thread().ident
        self.flag_seen: str | None = None
        self.flag_raised = False
        self.watchdog: Any = None
        self.on_first_group: Callable[[Recorder], None] | None = None
        # Told of every dump written (the verdict agent, recorder/_verdict.py).
        self.on_dumped: Callable[[DumpReason, Any, Path], None] | None = None
        self.verdict_agent: Any = None
        self.namespace = "frforensics/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/"
        self.resolution_ns = int(config.poll_interval_s * 1e9)

    # ------------------------------------------------------------ hot-path helpers

    def next_block_id(self) -> int:
        self._block_counter += 1
        return self._block_counter

    def cuda_info(self, tensor: Any) -> tuple[str, int, Any]:
        import torch as _torch

        torch: Any = _torch
        dev = tensor.device
        stream = torch.cuda.current_stream(dev)
        event = None
        if self.config.cuda_events:
            event = torch.cuda.Event()
            event.record(stream)
        return f"cuda:{dev.index}", int(stream.cuda_stream), event

    def note_error(self, where: str, exc: BaseException) -> None:
        """One log line per kind of failure; never raises."""
        key = f"{where}:{type(exc).__name__}"
        if key in self.errors_logged:
            return
        self.errors_logged.add(key)
        with contextlib.suppress(Exception):
            log.warning("frforensics recorder: %s failed: %s: %s", where, type(exc).__name__, exc)

    # ------------------------------------------------------------ groups and store

    def new_group(self, *, name: str, desc: str, ranks: tuple[int, ...], backend: str,
                  timeout_ms: int) -> Any:
        from frforensics.recorder._pg import GroupState

        effective = min(timeout_ms, int(self.config.timeout_s * 1000)) if timeout_ms > 0 else int(
            self.config.timeout_s * 1000)
        state = GroupState(len(self.groups), name, desc, ranks, backend, effective)
        self.groups.append(state)
        if self.watchdog is None and self.on_first_group is not None:
            try:
                self.on_first_group(self)
            except Exception as exc:
                self.note_error("watchdog start", exc)
        return state

    def attach_store(self, store: Any, rank: int, world_size: int) -> None:
        """Keep a store client of our own for the flag and heartbeats."""
        self.rank = int(rank)
        self.world_size = int(world_size)
        try:
            import torch.distributed as _dist

            dist: Any = _dist
            root = store
            while isinstance(root, dist.PrefixStore):
                root = root.underlying_store
            client = root
            if isinstance(root, dist.TCPStore):
                with contextlib.suppress(Exception):
                    client = root.clone()
            with contextlib.suppress(Exception):
                from datetime import timedelta

                client.set_timeout(timedelta(seconds=self.config.store_timeout_s))
            self.store = dist.PrefixStore(self.namespace, client)
            self.store.set(f"hb/{self.rank}", str(time.time_ns()))
        except Exception as exc:
            self.store = None
            self.note_error("store client", exc)
        if self.watchdog is not None:
            self.watchdog.wake()

    # ------------------------------------------------------------ dumping

    def current_rank(self) -> int:
        if self.rank is not None:
            return self.rank
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            if dist.is_initialized():
                return int(dist.get_rank())
        env = os.environ.get("RANK")
        return int(env) if env and env.isdigit() else 0

    def dump_path(self) -> Path:
        return self.config.dump_dir / f"frdump_rank_{self.current_rank()}"

    def dump(self, reason: DumpReason, detail: str = "", *, death: DeathInfo | None = None,
             automatic: bool = False, native: bool = True) -> Path | None:
        """Write this rank's dump now. Never raises; returns the path or None."""
        try:
            with self.dump_lock:
                if automatic and reason in (DumpReason.EXCEPTION, DumpReason.EXIT):
                    if self.hang_dump_written:
                        # Keep the hang dump: a later exception (the backend's own
                        # timeout) would replace the evidence with a less useful one.
                        return None
                    if reason is DumpReason.EXIT and self.death is not None and (
                            self.death.kind == "exception"):
                        return None  # the exception dump already tells how it died
                if death is not None and (self.death is None or death.kind == "exception"):
                    self.death = death
                from frforensics.formats import frdump
                from frforensics.recorder._dump import build_trace

                if self.watchdog is not None:
                    try:
                        self.watchdog.settle_for_dump()
                    except Exception as exc:
                        self.note_error("settle", exc)
                trace = build_trace(self, reason, detail, death or self.death)
                path = frdump.write_atomic(self.dump_path(), frdump.encode(trace))
                self.dumped_reasons.append(reason)
                if self.on_dumped is not None:
                    try:
                        self.on_dumped(reason, trace, path)
                    except Exception as exc:
                        self.note_error("after dump", exc)
                if self.death is None and reason in (DumpReason.WATCHDOG_TIMEOUT,
                                                     DumpReason.PEER_SIGNAL):
                    self.hang_dump_written = True
                with contextlib.suppress(Exception):
                    log.warning("frforensics: rank %s dumped (%s) to %s", trace.rank,
                                reason.value, path)
            if native and self.config.save_native:
                self.save_native()
            return path
        except Exception as exc:
            self.note_error("dump", exc)
            return None

    def save_native(self) -> None:
        """Save PyTorch's own flight-recorder dump beside ours, pg_config repaired."""
        try:
            if os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get(
                    "TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")) in ("0", ""):
                return
            from frforensics.recorder._dump import native_dump_bytes

            data = native_dump_bytes(self)
            if data is None:
                return
            from frforensics.formats import frdump

            frdump.write_atomic(self.config.dump_dir / f"nccl_trace_rank_{self.current_rank()}",
                                data)
        except Exception as exc:
            self.note_error("native dump", exc)

    # ------------------------------------------------------------ store coordination

    def raise_flag(self, payload: dict[str, Any]) -> bool:
        """Set the job-wide dump flag (first rank wins). True when ours won."""
        store = self.store
        if store is None or self.store_dead or self.flag_raised:
            return False
        self.flag_raised = True
        try:
            text = json.dumps(payload, sort_keys=True)
            current = store.compare_set(FLAG_KEY, "", text)
            won = (current.decode() if isinstance(current, bytes) else str(current)) == text
            self.flag_seen = text if won else (current.decode() if isinstance(current, bytes)
                                               else str(current))
            return won
        except Exception as exc:
            self.note_error("store flag", exc)
            return False

    def poll_flag(self) -> str | None:
        """The flag's payload when another rank raised it; never blocks for long."""
        store = self.store
        if store is None or self.store_dead:
            return None
        if not store.check([FLAG_KEY]):
            return None
        value = store.get(FLAG_KEY)
        return value.decode() if isinstance(value, bytes) else str(value)

    def heartbeat(self) -> None:
        if self.store is not None and self.rank is not None and not self.store_dead:
            self.store.set(f"hb/{self.rank}", str(time.time_ns()))

    def stale_peers(self) -> tuple[PeerHeartbeat, ...]:
        """Peers whose heartbeat is older than the staleness limit (best effort).

        When the store cannot be read (its host, often rank 0, exited first), the
        last successful reading is returned: a peer that was stale then is still
        silent now (its ages are those of that reading).
        """
        fresh = self._read_stale_peers()
        if fresh is None:
            return self.last_stale
        self.last_stale = fresh
        return fresh

    def _read_stale_peers(self) -> tuple[PeerHeartbeat, ...] | None:
        store, world, me = self.store, self.world_size, self.rank
        if world is None or me is None:
            return ()
        if store is None or self.store_dead:
            return None
        if world > self.config.stale_check_max_world:
            return ()
        limit = self.config.heartbeat_stale_s
        if limit is None:
            limit = max(3.0 * self.config.store_poll_interval_s, 2.0)
        keys = [f"hb/{r}" for r in range(world) if r != me]
        if not keys:
            return ()
        try:
            if store.check(keys):
                values = store.multi_get(keys)
                present = list(zip(keys, values, strict=True))
            else:
                present = [(k, store.get(k)) for k in keys if store.check([k])]
        except Exception as exc:
            self.note_error("heartbeat read", exc)
            return None
        now = time.time_ns()
        stale = []
        for key, raw in present:
            try:
                age = (now - int(raw)) / 1e9
            except (TypeError, ValueError):
                continue
            if age > limit:
                stale.append(PeerHeartbeat(rank=int(key.split("/")[1]), age_s=round(age, 3)))
        return tuple(stale)


def frames_of(frame: FrameType | None, limit: int = 64) -> tuple[Frame, ...]:
    """A live frame chain as model frames, innermost first."""
    out: list[Frame] = []
    while frame is not None and len(out) < limit:
        code = frame.f_code
        out.append(Frame(code.co_filename, int(frame.f_lineno or 0),
                         getattr(code, "co_qualname", code.co_name)))
        frame = frame.f_back
    return tuple(out)


def frames_of_traceback(tb: TracebackType | None, limit: int = 64) -> tuple[Frame, ...]:
    """A traceback's frames, innermost first."""
    items = traceback.extract_tb(tb)
    return tuple(Frame(fs.filename, int(fs.lineno or 0), fs.name) for fs in reversed(items))[:limit]


def host_name() -> str:
    try:
        return socket.gethostname()
    except Exception:
        return ""


def job_id() -> str | None:
    for key in ("FRFORENSICS_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "JOB_ID",
                "LSB_JOBID", "PBS_JOBID"):
        value = os.environ.get(key)
        if value:
            return value
    return None


def current_exception_info() -> tuple[type[BaseException] | None, BaseException | None,
                                      TracebackType | None]:
    return sys.exc_info()
