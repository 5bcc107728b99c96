"""The verdict a recovery acts on: asked of its source, agreed by every survivor.

Sources hand back a :class:`~frforensics.verdict.Verdict` or its JSON object; the
survivors agree on the first one published in the store (the orchestrator
contract's document), and from there on the recovery holds it typed.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from frforensics.recovery._agents import _agent_verdict, _exit_records
from frforensics.recovery._state import (
    ENV_RUN,
    RecoveryError,
    RecoveryFailed,
    State,
    _say,
)
from frforensics.recovery._store import _get
from frforensics.verdict import SCHEMA, Verdict, VerdictError, headline, report_headline


def _wait_verdict(st: State, deadline: float, detail: str) -> dict[str, Any] | None:
    """This rank's verdict, as the JSON object it publishes for the survivors' agreement."""
    verdict = _wait_verdict_inner(st, deadline, detail)
    if verdict is not None and os.environ.get(ENV_RUN) == "1":
        records = _exit_records(st)
        if records and "evidence" not in verdict:
            verdict = {**verdict, "evidence": records}  # the agent's exit codes and signals
    return verdict


def _under_agent_poll(st: State, seconds: float) -> Verdict | None:
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
        return fast.to_json()
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
                return fast.to_json()
            time.sleep(max(0.0, settle_end - time.monotonic()))
    try:
        v = source(max(0.0, deadline - time.monotonic()), detail)
    except Exception as exc:
        _say(st, f"the verdict source failed: {exc}")
        return None
    if isinstance(v, Verdict):
        return v.to_json()
    # a JSON object goes to the agreement as it came: every survivor then refuses a
    # malformed one with the same message (recover parses the agreed document)
    return v if isinstance(v, dict) else None


def verdict_from_dump_dir(dump_dir: str | os.PathLike[str], *, world_size: int,
                          settle_s: float = 1.5) -> Callable[[float, str], Verdict | None]:
    """A verdict source for jobs whose ranks share a dump directory.

    When called, this rank dumps (the recorder's API dump, unless its watchdog
    already did), waits until every rank of ``world_size`` has a dump there or
    no new dump appeared for ``settle_s``, then runs ``fr-analyze --format json``
    in a child process (the training process imports no analysis code) and
    returns the report's verdict (a :class:`~frforensics.verdict.Verdict`). Used when the recorder has no verdict
    of its own at hang time; the first survivor's verdict is the one everyone
    uses (see :func:`recover`).
    """
    from pathlib import Path

    directory = Path(dump_dir)

    def source(timeout_s: float, detail: str) -> Verdict | None:
        import subprocess

        end = time.monotonic() + timeout_s
        with contextlib.suppress(Exception):
            import frforensics.recorder as recorder

            # The watchdog's dump (with the peers' heartbeats) is the better evidence:
            # dump here only when the step failed before any deadline fired. The
            # recorder names its dump by the member id (recorder/_reconfig.py).
            s = recorder.session()
            mine = directory / f"frdump_rank_{s.rec.current_rank() if s else -1}"
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
                           error=str(exc))
        head = report_headline(report)
        return replace(found, headline=head, text=head, source=str(directory))

    return source


def _agree_on_verdict(st: State, ns: str, local: dict[str, Any] | None,
                      deadline: float) -> dict[str, Any] | None:
    """The verdict every survivor uses for the attempt whose keys are under ``ns``
    (``_state._ns``): the first one published.

    The store holds its JSON object (the orchestrator contract's document);
    :func:`parse_agreed` reads it typed.
    """
    key = f"{ns}/verdict"
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


def parse_agreed(doc: dict[str, Any]) -> Verdict:
    """The agreed document, typed; :class:`RecoveryError` naming its first bad field
    (``actions[0].rank is 'two' (want an int member id)``)."""
    try:
        return Verdict.from_json(doc, require_schema=False)
    except VerdictError as exc:
        raise RecoveryError(str(exc), [doc]) from None


def _later_verdicts(st: State) -> list[dict[str, Any]]:
    """The recorder's verdict of the next incident, when one arrives within the bound."""
    rec = st.recorder
    if rec is None:
        return []
    with contextlib.suppress(Exception):
        rec.next_incident()
        v = rec(st.options.arrival_timeout_s, "recovery failed: a survivor did not arrive")
        if isinstance(v, Verdict):
            return [v.to_json()]
        if isinstance(v, dict):
            return [v]
    return []


