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

The package, bottom up (each module imports only those below it; an import-linter
contract keeps it so): ``_state`` (options, state, errors, the source protocols),
``_store`` (bounded store calls, reconfigure), ``_agents`` (frforensics-run's exit
records), ``_verdicts`` (asking the source, the survivors' agreement), ``_policy``
(whom to exclude), ``_transfer`` (the state hand-over's protocol; ``_handover`` its
bytes), ``_reform`` (one recovery), ``_standby``; this module holds the
:class:`Recovery` and the module functions.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

# re-exported: frforensics-run's agent (run.py) and the tests use these names here
from frforensics.recovery import _mesh
from frforensics.recovery._agents import _agent_verdict as _agent_verdict
from frforensics.recovery._agents import exit_record as exit_record
from frforensics.recovery._handover import LoadStateDictFn, StateDictFn
from frforensics.recovery._policy import exclusion_from as exclusion_from
from frforensics.recovery._policy import propose, straggler_hook
from frforensics.recovery._reform import _planned_check, _tell_recorder, recover
from frforensics.recovery._standby import _exclusion_watch, _standby
from frforensics.recovery._state import ENV_JOB_WORLD as ENV_JOB_WORLD
from frforensics.recovery._state import ENV_RUN as ENV_RUN
from frforensics.recovery._state import ENV_STANDBY as ENV_STANDBY
from frforensics.recovery._state import (
    Guard,
    JobRecorder,
    Options,
    RecoveryError,
    RecoveryFailed,
    RecoveryRefused,
    RecoveryUnavailable,
    State,
    VerdictSource,
    _current_rank,
    _Sub,
    _torch,
    available,
)
from frforensics.recovery._state import _is_comm_failure as _is_comm_failure
from frforensics.recovery._store import _add, _get, _handle, _reconfigure, _set
from frforensics.recovery._store import job_store as job_store
from frforensics.recovery._verdicts import verdict_from_dump_dir
from frforensics.verdict import EXIT_EXCLUDED

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
T = TypeVar("T")


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
                       load_state_dict: LoadStateDictFn,
                       reset_step: Callable[[], None] | None = None) -> None:
        """The training state's callables, as :func:`setup`'s (when the model comes later).

        Every process registers them before the first guarded step (a standby
        before :meth:`standby`).
        """
        st = self._live()
        if not callable(state_dict) or not callable(load_state_dict):
            raise RecoveryError("register_state: state_dict and load_state_dict must be callables")
        st.state_dict, st.load_state_dict = state_dict, load_state_dict
        if reset_step is not None:
            st.reset_step = reset_step

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

    def device_mesh(self, device_type: str, mesh_shape: Sequence[int], *,
                    mesh_dim_names: Sequence[str] | None = None) -> Any:
        """``init_device_mesh`` whose groups the guard re-forms around a standby (HSDP).

        Every member calls it, as ``init_device_mesh``; each dimension's slices
        become registered subgroups. In an admitted standby (after
        :meth:`standby` or from its ``state_dict``/``load_state_dict``, which run
        during the hand-over) the same call returns the mesh the members made,
        over the groups the standby joined in the lost rank's place -- build the
        sharded model on it (docs/recovery.md, "Sharded models").
        """
        st = self._live()
        names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
        if st.me in st.members and not st.joined:
            return _mesh.make_mesh(st, device_type, tuple(mesh_shape), names)
        if st.me not in st.members:
            raise RecoveryError("a standby has no device mesh until a recovery admits it "
                                "(call device_mesh after standby(), or from state_dict())")
        return _mesh.find_mesh(st, device_type, tuple(mesh_shape), names)

    def propose_exclusion(self, ranks: Sequence[int], reason: str) -> bool:
        """Propose excluding ``ranks`` (member ids) at this Recovery's next planned check.

        Any process may call it (an ``on_verdict`` hook, an operator's tool): the
        proposal goes to the store (the first one per membership wins) and is
        carried out at a step boundary by :meth:`guard` when
        ``Options.plan_check_every`` is set, with the same rules and bounds as a
        failure's verdict. True when this proposal is the one stored.
        """
        return propose(self._live(), ranks, reason)

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


def setup(*, spares: int = 0, options: Options | None = None,
          source: VerdictSource | None = None,
          recorder: JobRecorder | None = None,
          state_dict: StateDictFn | None = None,
          load_state_dict: LoadStateDictFn | None = None,
          reset_step: Callable[[], None] | None = None) -> Recovery:
    """First configuration of the default group (collective over every process).

    ``state_dict`` / ``load_state_dict`` (torchft's ``Manager`` shape, both or
    neither): the training state -- a nested dict of tensors and plain values --
    that one survivor hands to each standby a recovery admits, over the re-formed
    group, before :meth:`Recovery.standby` returns; then every member checks that
    they hold the same state version (docs/recovery.md, "The state hand-over").
    A sharded state (DTensors: FSDP2, HSDP) travels shard by shard, each from a
    replica peer of the lost rank; its mesh must come from
    :meth:`Recovery.device_mesh`. ``reset_step``: called by the guard when a step
    failed, before the recovery, to put the model back between steps (FSDP2:
    the root module's ``reset_iter_state``, torch >= 2.15).

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
                   state_dict=state_dict, load_state_dict=load_state_dict,
                   reset_step=reset_step)
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
               state_dict=state_dict, load_state_dict=load_state_dict,
               reset_step=reset_step)
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
        if st.reset_step is not None:
            try:
                st.reset_step()
            except Exception as reset_exc:
                raise RecoveryFailed(f"reset_step() raised after the step failed: "
                                     f"{type(reset_exc).__name__}: {reset_exc}"[:500]) from exc
        recover(st, g, cause=exc)
        return
    st.version += 1
    _planned_check(st, g)


def run_step(fn: Callable[[], T]) -> tuple[T | None, Guard]:
    """``fn()`` under :func:`guard`; returns (its result or None after a recovery, guard)."""
    return _require().run_step(fn)


def standby(*, timeout_s: float | None = None) -> Guard:
    """Wait (in a spare process) until a recovery admits this process; returns its place.

    Raises :class:`RecoveryFailed` when ``timeout_s`` passes first.
    :meth:`Recovery.standby` of the Recovery :func:`setup` made.
    """
    return _require().standby(timeout_s=timeout_s)


def propose_exclusion(ranks: Sequence[int], reason: str) -> bool:
    """:meth:`Recovery.propose_exclusion` of the Recovery :func:`setup` made."""
    return propose(state(), ranks, reason)


def exclude_stragglers(windows: int = 3) -> Callable[[dict[str, Any]], None]:
    """An ``on_verdict`` hook: a rank the live straggler finding names with
    ``replace_gpu_or_host`` in ``windows`` consecutive reports is proposed for a
    planned exclusion (``recorder.enable(..., on_verdict=recovery.exclude_stragglers())``),
    by :func:`propose_exclusion`.
    """
    if windows < 1:
        raise ValueError("windows must be >= 1")
    return straggler_hook(windows, lambda ranks, why: propose_exclusion(ranks, why))
