"""Orderings of the recovery store protocol that lose a standby, exclude or fail wrongly.

Each test plays the processes of one interleaving (threads on one dict-backed store,
or one process's calls in order) and fails on the code it was written against.
Nothing here needs a process group: the reconfigure handle and the re-form's apply
are stubbed where a test reaches them.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
import time
from typing import Any

import pytest

from frforensics import recovery
from frforensics.recovery import _reform
from frforensics.verdict import Action, Verdict

# the package's name ``_standby`` is the function it re-exports; this is the module
_standby = importlib.import_module("frforensics.recovery._standby")

pytestmark = pytest.mark.torch215  # run on 2.13 (stage 1) and 2.15 (stage 2)

LOST_PEER = "[../pair.cc:545] Read error [127.0.0.1]:22437: Connection reset by peer."


class _Store:
    """The c10d store calls recovery makes, in a dict; one lock (TCPStore's server
    applies each call atomically, and the tests call it from several threads)."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.kv for k in keys)

    def get(self, key: str) -> bytes:
        with self.lock:
            return self.kv[key]

    def set(self, key: str, value: str | bytes) -> None:
        with self.lock:
            self.kv[key] = value.encode() if isinstance(value, str) else value

    def add(self, key: str, n: int) -> int:
        with self.lock:
            value = int(self.kv.get(key, b"0")) + n
            self.kv[key] = str(value).encode()
            return value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        # c10d's TCPStore: a missing key with expected "" is set; the value is returned
        with self.lock:
            if key not in self.kv and expected == "":
                self.kv[key] = desired.encode()
            return self.kv.get(key, expected.encode())


def _verdict(*actions: tuple[int, str]) -> dict[str, Any]:
    return {"schema": "frforensics.verdict/1", "status": "hang", "headline": "HANG — test",
            "actions": [{"rank": r, "action": a} for r, a in actions]}


def _planned(*ranks: int) -> Verdict:
    return Verdict(status="planned", culprit_ranks=tuple(ranks),
                   actions=tuple(Action(rank=r, action="replace_gpu_or_host", because="planned")
                                 for r in ranks),
                   headline="PLANNED — test")


def _state(store: _Store, me: int, members: list[int], *, spares: list[int] | None = None,
           **options: Any) -> recovery.State:
    opts = recovery.Options(**{"verdict_timeout_s": 2.0, "arrival_timeout_s": 2.0, **options})
    return recovery.State(me=me, members=list(members), uuid=1, store=store, options=opts,
                          restart="0", known=set(members) | set(spares or ()),
                          spares=list(spares or ()))


def _stub_reconfigure(monkeypatch: pytest.MonkeyPatch) -> dict[int, dict[str, Any]]:
    """No process group here: a fixed handle, and an apply that records the decision."""
    applied: dict[int, dict[str, Any]] = {}

    def apply(st: recovery.State, g: recovery.Guard, decision: dict[str, Any],
              verdict: Verdict) -> None:
        applied[st.me] = decision
        st.members, st.uuid = [int(m) for m in decision["members"]], int(decision["uuid"])
        g.reconfigured = True

    monkeypatch.setattr(_reform, "_handle", lambda group=None: "h-member")
    monkeypatch.setattr(_standby, "_handle", lambda group=None: "h-standby")
    monkeypatch.setattr(_reform, "_apply", apply)
    monkeypatch.setattr(_standby, "_apply", apply)
    return applied


