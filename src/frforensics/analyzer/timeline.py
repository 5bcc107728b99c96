"""Chrome-trace / Perfetto JSON of every rank's recorded ops (``fr-analyze timeline``).

An exporter beside ``convert``, not a reporter: reporters render a
:class:`~frforensics.report.Report`, a timeline shows every entry of every
ring. ``write_timeline`` takes the stream of traces and load problems that
:func:`frforensics.formats.read_sources` yields (one dump at a time) and writes
each rank's events before the next trace arrives, so memory stays at one
dump's worth::

    write_timeline(read_sources(paths, prefix=prefix), out)

``write_timeline_file(paths, path)`` does that into a file, atomically (``fr-analyze
--output-dir`` and the pytest plugin's ``timeline.json``).

The trace (load it in ui.perfetto.dev or ``chrome://tracing``):

* one process per rank (``pid`` = global rank, named ``rank N [host, pid P]``);
* one thread per process group on that rank (``tid`` shared by every rank for
  the same group, named ``<desc> <name> (ranks ...)``); ops of one group that
  overlap without nesting (async ops, p2p) go to extra lanes ``… lane 2``;
* one complete event (``"ph": "X"``, ``ts``/``dur`` in µs, wall clock) per
  entry, from start (or enqueue) to completion; ``args`` hold op, seq, p2p seq,
  peer, sizes, dtypes, state, timeout and the user's code location;
* ops unfinished at dump time run to the dump time, are named ``… [STUCK]``
  (``[FAILED]`` for failed ones) and get an instant event where the dump
  happened; each rank's dump is an instant event ``dump: <reason>``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from frforensics._atomic import atomic_file
from frforensics.formats.sources import read_sources
from frforensics.model import OpState, RankTrace, user_frame
from frforensics.report import LoadProblem

__all__ = ["TimelineSummary", "trace_events", "write_timeline", "write_timeline_file"]

_LANES = 64  # tids per group: lane k of group g is g * _LANES + k
_STATES = {int(s): s for s in OpState}


@dataclass(slots=True)
class TimelineSummary:
    """What a timeline export wrote."""

    ranks: list[int] = field(default_factory=list)
    events: int = 0
    stuck: int = 0
    problems: list[tuple[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class _Groups:
    """Group key -> thread id base, the same for every rank."""

    tids: dict[tuple[str, str], int] = field(default_factory=dict)

    def tid(self, name: str, desc: str) -> int:
        key = (name, desc)
        if key not in self.tids:
            self.tids[key] = (len(self.tids) + 1) * _LANES
        return self.tids[key]


def _us(ns: int) -> float:
    return round(ns / 1000.0, 3)


def trace_events(trace: RankTrace, rank: int, groups: _Groups | None = None) -> list[dict[str, Any]]:
    """The trace events of one rank's dump (metadata first)."""
    groups = groups or _Groups()
    e = trace.entries
    n = len(e)
    s = trace.string
    host = ", ".join(x for x in (trace.host, f"pid {trace.pid}" if trace.pid else None) if x)
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
         "args": {"name": f"rank {rank}" + (f" [{host}]" if host else "")}},
        {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
         "args": {"sort_index": rank}},
    ]
    newest = 0
    if n:
        newest = max(int(e.t_enqueue_ns.max()), int(e.t_complete_ns.max()), int(e.t_start_ns.max()))
    now_ns = trace.dump_time_ns or newest
    lane_end: dict[int, list[int]] = {}
    named: set[int] = set()
    for row in range(n):
        enq = int(e.t_enqueue_ns[row])
        start = int(e.t_start_ns[row]) or enq
        if start <= 0:
            continue
        gi = int(e.pg[row])
        info = trace.groups[gi] if 0 <= gi < len(trace.groups) else None
        gname = info.name if info else str(gi)
        gdesc = info.desc if info else ""
        base = groups.tid(gname, gdesc)
        state = _STATES.get(int(e.state[row]), OpState.SCHEDULED)
        done = int(e.t_complete_ns[row])
        unfinished = state < OpState.COMPLETED
        if done > 0:
            end = max(done, start)
        elif unfinished or state is OpState.FAILED:
            end = max(now_ns, start)
        else:
            end = start  # completed, completion time not recorded (native dumps)
        lanes = lane_end.setdefault(base, [])
        lane = next((k for k, t in enumerate(lanes) if t <= start), len(lanes))
        lane = min(lane, _LANES - 1)
        if lane == len(lanes):
            lanes.append(end)
        else:
            lanes[lane] = max(lanes[lane], end)
        tid = base + lane
        if tid not in named:
            named.add(tid)
            members = ("ranks ?" if info is None or info.ranks is None
                       else "ranks " + _ranges(info.ranks))
            label = f"{gdesc or 'group'} {gname} ({members})" + (f" lane {lane + 1}" if lane else "")
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                           "args": {"name": label}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                           "args": {"sort_index": tid}})
        op = s(int(e.op[row])) or "?"
        is_p2p = bool(e.is_p2p[row])
        seq = int(e.p2p_seq[row]) if is_p2p else int(e.seq[row])
        name = f"{op} #{seq}" if not is_p2p else f"{op} p2p #{seq}"
        if unfinished:
            name += " [STUCK]"
        elif state is OpState.FAILED:
            name += " [FAILED]"
        frame = user_frame(trace.stack(int(e.stack[row])))
        args: dict[str, Any] = {
            "op": op, "group": gname, "group_desc": gdesc, "seq": int(e.seq[row]),
            "state": state.name.lower(), "record_id": int(e.record_id[row]),
            "in_shapes": s(int(e.in_shapes[row])), "out_shapes": s(int(e.out_shapes[row])),
            "in_dtypes": s(int(e.in_dtypes[row])), "in_numel": int(e.in_numel[row]),
            "timeout_ms": int(e.timeout_ms[row]),
        }
        if is_p2p:
            args.update(p2p_seq=int(e.p2p_seq[row]), peer=int(e.peer[row]),
                        peer_seq=int(e.peer_seq[row]))
        if int(e.root[row]) >= 0:
            args["root"] = int(e.root[row])
        reduce_op = s(int(e.reduce_op[row]))
        if reduce_op:
            args["reduce_op"] = reduce_op
        if done <= 0 and not unfinished:
            args["complete_time"] = "not recorded"
        if frame is not None:
            args["location"] = str(frame)
        events.append({"ph": "X", "name": name, "cat": "stuck" if unfinished else "op",
                       "pid": rank, "tid": tid, "ts": _us(start),
                       "dur": _us(end - start), "args": args})
        if unfinished:
            events.append({"ph": "i", "s": "t", "name": f"stuck: {op} #{seq}", "pid": rank,
                           "tid": tid, "ts": _us(end), "cat": "stuck",
                           "args": {"waited_s": round((end - start) / 1e9, 3)}})
    if trace.dump_time_ns:
        events.append({"ph": "i", "s": "p", "name": f"dump: {trace.dump_reason.value}",
                       "pid": rank, "tid": 0, "ts": _us(trace.dump_time_ns),
                       "args": {"detail": trace.dump_detail}})
    return events


