"""The recorder's torch-free state: ring, groups, counters, store coordination.

Bottom of the recorder's one-way stack (docs/recorder.md, "Layout")::

    _config, _ring  <-  _core  <-  _dump, _watchdog  <-  _pg (the wrapper)
        <-  _c10d (installation into torch, version probes)  <-  __init__ (API)

Nothing here imports torch: the store client and the backend works are reached
through the small protocols below, which torch's objects satisfy.
"""

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
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Protocol

from frforensics.model import DeathInfo, Frame, PeerHeartbeat
from frforensics.recorder import _ring as R
from frforensics.recorder._config import RecorderConfig

__all__ = ["GroupState", "Recorder", "RecorderConfig", "StoreLike", "WorkLike"]

log = logging.getLogger("frforensics.recorder")

FLAG_KEY = "dump_flag"

Entry = list[Any]
"""One ring entry: a list with the slots of :mod:`._ring` (``R.STATE``, ...)."""


class WorkLike(Protocol):
    """What the recorder asks of a backend's ``Work``."""

    def is_completed(self) -> bool: ...

    def get_future(self) -> Any: ...


class StoreLike(Protocol):
    """The c10d store calls the recorder makes (a ``PrefixStore`` over a clone)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...

    def multi_get(self, keys: list[str]) -> list[bytes]: ...


Tracked = tuple[Entry, WorkLike]
"""An op the watchdog polls: its entry and the backend work that finishes it."""


class GroupState:
    """Per-group counters (PyTorch semantics) and identity, one per wrapper."""

    __slots__ = (
        "backend",
        "block_id",
        "block_p2p",
        "cuda",
        "desc",
        "index",
        "last",
        "name",
        "p2p_seq",
        "ranks",
        "recv_count",
        "send_count",
        "seq",
        "timeout_ms",
    )

    def __init__(self, index: int, name: str, desc: str, ranks: tuple[int, ...],
                 backend: str, timeout_ms: int) -> None:
        self.index = index
        self.name = name
        self.desc = desc
        self.ranks = ranks
        self.backend = backend
        self.timeout_ms = timeout_ms
        self.seq = 0
        self.p2p_seq = 0
        self.send_count: dict[int, int] = {}
        self.recv_count: dict[int, int] = {}
        self.block_id = -1  # coalescing block in progress (-1: none)
        self.block_p2p = -1  # -1 unknown yet, 0 collective block, 1 p2p block
        # The newest (entry, work) of this group: the watchdog polls it; when the
        # next op comes, it is dropped if done, else handed to the watchdog.
        self.last: Tracked | None = None
        self.cuda = False  # the group has a CUDA backend (is_completed queries events)

    def global_rank(self, group_rank: int) -> int:
        ranks = self.ranks
        return ranks[group_rank] if 0 <= group_rank < len(ranks) else -1


class Recorder:
    """Everything one process records; one instance while enabled.

    Torch-free: the wrapper (``_pg``) writes entries into ``ring`` and hands
    unfinished works to ``pending``; the watchdog and the dump writer read them.
    """

    def __init__(self, config: RecorderConfig) -> None:
        self.config = config
        self.active = True
        self.ring = R.Ring(config.buffer_size)
        self.count = 0
        self.stack_depth = max(0, int(config.stack_depth))
        self.frame_filter = R.FrameFilter(R.default_skip_prefixes())
        self.wrap_backends = config.wrap_backends
        self.pending: collections.deque[Tracked] = collections.deque()
        # The native ring (``_cxx``'s ``Ring``) when the native path records: groups
        # it wraps write there, the rest here; :meth:`snapshot` reads both.
        self.cxx: Any = None
        # why the native path does not record (recorder_path "auto" or "cxx"), for the dumps
        self.native_why = ""
        self.groups: list[GroupState] = []
        self._block_counter = 0
        self.store: StoreLike | None = None
        self.store_dead = False
        self.rank: int | None = None
        self.world_size: int | None = None
        # A watchdog/peer-signal dump written while the process was alive: the
        # hang's evidence, which a later exception (the backend's own timeout)
        # or exit dump must not replace.
        self.hang_dump_written = False
        # How this process died (uncaught exception in the main thread, exit with
        # ops unfinished, a teardown signal), once known: every later dump carries
        # it, so a peer's dump flag or the watchdog cannot erase the death.
        self.death: DeathInfo | None = None
        self.last_stale: tuple[PeerHeartbeat, ...] = ()  # the last successful reading
        self.errors_logged: set[str] = set()
        self.main_ident = threading.main_thread().ident
        self.flag_seen: str | None = None
        self.flag_raised = False
        # The flag of the current incident (``rearm()`` opens the next one).
        self.flag_key = FLAG_KEY
        # Called with each new group (the API starts the watchdog on the first).
        self.group_listeners: list[Callable[[GroupState], None]] = []
        # Called once the store client is attached (the watchdog wakes up).
        self.store_listeners: list[Callable[[], None]] = []
        # Why groups are created unrecorded (a failed probe), for the dump notes.
        self.unrecorded: list[str] = []
        # The process whose groups these are (set at the first group): a forked
        # child inherits this state but must never write that rank's dump.
        self.owner_pid: int | None = None
        # c10d's PrefixStore joins prefix and key with "/": keys are
        # "frforensics/<restart>/dump_flag", "frforensics/<restart>/hb/<rank>", ...
        self.namespace = "frforensics/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.resolution_ns = int(config.poll_interval_s * 1e9)

    # ------------------------------------------------------------ hot-path helpers

    def next_block_id(self) -> int:
        self._block_counter += 1
        return self._block_counter

    def note_error(self, where: str, exc: BaseException) -> None:
        """One log line per kind of failure; never raises."""
        key = f"{where}:{type(exc).__name__}"
        if key in self.errors_logged:
            return
        self.errors_logged.add(key)
        with contextlib.suppress(Exception):
            log.warning("frforensics recorder: %s failed: %s: %s", where, type(exc).__name__, exc)

    def snapshot(self) -> tuple[list[Entry], int]:
        """The live entries oldest first (both paths), and how many were overwritten.

        Where both rings hold entries (a group the native path cannot wrap beside
        ones it does), they are merged by enqueue time and numbered again in that
        order: each ring counts its own records.
        """
        entries, dropped = self.ring.snapshot()
        cxx = self.cxx
        if cxx is None:
            return entries, dropped
        native, native_dropped = cxx.snapshot()
        if not entries:
            return native, native_dropped
        if not native:
            return entries, dropped
        # copies: the Python ring's entries are live (the watchdog stamps them)
        merged = sorted([list(e) for e in entries] + native, key=lambda e: e[R.T_ENQUEUE])
        first = dropped + native_dropped
        for k, e in enumerate(merged):
            e[R.RECORD_ID] = first + k
        return merged, first

    # ------------------------------------------------------------ groups and store

    def new_group(self, *, name: str, desc: str, ranks: tuple[int, ...], backend: str,
                  timeout_ms: int) -> GroupState:
        if self.owner_pid is None:
            self.owner_pid = os.getpid()
        deadline = self.config.deadline_ms
        effective = min(timeout_ms, deadline) if timeout_ms > 0 else deadline
        state = GroupState(len(self.groups), name, desc, ranks, backend, effective)
        self.groups.append(state)
        for listener in list(self.group_listeners):
            try:
                listener(state)
            except Exception as exc:
                self.note_error("group listener", exc)
        return state

    def set_store(self, client: StoreLike | None, rank: int, world_size: int) -> None:
        """Use ``client`` (already namespaced and cloned) for the flag and heartbeats."""
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.store = client
        if client is not None:
            try:
                client.set(f"hb/{self.rank}", str(time.time_ns()))
            except Exception as exc:
                self.store = None
                self.note_error("store client", exc)
        for listener in list(self.store_listeners):
            with contextlib.suppress(Exception):
                listener()

    def current_rank(self) -> int:
        if self.rank is not None:
            return self.rank
        dist: Any = sys.modules.get("torch.distributed")  # only if torch is loaded
        with contextlib.suppress(Exception):
            if dist is not None and dist.is_initialized():
                return int(dist.get_rank())
        env = os.environ.get("RANK")
        return int(env) if env and env.isdigit() else 0

    def owns_process(self) -> bool:
        """False in a child forked after the groups were made (it must not dump)."""
        return self.owner_pid is None or self.owner_pid == os.getpid()

    def dump_path(self) -> Path:
        return self.config.dump_dir / f"frdump_rank_{self.current_rank()}"

    def native_dump_path(self, key: str | None = None) -> Path:
        """Where PyTorch's dump goes: the main one, or the one of native recorder ``key``."""
        stem = "nccl_trace" if not key else "nccl_trace_" + "".join(
            c if c.isalnum() else "-" for c in key)
        return self.config.dump_dir / f"{stem}_rank_{self.current_rank()}"

    # ------------------------------------------------------------ store coordination

    def raise_flag(self, payload: dict[str, Any]) -> bool:
        """Set the job-wide dump flag (first rank wins). True when ours won."""
        store = self.store
        if store is None or self.store_dead or self.flag_raised:
            return False
        self.flag_raised = True
        try:
            text = json.dumps(payload, sort_keys=True)
            current = _text(store.compare_set(self.flag_key, "", text))
            won = current == text
            self.flag_seen = text if won else current
            return won
        except Exception as exc:
            self.note_error("store flag", exc)
            return False

    def poll_flag(self) -> str | None:
        """The flag's payload when another rank raised it; never blocks for long."""
        store = self.store
        if store is None or self.store_dead:
            return None
        if not store.check([self.flag_key]):
            return None
        return _text(store.get(self.flag_key))

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
        limit = self.config.stale_limit_s
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


def _text(value: bytes | str | Sequence[int]) -> str:
    if isinstance(value, bytes):
        return value.decode()
    return str(value)