def _in_thread(fn: Any, *args: Any, **kwargs: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the test's thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


# ------------------------------------------------ 1. a refused attempt's keys are reused

def test_a_refused_planned_exclusion_is_not_the_verdict_of_the_next_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A planned exclusion of ranks 2 and 3 is refused (min_world_size=3) and the job
    # trains on, at the same uuid (a refusal does not advance it). Then rank 1 dies
    # and the source names it: excluding rank 1 leaves 3, within the rules. The
    # survivors agree on the verdict with compare_set on <uuid>/verdict, which still
    # holds the refused plan: they agree on it, refuse again, and the job fails.
    import torch.distributed as dist

    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, **kw: None)  # one process
    reformed: list[list[int]] = []
    monkeypatch.setattr(_reform, "_reform",
                        lambda st, g, verdict, excluded, sharded: reformed.append(excluded))
    st = _state(_Store(), 0, [0, 1, 2, 3], min_world_size=3, plan_check_every=1)
    st.source = lambda timeout_s, detail: _verdict((1, "replace_gpu_or_host"))
    rec = recovery.Recovery(st)

    assert rec.propose_exclusion([2, 3], "two slow GPUs") is True
    with rec.guard() as g:  # the step succeeds; the planned check refuses the plan
        pass
    assert not g.reconfigured and reformed == [] and rec.members == [0, 1, 2, 3]

    with rec.guard() as g:  # rank 1 died
        raise RuntimeError(LOST_PEER)
    assert reformed == [[1]]
    assert g.verdict is not None and g.verdict["actions"][0]["rank"] == 1


# ------------------------------------ 2. an excluded rank exits before the leader decides

class _Exited(BaseException):
    """os._exit, in a test: ends the thread playing that process."""


def _sharded_job(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[int, dict[str, Any]], list[int]]:
    """A state sharded across the excluded ranks' places (HSDP, each shard with a
    replica peer), no process group, and os._exit recorded."""
    applied = _stub_reconfigure(monkeypatch)
    monkeypatch.setattr(_reform, "_refuse_lost_shards", lambda st, excluded, verdict: True)
    exits: list[int] = []

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise _Exited

    monkeypatch.setattr(os, "_exit", fake_exit)
    return applied, exits


def _plan(*ranks: int) -> dict[str, Any]:
    return dict(json.loads(_planned(*ranks).dumps()))


