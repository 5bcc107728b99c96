"""The watchdog thread: completion stamps, deadlines, the store flag, heartbeats, signals.

It runs while the main thread is blocked inside a backend (``work.wait()``
releases the GIL), so it can see an op go overdue, dump, and tell the other
ranks through the c10d store. Signals reach it at C level through
``signal.set_wakeup_fd``: the interpreter writes the signal number into our
pipe the moment the signal arrives, even though the Python-level handler will
not run until the main thread leaves the blocking call.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from frforensics.model import DumpReason
from frforensics.recorder import _ring as R
from frforensics.recorder._core import Entry, Recorder, Tracked, WorkLike
from frforensics.recorder._dump import DumpWriter

_STORE_RETRY_S = 10.0


def work_failed(work: WorkLike) -> bool:
    """True when a finished ``work`` ended with an error.

    ``Work.exception()``/``is_success()`` are deprecated; a work's future raises
    the op's error from ``value()``. Works without a future (gloo p2p and
    reduce_scatter) are stamped by ``RecordedWork.wait()`` instead.
    """
    try:
        fut = work.get_future()
    except Exception:
        return False
    try:
        if not fut.done():
            return False
        fut.value()
    except Exception:
        return True
    return False


def _settle(item: Tracked, now: int) -> bool:
    """Poll one op: start event, completion, failure. True once it is finished."""
    entry, work = item
    event = entry[R.START_EVENT]
    if event is not None and entry[R.STATE] == R.SCHEDULED:
        with contextlib.suppress(Exception):
            if event.query():
                entry[R.T_START] = now
                entry[R.STATE] = R.STARTED
                entry[R.START_EVENT] = None
    try:
        done = bool(work.is_completed())
        failed = done and work_failed(work)
    except Exception:
        done, failed = True, True
    if not done:
        return False
    if entry[R.STATE] < R.COMPLETED:
        entry[R.T_COMPLETE] = now
        entry[R.STATE] = R.FAILED if failed else R.COMPLETED
    return True


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)


def _die_of(signum: int) -> None:
    """End the process with ``signum``'s default action, from any thread.

    ``signal.signal`` may only be called from the main thread, which may be
    blocked in a collective; libc's ``signal()`` may be called from any thread
    (the disposition is process-wide), after which the signal is re-sent.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal(signum, None)  # SIG_DFL is the null handler
        os.kill(os.getpid(), signum)
    except Exception:
        os._exit(128 + signum)


