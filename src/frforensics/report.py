"""The analysis report: what ``fr-analyze`` says, as data (DESIGN §3).

Reporters (text, JSON, markdown, HTML, JUnit) render a :class:`Report`; none of
them decides anything. ``Report.to_json()`` is the public contract
``frforensics.report/1`` that orchestrators parse.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from frforensics.rankset import RankSet, rank_ranges

__all__ = [
    "ACTIONS",
    "KIND_SEVERITY",
    "SCHEMA",
    "TIMELINE_RANKS",
    "Action",
    "Finding",
    "FindingKind",
    "GroupRef",
    "LoadProblem",
    "RankFacts",
    "RankState",
    "RankTimeline",
    "Report",
    "ReportFormatError",
    "Severity",
    "Status",
    "TimelineOp",
    "code_sides",
    "format_ranks",
    "rank_states",
    "timeline_ranks",
]

SCHEMA: Final = "frforensics.report/1"


class ReportFormatError(ValueError):
    """A ``frforensics.report/1`` document that :meth:`Report.from_json` cannot read;
    the message names the field (``findings[2].culprit_ranks``)."""


# ------------------------------------------------------------------ reading JSON
# A report document is as untrusted as a dump (it crosses process and job
# boundaries): every field is checked for its type, a malformed one is one
# ReportFormatError naming it, and nothing in it is run.

#: the deepest nesting a finding's ``evidence`` may have
_MAX_DEPTH: Final = 32


def _bad(where: str, what: str) -> ReportFormatError:
    return ReportFormatError(f"report field {where}: {what}")


def _obj(doc: object, where: str) -> Mapping[str, Any]:
    if not isinstance(doc, Mapping):
        raise _bad(where, f"expected an object, got {type(doc).__name__}")
    return doc


def _key(doc: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in doc:
        raise _bad(f"{where}.{key}" if where else key, "missing")
    return doc[key]


def _int(value: object, where: str, *, low: int | None = 0) -> int:
    if type(value) is not int or (low is not None and value < low):
        raise _bad(where, f"expected an integer{'' if low is None else f' >= {low}'}, "
                          f"got {value!r:.40}")
    return value


def _opt_int(value: object, where: str, *, low: int | None = 0) -> int | None:
    return None if value is None else _int(value, where, low=low)


def _str(value: object, where: str) -> str:
    if type(value) is not str:
        raise _bad(where, f"expected a string, got {type(value).__name__}")
    return value


def _opt_str(value: object, where: str) -> str | None:
    return None if value is None else _str(value, where)


def _list(value: object, where: str) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise _bad(where, f"expected a list, got {type(value).__name__}")
    return value


def _ranks(value: object, where: str) -> tuple[int, ...]:
    return tuple(_int(r, f"{where}[{i}]") for i, r in enumerate(_list(value, where)))


def _spans(doc: Mapping[str, Any], prefix: str, where: str) -> RankSet:
    """A rank set written as ``<prefix>_count`` and ``<prefix>_ranges``."""
    base = f"{where}.{prefix}" if where else prefix
    ranges = _list(_key(doc, f"{prefix}_ranges", where), f"{base}_ranges")
    spans: list[range] = []
    for i, pair in enumerate(ranges):
        at = f"{base}_ranges[{i}]"
        pair = _list(pair, at)
        if len(pair) != 2:
            raise _bad(at, "expected [first, last]")
        first, last = _int(pair[0], at), _int(pair[1], at)
        if last < first or (spans and first <= spans[-1].stop):
            raise _bad(at, "ranges must ascend, each [first, last] with first <= last")
        spans.append(range(first, last + 1))
    out = RankSet(spans)
    if _int(_key(doc, f"{prefix}_count", where), f"{base}_count") != len(out):
        raise _bad(f"{base}_count", "does not match the ranges")
    return out


def _json_value(value: object, where: str, depth: int = 0) -> Any:
    """``value`` if it is plain JSON data (objects with string keys), nested at most
    ``_MAX_DEPTH`` deep."""
    if depth > _MAX_DEPTH:
        raise _bad(where, f"nested deeper than {_MAX_DEPTH}")
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, (list, tuple)):
        for i, x in enumerate(value):
            _json_value(x, f"{where}[{i}]", depth + 1)
        return value
    if isinstance(value, Mapping):
        for k, x in value.items():
            if type(k) not in (str, int):
                raise _bad(where, f"a key of type {type(k).__name__}")
            _json_value(x, f"{where}.{k}", depth + 1)
        return value
    raise _bad(where, f"{type(value).__name__} is not JSON data")


def _enum(cls: type[enum.Enum], value: object, where: str) -> Any:
    try:
        return cls(_str(value, where))
    except ValueError:
        raise _bad(where, f"{value!r:.40} is not one of "
                          f"{', '.join(str(m.value) for m in cls)}") from None


class Severity(str, enum.Enum):
    """How bad a finding is: errors make the exit code 1."""

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


class Status(str, enum.Enum):
    """The job's overall verdict, from the most severe finding."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"
    HANG = "hang"
    DESYNC = "desync"
    UNREADABLE = "unreadable"


