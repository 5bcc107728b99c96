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
    assert recovery.exclusion_from(v, [0, 1, 2, 3]) == [2]


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