class Watchdog(threading.Thread):
    """One per process; a daemon thread that never raises."""

    def __init__(self, rec: Recorder, writer: DumpWriter) -> None:
        super().__init__(name="frforensics-watchdog", daemon=True)
        self.rec = rec
        self.writer = writer
        # Set by the installation layer (_c10d): True once the job destroyed its
        # default group.
        self.is_torn_down: Callable[[], bool] = lambda: False
        self.stop_event = threading.Event()
        self.rfd, self.wfd = os.pipe()
        os.set_blocking(self.rfd, False)
        os.set_blocking(self.wfd, False)
        self.tracked: list[Tracked] = []
        self.poll_lock = threading.RLock()
        self.fired = False
        self.answered = False
        self.store_failures = 0
        self.store_retry_at = 0.0
        self.signals: set[int] = set()
        self.previous_handlers: dict[int, Any] = {}
        self.fork_hook_registered = False
        self.teardown_lock = threading.Lock()
        self.teardown_seen: set[int] = set()
        self.wakeup_installed = False
        self.previous_wakeup_fd = -1

    # ------------------------------------------------------------ control

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.wfd, b"\0")

    def stop(self) -> None:
        self.stop_event.set()
        self.wake()

    def install_signals(self, signals: tuple[int, ...],
                        teardown: tuple[int, ...] = ()) -> None:
        """From the main thread: route ``signals`` and ``teardown`` to the watchdog at C level.

        ``signals`` only dump (a Python handler is installed where there was none,
        so ``SIGUSR1`` no longer kills). ``teardown`` signals dump and then go on
        to the handler that was there before, or to the default action: the
        process ends as it would have (:meth:`_teardown`).
        """
        if threading.current_thread() is not threading.main_thread():
            return
        if not signals and not teardown:
            return
        if not self.fork_hook_registered:
            # A forked child (DataLoader workers, ...) inherits the handlers and
            # the wakeup fd, whose pipe the parent's watchdog reads: a SIGTERM to
            # the child would reach the parent's watchdog as the parent's own.
            os.register_at_fork(after_in_child=self._after_fork_in_child)
            self.fork_hook_registered = True
        for sig in signals:
            try:
                if signal.getsignal(sig) in (signal.SIG_DFL, None):
                    signal.signal(sig, self._python_handler)
                self.signals.add(int(sig))
            except (OSError, ValueError, RuntimeError) as exc:
                self.rec.note_error(f"signal {sig}", exc)
        for sig in teardown:
            if sig in self.signals:
                continue
            try:
                previous = signal.getsignal(sig)
                if previous is None or previous is signal.SIG_IGN:
                    continue  # set outside Python, or ignored: leave it alone
                signal.signal(sig, self._teardown_handler)
                self.previous_handlers[int(sig)] = previous
            except (OSError, ValueError, RuntimeError) as exc:
                self.rec.note_error(f"signal {sig}", exc)
        try:
            previous_fd = signal.set_wakeup_fd(self.wfd, warn_on_full_buffer=False)
        except (ValueError, OSError) as exc:
            self.rec.note_error("set_wakeup_fd", exc)
            return
        if previous_fd not in (-1, self.wfd):
            # Someone (asyncio, ...) owns the wakeup fd: give it back; our Python
            # handlers still dump, but only once the main thread runs Python again.
            with contextlib.suppress(Exception):
                signal.set_wakeup_fd(previous_fd)
            self.rec.note_error("set_wakeup_fd", RuntimeError("wakeup fd already in use"))
            return
        self.wakeup_installed = True

    def _after_fork_in_child(self) -> None:
        """In a forked child: the process it was before the recorder, for signals."""
        with contextlib.suppress(Exception):
            if self.wakeup_installed:
                signal.set_wakeup_fd(-1)
            for sig, previous in self.previous_handlers.items():
                if signal.getsignal(sig) == self._teardown_handler:
                    signal.signal(sig, previous)
            for sig in self.signals:
                if signal.getsignal(sig) == self._python_handler:
                    signal.signal(sig, signal.SIG_DFL)

    def uninstall_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in list(self.previous_handlers.items()):
            with contextlib.suppress(Exception):
                if signal.getsignal(sig) == self._teardown_handler:
                    signal.signal(sig, previous)
            self.previous_handlers.pop(sig, None)
        if self.wakeup_installed:
            with contextlib.suppress(Exception):
                signal.set_wakeup_fd(-1)
                self.wakeup_installed = False

    def _python_handler(self, signum: int, frame: Any) -> None:
        # Runs in the main thread, late. The watchdog already dumped from the
        # wakeup fd when it could; dump here only when it could not.
        if not self.wakeup_installed or not self.is_alive():
            self.writer.dump(DumpReason.SIGNAL, f"signal {signum}")

    def _teardown_handler(self, signum: int, frame: Any) -> None:
        """Main thread: dump (unless the watchdog did), then the previous handler."""
        self._teardown_dump(signum)
        previous = self.previous_handlers.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
            return
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    def _teardown(self, signum: int) -> None:
        """Watchdog thread, the moment the signal arrives (the main thread may be
        blocked in a collective and run no Python handler until it returns).

        Dumps; when the previous disposition was the default action, the process
        dies of the same signal now, as it would have without the recorder. A
        Python handler that was there before runs on the main thread, as before.
        """
        self._teardown_dump(signum)
        if self.previous_handlers.get(signum, signal.SIG_DFL) is signal.SIG_DFL:
            _die_of(signum)

    def _teardown_dump(self, signum: int) -> None:
        # Both the watchdog (wakeup fd) and the main thread's handler see the
        # signal: the first dumps, the second waits for that dump before going on
        # to the previous handler (bounded, should the main thread itself be
        # inside a dump the watchdog waits on).
        if not self.teardown_lock.acquire(timeout=5.0):
            return
        try:
            if signum in self.teardown_seen:
                return
            self.teardown_seen.add(signum)
            if self.rec.hang_dump_written:
                return  # the hang's dump is the evidence; the teardown adds nothing to it
            self.writer.dump(DumpReason.SIGNAL, f"received {_signal_name(signum)} (teardown)")
        finally:
            self.teardown_lock.release()

    # ------------------------------------------------------------ loop

    def run(self) -> None:
        rec = self.rec
        poll = max(0.001, rec.config.poll_interval_s)
        store_every = max(poll, rec.config.store_poll_interval_s)
        next_store = 0.0
        while not self.stop_event.is_set():
            try:
                readable, _, _ = select.select([self.rfd], [], [], poll)
                if readable:
                    self._drain_pipe()
                self.poll_works()
                now = time.monotonic()
                if now >= next_store:
                    next_store = now + store_every
                    self.poll_store()
            except Exception as exc:  # the thread must survive anything
                rec.note_error("watchdog", exc)
                time.sleep(poll)

    def _drain_pipe(self) -> None:
        try:
            data = os.read(self.rfd, 512)
        except (BlockingIOError, OSError):
            return
        for byte in data:
            if byte and byte in self.previous_handlers:
                self._teardown(byte)
            elif byte and byte in self.signals:
                self.writer.dump(DumpReason.SIGNAL, f"received {_signal_name(byte)}")

    def poll_works(self) -> None:
        """Stamp completions and start events; fire on the oldest overdue op.

        Looks at each group's newest op and at the ops that were still running
        when their group's next op was issued (``rec.pending``): the hot path
        stamps and drops the rest, so one poll costs O(groups + running ops),
        not O(ops issued since the last poll).
        """
        with self.poll_lock:
            overdue = self._poll_locked()
        if overdue is not None and not self.fired:
            self.fired = True
            self.on_overdue(overdue, time.monotonic_ns())

    def _poll_locked(self) -> Entry | None:
        rec = self.rec
        pending = rec.pending
        tracked = self.tracked
        while pending:
            item = pending.popleft()
            if item[0][R.STATE] == R.COMPLETED:
                # Stamped on the next-op path, which does not read results.
                if work_failed(item[1]):
                    item[0][R.STATE] = R.FAILED
                continue
            tracked.append(item)
        now = time.monotonic_ns()
        deadline_ns = int(rec.config.timeout_s * 1e9)
        oldest: Entry | None = None
        if tracked:
            still: list[Tracked] = []
            for item in tracked:
                if item[0][R.STATE] >= R.COMPLETED or _settle(item, now):
                    continue
                still.append(item)
                if oldest is None or item[0][R.T_ENQUEUE] < oldest[R.T_ENQUEUE]:
                    oldest = item[0]
            self.tracked = still
        for st in list(rec.groups):
            last = st.last
            if last is None or last[0][R.STATE] >= R.COMPLETED or _settle(last, now):
                continue
            if oldest is None or last[0][R.T_ENQUEUE] < oldest[R.T_ENQUEUE]:
                oldest = last[0]
        cxx = rec.cxx
        if cxx is not None:  # the native ring settles its own ops, without the GIL
            rid, t_enqueue = cxx.poll()
            if rid >= 0 and (oldest is None or t_enqueue < oldest[R.T_ENQUEUE]) and (
                    now - t_enqueue > deadline_ns):
                found, _ = cxx.snapshot(rid)
                if found:
                    entry: Entry = found[0]
                    return entry
        if oldest is not None and now - oldest[R.T_ENQUEUE] > deadline_ns:
            return oldest
        return None

    def settle_for_dump(self) -> None:
        """Before a dump: poll everything, and mark each group's newest op failed if it was.

        An op that failed fast (a lost peer) may have been stamped ``completed``
        before anyone looked at its result; a failed op leaves its group unusable,
        so it is the group's newest op when the dump is written.
        """
        with self.poll_lock:
            self._poll_locked()
            now = time.monotonic_ns()
            for st in list(self.rec.groups):
                last = st.last
                if last is not None and last[0][R.STATE] == R.COMPLETED and work_failed(last[1]):
                    last[0][R.STATE] = R.FAILED
                    if not last[0][R.T_COMPLETE]:
                        last[0][R.T_COMPLETE] = now
            if self.rec.cxx is not None:
                self.rec.cxx.settle_for_dump()

    def unfinished(self) -> bool:
        """True while any recorded op is still running."""
        with self.poll_lock:
            self._poll_locked()
            return bool(self.tracked) or any(
                st.last is not None and st.last[0][R.STATE] < R.COMPLETED
                for st in list(self.rec.groups)) or (
                    self.rec.cxx is not None and bool(self.rec.cxx.unfinished()))

    def drop_works(self) -> None:
        """Forget every backend Work (they must not outlive interpreter shutdown)."""
        with self.poll_lock:
            self.tracked = []
            self.rec.pending.clear()
            for st in list(self.rec.groups):
                st.last = None
            if self.rec.cxx is not None:
                self.rec.cxx.drop_works()

    def on_overdue(self, entry: Entry, now: int) -> None:
        rec = self.rec
        group = rec.groups[entry[R.GROUP]] if 0 <= entry[R.GROUP] < len(rec.groups) else None
        age = (now - entry[R.T_ENQUEUE]) / 1e9
        seq_kind = "p2p" if entry[R.IS_P2P] else "collective"
        seq = entry[R.P2P_SEQ] if entry[R.IS_P2P] else entry[R.SEQ]
        gname = group.name if group else "?"
        gdesc = group.desc if group else ""
        detail = (f"{entry[R.OP]} {seq_kind} seq {seq} on pg {gname} ({gdesc}) unfinished "
                  f"after {age:.1f} s (deadline {rec.config.timeout_s:g} s)")
        # Our dump first (milliseconds), then the flag, then PyTorch's (slower).
        self.writer.dump(DumpReason.WATCHDOG_TIMEOUT, detail, automatic=True, native=False)
        payload = {
            "rank": rec.current_rank(), "pg": gname, "desc": gdesc, "op": entry[R.OP],
            "seq": seq, "seq_kind": seq_kind, "age_s": round(age, 3), "time_ns": time.time_ns(),
        }
        if self._store_usable():
            try:
                rec.raise_flag(payload)
                self.store_failures = 0
            except Exception as exc:
                self._store_failed(exc)
        if rec.config.save_native:
            self.writer.save_native()

    def poll_store(self) -> None:
        if not self._store_usable() or self.torn_down():
            return
        rec = self.rec
        try:
            rec.heartbeat()
            if not self.answered and not rec.flag_raised:
                payload = rec.poll_flag()
                if payload is not None:
                    self.answer_flag(payload)
            self.store_failures = 0
        except Exception as exc:
            self._store_failed(exc)

    def answer_flag(self, payload: str) -> None:
        self.answered = True
        try:
            info = json.loads(payload)
            detail = (f"rank {info.get('rank')} saw {info.get('op')} {info.get('seq_kind')} seq "
                      f"{info.get('seq')} on pg {info.get('pg')} ({info.get('desc')}) unfinished "
                      f"after {info.get('age_s')} s")
        except (ValueError, AttributeError):
            detail = f"peer raised the dump flag: {payload[:200]}"
        self.writer.dump(DumpReason.PEER_SIGNAL, detail, automatic=True)

    def check_flag_at_exit(self) -> None:
        """At exit: settle, and answer a peer's flag once more (PyTorch's ranks do not)."""
        with contextlib.suppress(Exception):
            self.poll_works()
            rec = self.rec
            if (not self.answered and not rec.flag_raised and self._store_usable()
                    and not self.torn_down()):
                payload = rec.poll_flag()
                if payload is not None:
                    self.answer_flag(payload)

    def shutdown(self, join_timeout_s: float) -> None:
        """Stop the thread and drop every backend Work it holds (never raises).

        Works must not outlive the interpreter's orderly shutdown: a daemon thread
        frozen at exit while holding gloo works ends the process with SIGABRT
        ("terminate called without an active exception").
        """
        with contextlib.suppress(Exception):
            self.stop()
            if self is not threading.current_thread() and self.is_alive():
                self.join(timeout=join_timeout_s)
            self.drop_works()

    def torn_down(self) -> bool:
        """True once the default group was destroyed (healthy teardown: stop using the store)."""
        try:
            return bool(self.is_torn_down())
        except Exception:
            return False

    def _store_usable(self) -> bool:
        rec = self.rec
        if rec.store is None:
            return False
        if rec.store_dead:
            if time.monotonic() < self.store_retry_at:
                return False
            rec.store_dead = False  # try the store again
        return True

    def _store_failed(self, exc: BaseException) -> None:
        rec = self.rec
        self.store_failures += 1
        rec.note_error("store", exc)
        if self.store_failures >= 1:
            rec.store_dead = True
            self.store_retry_at = time.monotonic() + _STORE_RETRY_S