class FindingKind(str, enum.Enum):
    """Finding kinds; their meaning is part of the contract."""

    MISSING_DUMP = "missing_dump"
    MISSING_RANK = "missing_rank"
    OP_MISMATCH = "op_mismatch"
    SIZE_MISMATCH = "size_mismatch"
    DTYPE_MISMATCH = "dtype_mismatch"
    P2P_DEADLOCK = "p2p_deadlock"
    CROSS_PG_DEADLOCK = "cross_pg_deadlock"
    TIMEOUT = "timeout"
    STRAGGLER = "straggler"
    DEAD_RANK = "dead_rank"
    INCOMPLETE_DUMP = "incomplete_dump"


#: The status a finding of each kind implies, at error severity.
KIND_STATUS: Final = {
    FindingKind.OP_MISMATCH: Status.DESYNC,
    FindingKind.SIZE_MISMATCH: Status.DESYNC,
    FindingKind.DTYPE_MISMATCH: Status.DESYNC,
    FindingKind.MISSING_RANK: Status.HANG,
    FindingKind.TIMEOUT: Status.HANG,
    FindingKind.P2P_DEADLOCK: Status.HANG,
    FindingKind.CROSS_PG_DEADLOCK: Status.HANG,
    FindingKind.DEAD_RANK: Status.HANG,
    FindingKind.MISSING_DUMP: Status.HANG,
    FindingKind.STRAGGLER: Status.DEGRADED,
    FindingKind.INCOMPLETE_DUMP: Status.DEGRADED,
}

#: Default severity per kind (``missing_dump`` is an error only with waiters).
KIND_SEVERITY: Final = {
    kind: (Severity.WARNING if kind in (FindingKind.STRAGGLER, FindingKind.INCOMPLETE_DUMP)
           else Severity.ERROR)
    for kind in FindingKind
}

_STATUS_ORDER: Final = [Status.HEALTHY, Status.DEGRADED, Status.HANG, Status.DESYNC]


