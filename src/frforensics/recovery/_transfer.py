"""The survivors' training state to the admitted standbys (the bytes: ``_handover``)."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

from frforensics.recovery import _handover
from frforensics.recovery._state import RecoveryError, RecoveryFailed, State, _say, _torch
from frforensics.recovery._store import _get, _set
from frforensics.verdict import Verdict


def _hand_over(st: State, decision: dict[str, Any], verdict: Verdict) -> None:
    """The survivors' state to every receiver (the admitted standbys), then one agreement each.

    Receivers are taken in classes by who may send to them: any survivor when
    the state is the same on every member (DDP), the lost rank's replica peers
    when it is sharded (HSDP: the leader's ``decision["senders"]``, from
    ``_handover.shard_peers``). In each class the first sender sends; when its
    ``state_dict()`` cannot be flattened (it raised, or holds what cannot travel)
    the next one tries. The agreement -- ``all_reduce(MAX)`` of ``[version,
    -version, sender failed, receiver failed]`` -- runs on every member after each
    attempt, so all of them learn the outcome at once: a standby that could not
    take the state (its own model differs, its ``load_state_dict`` raised, the
    bytes arrived damaged) fails the recovery on every member; survivors whose
    versions differ (one finished the step the others failed) fail it too. Never
    a standby training on partial state.
    """
    members = [int(m) for m in decision["members"]]
    old = {int(m) for m in decision["old_members"]}
    # receivers: the admitted standbys and any earlier one still without state (its
    # hand-over lost the sender); senders: the members that hold the state
    receivers = [int(m) for m in decision.get("receivers", [m for m in members if m not in old])]
    survivors = [m for m in members if m in old and m not in receivers]
    chosen = decision.get("senders") or {}
    classes: dict[tuple[int, ...], list[int]] = {}
    for r in receivers:
        classes.setdefault(tuple(int(m) for m in chosen.get(str(r), survivors)), []).append(r)
    if not classes:
        classes[tuple(survivors)] = []
    for n, (senders, rcv) in enumerate(sorted(classes.items())):
        key = f"{int(decision['uuid'])}/state/" + (f"{n}." if n else "")
        _hand_over_class(st, key, list(senders), rcv, members, verdict)


def _hand_over_class(st: State, prefix: str, senders: list[int], receivers: list[int],
                     members: list[int], verdict: Verdict) -> None:
    torch, dist, _ = _torch()
    deadline = time.monotonic() + st.options.arrival_timeout_s
    for attempt, sender in enumerate(senders):
        key = f"{prefix}{attempt}"
        failed = [0, 0]  # sender, receiver
        if st.me == sender:
            failed[0] = _send_state(st, key, receivers, members, deadline)
        elif st.me in receivers:
            st.stateless = True  # until this hand-over completes
            failed[1] = _receive_state(st, key, members.index(sender), deadline)
            _set(st.store, f"{key}/loaded/{st.me}", str(failed[1]))
        if st.me not in receivers:
            # The transfer may outlast the group's op timeout (the hang budget): the
            # members not receiving wait for the standbys' word in the store, so the
            # agreement's all_reduce starts when everyone is there.
            end = time.monotonic() + st.options.handover_timeout_s
            for m in receivers:
                if _get(st.store, f"{key}/loaded/{m}", end) is None:
                    _say(st, f"rank {m} did not report its state loaded within "
                             f"{st.options.handover_timeout_s:g} s")
                    break
        flags = torch.tensor([st.version, -st.version, *failed], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        high, low, sender_failed, receiver_failed = (int(x) for x in flags.tolist())
        if receiver_failed:
            why = _reasons(st, f"{key}/why/", receivers)
            raise RecoveryFailed(f"a standby could not take the survivors' state: {why}",
                                 [verdict])
        if sender_failed:
            why = _reasons(st, f"{key}/why/", [sender])
            _say(st, f"rank {sender} could not hand over its state ({why}); the next survivor "
                     "tries")
            continue
        if high != -low:
            raise RecoveryFailed(f"the members hold different state versions (steps {-low} to "
                                 f"{high}): a survivor finished a step the others failed",
                                 [verdict])
        if receivers:
            _say(st, f"state version {high} handed over by rank {sender} to {receivers}")
        return
    raise RecoveryFailed(f"no survivor could hand over its state to {receivers} (each one's "
                         f"state_dict() failed, of {senders}; see the lines above)", [verdict])


def _send_state(st: State, key: str, admitted: list[int], members: list[int],
                deadline: float) -> int:
    """The sender's side: 1 when its own state could not be sent (the next one tries)."""
    assert st.state_dict is not None
    try:
        manifest, tensors = _handover.flatten(st.state_dict(), version=st.version)
    except Exception as exc:
        reason = f"its state_dict() failed: {type(exc).__name__}: {exc}"[:500]
        _set(st.store, f"{key}/manifest", json.dumps({"failed": reason}))
        _set(st.store, f"{key}/why/{st.me}", reason)
        return 1
    _set(st.store, f"{key}/manifest", manifest.dumps())
    t0 = time.monotonic()
    sent = 0
    for m in admitted:
        ack = _get(st.store, f"{key}/ack/{m}", deadline)
        if ack != b"ok":
            continue  # that standby refused (or never answered): it says so in the agreement
        sent += _handover.send(tensors, dst=members.index(m), chunk_bytes=st.options.state_chunk_bytes)
    if sent:
        dt = max(time.monotonic() - t0, 1e-9)
        _say(st, f"sent {len(tensors)} tensors ({sent / 1e6:.1f} MB) to {admitted} in "
                 f"{dt:.2f} s ({sent / 1e6 / dt:.0f} MB/s)")
    return 0


