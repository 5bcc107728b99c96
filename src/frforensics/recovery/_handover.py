"""The survivors' training state handed to an admitted standby, tensors as tensors.

The training script hands recovery two callables, torchft's shape
(``torchft/manager.py``: ``Manager(load_state_dict=..., state_dict=...)``):
``state_dict()`` returns what makes its state -- model, optimizer, scheduler,
step, RNG -- as a nested dict of tensors and plain values, and
``load_state_dict(sd)`` takes it back. When a recovery admits a standby, one
survivor's ``state_dict()`` is flattened here into a typed :class:`Manifest`
(each tensor's path, dtype, shape and size; the plain leaves as JSON values)
and a list of tensors. The manifest goes through the job's c10d store (JSON:
never pickle between processes); the tensors' bytes go over the re-formed
group, packed into chunks of at most ``chunk_bytes`` (one chunk buffer on each
side: bounded memory beside the state itself), with a CRC-32 of the whole byte
stream checked by the receiver. The standby checks the manifest against its
own ``state_dict()`` first (paths, dtypes, shapes of every tensor), so a model
that differs is refused before a byte moves -- never a silent partial load.

Worked example (4 members, rank 3 lost, standby 4 admitted as group rank 3)::

    sender (member 0)              store                      standby (member 4)
    sd = state_dict()
    manifest, tensors = flatten(sd)
    set <uuid>/state/0/manifest ─▶ {"version": 812, "tree": ..., "tensors": [...]}
                                                              mine = flatten(its state_dict())
                                   <uuid>/state/0/ack/4 ◀──── check(manifest, mine) -> "ok"
    send chunk 0..k, crc ────────────── gloo send/recv ─────▶ recv, unpack, crc check
                                                              load_state_dict(unflatten(...))
    every member: all_reduce(MAX) [version, -version, sender_failed, receiver_failed]

Nothing here decides whom to exclude; :mod:`frforensics.recovery` drives it.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: torch dtypes a manifest may name (``str(torch.float32)`` without ``torch.``).
_DTYPES = (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
    "uint8", "bool", "complex64", "complex128", "uint16", "uint32", "uint64",
    "float8_e4m3fn", "float8_e5m2",
)
#: Bounds on a manifest read from the store (it is a peer's, but still input).
MAX_MANIFEST_BYTES = 256 << 20
MAX_TENSORS = 1_000_000
MAX_DEPTH = 64
MAX_DIMS = 16
#: Default size of one transfer chunk.
CHUNK_BYTES = 16 << 20

Path = tuple[str | int, ...]
StateDictFn = Callable[[], Mapping[str, Any]]
LoadStateDictFn = Callable[[dict[str, Any]], None]


class HandoverError(ValueError):
    """A state that cannot travel, or a manifest that is malformed or does not match."""


@dataclass(frozen=True, slots=True)
class TensorLeaf:
    """One tensor of the state: where it sits, what it is, how many bytes it has."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def describe(self) -> str:
        return f"{_path_text(self.path)} ({self.dtype}{list(self.shape)})"


