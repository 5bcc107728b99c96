"""The verdict at hang time: one elected rank analyzes, every rank hears the result.

After a hang dump (``watchdog_timeout`` or ``peer_signal``), or an exception
dump caused by a lost peer (then the job-wide flag is raised here, since no
watchdog will fire: every survivor is dying), each rank:

1. publishes, through the c10d store (keys under ``frforensics/<R>/verdict/<k>/``),
   a small record of its dump (host, pid, path, size, mtime) and — unless the
   dump directory is declared shared — its *tail digest* (``_tail``: a trimmed,
   compressed frdump; a few KB);
2. votes for the lowest rank that dumped (``compare_set`` on ``leader``) and
   waits until every rank announced its dump or two store polls passed;
3. the rank the vote names takes ``owner`` by ``compare_set`` (exactly one
   wins, even when several ranks time out at once) and runs the analysis in a
   **child process** (``python -m frforensics verdict``: the training process
   never imports the analyzer) over the peers' dump files where it can see
   them (same size and mtime as announced) and their digests otherwise; it
   prints the human verdict on stderr, writes ``verdict.json`` and
   ``verdict.txt`` next to its dumps, sets ``frforensics/<R>/verdict/<k>``,
   and runs the ``on_verdict`` hooks;
4. every other rank polls that key, logs one line pointing at it, and runs its
   listeners. A rank that sees no owner long after the vote takes over.

``FRFORENSICS_ABORT_AFTER_VERDICT``: each rank then exits with
:data:`EXIT_VERDICT` (75), or :data:`EXIT_NO_VERDICT` (76) when none could be had.

Nothing here raises into the job: failures become one log line each.
Contract for orchestrators and recovery: docs/orchestrators.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from frforensics._atomic import safe_dir, write_atomic
from frforensics.model import DumpReason, RankTrace
from frforensics.verdict import (
    EXIT_NO_VERDICT,
    EXIT_VERDICT,
    SCHEMA,
    Verdict,
    VerdictError,
    headline,
    report_headline,
)

if TYPE_CHECKING:
    from frforensics.recorder._core import Recorder
    from frforensics.recorder._dump import DumpWriter, DumpWritten

__all__ = ["EXIT_NO_VERDICT", "EXIT_VERDICT", "SCHEMA", "VerdictAgent"]

log = logging.getLogger("frforensics.recorder")

_HANG = (DumpReason.WATCHDOG_TIMEOUT, DumpReason.PEER_SIGNAL)
_DEATH = (DumpReason.EXCEPTION, DumpReason.EXIT)
#: the elected rank's time for reading its inputs past the late-digest grace
#: (``_collect_limit``): 3 s, and 1 ms per rank (two reads; ~0.1 ms on one host)
_READ_S = 3.0
_READ_PER_RANK_S = 0.001


VerdictHook = Callable[[dict[str, Any]], None]


@dataclass
class _Incident:
    k: int
    published_at: float = 0.0  # monotonic, when this rank's dump was published
    counted: bool = False
    started: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    verdict: dict[str, Any] | None = None


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


_I64_MAX: Final = (1 << 63) - 1
_MAX_RANK: Final = 1 << 20  # formats.limits' max_rank: a larger number names no rank
#: a ``dumped`` record is a few hundred bytes; a larger value is not one
_MAX_RECORD: Final = 1 << 16


#: ``compare_set(key, _ABSENT, _ABSENT)`` reads a key without ever blocking: a
#: missing key answers ``_ABSENT`` and stays missing (``expected`` is not empty), a
#: set one answers its value (rewritten unchanged only if it *is* ``_ABSENT``), in
#: one atomic call. ``get``/``multi_get``/``wait`` of a missing key block for the
#: store's timeout (``store_timeout_s``; torch's default is 300 s), and a key that
#: ``check`` saw can be deleted before the ``get`` that follows it.
_ABSENT: Final = "\x00frforensics: no such key\x00"
_ABSENT_BYTES: Final = _ABSENT.encode()


def peek(store: Any, key: str) -> bytes | None:
    """The value of ``key``, or None when it is not set (one call that never waits)."""
    raw = store.compare_set(key, _ABSENT, _ABSENT)
    value = bytes(raw) if isinstance(raw, bytes | bytearray | memoryview) else str(raw).encode()
    return None if value == _ABSENT_BYTES else value


def _rank_of(raw: Any, world: int) -> int | None:
    """A rank number written in the store, or None when it is not one below ``world``."""
    if raw is None:
        return None
    text = _text(raw).strip()
    if not text.isdigit() or len(text) > 8 or int(text) >= world:
        return None
    return int(text)


def check_verdict(raw: Any) -> tuple[Verdict | None, str]:
    """The verdict document of the store key, typed, or ``(None, why)``
    (``Verdict.loads``: at most 4 Mi characters of JSON, every field checked)."""
    try:
        return Verdict.loads(_text(raw) if not isinstance(raw, bytes) else raw), ""
    except VerdictError as exc:
        return None, exc.detail

def check_record(raw: Any, rank: int) -> tuple[dict[str, Any] | None, str]:
    """A peer's ``dumped`` record, typed, or ``(None, why)``: a JSON object whose
    ``rank`` is the key's, ``size``/``mtime_ns``/``digest_bytes`` integers within int64
    (>= 0), ``digest`` a boolean, ``path``/``host``/``reason`` strings."""
    try:
        text = _text(raw)
        if len(text) > _MAX_RECORD:
            return None, f"dumped record of {len(text)} characters: skipped"
        doc = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return None, f"dumped record is not JSON ({str(exc)[:100]}): skipped"
    if not isinstance(doc, dict):
        return None, f"dumped record is a {type(doc).__name__}, not an object: skipped"
    if doc.get("rank") != rank or type(doc.get("rank")) is not int:
        return None, f"dumped record claims rank {str(doc.get('rank'))[:40]}: skipped"
    doc.setdefault("digest_bytes", 0)
    for name in ("size", "mtime_ns", "digest_bytes"):
        v = doc.get(name)
        if type(v) is not int or not 0 <= v <= _I64_MAX:
            return None, (f"dumped record's {name} {str(v)[:40]!r} is not an integer in "
                          f"0..2^63-1: skipped")
    if type(doc.get("digest")) is not bool:
        return None, "dumped record's digest is not true/false: skipped"
    for name in ("path", "host", "reason"):
        if not isinstance(doc.get(name, ""), str | None):
            return None, f"dumped record's {name} is not a string: skipped"
    return doc, ""


def compact(k: int, report: dict[str, Any] | None, text: str, inputs: dict[str, Any],
            error: str | None, dump_dir: Path, *, elected_rank: int | None, host: str,
            digest_bytes: dict[str, int], flag_ns: int | None, now_ns: int) -> Verdict:
    """The verdict of incident ``k`` (the store key's document) from the analysis
    child's report and printed ``text`` (``report`` None: it failed, ``error`` says
    why). The report is a file: its status, culprits and actions are checked as any
    verdict's (``Verdict.from_json``); one that is not the contract is an error verdict."""
    block = text.split("\n\n", 1)[0].strip("\n")
    found = Verdict(status="error")
    if report is not None and error is None:
        try:
            found = Verdict.from_json({"schema": SCHEMA, "status": report.get("status"),
                                       "culprit_ranks": report.get("culprit_ranks", []),
                                       "actions": report.get("actions", [])})
        except (VerdictError, AttributeError) as exc:
            error = f"the analysis wrote a report that is not one ({exc})"
            found = Verdict(status="error")
    # the one headline rule (verdict.report_headline: the text block's first line,
    # never cut where the terminal wrapped it)
    head = (report_headline(report) if report is not None and error is None
            else headline("error", error or "the analysis wrote no verdict"))
    return replace(
        found, incident=k, headline=head, text=block, elected_rank=elected_rank, host=host,
        verdict_json=str(dump_dir / "verdict.json"), verdict_txt=str(dump_dir / "verdict.txt"),
        inputs=inputs, digest_bytes=dict(digest_bytes), time_ns=now_ns,
        seconds_after_flag=None if flag_ns is None else round((now_ns - flag_ns) / 1e9, 3),
        error=error)


