"""Keep training without the bad rank: exclude the culprit and re-form the groups.

Needs torch >= 2.15 (``init_process_group(..., enable_reconfigure=True)`` and
``distributed_c10d._reconfigure``); on older torch :func:`setup` raises
:class:`RecoveryUnavailable` with one line saying so. docs/recovery.md has the
measured mechanics this module is built on and a real job log.

::

    dist.init_process_group("gloo", enable_reconfigure=True, timeout=timedelta(seconds=10))
    rec = recovery.setup()                 # first configuration, all ranks (or spares=1)
    for step in ...:
        with rec.guard() as g:
            train_step()
        if g.reconfigured:
            reshard(g.rank, g.world_size)
    rec.close()

:func:`setup` returns the :class:`Recovery` you hold (torchft's ``Manager`` shape:
one object made once, driven by the training loop, ``close()`` at the end). It
takes a :class:`VerdictSource` -- where the verdict comes from: the recorder's
(``frforensics.recorder.RecorderVerdicts``, the default) or
:func:`verdict_from_dump_dir` -- and tells the recorder (a :class:`JobRecorder`)
about every re-formed group. The module functions :func:`guard`,
:func:`run_step`, :func:`new_group`, :func:`propose_exclusion`, :func:`standby`
and :func:`state` are thin wrappers over the Recovery that :func:`setup` made
last (the default process group it reconfigures is one per process, so is the
Recovery); the ``on_verdict`` hook :func:`exclude_stragglers` uses them.

What happens when a step fails (the blocked collective times out after the group's
timeout, or fails because a peer died): the guard waits for the job's verdict
(``frforensics.recorder`` with the orchestrator contract: one verdict per incident
in the store), refuses with :class:`RecoveryRefused` when a culprit's action is
``fix_code`` (or nothing can be excluded), else takes the ranks whose action is
``replace_gpu_or_host`` as the exclusion set; every survivor then publishes a
fresh reconfigure handle, the lowest survivor writes the new membership once
(after every expected survivor arrived), everyone reconfigures the default group
and each registered subgroup that lost a member with a fresh uuid, and a checked
all_reduce proves the new group works. Every wait is bounded; a failure raises
:class:`RecoveryFailed` with the verdict and the reason (never a second hang).
An excluded rank that is still alive learns it from the store (a daemon thread)
and exits with :data:`EXIT_EXCLUDED`. A standby admitted in its place receives
the survivors' training state (``setup(state_dict=..., load_state_dict=...)``;
:mod:`frforensics.recovery._handover`) before :meth:`Recovery.standby` returns.

Ranks are *member ids*: the global rank each process had at ``init_process_group``.
They never change; group ranks do (``g.rank``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Protocol, TypeVar

from frforensics.errors import FrForensicsError
from frforensics.failures import is_comm_failure
from frforensics.recovery import _handover
from frforensics.recovery._handover import CHUNK_BYTES, LoadStateDictFn, StateDictFn
from frforensics.verdict import (
    EXIT_EXCLUDED,
    SCHEMA,
    Action,
    Verdict,
    VerdictError,
    headline,
    report_headline,
)

__all__ = [
    "EXIT_EXCLUDED",
    "Guard",
    "JobRecorder",
    "Options",
    "Recovery",
    "RecoveryError",
    "RecoveryFailed",
    "RecoveryRefused",
    "RecoveryUnavailable",
    "State",
    "VerdictSource",
    "available",
    "exclude_stragglers",
    "guard",
    "new_group",
    "propose_exclusion",
    "run_step",
    "setup",
    "standby",
    "state",
    "verdict_from_dump_dir",
]

log = logging.getLogger("frforensics.recovery")

#: Exit code of a process told it was excluded from the job: ``EXIT_EXCLUDED`` (79),
#: defined once in frforensics.verdict.
_NS = "frforensics/recovery/"
#: Set by frforensics-run in the standby processes it starts (``--spares``).
ENV_STANDBY = "FRFORENSICS_STANDBY"
#: The job's world size (torchrun's WORLD_SIZE), given to standbys by frforensics-run.
ENV_JOB_WORLD = "FRFORENSICS_JOB_WORLD_SIZE"
#: Set by frforensics-run in every process it starts: its agent reports exits.
ENV_RUN = "FRFORENSICS_RUN"
T = TypeVar("T")


class RecoveryError(FrForensicsError):
    """Base of the recovery errors; ``verdicts`` holds the job verdicts involved."""

    def __init__(self, message: str, verdicts: Sequence[dict[str, Any]] = ()) -> None:
        # each verdict's headline, made by the one rule (frforensics.verdict.headline)
        heads = [str(v.get("headline", "")) for v in verdicts if isinstance(v, dict) and v]
        full = message + "".join(f"\n  verdict: {h}" for h in heads if h)
        super().__init__(full)
        self.reason = message
        self.verdicts = list(verdicts)

    @property
    def verdict(self) -> dict[str, Any] | None:
        """The first verdict (the incident that started the recovery), if any."""
        return self.verdicts[0] if self.verdicts else None


class RecoveryUnavailable(RecoveryError):
    """This torch cannot re-form a process group (needs torch >= 2.15)."""


class RecoveryRefused(RecoveryError):
    """The verdict says excluding a rank will not help (``fix_code``) or names nobody."""


class RecoveryFailed(RecoveryError):
    """Recovery was attempted and did not complete within its bounds."""


def _torch() -> tuple[Any, Any, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    return torch, dist, c10d


def available() -> str | None:
    """None when this torch can reconfigure groups, else the one-line reason."""
    try:
        torch, _, c10d = _torch()
    except Exception as exc:  # pragma: no cover - torch missing
        return f"frforensics.recovery needs torch >= 2.15 (torch not importable: {exc})"
    if not hasattr(c10d, "_reconfigure") or not hasattr(c10d, "_get_reconfigure_handle"):
        return (f"frforensics.recovery needs torch >= 2.15 (process-group reconfigure); "
                f"this is torch {torch.__version__}")
    return None


class VerdictSource(Protocol):
    """Where a recovery gets the job's verdict when a step failed.

    ``source(timeout_s, detail)``: the verdict (a ``frforensics.verdict/1`` dict)
    within ``timeout_s`` seconds, or None when there is none (then recovery fails
    with "no verdict", never guessing whom to exclude). ``detail`` says what failed
    (``"recovery: DistBackendError: ..."``). Two come with frforensics: the
    recorder's (``frforensics.recorder.RecorderVerdicts``, the default) and
    :func:`verdict_from_dump_dir`; a plain function of the same shape is one too.
    Exceptions it raises are logged and count as no verdict.
    """

    def __call__(self, timeout_s: float, detail: str, /) -> dict[str, Any] | None: ...


class JobRecorder(VerdictSource, Protocol):
    """What recovery tells the job's recorder, and asks it, beyond the verdict.

    ``frforensics.recorder.RecorderVerdicts`` (recorder/_source.py) is the one
    implementation; none of its methods raises.
    """

    def settle_s(self, detail: str) -> float:
        """Seconds to wait before asking for the verdict after the failure ``detail``."""
        ...

    def note_reconfigure(self, group: Any, *, uuid: int, old_members: Sequence[int],
                         members: Sequence[int], reason: str) -> None:
        """``group`` was re-formed over ``members`` (member ids)."""
        ...

    def next_incident(self) -> None:
        """A recovery ended the incident: the next hang is a new one."""
        ...


@dataclass
class Options:
    """Bounds of one recovery, in seconds."""

    verdict_timeout_s: float = 90.0
    arrival_timeout_s: float = 20.0
    reconfigure_timeout_s: float = 20.0
    check_timeout_s: float = 10.0
    exit_excluded: bool = True
    #: Where the verdict comes from (a :class:`VerdictSource`); the same as
    #: ``setup(source=...)``. None: the recorder's verdict at hang time.
    verdict_source: VerdictSource | None = None
    #: The most ranks this job may exclude over its life (None: no limit).
    max_exclusions: int | None = None
    #: Never exclude below this many survivors (standbys not counted).
    min_world_size: int = 1
    #: The member id whose process hosts the c10d store; excluding it would take the
    #: store with it. "auto": none under torchrun/frforensics-run (the agent's store,
    #: ``TORCHELASTIC_USE_AGENT_STORE=True``), else rank 0. None: the store is external.
    store_host: int | str | None = "auto"
    #: Planned exclusions (a slow GPU): every this many successful guarded steps the
    #: members agree, with one 1-element all_reduce, whether an exclusion was
    #: proposed (:func:`propose_exclusion`); 0 (default): never checked, no extra op.
    plan_check_every: int = 0
    #: The state hand-over's chunk (bytes sent per message; one such buffer per side).
    state_chunk_bytes: int = CHUNK_BYTES
    #: How long the members wait for the standbys to load the handed-over state.
    handover_timeout_s: float = 600.0


@dataclass
class _Sub:
    group: Any
    members: list[int]  # member ids, in group-rank order


@dataclass
class State:
    """This process's view of the job's membership (``recovery.state()``)."""

    me: int
    members: list[int]
    uuid: int
    store: Any
    options: Options
    restart: str
    incident: int = 0
    spares: list[int] = field(default_factory=list)
    subgroups: list[_Sub] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    recovering: bool = False
    closed: bool = False
    #: Every member id this job ever had (a verdict may name no other rank).
    known: set[int] = field(default_factory=set)
    #: The member id hosting the store, None when it is outside the ranks.
    store_host: int | None = None
    #: Successful guarded steps since the last (re)configuration (the same on every member).
    steps: int = 0
    #: Planned exclusions already refused (their store value), not tried again.
    refused_plans: set[bytes] = field(default_factory=set)
    #: Where this job's verdicts come from (None: nowhere; recovery then fails).
    source: VerdictSource | None = None
    #: The job's recorder, told about re-formed groups (None: not importable).
    recorder: JobRecorder | None = None
    #: The training state's callables (torchft's shape); None: no state is handed over.
    state_dict: StateDictFn | None = None
    load_state_dict: LoadStateDictFn | None = None
    #: Successful guarded steps since setup (the state version; a standby takes the
    #: sender's with its state).
    version: int = 0
    #: The exclusion watcher (joined by ``Recovery.close``) and the event that wakes it.
    watcher: threading.Thread | None = None
    stop: threading.Event = field(default_factory=threading.Event)


class Recovery:
    """The job's recovery, made by :func:`setup`: hold it, guard each step, close it.

    Its :class:`State` (``.state``) is its own; the module functions act on the
    one :func:`setup` made last. ``members``/``me``/``spares``/``history``/``uuid``
    read that state (member ids: the global ranks of ``init_process_group``);
    ``rank``/``world_size`` are this process's place in the current group
    (-1 and the members' count in a standby).
    """

    __slots__ = ("_state",)

    def __init__(self, state: State) -> None:
        self._state = state

    @property
    def state(self) -> State:
        return self._state

    @property
    def me(self) -> int:
        """This process's member id (its rank at ``init_process_group``)."""
        return self._state.me

    @property
    def members(self) -> list[int]:
        """The current members (member ids, in group-rank order)."""
        return self._state.members

    @property
    def spares(self) -> list[int]:
        """Standbys not yet admitted (member ids)."""
        return self._state.spares

    @property
    def history(self) -> list[dict[str, Any]]:
        """One record per completed reconfiguration (uuid, old members, excluded...)."""
        return self._state.history

    @property
    def uuid(self) -> int:
        """The current configuration's number (1: the first)."""
        return self._state.uuid

    @property
    def rank(self) -> int:
        """This process's rank in the current group (-1: not a member)."""
        return _current_rank(self._state)

    @property
    def world_size(self) -> int:
        return len(self._state.members)

    @property
    def closed(self) -> bool:
        return self._state.closed

    @property
    def version(self) -> int:
        """Successful guarded steps since setup (a standby takes the survivors' count)."""
        return self._state.version

    def register_state(self, *, state_dict: StateDictFn,
                       load_state_dict: LoadStateDictFn) -> None:
        """The training state's callables, as :func:`setup`'s (when the model comes later).

        Every process registers them before the first guarded step (a standby
        before :meth:`standby`).
        """
        st = self._live()
        if not callable(state_dict) or not callable(load_state_dict):
            raise RecoveryError("register_state: state_dict and load_state_dict must be callables")
        st.state_dict, st.load_state_dict = state_dict, load_state_dict

    def guard(self) -> contextlib.AbstractContextManager[Guard]:
        """Guard one training step (see the module doc and :func:`guard`)."""
        return _guard(self._live())

    def run_step(self, fn: Callable[[], T]) -> tuple[T | None, Guard]:
        """``fn()`` under :meth:`guard`; returns (its result or None after a recovery, guard)."""
        result: T | None = None
        with self.guard() as g:
            result = fn()
        return result, g

    def new_group(self, ranks: Sequence[int], **kwargs: Any) -> Any:
        """``dist.new_group`` whose membership the guard keeps (re-formed on exclusion).

        ``ranks`` are member ids; every process of the current group calls it, as
        with ``dist.new_group``.
        """
        st = self._live()
        _, dist, _ = _torch()
        group = dist.new_group(list(ranks), **kwargs)
        st.subgroups.append(_Sub(group, list(ranks)))
        return group

    def propose_exclusion(self, ranks: Sequence[int], reason: str) -> bool:
        """Propose excluding ``ranks`` at the next planned check (:func:`propose_exclusion`)."""
        self._live()
        if _current is not self:
            raise RecoveryError("this Recovery is not the process's current one "
                                "(a later setup() replaced it)")
        return propose_exclusion(ranks, reason)

    def standby(self, *, timeout_s: float | None = None) -> Guard:
        """In a spare process: wait until a recovery admits it; returns its place.

        When the survivors hand over their state (``setup(state_dict=...)``), it is
        loaded here, before this returns. A ``Guard`` with ``reconfigured`` False
        means the job finished without needing this standby (every member closed):
        exit 0. Raises :class:`RecoveryFailed` when ``timeout_s`` passes first.
        """
        return _standby(self._live(), timeout_s)

    def close(self) -> None:
        """Stop watching the store (the exclusion watcher ends); idempotent.

        The groups stay as they are; guarding a step afterwards raises
        :class:`RecoveryError`. A member's close counts towards the job's end: once
        every current member closed, standbys still waiting in :meth:`standby`
        return (``reconfigured`` False) and can exit 0.
        """
        global _current
        st = self._state
        if not st.closed and st.me in st.members:
            with contextlib.suppress(Exception):  # the store may be gone at the very end
                st.store.add(f"{st.uuid}/closed", 1)
        st.closed = True
        st.stop.set()
        if _current is self:
            _current = None
        watcher = st.watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=2.0)  # it polls every 0.1 s; a store call is bounded

    def __enter__(self) -> Recovery:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        st = self._state
        return (f"Recovery(me={st.me}, members={st.members}, uuid={st.uuid}, "
                f"spares={st.spares}{', closed' if st.closed else ''})")

    def _live(self) -> State:
        if self._state.closed:
            raise RecoveryError("this Recovery was closed")
        return self._state


