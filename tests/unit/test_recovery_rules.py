"""The recovery guard's rules that need no job: whom to exclude, when to refuse, old torch."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from frforensics import recovery

pytestmark = pytest.mark.torch215  # run on 2.13 (stage 1) and 2.15 (stage 2)


def _verdict(*actions: tuple[int, str]) -> dict[str, Any]:
    return {"schema": "frforensics.verdict/1", "status": "hang", "headline": "HANG — test",
            "actions": [{"rank": r, "action": a} for r, a in actions]}


def test_ranks_to_replace_are_the_exclusion_set() -> None:
    v = _verdict((2, "replace_gpu_or_host"), (5, "replace_gpu_or_host"))
    assert recovery.exclusion_from(v, [0, 1, 2, 3, 4, 5]) == [2, 5]


def test_fix_code_refuses_with_the_verdict_in_the_exception() -> None:
    v = _verdict((2, "replace_gpu_or_host"), (3, "fix_code"))
    with pytest.raises(recovery.RecoveryRefused) as info:
        recovery.exclusion_from(v, [0, 1, 2, 3])
    assert info.value.verdict is v
    assert "fix_code" in str(info.value) and "HANG — test" in str(info.value)


@pytest.mark.parametrize("actions", [[(2, "inspect")], []])
def test_a_verdict_naming_nobody_to_replace_refuses(actions: list[tuple[int, str]]) -> None:
    with pytest.raises(recovery.RecoveryRefused, match="names no rank to replace"):
        recovery.exclusion_from(_verdict(*actions), [0, 1, 2, 3])


def test_ranks_already_gone_are_not_excluded_twice() -> None:
    v = _verdict((2, "replace_gpu_or_host"), (7, "replace_gpu_or_host"))
    assert recovery.exclusion_from(v, [0, 1, 2, 3], known=range(8)) == [2]


def test_a_verdict_excluding_every_member_is_refused_with_the_verdict() -> None:
    v = _verdict(*[(r, "replace_gpu_or_host") for r in range(4)])
    with pytest.raises(recovery.RecoveryRefused, match="would exclude every member") as info:
        recovery.exclusion_from(v, [0, 1, 2, 3])
    assert info.value.verdict is v


def test_the_store_hosts_rank_is_not_excluded_without_an_external_store() -> None:
    v = _verdict((0, "replace_gpu_or_host"))
    with pytest.raises(recovery.RecoveryRefused, match="rank 0 hosts the c10d store"):
        recovery.exclusion_from(v, [0, 1, 2, 3], store_host=0)
    assert recovery.exclusion_from(v, [0, 1, 2, 3], store_host=None) == [0]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_exclusions": 1, "excluded_so_far": 1}, "more than max_exclusions=1"),
    ({"max_exclusions": 1}, "more than max_exclusions=1"),
    ({"min_world_size": 3}, "fewer than min_world_size=3"),
])
def test_more_exclusions_than_the_options_allow_are_refused(kwargs: dict[str, Any],
                                                            message: str) -> None:
    v = _verdict((2, "replace_gpu_or_host"), (3, "replace_gpu_or_host"))
    with pytest.raises(recovery.RecoveryRefused, match=message):
        recovery.exclusion_from(v, [0, 1, 2, 3], **kwargs)


def test_exclusions_within_the_options_are_allowed() -> None:
    v = _verdict((3, "replace_gpu_or_host"))
    assert recovery.exclusion_from(v, [0, 1, 2, 3], max_exclusions=2, excluded_so_far=1,
                                   min_world_size=3) == [3]


@pytest.mark.parametrize(("action", "field"), [
    ({"action": "replace_gpu_or_host"}, "actions[0].rank is missing"),
    ({"rank": None, "action": "replace_gpu_or_host"}, "actions[0].rank is None"),
    ({"rank": "two", "action": "replace_gpu_or_host"}, "actions[0].rank is 'two'"),
    ({"rank": "1", "action": "replace_gpu_or_host"}, "actions[0].rank is '1'"),
    ({"rank": 1.9, "action": "replace_gpu_or_host"}, "actions[0].rank is 1.9"),
    ({"rank": 1.0, "action": "replace_gpu_or_host"}, "actions[0].rank is 1.0"),
    ({"rank": True, "action": "replace_gpu_or_host"}, "actions[0].rank is True"),
    ({"rank": -1, "action": "replace_gpu_or_host"}, "actions[0].rank -1 is not a member"),
    ({"rank": 4, "action": "replace_gpu_or_host"}, "actions[0].rank 4 is not a member"),
    ({"rank": 1, "action": None}, "actions[0].action is None"),
    ({"rank": 1, "action": 3}, "actions[0].action is 3"),
    ("rank 1", "actions[0] is str"),
])
def test_a_malformed_action_is_an_error_naming_the_field(action: Any, field: str) -> None:
    v = {"status": "hang", "headline": "HANG — test", "actions": [action]}
    with pytest.raises(recovery.RecoveryError) as info:
        recovery.exclusion_from(v, [0, 1, 2, 3])
    assert type(info.value) is recovery.RecoveryError  # not a refusal, not a raw TypeError
    assert field in str(info.value)


@pytest.mark.parametrize("verdict", [{"actions": {"rank": 1}}, {"actions": "all"}, [1], None])
def test_a_verdict_that_is_not_the_contract_is_an_error(verdict: Any) -> None:
    with pytest.raises(recovery.RecoveryError, match="malformed verdict"):
        recovery.exclusion_from(verdict, [0, 1, 2, 3])


@pytest.mark.parametrize(("code", "signal", "excluded"), [
    (-9, "SIGKILL", False), (137, "SIGKILL", False), (-11, "SIGSEGV", False),
    (1, None, False), (79, None, True),
])
def test_the_agents_exit_record_names_the_signal(code: int, signal: str | None,
                                                 excluded: bool) -> None:
    rec = recovery.exit_record(3, code, host="h", pid=10)
    assert (rec["rank"], rec["exitcode"], rec["signal"], rec["excluded"]) == (
        3, code, signal, excluded)


def test_torch_without_reconfigure_is_said_in_one_line() -> None:
    import torch

    why = recovery.available()
    if hasattr(torch.distributed.distributed_c10d, "_reconfigure"):
        assert why is None
        return
    assert why is not None and "\n" not in why
    assert "torch >= 2.15" in why and torch.__version__ in why
    with pytest.raises(recovery.RecoveryUnavailable, match=r"torch >= 2\.15"):
        recovery.setup()


@pytest.mark.parametrize(("message", "is_comm"), [
    ("[../unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete", True),
    ("[../pair.cc:561] Connection closed by peer [127.0.0.1]:45793. This is typically", True),
    ("[../pair.cc:545] Read error [127.0.0.1]:22437: Connection reset by peer.", True),
    ("Application timeout caused pair closure", True),
    ("my data loader timed out", False),
    ("CUDA out of memory", False),
])
def test_only_failed_collectives_start_a_recovery(message: str, is_comm: bool) -> None:
    assert recovery._is_comm_failure(RuntimeError(message)) is is_comm
    assert recovery._is_comm_failure(ValueError(message)) is False


def _record_proposals(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    proposed: list[list[int]] = []

    def propose(ranks: list[int], reason: str) -> bool:
        proposed.append(list(ranks))
        return True

    monkeypatch.setattr(recovery, "propose_exclusion", propose)
    return proposed


def _straggler(*ranks: int) -> dict[str, Any]:
    return {"kind": "straggler", "actions": [
        {"rank": r, "action": "replace_gpu_or_host", "because": "straggler"} for r in ranks]}


def test_a_straggler_named_in_consecutive_windows_is_proposed_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    proposed = _record_proposals(monkeypatch)
    hook = recovery.exclude_stragglers(windows=3)
    # rank 3 in three windows in a row; rank 1 in two, then not: its streak ends
    for doc in (_straggler(3, 1), _straggler(3, 1), {"kind": "hang", "actions": []},
                _straggler(3), _straggler(3), _straggler(3)):
        hook(doc)
    assert proposed == [[3]]


@pytest.mark.parametrize("doc", [
    _straggler(), {"kind": "straggler", "actions": [{"rank": True, "action":
                                                      "replace_gpu_or_host"}]},
    {"kind": "straggler", "actions": [{"rank": 2, "action": "inspect"}]},
    {"kind": "straggler", "actions": "all"}, "not a dict",
])
def test_a_straggler_report_without_a_rank_to_replace_proposes_nothing(
        monkeypatch: pytest.MonkeyPatch, doc: Any) -> None:
    proposed = _record_proposals(monkeypatch)
    hook = recovery.exclude_stragglers(windows=1)
    hook(doc)
    assert proposed == []


# ---------------------------------------------------------------- the Recovery you hold

class _Store:
    """The c10d store calls recovery makes (check/get/set/add/compare_set), in a dict."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def check(self, keys: list[str]) -> bool:
        return all(k in self.kv for k in keys)

    def get(self, key: str) -> bytes:
        return self.kv[key]

    def set(self, key: str, value: str | bytes) -> None:
        self.kv[key] = value.encode() if isinstance(value, str) else value

    def add(self, key: str, n: int) -> int:
        value = int(self.kv.get(key, b"0")) + n
        self.kv[key] = str(value).encode()
        return value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        # c10d's TCPStore: a missing key with expected "" is set; the value is returned
        if key not in self.kv and expected == "":
            self.kv[key] = desired.encode()
        return self.kv.get(key, expected.encode())


