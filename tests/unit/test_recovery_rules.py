"""The recovery guard's rules that need no job: whom to exclude, when to refuse, old torch."""

from __future__ import annotations

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
