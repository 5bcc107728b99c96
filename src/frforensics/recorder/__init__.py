"""The recorder: records every collective and p2p op of every process group.

One line before ``init_process_group``::

    import frforensics.recorder
    frforensics.recorder.enable("/shared/dumps", timeout_s=300)

or, with no code change (``torchrun``, ``mp.spawn``, pytest children)::

    FRFORENSICS_ENABLE=1 FRFORENSICS_DUMP_DIR=/shared/dumps torchrun ...

Each rank writes ``<dump_dir>/frdump_rank_<rank>`` when an op of any group stays
unfinished past ``timeout_s`` (and every other rank follows within a store poll
period), on ``SIGUSR1``, on :func:`dump`, and when the process dies of an
uncaught exception. See docs/recorder.md for every option and what a dump holds.
This package needs torch; the analyzer never imports it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

from frforensics.model import DeathInfo, DumpReason

__all__ = [
    "EXIT_NO_VERDICT",
    "EXIT_VERDICT",
    "add_verdict_listener",
    "disable",
    "dump",
    "enable",
    "is_enabled",
    "last_verdict",
    "request_verdict",
    "wait_verdict",
]

#: Exit code of every rank after the verdict with ``abort_after_verdict``
#: (``FRFORENSICS_ABORT_AFTER_VERDICT=1``); ``EXIT_NO_VERDICT`` when none could be had.
EXIT_VERDICT = 75
EXIT_NO_VERDICT = 76

_lock = threading.Lock()
_state: dict[str, Any] = {}


def _recorder() -> Any:
    return _state.get("recorder")


def is_enabled() -> bool:
    """True while the recorder is on in this process."""
    rec = _recorder()
    return bool(rec is not None and rec.active)


def enable(
    dump_dir: str | os.PathLike[str],
    *,
    timeout_s: float = 600.0,
    buffer_size: int = 2000,
    poll_interval_s: float = 0.01,
    store_poll_interval_s: float = 1.0,
    stack_depth: int = 8,
    dump_signals: Iterable[int] = (signal.SIGUSR1,),
    dump_on_exception: bool = True,
    dump_on_exit: str = "auto",
    save_native: bool = True,
    backends: Iterable[str] = ("gloo", "nccl"),
    cuda_events: bool = True,
    heartbeat_stale_s: float | None = None,
    verdict: bool = True,
    verdict_source: str = "auto",
    verdict_timeout_s: float = 60.0,
    on_verdict: Callable[[dict[str, Any]], None] | None = None,
    on_verdict_command: str | None = None,
    hook_timeout_s: float = 30.0,
    abort_after_verdict: bool = False,
) -> Path:
    """Turn the recorder on for every process group created from now on.

    Call before ``init_process_group``. ``timeout_s`` is the watchdog deadline:
    an op unfinished that long makes this rank dump and raise the job-wide dump
    flag (keep it well below the backend's own timeout). ``poll_interval_s`` is
    the completion polling period (the resolution of completion times);
    ``store_poll_interval_s`` how often the flag and heartbeats go through the
    store. ``dump_on_exit``: ``"auto"`` (dump at exit only when ops are still
    unfinished or a peer raised the flag), ``"always"`` or ``"never"``.
    ``backends`` are the backend names routed through the recorder.

    At hang time one elected rank computes the verdict in a child process
    (``verdict``; docs/orchestrators.md): ``verdict_source`` ``"auto"`` (peers'
    dump files where visible, their store digests otherwise), ``"dir"`` (the
    dump directory is shared: no digests) or ``"store"``; the analysis is given
    ``verdict_timeout_s``. ``on_verdict(verdict_dict)`` and
    ``on_verdict_command`` (run with the verdict.json path appended) run once,
    on the elected rank, for at most ``hook_timeout_s``; failures are logged.
    ``abort_after_verdict``: every rank then exits with ``EXIT_VERDICT`` (75),
    or ``EXIT_NO_VERDICT`` (76) when none could be had.

    Returns the dump directory. Raises ``ValueError`` for bad arguments only;
    anything going wrong later is logged once and never raised into the job.
    """
    from frforensics.recorder._core import Recorder, RecorderConfig

    if timeout_s <= 0 or buffer_size < 1 or poll_interval_s <= 0 or store_poll_interval_s <= 0:
        raise ValueError("timeout_s, buffer_size and the poll intervals must be positive")
    if dump_on_exit not in ("auto", "always", "never"):
        raise ValueError("dump_on_exit must be 'auto', 'always' or 'never'")
    if verdict_source not in ("auto", "dir", "store"):
        raise ValueError("verdict_source must be 'auto', 'dir' or 'store'")
    if verdict_timeout_s <= 0 or hook_timeout_s <= 0:
        raise ValueError("verdict_timeout_s and hook_timeout_s must be positive")
    path = Path(dump_dir).expanduser().resolve()
    config = RecorderConfig(
        dump_dir=path,
        timeout_s=float(timeout_s),
        buffer_size=int(buffer_size),
        poll_interval_s=float(poll_interval_s),
        store_poll_interval_s=float(store_poll_interval_s),
        stack_depth=int(stack_depth),
        heartbeat_stale_s=heartbeat_stale_s,
        dump_signals=tuple(int(s) for s in dump_signals),
        dump_on_exception=dump_on_exception,
        dump_on_exit=dump_on_exit,
        save_native=save_native,
        wrap_backends=tuple(b.lower() for b in backends),
        cuda_events=cuda_events,
    )
    with _lock:
        old = _state.get("recorder")
        if old is not None and old.active:
            _stop(old)
        rec = Recorder(config)
        from frforensics.recorder import _pg

        _pg.install(rec)
        rec.on_first_group = _start_watchdog
        from frforensics.recorder._verdict import VerdictAgent, VerdictConfig

        agent = VerdictAgent(rec, VerdictConfig(
            enabled=verdict, source=verdict_source, verdict_timeout_s=float(verdict_timeout_s),
            hook_timeout_s=float(hook_timeout_s), on_verdict=on_verdict,
            on_verdict_command=on_verdict_command or None,
            abort_after_verdict=abort_after_verdict,
            listeners=list(_state.get("listeners", ())),
        ))
        rec.on_dumped = agent.on_dumped
        rec.verdict_agent = agent
        agent.start()
        _state["recorder"] = rec
        if not _state.get("hooks"):
            _state["hooks"] = True
            _state["prev_excepthook"] = sys.excepthook
            sys.excepthook = _excepthook
            atexit.register(_at_exit)
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rec.note_error("enable", RuntimeError(
                "enable() called after init_process_group: existing groups are not recorded"))
    return path


def _start_watchdog(rec: Any) -> None:
    from frforensics.recorder._watchdog import Watchdog

    if rec.watchdog is not None:
        return
    dog = Watchdog(rec)
    rec.watchdog = dog
    dog.install_signals(rec.config.dump_signals)
    dog.start()


def disable() -> None:
    """Stop recording and the watchdog. Groups keep working (they forward only)."""
    with _lock:
        rec = _state.pop("recorder", None)
        if rec is not None:
            _stop(rec)


def _stop(rec: Any) -> None:
    rec.active = False
    agent = getattr(rec, "verdict_agent", None)
    if agent is not None:
        agent.events.put(("stop", None))
    from frforensics.recorder import _pg

    _pg.uninstall()
    if rec.watchdog is not None:
        rec.watchdog.uninstall_signals()
    _release(rec)


def _release(rec: Any) -> None:
    """Stop the watchdog and drop every backend Work it holds.

    Works must not outlive the interpreter's orderly shutdown: a daemon thread
    frozen at exit while holding gloo works ends the process with SIGABRT.
    """
    dog = rec.watchdog
    if dog is not None:
        dog.stop()
        if dog is not threading.current_thread():
            dog.join(timeout=2.0)
        dog.drop_works()
    rec.pending.clear()


def dump(reason: str = "api", detail: str = "") -> Path | None:
    """Write this rank's dump now (``reason``: a ``DumpReason`` value, default ``api``).

    Returns the path written, or ``None`` when the recorder is off or the dump
    failed (logged). Never raises.
    """
    rec = _recorder()
    if rec is None:
        return None
    try:
        why = DumpReason(reason)
    except ValueError:
        why, detail = DumpReason.API, detail or reason
    result: Path | None = rec.dump(why, detail)
    return result


def _agent() -> Any:
    rec = _recorder()
    return None if rec is None else getattr(rec, "verdict_agent", None)


def last_verdict() -> dict[str, Any] | None:
    """The newest verdict this rank learned (``frforensics.verdict/1`` dict), or None."""
    agent = _agent()
    return None if agent is None else agent.last


def wait_verdict(timeout_s: float, incident: int | None = None) -> dict[str, Any] | None:
    """Block up to ``timeout_s`` until this rank knows the verdict of ``incident``
    (default: the current one); the verdict dict, or None. Never raises."""
    agent = _agent()
    if agent is None:
        return None
    try:
        result: dict[str, Any] | None = agent.wait(timeout_s, incident)
        return result
    except Exception:
        return None


def add_verdict_listener(fn: Callable[[dict[str, Any]], None]) -> None:
    """Call ``fn(verdict)`` on this rank whenever it learns a verdict (every live
    rank, the elected one included), bounded by ``hook_timeout_s``, failures logged."""
    listeners = _state.setdefault("listeners", [])
    listeners.append(fn)
    agent = _agent()
    if agent is not None and fn not in agent.config.listeners:
        agent.config.listeners.append(fn)


def request_verdict(detail: str = "") -> bool:
    """Raise the job-wide dump flag from this rank now: every live rank dumps and
    one verdict follows (for a failed op where no watchdog deadline fired).

    Returns False when the flag was already up, or there is no recorder or store.
    """
    rec = _recorder()
    agent = _agent()
    if rec is None or agent is None or rec.store is None or rec.flag_raised:
        return False
    try:
        import time

        agent.requested = True
        path = rec.dump(DumpReason.API, f"verdict requested: {detail}"[:500], native=False)
        if path is None:
            return False
        won: bool = rec.raise_flag({"rank": rec.current_rank(), "pg": "", "desc": "",
                                    "op": "", "seq": -1, "seq_kind": "", "age_s": 0.0,
                                    "time_ns": time.time_ns(),
                                    "detail": f"verdict requested: {detail}"[:500]})
        return won
    except Exception as exc:
        rec.note_error("request_verdict", exc)
        return False


def _excepthook(exc_type: type[BaseException], exc: BaseException,
                tb: TracebackType | None) -> None:
    try:
        rec = _recorder()
        if rec is not None and rec.active and rec.config.dump_on_exception and rec.groups:
            from frforensics.recorder._core import frames_of_traceback

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
                import time

                limit = rec.config.heartbeat_stale_s or max(
                    3.0 * rec.config.store_poll_interval_s, 2.0)
                step = max(0.05, rec.config.store_poll_interval_s)
                until = time.monotonic() + min(limit + step, 10.0)
                while time.monotonic() < until:
                    time.sleep(min(step, max(0.0, until - time.monotonic())))
                    # Read the heartbeats as we go: the store's host may die of the
                    # same lost peer and exit before this dump (then the last
                    # reading stands in).
                    rec.stale_peers()
            rec.dump(DumpReason.EXCEPTION, message[:500], death=death, automatic=True)
            agent = getattr(rec, "verdict_agent", None)
            if agent is not None:
                # A lost peer: every survivor is dying, no watchdog will fire; raise
                # the flag and stay (bounded) for the verdict.
                agent.after_exception(message, _is_peer_loss(message))
    except Exception:
        pass
    previous = _state.get("prev_excepthook") or sys.__excepthook__
    previous(exc_type, exc, tb)


_PEER_LOSS = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "socket closed", "ncclremoteerror", "remote process exited")


def _is_peer_loss(message: str) -> bool:
    low = message.lower()
    return any(marker in low for marker in _PEER_LOSS)


def _at_exit() -> None:
    try:
        rec = _recorder()
        if rec is None or not rec.active or not rec.groups:
            return
        dog = rec.watchdog
        if dog is not None:
            # A rank tearing down still answers the flag (PyTorch's does not).
            with contextlib.suppress(Exception):
                dog.poll_works()
                if (not dog.answered and not rec.flag_raised and dog._store_usable()
                        and not dog.torn_down()):
                    payload = rec.poll_flag()
                    if payload is not None:
                        dog.answer_flag(payload)
        mode = rec.config.dump_on_exit
        unfinished = dog.unfinished() if dog is not None else False
        if mode == "always" or (mode == "auto" and unfinished):
            death = DeathInfo(kind="exit", message="process exited with ops unfinished"
                              if unfinished else "process exited")
            rec.dump(DumpReason.EXIT, death.message, death=death, automatic=True)
        if dog is not None:
            dog.stop()
            # A daemon thread frozen at shutdown while the interpreter still holds
            # backend works ends the process with "terminate called without an
            # active exception" (SIGABRT): let go of them now.
            if dog is not threading.current_thread():
                dog.join(timeout=1.0)
            dog.drop_works()
    except Exception:
        pass


def _autoenable() -> None:
    """Turn the recorder on from ``FRFORENSICS_*`` environment variables."""
    env = os.environ

    def num(key: str, default: float) -> float:
        raw = env.get(key)
        return float(raw) if raw else default

    signals_raw = env.get("FRFORENSICS_SIGNALS", "USR1").strip()
    signals: list[int] = []
    if signals_raw.lower() not in ("", "none", "0"):
        for name in signals_raw.split(","):
            name = name.strip().upper()
            if name:
                signals.append(int(getattr(signal, name if name.startswith("SIG") else "SIG" + name)))
    enable(
        env.get("FRFORENSICS_DUMP_DIR") or "frforensics_dumps",
        timeout_s=num("FRFORENSICS_TIMEOUT_S", 600.0),
        buffer_size=int(num("FRFORENSICS_BUFFER_SIZE", 2000)),
        poll_interval_s=num("FRFORENSICS_POLL_INTERVAL_S", 0.01),
        store_poll_interval_s=num("FRFORENSICS_STORE_POLL_INTERVAL_S", 1.0),
        stack_depth=int(num("FRFORENSICS_STACK_DEPTH", 8)),
        dump_signals=signals,
        dump_on_exit=env.get("FRFORENSICS_DUMP_ON_EXIT", "auto"),
        save_native=env.get("FRFORENSICS_SAVE_NATIVE", "1") not in ("0", "false", "no"),
        backends=[b for b in env.get("FRFORENSICS_BACKENDS", "gloo,nccl").split(",") if b],
        verdict=env.get("FRFORENSICS_VERDICT", "1").lower() not in ("0", "false", "no"),
        verdict_source=env.get("FRFORENSICS_VERDICT_SOURCE", "auto"),
        verdict_timeout_s=num("FRFORENSICS_VERDICT_TIMEOUT_S", 60.0),
        on_verdict_command=env.get("FRFORENSICS_ON_VERDICT") or None,
        hook_timeout_s=num("FRFORENSICS_HOOK_TIMEOUT_S", 30.0),
        abort_after_verdict=env.get("FRFORENSICS_ABORT_AFTER_VERDICT", "0").lower()
        not in ("0", "false", "no", ""),
    )