#: The Recovery setup() made last (the module functions act on it).
_current: Recovery | None = None
#: Whether the interpreter-exit hook that closes it is registered.
_exit_hook = False


def _require() -> Recovery:
    if _current is None:
        raise RecoveryError("frforensics.recovery.setup() was not called")
    return _current


def state() -> State:
    """The current membership state; :class:`RecoveryError` before :func:`setup`."""
    return _require().state


# ---------------------------------------------------------------- store helpers

def job_store(store: Any, restart: str = "0") -> Any:
    """Recovery's namespace in the job's store: ``frforensics/recovery/<restart>/``.

    Rooted at the store under every ``PrefixStore`` (init_process_group adds
    ``default_pg`` and the group's name, distributed_c10d.py), so that
    frforensics-run's agent, a client of the same TCPStore, sees the same keys;
    one namespace per torchrun restart (``TORCHELASTIC_RESTART_COUNT``).
    """
    _, dist, _ = _torch()
    root = store
    while isinstance(root, dist.PrefixStore):
        root = root.underlying_store
    return dist.PrefixStore(f"{_NS}{restart}", root)


def _get(store: Any, key: str, deadline: float) -> bytes | None:
    """The key's value, or None when it is not set by ``deadline`` (monotonic)."""
    while True:
        try:
            if store.check([key]):
                return bytes(store.get(key))
        except Exception as exc:
            raise RecoveryFailed(f"the c10d store is unreachable ({exc})") from exc
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _add(store: Any, key: str, value: int) -> int:
    try:
        return int(store.add(key, value))
    except Exception as exc:
        raise RecoveryFailed(f"the c10d store is unreachable ({exc})") from exc