class _Recorder:
    """A JobRecorder that notes what recovery asked of it, in order."""

    def __init__(self, verdict: Any) -> None:
        self.verdict = verdict
        self.calls: list[str] = []

    def __call__(self, timeout_s: float, detail: str) -> Any:
        self.calls.append("verdict")
        return self.verdict

    def settle_s(self, detail: str) -> float:
        self.calls.append("settle")
        return 0.01

    def note_reconfigure(self, group: Any, **kwargs: Any) -> None:
        self.calls.append("note")

    def next_incident(self) -> None:
        self.calls.append("next")


def _held(source: Any = None, recorder: Any = None, me: int = 1) -> recovery.Recovery:
    st = recovery.State(me=me, members=[0, 1, 2, 3], uuid=1, store=_Store(),
                        options=recovery.Options(verdict_timeout_s=2.0), restart="0",
                        known={0, 1, 2, 3}, source=source, recorder=recorder)
    return recovery.Recovery(st)


LOST_PEER = "[../pair.cc:545] Read error [127.0.0.1]:22437: Connection reset by peer."


def _fail_a_step(rec: recovery.Recovery) -> None:
    with rec.guard():
        raise RuntimeError(LOST_PEER)


@pytest.mark.parametrize(("verdict", "error", "reason"), [
    (_verdict((2, "fix_code")), recovery.RecoveryRefused, "fix_code"),
    (_verdict(*((r, "replace_gpu_or_host") for r in range(4))), recovery.RecoveryRefused,
     "every member"),
    (_verdict((2, "inspect")), recovery.RecoveryRefused, "names no rank"),
    (_verdict((9, "replace_gpu_or_host")), recovery.RecoveryError, "not a member"),
    (None, recovery.RecoveryFailed, "no verdict"),
    ("not a verdict", recovery.RecoveryFailed, "no verdict"),
])
def test_a_held_recovery_asks_its_own_source_and_refuses_what_cannot_be_right(
        verdict: Any, error: type[Exception], reason: str) -> None:
    asked: list[tuple[float, str]] = []

    def source(timeout_s: float, detail: str) -> Any:
        asked.append((timeout_s, detail))
        return verdict

    rec = _held(source)
    with pytest.raises(error, match=reason) as info:
        _fail_a_step(rec)
    assert type(info.value) is error
    assert len(asked) == 1 and 0 < asked[0][0] <= 2.0
    assert asked[0][1].startswith("recovery: RuntimeError: ") and "reset by peer" in asked[0][1]
    gave_up = json.loads(rec.state.store.kv["gave_up"])  # frforensics-run fails the job on it
    assert (gave_up["rank"], gave_up["kind"]) == (1, error.__name__)
    assert rec.members == [0, 1, 2, 3] and rec.history == []