@dataclass(frozen=True, slots=True)
class GroupRef:
    """A process group in a report: name, description and global member ranks."""

    name: str
    desc: str
    #: a tuple, or a ``range`` where the members are the world the dumps claim
    ranks: Sequence[int] | None
    #: False for a group implied by a world-size claim too large to list per rank
    #: (``rankset.listable``): its JSON has ``ranks: null`` with ``ranks_count``
    #: and ``ranks_ranges`` (``[[first, last], ...]``) instead
    listed: bool = True

    def to_json(self) -> dict[str, Any]:
        if self.ranks is not None and not self.listed:
            spans = RankSet(rank_ranges(self.ranks) or [range(r, r + 1) for r in self.ranks])
            return {"name": self.name, "desc": self.desc, "ranks": None,
                    "ranks_count": len(spans), "ranks_ranges": spans.ranges()}
        return {"name": self.name, "desc": self.desc,
                "ranks": None if self.ranks is None else list(self.ranks)}

    @classmethod
    def from_json(cls, doc: object, where: str = "pg") -> GroupRef:
        """The inverse of :meth:`to_json` (a group too large to list: a ``RankSet``)."""
        d = _obj(doc, where)
        name, desc = _str(_key(d, "name", where), f"{where}.name"), _str(
            _key(d, "desc", where), f"{where}.desc")
        ranks = _key(d, "ranks", where)
        if ranks is None and "ranks_ranges" in d:
            return cls(name, desc, _spans(d, "ranks", where), listed=False)
        return cls(name, desc, None if ranks is None else _ranks(ranks, f"{where}.ranks"))

    def label(self) -> str:
        """``'default_pg (name 0, ranks 0-3)'``-style label for humans."""
        desc = self.desc if self.desc and self.desc != "undefined" else f"group {self.name}"
        members = "ranks unknown" if self.ranks is None else f"ranks {format_ranks(self.ranks)}"
        if desc == f"group {self.name}":
            return f"{desc} ({members})"
        return f"{desc} (name {self.name}, {members})"


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing wrong (or worth a warning), with the ranks it concerns."""

    kind: FindingKind
    severity: Severity
    message: str
    culprit_ranks: tuple[int, ...] = ()
    waiting_ranks: tuple[int, ...] = ()
    pg: GroupRef | None = None
    seq: int | None = None
    seq_kind: str | None = None
    op: str | None = None
    location: str | None = None
    evidence: Mapping[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> Status:
        """The job status this finding implies."""
        if self.severity is not Severity.ERROR:
            return Status.DEGRADED if self.severity is Severity.WARNING else Status.HEALTHY
        return KIND_STATUS[self.kind]

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "severity": self.severity.value,
            "culprit_ranks": list(self.culprit_ranks),
            "waiting_ranks": list(self.waiting_ranks),
            "pg": None if self.pg is None else self.pg.to_json(),
            "seq": self.seq,
            "seq_kind": self.seq_kind,
            "op": self.op,
            "location": self.location,
            "message": self.message,
            "evidence": dict(self.evidence),
        }

    @classmethod
    def from_json(cls, doc: object, where: str = "finding") -> Finding:
        """The inverse of :meth:`to_json`."""
        d = _obj(doc, where)

        def get(key: str) -> Any:
            return _key(d, key, where)

        pg = get("pg")
        evidence = _json_value(get("evidence"), f"{where}.evidence")
        if not isinstance(evidence, Mapping):
            raise _bad(f"{where}.evidence", "expected an object")
        return cls(
            kind=_enum(FindingKind, get("kind"), f"{where}.kind"),
            severity=_enum(Severity, get("severity"), f"{where}.severity"),
            message=_str(get("message"), f"{where}.message"),
            culprit_ranks=_ranks(get("culprit_ranks"), f"{where}.culprit_ranks"),
            waiting_ranks=_ranks(get("waiting_ranks"), f"{where}.waiting_ranks"),
            pg=None if pg is None else GroupRef.from_json(pg, f"{where}.pg"),
            seq=_opt_int(get("seq"), f"{where}.seq", low=None),
            seq_kind=_opt_str(get("seq_kind"), f"{where}.seq_kind"),
            op=_opt_str(get("op"), f"{where}.op"),
            location=_opt_str(get("location"), f"{where}.location"),
            evidence=dict(evidence),
        )


@dataclass(frozen=True, slots=True)
class RankFacts:
    """What is known about one rank (JSON ``ranks[str(rank)]``).

    ``local_rank``, ``cuda_device``, ``gpu_uuid``, ``pci_bus_id``: the rank's
    physical identity as its dump recorded it (``None`` when unknown or on CPU;
    in JSON only when known).
    """

    rank: int
    host: str | None = None
    pid: int | None = None
    dump_reason: str | None = None
    stuck_at: str | None = None
    blocked_in: str | None = None
    source: str | None = None
    format: str | None = None
    local_rank: int | None = None
    cuda_device: int | None = None
    gpu_uuid: str | None = None
    pci_bus_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "host": self.host,
            "pid": self.pid,
            "dump_reason": self.dump_reason,
            "stuck_at": self.stuck_at,
        }
        if self.blocked_in is not None:
            out["blocked_in"] = self.blocked_in
        if self.source is not None:
            out["source"] = self.source
        if self.format is not None:
            out["format"] = self.format
        for key in ("local_rank", "cuda_device", "gpu_uuid", "pci_bus_id"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

    @classmethod
    def from_json(cls, rank: int, doc: object, where: str) -> RankFacts:
        """The inverse of :meth:`to_json` (the rank is the document's key)."""
        d = _obj(doc, where)

        def opt(key: str, required: bool = False) -> Any:
            return _key(d, key, where) if required else d.get(key)

        return cls(
            rank=rank,
            host=_opt_str(opt("host", True), f"{where}.host"),
            pid=_opt_int(opt("pid", True), f"{where}.pid", low=None),
            dump_reason=_opt_str(opt("dump_reason", True), f"{where}.dump_reason"),
            stuck_at=_opt_str(opt("stuck_at", True), f"{where}.stuck_at"),
            blocked_in=_opt_str(opt("blocked_in"), f"{where}.blocked_in"),
            source=_opt_str(opt("source"), f"{where}.source"),
            format=_opt_str(opt("format"), f"{where}.format"),
            local_rank=_opt_int(opt("local_rank"), f"{where}.local_rank", low=None),
            cuda_device=_opt_int(opt("cuda_device"), f"{where}.cuda_device", low=None),
            gpu_uuid=_opt_str(opt("gpu_uuid"), f"{where}.gpu_uuid"),
            pci_bus_id=_opt_str(opt("pci_bus_id"), f"{where}.pci_bus_id"),
        )


#: What an orchestrator should do about a culprit rank (DESIGN §3, docs/detectors.md).
ACTIONS: Final = ("replace_gpu_or_host", "fix_code", "inspect")


@dataclass(frozen=True, slots=True)
class Action:
    """What to do about one culprit rank, with its physical identity.

    ``action``: ``replace_gpu_or_host`` (hardware-like: excluding the GPU/host
    helps), ``fix_code`` (a bug in the program: excluding it will not help) or
    ``inspect``. ``because``: the finding kind that decided it; ``detail``: why,
    in one sentence.
    """

    rank: int
    action: str
    because: str
    detail: str
    host: str | None = None
    local_rank: int | None = None
    cuda_device: int | None = None
    gpu_uuid: str | None = None
    pci_bus_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "action": self.action,
            "host": self.host,
            "local_rank": self.local_rank,
            "cuda_device": self.cuda_device,
            "gpu_uuid": self.gpu_uuid,
            "pci_bus_id": self.pci_bus_id,
            "because": self.because,
            "detail": self.detail,
        }

    @classmethod
    def from_json(cls, doc: object, where: str = "action") -> Action:
        """The inverse of :meth:`to_json`."""
        d = _obj(doc, where)

        def get(key: str) -> Any:
            return _key(d, key, where)

        action = _str(get("action"), f"{where}.action")
        if action not in ACTIONS:
            raise _bad(f"{where}.action", f"{action!r:.40} is not one of {', '.join(ACTIONS)}")
        return cls(
            rank=_int(get("rank"), f"{where}.rank"),
            action=action,
            because=_str(get("because"), f"{where}.because"),
            detail=_str(get("detail"), f"{where}.detail"),
            host=_opt_str(get("host"), f"{where}.host"),
            local_rank=_opt_int(get("local_rank"), f"{where}.local_rank", low=None),
            cuda_device=_opt_int(get("cuda_device"), f"{where}.cuda_device", low=None),
            gpu_uuid=_opt_str(get("gpu_uuid"), f"{where}.gpu_uuid"),
            pci_bus_id=_opt_str(get("pci_bus_id"), f"{where}.pci_bus_id"),
        )