def _set(store: Any, key: str, value: str) -> None:
    try:
        store.set(key, value)
    except Exception as exc:
        raise RecoveryFailed(f"the c10d store is unreachable ({exc})") from exc


def _handle(group: Any = None) -> str:
    _, _, c10d = _torch()
    return str(c10d._get_reconfigure_handle(group))


def _reconfigure(uuid: int, handles: list[str], group: Any, timeout_s: float) -> None:
    _, _, c10d = _torch()
    work = c10d._reconfigure(uuid, handles, group=group, timeout=timedelta(seconds=timeout_s))
    # The reconfigure Work refuses a finite wait ("FutureWrappingWork::wait() with
    # finite timeout not implemented", torch 2.15); the backend bounds it by the
    # timeout above, and this thread bounds it again so we never hang here.
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            work.wait()
            outcome.append(None)
        except BaseException as exc:  # handed to the caller's thread
            outcome.append(exc)

    waiter = threading.Thread(target=wait, name="frforensics-reconfigure", daemon=True)
    waiter.start()
    waiter.join(timeout_s + 5.0)
    if not outcome:
        raise RecoveryFailed(f"reconfigure (uuid {uuid}) did not finish in {timeout_s + 5:g} s")
    if outcome[0] is not None:
        raise RecoveryFailed(f"reconfigure (uuid {uuid}) failed: {outcome[0]}")


# ---------------------------------------------------------------- setup

