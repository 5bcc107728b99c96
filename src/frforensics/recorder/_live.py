"""Live stragglers: a periodic exchange of collective arrival times (off by default).

Every ``straggler_interval_s`` each rank publishes, through the c10d store, the
collectives it completed in its last four rounds (at most 512): per entry its
group, seq, op, enqueue and completion time — delta-coded (seq and enqueue-time differences,
wait durations) and zlib-compressed, some tens of bytes per op (key
``frforensics/<R>/live/<rank>``, overwritten each round). One rank (the first to
``compare_set`` ``live/owner``) keeps a window of each rank's latest entries and
runs the analyzer's own straggler rule on them — same thresholds, clock-offset
handling and window — in a child process (``python -m frforensics verdict``),
writing each rank's window as a small frdump. When a rank is reported as a
straggler it logs one line (once per rank), writes ``stragglers.json`` next to
the dumps and calls the ``on_verdict`` hooks with the finding — in every window
that names one, and once with no findings in the first window after that names
none, so a hook can count consecutive windows (``recovery.exclude_stragglers``). A healthy job produces nothing: the rule never blames a rank
late by less than 1 ms, and names one only when its lateness is sustained and
costs the job at least 5 % of its time (``AnalyzeOptions.straggler_min_cost``;
the analyzer's "Significance", docs/detectors.md): a rank with rare spikes is
noise, here as in ``fr-analyze``. Send/recv are not published (the window holds
collectives only), so a slow pipeline stage is found by ``fr-analyze`` on the
dumps, not live.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from frforensics.formats import frdump
from frforensics.model import DumpHeader, EntryTable, GroupInfo, OpState, RankTrace, SourceFormat
from frforensics.recorder import _ring as R
from frforensics.recorder._verdict import _MAX_RANK, _text
from frforensics.verdict import STRAGGLERS_SCHEMA, StragglerReport

if TYPE_CHECKING:
    from pathlib import Path

    from frforensics.recorder._core import Recorder
    from frforensics.recorder._verdict import VerdictAgent

__all__ = ["LiveStragglers", "decode_round", "encode_round"]

log = logging.getLogger("frforensics.recorder")

WINDOW: Final = 512  # the straggler rule's own window (analyzer/detectors/straggler.py)
_MAX_ROUND: Final = 4 << 20
KEEP_ROUNDS: Final = 4  # rounds each published blob repeats (``LiveStragglers._round``)
#: registry slots (``live/who/<k>``) the owner reads a round at most: the count is a
#: store value, and a store value bounds no loop
SLOTS_A_ROUND: Final = 4096


def encode_round(groups: list[int], seqs: list[int], ops: list[str], enq_ns: list[int],
                 comp_ns: list[int]) -> bytes:
    """One round of arrivals, delta-coded and compressed."""
    names = sorted(set(ops))
    index = {n: i for i, n in enumerate(names)}
    g = np.asarray(groups, dtype="<i4")
    s = np.asarray(seqs, dtype="<i8")
    e = np.asarray(enq_ns, dtype="<i8")
    c = np.asarray(comp_ns, dtype="<i8")
    head = {"n": len(g), "ops": names, "seq0": int(s[0]) if len(s) else 0,
            "enq0": int(e[0]) if len(e) else 0}
    body = b"".join([
        g.astype("<i2").tobytes(),
        np.diff(s, prepend=s[:1]).astype("<i4").tobytes(),
        np.diff(e, prepend=e[:1]).astype("<i8").tobytes(),
        (c - e).astype("<i8").tobytes(),
        np.asarray([index[o] for o in ops], dtype="<i2").tobytes(),
    ])
    return zlib.compress(json.dumps(head).encode() + b"\n" + body, 6)


def decode_round(blob: bytes) -> dict[str, np.ndarray] | None:
    """Inverse of :func:`encode_round`; None when malformed (store data is not trusted)."""
    try:
        d = zlib.decompressobj()
        raw = d.decompress(blob, _MAX_ROUND)
        if d.unconsumed_tail:
            return None
        line, body = raw.split(b"\n", 1)
        head = json.loads(line)
        n = int(head["n"])
        names = [str(x) for x in head["ops"]]
        sizes = [2 * n, 4 * n, 8 * n, 8 * n, 2 * n]
        if n < 0 or len(body) != sum(sizes):
            return None
        parts, at = [], 0
        for size in sizes:
            parts.append(body[at:at + size])
            at += size
        g = np.frombuffer(parts[0], dtype="<i2").astype(np.int32)
        s = np.cumsum(np.frombuffer(parts[1], dtype="<i4").astype(np.int64)) + int(head["seq0"])
        e = np.cumsum(np.frombuffer(parts[2], dtype="<i8")) + int(head["enq0"])
        c = e + np.frombuffer(parts[3], dtype="<i8")
        o = np.frombuffer(parts[4], dtype="<i2").astype(np.int64)
        if n and (o.min() < 0 or o.max() >= len(names)):
            return None
        return {"group": g, "seq": s, "enq": e, "comp": c,
                "op": np.asarray([names[i] for i in o.tolist()], dtype=object)}
    except (ValueError, KeyError, TypeError, zlib.error):
        return None


@dataclass(slots=True)
class _OwnerSeen:
    """The owner as a non-owner last saw it change (its own monotonic clock)."""

    owner: str
    count: int  # its live round counter
    since: float  # when the counter last changed
    beat: str  # its process heartbeat (hb/<rank>)
    beat_since: float  # when the heartbeat last changed


def straggler_report(report: dict[str, Any], round_: int, dump_dir: Path,
                     now_ns: int) -> StragglerReport:
    """The ``frforensics.stragglers/1`` document of one round from the analysis child's
    JSON report: its straggler findings and their actions (``because: straggler``).
    The report is a file: what is read is checked (``StragglerReport.from_json``;
    ``VerdictError`` names the field when it is not the contract)."""
    found = [f for f in report.get("findings", []) if isinstance(f, dict)
             and f.get("kind") == "straggler"]
    return StragglerReport.from_json({
        "schema": STRAGGLERS_SCHEMA, "kind": "straggler", "round": round_, "time_ns": now_ns,
        "findings": found,
        "actions": [a for a in report.get("actions", [])
                    if isinstance(a, dict) and a.get("because") == "straggler"],
        "culprit_ranks": sorted({r for f in found for r in f.get("culprit_ranks", [])}),
        "stragglers_json": str(dump_dir / "stragglers.json")})


class LiveStragglers(threading.Thread):
    """Publishes this rank's arrivals every interval; the owner rank analyzes them."""

    def __init__(self, rec: Recorder, agent: VerdictAgent, interval_s: float) -> None:
        super().__init__(name="frforensics-stragglers", daemon=True)
        self.rec = rec
        self.agent = agent
        self.interval_s = float(interval_s)
        self.stop_event = threading.Event()
        self.last_record = -1
        self.recent: deque[list[tuple[int, int, str, int, int]]] = deque(maxlen=KEEP_ROUNDS)
        self.owner: bool | None = None
        self.groups_sent = 0
        self.windows: dict[int, dict[str, np.ndarray]] = {}
        self.groups_of: dict[int, list[GroupInfo]] = {}
        self.reported: set[int] = set()
        self.named_last = False
        self.rounds = 0
        self.registered = False
        #: the owner's view of every publisher: rank -> (its round counter, when it
        #: last changed, monotonic); a rank whose counter stopped is no longer read
        self.seen: dict[int, tuple[int, float]] = {}
        self.slots: dict[int, int] = {}  # registry slot -> rank (``_publishers``)
        self.next_slot = 1  # the first slot not yet looked at
        self.unwritten: set[int] = set()  # slots counted but not yet written
        self.owner_seen: _OwnerSeen | None = None  # a non-owner's view of the owner

    def stop(self) -> None:
        self.stop_event.set()

    def run(self) -> None:
        while not self.stop_event.wait(self.interval_s):
            try:
                self._round()
            except Exception as exc:  # never into the job
                self.rec.note_error("live stragglers", exc)

    # ------------------------------------------------------------ every rank

    def _round(self) -> None:
        rec = self.rec
        store, me = rec.store, rec.rank
        if store is None or me is None or rec.store_dead or rec.flag_raised or rec.flag_seen:
            return
        s: Any = store
        groups = list(rec.groups)
        if len(groups) != self.groups_sent:
            s.set(f"live/{me}/groups", json.dumps(
                [{"name": g.name, "desc": g.desc, "ranks": list(g.ranks)} for g in groups]))
            self.groups_sent = len(groups)
        entries, _ = rec.snapshot()
        offset = time.time_ns() - time.monotonic_ns()
        rows = [e for e in entries if e[R.RECORD_ID] > self.last_record and not e[R.IS_P2P]
                and e[R.STATE] == R.COMPLETED and e[R.T_COMPLETE]]
        if rows:
            self.last_record = max(e[R.RECORD_ID] for e in rows)
        # Each blob repeats the last KEEP_ROUNDS rounds (at most WINDOW entries): the
        # owner reads every key once per round of its own, and its analysis can take
        # longer than an interval; a round it missed is in the next blob (it keeps
        # only entries newer than those it has). Wall times are fixed once.
        self.recent.append([(e[R.GROUP], e[R.SEQ], e[R.OP], e[R.T_ENQUEUE] + offset,
                             e[R.T_COMPLETE] + offset) for e in rows])
        kept = [row for batch in self.recent for row in batch][-WINDOW:]
        blob = encode_round([r[0] for r in kept], [r[1] for r in kept], [r[2] for r in kept],
                            [r[3] for r in kept], [r[4] for r in kept])
        s.set(f"live/{me}", blob)
        s.add(f"live/{me}/round", 1)
        if not self.registered:  # how the owner finds a rank past the world (a standby)
            s.set(f"live/who/{s.add('live/n', 1)}", str(me))
            self.registered = True
        self.owner = self._elect(s, me)
        if self.owner:
            self._analyze(s)

    def _elect(self, s: Any, me: int) -> bool:
        """Whether this rank owns the analysis this round.

        The first rank to ``compare_set`` ``live/owner`` owns it. An owner whose
        round counter has not moved for three intervals while its process
        heartbeat (``hb/<rank>``, the watchdog's) has not moved for the stale limit
        has gone (excluded, died, or finished); one whose counter has not moved for
        longer than its longest analysis (``verdict_timeout_s``) plus three
        intervals has stalled. The first rank to swap its id for the owner's takes
        over; an owner that finds another id there steps down. Both readings are of
        changes seen on this rank's own clock: no two hosts' clocks are compared.
        """
        current = _text(s.compare_set("live/owner", "", str(me)))
        if current == str(me):
            return True
        if not current.isdigit():
            return False
        now = time.monotonic()
        count = int(s.add(f"live/{current}/round", 0))
        beat = _text(s.get(f"hb/{current}")) if s.check([f"hb/{current}"]) else ""
        seen = self.owner_seen
        if seen is None or seen.owner != current or seen.count != count:
            self.owner_seen = _OwnerSeen(current, count, now, beat, now)
            return False
        if beat != seen.beat:
            seen.beat, seen.beat_since = beat, now
        quiet = now - seen.since
        config = self.rec.config
        gone = quiet > 3 * self.interval_s and now - seen.beat_since > config.stale_limit_s
        if not gone and quiet <= config.verdict_timeout_s + 3 * self.interval_s:
            return False
        won = _text(s.compare_set("live/owner", current, str(me))) == str(me)
        if won:
            self.windows.clear()
            # what this rank saw of the old owner stands: it is not read again
            self.seen = {int(current): (count, seen.since)}
            with contextlib.suppress(Exception):
                log.warning("frforensics: live stragglers: rank %s took over the analysis "
                            "(rank %s's rounds stopped %.0f s ago)", me, current, quiet)
        self.owner_seen = None
        return won

    # ------------------------------------------------------------ the owner

    def _publishers(self, store: Any) -> list[int]:
        """The ranks publishing now: those of the world and those registered past it
        (an admitted standby), less any whose round counter has not moved for three
        intervals (excluded, exited, or died: its last window is dropped)."""
        world = self.rec.world_size or 0
        end = min(int(store.add("live/n", 0)), self.next_slot + SLOTS_A_ROUND - 1)
        todo = [*sorted(self.unwritten)[:SLOTS_A_ROUND], *range(self.next_slot, end + 1)]
        self.next_slot = max(self.next_slot, end + 1)
        for slot in todo:
            if not store.check([f"live/who/{slot}"]):
                if len(self.unwritten) < SLOTS_A_ROUND:
                    self.unwritten.add(slot)  # its rank counted in, then wrote: next round
                continue
            self.unwritten.discard(slot)
            with contextlib.suppress(ValueError):
                rank = int(_text(store.get(f"live/who/{slot}")))
                if 0 <= rank < _MAX_RANK:
                    self.slots[slot] = rank
        candidates = sorted({*range(world), *self.slots.values()})
        # the counter is written after the blob: a rank with a counter has a blob
        ranks = [r for r in candidates if store.check([f"live/{r}/round"])]
        now = time.monotonic()
        out = []
        for r, raw in zip(ranks, store.multi_get([f"live/{r}/round" for r in ranks]),
                          strict=True):
            try:
                count = int(_text(raw))
            except ValueError:
                continue
            last = self.seen.get(r)
            if last is None or last[0] != count:
                self.seen[r] = (count, now)
            elif now - last[1] > 3 * self.interval_s:
                self.windows.pop(r, None)
                continue
            out.append(r)
        return out

    def _analyze(self, store: Any) -> None:
        rec = self.rec
        ranks = self._publishers(store)
        # a standby's member id is past the world it was started in
        world = max([rec.world_size or 0, *(r + 1 for r in ranks)])
        for r in ranks:
            known = self.groups_of.get(r)
            window = self.windows.get(r)
            stale = known is None or (window is not None and len(window["group"])
                                      and int(window["group"].max()) >= len(known))
            if stale and store.check([f"live/{r}/groups"]):
                with contextlib.suppress(ValueError, TypeError, KeyError):
                    raw = json.loads(store.get(f"live/{r}/groups"))
                    self.groups_of[r] = [GroupInfo(str(g["name"]), str(g["desc"]),
                                                   tuple(int(x) for x in g["ranks"]), "")
                                         for g in raw]
        # A round read twice adds nothing: each rank's blob says which round it is.
        for r, blob in zip(ranks, store.multi_get([f"live/{r}" for r in ranks]), strict=True):
            got = decode_round(bytes(blob))
            if got is None:
                continue
            have = self.windows.get(r)
            if have is not None and len(got["seq"]) and len(have["seq"]):
                fresh = got["enq"] > have["enq"][-1]
                got = {k: v[fresh] for k, v in got.items()}
            merged = got if have is None else {k: np.concatenate([have[k], got[k]])
                                               for k in got}
            self.windows[r] = {k: v[-WINDOW:] for k, v in merged.items()}
        self.rounds += 1
        ready = [r for r in ranks if r in self.groups_of and len(self.windows.get(r, {}).get(
            "seq", ())) >= 8]
        if len(ready) < 2:
            return
        from frforensics._atomic import safe_dir, write_atomic

        work = safe_dir(rec.config.dump_dir / ".frforensics_verdict" / "live")
        paths = [str(frdump.write_atomic(work / f"frdump_rank_{r}",
                                         frdump.encode(self._trace(r)))) for r in ready]
        listing = write_atomic(work / "paths.txt", "\n".join(paths) + "\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("FRFORENSICS_")}
        proc = subprocess.run(
            [sys.executable, "-m", "frforensics", "verdict", "--paths-from", str(listing),
             "--out-dir", str(work), "--world-size", str(world), "--jobs", "1"],
            capture_output=True, timeout=rec.config.verdict_timeout_s, env=env,
            stdin=subprocess.DEVNULL, check=False)
        if proc.returncode not in (0, 1):
            return
        report = json.loads((work / "verdict.json").read_text(encoding="utf-8"))
        found = [f for f in report.get("findings", []) if f.get("kind") == "straggler"]
        # The hooks hear every window that names a straggler, and the first window that
        # names none after one that did, so a hook can count consecutive windows
        # (recovery.exclude_stragglers); the log line is once per rank.
        if not found and not self.named_last:
            return
        self.named_last = bool(found)
        new = [f for f in found if not set(f.get("culprit_ranks", [])) <= self.reported]
        doc = self._document(report).to_json()
        if found:  # the file and the store key keep the last window that named one
            frdump.write_atomic(rec.config.dump_dir / "stragglers.json",
                                (json.dumps(doc, indent=2) + "\n").encode())
            with contextlib.suppress(Exception):
                store.set("live/stragglers", json.dumps(doc))
        for f in new:
            self.reported.update(f.get("culprit_ranks", []))
            with contextlib.suppress(Exception):
                log.warning("frforensics: straggler: %s", f.get("message", "")[:600])
        self.agent.run_hooks(doc, str(doc["stragglers_json"]))

    def _document(self, report: dict[str, Any]) -> StragglerReport:
        """This round's straggler document (:func:`straggler_report`)."""
        return straggler_report(report, self.rounds, self.rec.config.dump_dir, time.time_ns())

    def _trace(self, r: int) -> RankTrace:
        w = self.windows[r]
        n = len(w["seq"])
        names = sorted(set(w["op"].tolist()))
        index = {s: i for i, s in enumerate(names)}
        cols = {
            "record_id": np.arange(n), "pg": w["group"], "seq": w["seq"],
            "op": np.asarray([index[o] for o in w["op"].tolist()]),
            "state": np.full(n, int(OpState.COMPLETED)), "t_enqueue_ns": w["enq"],
            "t_complete_ns": w["comp"], "in_dtypes": np.full(n, -1),
            "timeout_ms": np.full(n, int(self.rec.config.timeout_s * 1000)),
        }
        return RankTrace(
            rank=r, header=DumpHeader(
                source="frforensics.live", format=SourceFormat.FRDUMP, version="3",
                world_size=max(self.rec.world_size or 0, r + 1),
                dump_time_ns=int(w["comp"].max()) if n else None,
                completion_resolution_ns=self.rec.resolution_ns),
            groups=tuple(self.groups_of[r]), strings=tuple(names), stacks=(),
            entries=EntryTable.from_columns(n, cols),
            notes=("live straggler window",),
        )