@dataclass(frozen=True, slots=True)
class LoadProblem:
    """A file that could not be used (the analysis went on without it)."""

    path: str
    error: str

    def to_json(self) -> dict[str, str]:
        return {"path": self.path, "error": self.error}

    @classmethod
    def from_json(cls, doc: object, where: str = "load_problem") -> LoadProblem:
        """The inverse of :meth:`to_json`."""
        d = _obj(doc, where)
        return cls(_str(_key(d, "path", where), f"{where}.path"),
                   _str(_key(d, "error", where), f"{where}.error"))


@dataclass(frozen=True, slots=True)
class TimelineOp:
    """One recorded op of one rank, for timelines (times: wall-clock ns, 0 = unknown).

    ``blocking`` marks the op the analysis found this rank blocked in.
    """

    group: str
    group_label: str
    seq: int
    seq_kind: str
    op: str
    state: str
    t_enqueue_ns: int
    t_start_ns: int
    t_complete_ns: int
    peer: int = -1
    in_shapes: str = ""
    in_dtypes: str = ""
    location: str | None = None
    blocking: bool = False


@dataclass(frozen=True, slots=True)
class RankTimeline:
    """The ops a report can draw for one rank: the last ones and every unfinished one."""

    rank: int
    dump_time_ns: int | None
    ops: tuple[TimelineOp, ...]


