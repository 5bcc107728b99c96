"""Rank layout of a simulated 3-D parallel job (TP × DP × PP), Megatron style.

Global rank ``r`` of a job with tensor-parallel size ``tp``, data-parallel size
``dp`` and pipeline size ``pp`` (``world_size = tp * dp * pp``)::

    tp_rank = r % tp                  # fastest: a TP group is tp consecutive ranks
    dp_rank = (r // tp) % dp
    pp_rank = r // (tp * dp)          # slowest: the pipeline stage

So with ``tp=2, dp=2, pp=2``: TP groups ``[0,1] [2,3] [4,5] [6,7]``, DP groups
``[0,2] [1,3] [4,6] [5,7]``, PP groups ``[0,4] [1,5] [2,6] [3,7]``; the default
group holds every rank. Groups of size 1 are not created.

Group names imitate what real jobs write: the default group is ``"0"``
(``default_pg``); every TP group shares **one** hashed name (as ``split_group`` /
DeviceMesh produce: same name, different members), while each DP and PP group has
its own hashed name (the SHA-1 of its ranks, as ``new_group(use_hashed_name)``).
With ``shared_tp_name=False`` (gloo jobs: ``split_group`` shares a name only on
NCCL) every TP group gets its own hashed name too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = ["GROUP_KINDS", "GroupSpec", "Layout"]

GROUP_KINDS: Final = ("default", "tp", "dp", "pp")
"""Kinds of process group, in the order each rank creates them (its ``pg_id``)."""

_DESCS: Final = {
    "default": "default_pg",
    "tp": "TENSOR_MODEL_PARALLEL_GROUP",
    "dp": "DATA_PARALLEL_GROUP",
    "pp": "PIPELINE_MODEL_PARALLEL_GROUP",
}


def _hashed(ranks: tuple[int, ...], salt: str = "") -> str:
    return hashlib.sha1((salt + "_".join(map(str, ranks))).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One concrete process group: its kind, name, description and global ranks."""

    gid: int
    kind: str
    name: str
    desc: str
    ranks: tuple[int, ...]

    def group_rank(self, global_rank: int) -> int:
        """The group-local rank of ``global_rank`` (raises ``ValueError`` if absent)."""
        return self.ranks.index(global_rank)


class Layout:
    """TP-major layout of ranks into groups; see the module docstring."""

    def __init__(self, *, tp: int, dp: int, pp: int, shared_tp_name: bool = True) -> None:
        if min(tp, dp, pp) < 1:
            raise ValueError("tp, dp and pp must be at least 1")
        self.tp, self.dp, self.pp = tp, dp, pp
        self.shared_tp_name = shared_tp_name
        self.world_size = tp * dp * pp
        ws = self.world_size
        ranks = np.arange(ws)
        self.tp_rank: npt.NDArray[np.int64] = ranks % tp
        self.dp_rank: npt.NDArray[np.int64] = (ranks // tp) % dp
        self.pp_rank: npt.NDArray[np.int64] = ranks // (tp * dp)
        self.groups: list[GroupSpec] = []
        # gid_of[kind][rank] -> gid, or -1 when the kind has size 1 (not created)
        self.gid_of: dict[str, npt.NDArray[np.int64]] = {}
        self._add("default", [tuple(range(ws))])
        tp_groups = [tuple(range(b, b + tp)) for b in range(0, ws, tp)]
        dp_groups = [
            tuple(s * tp * dp + t + tp * d for d in range(dp)) for s in range(pp) for t in range(tp)
        ]
        pp_groups = [tuple(t + tp * d + tp * dp * s for s in range(pp)) for d in range(dp) for t in range(tp)]
        if tp > 1:
            self._add("tp", tp_groups)
        if dp > 1:
            self._add("dp", dp_groups)
        if pp > 1:
            self._add("pp", pp_groups)
        for kind in GROUP_KINDS:
            self.gid_of.setdefault(kind, np.full(ws, -1, dtype=np.int64))

    def _add(self, kind: str, members: list[tuple[int, ...]]) -> None:
        gid_of = np.full(self.world_size, -1, dtype=np.int64)
        shared = _hashed(members[0], salt="split:tp:") if kind == "tp" else ""
        for ranks in members:
            if kind == "default":
                name = "0"
            elif kind == "tp" and self.shared_tp_name:
                name = shared
            else:
                name = _hashed(ranks)
            gid = len(self.groups)
            self.groups.append(GroupSpec(gid, kind, name, _DESCS[kind], ranks))
            gid_of[list(ranks)] = gid
        self.gid_of[kind] = gid_of

    def kinds_present(self) -> tuple[str, ...]:
        """Group kinds that exist in this layout (size > 1, plus the default group)."""
        return tuple(k for k in GROUP_KINDS if k == "default" or int(self.gid_of[k][0]) >= 0)

    def group(self, kind: str, rank: int) -> GroupSpec | None:
        """The group of ``kind`` that ``rank`` belongs to (``None`` if not created)."""
        gid = int(self.gid_of[kind][rank])
        return self.groups[gid] if gid >= 0 else None

    def stage_peer(self, rank: int, delta: int) -> int:
        """The rank ``delta`` pipeline stages away with the same TP and DP index."""
        return rank + delta * self.tp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(tp_rank, dp_rank, pp_rank)`` of a global rank."""
        return int(self.tp_rank[rank]), int(self.dp_rank[rank]), int(self.pp_rank[rank])

    def rank_at(self, *, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """The global rank at the given coordinates."""
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)