def test_a_rank_whose_exclusion_the_leader_refuses_does_not_exit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A sharded state and no free standby: the leader refuses in _decide ("no
    # standby is free to take its place"), and the docs promise nobody is excluded
    # (a refused plan: "training goes on"). But the rank the planned verdict names
    # acts on the verdict alone: it exits 79 in _reform before the leader has
    # decided anything, and the others train on without it.
    _, exits = _sharded_job(monkeypatch)
    store = _Store()
    leader, culprit = _state(store, 0, [0, 1]), _state(store, 1, [0, 1])

    t, out = _in_thread(_reform.recover, culprit, recovery.Guard(), planned=_plan(1))
    with pytest.raises(recovery.RecoveryRefused, match="no standby is free"):
        _reform.recover(leader, recovery.Guard(), planned=_plan(1))
    t.join(10)
    assert not t.is_alive()
    assert exits == [], "rank 1 exited 79 although the leader refused to exclude it"
    assert isinstance(out.get("error"), recovery.RecoveryRefused)


# ----------------------------- 3. a standby leaves the uuid the members will use again

def test_a_standby_that_answered_a_refused_plan_takes_the_place_of_a_rank_lost_later(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Attempt 1 (uuid 2): a planned exclusion of ranks 1 and 2 in a sharded job;
    # standby 4 answers, but two places need two standbys: the leader refuses, the
    # members stay at uuid 1 and train on. The standby reads the refused decision
    # and moves on to uuid 3. Then rank 1 dies; attempt 2 is uuid 2 again, and
    # finds attempt 1's keys: the verdict (the plan, not rank 1), the refused
    # decision, and the standby's count and entry (<2>/nspare, <2>/spare#1) -- the
    # leader can admit a standby that is watching <3>/open and never joins.
    monkeypatch.setattr(_reform, "SPARE_WAIT_S", 1.5)
    monkeypatch.setattr(_reform, "SPARE_ENTRY_GRACE_S", 1.0)
    applied, exits = _sharded_job(monkeypatch)
    store = _Store()
    members = [0, 1, 2]
    leader = _state(store, 0, members, spares=[4])
    rank2 = _state(store, 2, members, spares=[4])
    spare = _state(store, 4, members, spares=[4])
    for st in (leader, rank2):
        st.source = lambda timeout_s, detail: _verdict((1, "replace_gpu_or_host"))
    store.add("standbys", 1)  # the standby's setup()
    t_spare, spare_out = _in_thread(_standby._standby, spare, 10.0)
    leader_error: BaseException | None = None
    try:
        # attempt 1: the plan; rank 1 and rank 2 are alive (slow GPUs), rank 2 here
        t2, out2 = _in_thread(_reform.recover, rank2, recovery.Guard(), planned=_plan(1, 2))
        with pytest.raises(recovery.RecoveryRefused, match="no standby is free"):
            _reform.recover(leader, recovery.Guard(), planned=_plan(1, 2))
        t2.join(10)
        assert leader.uuid == 1  # refused: the members keep their configuration
        time.sleep(0.3)  # the standby reads the refused decision
        # attempt 2: rank 1 died
        t2, out2 = _in_thread(_reform.recover, rank2, recovery.Guard(),
                              cause=RuntimeError(LOST_PEER))
        try:
            _reform.recover(leader, recovery.Guard(), cause=RuntimeError(LOST_PEER))
        except recovery.RecoveryError as exc:
            leader_error = exc
        t2.join(10)
        t_spare.join(3.0)
    finally:
        if t_spare.is_alive():  # end it: the members of every configuration closed
            for uuid in (1, 2, 3):
                store.add(f"{uuid}/closed", 10)
            t_spare.join(5.0)
    problems = []
    if exits:
        problems.append(f"a rank exited {exits} (the refused plan named it)")
    if leader_error is not None:
        problems.append(f"the leader: {type(leader_error).__name__}: {leader_error}")
    if "error" in out2:
        problems.append(f"rank 2: {type(out2['error']).__name__}: {out2['error']}")
    if 4 not in applied:
        problems.append("standby 4 never joined (it had moved on to uuid 3)"
                        + (", though the leader admitted it from its old entry"
                           if 4 in applied.get(0, {}).get("members", []) else ""))
    assert not problems, "\n".join(problems)
    assert applied[0]["members"] == applied[4]["members"] == [0, 4, 2]
    assert spare_out["result"].reconfigured


# ------------------------- 4. the planned check's collective is outside the guard's net

def test_a_peer_lost_at_the_planned_check_starts_a_recovery(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A peer dies after the step's last collective (in its optimizer step). The
    # step succeeds everywhere; at the N-th step the guard's planned check runs its
    # all_reduce, which fails: that error leaves the guard as it is, no recovery.
    import torch.distributed as dist

    def lost(tensor: Any, op: Any = None, **kw: Any) -> None:
        raise RuntimeError(LOST_PEER)

    monkeypatch.setattr(dist, "all_reduce", lost)
    asked: list[str] = []
    st = _state(_Store(), 1, [0, 1, 2, 3], plan_check_every=1)
    st.source = lambda timeout_s, detail: asked.append(detail)  # no verdict: fails, bounded
    rec = recovery.Recovery(st)
    with pytest.raises(recovery.RecoveryFailed, match="no verdict"), rec.guard():
        pass
    assert len(asked) == 1 and "reset by peer" in asked[0]


# ---------------- 5. the leader reads the standby count once, then waits on one entry

def test_a_standby_that_answers_after_one_that_never_wrote_its_entry_is_admitted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Standby A counts itself in (nspare 1) and stalls, or dies, before writing its
    # entry; standby B answers 0.1 s later (nspare 2, spare#2). The leader read the
    # count once (1 >= wanted), waits on spare#1 only, and goes on without a standby
    # although B's entry was there within the window.
    monkeypatch.setattr(_reform, "SPARE_WAIT_S", 1.0)
    monkeypatch.setattr(_reform, "SPARE_ENTRY_GRACE_S", 1.0)
    store = _Store()
    st = _state(store, 0, [0, 1, 2, 3], spares=[4, 5])
    store.add("standbys", 2)
    store.add("2/nspare", 1)  # A, counted in; its entry never comes

    def answer_b() -> None:
        n = store.add("2/nspare", 1)
        store.set(f"2/spare#{n}", json.dumps({"id": 5, "handle": "h5"}))

    late = threading.Timer(0.1, answer_b)
    late.start()
    try:
        got = _reform._admit_spares(st, 2, 1, time.monotonic() + 10)
    finally:
        late.cancel()
    assert got == [(5, "h5")]