def _worst(statuses: Iterable[Status]) -> Status:
    worst = Status.HEALTHY
    for s in statuses:
        if s in _STATUS_ORDER and _STATUS_ORDER.index(s) > _STATUS_ORDER.index(worst):
            worst = s
    return worst


@dataclass(frozen=True, slots=True)
class Report:
    """The verdict on one job's dumps."""

    world_size: int | None
    ranks_loaded: tuple[int, ...]
    #: a tuple, or a :class:`~frforensics.rankset.RankSet` when too many ranks left
    #: no dump to list them (``rankset.listable``; the JSON then has
    #: ``ranks_missing: null``, ``ranks_missing_count`` and ``ranks_missing_ranges``)
    ranks_missing: Sequence[int]
    culprit_ranks: tuple[int, ...]
    ranks: Mapping[int, RankFacts]
    findings: tuple[Finding, ...]
    load_problems: tuple[LoadProblem, ...] = ()
    notes: tuple[str, ...] = ()
    unreadable: bool = False
    #: Per-rank recent ops for drawn timelines (HTML); not part of the JSON contract.
    timeline: tuple[RankTimeline, ...] = ()
    #: One entry per culprit rank, in ``culprit_ranks`` order: what to do about it.
    actions: tuple[Action, ...] = ()

    @property
    def status(self) -> Status:
        """Most severe of the findings: desync > hang > degraded > healthy."""
        if self.unreadable:
            return Status.UNREADABLE
        statuses = [f.status for f in self.findings]
        if self.load_problems:
            statuses.append(Status.DEGRADED)
        return _worst(statuses)

    @property
    def has_errors(self) -> bool:
        return any(f.severity is Severity.ERROR for f in self.findings)

    @property
    def exit_code(self) -> int:
        """0 no error finding, 1 at least one, 2 nothing readable."""
        if self.unreadable:
            return 2
        return 1 if self.has_errors else 0

    def to_json(self) -> dict[str, Any]:
        """The ``frforensics.report/1`` document."""
        return {
            "schema": SCHEMA,
            "status": self.status.value,
            "world_size": self.world_size,
            "ranks_loaded": list(self.ranks_loaded),
            **self._missing_json(),
            "culprit_ranks": list(self.culprit_ranks),
            "ranks": {str(r): facts.to_json() for r, facts in sorted(self.ranks.items())},
            "findings": [f.to_json() for f in self.findings],
            "load_problems": [p.to_json() for p in self.load_problems],
            "actions": [a.to_json() for a in self.actions],
            "notes": list(self.notes),
        }

    @classmethod
    def from_json(cls, doc: object) -> Report:
        """The report a ``frforensics.report/1`` document (``to_json``, ``verdict.json``)
        describes: ``Report.from_json(r.to_json()).to_json() == r.to_json()``.

        The document is untrusted: a malformed one raises one
        :class:`ReportFormatError` naming the field; keys this version does not
        know are ignored. The drawn timeline is not part of the document (empty).
        """
        d = _obj(doc, "report")

        def get(key: str) -> Any:
            return _key(d, key, "")

        schema = get("schema")
        if schema != SCHEMA:
            raise _bad("schema", f"{schema!r:.60} is not {SCHEMA!r}")
        status = _enum(Status, get("status"), "status")
        missing_doc = get("ranks_missing")
        missing: Sequence[int] = (_spans(d, "ranks_missing", "")
                                  if missing_doc is None else _ranks(missing_doc, "ranks_missing"))
        ranks_doc = _obj(get("ranks"), "ranks")
        ranks: dict[int, RankFacts] = {}
        for key, facts in ranks_doc.items():
            if type(key) is not str or not key.isdigit() or not key.isascii() \
                    or str(int(key)) != key:
                raise _bad(f"ranks.{key!s:.40}", "a key is a rank number")
            ranks[int(key)] = RankFacts.from_json(int(key), facts, f"ranks.{key}")
        report = cls(
            world_size=_opt_int(get("world_size"), "world_size", low=1),
            ranks_loaded=_ranks(get("ranks_loaded"), "ranks_loaded"),
            ranks_missing=missing,
            culprit_ranks=_ranks(get("culprit_ranks"), "culprit_ranks"),
            ranks=ranks,
            findings=tuple(Finding.from_json(f, f"findings[{i}]")
                           for i, f in enumerate(_list(get("findings"), "findings"))),
            load_problems=tuple(LoadProblem.from_json(p, f"load_problems[{i}]")
                                for i, p in enumerate(_list(get("load_problems"),
                                                            "load_problems"))),
            notes=tuple(_str(n, f"notes[{i}]") for i, n in enumerate(_list(get("notes"), "notes"))),
            unreadable=status is Status.UNREADABLE,
            actions=tuple(Action.from_json(a, f"actions[{i}]")
                          for i, a in enumerate(_list(get("actions"), "actions"))),
        )
        if report.status is not status:
            raise _bad("status", f"says {status.value!r}, but its findings and load problems "
                                 f"make it {report.status.value!r}")
        return report

    def _missing_json(self) -> dict[str, Any]:
        if isinstance(self.ranks_missing, RankSet):
            return {"ranks_missing": None, "ranks_missing_count": len(self.ranks_missing),
                    "ranks_missing_ranges": self.ranks_missing.ranges()}
        return {"ranks_missing": list(self.ranks_missing)}


