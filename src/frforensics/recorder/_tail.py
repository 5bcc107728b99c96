"""The tail digest: a trimmed frdump of one rank, small enough for the c10d store.

When the ranks of a job dump to node-local disks, the elected rank cannot read
its peers' files; each rank then publishes this instead. It *is* an frdump
(same format, so the analyzer reads it unchanged), holding only what a verdict
needs: every unfinished entry, the last ``per_group`` entries of each group,
the groups, every thread's stack at dump time (capped), death, stale peers and
the rank's identity. Strings and stacks are re-tabled to what the kept entries
use, and the whole is zlib-compressed.

Decoding on the elected rank goes through :func:`inflate`, which refuses
anything that would inflate past ``MAX_INFLATED`` bytes (the store is shared
and its contents are not trusted more than a dump file is).
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Final

import numpy as np

from frforensics.formats import frdump
from frforensics.model import ENTRY_COLUMNS, EntryTable, OpState, RankTrace, ThreadStack

__all__ = ["MAX_INFLATED", "inflate", "tail_bytes", "tail_trace"]

PER_GROUP: Final = 8
MAX_THREADS: Final = 16
MAIN_FRAMES: Final = 48
OTHER_FRAMES: Final = 12
MAX_INFLATED: Final = 32 << 20

_STRING_COLUMNS: Final = ("op", "in_shapes", "out_shapes", "in_dtypes", "out_dtypes",
                          "reduce_op", "thread", "device", "splits")


def tail_trace(trace: RankTrace, *, per_group: int = PER_GROUP) -> RankTrace:
    """``trace`` trimmed to its unfinished entries and each group's last ``per_group``."""
    e = trace.entries
    n = len(e)
    keep = np.zeros(n, dtype=np.bool_)
    keep |= e.state != OpState.COMPLETED
    for g in np.unique(e.pg).tolist():
        rows = np.flatnonzero(e.pg == g)
        keep[rows[-per_group:]] = True
    rows = np.flatnonzero(keep)
    cols = {name: np.ascontiguousarray(col[rows]) for name, col in e.columns().items()}

    strings: list[str] = []
    s_index: dict[int, int] = {}

    def restring(col: np.ndarray) -> np.ndarray:
        out = col.copy()
        for i, old in enumerate(col.tolist()):
            if old < 0:
                continue
            new = s_index.get(old)
            if new is None:
                new = s_index[old] = len(strings)
                strings.append(trace.string(old))
            out[i] = new
        return out

    for name in _STRING_COLUMNS:
        cols[name] = restring(cols[name])
    stacks: list[tuple] = []  # type: ignore[type-arg]
    k_index: dict[int, int] = {}
    stack_col = cols["stack"].copy()
    for i, old in enumerate(cols["stack"].tolist()):
        if old < 0:
            continue
        new = k_index.get(old)
        if new is None:
            new = k_index[old] = len(stacks)
            stacks.append(trace.stack(old))
        stack_col[i] = new
    cols["stack"] = stack_col
    table = EntryTable.from_columns(len(rows), {k: cols[k] for k in ENTRY_COLUMNS})
    threads = sorted(trace.threads, key=lambda t: not t.is_main)[:MAX_THREADS]
    threads = [ThreadStack(name=t.name, ident=t.ident, is_main=t.is_main,
                           frames=t.frames[:MAIN_FRAMES if t.is_main else OTHER_FRAMES])
               for t in threads]
    death = trace.death
    if death is not None:
        death = dataclasses.replace(death, frames=death.frames[:MAIN_FRAMES],
                                    message=death.message[:1000])
    return dataclasses.replace(
        trace,
        strings=tuple(strings),
        stacks=tuple(stacks),
        entries=table,
        header=dataclasses.replace(trace.header, threads=tuple(threads), death=death,
                                   dropped=trace.dropped + (n - len(rows))),
        notes=(*trace.notes, f"tail digest: {len(rows)} of {n} entries (unfinished ones and "
                             f"the last {per_group} of each group)"),
    )


def tail_bytes(trace: RankTrace, *, per_group: int = PER_GROUP) -> bytes:
    """The compressed tail digest of ``trace`` (zlib of an frdump)."""
    return zlib.compress(frdump.encode(tail_trace(trace, per_group=per_group)), 6)


def inflate(data: bytes) -> bytes:
    """Decompress a tail digest; ``ValueError`` when corrupt or too large."""
    try:
        d = zlib.decompressobj()
        out = d.decompress(data, MAX_INFLATED)
        if d.unconsumed_tail or not d.eof:
            raise ValueError("tail digest is truncated or inflates past the limit")
    except zlib.error as exc:
        raise ValueError(f"tail digest is not zlib data: {exc}") from None
    return out
