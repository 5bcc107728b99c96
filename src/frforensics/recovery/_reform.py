"""A recovery: the agreed verdict, the exclusion, the re-formed groups, the hand-over."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from frforensics.recovery import _handover, _mesh
from frforensics.recovery._policy import exclusion_from
from frforensics.recovery._state import (
    Guard,
    HandoverLost,
    RecoveryError,
    RecoveryFailed,
    RecoveryRefused,
    State,
    _is_comm_failure,
    _ns,
    _say,
    _torch,
    log,
)
from frforensics.recovery._store import _add, _get, _handle, _reconfigure, _set
from frforensics.recovery._transfer import _hand_over
from frforensics.recovery._verdicts import (
    _agree_on_verdict,
    _later_verdicts,
    _wait_verdict,
    parse_agreed,
)
from frforensics.verdict import EXIT_EXCLUDED, Verdict


def _planned_check(st: State, g: Guard) -> None:
    """At a step boundary: carry out a proposed exclusion, agreed by one all_reduce."""
    every = st.options.plan_check_every
    if every <= 0 or st.me not in st.members:
        return
    st.steps += 1
    if st.steps % every:
        return
    torch, dist, _ = _torch()
    key = f"{_ns(st.uuid + 1, st.attempt)}/plan"
    raw: bytes | None = None
    with contextlib.suppress(Exception):
        if st.store.check([key]):
            raw = bytes(st.store.get(key))
    seen = torch.tensor([0.0 if raw is None or raw in st.refused_plans else 1.0])
    # Every member reads the key at a different moment: the MAX tells all of them
    # that one saw it, and then it is there for everyone to read.
    try:
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    except Exception as exc:  # a peer lost after the step's last collective: a failure
        if not _is_comm_failure(exc):
            raise
        recover(st, g, cause=exc)
        return
    if seen.item() <= 0:
        return
    if raw is None:
        raw = _get(st.store, key, time.monotonic() + st.options.arrival_timeout_s)
    if raw is None:
        raise RecoveryFailed(f"a planned exclusion was seen but {key} is not readable")
    try:
        planned = json.loads(raw)
    except ValueError as exc:
        raise RecoveryError(f"malformed planned exclusion ({key}): {exc}") from None
    try:
        recover(st, g, planned=planned)
    except RecoveryRefused as exc:
        st.refused_plans.add(raw)
        _say(st, f"planned exclusion refused, training on: {exc.reason}")


def recover(st: State, g: Guard, *, cause: BaseException | None = None,
            planned: dict[str, Any] | None = None) -> None:
    """Exclude the verdict's culprits and re-form the groups (called by the guard).

    ``planned``: the verdict of a planned exclusion (no step failed; a refusal
    leaves the job running, so it does not tell frforensics-run to fail the job).
    A member lost during the state hand-over (:class:`HandoverLost`) is one more
    failure: the members recover again from it, as bounded as any recovery
    (``max_exclusions`` counts every re-form), and the standbys still without state
    receive it from the next survivor.
    """
    while True:
        try:
            _recover_once(st, g, cause=cause, planned=planned)
            return
        except HandoverLost as exc:
            _say(st, f"{exc.reason}; recovering again")
            cause, planned = exc, None
            g.phases.clear()


def _recover_once(st: State, g: Guard, *, cause: BaseException | None,
                  planned: dict[str, Any] | None) -> None:
    t0 = time.monotonic()
    opts = st.options
    with st.lock:
        st.recovering = True
    try:
        detail = f"recovery: {type(cause).__name__}: {str(cause)[:200]}" if cause else "recovery"
        if planned is None:
            _say(st, f"step failed ({str(cause).splitlines()[0][:160] if cause else 'requested'})"
                     f"; waiting for the verdict (<= {opts.verdict_timeout_s:g} s)")
        else:
            _say(st, f"planned exclusion at step boundary {st.steps}")
        deadline = t0 + opts.verdict_timeout_s
        local = planned if planned is not None else _wait_verdict(st, deadline, detail)
        agreed = _agree_on_verdict(st, _ns(st.uuid + 1, st.attempt), local, deadline)
        if agreed is None:
            raise RecoveryFailed(
                f"no verdict within {opts.verdict_timeout_s:g} s (is frforensics.recorder "
                "enabled with the verdict at hang time?); not guessing whom to exclude") from cause
        g.verdict = agreed
        verdict = parse_agreed(agreed)  # typed from here to the exclusion and the re-form
        g.phases["verdict_s"] = time.monotonic() - t0
        _say(st, f"verdict: {' '.join(verdict.headline.split())}")
        excluded = exclusion_from(
            verdict, st.members, known=sorted(st.known), store_host=st.store_host,
            max_exclusions=opts.max_exclusions,
            excluded_so_far=sum(len(h["excluded"]) for h in st.history),
            min_world_size=opts.min_world_size)
        sharded = _refuse_lost_shards(st, excluded, verdict)
        t_verdict = time.monotonic()
        _reform(st, g, verdict, excluded, sharded)
        g.phases["reform_s"] = time.monotonic() - t_verdict - g.phases.get("handover_s", 0.0)
    except HandoverLost:
        raise  # the members recover again (``recover``)
    except RecoveryError as exc:
        if isinstance(exc, RecoveryRefused):
            st.attempt += 1  # everyone saw this refusal: the next attempt's keys are fresh
        _say(st, f"recovery gave up: {exc.reason}")
        if planned is not None and isinstance(exc, RecoveryRefused):
            raise exc from cause  # a refused plan: the job trains on
        # frforensics-run's agent fails the job (as torchrun would) on this key.
        with contextlib.suppress(Exception):
            st.store.set("gave_up", json.dumps({
                "rank": st.me, "kind": type(exc).__name__, "reason": exc.reason[:500]}))
        raise exc from cause
    finally:
        st.recovering = False
    g.seconds = time.monotonic() - t0
    _say(st, f"reconfigured: now rank {g.rank} of {g.world_size} (excluded {g.excluded}, "
             f"uuid {st.uuid}, {g.seconds:.2f} s after "
             f"{'the step failed' if planned is None else 'the planned check'}: "
             + ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in g.phases.items()) + ")")


def _reform(st: State, g: Guard, verdict: Verdict, excluded: list[int],
            sharded: bool) -> None:
    opts = st.options
    uuid = st.uuid + 1
    survivors = [m for m in st.members if m not in excluded]
    ns = _ns(uuid, st.attempt)
    if st.me not in survivors:
        # the leader may still refuse (a shard with no standby to take it): this rank
        # exits only once the decision is not a refusal (or none comes in its bound)
        raw = _get(st.store, f"{ns}/decision", time.monotonic() + 2 * opts.arrival_timeout_s)
        decision: Any = None
        with contextlib.suppress(ValueError):
            decision = json.loads(raw) if raw is not None else None
        if isinstance(decision, dict) and "refused" in decision:
            raise RecoveryRefused(str(decision["refused"]), [verdict])
        _exit_excluded(st, verdict)
    # 1. arrive: a fresh handle per survivor, per attempt (a standby admitted by a
    # re-form whose hand-over lost a peer says first that it holds no state).
    if st.stateless:
        _set(st.store, f"{ns}/nostate/{st.me}", "1")
    _set(st.store, f"{ns}/h/{st.me}", _handle())
    _set(st.store, f"{uuid}/open", str(st.attempt))  # standbys watch this
    leader = survivors[0]
    deadline = time.monotonic() + opts.arrival_timeout_s
    if st.me == leader:
        handles: dict[int, str] = {}
        for m in survivors:
            raw = _get(st.store, f"{ns}/h/{m}", deadline)
            if raw is None:
                _set(st.store, f"{ns}/decision", json.dumps(
                    {"failed": f"rank {m} did not arrive within {opts.arrival_timeout_s:g} s"}))
                raise RecoveryFailed(
                    f"rank {m} (a survivor) did not arrive at the recovery within "
                    f"{opts.arrival_timeout_s:g} s", [verdict, *_later_verdicts(st)])
            handles[m] = raw.decode()
        admitted = _admit_spares(st, ns, len(excluded), deadline)
        handles.update(dict(admitted))
        stateless = [m for m in survivors if st.store.check([f"{ns}/nostate/{m}"])]
        decision = _decide(st, uuid, excluded, [m for m, _ in admitted], stateless, handles,
                           verdict, sharded)
        _set(st.store, f"{ns}/decision", json.dumps(decision))
        if "refused" in decision:
            raise RecoveryRefused(str(decision["refused"]), [verdict])
        members = decision["members"]
        _set(st.store, "current", json.dumps({"uuid": uuid, "members": members}))
    else:
        raw = _get(st.store, f"{ns}/decision",
                   deadline + opts.arrival_timeout_s)  # the leader's own bound, then ours
        if raw is None:
            raise RecoveryFailed(f"no membership decision from rank {leader} (the leader) "
                                 f"within {2 * opts.arrival_timeout_s:g} s", [verdict])
        decision = json.loads(raw)
        if "failed" in decision:
            raise RecoveryFailed(str(decision["failed"]), [verdict, *_later_verdicts(st)])
        if "refused" in decision:
            raise RecoveryRefused(str(decision["refused"]), [verdict])
    _apply(st, g, decision, verdict)


def _decide(st: State, uuid: int, excluded: list[int], admitted: list[int],
            stateless: list[int], handles: dict[int, str], verdict: Verdict,
            sharded: bool) -> dict[str, Any]:
    """The leader's membership decision (what every member and admitted standby applies).

    Each admitted standby takes an excluded rank's group rank (its position), so the
    global ranks a device mesh, a data partition or a DTensor was laid out with
    stay the same; the excluded ranks no standby replaces are dropped (the group
    shrinks). Subgroups follow: a replaced member's place goes to its standby.
    """
    place = dict(zip([m for m in st.members if m in excluded], admitted, strict=False))
    members = [place.get(m, m) for m in st.members if m not in excluded or m in place]
    receivers = list(admitted) + stateless
    senders: dict[str, list[int]] = {}
    if sharded:
        lost = [m for m in st.members if m in excluded and m not in place]
        if lost:
            return {"refused": f"not excluding anyone: rank {lost[0]}'s shard has a replica, "
                               "but no standby is free to take its place (frforensics-run "
                               "--spares N): restore from a checkpoint"}
        # who holds each receiver's shards (group ranks are kept: old positions)
        gone = [i for i, m in enumerate(st.members) if m in excluded or m in stateless]
        peers = _handover.shard_peers(st.state_dict(), gone) if st.state_dict else {}
        if isinstance(peers, str):
            return {"refused": f"not excluding anyone: {peers}"}
        for i, m in enumerate(members):
            if m in receivers and i in peers:
                senders[str(m)] = [st.members[q] for q in peers[i]]
    subgroups = [[place.get(m, m) for m in sub.members if m not in excluded or m in place]
                 for sub in st.subgroups]
    return {"uuid": uuid, "members": members, "handles": [handles[m] for m in members],
            "old_members": st.members, "excluded": excluded,
            # who receives the state: the admitted standbys, and earlier ones
            # whose hand-over lost its sender; who may send to each (sharded state)
            "receivers": receivers, "senders": senders,
            "subgroups": subgroups, **_mesh.describe(st),
            "reason": verdict.headline, "incident": verdict.incident,
            # the leader's word for everyone: a survivor hands its state over
            "state": st.state_dict is not None}


def _apply(st: State, g: Guard, decision: dict[str, Any], verdict: Verdict) -> None:
    """Reconfigure the default group (and subgroups) as ``decision`` says."""
    opts = st.options
    _, dist, c10d = _torch()
    torch, _, _ = _torch()
    uuid = int(decision["uuid"])
    members = [int(m) for m in decision["members"]]
    excluded = [int(m) for m in decision["excluded"]]
    why = _mesh.malformed(decision, len(st.subgroups))
    if why:
        raise RecoveryFailed(f"malformed membership decision (uuid {uuid}): {why}", [verdict])
    try:
        _reconfigure(uuid, list(decision["handles"]), None, opts.reconfigure_timeout_s)
    except RecoveryFailed as exc:
        raise RecoveryFailed(exc.reason, [verdict]) from None
    except Exception as exc:
        raise RecoveryFailed(f"reconfigure (uuid {uuid}) failed: {exc}", [verdict]) from exc
    old = st.members
    st.members, st.uuid, st.attempt = members, uuid, 0
    st.known.update(members)
    st.steps = 0
    _tell_recorder(st, c10d._get_default_group(), uuid, old, members,
                   str(decision.get("reason", ""))[:300])
    _mesh.adopt(st, decision)  # an admitted standby: the members' subgroups and meshes
    new = decision.get("subgroups") or [[m for m in sub.members if m not in excluded]
                                        for sub in st.subgroups]
    try:
        for group, before, keep in _mesh.reform_subgroups(st, [list(x) for x in new], uuid):
            _tell_recorder(st, group, uuid, before, keep, f"excluded {excluded}")
    except RecoveryFailed as exc:
        raise RecoveryFailed(exc.reason, [verdict]) from None
    # Prove the new group works: every member adds its member id + 1.
    t = torch.tensor([float(st.me + 1)])
    work = dist.all_reduce(t, async_op=True)
    try:
        ok = work.wait(timeout=timedelta(seconds=opts.check_timeout_s))
    except Exception as exc:
        raise RecoveryFailed(f"the re-formed group failed its check all_reduce: {exc}",
                             [verdict]) from exc
    expected = float(sum(m + 1 for m in members))
    if not ok or t.item() != expected:
        raise RecoveryFailed(f"the re-formed group's check all_reduce gave {t.item()}, "
                             f"expected {expected}", [verdict])
    # the re-form is done (a hand-over that loses a peer below recovers again, and
    # ``max_exclusions`` counts this one)
    record = {"uuid": uuid, "old_members": old, "members": members, "excluded": excluded,
              "reason": decision.get("reason", ""), "time_ns": time.time_ns()}
    st.history.append(record)
    _note_recorder(st, record)
    t_handover = time.monotonic()
    if decision.get("state"):
        try:
            _hand_over(st, decision, verdict)
        except RecoveryError:
            raise
        except Exception as exc:  # a peer lost mid-transfer, the agreement's op failed
            raise HandoverLost(f"the state hand-over failed: {type(exc).__name__}: "
                               f"{str(exc)[:300]}", [verdict]) from exc
    g.phases["handover_s"] = time.monotonic() - t_handover
    pg = c10d._get_default_group()
    g.reconfigured, g.rank, g.world_size, g.excluded = True, pg.rank(), pg.size(), excluded


def _refuse_lost_shards(st: State, excluded: list[int], verdict: Verdict) -> bool:
    """:class:`RecoveryRefused` when excluding ``excluded`` loses a shard of the state.

    True when the state is sharded across the excluded ranks' places (a DTensor
    on a mesh they are in): then only a standby with the shard from a replica
    peer may take each place (``_decide``), and the mesh's groups must be ones
    recovery re-forms (made by ``Recovery.device_mesh``).
    """
    if st.state_dict is None:
        return False
    try:
        state = st.state_dict()
        lost = [i for i, m in enumerate(st.members) if m in excluded]
        peers = _handover.shard_peers(state, lost)
        names = _handover.mesh_group_names(state) if peers else set()
    except Exception as exc:  # the hand-over's own attempt will report a failing state_dict
        log.debug("frforensics.recovery: lost-shard check skipped: %s", exc)
        return False
    if isinstance(peers, str):
        raise RecoveryRefused(f"not excluding anyone: {peers}", [verdict])
    known = {str(sub.group.group_name) for sub in st.subgroups if sub.group is not None}
    if names - known:
        raise RecoveryRefused(
            "not excluding anyone: the state's device mesh was not made with "
            "Recovery.device_mesh, so its groups cannot be re-formed around a standby: "
            "restore from a checkpoint", [verdict])
    return bool(peers)


#: How long the leader waits for a live standby to answer a recovery's ``open``. It
#: was 2 s: a CI run on a loaded 2-core machine (four ranks, a standby, the agent and
#: other jobs) had its standby answer later, and the survivors went on without it.
#: Only a standby counted alive but not answering costs this much (one that died
#: without leaving, a stopped host).
SPARE_WAIT_S = 5.0
#: How long the leader waits for the entry of a standby that has counted itself in.
SPARE_ENTRY_GRACE_S = 2.0


def _admit_spares(st: State, ns: str, wanted: int,
                  deadline: float) -> list[tuple[int, str]]:
    """Up to ``wanted`` standbys that answered this attempt's ``open`` (id, handle).

    A standby registers as ``<ns>/spare#<n>`` (``n`` from the store's counter);
    the leader waits up to ``SPARE_WAIT_S`` for them, and only while some standby is
    alive (the ``standbys`` counter), so a job without standbys loses no time here.
    A standby counts itself in, then writes its entry: two store calls, and a loaded
    host may run others between them. The count is read again while waiting (a
    standby counted in that never writes does not hide one that does), and an entry
    counted in but not yet written is waited for up to ``SPARE_ENTRY_GRACE_S`` past
    the window: a single look lost a standby that had answered (CI, 7 December).
    """
    out: list[tuple[int, str]] = []
    if wanted <= 0 or _add(st.store, "standbys", 0) <= 0:
        return out
    end = min(deadline, time.monotonic() + SPARE_WAIT_S)
    read: set[int] = set()  # entries read (taken or not)
    pending_since: float | None = None  # first seen counted in without an entry
    n = 0
    while True:
        n = _add(st.store, f"{ns}/nspare", 0)
        now = time.monotonic()
        for i in range(1, n + 1):
            if i in read or len(out) >= wanted:
                continue
            raw = _get(st.store, f"{ns}/spare#{i}", now)  # one look a round
            if raw is None:
                continue
            read.add(i)
            with contextlib.suppress(ValueError, TypeError, KeyError):
                entry = json.loads(raw)
                spare, handle = int(entry["id"]), str(entry["handle"])
                if spare not in st.members and spare not in [m for m, _ in out]:
                    out.append((spare, handle))
        if len(out) >= wanted:
            break
        if n > len(read) and pending_since is None:
            pending_since = now
        limit = end if n == len(read) or pending_since is None else \
            min(deadline, max(end, pending_since + SPARE_ENTRY_GRACE_S))
        if now >= limit:
            break
        time.sleep(0.02)
    if not out:
        _say(st, f"no standby answered within {SPARE_WAIT_S:g} s ({n} counted in, "
                 f"{_add(st.store, 'standbys', 0)} counted alive): going on without one")
    for spare, _ in out:
        if spare in st.spares:
            st.spares.remove(spare)
        st.known.add(spare)
    return out


def _tell_recorder(st: State, group: Any, uuid: int, old: Sequence[int],
                   new: Sequence[int], reason: str) -> None:
    """The recorder gives a re-formed group a new identity (recorder/_reconfig.py)."""
    if st.recorder is not None:
        with contextlib.suppress(Exception):
            st.recorder.note_reconfigure(group, uuid=uuid, old_members=list(old),
                                         members=list(new), reason=reason)


def _note_recorder(st: State, record: dict[str, Any]) -> None:
    """Tell the recorder that the incident is over (the next hang is a new one)."""
    # Rank and world size stay the member ids of init_process_group: the
    # recorder's dump names and group members are in those terms
    # (recorder/_reconfig.py); the group rank is only the backend's.
    if st.recorder is not None:
        with contextlib.suppress(Exception):
            st.recorder.next_incident()


def _exit_excluded(st: State, verdict: Verdict) -> None:
    _say(st, f"this rank was excluded from the job by the verdict: "
             f"{' '.join(verdict.headline.split())}; "
             f"exiting with code {EXIT_EXCLUDED}")
    if st.options.exit_excluded:
        sys.stderr.flush()
        os._exit(EXIT_EXCLUDED)
    raise RecoveryRefused("this rank was excluded from the job", [verdict])