def setup(*, spares: int = 0, options: Options | None = None,
          source: VerdictSource | None = None,
          recorder: JobRecorder | None = None,
          state_dict: StateDictFn | None = None,
          load_state_dict: LoadStateDictFn | None = None) -> Recovery:
    """First configuration of the default group (collective over every process).

    ``state_dict`` / ``load_state_dict`` (torchft's ``Manager`` shape, both or
    neither): the training state -- a nested dict of tensors and plain values --
    that one survivor hands to each standby a recovery admits, over the re-formed
    group, before :meth:`Recovery.standby` returns; then every member checks that
    they hold the same state version (docs/recovery.md, "The state hand-over").

    Call right after ``init_process_group(..., enable_reconfigure=True)``. The
    last ``spares`` processes become standbys (call :meth:`Recovery.standby`
    there); the others form the group. ``source``: where verdicts come from
    (default ``options.verdict_source``, else ``recorder``); ``recorder``: the
    job's recorder (default ``frforensics.recorder.RecorderVerdicts()``, which
    does nothing while the recorder is off). Returns the :class:`Recovery`
    (and makes it the one the module functions use; a previous one is closed);
    raises :class:`RecoveryUnavailable` on torch < 2.15 or a group created
    without ``enable_reconfigure=True``.
    """
    global _current
    why = available()
    if why is not None:
        raise RecoveryUnavailable(why)
    _, _, c10d = _torch()
    pg = c10d._get_default_group()
    if not c10d._supports_reconfigure(pg):
        raise RecoveryUnavailable("the default group's backend cannot reconfigure "
                                  "(init_process_group(..., enable_reconfigure=True))")
    opts = options or Options()
    if (state_dict is None) != (load_state_dict is None):
        raise RecoveryError("setup: give both state_dict and load_state_dict, or neither")
    if source is not None and opts.verdict_source is not None \
            and source is not opts.verdict_source:
        raise RecoveryError("two verdict sources: setup(source=...) and "
                            "Options(verdict_source=...); give one")
    if recorder is None:
        from frforensics.recorder import RecorderVerdicts

        recorder = RecorderVerdicts()
    source = source or opts.verdict_source or recorder
    if _current is not None:
        _current.close()
    store = job_store(c10d._get_default_store(),
                      os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    me, world = pg.rank(), pg.size()
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host: int | None = (None if agent_store else 0) if opts.store_host == "auto" \
        else (opts.store_host if isinstance(opts.store_host, int) else None)
    if os.environ.get(ENV_STANDBY) == "1":
        # A standby started by frforensics-run: its own member id (RANK), outside the
        # job's world; it joins the membership the job has now.
        job_world = int(os.environ.get(ENV_JOB_WORLD, "0") or 0)
        uuid, members = 1, list(range(job_world))
        raw = _get(store, "current", time.monotonic())
        if raw is not None:
            cur = json.loads(raw)
            uuid, members = int(cur["uuid"]), [int(m) for m in cur["members"]]
        st = State(me=me, members=members, uuid=uuid, store=store, options=opts,
                   restart=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
                   spares=[me], known=set(range(job_world)) | set(members) | {me},
                   store_host=host, source=source, recorder=recorder,
                   state_dict=state_dict, load_state_dict=load_state_dict)
        _current = Recovery(st)
        _add(store, "standbys", 1)
        _start_watch(st)
        return _current
    if not 0 <= spares < world:
        raise RecoveryError(f"spares={spares} leaves no active rank in a world of {world}")
    members = list(range(world - spares))
    st = State(me=me, members=members, uuid=1, store=store, options=opts,
               restart=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
               spares=list(range(world - spares, world)), known=set(range(world)),
               store_host=host, source=source, recorder=recorder,
               state_dict=state_dict, load_state_dict=load_state_dict)
    made = _current = Recovery(st)
    if me in st.spares:
        _add(store, "standbys", 1)
    if me == 0:
        _set(store, "current", json.dumps({"uuid": 1, "members": members}))
        _set(store, "setup", "1")  # frforensics-run: this job recovers; keep survivors
    if me in members:
        _set(store, f"1/h/{me}", _handle())
        deadline = time.monotonic() + opts.arrival_timeout_s
        handles = []
        for m in members:
            raw = _get(store, f"1/h/{m}", deadline)
            if raw is None:
                raise RecoveryFailed(f"setup: rank {m} did not publish its handle in "
                                     f"{opts.arrival_timeout_s:g} s")
            handles.append(raw.decode())
        _reconfigure(1, handles, None, opts.reconfigure_timeout_s)
    _tell_recorder(st, pg, 1, list(range(world)), members, "first configuration")
    _start_watch(st)
    return made


def _start_watch(st: State) -> None:
    """The exclusion watcher, stopped and joined by close() (also at interpreter exit)."""
    global _exit_hook
    st.watcher = threading.Thread(target=_exclusion_watch, args=(st,),
                                  name="frforensics-recovery", daemon=True)
    st.watcher.start()
    if not _exit_hook:
        # A daemon thread still inside a store call when the interpreter finalizes is
        # ended by pthread_exit from take_gil, which unwinds through pybind11's
        # noexcept frames: std::terminate, SIGABRT ("terminate called without an
        # active exception"), the job's exit code -6. Join it before that.
        _exit_hook = True
        atexit.register(_close_at_exit)


def _close_at_exit() -> None:
    with contextlib.suppress(Exception):
        if _current is not None:
            _current.close()


def new_group(ranks: Sequence[int], **kwargs: Any) -> Any:
    """:meth:`Recovery.new_group` of the Recovery :func:`setup` made."""
    return _require().new_group(ranks, **kwargs)


# ---------------------------------------------------------------- the guard

@dataclass
class Guard:
    """What one guarded step did: ``reconfigured``, and this process's new place."""

    reconfigured: bool = False
    rank: int = -1
    world_size: int = -1
    excluded: list[int] = field(default_factory=list)
    verdict: dict[str, Any] | None = None
    seconds: float = 0.0
    error: BaseException | None = None
    #: Where the recovery's seconds went: ``verdict_s`` (the failure or planned check
    #: to the agreed verdict), ``reform_s`` (arrival, decision, reconfigure, check),
    #: ``handover_s`` (the state to the standbys and the agreement; 0 without one).
    phases: dict[str, float] = field(default_factory=dict)


def _is_comm_failure(exc: BaseException) -> bool:
    _, dist, _ = _torch()
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        # The messages failed ops raise (the one classifier, frforensics.failures); a
        # program's own RuntimeError is not a communication failure.
        return is_comm_failure(text)
    return False


def guard() -> contextlib.AbstractContextManager[Guard]:
    """Run a training step; on a failed collective, recover (see the module doc).

    The step's own exception is swallowed only when recovery succeeded
    (``g.reconfigured``); otherwise :class:`RecoveryRefused` or
    :class:`RecoveryFailed` is raised from it. Other exceptions pass through.
    :meth:`Recovery.guard` of the Recovery :func:`setup` made.
    """
    return _require().guard()


@contextlib.contextmanager
def _guard(st: State) -> Iterator[Guard]:
    g = Guard(rank=_current_rank(st), world_size=len(st.members))
    try:
        yield g
    except Exception as exc:
        if not _is_comm_failure(exc):
            raise
        g.error = exc
        recover(st, g, cause=exc)
        return
    st.version += 1
    _planned_check(st, g)


def propose_exclusion(ranks: Sequence[int], reason: str) -> bool:
    """Propose excluding ``ranks`` (member ids) at the next planned check.

    Any process may call it (an ``on_verdict`` hook, an operator's tool): the
    proposal goes to the store (the first one per membership wins) and is carried
    out at a step boundary by :func:`guard` when ``Options.plan_check_every`` is
    set, with the same rules and bounds as a failure's verdict. True when this
    proposal is the one stored.
    """
    st = state()
    named = sorted({int(r) for r in ranks})
    raw = Verdict(status="planned", culprit_ranks=tuple(named),
                  actions=tuple(Action(rank=r, action="replace_gpu_or_host", because="planned")
                                for r in named),
                  headline=headline("planned", reason)).dumps()
    try:
        got = st.store.compare_set(f"{st.uuid + 1}/plan", "", raw)
    except Exception as exc:
        raise RecoveryFailed(f"the c10d store is unreachable ({exc})") from exc
    return bytes(got).decode() == raw


def exclude_stragglers(windows: int = 3) -> Callable[[dict[str, Any]], None]:
    """An ``on_verdict`` hook: a rank the live straggler finding names with
    ``replace_gpu_or_host`` in ``windows`` consecutive reports is proposed for a
    planned exclusion (``recorder.enable(..., on_verdict=recovery.exclude_stragglers())``).
    """
    if windows < 1:
        raise ValueError("windows must be >= 1")
    streak: dict[int, int] = {}

    def hook(doc: dict[str, Any]) -> None:
        if not isinstance(doc, dict) or doc.get("kind") != "straggler":
            return  # a hang's verdict: the guard handles those
        # Only the actions are read (a hook is handed whatever its caller built); each
        # is checked as in any verdict (Action.from_json), a malformed one names nobody.
        raw = doc.get("actions")
        named = set()
        for i, entry in enumerate(raw if isinstance(raw, list) else []):
            try:
                a = Action.from_json(entry, f"actions[{i}]")
            except VerdictError as exc:
                log.warning("frforensics.recovery: straggler document: %s", exc)
                continue
            if a.action == "replace_gpu_or_host":
                named.add(a.rank)
        for r in list(streak):
            if r not in named:
                del streak[r]
        for r in named:
            streak[r] = streak.get(r, 0) + 1
        due = sorted(r for r, n in streak.items() if n >= windows)
        if due:
            propose_exclusion(due, f"straggler in {windows} consecutive window(s): "
                                   f"rank(s) {due}")
            for r in due:
                del streak[r]

    return hook


def _planned_check(st: State, g: Guard) -> None:
    """At a step boundary: carry out a proposed exclusion, agreed by one all_reduce."""
    every = st.options.plan_check_every
    if every <= 0 or st.me not in st.members:
        return
    st.steps += 1
    if st.steps % every:
        return
    torch, dist, _ = _torch()
    key = f"{st.uuid + 1}/plan"
    raw: bytes | None = None
    with contextlib.suppress(Exception):
        if st.store.check([key]):
            raw = bytes(st.store.get(key))
    seen = torch.tensor([0.0 if raw is None or raw in st.refused_plans else 1.0])
    # Every member reads the key at a different moment: the MAX tells all of them
    # that one saw it, and then it is there for everyone to read.
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    if seen.item() <= 0:
        return
    if raw is None:
        raw = _get(st.store, key, time.monotonic() + st.options.arrival_timeout_s)
    if raw is None:
        raise RecoveryFailed(f"a planned exclusion was seen but {key} is not readable")
    try:
        planned = json.loads(raw)
    except ValueError as exc:
        raise RecoveryError(f"malformed planned exclusion ({key}): {exc}") from None
    try:
        recover(st, g, planned=planned)
    except RecoveryRefused as exc:
        st.refused_plans.add(raw)
        _say(st, f"planned exclusion refused, training on: {exc.reason}")


def run_step(fn: Callable[[], T]) -> tuple[T | None, Guard]:
    """``fn()`` under :func:`guard`; returns (its result or None after a recovery, guard)."""
    return _require().run_step(fn)


def _current_rank(st: State) -> int:
    return st.members.index(st.me) if st.me in st.members else -1


# ---------------------------------------------------------------- verdict

#: What a worker's death says about its host, as frforensics-run's agent saw it.
#: SIGKILL is the kernel's OOM killer or the host's own tooling (137 = 128 + 9 when
#: a shell wrapped the worker); other deaths are evidence only, the verdict decides.
_HOST_DEATHS = {"SIGKILL"}


def exit_record(rank: int, exitcode: int, *, host: str, pid: int) -> dict[str, Any]:
    """What frforensics-run's agent stores about a worker that exited (``exit/<rank>``)."""
    import signal as _signal

    sig = None
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            sig = _signal.Signals(-exitcode).name
    elif exitcode == 137:
        sig = "SIGKILL"
    return {"rank": rank, "exitcode": exitcode, "signal": sig, "host": host, "pid": pid,
            "time_ns": time.time_ns(), "excluded": exitcode == EXIT_EXCLUDED}


def _exit_records(st: State) -> list[dict[str, Any]]:
    """The agent's records of members that exited (frforensics-run), oldest first."""
    try:
        if _add(st.store, "exits", 0) <= 0:
            return []
        keys = [f"exit/{m}" for m in st.members]
        present = [k for k in keys if st.store.check([k])]
        out = []
        for raw in (st.store.multi_get(present) if present else []):
            with contextlib.suppress(ValueError, TypeError):
                rec = json.loads(bytes(raw))
                if isinstance(rec, dict) and isinstance(rec.get("rank"), int):
                    out.append(rec)
        return sorted(out, key=lambda r: int(r.get("time_ns") or 0))
    except Exception:
        return []


def _agent_verdict(st: State) -> dict[str, Any] | None:
    """A verdict from frforensics-run's agent: members killed (SIGKILL/OOM) are replaced."""
    records = [r for r in _exit_records(st) if not r.get("excluded")]
    dead = [r for r in records if r.get("signal") in _HOST_DEATHS]
    if not dead:
        return None
    ranks = sorted({int(r["rank"]) for r in dead})
    what = "; ".join(f"rank {r['rank']} on {r.get('host')} killed by {r['signal']} "
                     f"(exit code {r['exitcode']}, pid {r.get('pid')})" for r in dead)
    return Verdict(
        status="dead", culprit_ranks=tuple(ranks),
        actions=tuple(Action(rank=r, action="replace_gpu_or_host", because="killed")
                      for r in ranks),
        headline=headline("dead", f"{what}: the OOM killer or the host (frforensics-run's agent)"),
        evidence=tuple(records), source="frforensics-run").to_json()


def _wait_verdict(st: State, deadline: float, detail: str) -> dict[str, Any] | None:
    verdict = _wait_verdict_inner(st, deadline, detail)
    if verdict is not None and os.environ.get(ENV_RUN) == "1":
        records = _exit_records(st)
        if records and "evidence" not in verdict:
            verdict = {**verdict, "evidence": records}  # the agent's exit codes and signals
    return verdict


def _under_agent_poll(st: State, seconds: float) -> dict[str, Any] | None:
    """frforensics-run's verdict within ``seconds`` (its monitor runs every 0.1 s)."""
    if os.environ.get(ENV_RUN) != "1":
        return None
    end = time.monotonic() + seconds
    while True:
        v = _agent_verdict(st)
        if v is not None or time.monotonic() >= end:
            return v
        time.sleep(0.05)


def _wait_verdict_inner(st: State, deadline: float, detail: str) -> dict[str, Any] | None:
    fast = _under_agent_poll(st, 0.0)
    if fast is not None:
        return fast
    source, rec = st.source, st.recorder
    if source is None:
        return None
    if rec is not None and source is rec:
        # The op failed at once because a peer died: give the dead peer's heartbeat
        # time to go stale first, so the dumps the verdict reads name it (dead_rank)
        # rather than a rank merely missing (the recorder's excepthook does the same);
        # frforensics-run's agent may name it meanwhile (a SIGKILL).
        settle_end = time.monotonic() + max(0.0, min(rec.settle_s(detail),
                                                     deadline - time.monotonic()))
        if settle_end > time.monotonic():
            fast = _under_agent_poll(st, settle_end - time.monotonic())
            if fast is not None:
                return fast
            time.sleep(max(0.0, settle_end - time.monotonic()))
    try:
        v = source(max(0.0, deadline - time.monotonic()), detail)
    except Exception as exc:
        _say(st, f"the verdict source failed: {exc}")
        return None
    return v if isinstance(v, dict) else None


def _action_rank(i: int, action: Action, known: set[int]) -> int:
    """The action's rank (an int, checked by ``Action.from_json``) naming a member this
    job had."""
    if action.rank not in known:
        raise RecoveryError(f"malformed verdict: actions[{i}].rank {action.rank} is not a member "
                            f"of this job (members ever: {sorted(known)[:16]})")
    return action.rank


def _actions(verdict: Any, known: set[int]) -> list[tuple[int, str]]:
    """(rank, action) of every action, or :class:`RecoveryError` naming the bad field
    (``Verdict.from_json``'s message: ``actions[0].rank is 'two' (want an int member id)``)."""
    try:
        parsed = Verdict.from_json(verdict, require_schema=False)
    except VerdictError as exc:
        raise RecoveryError(str(exc), [verdict] if isinstance(verdict, dict) else []) from None
    try:
        return [(_action_rank(i, a, known), a.action) for i, a in enumerate(parsed.actions)]
    except RecoveryError as exc:
        raise RecoveryError(exc.reason, [verdict]) from None


def exclusion_from(verdict: dict[str, Any], members: Sequence[int], *,
                   known: Sequence[int] | None = None, store_host: int | None = None,
                   max_exclusions: int | None = None, excluded_so_far: int = 0,
                   min_world_size: int = 1) -> list[int]:
    """The member ids to exclude, or :class:`RecoveryRefused` with the verdict.

    ``fix_code`` anywhere refuses (excluding a rank will not fix a desync); the
    ranks whose action is ``replace_gpu_or_host`` are excluded; a verdict that
    names none (``inspect`` only, or an analysis error) refuses too. So does one
    that would exclude every member, the store host's rank (``store_host``: the
    store would go with it), more ranks than ``max_exclusions`` allows over the
    job, or leave fewer than ``min_world_size`` survivors. A malformed action (a
    rank that is not an int — ``None``, ``"two"``, ``1.9``, ``True`` — or not a
    member this job ever had, in ``known``) raises :class:`RecoveryError` naming
    the field. Ranks of ``known`` that are no longer members are ignored.
    """
    ever = set(known) if known is not None else set(members)
    ever |= set(members)
    actions = _actions(verdict, ever)
    fix = sorted({r for r, a in actions if a == "fix_code"})
    if fix:
        raise RecoveryRefused(
            f"not excluding anyone: the verdict says fix_code for rank(s) {fix} "
            "(a code bug: excluding ranks will not help)", [verdict])
    out = sorted({r for r, a in actions if a == "replace_gpu_or_host" and r in members})
    if not out:
        status = verdict.get("status")  # a dict: _actions checked it is one
        raise RecoveryRefused(
            f"not excluding anyone: the verdict (status {status}) names no rank to replace "
            f"(actions: {actions})", [verdict])
    if len(out) >= len(members):
        raise RecoveryRefused(
            f"not excluding anyone: the verdict would exclude every member ({out}); "
            "nobody would be left to train", [verdict])
    if store_host is not None and store_host in out:
        raise RecoveryRefused(
            f"not excluding anyone: rank {store_host} hosts the c10d store and the job has "
            "no external store (run under frforensics-run or torchrun, whose agent hosts it)",
            [verdict])
    if max_exclusions is not None and excluded_so_far + len(out) > max_exclusions:
        raise RecoveryRefused(
            f"not excluding anyone: excluding {out} would make {excluded_so_far + len(out)} "
            f"exclusions in this job, more than max_exclusions={max_exclusions}", [verdict])
    if len(members) - len(out) < min_world_size:
        raise RecoveryRefused(
            f"not excluding anyone: excluding {out} would leave {len(members) - len(out)} "
            f"rank(s), fewer than min_world_size={min_world_size}", [verdict])
    return out


def verdict_from_dump_dir(dump_dir: str | os.PathLike[str], *, world_size: int,
                          settle_s: float = 1.5) -> Callable[[float, str], dict[str, Any] | None]:
    """A verdict source for jobs whose ranks share a dump directory.

    When called, this rank dumps (the recorder's API dump, unless its watchdog
    already did), waits until every rank of ``world_size`` has a dump there or
    no new dump appeared for ``settle_s``, then runs ``fr-analyze --format json``
    in a child process (the training process imports no analysis code) and
    returns the report's verdict fields. Used when the recorder has no verdict
    of its own at hang time; the first survivor's verdict is the one everyone
    uses (see :func:`recover`).
    """
    from pathlib import Path

    directory = Path(dump_dir)

    def source(timeout_s: float, detail: str) -> dict[str, Any] | None:
        import subprocess

        end = time.monotonic() + timeout_s
        with contextlib.suppress(Exception):
            import frforensics.recorder as recorder

            mine = directory / f"frdump_rank_{state().me}"
            # The watchdog's dump (with the peers' heartbeats) is the better evidence:
            # dump here only when the step failed before any deadline fired.
            if recorder.is_enabled() and not mine.exists():
                recorder.dump("api", f"recovery: {detail}"[:300])
        seen: set[str] = set()
        changed = time.monotonic()
        while time.monotonic() < end:
            now = {p.name for p in directory.glob("frdump_rank_*")}
            if now != seen:
                seen, changed = now, time.monotonic()
            if len(seen) >= world_size or (seen and time.monotonic() - changed >= settle_s):
                break
            time.sleep(0.1)
        if not seen:
            return None
        try:
            out = subprocess.run(
                [sys.executable, "-m", "frforensics", "--format", "json",
                 "--world-size", str(world_size), str(directory)],
                capture_output=True, text=True, timeout=max(1.0, end - time.monotonic()),
                check=False)
            report = json.loads(out.stdout)
            # the report is a file: its status, culprits and actions are checked
            found = Verdict.from_json({"schema": SCHEMA, "status": report.get("status"),
                                       "culprit_ranks": report.get("culprit_ranks", []),
                                       "actions": report.get("actions", [])})
        except Exception as exc:
            return Verdict(status="error", headline=headline("error", f"fr-analyze failed ({exc})"),
                           error=str(exc)).to_json()
        head = report_headline(report)
        return replace(found, headline=head, text=head, source=str(directory)).to_json()

    return source


def _agree_on_verdict(st: State, uuid: int, local: dict[str, Any] | None,
                      deadline: float) -> dict[str, Any] | None:
    """The verdict every survivor uses for attempt ``uuid``: the first one published."""
    key = f"{uuid}/verdict"
    try:
        raw = st.store.compare_set(key, "", json.dumps(local)) if local is not None else None
    except Exception as exc:
        raise RecoveryFailed(f"the c10d store is unreachable ({exc})") from exc
    if raw is None:
        raw = _get(st.store, key, deadline)
    if raw is None:
        return None
    try:
        verdict = json.loads(bytes(raw))
    except ValueError as exc:
        raise RecoveryError(f"malformed verdict in the store ({key}): {exc}") from None
    if not isinstance(verdict, dict):
        raise RecoveryError(f"malformed verdict in the store ({key}): "
                            f"{type(verdict).__name__}, not an object")
    return verdict


# ---------------------------------------------------------------- recovery

def recover(st: State, g: Guard, *, cause: BaseException | None = None,
            planned: dict[str, Any] | None = None) -> None:
    """Exclude the verdict's culprits and re-form the groups (called by the guard).

    ``planned``: the verdict of a planned exclusion (no step failed; a refusal
    leaves the job running, so it does not tell frforensics-run to fail the job).
    """
    t0 = time.monotonic()
    opts = st.options
    with st.lock:
        st.recovering = True
    try:
        detail = f"recovery: {type(cause).__name__}: {str(cause)[:200]}" if cause else "recovery"
        if planned is None:
            _say(st, f"step failed ({str(cause).splitlines()[0][:160] if cause else 'requested'})"
                     f"; waiting for the verdict (<= {opts.verdict_timeout_s:g} s)")
        else:
            _say(st, f"planned exclusion at step boundary {st.steps}")
        deadline = t0 + opts.verdict_timeout_s
        local = planned if planned is not None else _wait_verdict(st, deadline, detail)
        verdict = _agree_on_verdict(st, st.uuid + 1, local, deadline)
        if verdict is None:
            raise RecoveryFailed(
                f"no verdict within {opts.verdict_timeout_s:g} s (is frforensics.recorder "
                "enabled with the verdict at hang time?); not guessing whom to exclude") from cause
        g.verdict = verdict
        g.phases["verdict_s"] = time.monotonic() - t0
        _say(st, f"verdict: {' '.join(str(verdict.get('headline', '')).split())}")
        excluded = exclusion_from(
            verdict, st.members, known=sorted(st.known), store_host=st.store_host,
            max_exclusions=opts.max_exclusions,
            excluded_so_far=sum(len(h["excluded"]) for h in st.history),
            min_world_size=opts.min_world_size)
        _refuse_lost_shards(st, excluded, verdict)
        t_verdict = time.monotonic()
        _reform(st, g, verdict, excluded, t0)
        g.phases["reform_s"] = time.monotonic() - t_verdict - g.phases.get("handover_s", 0.0)
    except RecoveryError as exc:
        _say(st, f"recovery gave up: {exc.reason}")
        if planned is not None and isinstance(exc, RecoveryRefused):
            raise exc from cause  # a refused plan: the job trains on
        # frforensics-run's agent fails the job (as torchrun would) on this key.
        with contextlib.suppress(Exception):
            st.store.set("gave_up", json.dumps({
                "rank": st.me, "kind": type(exc).__name__, "reason": exc.reason[:500]}))
        raise exc from cause
    finally:
        st.recovering = False
    g.seconds = time.monotonic() - t0
    _say(st, f"reconfigured: now rank {g.rank} of {g.world_size} (excluded {g.excluded}, "
             f"uuid {st.uuid}, {g.seconds:.2f} s after "
             f"{'the step failed' if planned is None else 'the planned check'}: "
             + ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in g.phases.items()) + ")")


