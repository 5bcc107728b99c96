"""Subgroups and device meshes re-formed around a standby (HSDP, TP x DP).

A survivor's subgroup (``Recovery.new_group``, or a mesh dimension's slice made by
``Recovery.device_mesh``) is reconfigured in place, like the default group
(``_reconfigure(uuid, handles, group=sub)``). A standby admitted in a lost rank's
place (the same group rank: ``_reform`` keeps positions) has no such group: it
makes a one-member group under the survivors' group name -- the reconfigure
rendezvous keys are the group's store prefix, ``<group name>/``, so the names must
agree (measured on torch 2.15: under another name both sides time out on
``.../reconfigure/<uuid>/...``) -- and reconfigures it with the survivors'
handles. Its ``DeviceMesh`` is then ``DeviceMesh.from_group`` over those groups,
laid out as the survivors' (global ranks = default-group ranks, unchanged).

``distributed_c10d._world.pg_group_ranks`` (global rank -> group rank, used by
``get_process_group_ranks``, DeviceMesh and FSDP2) is Python-side bookkeeping
that ``_reconfigure`` does not touch: it is set again here after every re-form.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta
from typing import Any

from frforensics.recovery._state import RecoveryError, RecoveryFailed, State, _Mesh, _Sub, _torch
from frforensics.recovery._store import _get, _handle, _reconfigure, _set


def make_mesh(st: State, device_type: str, shape: tuple[int, ...],
              names: tuple[str, ...] | None) -> Any:
    """A device mesh laid out as ``init_device_mesh``'s, its slices registered subgroups.

    Made from ``new_group`` per slice (every member calls it), not by
    ``init_device_mesh``: that makes its groups with the backend's default timeout
    (30 min for gloo) where ours take the default group's -- the hang budget -- so
    a rank blocked on a slice whose peer is recovering fails within it and joins
    the recovery (measured: with ``init_device_mesh``'s groups, HSDP rank 0, which
    shares no group with a lost rank 3, waited on rank 1 past every deadline).
    """
    torch, dist, c10d = _torch()
    timeout = group_timeout()
    grid = torch.arange(math.prod(shape), dtype=torch.int).reshape(shape)
    me = c10d._get_default_group().rank()
    dims: list[list[int]] = []
    for d in range(len(shape)):
        idx = []
        for ranks in grid.movedim(d, -1).reshape(-1, shape[d]).tolist():
            group = dist.new_group(ranks, timeout=timeout)
            st.subgroups.append(_Sub(group if me in ranks else None,
                                     [st.members[int(r)] for r in ranks]))
            idx.append(len(st.subgroups) - 1)
        dims.append(idx)
    spec = _Mesh(device_type, tuple(shape), names, dims)
    spec.mesh = _from_groups(st, spec)
    st.meshes.append(spec)
    return spec.mesh


def group_timeout() -> timedelta | None:
    """The default group's timeout (the job's hang budget), None if unreadable."""
    torch, _, c10d = _torch()
    try:
        backend = c10d._get_default_group()._get_backend(torch.device("cpu"))
        return timedelta(seconds=backend.options._timeout.total_seconds())
    except Exception:
        return None


def find_mesh(st: State, device_type: str, shape: tuple[int, ...],
              names: tuple[str, ...] | None) -> Any:
    """An admitted standby's mesh: the one the survivors made, over its re-formed groups."""
    for spec in st.meshes:
        if (spec.device_type, spec.shape, spec.names) != (device_type, tuple(shape), names):
            continue
        if spec.mesh is None:
            spec.mesh = _from_groups(st, spec)
        return spec.mesh
    raise RecoveryError(f"no device mesh {device_type} {tuple(shape)} {names} was made by the "
                        "members (Recovery.device_mesh with the same arguments on every process)")


def _from_groups(st: State, spec: _Mesh) -> Any:
    torch, _, _ = _torch()
    from torch.distributed.device_mesh import DeviceMesh

    pos = {m: i for i, m in enumerate(st.members)}
    grid = torch.empty(spec.shape, dtype=torch.int)
    groups = []
    for d, idx in enumerate(spec.dims):
        view = grid.movedim(d, -1).reshape(-1, spec.shape[d])
        mine = None
        for row, i in enumerate(idx):
            sub = st.subgroups[i]
            view[row] = torch.tensor([pos[m] for m in sub.members], dtype=torch.int)
            if st.me in sub.members:
                mine = sub.group
        if mine is None:
            raise RecoveryError(f"this process is in no slice of the mesh's dimension {d}")
        groups.append(mine)
    return DeviceMesh.from_group(groups, spec.device_type, mesh=grid,
                                 mesh_dim_names=spec.names or tuple(f"dim{d}" for d in
                                                                    range(len(spec.shape))))


def describe(st: State) -> dict[str, Any]:
    """What a standby needs to make the same subgroups and meshes (goes into the decision)."""
    return {"meshes": [{"device_type": m.device_type, "shape": list(m.shape),
                        "names": list(m.names) if m.names else None, "dims": m.dims}
                       for m in st.meshes]}


