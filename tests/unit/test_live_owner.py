"""Who the live straggler owner reads, and who owns it (recorder/_live.py).

Each rank's thread is driven by hand (``_round``) against one in-memory store, with
the clock moved by hand: the owner reads an admitted standby (a member id past the
world it was started in), stops reading a rank whose rounds stopped (excluded or
exited), and is replaced when its own rounds stop; the last test runs the real
analysis child on windows that include the standby's.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from frforensics.model import GroupInfo
from frforensics.recorder import _live


class _Store:
    """The c10d store calls the live exchange makes (TCPStore's semantics)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self.values[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        return self.values[key]

    def add(self, key: str, n: int) -> int:
        v = int(self.values.get(key, b"0")) + n
        self.values[key] = str(v).encode()
        return v

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.values[k] for k in keys]

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        current = self.values.get(key)
        if (current is None and expected == "") or current == expected.encode():
            self.values[key] = desired.encode()
        return self.values[key]


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _rank(store: _Store, me: int, world: int, tmp: Path, interval: float = 1.0,
          verdict_timeout: float = 10.0) -> _live.LiveStragglers:
    rec = SimpleNamespace(
        store=store, rank=me, world_size=world, store_dead=False, flag_raised=False,
        flag_seen=None, groups=[], snapshot=lambda: ([], 0), resolution_ns=1_000_000,
        config=SimpleNamespace(verdict_timeout_s=verdict_timeout, dump_dir=tmp, timeout_s=3.0,
                               stale_limit_s=2.0),
        note_error=lambda *a: None)
    return _live.LiveStragglers(rec, None, interval)  # type: ignore[arg-type]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(_live.time, "monotonic", c)
    return c


def _read_by_owner(threads: dict[int, _live.LiveStragglers],
                   monkeypatch: pytest.MonkeyPatch) -> dict[int, list[list[int]]]:
    """Each rank's ``_analyze`` records whom it would read instead of analyzing."""
    read: dict[int, list[list[int]]] = {r: [] for r in threads}
    for r, t in threads.items():
        monkeypatch.setattr(t, "_analyze", lambda s, r=r, t=t: read[r].append(t._publishers(s)))
    return read