@dataclass(frozen=True, slots=True)
class Manifest:
    """A state's typed description: the tree with tensors as indices, and the tensors.

    ``tree`` is the state with every container tagged (``{"d": [[key, value],
    ...]}`` for a dict, keys kept as str or int; ``{"l": [...]}`` a list;
    ``{"u": [...]}`` a tuple), every tensor replaced by ``{"t": index}`` (``{"s": index}``: a DTensor's
    local shard, wrapped again on the receiver's mesh by :func:`rewrap`) and
    every plain leaf by ``{"v": value}``. ``version`` is the number of
    successful guarded steps the state has seen (recovery's count, the same on
    every member).
    """

    version: int
    tree: Any
    tensors: tuple[TensorLeaf, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def dumps(self) -> str:
        return json.dumps({
            "schema": "frforensics.state-manifest/1", "version": self.version,
            "tree": self.tree,
            "tensors": [[list(t.path), t.dtype, list(t.shape), t.nbytes] for t in self.tensors],
        }, separators=(",", ":"))

    @classmethod
    def loads(cls, raw: bytes | str) -> Manifest:
        """The manifest in ``raw``, every field checked; :class:`HandoverError` names the bad one."""
        if len(raw) > MAX_MANIFEST_BYTES:
            raise HandoverError(f"state manifest is {len(raw)} bytes (limit {MAX_MANIFEST_BYTES})")
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise HandoverError(f"state manifest is not JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("schema") != "frforensics.state-manifest/1":
            raise HandoverError("state manifest has no schema frforensics.state-manifest/1")
        version = doc.get("version")
        if type(version) is not int or version < 0:
            raise HandoverError(f"state manifest version is {version!r} (want an int >= 0)")
        rows = doc.get("tensors")
        if not isinstance(rows, list) or len(rows) > MAX_TENSORS:
            raise HandoverError("state manifest tensors is not a list within bounds")
        tensors = tuple(_leaf(i, row) for i, row in enumerate(rows))
        _check_tree(doc.get("tree"), len(tensors), 0)
        return cls(version=version, tree=doc["tree"], tensors=tensors)


def _path_text(path: Path) -> str:
    return "/".join(str(p) for p in path) or "<root>"


def _leaf(i: int, row: Any) -> TensorLeaf:
    where = f"state manifest tensors[{i}]"
    if not isinstance(row, list) or len(row) != 4:
        raise HandoverError(f"{where} is not [path, dtype, shape, nbytes]")
    path, dtype, shape, nbytes = row
    if not isinstance(path, list) or len(path) > MAX_DEPTH or not all(
            type(p) in (str, int) for p in path):
        raise HandoverError(f"{where}.path is not a list of str/int keys")
    if dtype not in _DTYPES:
        raise HandoverError(f"{where}.dtype {dtype!r} is not a torch dtype this reader knows")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(
            type(d) is int and d >= 0 for d in shape):
        raise HandoverError(f"{where}.shape {shape!r} is not a list of ints >= 0")
    if type(nbytes) is not int or nbytes != math.prod(shape) * _itemsize(dtype):
        raise HandoverError(f"{where}.nbytes {nbytes!r} does not match {dtype}{shape}")
    return TensorLeaf(path=tuple(path), dtype=dtype, shape=tuple(shape), nbytes=nbytes)


def _itemsize(dtype: str) -> int:
    if dtype in ("bool", "int8", "uint8", "float8_e4m3fn", "float8_e5m2"):
        return 1
    if dtype in ("float16", "bfloat16", "int16", "uint16"):
        return 2
    if dtype in ("float32", "int32", "uint32"):
        return 4
    if dtype == "complex128":
        return 16
    return 8


def _check_tree(node: Any, n_tensors: int, depth: int) -> None:
    """The tree is made of the tags :class:`Manifest` documents and nothing else."""
    if depth > MAX_DEPTH:
        raise HandoverError(f"state manifest tree is deeper than {MAX_DEPTH}")
    if not isinstance(node, dict) or len(node) != 1:
        raise HandoverError("state manifest tree has a node that is not a one-key tag")
    (tag, body), = node.items()
    if tag in ("t", "s"):
        if type(body) is not int or not 0 <= body < n_tensors:
            raise HandoverError(f"state manifest tree names tensor {body!r} of {n_tensors}")
    elif tag == "v":
        if body is not None and type(body) not in (bool, int, float, str):
            raise HandoverError(f"state manifest tree has a plain leaf of type {type(body).__name__}")
    elif tag in ("l", "u"):
        if not isinstance(body, list):
            raise HandoverError(f"state manifest tree: {tag!r} holds no list")
        for child in body:
            _check_tree(child, n_tensors, depth + 1)
    elif tag == "d":
        if not isinstance(body, list):
            raise HandoverError("state manifest tree: 'd' holds no list of pairs")
        for pair in body:
            if not isinstance(pair, list) or len(pair) != 2 or type(pair[0]) not in (str, int):
                raise HandoverError("state manifest tree: a dict entry is not [str|int key, value]")
            _check_tree(pair[1], n_tensors, depth + 1)
    else:
        raise HandoverError(f"state manifest tree has an unknown tag {tag!r}")


def flatten(state: Mapping[str, Any], *, version: int) -> tuple[Manifest, list[Any]]:
    """``state`` as a :class:`Manifest` and its tensors (detached, in manifest order).

    Only tensors, dicts (str/int keys), lists, tuples and plain values (None,
    bool, int, float, str) travel; anything else raises :class:`HandoverError`
    naming its path, so a state that cannot be rebuilt never half-travels.
    """
    import torch

    tensors: list[Any] = []
    leaves: list[TensorLeaf] = []

    def walk(node: Any, path: Path) -> Any:
        if len(path) > MAX_DEPTH:
            raise HandoverError(f"state_dict() is deeper than {MAX_DEPTH} at {_path_text(path)}")
        if _is_dtensor(node):
            # FSDP2 / HSDP / tensor parallel: this rank's shard travels; the receiver
            # wraps it on its own mesh (``rewrap``), after ``_transfer`` chose a
            # sender holding the same shard (``shard_peers``).
            return {"s": walk(node.to_local(), path)["t"]}
        if isinstance(node, torch.Tensor):
            t = node.detach()
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in _DTYPES or t.is_sparse or t.layout != torch.strided:
                raise HandoverError(f"state_dict() tensor at {_path_text(path)} is {t.dtype} "
                                    f"{t.layout}: only dense tensors of plain dtypes travel")
            if type(node) is not torch.Tensor and not isinstance(node, torch.nn.Parameter):
                raise HandoverError(
                    f"state_dict() tensor at {_path_text(path)} is a {type(node).__name__} "
                    "(a tensor subclass): hand over plain tensors or DTensors "
                    "(torch.distributed.checkpoint.state_dict gives those)")
            leaves.append(TensorLeaf(path=path, dtype=dtype, shape=tuple(t.shape),
                                     nbytes=t.numel() * t.element_size()))
            tensors.append(t)
            return {"t": len(tensors) - 1}
        if isinstance(node, Mapping):
            out = []
            for k, v in node.items():
                if type(k) not in (str, int):
                    raise HandoverError(f"state_dict() key {k!r} at {_path_text(path)} is a "
                                        f"{type(k).__name__}: keys must be str or int")
                out.append([k, walk(v, (*path, k))])
            return {"d": out}
        if isinstance(node, (list, tuple)):
            tag = "u" if isinstance(node, tuple) else "l"
            return {tag: [walk(v, (*path, i)) for i, v in enumerate(node)]}
        if node is None or type(node) in (bool, int, float, str):
            return {"v": node}
        raise HandoverError(f"state_dict() leaf at {_path_text(path)} is a {type(node).__name__}: "
                            "only tensors and plain values (None, bool, int, float, str) travel")

    tree = walk(state, ())
    if "d" not in tree:
        raise HandoverError("state_dict() must return a dict")
    return Manifest(version=version, tree=tree, tensors=tuple(leaves)), tensors


def _is_dtensor(node: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(node, DTensor)


def _dtensors(node: Any, path: Path = ()) -> list[tuple[Path, Any]]:
    if _is_dtensor(node):
        return [(path, node)]
    if isinstance(node, Mapping):
        return [x for k, v in node.items() for x in _dtensors(v, (*path, k))]
    if isinstance(node, (list, tuple)):
        return [x for i, v in enumerate(node) for x in _dtensors(v, (*path, i))]
    return []


def shard_peers(state: Mapping[str, Any], lost: list[int]) -> dict[int, list[int]] | str:
    """For each lost group rank, the group ranks holding the same shards; or why none can.

    A DTensor (FSDP2's parameters and optimizer state, tensor parallel) holds one
    shard per position on its mesh's sharded dimensions; the ranks that differ
    from a lost rank only on replicated dimensions hold its shard too (HSDP's
    replica peers), so a standby taking the lost rank's place receives the state
    from one of them. With no such rank left the shard is gone: training on would
    train a model with a hole, so recovery refuses -- one line, the first lost
    shard. ``{}``: nothing in ``state`` is sharded (every member holds the same
    state; any survivor can send). The peers are the intersection over every
    mesh the state's DTensors live on, lost ranks left out.
    """
    peers: dict[int, set[int]] = {}
    gone = set(lost)
    seen: set[tuple[int, tuple[str, ...]]] = set()
    for _, t in _dtensors(state):
        mesh, placements = t.device_mesh, tuple(t.placements)
        sig = (id(mesh), tuple(str(p) for p in placements))
        if sig in seen:
            continue
        seen.add(sig)
        grid = mesh.mesh
        sharded = [d for d, p in enumerate(placements) if p.is_shard()]
        for r in sorted(gone):
            at = (grid == r).nonzero()
            if not len(at):
                continue
            if not sharded:
                same = [int(x) for x in grid.reshape(-1).tolist()]
            else:
                coords = at[0].tolist()
                sel = grid
                for d in sorted(sharded, reverse=True):  # keep only the replicated dims
                    sel = sel.select(d, coords[d])
                same = [int(x) for x in sel.reshape(-1).tolist()]
            mine = {x for x in same if x not in gone}
            peers[r] = mine if r not in peers else peers[r] & mine
            if not peers[r]:
                return f"rank {r}'s shard has no replica: restore from a checkpoint"
    return {r: sorted(p) for r, p in peers.items()}


def mesh_group_names(state: Mapping[str, Any]) -> set[str]:
    """The process groups (names) of every mesh dimension the state's DTensors use."""
    names: set[str] = set()
    for _, t in _dtensors(state):
        mesh = t.device_mesh
        for d in range(mesh.ndim):
            names.add(str(mesh.get_group(d).group_name))
    return names


def rewrap(received: Mapping[str, Any], manifest: Manifest, like: Mapping[str, Any]) -> dict[str, Any]:
    """``received`` with each shard (tag ``s``) wrapped as a DTensor on ``like``'s mesh.

    ``like`` is the receiver's own state: every shard the sender sent must be a
    DTensor there (same path), and every DTensor there a shard in the manifest;
    else :class:`HandoverError` (a DDP standby cannot take an FSDP2 state).
    """
    from torch.distributed.tensor import DTensor

    why = sharding_mismatch(manifest, like)
    if why:
        raise HandoverError(why)
    own = dict(_dtensors(like))

    def wrap(node: Any, path: Path) -> Any:
        if path in own:
            t = own[path]
            return DTensor.from_local(node, t.device_mesh, t.placements, run_check=False,
                                      shape=t.shape, stride=t.stride())
        if isinstance(node, dict):
            return {k: wrap(v, (*path, k)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            out = [wrap(v, (*path, i)) for i, v in enumerate(node)]
            return tuple(out) if isinstance(node, tuple) else out
        return node

    result = wrap(dict(received), ())
    assert isinstance(result, dict)
    return result


def sharding_mismatch(manifest: Manifest, like: Mapping[str, Any]) -> str | None:
    """Why the sender's shards (tag ``s``) are not where ``like`` has DTensors, or None."""
    shards = _tagged(manifest.tree, "s", ())
    wrong = sorted(set(shards) ^ {p for p, _ in _dtensors(like)}, key=str)
    if not wrong:
        return None
    return (f"{_path_text(wrong[0])} is a DTensor on one side only (the survivor's and this "
            "standby's models are sharded differently)")


def _tagged(node: Any, tag: str, path: Path) -> list[Path]:
    (t, body), = node.items()
    if t == tag:
        return [path]
    if t in ("l", "u"):
        return [p for i, c in enumerate(body) for p in _tagged(c, tag, (*path, i))]
    if t == "d":
        return [p for k, v in body for p in _tagged(v, tag, (*path, k))]
    return []


def unflatten(manifest: Manifest, tensors: list[Any]) -> dict[str, Any]:
    """The nested state ``manifest`` describes, with ``tensors`` in its places."""

    def build(node: dict[str, Any]) -> Any:
        (tag, body), = node.items()
        if tag in ("t", "s"):
            return tensors[body]
        if tag == "v":
            return body
        if tag == "l":
            return [build(c) for c in body]
        if tag == "u":
            return tuple(build(c) for c in body)
        return {k: build(v) for k, v in body}

    out = build(manifest.tree)
    assert isinstance(out, dict)  # checked by flatten / Manifest.loads
    return out


def mismatch(got: Manifest, mine: Manifest, *, limit: int = 4) -> str | None:
    """Why the sender's ``got`` does not fit the standby's own ``mine``, or None.

    Every tensor path of either side must be on both, with the same dtype and
    shape. Plain values may differ (a learning rate, a step count): they are
    the state being handed over.
    """
    theirs = {t.path: t for t in got.tensors}
    ours = {t.path: t for t in mine.tensors}
    problems = [f"{ours[p].describe()} is not in the survivor's state" for p in ours
                if p not in theirs]
    problems += [f"the survivor's {theirs[p].describe()} is not in this standby's state"
                 for p in theirs if p not in ours]
    problems += [f"{_path_text(p)}: the survivor's is {theirs[p].dtype}{list(theirs[p].shape)}, "
                 f"this standby's {ours[p].dtype}{list(ours[p].shape)}"
                 for p in theirs if p in ours and (theirs[p].dtype, theirs[p].shape)
                 != (ours[p].dtype, ours[p].shape)]
    if not problems:
        return None
    more = f" (and {len(problems) - limit} more)" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


def _byte_views(tensors: list[Any]) -> list[Any]:
    """Each tensor's bytes as a flat contiguous uint8 tensor (a view where possible)."""
    import torch

    return [t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else
            torch.empty(0, dtype=torch.uint8) for t in tensors]


def _chunks(sizes: list[int], chunk_bytes: int) -> list[list[tuple[int, int, int]]]:
    """The transfer's chunks: each a list of (tensor index, start, length) pieces."""
    out: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    room = chunk_bytes
    for i, size in enumerate(sizes):
        start = 0
        while start < size:
            n = min(room, size - start)
            current.append((i, start, n))
            start += n
            room -= n
            if room == 0:
                out.append(current)
                current, room = [], chunk_bytes
    if current:
        out.append(current)
    return out


def send(tensors: list[Any], *, dst: int, chunk_bytes: int = CHUNK_BYTES,
         group: Any = None) -> int:
    """Send ``tensors``' bytes to group rank ``dst`` in chunks; returns the bytes sent."""
    import torch
    import torch.distributed as dist

    views = _byte_views(tensors)
    crc = 0
    buf = torch.empty(min(chunk_bytes, max(1, sum(v.numel() for v in views))), dtype=torch.uint8)
    sent = 0
    for pieces in _chunks([v.numel() for v in views], chunk_bytes):
        at = 0
        for i, start, n in pieces:
            buf[at:at + n].copy_(views[i][start:start + n])
            at += n
        part = buf[:at]
        crc = zlib.crc32(part.numpy().data, crc)
        dist.send(part, dst, group=group)
        sent += at
    dist.send(torch.tensor([crc], dtype=torch.int64), dst, group=group)
    return sent


def receive(manifest: Manifest, *, src: int, chunk_bytes: int = CHUNK_BYTES,
            group: Any = None) -> list[Any]:
    """The manifest's tensors, received from group rank ``src`` (see :func:`send`)."""
    import torch
    import torch.distributed as dist

    tensors = [torch.empty(t.shape, dtype=getattr(torch, t.dtype)) for t in manifest.tensors]
    views = _byte_views(tensors)
    crc = 0
    buf = torch.empty(min(chunk_bytes, max(1, manifest.nbytes)), dtype=torch.uint8)
    for pieces in _chunks([t.nbytes for t in manifest.tensors], chunk_bytes):
        size = sum(n for _, _, n in pieces)
        part = buf[:size]
        dist.recv(part, src, group=group)
        crc = zlib.crc32(part.numpy().data, crc)
        at = 0
        for i, start, n in pieces:
            views[i][start:start + n].copy_(part[at:at + n])
            at += n
    got = torch.zeros(1, dtype=torch.int64)
    dist.recv(got, src, group=group)
    if int(got.item()) != crc:
        raise HandoverError(f"the state's bytes arrived damaged (CRC-32 {crc:#010x}, "
                            f"the sender's {int(got.item()):#010x})")
    return tensors