class VerdictAgent(threading.Thread):
    """One daemon thread per process; handed every dump by ``Recorder.dump``."""

    def __init__(self, rec: Recorder, writer: DumpWriter, *,
                 listeners: list[VerdictHook] | None = None) -> None:
        super().__init__(name="frforensics-verdict", daemon=True)
        self.rec = rec
        self.writer = writer
        self.config = rec.config
        #: called on this rank with every verdict it learns (shared with the API)
        self.listeners: list[VerdictHook] = listeners if listeners is not None else []
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.incident = 0
        self.incidents: dict[int, _Incident] = {}
        self.started_wall_ns = time.time_ns()
        #: when each incident after the first opened (``rearm``): a dump file
        #: older than that belongs to an earlier incident
        self.opened_wall_ns: dict[int, int] = {}
        self.last: dict[str, Any] | None = None
        self.learned = threading.Condition()
        self.lock = threading.Lock()
        #: ``request_verdict()`` was called: its API dump opens the incident
        self.requested = False
        #: sizes of the digests the elected rank saw (ranks, total, max bytes)
        self.digest_bytes: dict[str, int] = {}

    # ------------------------------------------------------------ called by the job

    def on_dump_written(self, written: DumpWritten) -> None:
        """A post-dump hook of the writer: hand over to this thread, never block."""
        self.on_dumped(written.reason, written.trace, written.path)

    def on_dumped(self, reason: DumpReason, trace: RankTrace, path: Path) -> None:
        """Queue one written dump for this thread."""
        if not self.config.verdict:
            return
        if reason is DumpReason.API and self.requested:
            self.requested = False
            reason = DumpReason.WATCHDOG_TIMEOUT  # handled as the hang dump it stands for
        if reason not in (*_HANG, *_DEATH):
            return
        self.events.put(("dumped", (reason, trace, path)))

    def after_exception(self, message: str, peer_loss: bool) -> None:
        """From the excepthook, after the exception dump: for a lost peer, raise the
        flag and stay (bounded) until this rank's part of the verdict is done."""
        if not self.config.verdict or not peer_loss:
            return
        k = self.incident
        self.events.put(("incident", (k, f"lost a peer: {message[:200]}")))
        limit = self._wait_limit() + 4 * self.rec.config.store_poll_interval_s + 10.0
        self._incident(k).done.wait(limit)

    def request(self, detail: str) -> bool:
        """``request_verdict()``: dump now and raise the flag (False if already up)."""
        rec = self.rec
        if not self.config.verdict or rec.store is None or rec.flag_raised:
            return False
        try:
            self.requested = True
            path = self.writer.dump(DumpReason.API, f"verdict requested: {detail}"[:500],
                                    native=False)
            if path is None:
                return False
            return rec.raise_flag(self._flag_payload(f"verdict requested: {detail}"))
        except Exception as exc:
            rec.note_error("request_verdict", exc)
            return False

    def rearm(self, watchdog: Any, rank: int | None, world_size: int | None) -> int:
        """Open the next incident: a new flag key, the watchdog armed again."""
        rec = self.rec
        with self.lock:
            self.incident += 1
            k = self.incident
            self.opened_wall_ns[k] = time.time_ns()
        if rank is not None:
            rec.rank = int(rank)
        if world_size is not None:
            rec.world_size = int(world_size)
        rec.flag_key = f"dump_flag/{k}"
        rec.flag_seen = None
        rec.flag_raised = False
        rec.hang_dump_written = False
        self.requested = False
        if watchdog is not None:
            watchdog.fired = False
            watchdog.answered = False
        return k

    def stop(self) -> None:
        """End the thread (``disable()``)."""
        self.events.put(("stop", None))

    def _flag_payload(self, detail: str) -> dict[str, Any]:
        return {"rank": self.rec.current_rank(), "pg": "", "desc": "", "op": "", "seq": -1,
                "seq_kind": "", "age_s": 0.0, "time_ns": time.time_ns(), "detail": detail[:500]}

    def wait(self, timeout_s: float, incident: int | None = None) -> dict[str, Any] | None:
        """Block until this rank knows the verdict of ``incident`` (default: current)."""
        k = self.incident if incident is None else incident
        inc = self._incident(k)
        inc.done.wait(max(0.0, timeout_s))
        return inc.verdict

    # ------------------------------------------------------------ the thread

    def run(self) -> None:
        while True:
            try:
                kind, payload = self.events.get()
                if kind == "dumped":
                    self._handle_dump(*payload)
                elif kind == "incident":
                    k, detail = payload
                    self._raise_flag(detail)
                    self._run_incident(k)
                elif kind == "stop":
                    return
            except Exception as exc:  # the thread must survive anything
                self.rec.note_error("verdict", exc)

    def _incident(self, k: int) -> _Incident:
        with self.lock:
            inc = self.incidents.get(k)
            if inc is None:
                inc = self.incidents[k] = _Incident(k)
            return inc

    def _store(self) -> Any:
        # Shared with the watchdog (the TCPStore client serializes calls); only
        # non-blocking calls are made on it: every read of a key is a ``peek``.
        return self.rec.store

    def _key(self, k: int, *parts: object) -> str:
        return "/".join(["verdict", str(k), *(str(p) for p in parts)])

    def _handle_dump(self, reason: DumpReason, trace: RankTrace, path: Path) -> None:
        k = self.incident
        inc = self._incident(k)
        if inc.done.is_set():
            return
        store, me = self._store(), self.rec.rank
        if reason in _HANG and store is not None and me is not None:
            # vote before the dump is counted: a rank that sees every dump counted
            # then reads the lowest rank's vote (voting after, a slow rank 0 could
            # be counted but not yet voted, and rank 1 elected); a store error here
            # is the incident's to report (it votes again)
            with contextlib.suppress(Exception):
                self._vote(store, k, me)
        if not self._publish(inc, trace, path):
            if reason in _HANG:
                self._no_verdict(inc, "the c10d store is unreachable (its host, rank 0's "
                                      "process unless torchrun hosts it, may have died)", path)
            return
        if reason in _HANG:
            self._run_incident(k)

    def _publish(self, inc: _Incident, trace: RankTrace, path: Path) -> bool:
        store, me = self._store(), self.rec.rank
        if store is None or me is None:
            return False
        try:
            st = path.stat()
            record = {"rank": me, "host": trace.host, "pid": trace.pid, "path": str(path),
                      "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                      "reason": trace.dump_reason.value, "digest": False}
            if self.config.verdict_source != "dir":
                from frforensics.recorder._tail import tail_bytes

                blob = tail_bytes(trace)
                store.set(self._key(inc.k, "digest", me), blob)
                record["digest"] = True
                record["digest_bytes"] = len(blob)
            store.set(self._key(inc.k, "dumped", me), json.dumps(record))
            if not inc.counted:
                inc.counted = True
                store.add(self._key(inc.k, "n"), 1)
                with contextlib.suppress(Exception):
                    store.append(self._key(inc.k, "ranks"), f"{me},")
            inc.published_at = time.monotonic()
            return True
        except Exception as exc:
            self.rec.note_error("verdict publish", exc)
            return False

    def _raise_flag(self, detail: str) -> None:
        rec = self.rec
        if rec.flag_raised or rec.store is None:
            return
        with contextlib.suppress(Exception):
            rec.raise_flag(self._flag_payload(detail))

    def _wait_limit(self) -> float:
        """How long a follower waits for the verdict: past the elected rank's input
        deadline and its analysis' time limit."""
        return max(2 * self.rec.config.store_poll_interval_s + 5.0,
                   self._collect_limit() + 2.0) + self.config.verdict_timeout_s

    def _grace(self) -> float:
        """How long the elected rank waits for a digest a record claims (two polls, <= 10 s)."""
        return min(2 * self.rec.config.store_poll_interval_s, 10.0)

    def _collect_limit(self) -> float:
        """The elected rank's deadline for reading its inputs: the late-digest grace
        and the reads (``_READ_S``, more in a large world); with the analysis
        (``verdict_timeout_s``) it stays inside every follower's wait (``_wait_limit``)."""
        world = self.rec.world_size or 0
        return self._grace() + _READ_S + _READ_PER_RANK_S * world

    # ------------------------------------------------------------ the protocol

    def _run_incident(self, k: int) -> None:
        inc = self._incident(k)
        if inc.started or inc.done.is_set():
            return
        inc.started = True
        store, me, world = self._store(), self.rec.rank, self.rec.world_size
        if store is None or me is None or world is None or not inc.counted:
            self._no_verdict(inc, "this rank could not publish its dump: the c10d store is "
                                  "unreachable (its host, rank 0's process unless torchrun hosts "
                                  "it, may have died)", None)
            return
        poll = self.rec.config.store_poll_interval_s
        try:
            self._vote(store, k, me)
            window_end = self._await_dumps(store, k, world, inc.published_at)
            # garbage a peer wrote there names no one: the owner race decides
            elected = _rank_of(peek(store, self._key(k, "leader")), world)
            if elected in (me, None) and self._take_ownership(store, k, me):
                self._lead(inc, store, world)
                return
            # past any rank's own wait (hard_end), so a slow leader is not overtaken
            self._follow(inc, store, me, world, window_end + 4 * poll + 3.0)
        except Exception as exc:
            self._no_verdict(inc, f"the c10d store failed during the verdict "
                                  f"({type(exc).__name__}: {exc})", None)

    def _await_dumps(self, store: Any, k: int, world: int, since: float) -> float:
        """Wait until every rank announced its dump, or two store polls passed and
        every rank with a fresh heartbeat did (a dead rank never will); bounded
        by two more polls + 2 s for live ranks slow to dump. Returns when it ended."""
        poll = self.rec.config.store_poll_interval_s
        window_end = since + 2 * poll
        hard_end = window_end + 2 * poll + 2.0
        expected: int | None = None
        while True:
            now = time.monotonic()
            n = int(store.add(self._key(k, "n"), 0))
            if n >= world or now >= hard_end:
                return now
            if now >= window_end:
                if expected is None:
                    expected = world - len(self.rec.stale_peers())
                if n >= expected:
                    return now
            time.sleep(min(0.05, poll / 4))

    def _vote(self, store: Any, k: int, me: int) -> int:
        """Make ``leader`` the lowest rank that voted (compare-and-set loop)."""
        key = self._key(k, "leader")
        current = _text(store.compare_set(key, "", str(me)))
        for _ in range(1 << 16):  # each round lowers the value, or another rank set it
            theirs = _rank_of(current, _MAX_RANK)
            if not current or (theirs is not None and theirs <= me):
                break
            # a higher rank, or garbage a peer wrote there: ours replaces it
            seen = _text(store.compare_set(key, current, str(me)))
            if seen == str(me):
                return me
            current = seen
        theirs = _rank_of(current, _MAX_RANK)
        return me if theirs is None else theirs

    def _take_ownership(self, store: Any, k: int, me: int) -> bool:
        return _text(store.compare_set(self._key(k, "owner"), "", str(me))) == str(me)

    def _follow(self, inc: _Incident, store: Any, me: int, world: int, takeover_at: float) -> None:
        poll = self.rec.config.store_poll_interval_s
        key = f"verdict/{inc.k}"
        until = time.monotonic() + self._wait_limit()
        while time.monotonic() < until:
            raw = peek(store, key)
            if raw is not None:
                verdict, why = check_verdict(raw)
                if verdict is not None:
                    self._learn(inc, verdict, elected=False)
                    return
                with contextlib.suppress(Exception):
                    log.warning("frforensics: the verdict in the store is not one (%s); "
                                "still waiting", why)
                until = min(until, time.monotonic() + 4 * poll)
            if time.monotonic() > takeover_at and not store.check([self._key(inc.k, "owner")]) \
                    and self._take_ownership(store, inc.k, me):
                # The elected rank died before starting: take its place.
                self._lead(inc, store, world)
                return
            time.sleep(poll)
        self._no_verdict(inc, f"no verdict appeared within {self._wait_limit():.0f} s "
                              "(the elected rank may have died)", None)

    # ------------------------------------------------------------ the elected rank

    def _lead(self, inc: _Incident, store: Any, world: int) -> None:
        rec = self.rec
        t0 = time.monotonic()
        dump_dir = rec.config.dump_dir
        try:
            work = safe_dir(dump_dir / ".frforensics_verdict"
                            / f"{rec.namespace.replace('/', '-')}-{inc.k}")
            paths, inputs = self._inputs(inc.k, store, world, work)
            listing = write_atomic(work / "paths.txt", "\n".join(paths) + "\n")
        except OSError as exc:  # a work folder that is a planted link, a full disk
            verdict = self._compact(inc.k, None, "", {"files": [], "digests": [], "none": [],
                                                      "skipped": []}, str(exc), dump_dir)
            with contextlib.suppress(Exception):
                store.set(f"verdict/{inc.k}", verdict.dumps())
            self._no_verdict(inc, f"cannot prepare the analysis: {exc}", None)
            return
        cmd = [sys.executable, "-m", "frforensics", "verdict", "--paths-from", str(listing),
               "--out-dir", str(dump_dir), "--world-size", str(world), "--jobs", "1"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("FRFORENSICS_")}
        error = None
        text = ""
        report: dict[str, Any] | None = None
        if inputs["skipped"]:
            with contextlib.suppress(Exception):
                log.warning("frforensics: verdict inputs skipped: %s",
                            "; ".join(inputs["skipped"][:32]))
        try:
            proc = subprocess.run(cmd, capture_output=True, timeout=self.config.verdict_timeout_s,
                                  env=env, stdin=subprocess.DEVNULL, check=False)
            text = proc.stdout.decode("utf-8", "replace")
            if proc.returncode in (0, 1):
                report = json.loads((dump_dir / "verdict.json").read_text(encoding="utf-8"))
            else:
                tail = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
                error = f"the analysis exited {proc.returncode}: {' / '.join(tail)}"
        except subprocess.TimeoutExpired:
            error = f"the analysis took longer than {self.config.verdict_timeout_s:g} s"
        except (OSError, ValueError) as exc:
            error = f"the analysis could not run: {type(exc).__name__}: {exc}"
        verdict = replace(self._compact(inc.k, report, text, inputs, error, dump_dir),
                          analysis_s=round(time.monotonic() - t0, 3))
        error = verdict.error
        try:
            store.set(f"verdict/{inc.k}", verdict.dumps())
        except Exception as exc:
            rec.note_error("verdict store key", exc)
        block = (verdict.text or "") if error is None else f"no report: {error}"
        with contextlib.suppress(Exception):
            sys.stderr.write(
                f"frforensics: verdict (incident {inc.k}, elected rank {rec.rank}, "
                f"{verdict.seconds_after_flag} s after the dump flag; "
                f"{len(inputs['files'])} dump file(s), {len(inputs['digests'])} store digest(s)):\n"
                f"{block.rstrip()}\n  Report:   {verdict.verdict_json}\n")
            sys.stderr.flush()
        self.run_hooks(verdict.to_json(), str(verdict.verdict_json))
        self._learn(inc, verdict, elected=True)

    def _inputs(self, k: int, store: Any, world: int, work: Path,
                until: float | None = None) -> tuple[list[str], dict[str, Any]]:
        """Per rank: its dump file when visible as announced, else its digest.

        Every store value is a peer's word (docs/security.md, "the store"): a
        record or digest that is malformed, claims another rank, or never appears
        is skipped with one note ``rank R: ...`` in ``inputs["skipped"]``; the
        other ranks' inputs are used as they are. Every read is a ``peek`` (never
        a blocking read: a key a peer announced but never wrote, or deleted as it
        was read, costs nothing), and no read starts after ``until`` (default:
        ``_collect_limit`` from now): a rank not read by then is skipped too."""
        from frforensics.formats import frdump
        from frforensics.recorder._tail import inflate

        if until is None:
            until = time.monotonic() + self._collect_limit()
        skipped: list[str] = []
        late: list[int] = []  # not read before the deadline

        def read(r: int, *parts: object) -> bytes | None:
            if time.monotonic() >= until:
                late.append(r)
                return None
            return peek(store, self._key(k, *parts))

        ranks: list[int] = []
        listed = False
        with contextlib.suppress(Exception):
            raw_ranks = peek(store, self._key(k, "ranks"))
            if raw_ranks is not None:
                ranks = sorted({int(x) for x in _text(raw_ranks)[:16 * (world + 1)].split(",")
                                if x.strip().isdigit() and len(x.strip()) <= 8
                                and int(x) < world})
                listed = bool(ranks)
        if not ranks:  # no append on this store: look key by key
            ranks = list(range(world))
        # Rank by rank, its record and then its digest: a deadline cut leaves the
        # ranks before it whole.
        dump_dir = self.rec.config.dump_dir
        records: dict[int, dict[str, Any]] = {}
        files: dict[int, str] = {}
        want_digest: list[int] = []
        blobs: dict[int, bytes] = {}
        for r in ranks:
            raw = read(r, "dumped", r)
            if raw is None:
                if listed and r not in late:  # announced (after its record), then gone
                    skipped.append(f"rank {r}: dumped record missing (its rank is listed)")
                continue
            record, why = check_record(raw, r)
            if record is None:
                skipped.append(f"rank {r}: {why}")
                continue
            records[r] = record
            path = dump_dir / f"frdump_rank_{r}"
            visible = False
            if self.config.verdict_source != "store":
                with contextlib.suppress(OSError):
                    st = path.stat()
                    visible = (st.st_size, st.st_mtime_ns) == (record["size"], record["mtime_ns"])
            if visible:
                files[r] = str(path)
            elif record["digest"]:
                want_digest.append(r)
                raw = read(r, "digest", r)
                if raw is not None:
                    blobs[r] = raw
        # A digest is set before its record: give a late one the grace (two polls),
        # then go on with the digests that did arrive.
        grace_end = min(time.monotonic() + self._grace(), until)
        missing = [r for r in want_digest if r not in blobs and r not in late]
        while missing and time.monotonic() < grace_end:
            time.sleep(min(0.1, self.rec.config.store_poll_interval_s / 4))
            for r in missing:
                raw = read(r, "digest", r)
                if raw is not None:
                    blobs[r] = raw
            missing = [r for r in missing if r not in blobs and r not in late]
        skipped.extend(f"rank {r}: digest missing (its record claims one)" for r in missing)
        skipped.extend(f"rank {r}: not read within the verdict's {self._collect_limit():g} s "
                       "input deadline" for r in sorted(set(late)))
        digests: dict[int, str] = {}
        for r in want_digest:
            raw = blobs.pop(r, None)
            if raw is None:
                continue
            try:
                data = inflate(raw)
                claimed = frdump.decode(data, source=f"digest of rank {r}").rank
            except MemoryError:
                skipped.append(f"rank {r}: digest too large for memory")
                continue
            except Exception as exc:  # any damage: that rank's digest only
                skipped.append(f"rank {r}: bad digest ({type(exc).__name__}: "
                               f"{str(exc)[:200]})")
                continue
            if claimed != r:
                skipped.append(f"rank {r}: digest claims rank {claimed}")
                continue
            try:
                target = write_atomic(work / f"frdump_rank_{r}", data, mode=0o600)
            except OSError as exc:
                skipped.append(f"rank {r}: {exc}")
                continue
            digests[r] = str(target)
        if self.config.verdict_source != "store":
            # Ranks that dumped but never announced (died before the store knew):
            # their files, when written by this run and for this incident (after a
            # recovery, a frozen rank's file from the incident before is stale).
            floor = max(self.started_wall_ns - 120 * 10**9, self.opened_wall_ns.get(k, 0))
            for r in range(world):
                if r in files or r in digests:
                    continue
                path = dump_dir / f"frdump_rank_{r}"
                with contextlib.suppress(OSError):
                    if path.stat().st_mtime_ns >= floor:
                        files[r] = str(path)
        none = [r for r in range(world) if r not in files and r not in digests]
        sizes = [rec["digest_bytes"] for rec in records.values()]
        self.digest_bytes = {"ranks": len(sizes), "total": sum(sizes),
                             "max": max(sizes, default=0)}
        paths = [files.get(r) or digests[r] for r in sorted({*files, *digests})]
        return paths, {"files": sorted(files), "digests": sorted(digests), "none": none,
                       "skipped": skipped}

    def _compact(self, k: int, report: dict[str, Any] | None, text: str,
                 inputs: dict[str, Any], error: str | None, dump_dir: Path) -> Verdict:
        rec = self.rec
        flag_ns = None
        with contextlib.suppress(Exception):
            flag = peek(self._store(), rec.flag_key) if rec.store is not None else None
            flag_ns = int(json.loads(_text(flag)).get("time_ns")) if flag is not None else None
        from frforensics.recorder._core import host_name

        return compact(k, report, text, inputs, error, dump_dir, elected_rank=rec.rank,
                       host=host_name(), digest_bytes=self.digest_bytes, flag_ns=flag_ns,
                       now_ns=time.time_ns())

    # ------------------------------------------------------------ after the verdict

    def run_hooks(self, verdict: dict[str, Any], path: str) -> None:
        """``on_verdict`` and ``on_verdict_command`` (with ``path`` appended), bounded."""
        hook = self.config.on_verdict
        if hook is not None:
            self._bounded("on_verdict", lambda: hook(dict(verdict)))
        command = self.config.on_verdict_command
        if command:
            def run_command() -> None:
                argv = [*shlex.split(command), path]
                proc = subprocess.run(argv, capture_output=True, check=False,
                                      timeout=self.config.hook_timeout_s, stdin=subprocess.DEVNULL)
                if proc.returncode != 0:
                    raise RuntimeError(f"exited {proc.returncode}: "
                                       f"{proc.stderr.decode('utf-8', 'replace')[-300:]}")
            self._bounded("FRFORENSICS_ON_VERDICT", run_command)

    def _bounded(self, what: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` in a thread for at most ``hook_timeout_s``; log its failure."""
        failure: list[BaseException] = []

        def target() -> None:
            try:
                fn()
            except BaseException as exc:  # a hook must never take the job down
                failure.append(exc)

        t = threading.Thread(target=target, name=f"frforensics-{what}", daemon=True)
        t.start()
        t.join(self.config.hook_timeout_s)
        with contextlib.suppress(Exception):
            if t.is_alive():
                log.warning("frforensics: %s still running after %g s; not waiting for it",
                            what, self.config.hook_timeout_s)
            elif failure:
                log.warning("frforensics: %s failed: %s: %s", what, type(failure[0]).__name__,
                            failure[0])

    def _learn(self, inc: _Incident, verdict: Verdict, *, elected: bool) -> None:
        doc = verdict.to_json()  # what the API and the listeners receive (a plain dict)
        inc.verdict = doc
        self.last = doc
        if not elected:
            with contextlib.suppress(Exception):
                acts = ", ".join(f"rank {a.rank}: {a.action}" for a in verdict.actions[:8])
                culprits = ", ".join(str(r) for r in verdict.culprit_ranks[:32])
                log.warning("frforensics: verdict by rank %s on %s: %s — culprits [%s] (%s) — %s "
                            "(store key %s/verdict/%s)",
                            verdict.elected_rank, verdict.host, verdict.headline, culprits, acts,
                            verdict.verdict_json, self.rec.namespace, inc.k)
        for fn in list(self.listeners):
            self._bounded("verdict listener", lambda fn=fn: fn(dict(doc)))  # type: ignore[misc]
        inc.done.set()
        if self.config.abort_after_verdict:
            # Every rank exits at the same wall-clock time, so a launcher that tears
            # the job down when its first worker exits (torchrun) still sees the
            # documented code from every rank.
            self._sleep_until_abort_time(inc.k, elected)
            self._abort(EXIT_VERDICT)

    def _sleep_until_abort_time(self, k: int, elected: bool) -> None:
        """The elected rank, its hooks done, sets ``verdict/<k>/abort_at`` (wall ns, two
        store polls ahead: every rank reads it by then); the others wait for it
        (bounded by the hooks' time limit) and every rank exits at that instant."""
        poll = self.rec.config.store_poll_interval_s
        store = self._store()
        key = self._key(k, "abort_at")
        at: int | None = None
        with contextlib.suppress(Exception):
            if elected:
                at = time.time_ns() + int((2 * poll + 0.3) * 1e9)
                store.set(key, str(at))
            else:
                until = time.monotonic() + self.config.hook_timeout_s + 2 * poll + 5.0
                while at is None and time.monotonic() < until:
                    raw = peek(store, key)
                    if raw is not None:
                        at = int(_text(raw))
                    else:
                        time.sleep(min(poll, 0.2))
        if at is not None:
            time.sleep(max(0.0, min((at - time.time_ns()) / 1e9, 4 * poll + 5.0)))

    def _no_verdict(self, inc: _Incident, why: str, path: Path | None) -> None:
        where = f"; this rank's dump is at {path}" if path is not None else (
            f"; this rank's dump is in {self.rec.config.dump_dir}")
        with contextlib.suppress(Exception):
            log.warning("frforensics: no verdict for this hang: %s%s", why, where)
        inc.done.set()
        if self.config.abort_after_verdict:
            self._abort(EXIT_NO_VERDICT)

    def _abort(self, code: int) -> None:
        with contextlib.suppress(Exception):
            log.warning("frforensics: exiting with code %d (abort_after_verdict)", code)
            sys.stderr.flush()
            sys.stdout.flush()
        os._exit(code)