def test_the_owner_reads_a_standby_past_the_world_and_stops_reading_a_rank_whose_rounds_stop(
        tmp_path: Path, clock: _Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _Store()
    # ranks 0-3 of a world of 4; the standby is member 4, started as a world of 5
    threads = {r: _rank(store, r, 4 if r < 4 else 5, tmp_path) for r in range(5)}
    read = _read_by_owner(threads, monkeypatch)
    for _ in range(2):
        for r in range(5):
            threads[r]._round()
        clock.t += 1.0
    assert [r for r, t in threads.items() if t.owner] == [0]
    assert read[0][-1] == [0, 1, 2, 3, 4]
    # rank 3 is excluded and exits: its counter stops; the others go on. Its last
    # change was seen at 1002: it is read until more than 3 intervals have passed
    for _ in range(5):
        for r in (0, 1, 2, 4):
            threads[r]._round()
        clock.t += 1.0
    assert read[0][2] == [0, 1, 2, 3, 4]  # not dropped after one quiet interval
    assert read[0][-1] == [0, 1, 2, 4]
    assert all(not t.owner for r, t in threads.items() if r != 0)


@pytest.mark.parametrize("process_alive", [False, True])
def test_a_rank_takes_over_when_the_owners_rounds_stop_and_the_old_owner_steps_down(
        tmp_path: Path, clock: _Clock, monkeypatch: pytest.MonkeyPatch,
        process_alive: bool) -> None:
    # The owner's rounds stop. Its process gone (its heartbeat stopped too): a rank
    # takes over after three intervals. Its process alive (an analysis that stalls):
    # only past the analysis bound, verdict_timeout_s (10 s) + three intervals.
    store = _Store()
    threads = {r: _rank(store, r, 4, tmp_path, verdict_timeout=10.0) for r in range(4)}
    read = _read_by_owner(threads, monkeypatch)
    for r in range(4):
        threads[r]._round()
    assert threads[0].owner
    wait = 12 if process_alive else 3
    for i in range(wait):
        clock.t += 1.0
        if process_alive:
            store.set("hb/0", str(i))  # the watchdog's heartbeat goes on
        for r in (1, 2, 3):
            threads[r]._round()
    assert not any(threads[r].owner for r in (1, 2, 3))
    for _ in range(2 if process_alive else 1):
        clock.t += 1.0
        for r in (1, 2, 3):
            threads[r]._round()
    assert [r for r in (1, 2, 3) if threads[r].owner] == [1]  # exactly one took over
    assert store.values["live/owner"] == b"1"
    assert read[1] and read[1][-1] == [1, 2, 3]  # it no longer reads the stopped owner
    # the old owner comes back (it had stalled): it finds another id and steps down
    before = len(read[0])
    threads[0]._round()
    assert not threads[0].owner and len(read[0]) == before


def test_a_hostile_registry_costs_the_owner_a_bounded_round(
        tmp_path: Path, clock: _Clock) -> None:
    # the registry's count and entries are store values: a count of 10**12 is read
    # SLOTS_A_ROUND slots a round, and an entry naming no rank is no candidate
    store = _Store()
    t = _rank(store, 0, 4, tmp_path)
    for r in range(4):
        store.set(f"live/{r}", b"x")
        store.add(f"live/{r}/round", 1)
    store.add("live/n", 10**12)
    store.set("live/who/1", "99999999999")
    store.set("live/who/2", "-3")
    store.set("live/who/3", "two")
    store.set("live/who/5", "4")  # slot 4 counted, not yet written
    store.set("live/4/round", b"1")
    checks = 0
    real_check = store.check

    def counting(keys: list[str]) -> bool:
        nonlocal checks
        checks += 1
        return real_check(keys)

    store.check = counting  # type: ignore[method-assign]
    assert t._publishers(store) == [0, 1, 2, 3, 4]
    assert checks < _live.SLOTS_A_ROUND + 100
    assert t.next_slot == _live.SLOTS_A_ROUND + 1 and 4 in t.unwritten
    store.set("live/who/4", "1")  # written late: read the next round
    t._publishers(store)
    assert t.slots[4] == 1 and 4 not in t.unwritten


def test_the_owner_names_a_slow_standby_from_its_window(tmp_path: Path) -> None:
    # The analysis child on windows of members 0, 1, 2 and the admitted standby 4
    # (world 4): the standby arrives 50 ms after the others at every all_reduce.
    t = _rank(_Store(), 0, 4, tmp_path)
    group = [GroupInfo("0@r2", "default_pg", (0, 1, 2, 4), "")]
    n = 64
    seq = np.arange(1, n + 1, dtype=np.int64)
    start = 1_700_000_000_000_000_000 + seq * 200_000_000
    for r in (0, 1, 2, 4):
        enq = start + (50_000_000 if r == 4 else 0)
        comp = start + 55_000_000
        t.windows[r] = {"group": np.zeros(n, np.int32), "seq": seq, "enq": enq, "comp": comp,
                        "op": np.asarray(["all_reduce"] * n, dtype=object)}
        t.groups_of[r] = group
    docs: list[dict[str, Any]] = []
    t.agent = SimpleNamespace(run_hooks=lambda doc, path: docs.append(doc))
    store: Any = t.rec.store
    for r in (0, 1, 2, 4):
        store.set(f"live/{r}", _live.encode_round([], [], [], [], []))
        store.add(f"live/{r}/round", 1)
    store.set("live/who/1", "4")
    store.add("live/n", 1)
    t._analyze(store)
    assert docs, "the owner named nobody"
    assert docs[-1]["culprit_ranks"] == [4], json.dumps(docs[-1])[:2000]
