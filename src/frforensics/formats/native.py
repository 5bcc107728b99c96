"""PyTorch's native flight-recorder dumps (pickle and JSON), read safely.

PyTorch's ProcessGroupNCCL / ProcessGroupGloo write one dump per rank: a pickle of
plain builtins (dicts, lists, tuples, str, int, float, bool, None), or the same
document as JSON. Schema 2.x (see docs/native-format.md)::

    {"version": "2.10",
     "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}},
     "pg_status": {"0": {"last_enqueued_collective": 7, ...}},
     "entries": [{"record_id": 0, "pg_id": 0, "process_group": ("0", "default_pg"),
                  "collective_seq_id": 1, "p2p_seq_id": 0, "op_id": 1,
                  "profiling_name": "nccl:all_reduce", "time_created_ns": ...,
                  "input_sizes": [[4, 4]], "input_dtypes": ["Float"], ...,
                  "state": "scheduled", "time_discovered_started_ns": None,
                  "time_discovered_completed_ns": None, "retired": False,
                  "timeout_ms": 600000, "is_p2p": False,
                  "frames": [{"name": "step", "filename": "train.py", "line": 12}],
                  "thread_id": ..., "thread_name": ...}, ...]}

Safety: pickles are decoded by :class:`NoGlobalsUnpickler`, which refuses every
global (so no ``REDUCE``/``BUILD`` can reach code) and every persistent id. Older
2.x versions lack some keys (``p2p_seq_id``, ``is_p2p``, ``thread_*``,
``timeout_ms``...): absent keys become "unknown", never a crash.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import re
from collections.abc import Mapping
from typing import Any, Final, NoReturn

import numpy as np

from frforensics.errors import CorruptDumpError, NotADumpError, UnsafeDumpError
from frforensics.model import (
    NO_INDEX,
    EntryTable,
    Frame,
    GroupInfo,
    OpState,
    RankTrace,
    SourceFormat,
)

__all__ = ["NoGlobalsUnpickler", "decode_json", "decode_pickle", "looks_like_pickle", "to_trace"]

#: Largest native document we accept (bytes); beyond this a file is not a dump.
MAX_NATIVE_BYTES: Final = 2 << 30

_STATES: Final = {
    "scheduled": OpState.SCHEDULED,
    "started": OpState.STARTED,
    "completed": OpState.COMPLETED,
}

# PyTorch spells the same collective several ways across backends and versions.
_OP_ALIASES: Final = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce_coalesced",
    "allgather": "all_gather",
    "_allgather_base": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "allgather_coalesced": "all_gather_coalesced",
    "reducescatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all_single",
    "all_to_all_base": "all_to_all_single",
    "recvanysource": "recv_any_source",
}

_P2P_NAME: Final = re.compile(r"^(send|recv)\s+(\d+)\s*(->|<-)\s*(\d+)")


def looks_like_pickle(head: bytes) -> bool:
    """True when ``head`` starts like a pickle of protocol 2 or newer."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


class NoGlobalsUnpickler(pickle.Unpickler):
    """An unpickler that builds only builtin containers and scalars.

    ``find_class`` refuses everything, so ``GLOBAL``/``STACK_GLOBAL``/``EXT*``
    opcodes — the only routes from a pickle to code — raise before anything runs.
    """

    def find_class(self, module: str, name: str) -> NoReturn:
        raise UnsafeDumpError(
            f"pickle references {module}.{name}: native dumps hold only builtins, "
            "so this file is refused unread (it could run code)"
        )

    def persistent_load(self, pid: Any) -> NoReturn:
        raise UnsafeDumpError("pickle uses persistent ids: refused unread")


def decode_pickle(data: bytes, *, source: str = "<bytes>") -> Any:
    """Decode a native pickle dump with :class:`NoGlobalsUnpickler`."""
    try:
        return NoGlobalsUnpickler(io.BytesIO(data)).load()
    except UnsafeDumpError as exc:
        raise UnsafeDumpError(f"{source}: {exc}") from None
    except RecursionError:
        raise CorruptDumpError(f"{source}: pickle nests too deeply") from None
    except Exception as exc:  # the unpickler raises many types on bad bytes
        raise CorruptDumpError(
            f"{source}: truncated or corrupt pickle ({type(exc).__name__}: {exc})"
        ) from None