def _ranges(ranks: Sequence[int]) -> str:
    from frforensics.report import format_ranks

    return format_ranks(ranks, limit=4)


def write_timeline(
    traces: Iterable[RankTrace | LoadProblem],
    out: TextIO,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> TimelineSummary:
    """Write the Chrome-trace JSON of ``traces`` (as ``read_sources`` yields them) to ``out``.

    Load problems are listed in ``otherData``; a second trace of a rank already
    written is skipped and listed too. ``progress(done, done)`` is called per trace.
    """
    summary = TimelineSummary()
    groups = _Groups()
    out.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
    first = True
    done = 0
    for item in traces:
        done += 1
        if progress is not None:
            progress(done, done)
        if isinstance(item, LoadProblem):
            summary.problems.append((item.path, item.error))
            continue
        if item.rank is None:
            summary.problems.append((item.source, "cannot tell which rank wrote this dump"))
            continue
        if item.rank in summary.ranks:
            summary.problems.append((item.source, f"second dump for rank {item.rank}: skipped"))
            continue
        summary.ranks.append(item.rank)
        for event in trace_events(item, item.rank, groups):
            if not first:
                out.write(",\n")
            first = False
            out.write(json.dumps(event, separators=(",", ":")))
            summary.events += 1
            if event.get("ph") == "X" and event.get("cat") == "stuck":
                summary.stuck += 1
        del item
    other = {"tool": "frforensics", "ranks": sorted(summary.ranks),
             "problems": [{"path": p, "error": e} for p, e in summary.problems]}
    out.write('\n], "otherData": ' + json.dumps(other) + "}\n")
    return summary


def write_timeline_file(paths: Sequence[str | os.PathLike[str]], path: str | os.PathLike[str],
                        *, prefix: str | None = None) -> TimelineSummary:
    """Read the dumps at ``paths`` and write their timeline to ``path`` atomically
    (a reader never sees half of it)."""
    with atomic_file(path) as fh:  # never through a link; no .tmp left on failure
        return write_timeline(read_sources([str(p) for p in paths], prefix=prefix), fh)