def _reform(st: State, g: Guard, verdict: dict[str, Any], excluded: list[int],
            t0: float) -> None:
    opts = st.options
    uuid = st.uuid + 1
    survivors = [m for m in st.members if m not in excluded]
    if st.me not in survivors:
        _exit_excluded(st, verdict)
    # 1. arrive: a fresh handle per survivor, per attempt.
    _set(st.store, f"{uuid}/h/{st.me}", _handle())
    _set(st.store, f"{uuid}/open", "1")  # standbys watch this
    leader = survivors[0]
    deadline = time.monotonic() + opts.arrival_timeout_s
    if st.me == leader:
        handles: dict[int, str] = {}
        for m in survivors:
            raw = _get(st.store, f"{uuid}/h/{m}", deadline)
            if raw is None:
                _set(st.store, f"{uuid}/decision", json.dumps(
                    {"failed": f"rank {m} did not arrive within {opts.arrival_timeout_s:g} s"}))
                raise RecoveryFailed(
                    f"rank {m} (a survivor) did not arrive at the recovery within "
                    f"{opts.arrival_timeout_s:g} s", [verdict, *_later_verdicts(st)])
            handles[m] = raw.decode()
        admitted = _admit_spares(st, uuid, len(excluded), deadline)
        members = survivors + [m for m, _ in admitted]
        handles.update(dict(admitted))
        decision = {"uuid": uuid, "members": members, "handles": [handles[m] for m in members],
                    "old_members": st.members, "excluded": excluded,
                    "reason": verdict.get("headline", ""), "incident": verdict.get("incident"),
                    # the leader's word for everyone: a survivor hands its state over
                    "state": st.state_dict is not None}
        _set(st.store, f"{uuid}/decision", json.dumps(decision))
        _set(st.store, "current", json.dumps({"uuid": uuid, "members": members}))
    else:
        raw = _get(st.store, f"{uuid}/decision",
                   deadline + opts.arrival_timeout_s)  # the leader's own bound, then ours
        if raw is None:
            raise RecoveryFailed(f"no membership decision from rank {leader} (the leader) "
                                 f"within {2 * opts.arrival_timeout_s:g} s", [verdict])
        decision = json.loads(raw)
        if "failed" in decision:
            raise RecoveryFailed(str(decision["failed"]), [verdict, *_later_verdicts(st)])
    _apply(st, g, decision, verdict)