def decode_json(data: bytes, *, source: str = "<bytes>") -> Any:
    """Decode a native JSON dump."""
    try:
        return json.loads(data)
    except RecursionError:
        raise CorruptDumpError(f"{source}: JSON nests too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptDumpError(f"{source}: truncated or invalid JSON ({exc})") from None


def _parse_ranks(raw: Any) -> tuple[int, ...] | None:
    """``pg_config`` ranks: a string like '[0, 1]' (or a list). Empty = unknown."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return None
    if not isinstance(raw, list | tuple) or not raw:
        return None
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in raw):
        return None
    return tuple(raw)


def _as_str(value: Any) -> str:
    return value if isinstance(value, str) else ("" if value is None else str(value))


def normalize_op(profiling_name: str) -> tuple[str, int, int]:
    """``'nccl:send 0->1'`` -> ``('send', self_group_rank, peer_group_rank)``.

    Collectives return ``(name, -1, -1)`` with backend prefix and aliases removed.
    """
    name = profiling_name.split(":", 1)[1] if ":" in profiling_name else profiling_name
    name = name.strip()
    match = _P2P_NAME.match(name)
    if match:
        kind, a, _arrow, b = match.groups()
        return kind, int(a), int(b)
    base = name.split(" ", 1)[0]
    return _OP_ALIASES.get(base, base), NO_INDEX, NO_INDEX


class _Table:
    """String interning for one trace."""

    __slots__ = ("index", "strings")

    def __init__(self) -> None:
        self.strings: list[str] = []
        self.index: dict[str, int] = {}

    def add(self, s: str) -> int:
        i = self.index.get(s)
        if i is None:
            i = self.index[s] = len(self.strings)
            self.strings.append(s)
        return i


def _int_list(values: list[Any], what: str, source: str) -> np.ndarray:
    try:
        return np.array([0 if v is None else v for v in values], dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise CorruptDumpError(f"{source}: entry field {what!r} holds a non-integer") from None


def _bad(source: str, what: str) -> NoReturn:
    raise CorruptDumpError(f"{source}: {what}")


def to_trace(
    doc: Any,
    *,
    source: str,
    fmt: SourceFormat,
    rank: int | None,
    rank_from: str = "filename",
) -> RankTrace:
    """Normalize a decoded native document into a :class:`RankTrace`.

    ``rank`` comes from the file name (native dumps carry none); a top-level
    ``rank`` key, where a writer added one, wins.
    """
    if not isinstance(doc, Mapping):
        raise NotADumpError(f"{source}: not a flight-recorder dump (top level is {type(doc).__name__})")
    if "entries" not in doc and "version" not in doc:
        raise NotADumpError(f"{source}: not a flight-recorder dump (no 'version' or 'entries')")
    version = _as_str(doc.get("version"))
    entries = doc.get("entries") or []
    if not isinstance(entries, list) or not all(isinstance(e, Mapping) for e in entries):
        _bad(source, "'entries' is not a list of records")
    if isinstance(doc.get("rank"), int) and not isinstance(doc.get("rank"), bool):
        rank, rank_from = int(doc["rank"]), "content"

    # ---- groups: pg_config first (membership), then every group entries name
    pg_config = doc.get("pg_config") or {}
    if not isinstance(pg_config, Mapping):
        pg_config = {}
    config: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for key, cfg in pg_config.items():
        if not isinstance(cfg, Mapping):
            continue
        name = _as_str(cfg.get("name")) or _as_str(key)
        if not name:
            continue  # gloo writes {'': {name: '', desc: '', ranks: '[]'}}
        config[name] = (_as_str(cfg.get("desc")), _parse_ranks(cfg.get("ranks")))

    group_index: dict[str, int] = {}
    groups: list[GroupInfo] = []

    def group_of(name: str, desc: str) -> int:
        i = group_index.get(name)
        if i is None:
            cfg_desc, ranks = config.get(name, ("", None))
            i = group_index[name] = len(groups)
            groups.append(GroupInfo(name=name, desc=desc or cfg_desc, ranks=ranks))
        return i

    n = len(entries)
    strings = _Table()
    pg = np.empty(n, dtype=np.int32)
    op = np.empty(n, dtype=np.int32)
    is_p2p = np.zeros(n, dtype=np.uint8)
    peer = np.full(n, NO_INDEX, dtype=np.int32)
    in_shapes = np.empty(n, dtype=np.int32)
    out_shapes = np.empty(n, dtype=np.int32)
    in_dtypes = np.empty(n, dtype=np.int32)
    out_dtypes = np.empty(n, dtype=np.int32)
    in_numel = np.empty(n, dtype=np.int64)
    out_numel = np.empty(n, dtype=np.int64)
    state = np.empty(n, dtype=np.uint8)
    thread = np.empty(n, dtype=np.int32)
    stack = np.full(n, NO_INDEX, dtype=np.int32)

    shape_cache: dict[str, tuple[int, int]] = {}
    op_cache: dict[str, tuple[int, int, int, bool]] = {}
    stack_index: dict[tuple[Any, ...], int] = {}
    stacks: list[tuple[Frame, ...]] = []
    p2p_local_peer: dict[int, int] = {}

    def shape_of(sizes: Any) -> tuple[int, int]:
        key = str(sizes)
        hit = shape_cache.get(key)
        if hit is None:
            numel = 0
            if isinstance(sizes, list | tuple):
                for shape in sizes:
                    if isinstance(shape, list | tuple) and all(
                        isinstance(d, int) and not isinstance(d, bool) for d in shape
                    ):
                        numel += math.prod(shape)
            hit = shape_cache[key] = (strings.add(key), numel)
        return hit

    try:
        for i, e in enumerate(entries):
            pgt = e.get("process_group")
            if isinstance(pgt, list | tuple) and len(pgt) >= 1:
                pg_name, pg_desc = _as_str(pgt[0]), _as_str(pgt[1]) if len(pgt) > 1 else ""
            else:
                pg_name, pg_desc = _as_str(e.get("pg_id")), ""
            pg[i] = group_of(pg_name, pg_desc)

            pname = _as_str(e.get("profiling_name"))
            cached = op_cache.get(pname)
            if cached is None:
                name, _self_rank, peer_local = normalize_op(pname)
                cached = op_cache[pname] = (
                    strings.add(name), peer_local, 0, name in ("send", "recv", "recv_any_source")
                )
            op[i] = cached[0]
            p2p = bool(e.get("is_p2p", cached[3]))
            is_p2p[i] = p2p
            if cached[1] >= 0:
                p2p_local_peer[i] = cached[1]

            in_shapes[i], in_numel[i] = shape_of(e.get("input_sizes"))
            out_shapes[i], out_numel[i] = shape_of(e.get("output_sizes"))
            in_dtypes[i] = strings.add(",".join(map(_as_str, e.get("input_dtypes") or ())))
            out_dtypes[i] = strings.add(",".join(map(_as_str, e.get("output_dtypes") or ())))

            st = _STATES.get(_as_str(e.get("state")), OpState.SCHEDULED)
            if e.get("retired") is True or e.get("time_discovered_completed_ns"):
                st = OpState.COMPLETED
            state[i] = st
            thread[i] = strings.add(_as_str(e.get("thread_name")))

            frames = e.get("frames")
            if frames:
                key = tuple(map(tuple, map(Mapping.values, frames)))
                s = stack_index.get(key)
                if s is None:
                    s = stack_index[key] = len(stacks)
                    stacks.append(
                        tuple(
                            Frame(
                                _as_str(f.get("filename")),
                                int(f.get("line") or 0),
                                _as_str(f.get("name")),
                            )
                            for f in frames
                        )
                    )
                stack[i] = s
    except (TypeError, ValueError, AttributeError) as exc:
        _bad(source, f"malformed entry ({type(exc).__name__}: {exc})")

    def col(key: str, *fallbacks: str) -> np.ndarray:
        values = []
        for e in entries:
            v = e.get(key)
            for fb in fallbacks:
                if v is not None:
                    break
                v = e.get(fb)
            values.append(v)
        return _int_list(values, key, source)

    seq = col("collective_seq_id", "seq_id")
    p2p_seq = col("p2p_seq_id")
    t_enqueue = col("time_created_ns")
    t_start = col("time_discovered_started_ns")
    t_complete = col("time_discovered_completed_ns")
    timeout_ms = col("timeout_ms")
    record_id = col("record_id")

    group_tuple = tuple(groups)
    for i, local in p2p_local_peer.items():
        g = group_tuple[pg[i]]
        if g.ranks is not None:
            peer[i] = g.group_rank_to_global(local)
        elif _is_default_group(g):
            peer[i] = local  # the default group's ranks are the global ranks

    table = EntryTable.from_columns(
        n,
        {
            "record_id": record_id,
            "pg": pg,
            "seq": seq,
            "p2p_seq": p2p_seq,
            "op": op,
            "is_p2p": is_p2p,
            "peer": peer,
            "in_numel": in_numel,
            "out_numel": out_numel,
            "in_shapes": in_shapes,
            "out_shapes": out_shapes,
            "in_dtypes": in_dtypes,
            "out_dtypes": out_dtypes,
            "state": state,
            "t_enqueue_ns": t_enqueue,
            "t_start_ns": t_start,
            "t_complete_ns": t_complete,
            "timeout_ms": timeout_ms,
            "thread": thread,
            "stack": stack,
        },
    )
    return RankTrace(
        rank=rank,
        rank_from=rank_from if rank is not None else "unknown",
        source=source,
        format=fmt,
        version=version,
        groups=group_tuple,
        strings=tuple(strings.strings),
        stacks=tuple(stacks),
        entries=table,
    )


def _is_default_group(group: GroupInfo) -> bool:
    return group.desc == "default_pg" or group.name == "0"
