"""The job's store and the process group's reconfigure, each call bounded."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

from frforensics.recovery._state import _NS, RecoveryFailed, _torch


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