def code_sides(finding: Finding, *, limit: int = 4) -> list[str]:
    """For a mismatch: ``'ranks 0,2-3: train.py:73 in step (all_reduce)'`` per distinct
    call site, from ``evidence.locations`` (and ``evidence.values``); [] otherwise."""
    locations = finding.evidence.get("locations") if finding.evidence else None
    if not isinstance(locations, dict) or len(set(locations.values())) < 2:
        return []
    values = finding.evidence.get("values")
    sides: dict[tuple[str, str], list[int]] = {}
    for rank, where in locations.items():
        what = str(values.get(rank, "")) if isinstance(values, dict) else ""
        with_rank = sides.setdefault((str(where), what), [])
        if str(rank).isdigit():
            with_rank.append(int(rank))
    ordered = sorted(sides.items(), key=lambda kv: len(kv[1]))
    lines = [f"rank{'s' if len(r) > 1 else ''} {format_ranks(r)}: {where}"
             + (f" ({what})" if what else "") for (where, what), r in ordered]
    return lines[:limit]


def culprit_code(finding: Finding, *, limit: int = 3) -> list[str]:
    """For a finding whose culprits stand elsewhere than the op they never joined
    (``evidence.culprit_code``): ``'rank 2: train.py:199 in idle (called from ...)'``
    per culprit, then the op's call site, where the waiters stand; [] otherwise."""
    where = finding.evidence.get("culprit_code") if finding.evidence else None
    if not isinstance(where, dict) or not where:
        return []
    named = {str(r) for r in finding.culprit_ranks}
    lines = [f"rank {rank}: {at}" for rank, at in where.items() if rank in named][:limit]
    if not lines:
        return []
    if finding.location:
        number = "" if finding.seq is None else (
            f" #{finding.seq}" if finding.seq_kind == "collective" else f" (p2p #{finding.seq})")
        lines.append(f"never joined {finding.op or '?'}{number}, called at {finding.location} "
                     "(where the waiters are)")
    return lines