def test_a_verdict_source_that_raises_is_no_verdict_never_a_guess() -> None:
    def source(timeout_s: float, detail: str) -> Any:
        raise OSError("the dump directory went away")

    with pytest.raises(recovery.RecoveryFailed, match="no verdict"):
        _fail_a_step(_held(source))


def test_the_recorder_as_source_settles_first_and_is_not_rearmed_on_a_refusal() -> None:
    job = _Recorder(_verdict((2, "fix_code")))
    with pytest.raises(recovery.RecoveryRefused, match="fix_code"):
        _fail_a_step(_held(job, job))
    assert job.calls == ["settle", "verdict"]


def test_an_explicit_source_beside_the_recorder_gets_no_settle() -> None:
    job = _Recorder(_verdict((3, "replace_gpu_or_host")))
    with pytest.raises(recovery.RecoveryRefused):
        _fail_a_step(_held(lambda t, d: _verdict((0, "fix_code")), job))
    assert job.calls == []


def test_a_held_recovery_passes_other_errors_through_and_good_steps_untouched() -> None:
    asked: list[str] = []
    rec = _held(lambda t, d: asked.append(d))
    with pytest.raises(ValueError, match="my bug"), rec.guard():
        raise ValueError("my bug")
    with rec.guard() as g:
        pass
    assert not g.reconfigured and (g.rank, g.world_size) == (1, 4) and asked == []
    assert (rec.me, rec.rank, rec.world_size, rec.uuid) == (1, 1, 4, 1)


