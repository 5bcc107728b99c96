"""A standby waiting to be admitted, and a live member told it was excluded."""

from __future__ import annotations

import contextlib
import json
import time

from frforensics.recovery._reform import _apply, _exit_excluded, recover
from frforensics.recovery._state import (
    Guard,
    HandoverLost,
    RecoveryError,
    RecoveryFailed,
    State,
    _ns,
    _say,
)
from frforensics.recovery._store import _add, _get, _handle, _set
from frforensics.verdict import Verdict


def _standby(st: State, timeout_s: float | None) -> Guard:
    if st.me not in st.spares:
        raise RecoveryError(f"rank {st.me} is not a spare (spares: {st.spares})")
    end = None if timeout_s is None else time.monotonic() + timeout_s
    uuid = st.uuid + 1
    next_attempt = 0
    _say(st, "standing by")
    while end is None or time.monotonic() < end:
        if _job_finished(st):
            _say(st, "the job finished without needing this standby")
            return Guard()
        opened = _get(st.store, f"{uuid}/open", time.monotonic() + 0.2)
        if opened is None:
            continue
        try:
            a = int(opened)  # the members' attempt at this membership
        except ValueError:
            a = 0
        if a < next_attempt:  # the refused attempt's open: wait for the next one
            time.sleep(0.05)
            continue
        ns = _ns(uuid, a)
        # the entry is made before counting in: the leader reads it as soon as the
        # count says it is there (and waits a little for it, _admit_spares)
        entry = json.dumps({"id": st.me, "handle": _handle()})
        n = _add(st.store, f"{ns}/nspare", 1)
        _set(st.store, f"{ns}/spare#{n}", entry)
        raw = _get(st.store, f"{ns}/decision", time.monotonic() + 3 * st.options.arrival_timeout_s)
        if raw is None:
            uuid += 1
            next_attempt = 0
            continue
        decision = json.loads(raw)
        if "failed" in decision or "refused" in decision:
            next_attempt = a + 1  # the members stay at this uuid: their next attempt
            continue
        if st.me not in decision["members"]:
            st.uuid = uuid
            uuid += 1
            next_attempt = 0
            continue
        g = Guard()
        st.spares = [s for s in st.spares if s != st.me]
        for s in decision["members"]:
            if s in st.spares:
                st.spares.remove(s)
        st.known.update(int(m) for m in decision["members"])
        with contextlib.suppress(RecoveryError):
            _add(st.store, "standbys", -1)
        st.joined = True
        t_admitted = time.monotonic()
        try:
            _apply(st, g, decision, Verdict(status=None, headline=str(decision.get("reason", ""))))
        except HandoverLost as exc:
            # A member now: it recovers with the others and, still without state,
            # receives it from the next survivor.
            _say(st, f"{exc.reason}; recovering again with the members")
            recover(st, g, cause=exc)
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
        key = f"{_ns(st.uuid + 1, st.attempt)}/decision"
        try:
            if not st.store.check([key]):
                failures = 0
                continue
            decision = json.loads(bytes(st.store.get(key)))
        except Exception:
            failures += 1
            continue
        if "failed" in decision or st.me in decision.get("members", [st.me]):
            continue
        _exit_excluded(st, Verdict(status=None, headline=str(decision.get("reason", ""))))


