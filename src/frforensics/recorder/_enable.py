"""The recorder's switch and its module state: ``enable``/``disable``, the running
:class:`Session`, the process hooks (``sys.excepthook``, ``atexit``) and the
verdict accessors. ``frforensics.recorder`` re-exports the public names (a facade
whose ``__all__`` tests/unit/test_facades.py pins).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

from frforensics.failures import is_peer_loss
from frforensics.model import DeathInfo, DumpReason
from frforensics.recorder._config import RECORDER_PATHS, RecorderConfig
from frforensics.recorder._core import Recorder, frames_of_traceback

if TYPE_CHECKING:
    from frforensics.recorder._dump import DumpWriter
    from frforensics.recorder._live import LiveStragglers
    from frforensics.recorder._verdict import VerdictAgent
    from frforensics.recorder._watchdog import Watchdog

@dataclass
class Session:
    """The recorder while enabled: its state, dump writer and watchdog.

    ``writer.post_dump_hooks`` / ``writer.note_providers`` are the extension
    points for code that acts on dumps (docs/recorder.md, "Layout").
    """

    rec: Recorder
    writer: DumpWriter
    watchdog: Watchdog | None = None
    verdict: VerdictAgent | None = None
    live: LiveStragglers | None = None


_lock = threading.Lock()
_session: Session | None = None
_hooks_installed = False
_prev_excepthook = sys.excepthook


def session() -> Session | None:
    """The running recorder (None when off)."""
    return _session


def note_reconfigure(group: Any, *, uuid: int, old_members: Sequence[int],
                     members: Sequence[int], reason: str = "") -> None:
    """Tell the recorder that ``group`` was re-formed over ``members`` (recorder/_reconfig.py).

    Called by ``frforensics.recovery`` after each ``_reconfigure``; never raises.
    """
    s = _session
    if s is None:
        return
    try:
        from frforensics.recorder._reconfig import Reconfigurations, reconfigured

        log = _state_reconfig.get("log")
        if log is None:
            log = _state_reconfig["log"] = Reconfigurations()
            s.writer.note_providers.append(log.notes)
        native: Any = None
        if s.rec.cxx is not None:
            from frforensics.recorder import _c10d

            native = _c10d.NATIVE_GROUPS
        reconfigured(s.rec, group, uuid=uuid, old_members=old_members, members=members,
                     reason=reason, log=log, native=native)
    except Exception as exc:
        s.rec.note_error("note_reconfigure", exc)


_state_reconfig: dict[str, Any] = {}


def is_enabled() -> bool:
    """True while the recorder is on in this process (False when a probe failed)."""
    s = _session
    return bool(s is not None and s.rec.active)


def enable(dump_dir: str | os.PathLike[str], config: RecorderConfig | None = None,
           **overrides: Any) -> Path:
    """Turn the recorder on for every process group created from now on.

    Call before ``init_process_group``. The settings are a
    :class:`~frforensics.recorder.RecorderConfig`: ``config`` (default: every
    field's default) with ``overrides``, keywords named as its fields
    (``enable(d, timeout_s=300)``; ``backends`` is ``wrap_backends``). A keyword
    that is no field is a ``TypeError`` naming it; a bad value the same
    ``ValueError`` (``SettingError``) as ``RecorderConfig.build`` gives.

    ``timeout_s`` is the watchdog deadline:
    an op unfinished that long makes this rank dump and raise the job-wide dump
    flag (keep it well below the backend's own timeout). ``poll_interval_s`` is
    the completion polling period (the resolution of completion times);
    ``store_poll_interval_s`` how often the flag and heartbeats go through the
    store. ``dump_on_exit``: ``"auto"`` (dump at exit only when ops are still
    unfinished or a peer raised the flag), ``"always"`` or ``"never"``.
    ``teardown_signals`` make the rank dump, then reach the previous handler or
    the default action. ``backends`` are the backend names routed through the
    recorder.

    At hang time one elected rank computes the verdict in a child process
    (``verdict``; docs/orchestrators.md): ``verdict_source`` ``"auto"`` (peers'
    dump files where visible, their store digests otherwise), ``"dir"`` (the
    dump directory is shared: no digests) or ``"store"``; the analysis gets
    ``verdict_timeout_s``. ``on_verdict(verdict_dict)`` and
    ``on_verdict_command`` (run with the verdict.json path appended) run once,
    on the elected rank, for at most ``hook_timeout_s``; failures are logged.
    ``abort_after_verdict``: every rank then exits with ``EXIT_VERDICT`` (75),
    or ``EXIT_NO_VERDICT`` (76) when none could be had.
    ``straggler_interval_s`` (off by default): exchange arrival times that often
    and report persistent stragglers while the job runs.

    Returns the dump directory. Raises ``ValueError`` for bad arguments only;
    anything going wrong later is logged once and never raised into the job. When
    the installed torch lacks a private API the recorder needs, one stderr line
    says so and groups are created by torch unrecorded (``is_enabled()`` False).
    """
    config = _config(dump_dir, config, overrides)
    start(config)
    return config.dump_dir


#: ``enable()``'s keywords that are not named as the field they set
_ALIASES: Final = {"backends": "wrap_backends"}
#: what ``enable()`` takes as overrides: every field but the dump directory
_FIELDS: Final = frozenset(f.name for f in dataclasses.fields(RecorderConfig)) - {"dump_dir"}


def _config(dump_dir: str | os.PathLike[str], config: RecorderConfig | None,
            overrides: dict[str, Any]) -> RecorderConfig:
    """``enable()``'s settings: ``config``'s fields (or the defaults) with
    ``overrides``, every value through ``RecorderConfig.build``'s checks."""
    if config is not None and not isinstance(config, RecorderConfig):
        raise TypeError(f"enable() config must be a RecorderConfig, not {type(config).__name__}")
    options: dict[str, Any] = {} if config is None else {
        name: getattr(config, name) for name in _FIELDS}
    for key, value in overrides.items():
        name = _ALIASES.get(key, key)
        if name not in _FIELDS:
            raise TypeError(f"enable() got an unexpected keyword argument {key!r}")
        options[name] = value
    path = os.environ.get("FRFORENSICS_RECORDER_PATH", "").strip().lower()
    if "recorder_path" not in options and path:
        # how ops are recorded is the deployment's choice, not the job's: the
        # variable switches it without touching the training script (a bad value
        # is said once and ignored: a variable must not make enable() raise)
        if path in RECORDER_PATHS:
            options["recorder_path"] = path
        else:
            print(f"frforensics: FRFORENSICS_RECORDER_PATH={path[:40]!r} ignored "
                  f"(expected one of {', '.join(RECORDER_PATHS)})", file=sys.stderr)
    if "on_verdict_command" in options:
        options["on_verdict_command"] = options["on_verdict_command"] or None
    return RecorderConfig.build(dump_dir, **options)


def start(config: RecorderConfig) -> Session | None:
    """Turn the recorder on with ``config`` (None when the installed torch fails a probe)."""
    global _session, _hooks_installed, _prev_excepthook
    from frforensics.recorder._dump import DumpWriter
    from frforensics.recorder._live import LiveStragglers

    try:
        from frforensics.recorder import _c10d
    except Exception as exc:  # no torch, or a torch too different to import against
        print(f"frforensics: recorder off: {type(exc).__name__}: {exc}", file=sys.stderr)
        disable()
        return None
    probes = _c10d.probe()
    if not probes.ok:
        _c10d.say(f"recorder off on torch {probes.torch_version}: {'; '.join(probes.problems)}"
                  " -- process groups are created by torch as usual, unrecorded")
        disable()
        return None
    with _lock:
        old = _session
        if old is not None and old.rec.active:
            _stop(old)
        rec = Recorder(config)
        if config.recorder_path != "python":
            rec.cxx = _c10d.native_ring(rec, build_now=config.recorder_path == "cxx")
        writer = DumpWriter(rec)
        writer.native_source = _c10d.native_dumps
        sess = Session(rec, writer)
        from frforensics.recorder._verdict import VerdictAgent

        agent = VerdictAgent(rec, writer, listeners=_listeners)
        writer.post_dump_hooks.append(agent.on_dump_written)
        sess.verdict = agent
        agent.start()
        if config.straggler_interval_s:
            from frforensics.recorder._live import LiveStragglers

            sess.live = LiveStragglers(rec, agent, config.straggler_interval_s)
            sess.live.start()
        rec.group_listeners.append(lambda _state: _start_watchdog(sess))
        for missing in probes.degraded:
            rec.unrecorded.append(f"{missing} missing in this torch: batched p2p ops run "
                                  "one by one under the recorder")
        _c10d.install(rec)
        _session = sess
        if not _hooks_installed:
            _hooks_installed = True
            _prev_excepthook = sys.excepthook
            sys.excepthook = _excepthook
            atexit.register(_at_exit)
    if _c10d.dist_initialized():
        rec.note_error("enable", RuntimeError(
            "enable() called after init_process_group: existing groups are not recorded"))
    return sess


def _start_watchdog(sess: Session) -> None:
    from frforensics.recorder import _c10d
    from frforensics.recorder._watchdog import Watchdog

    if sess.watchdog is not None:
        return
    rec = sess.rec
    dog = Watchdog(rec, sess.writer)
    dog.is_torn_down = _c10d.torn_down
    sess.watchdog = dog
    sess.writer.settle = dog.settle_for_dump
    rec.store_listeners.append(dog.wake)
    dog.install_signals(rec.config.dump_signals, rec.config.teardown_signals)
    dog.start()


def disable() -> None:
    """Stop recording and the watchdog. Groups keep working (they forward only)."""
    global _session
    with _lock:
        sess, _session = _session, None
        if sess is not None:
            _stop(sess)


def _stop(sess: Session) -> None:
    sess.rec.active = False
    if sess.rec.cxx is not None:
        sess.rec.cxx.set_active(False)
    if sess.verdict is not None:
        sess.verdict.stop()
    if sess.live is not None:
        sess.live.stop()
    with contextlib.suppress(Exception):
        from frforensics.recorder import _c10d

        _c10d.uninstall()
    dog = sess.watchdog
    if dog is not None:
        dog.uninstall_signals()
        dog.shutdown(join_timeout_s=2.0)
    sess.rec.pending.clear()
    if sess.rec.cxx is not None:
        with contextlib.suppress(Exception):
            sess.rec.cxx.drop_works()


def dump(reason: str = "api", detail: str = "") -> Path | None:
    """Write this rank's dump now (``reason``: a ``DumpReason`` value, default ``api``).

    Returns the path written, or ``None`` when the recorder is off or the dump
    failed (logged). Never raises.
    """
    sess = _session
    if sess is None:
        return None
    try:
        why = DumpReason(reason)
    except ValueError:
        why, detail = DumpReason.API, detail or reason
    return sess.writer.dump(why, detail)


_listeners: list[Callable[[dict[str, Any]], None]] = []


def last_verdict() -> dict[str, Any] | None:
    """The newest verdict this rank learned (a ``frforensics.verdict/1`` dict), or None."""
    sess = _session
    return None if sess is None or sess.verdict is None else sess.verdict.last


def wait_verdict(timeout_s: float, incident: int | None = None) -> dict[str, Any] | None:
    """Block up to ``timeout_s`` until this rank knows the verdict of ``incident``
    (default: the current one); the verdict dict, or None. Never raises."""
    sess = _session
    if sess is None or sess.verdict is None:
        return None
    try:
        return sess.verdict.wait(timeout_s, incident)
    except Exception:
        return None


def add_verdict_listener(fn: Callable[[dict[str, Any]], None]) -> None:
    """Call ``fn(verdict)`` on this rank whenever it learns a verdict (every live
    rank, the elected one included), bounded by ``hook_timeout_s``, failures logged.
    Listeners stay across ``enable()`` calls."""
    if fn not in _listeners:
        _listeners.append(fn)


def request_verdict(detail: str = "") -> bool:
    """Raise the job-wide dump flag from this rank now: every live rank dumps and
    one verdict follows (for a failed op where no watchdog deadline fired).

    Returns False when the flag was already up, or there is no recorder or store.
    """
    sess = _session
    if sess is None or sess.verdict is None:
        return False
    return sess.verdict.request(detail)


def rearm(*, rank: int | None = None, world_size: int | None = None) -> int:
    """After recovering from an incident, open the next one and return its number.

    The flag key becomes ``dump_flag/<k>`` and the watchdog fires again on the
    next overdue op; pass the new ``rank``/``world_size`` when they changed.
    Call it once the hung ops have ended (aborted or failed): an op still
    unfinished past the deadline fires the new incident at once. Returns -1
    when the recorder is off.
    """
    sess = _session
    if sess is None or sess.verdict is None:
        return -1
    return sess.verdict.rearm(sess.watchdog, rank, world_size)


def _excepthook(exc_type: type[BaseException], exc: BaseException,
                tb: TracebackType | None) -> None:
    try:
        sess = _session
        rec = sess.rec if sess is not None else None
        if (sess is not None and rec is not None and rec.active
                and rec.config.dump_on_exception and rec.groups):
            message = f"{exc_type.__name__}: {exc}"
            death = DeathInfo(kind="exception", message=message[:2000],
                              frames=frames_of_traceback(tb))
            # Known from now on: a peer-signal or watchdog dump written meanwhile
            # (during the wait below, or while the process lingers) carries it.
            if rec.death is None or rec.death.kind != "exception":
                rec.death = death
            if _is_peer_loss(message) and rec.store is not None:
                # A peer died and took the connection with it: give its heartbeat
                # time to go stale so this dump names who went silent first.
                limit = rec.config.stale_limit_s
                step = max(0.05, rec.config.store_poll_interval_s)
                until = time.monotonic() + min(limit + step, 10.0)
                while time.monotonic() < until:
                    time.sleep(min(step, max(0.0, until - time.monotonic())))
                    # Read the heartbeats as we go: the store's host may die of the
                    # same lost peer and exit before this dump (then the last
                    # reading stands in).
                    rec.stale_peers()
            sess.writer.dump(DumpReason.EXCEPTION, message[:500], death=death, automatic=True)
            if sess.verdict is not None:
                # A lost peer: every survivor is dying and no watchdog will fire;
                # raise the flag and stay (bounded) for the verdict.
                sess.verdict.after_exception(message, _is_peer_loss(message))
    except Exception:
        pass
    _prev_excepthook(exc_type, exc, tb)


def _is_peer_loss(message: str) -> bool:
    # the one classifier (frforensics.failures): gloo/NCCL's "peer lost" messages
    return is_peer_loss(message)


def _at_exit() -> None:
    try:
        sess = _session
        if sess is None:
            return
        rec, dog = sess.rec, sess.watchdog
        if rec.active and rec.groups:
            if dog is not None:
                dog.check_flag_at_exit()  # a rank tearing down still answers the flag
            mode = rec.config.dump_on_exit
            unfinished = dog.unfinished() if dog is not None else False
            if mode == "always" or (mode == "auto" and unfinished):
                death = DeathInfo(kind="exit", message="process exited with ops unfinished"
                                  if unfinished else "process exited")
                sess.writer.dump(DumpReason.EXIT, death.message, death=death, automatic=True)
    except Exception:
        pass
    _join_threads_at_exit(sess)


def _join_threads_at_exit(sess: Session | None) -> None:
    """Stop and join every thread of the session that may be inside a store call.

    Whether or not anything was recorded (a standby that never joined a group has
    a watchdog polling the store too): a daemon thread still in a pybind11 call
    when the interpreter finalizes is ended by ``pthread_exit`` from ``take_gil``,
    which unwinds through pybind11's noexcept ``~gil_scoped_release`` --
    ``std::terminate``, SIGABRT, exit code -6 for a process that finished.
    """
    if sess is None:
        return
    with contextlib.suppress(Exception):
        if sess.live is not None:
            sess.live.stop()
            sess.live.join(timeout=_EXIT_JOIN_S)
    with contextlib.suppress(Exception):
        if sess.verdict is not None:
            sess.verdict.stop()
            sess.verdict.join(timeout=_EXIT_JOIN_S)
    with contextlib.suppress(Exception):
        if sess.watchdog is not None:
            sess.watchdog.shutdown(join_timeout_s=_EXIT_JOIN_S)
    _join_named_threads(_EXIT_JOIN_S)


#: How long the exit hook waits for each of the session's threads (a loaded host
#: can hold a thread in a store call past 2 s: CI saw a survivor abort at exit)
_EXIT_JOIN_S = 5.0


def _join_named_threads(budget_s: float) -> None:
    """Join, within ``budget_s`` in all, every other live ``frforensics-*`` thread
    (a hook's bounded runner, recovery's reconfigure waiter): the same SIGABRT waits
    for any of them still inside a pybind11 call at finalization. The recorder's
    exit hook runs after recovery's (atexit is last in, first out), so it sees what
    recovery's left."""
    with contextlib.suppress(Exception):
        until = time.monotonic() + budget_s
        me = threading.current_thread()
        for t in threading.enumerate():
            if t is me or not t.name.startswith("frforensics") or not t.is_alive():
                continue
            t.join(timeout=max(0.0, until - time.monotonic()))


def _autoenable() -> None:
    """Turn the recorder on from ``FRFORENSICS_*`` environment variables."""
    start(RecorderConfig.from_env())