def test_a_closed_recovery_guards_nothing_and_the_module_needs_setup(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recovery, "_current", None)
    with pytest.raises(recovery.RecoveryError, match=r"setup\(\) was not called"):
        recovery.guard()
    with pytest.raises(recovery.RecoveryError, match=r"setup\(\) was not called"):
        recovery.state()
    rec = _held(lambda t, d: None)
    monkeypatch.setattr(recovery, "_current", rec)
    assert recovery.state() is rec.state
    rec.close()
    rec.close()  # idempotent
    assert rec.closed and recovery._current is None
    with pytest.raises(recovery.RecoveryError, match="closed"):
        rec.guard()
    with pytest.raises(recovery.RecoveryError, match="closed"):
        rec.new_group([0, 1])


def test_the_module_functions_act_on_the_recovery_setup_made(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []
    rec = _held(lambda t, d: asked.append(d))
    monkeypatch.setattr(recovery, "_current", rec)
    with pytest.raises(recovery.RecoveryFailed, match="no verdict"), recovery.guard():
        raise RuntimeError(LOST_PEER)
    assert len(asked) == 1
    # a proposal lands in this Recovery's store, for the next membership (uuid 2)
    assert rec.propose_exclusion([3], "40 % slower") is True
    assert recovery.propose_exclusion([2], "another") is False  # the first one wins
    plan = json.loads(rec.state.store.kv["2/plan"])
    assert plan["culprit_ranks"] == [3]
    # a Recovery acts on its own state, never on the module's current one
    other = _held(lambda t, d: None)
    assert other.propose_exclusion([1], "its own store") is True
    assert json.loads(other.state.store.kv["2/plan"])["culprit_ranks"] == [1]
    assert json.loads(rec.state.store.kv["2/plan"])["culprit_ranks"] == [3]
    other.close()
    with pytest.raises(recovery.RecoveryError, match="closed"):
        other.propose_exclusion([1], "closed")


def test_the_recorders_side_says_nothing_while_the_recorder_is_off() -> None:
    import frforensics.recorder as recorder

    recorder.disable()
    job: recovery.JobRecorder = recorder.RecorderVerdicts()
    assert job(0.0, LOST_PEER) is None
    assert job.settle_s(LOST_PEER) == 0.0
    job.note_reconfigure(object(), uuid=2, old_members=[0, 1], members=[0], reason="x")
    job.next_incident()


@pytest.mark.parametrize(("stale_s", "poll_s", "settle"), [
    (None, 0.2, 2.2),    # stale limit max(3 * poll, 2 s) + one poll
    (4.0, 0.5, 4.5),
    (30.0, 1.0, 10.0),   # never more than 10 s
])
def test_the_recorders_settle_after_a_lost_peer_is_its_stale_limit_and_one_poll(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any, stale_s: float | None,
        poll_s: float, settle: float) -> None:
    import types

    import frforensics.recorder as recorder
    from frforensics.recorder._config import RecorderConfig

    config = RecorderConfig.build(tmp_path, heartbeat_stale_s=stale_s,
                                  store_poll_interval_s=poll_s)
    sess = types.SimpleNamespace(rec=types.SimpleNamespace(active=True, config=config))
    monkeypatch.setattr(recorder, "session", lambda: sess)
    job = recorder.RecorderVerdicts()
    assert job.settle_s(LOST_PEER) == pytest.approx(settle)
    assert job.settle_s("my data loader timed out") == 0.0


def test_setup_takes_and_returns_only_what_the_module_exports() -> None:
    import inspect

    names = set(recovery.__all__)
    assert {"Options", "State", "Recovery", "VerdictSource", "JobRecorder", "Guard",
            "RecoveryError", "RecoveryRefused", "RecoveryFailed",
            "RecoveryUnavailable"} <= names
    assert all(hasattr(recovery, n) for n in names)
    assert not hasattr(recovery, "_reset_for_tests")
    sig = inspect.signature(recovery.setup)
    assert sig.return_annotation == "Recovery"
    assert set(sig.parameters) == {"spares", "options", "source", "recorder",
                                   "state_dict", "load_state_dict", "reset_step"}


@pytest.mark.parametrize(("field", "value", "why"), [
    ("subgroups", [[0, "1"]], "subgroups is not a list of lists of member ids"),
    ("subgroups", [[0, 1]], "subgroups has 1 entries, this process registered 2"),
    ("meshes", [{"device_type": "cpu", "shape": [2], "names": None, "dims": [[0, 9]]}],
     "a mesh is not {device_type, shape, names, dims} over the subgroups"),
    ("meshes", "cpu", "meshes is not a list"),
    ("senders", {"4": ["1"]}, "senders is not a map of member id to member ids"),
])
def test_a_malformed_decision_layout_is_named_before_anything_acts_on_it(
        field: str, value: Any, why: str) -> None:
    from frforensics.recovery import _mesh

    good = {"subgroups": [[0, 1], [2, 4]], "senders": {"4": [1]},
            "meshes": [{"device_type": "cpu", "shape": [2], "names": ["x"], "dims": [[0, 1]]}]}
    assert _mesh.malformed(good, 2) is None and _mesh.malformed({}, 0) is None
    assert _mesh.malformed({**good, field: value}, 2) == why


def test_a_standby_counted_in_before_its_entry_is_written_is_still_admitted() -> None:
    # The standby's two store calls (count itself in, then write its entry) with a
    # loaded host between them: the leader sees the count first. CI lost a standby
    # that way (one look at the entry); the leader now waits for it, bounded.
    import threading

    from frforensics.recovery import _reform

    st = _held().state
    st.store.add("standbys", 1)
    st.store.add("2/nspare", 1)
    entry = json.dumps({"id": 4, "handle": "h4"})
    late = threading.Timer(0.3, st.store.set, ("2/spare#1", entry))
    late.start()
    try:
        got = _reform._admit_spares(st, 2, 1, time.monotonic() + 10)
    finally:
        late.cancel()
    assert got == [(4, "h4")]
    assert 4 in st.known


def test_a_standby_that_counted_in_and_died_costs_a_bounded_wait(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from frforensics.recovery import _reform

    monkeypatch.setattr(_reform, "SPARE_WAIT_S", 0.2)
    monkeypatch.setattr(_reform, "SPARE_ENTRY_GRACE_S", 0.3)
    st = _held().state
    st.store.add("standbys", 1)
    st.store.add("2/nspare", 1)
    t0 = time.monotonic()
    assert _reform._admit_spares(st, 2, 1, time.monotonic() + 10) == []
    assert time.monotonic() - t0 < 2.0
    assert "no standby answered" in capsys.readouterr().err


def test_a_proposal_names_only_current_members() -> None:
    # a live report from before a re-form may name a rank already excluded
    rec = _held()
    rec.state.members = [0, 1, 2]
    assert rec.propose_exclusion([3], "stale report") is False
    assert "2/plan" not in rec.state.store.kv
    assert rec.propose_exclusion([3, 2], "one of them still here") is True
    assert json.loads(rec.state.store.kv["2/plan"])["culprit_ranks"] == [2]
