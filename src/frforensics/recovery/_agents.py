"""What frforensics-run's agent says about its workers: exit records, and a verdict."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

from frforensics.recovery._state import State
from frforensics.recovery._store import _add
from frforensics.verdict import EXIT_EXCLUDED, Action, Verdict, headline

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


def _agent_verdict(st: State) -> Verdict | None:
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
        evidence=tuple(records), source="frforensics-run")


