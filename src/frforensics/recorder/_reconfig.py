"""A process group re-formed over new peers (torch 2.15 ``_reconfigure``), as the recorder sees it.

torch 2.15's gloo restarts a group's sequence numbers at every reconfigure
(measured: ``pg._get_sequence_number_for_group()`` is 3 after three all_reduces,
0 right after ``_reconfigure(uuid=2, ...)`` with the same peers, 1 after one more
all_reduce; docs/recovery.md). So the recorder gives the re-formed group a new
identity: a new :class:`GroupState` named ``<name>@r<uuid>`` with the new members
(global ranks as of ``init_process_group``) and counters from zero. Entries
before the change stay under the old group, entries after it under the new one:
the analyzer, which matches ops per group, never pairs ops across the change,
without knowing about reconfiguration at all. Every dump notes the change (old
and new membership, uuid, reason) in its notes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from frforensics.recorder._core import GroupState, Recorder


class Reconfigurations:
    """The changes seen by this process, for the dump notes."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def notes(self, _reason: Any) -> Iterable[str]:
        return list(self.lines)


class NativeGroups(Protocol):
    """How a group on the native path is read and re-bound (``_c10d``)."""

    def state_of(self, group: Any) -> GroupState | None: ...

    def counters(self, group: Any) -> tuple[int, int] | None: ...

    def rebind(self, group: Any, state: GroupState) -> None: ...


def reconfigured(rec: Recorder, group: Any, *, uuid: int, old_members: Sequence[int],
                 members: Sequence[int], reason: str, log: Reconfigurations | None,
                 native: NativeGroups | None = None) -> GroupState | None:
    """Give ``group`` (a recording wrapper, or a group on the native path) its
    post-reconfigure identity; None if not ours."""
    old: GroupState | None = getattr(group, "_frf_state", None)
    counts = None if old is None else (old.seq, old.p2p_seq)
    on_native = old is None and native is not None
    if on_native and native is not None:  # its counters live in the native ring
        old = native.state_of(group)
        counts = native.counters(group)
    if old is None or counts is None:
        return None
    ranks = tuple(int(m) for m in members)
    if counts == (0, 0) and uuid <= 1:
        # The first configuration, nothing recorded yet: same group, real members.
        # Any later one gets the new identity even where this process recorded
        # nothing (an admitted standby): the members' group is `<name>@r<uuid>`,
        # and a standby still calling it `<name>` would put its ops beside the
        # members' ops from before the change (a later hang then read as a
        # deadlock across two groups, naming healthy ranks).
        old.ranks = ranks
        new = old
    else:
        base = old.name.split("@r", 1)[0]
        new = rec.new_group(name=f"{base}@r{uuid}", desc=old.desc, ranks=ranks,
                            backend=old.backend, timeout_ms=old.timeout_ms)
        new.cuda = old.cuda
        if not on_native:
            group._frf_state = new
    if on_native and native is not None:
        native.rebind(group, new)  # counters from zero, the new members' global ranks
    if log is not None:
        log.lines.append(
            f"reconfigured group {old.name} ({old.desc}) at {time.time_ns()} ns: uuid {uuid}, "
            f"members {list(old_members)} -> {list(ranks)} (now {new.name}); {reason}"[:500])
    return new
