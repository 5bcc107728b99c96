"""The recorder as ``frforensics.recovery``'s verdict source and reconfiguration listener.

Recovery (the job side) needs four things from the recorder, and only these
(``frforensics.recovery.VerdictSource`` and ``JobRecorder``, typed protocols):

- the verdict of the incident that failed a step: raise the job-wide dump flag
  from this rank (:func:`frforensics.recorder.request_verdict`: every live rank
  dumps and one elected rank computes the verdict) and wait for it
  (:func:`frforensics.recorder.wait_verdict`);
- how long to wait before asking, when the op failed *because a peer died*
  (``Connection reset by peer``): the dead peer's heartbeat must go stale first so
  that the dumps name it (``dead_rank``) rather than a rank merely missing — the
  recorder's ``stale_limit_s`` plus one store poll, at most 10 s (the excepthook
  in recorder/__init__.py waits the same);
- a re-formed group's new identity (:func:`frforensics.recorder.note_reconfigure`,
  recorder/_reconfig.py);
- the next incident once a recovery succeeded (:func:`frforensics.recorder.rearm`).

Every method checks that the recorder is on *when called* (it may be enabled
after ``recovery.setup()`` or disabled before a failure) and never raises: with
the recorder off, :meth:`RecorderVerdicts.__call__` returns None and recovery
says "no verdict" (it never guesses whom to exclude).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from frforensics.failures import is_peer_loss

__all__ = ["RecorderVerdicts"]


class RecorderVerdicts:
    """This process's recorder, seen from ``frforensics.recovery`` (stateless)."""

    __slots__ = ()

    def __call__(self, timeout_s: float, detail: str) -> dict[str, Any] | None:
        """Request the verdict now and wait up to ``timeout_s`` for it (None: none)."""
        import frforensics.recorder as recorder

        if not recorder.is_enabled():
            return None
        with contextlib.suppress(Exception):
            recorder.request_verdict(detail)
        verdict = recorder.wait_verdict(max(0.0, timeout_s))
        return verdict if isinstance(verdict, dict) else None

    def settle_s(self, detail: str) -> float:
        """Seconds to wait before :meth:`__call__` after a failed op described by ``detail``.

        Nonzero only for a lost peer (``frforensics.failures.is_peer_loss``).
        """
        import frforensics.recorder as recorder

        sess = recorder.session()
        if sess is None or not sess.rec.active or not is_peer_loss(detail):
            return 0.0
        config = sess.rec.config
        return min(float(config.stale_limit_s) + float(config.store_poll_interval_s), 10.0)

    def note_reconfigure(self, group: Any, *, uuid: int, old_members: Sequence[int],
                         members: Sequence[int], reason: str) -> None:
        """``group`` was re-formed over ``members`` (member ids); never raises."""
        import frforensics.recorder as recorder

        with contextlib.suppress(Exception):
            recorder.note_reconfigure(group, uuid=uuid, old_members=list(old_members),
                                      members=list(members), reason=reason)

    def next_incident(self) -> None:
        """Open the next incident (after a recovery); nothing when the recorder is off."""
        import frforensics.recorder as recorder

        if recorder.is_enabled():
            with contextlib.suppress(Exception):
                recorder.rearm()