def _apply(st: State, g: Guard, decision: dict[str, Any], verdict: dict[str, Any]) -> None:
    """Reconfigure the default group (and subgroups) as ``decision`` says."""
    opts = st.options
    _, dist, c10d = _torch()
    torch, _, _ = _torch()
    uuid = int(decision["uuid"])
    members = [int(m) for m in decision["members"]]
    excluded = [int(m) for m in decision["excluded"]]
    try:
        _reconfigure(uuid, list(decision["handles"]), None, opts.reconfigure_timeout_s)
    except RecoveryFailed as exc:
        raise RecoveryFailed(exc.reason, [verdict]) from None
    except Exception as exc:
        raise RecoveryFailed(f"reconfigure (uuid {uuid}) failed: {exc}", [verdict]) from exc
    old = st.members
    st.members, st.uuid = members, uuid
    st.known.update(members)
    st.steps = 0
    _tell_recorder(st, c10d._get_default_group(), uuid, old, members,
                   str(decision.get("reason", ""))[:300])
    _reform_subgroups(st, excluded, uuid, verdict)
    # Prove the new group works: every member adds its member id + 1.
    t = torch.tensor([float(st.me + 1)])
    work = dist.all_reduce(t, async_op=True)
    try:
        ok = work.wait(timeout=timedelta(seconds=opts.check_timeout_s))
    except Exception as exc:
        raise RecoveryFailed(f"the re-formed group failed its check all_reduce: {exc}",
                             [verdict]) from exc
    expected = float(sum(m + 1 for m in members))
    if not ok or t.item() != expected:
        raise RecoveryFailed(f"the re-formed group's check all_reduce gave {t.item()}, "
                             f"expected {expected}", [verdict])
    t_handover = time.monotonic()
    if decision.get("state"):
        try:
            _hand_over(st, decision, verdict)
        except RecoveryError:
            raise
        except Exception as exc:  # a peer lost mid-transfer, the agreement's op failed
            raise RecoveryFailed(f"the state hand-over failed: {type(exc).__name__}: {exc}",
                                 [verdict]) from exc
    g.phases["handover_s"] = time.monotonic() - t_handover
    pg = c10d._get_default_group()
    g.reconfigured, g.rank, g.world_size, g.excluded = True, pg.rank(), pg.size(), excluded
    record = {"uuid": uuid, "old_members": old, "members": members, "excluded": excluded,
              "reason": decision.get("reason", ""), "time_ns": time.time_ns()}
    st.history.append(record)
    _note_recorder(st, record)


