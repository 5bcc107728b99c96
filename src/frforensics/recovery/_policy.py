"""Whom to exclude: the verdict's actions against the job's rules, and planned exclusions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from frforensics.recovery._state import (
    RecoveryError,
    RecoveryFailed,
    RecoveryRefused,
    State,
    _ns,
    log,
)
from frforensics.verdict import Action, Verdict, VerdictError, headline


def _action_rank(i: int, action: Action, known: set[int]) -> int:
    """The action's rank (an int, checked by ``Action.from_json``) naming a member this
    job had."""
    if action.rank not in known:
        raise RecoveryError(f"malformed verdict: actions[{i}].rank {action.rank} is not a member "
                            f"of this job (members ever: {sorted(known)[:16]})")
    return action.rank


def _typed(verdict: Any) -> Verdict:
    """``verdict`` typed, or :class:`RecoveryError` naming the bad field
    (``Verdict.from_json``'s message: ``actions[0].rank is 'two' (want an int member id)``)."""
    if isinstance(verdict, Verdict):
        return verdict
    try:
        return Verdict.from_json(verdict, require_schema=False)
    except VerdictError as exc:
        raise RecoveryError(str(exc), [verdict] if isinstance(verdict, dict) else []) from None


def _actions(verdict: Any, parsed: Verdict, known: set[int]) -> list[tuple[int, str]]:
    """(rank, action) of every action of ``parsed`` (``verdict`` typed), each naming a
    member this job had."""
    try:
        return [(_action_rank(i, a, known), a.action) for i, a in enumerate(parsed.actions)]
    except RecoveryError as exc:
        raise RecoveryError(exc.reason, [verdict]) from None


def exclusion_from(verdict: Verdict | dict[str, Any], members: Sequence[int], *,
                   known: Sequence[int] | None = None, store_host: int | None = None,
                   max_exclusions: int | None = None, excluded_so_far: int = 0,
                   min_world_size: int = 1) -> list[int]:
    """The member ids to exclude, or :class:`RecoveryRefused` with the verdict.

    ``fix_code`` anywhere refuses (excluding a rank will not fix a desync); the
    ranks whose action is ``replace_gpu_or_host`` are excluded; a verdict that
    names none (``inspect`` only, or an analysis error) refuses too. So does one
    that would exclude every member, the store host's rank (``store_host``: the
    store would go with it), more ranks than ``max_exclusions`` allows over the
    job, or leave fewer than ``min_world_size`` survivors. A malformed action (a
    rank that is not an int — ``None``, ``"two"``, ``1.9``, ``True`` — or not a
    member this job ever had, in ``known``) raises :class:`RecoveryError` naming
    the field. Ranks of ``known`` that are no longer members are ignored. The
    errors carry ``verdict`` as given (its JSON object when it is a Verdict).
    """
    ever = set(known) if known is not None else set(members)
    ever |= set(members)
    parsed = _typed(verdict)
    actions = _actions(verdict, parsed, ever)
    fix = sorted({r for r, a in actions if a == "fix_code"})
    if fix:
        raise RecoveryRefused(
            f"not excluding anyone: the verdict says fix_code for rank(s) {fix} "
            "(a code bug: excluding ranks will not help)", [verdict])
    out = sorted({r for r, a in actions if a == "replace_gpu_or_host" and r in members})
    if not out:
        raise RecoveryRefused(
            f"not excluding anyone: the verdict (status {parsed.status}) names no rank to replace "
            f"(actions: {actions})", [verdict])
    if len(out) >= len(members):
        raise RecoveryRefused(
            f"not excluding anyone: the verdict would exclude every member ({out}); "
            "nobody would be left to train", [verdict])
    if store_host is not None and store_host in out:
        raise RecoveryRefused(
            f"not excluding anyone: rank {store_host} hosts the c10d store and the job has "
            "no external store (run under frforensics-run or torchrun, whose agent hosts it)",
            [verdict])
    if max_exclusions is not None and excluded_so_far + len(out) > max_exclusions:
        raise RecoveryRefused(
            f"not excluding anyone: excluding {out} would make {excluded_so_far + len(out)} "
            f"exclusions in this job, more than max_exclusions={max_exclusions}", [verdict])
    if len(members) - len(out) < min_world_size:
        raise RecoveryRefused(
            f"not excluding anyone: excluding {out} would leave {len(members) - len(out)} "
            f"rank(s), fewer than min_world_size={min_world_size}", [verdict])
    return out


def propose(st: State, ranks: Sequence[int], reason: str) -> bool:
    """Propose excluding ``ranks`` (member ids) at ``st``'s next planned check.

    The proposal (a ``planned`` verdict) goes to the store, the first one per
    membership wins; True when this one is stored.
    """
    named = sorted({int(r) for r in ranks})
    gone = [r for r in named if r not in st.members]
    if gone:
        # a live report from before a re-form can still name a rank already excluded:
        # proposing it would only have the next planned check refuse it
        log.warning("frforensics.recovery: not proposing rank(s) %s: not members (%s)",
                    gone, st.members)
        named = [r for r in named if r in st.members]
        if not named:
            return False
    raw = Verdict(status="planned", culprit_ranks=tuple(named),
                  actions=tuple(Action(rank=r, action="replace_gpu_or_host", because="planned")
                                for r in named),
                  headline=headline("planned", reason)).dumps()
    try:
        got = st.store.compare_set(f"{_ns(st.uuid + 1, st.attempt)}/plan", "", raw)
    except Exception as exc:
        raise RecoveryFailed(f"the c10d store is unreachable ({exc})") from exc
    return bytes(got).decode() == raw


def straggler_hook(windows: int, propose_exclusion: Callable[[list[int], str], Any],
                   ) -> Callable[[dict[str, Any]], None]:
    """An ``on_verdict`` hook: a rank the live straggler finding names with
    ``replace_gpu_or_host`` in ``windows`` consecutive reports is handed to
    ``propose_exclusion`` (``recovery.exclude_stragglers``)."""
    if windows < 1:
        raise ValueError("windows must be >= 1")
    streak: dict[int, int] = {}

    def hook(doc: dict[str, Any]) -> None:
        if not isinstance(doc, dict) or doc.get("kind") != "straggler":
            return  # a hang's verdict: the guard handles those
        # Only the actions are read (a hook is handed whatever its caller built); each
        # is checked as in any verdict (Action.from_json), a malformed one names nobody.
        raw = doc.get("actions")
        named = set()
        for i, entry in enumerate(raw if isinstance(raw, list) else []):
            try:
                a = Action.from_json(entry, f"actions[{i}]")
            except VerdictError as exc:
                log.warning("frforensics.recovery: straggler document: %s", exc)
                continue
            if a.action == "replace_gpu_or_host":
                named.add(a.rank)
        for r in list(streak):
            if r not in named:
                del streak[r]
        for r in named:
            streak[r] = streak.get(r, 0) + 1
        due = sorted(r for r, n in streak.items() if n >= windows)
        if due:
            propose_exclusion(due, f"straggler in {windows} consecutive window(s): "
                                   f"rank(s) {due}")
            for r in due:
                del streak[r]

    return hook