def malformed(decision: dict[str, Any], have: int) -> str | None:
    """Why the decision's subgroup, mesh and sender fields are unusable, or None.

    The decision is a peer's store value: every field this module and the
    hand-over read is checked before anything acts on it. ``have``: the
    subgroups this process registered (0 on a standby, which adopts them).
    """
    def ints(x: Any) -> bool:
        return isinstance(x, list) and len(x) <= 1 << 20 and all(type(i) is int for i in x)

    subs = decision.get("subgroups", [])
    if not isinstance(subs, list) or not all(ints(m) for m in subs):
        return "subgroups is not a list of lists of member ids"
    if have and len(subs) != have:
        return f"subgroups has {len(subs)} entries, this process registered {have}"
    meshes = decision.get("meshes", [])
    if not isinstance(meshes, list):
        return "meshes is not a list"
    for m in meshes:
        if not isinstance(m, dict) or not isinstance(m.get("device_type"), str) \
                or not ints(m.get("shape")) or not isinstance(m.get("dims"), list) \
                or not all(ints(d) and all(0 <= i < len(subs) for i in d) for d in m["dims"]) \
                or not (m.get("names") is None or (isinstance(m["names"], list) and all(
                    isinstance(n, str) for n in m["names"]))):
            return "a mesh is not {device_type, shape, names, dims} over the subgroups"
    senders = decision.get("senders", {})
    if not isinstance(senders, dict) or not all(
            isinstance(k, str) and ints(v) for k, v in senders.items()):
        return "senders is not a map of member id to member ids"
    return None


def adopt(st: State, decision: dict[str, Any]) -> None:
    """On an admitted standby: the members' subgroup list and meshes (no groups yet)."""
    if st.subgroups or "subgroups" not in decision:
        return
    # empty memberships: ``reform_subgroups`` then joins those it is in, and
    # records the rest as they are now
    st.subgroups = [_Sub(None, []) for _ in decision["subgroups"]]
    st.meshes = [_Mesh(str(m["device_type"]), tuple(int(x) for x in m["shape"]),
                       tuple(m["names"]) if m["names"] else None,
                       [[int(i) for i in dim] for dim in m["dims"]])
                 for m in decision.get("meshes", [])]


def reform_subgroups(st: State, new: list[list[int]],
                     uuid: int) -> list[tuple[Any, list[int], list[int]]]:
    """Re-form every subgroup this process is in, as ``new`` says (member ids per subgroup).

    Returns (group, old members, new members) for each one this process re-formed
    whose membership changed.
    """
    _, _, c10d = _torch()
    opts = st.options
    done = []
    for i, (sub, want) in enumerate(zip(st.subgroups, new, strict=True)):
        before = sub.members
        sub.members = want
        if st.me not in want:
            continue
        # Every subgroup this process is in is re-formed, changed or not: a gloo op
        # that timed out closes its pairs for good ("Application timeout caused pair
        # closure"), and a member may have timed out on a slice with no lost rank.
        key = f"{uuid}/sub{i}/"
        if sub.group is None:  # an admitted standby: a group under the members' name
            sub.group = _solo_group(st, key, want, c10d)
        else:
            _set(st.store, key + "name", str(sub.group.group_name))
        _set(st.store, key + "h/" + str(st.me), _handle(sub.group))
        deadline = time.monotonic() + opts.arrival_timeout_s
        handles = []
        for m in want:
            raw = _get(st.store, key + "h/" + str(m), deadline)
            if raw is None:
                raise RecoveryFailed(f"subgroup {want}: rank {m} did not publish its "
                                     f"handle in {opts.arrival_timeout_s:g} s")
            handles.append(raw.decode())
        try:
            _reconfigure(uuid, handles, sub.group, opts.reconfigure_timeout_s)
        except Exception as exc:
            raise RecoveryFailed(f"subgroup {want}: reconfigure failed: {exc}") from exc
        if want != before:
            done.append((sub.group, before, want))
    fix_group_ranks(st)
    return done


def _solo_group(st: State, key: str, want: list[int], c10d: Any) -> Any:
    """A one-member group named as the survivors' subgroup (its store prefix must match)."""
    name = None
    survivors = [m for m in want if m != st.me]
    if survivors:
        deadline = time.monotonic() + st.options.arrival_timeout_s
        raw = _get(st.store, key + "name", deadline)
        if raw is None:
            raise RecoveryFailed(f"subgroup {want}: no member published the group's name in "
                                 f"{st.options.arrival_timeout_s:g} s")
        name = raw.decode()
    default = c10d._get_default_group()
    backend, store = c10d._world.pg_map[default]
    if name is None:  # every old member was lost: a fresh name
        name = f"frforensics-sub-{key.rstrip('/').replace('/', '-')}"
    pg, _ = c10d._new_process_group_helper(
        1, 0, [default.rank()], backend, store, group_name=name,
        timeout=group_timeout() or timedelta(seconds=st.options.reconfigure_timeout_s),
        enable_reconfigure=True)
    return pg


def fix_group_ranks(st: State) -> None:
    """``pg_group_ranks`` of the default group and of this process's subgroups, as re-formed."""
    _, _, c10d = _torch()
    pos = {m: i for i, m in enumerate(st.members)}
    world = c10d._world
    default = c10d._get_default_group()
    world.pg_group_ranks[default] = {i: i for i in range(len(st.members))}
    for sub in st.subgroups:
        if sub.group is not None and all(m in pos for m in sub.members):
            world.pg_group_ranks[sub.group] = {pos[m]: j for j, m in enumerate(sub.members)}