def _refuse_lost_shards(st: State, excluded: list[int], verdict: dict[str, Any]) -> None:
    """:class:`RecoveryRefused` when excluding ``excluded`` loses a shard of the state."""
    if st.state_dict is None:
        return
    try:
        why = _handover.lost_shards(st.state_dict(), excluded)
    except Exception as exc:  # the hand-over's own attempt will report a failing state_dict
        log.debug("frforensics.recovery: lost-shard check skipped: %s", exc)
        return
    if why:
        raise RecoveryRefused(f"not excluding anyone: {why}", [verdict])


def _hand_over(st: State, decision: dict[str, Any], verdict: dict[str, Any]) -> None:
    """One survivor's state to every admitted standby, then one agreement all_reduce.

    The first survivor sends; when its ``state_dict()`` cannot be flattened (it
    raised, or holds what cannot travel) the next one tries. The agreement --
    ``all_reduce(MAX)`` of ``[version, -version, sender failed, receiver failed]``
    -- runs on every member after each attempt, so all of them learn the outcome
    at once: a standby that could not take the state (its own model differs, its
    ``load_state_dict`` raised, the bytes arrived damaged) fails the recovery on
    every member; survivors whose versions differ (one finished the step the
    others failed) fail it too. Never a standby training on partial state.
    """
    torch, dist, _ = _torch()
    uuid = int(decision["uuid"])
    members = [int(m) for m in decision["members"]]
    old = {int(m) for m in decision["old_members"]}
    survivors = [m for m in members if m in old]
    admitted = [m for m in members if m not in old]
    deadline = time.monotonic() + st.options.arrival_timeout_s
    for attempt, sender in enumerate(survivors):
        key = f"{uuid}/state/{attempt}"
        failed = [0, 0]  # sender, receiver
        if st.me == sender:
            failed[0] = _send_state(st, key, admitted, members, deadline)
        elif st.me in admitted:
            failed[1] = _receive_state(st, key, members.index(sender), deadline)
            _set(st.store, f"{key}/loaded/{st.me}", str(failed[1]))
        if st.me not in admitted:
            # The transfer may outlast the group's op timeout (the hang budget): the
            # members not receiving wait for the standbys' word in the store, so the
            # agreement's all_reduce starts when everyone is there.
            end = time.monotonic() + st.options.handover_timeout_s
            for m in admitted:
                if _get(st.store, f"{key}/loaded/{m}", end) is None:
                    _say(st, f"rank {m} did not report its state loaded within "
                             f"{st.options.handover_timeout_s:g} s")
                    break
        flags = torch.tensor([st.version, -st.version, *failed], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        high, low, sender_failed, receiver_failed = (int(x) for x in flags.tolist())
        if receiver_failed:
            why = _reasons(st, f"{key}/why/", admitted)
            raise RecoveryFailed(f"a standby could not take the survivors' state: {why}",
                                 [verdict])
        if sender_failed:
            why = _reasons(st, f"{key}/why/", [sender])
            _say(st, f"rank {sender} could not hand over its state ({why}); the next survivor "
                     "tries")
            continue
        if high != -low:
            raise RecoveryFailed(f"the members hold different state versions (steps {-low} to "
                                 f"{high}): a survivor finished a step the others failed",
                                 [verdict])
        if admitted:
            _say(st, f"state version {high} handed over by rank {sender} to {admitted}")
        return
    raise RecoveryFailed("no survivor could hand over its state (each one's state_dict() "
                         "failed; see the lines above)", [verdict])


def _send_state(st: State, key: str, admitted: list[int], members: list[int],
                deadline: float) -> int:
    """The sender's side: 1 when its own state could not be sent (the next one tries)."""
    assert st.state_dict is not None
    try:
        manifest, tensors = _handover.flatten(st.state_dict(), version=st.version)
    except Exception as exc:
        reason = f"its state_dict() failed: {type(exc).__name__}: {exc}"[:500]
        _set(st.store, f"{key}/manifest", json.dumps({"failed": reason}))
        _set(st.store, f"{key}/why/{st.me}", reason)
        return 1
    _set(st.store, f"{key}/manifest", manifest.dumps())
    t0 = time.monotonic()
    sent = 0
    for m in admitted:
        ack = _get(st.store, f"{key}/ack/{m}", deadline)
        if ack != b"ok":
            continue  # that standby refused (or never answered): it says so in the agreement
        sent += _handover.send(tensors, dst=members.index(m), chunk_bytes=st.options.state_chunk_bytes)
    if sent:
        dt = max(time.monotonic() - t0, 1e-9)
        _say(st, f"sent {len(tensors)} tensors ({sent / 1e6:.1f} MB) to {admitted} in "
                 f"{dt:.2f} s ({sent / 1e6 / dt:.0f} MB/s)")
    return 0


def _receive_state(st: State, key: str, src: int, deadline: float) -> int:
    """The standby's side: 0 when it loaded the state, 1 (and the reason stored) if not."""

    def refuse(reason: str) -> int:
        _say(st, f"cannot take the survivors' state: {reason}")
        with contextlib.suppress(RecoveryError):
            _set(st.store, f"{key}/why/{st.me}", f"rank {st.me}: {reason}"[:1000])
        return 1

    raw = _get(st.store, f"{key}/manifest", deadline)
    if raw is None:
        return refuse(f"no state manifest from the sender within "
                      f"{st.options.arrival_timeout_s:g} s")
    if raw.startswith(b'{"failed"'):
        return 0  # the sender says it failed: the agreement tells everyone, the next one tries
    ack = "ok"
    try:
        manifest = _handover.Manifest.loads(raw)
        if st.state_dict is None or st.load_state_dict is None:
            raise _handover.HandoverError("this standby registered no state_dict/load_state_dict "
                                          "(recovery.setup(state_dict=..., load_state_dict=...))")
        mine, _ = _handover.flatten(st.state_dict(), version=0)
        wrong = _handover.mismatch(manifest, mine)
        if wrong:
            raise _handover.HandoverError(f"its state does not match this standby's "
                                          f"({wrong}); same model and optimizer on every "
                                          "process? (an optimizer's state exists only after "
                                          "its first step: torch.distributed.checkpoint's "
                                          "get_state_dict initialises it)")
    except Exception as exc:
        ack = f"refused: {exc}"
        _set(st.store, f"{key}/ack/{st.me}", ack[:1000])
        return refuse(str(exc))
    _set(st.store, f"{key}/ack/{st.me}", ack)
    try:
        tensors = _handover.receive(manifest, src=src, chunk_bytes=st.options.state_chunk_bytes)
        st.load_state_dict(_handover.unflatten(manifest, tensors))
    except Exception as exc:
        return refuse(f"{type(exc).__name__}: {exc}")
    st.version = manifest.version
    return 0


def _reasons(st: State, prefix: str, ranks: list[int]) -> str:
    """The reasons ``ranks`` stored under ``prefix`` (bounded wait), joined."""
    out = []
    end = time.monotonic() + 2.0
    for r in ranks:
        with contextlib.suppress(RecoveryError):
            raw = _get(st.store, f"{prefix}{r}", end)
            if raw is not None:
                out.append(raw.decode(errors="replace"))
    return "; ".join(out) or "no reason recorded"


def _reform_subgroups(st: State, excluded: list[int], uuid: int,
                      verdict: dict[str, Any]) -> None:
    opts = st.options
    for i, sub in enumerate(st.subgroups):
        if not set(sub.members) & set(excluded):
            continue  # untouched: keeps working as it is
        keep = [m for m in sub.members if m not in excluded]
        before, sub.members = sub.members, keep
        if st.me not in keep:
            continue
        key = f"{uuid}/sub{i}/h/"
        _set(st.store, key + str(st.me), _handle(sub.group))
        deadline = time.monotonic() + opts.arrival_timeout_s
        handles = []
        for m in keep:
            raw = _get(st.store, key + str(m), deadline)
            if raw is None:
                raise RecoveryFailed(f"subgroup {sub.members}: rank {m} did not publish its "
                                     f"handle in {opts.arrival_timeout_s:g} s", [verdict])
            handles.append(raw.decode())
        try:
            _reconfigure(uuid, handles, sub.group, opts.reconfigure_timeout_s)
        except Exception as exc:
            raise RecoveryFailed(f"subgroup {keep}: reconfigure failed: {exc}", [verdict]) from exc
        _tell_recorder(st, sub.group, uuid, before, keep, f"excluded {excluded}")


def _admit_spares(st: State, uuid: int, wanted: int,
                  deadline: float) -> list[tuple[int, str]]:
    """Up to ``wanted`` standbys that answered this recovery's ``open`` (id, handle).

    A standby registers as ``<uuid>/spare#<n>`` (``n`` from the store's counter);
    the leader waits up to 2 s for them, and only while some standby is alive
    (the ``standbys`` counter), so a job without standbys loses no time here.
    """
    out: list[tuple[int, str]] = []
    if wanted <= 0 or _add(st.store, "standbys", 0) <= 0:
        return out
    end = min(deadline, time.monotonic() + 2.0)
    while True:
        n = _add(st.store, f"{uuid}/nspare", 0)
        if n >= wanted or time.monotonic() >= end:
            break
        time.sleep(0.02)
    for i in range(1, n + 1):
        if len(out) >= wanted:
            break
        raw = _get(st.store, f"{uuid}/spare#{i}", time.monotonic())
        if raw is None:
            continue
        with contextlib.suppress(ValueError, TypeError, KeyError):
            entry = json.loads(raw)
            spare, handle = int(entry["id"]), str(entry["handle"])
            if spare not in st.members and spare not in [m for m, _ in out]:
                out.append((spare, handle))
    for spare, _ in out:
        if spare in st.spares:
            st.spares.remove(spare)
        st.known.add(spare)
    return out


def _later_verdicts(st: State) -> list[dict[str, Any]]:
    """The recorder's verdict of the next incident, when one arrives within the bound."""
    rec = st.recorder
    if rec is None:
        return []
    with contextlib.suppress(Exception):
        rec.next_incident()
        v = rec(st.options.arrival_timeout_s, "recovery failed: a survivor did not arrive")
        if isinstance(v, dict):
            return [v]
    return []


def _tell_recorder(st: State, group: Any, uuid: int, old: Sequence[int],
                   new: Sequence[int], reason: str) -> None:
    """The recorder gives a re-formed group a new identity (recorder/_reconfig.py)."""
    if st.recorder is not None:
        with contextlib.suppress(Exception):
            st.recorder.note_reconfigure(group, uuid=uuid, old_members=list(old),
                                         members=list(new), reason=reason)


def _note_recorder(st: State, record: dict[str, Any]) -> None:
    """Tell the recorder that the incident is over (the next hang is a new one)."""
    # Rank and world size stay the member ids of init_process_group: the
    # recorder's dump names and group members are in those terms
    # (recorder/_reconfig.py); the group rank is only the backend's.
    if st.recorder is not None:
        with contextlib.suppress(Exception):
            st.recorder.next_incident()


# ---------------------------------------------------------------- standby, exclusion

def standby(*, timeout_s: float | None = None) -> Guard:
    """Wait (in a spare process) until a recovery admits this process; returns its place.

    Raises :class:`RecoveryFailed` when ``timeout_s`` passes first.
    :meth:`Recovery.standby` of the Recovery :func:`setup` made.
    """
    return _require().standby(timeout_s=timeout_s)


def _standby(st: State, timeout_s: float | None) -> Guard:
    if st.me not in st.spares:
        raise RecoveryError(f"rank {st.me} is not a spare (spares: {st.spares})")
    end = None if timeout_s is None else time.monotonic() + timeout_s
    uuid = st.uuid + 1
    _say(st, "standing by")
    while end is None or time.monotonic() < end:
        if _job_finished(st):
            _say(st, "the job finished without needing this standby")
            return Guard()
        if _get(st.store, f"{uuid}/open", time.monotonic() + 0.2) is None:
            continue
        n = _add(st.store, f"{uuid}/nspare", 1)
        _set(st.store, f"{uuid}/spare#{n}", json.dumps({"id": st.me, "handle": _handle()}))
        raw = _get(st.store, f"{uuid}/decision", time.monotonic() + 3 * st.options.arrival_timeout_s)
        if raw is None:
            uuid += 1
            continue
        decision = json.loads(raw)
        if "failed" in decision:
            uuid += 1
            continue
        if st.me not in decision["members"]:
            st.uuid = uuid
            uuid += 1
            continue
        g = Guard()
        st.spares = [s for s in st.spares if s != st.me]
        for s in decision["members"]:
            if s in st.spares:
                st.spares.remove(s)
        st.known.update(int(m) for m in decision["members"])
        with contextlib.suppress(RecoveryError):
            _add(st.store, "standbys", -1)
        t_admitted = time.monotonic()
        _apply(st, g, decision, {"headline": decision.get("reason", "")})
        g.seconds = time.monotonic() - t_admitted
        g.phases["reform_s"] = g.seconds - g.phases.get("handover_s", 0.0)
        _say(st, f"admitted: now rank {g.rank} of {g.world_size}")
        return g
    raise RecoveryFailed(f"standby: not called in within {timeout_s:g} s")


def _job_finished(st: State) -> bool:
    """Every member of the current configuration closed its Recovery (the job is over)."""
    try:
        raw = st.store.get("current") if st.store.check(["current"]) else None
        current = json.loads(bytes(raw)) if raw is not None else None
        if not isinstance(current, dict):
            return False
        members = current.get("members")
        return isinstance(members, list) and bool(members) and \
            _add(st.store, f"{int(current['uuid'])}/closed", 0) >= len(members)
    except Exception:
        return False


def _exclusion_watch(st: State) -> None:
    """Daemon: a live process that a decision excluded is told so and exits."""
    failures = 0
    while not st.closed and failures < 3:  # the store is gone: the job is over
        if st.stop.wait(0.1):  # close(): at once, never into another store call
            break
        if st.recovering or st.me not in st.members:
            continue
        uuid = st.uuid + 1
        try:
            if not st.store.check([f"{uuid}/decision"]):
                failures = 0
                continue
            decision = json.loads(bytes(st.store.get(f"{uuid}/decision")))
        except Exception:
            failures += 1
            continue
        if "failed" in decision or st.me in decision.get("members", [st.me]):
            continue
        _exit_excluded(st, {"headline": decision.get("reason", "")})


def _exit_excluded(st: State, verdict: dict[str, Any]) -> None:
    _say(st, f"this rank was excluded from the job by the verdict: "
             f"{' '.join(str(verdict.get('headline', '')).split())}; "
             f"exiting with code {EXIT_EXCLUDED}")
    if st.options.exit_excluded:
        sys.stderr.flush()
        os._exit(EXIT_EXCLUDED)
    raise RecoveryRefused("this rank was excluded from the job", [verdict])


def _say(st: State, message: str) -> None:
    line = f"[frforensics.recovery rank {st.me}] {message}"
    log.info(line)
    with contextlib.suppress(Exception):
        print(line, file=sys.stderr, flush=True)