def _receive_state(st: State, key: str, src: int, deadline: float) -> int:
    """The standby's side: 0 when it loaded the state, 1 (and the reason stored) if not."""

    def refuse(reason: str) -> int:
        _say(st, f"cannot take the survivors' state: {reason}")
        with contextlib.suppress(RecoveryError):
            _set(st.store, f"{key}/why/{st.me}", f"rank {st.me}: {reason}"[:1000])
        return 1

    raw = _get(st.store, f"{key}/manifest", deadline)
    if raw is None:
        return refuse(f"no state manifest from the sender within "
                      f"{st.options.arrival_timeout_s:g} s")
    if raw.startswith(b'{"failed"'):
        return 0  # the sender says it failed: the agreement tells everyone, the next one tries
    ack = "ok"
    try:
        manifest = _handover.Manifest.loads(raw)
        if st.state_dict is None or st.load_state_dict is None:
            raise _handover.HandoverError("this standby registered no state_dict/load_state_dict "
                                          "(recovery.setup(state_dict=..., load_state_dict=...))")
        own = st.state_dict()
        mine, _ = _handover.flatten(own, version=0)
        wrong = _handover.mismatch(manifest, mine) or _handover.sharding_mismatch(manifest, own)
        if wrong:
            raise _handover.HandoverError(f"its state does not match this standby's "
                                          f"({wrong}); same model and optimizer on every "
                                          "process? (an optimizer's state exists only after "
                                          "its first step: torch.distributed.checkpoint's "
                                          "get_state_dict initialises it)")
    except Exception as exc:
        ack = f"refused: {exc}"
        _set(st.store, f"{key}/ack/{st.me}", ack[:1000])
        return refuse(str(exc))
    _set(st.store, f"{key}/ack/{st.me}", ack)
    try:
        tensors = _handover.receive(manifest, src=src, chunk_bytes=st.options.state_chunk_bytes)
        st.load_state_dict(_handover.rewrap(_handover.unflatten(manifest, tensors), manifest, own))
    except Exception as exc:
        return refuse(f"{type(exc).__name__}: {exc}")
    st.version = manifest.version
    st.stateless = False
    return 0


def _reasons(st: State, prefix: str, ranks: list[int]) -> str:
    """The reasons ``ranks`` stored under ``prefix`` (bounded wait), joined."""
    out = []
    end = time.monotonic() + 2.0
    for r in ranks:
        with contextlib.suppress(RecoveryError):
            raw = _get(st.store, f"{prefix}{r}", end)
            if raw is not None:
                out.append(raw.decode(errors="replace"))
    return "; ".join(out) or "no reason recorded"