def format_ranks(ranks: Sequence[int] | Iterable[int], *, limit: int = 12) -> str:
    """Compact rank list: ``[0,1,2,3,7,9,10]`` -> ``'0-3,7,9-10'``.

    Beyond ``limit`` ranges the tail is summarized, so 10,000 ranks stay one line.
    A :class:`~frforensics.rankset.RankSet` or a ``range`` is rendered from its
    spans, without visiting each rank (a claimed world of 2^20 ranks).
    """
    known = rank_ranges(ranks)
    if known is not None:
        pairs = [(s.start, s.stop - 1) for s in known]
        count = sum(len(s) for s in known)
    else:
        values = sorted(set(ranks))
        count = len(values)
        pairs = []
        if values:
            start = prev = values[0]
            for r in values[1:]:
                if r == prev + 1:
                    prev = r
                    continue
                pairs.append((start, prev))
                start = prev = r
            pairs.append((start, prev))
    if not pairs:
        return "none"
    spans = [f"{a}" if a == b else f"{a}-{b}" for a, b in pairs]
    if len(spans) > limit:
        shown = ",".join(spans[:limit])
        return f"{shown},… ({count} ranks in {len(spans)} ranges)"
    return ",".join(spans)


@dataclass(frozen=True, slots=True)
class RankState:
    """Ranks that were doing the same thing at dump time."""

    state: str
    #: a tuple, or the report's RankSet of ranks without a dump (too many to list)
    ranks: Sequence[int]

    @property
    def ranks_label(self) -> str:
        return format_ranks(self.ranks)


def rank_states(report: Report) -> list[RankState]:
    """Ranks grouped by what they were doing, biggest group first."""
    groups: dict[str, list[int]] = defaultdict(list)
    for rank, facts in report.ranks.items():
        if facts.blocked_in:
            key = f"blocked in {facts.blocked_in}"
        elif facts.stuck_at:
            key = f"not in a collective; main thread at {facts.stuck_at}"
        else:
            key = "not blocked in any recorded op"
        groups[key].append(rank)
    states = [RankState(k, tuple(sorted(v))) for k, v in groups.items()]
    if report.ranks_missing:
        missing = report.ranks_missing
        states.append(RankState("no dump", missing if isinstance(missing, RankSet)
                                else tuple(sorted(missing))))
    states.sort(key=lambda s: (-len(s.ranks), s.ranks[0]))
    return states


#: ranks a drawn timeline (HTML) shows at most
TIMELINE_RANKS = 32


def timeline_ranks(report: Report, available: Collection[int], limit: int) -> list[int]:
    """The ranks a drawn timeline shows: culprits first, then a few ranks of each
    state, filled up in rank order; at most ``limit``, all from ``available``."""
    chosen: list[int] = [r for r in report.culprit_ranks if r in available][:limit // 2]
    states = rank_states(report)
    per_state = max(1, (limit - len(chosen)) // max(1, len(states)))
    for st in states:
        for r in st.ranks[:per_state]:
            if r in available and r not in chosen and len(chosen) < limit:
                chosen.append(r)
    for r in sorted(available):  # fill up, small jobs show every rank
        if len(chosen) >= limit:
            break
        if r not in chosen:
            chosen.append(r)
    chosen.sort(key=lambda r: (r not in report.culprit_ranks, r))
    return chosen
