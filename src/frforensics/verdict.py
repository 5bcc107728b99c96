"""The verdict documents that cross process boundaries, typed: ``Verdict``, ``Action``,
``StragglerReport``, and the exit codes the job side uses.

A verdict leaves the process that made it as JSON — the c10d store key
``frforensics/<R>/verdict/<k>`` (the recorder's elected rank), recovery's
``<uuid>/verdict`` and ``<uuid>/plan`` keys, the ``on_verdict`` hooks, the live
``stragglers.json`` — and every reader parses it back here, once:
``Verdict.from_json`` validates each field it reads and raises
:class:`VerdictError` naming the field (``actions[0].rank is 'two' (want an int
member id)``). The contract for orchestrators is docs/orchestrators.md; this
module writes exactly those fields.

Producers and their fields (``to_json`` writes the keys in this order, each only
when its producer set it, so every producer's JSON is what it wrote before the
type existed):

=========================  ====================================================
recorder (elected rank)    schema incident status culprit_ranks actions headline
                           text elected_rank host verdict_json verdict_txt inputs
                           digest_bytes time_ns seconds_after_flag error
                           analysis_s
recovery: planned          schema status culprit_ranks actions headline error
recovery: agent (killed)   schema status culprit_ranks actions headline evidence
                           source error
recovery: dump directory   schema status culprit_ranks actions headline text
                           source error
=========================  ====================================================

``seconds_after_flag`` is written whenever ``time_ns`` is (``null`` when the dump
flag's time was unknown), as the recorder always did. ``status``, ``culprit_ranks``,
``actions``, ``headline`` and ``error`` are always written. Fields this module does
not know are **kept** (``extra``, written after the known ones in the order read),
so a newer producer's document passes through an older reader unchanged.

Worked example (4 ranks, rank 2 skipped an all_reduce; the recorder's key)::

    {"schema": "frforensics.verdict/1", "incident": 0, "status": "hang",
     "culprit_ranks": [2], "actions": [{"rank": 2, "action": "fix_code", ...}],
     "headline": "HANG — missing_rank: Rank 2 never entered all_reduce #5 ...", ...}

    Verdict.from_json(doc).actions[0].rank == 2
    Verdict.from_json(doc).to_json() == doc

One headline rule (:func:`headline`): ``"<STATUS> — <what>"``, the status in
capitals — the text reporter's first line (``reporting/text.py``), which the
recorder's headline is; recovery's planned (``PLANNED — ...``), agent
(``DEAD — ...``) and dump-directory verdicts use the same function.

Stdlib only: the recorder (in the training process), recovery, the debug page
and the analyzer side may all import it (docs/design.md, the part map).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from frforensics.errors import FrForensicsError

__all__ = [
    "EXIT_EXCLUDED",
    "EXIT_NO_VERDICT",
    "EXIT_VERDICT",
    "SCHEMA",
    "STRAGGLERS_SCHEMA",
    "Action",
    "StragglerReport",
    "Verdict",
    "VerdictError",
    "first_clause",
    "headline",
    "report_headline",
]

SCHEMA: Final = "frforensics.verdict/1"
STRAGGLERS_SCHEMA: Final = "frforensics.stragglers/1"

#: Exit code of every rank after the verdict, with ``abort_after_verdict``
#: (``EX_TEMPFAIL`` of sysexits.h: restart now).
EXIT_VERDICT: Final = 75
#: Exit code with ``abort_after_verdict`` when no verdict could be had.
EXIT_NO_VERDICT: Final = 76
#: Exit code of a process recovery told it was excluded from the job.
EXIT_EXCLUDED: Final = 79

#: The most characters of a verdict document read from the store or a file.
MAX_CHARS: Final = 1 << 22
#: The most entries of ``culprit_ranks``, ``actions``, ``evidence``, ``findings``
#: (formats.limits' max_rank: a larger list names more ranks than any job has).
MAX_ITEMS: Final = 1 << 20


class VerdictError(FrForensicsError, ValueError):
    """A verdict document that is not the contract; the message names the field."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"malformed verdict: {detail}")
        #: the field and what is wrong with it, e.g. ``actions[0].rank is 'two' (...)``
        self.detail = detail


def headline(status: str, what: str) -> str:
    """The one headline rule: ``"<STATUS> — <what>"`` (``HANG — missing_rank: ...``)."""
    return f"{status.upper()} — {what}"


def first_clause(message: str) -> str:
    """A finding's message up to its first ``"; "`` or ``". "`` outside parentheses,
    capitalized: the text reporter's headline of a finding (``reporting/text.py``)."""
    text = message
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and ch in ";." and text[i + 1:i + 2] == " " and i > 0:
            text = text[:i]
            break
    return text[:1].upper() + text[1:]


def report_headline(report: Mapping[str, Any]) -> str:
    """The headline of an ``frforensics.report/1`` JSON report: its status, its first
    finding's kind and first clause — the text reporter's first line (before the
    terminal wraps it), on one line with every control character escaped (the
    message quotes dump strings: a dump must not forge a log line)."""
    findings = report.get("findings")
    first = findings[0] if isinstance(findings, list) and findings else None
    what = (f"{first.get('kind', '')}: {first_clause(str(first.get('message', '')))}"
            if isinstance(first, Mapping) else "no finding")
    return _printable(headline(str(report.get("status", "")), what))


# the rule of reporting/_escape.printable: C0/C1 controls, DEL, line/paragraph
# separators, bidi embeddings/overrides/isolates, BOM -> a visible escape
_UNSAFE: Final = re.compile(
    "[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\ufeff]")
_NAMED: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\x1b": "\\x1b"}


def _printable(text: str) -> str:
    def escape(match: re.Match[str]) -> str:
        ch = match.group(0)
        code = ord(ch)
        return _NAMED.get(ch) or (f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}")

    return _UNSAFE.sub(escape, text)


# ---------------------------------------------------------------- field checks

def _type(value: Any) -> str:
    return type(value).__name__


def _int(obj: Mapping[str, Any], key: str, where: str, *, want: str = "an int",
         minimum: int | None = None, required: bool = False) -> int | None:
    if key not in obj or (obj[key] is None and not required):
        if required:
            raise VerdictError(f"{where}{key} is missing")
        return None
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise VerdictError(f"{where}{key} is {_short(v)} (want {want})")
    if minimum is not None and v < minimum:
        raise VerdictError(f"{where}{key} is {v} (want {want})")
    return v


def _str(obj: Mapping[str, Any], key: str, where: str) -> str | None:
    v = obj.get(key)
    if v is not None and not isinstance(v, str):
        raise VerdictError(f"{where}{key} is {_short(v)} (want a string)")
    return v


def _number(obj: Mapping[str, Any], key: str, where: str) -> float | None:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise VerdictError(f"{where}{key} is {_short(v)} (want a number)")
    return v


def _object(obj: Mapping[str, Any], key: str, where: str) -> dict[str, Any] | None:
    v = obj.get(key)
    if v is not None and not isinstance(v, dict):
        raise VerdictError(f"{where}{key} is {_type(v)}, not an object")
    return v


def _list(obj: Mapping[str, Any], key: str, where: str) -> list[Any] | None:
    v = obj.get(key)
    if v is None:
        return None
    if not isinstance(v, list):
        raise VerdictError(f"{where}{key} is {_type(v)}, not a list")
    if len(v) > MAX_ITEMS:
        raise VerdictError(f"{where}{key} has {len(v)} entries (at most {MAX_ITEMS})")
    return v


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _ranks(obj: Mapping[str, Any], key: str, where: str = "") -> tuple[int, ...]:
    raw = _list(obj, key, where) or []
    for i, r in enumerate(raw):
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise VerdictError(f"{where}{key}[{i}] is {_short(r)} (want a rank: an int >= 0)")
    return tuple(raw)


def _objects(obj: Mapping[str, Any], key: str, where: str = "") -> tuple[dict[str, Any], ...]:
    raw = _list(obj, key, where) or []
    for i, x in enumerate(raw):
        if not isinstance(x, dict):
            raise VerdictError(f"{where}{key}[{i}] is {_type(x)}, not an object")
    return tuple(raw)


def _extra(obj: Mapping[str, Any], known: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in known}


# ---------------------------------------------------------------- the documents

@dataclass(frozen=True, slots=True)
class Action:
    """What to do about one culprit rank (docs/orchestrators.md, "The actions contract").

    ``action``: ``replace_gpu_or_host``, ``fix_code`` or ``inspect``; ``because``:
    the finding kind that decided it (``planned``/``killed`` for recovery's own);
    ``detail``: why, in one sentence (the analyzer's actions only). ``rank`` is an
    int (never a bool, float or string); whether it names a member of the job is
    the reader's check (recovery's ``exclusion_from``).
    """

    rank: int
    action: str
    because: str | None = None
    detail: str | None = None
    host: str | None = None
    local_rank: int | None = None
    cuda_device: int | None = None
    gpu_uuid: str | None = None
    pci_bus_id: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    _IDENTITY: ClassVar[tuple[str, ...]] = ("host", "local_rank", "cuda_device", "gpu_uuid",
                                            "pci_bus_id")
    _KNOWN: ClassVar[tuple[str, ...]] = ("rank", "action", "because", "detail", *_IDENTITY)

    def to_json(self) -> dict[str, Any]:
        """The analyzer's nine keys (``report.Action.to_json``'s order, ``null`` where
        unknown) when the action has a ``detail``; else ``rank``, ``action``,
        ``because`` and the identity fields that are set (recovery's actions)."""
        out: dict[str, Any] = {"rank": self.rank, "action": self.action}
        if self.detail is not None:
            out.update({k: getattr(self, k) for k in self._IDENTITY})
            out["because"] = self.because
            out["detail"] = self.detail
        else:
            if self.because is not None:
                out["because"] = self.because
            out.update({k: getattr(self, k) for k in self._IDENTITY
                        if getattr(self, k) is not None})
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, obj: Any, where: str = "action") -> Action:
        """An action read from untrusted JSON; :class:`VerdictError` names the field."""
        if not isinstance(obj, dict):
            raise VerdictError(f"{where} is {_type(obj)}, not an object")
        at = f"{where}."
        what = obj.get("action")
        if not isinstance(what, str):
            raise VerdictError(f"{at}action is {_short(what)} (want a string)")
        rank = _int(obj, "rank", at, want="an int member id", required=True)
        assert rank is not None
        return cls(rank=rank, action=what, because=_str(obj, "because", at),
                   detail=_str(obj, "detail", at), host=_str(obj, "host", at),
                   local_rank=_int(obj, "local_rank", at),
                   cuda_device=_int(obj, "cuda_device", at),
                   gpu_uuid=_str(obj, "gpu_uuid", at), pci_bus_id=_str(obj, "pci_bus_id", at),
                   extra=_extra(obj, cls._KNOWN))


def _actions(obj: Mapping[str, Any]) -> tuple[Action, ...]:
    raw = _list(obj, "actions", "") or []
    return tuple(Action.from_json(a, f"actions[{i}]") for i, a in enumerate(raw))


@dataclass(frozen=True, slots=True)
class Verdict:
    """One ``frforensics.verdict/1`` document (the module doc lists who sets what).

    ``None`` in an optional field means its producer did not write it; ``extra``
    holds the fields this version does not know, kept as read.
    """

    status: str | None
    culprit_ranks: tuple[int, ...] = ()
    actions: tuple[Action, ...] = ()
    headline: str = ""
    error: str | None = None
    incident: int | None = None
    #: the human verdict block (the text reporter's, first line = ``headline``)
    text: str | None = None
    #: the recorder's elected rank and where its report is
    elected_rank: int | None = None
    host: str | None = None
    verdict_json: str | None = None
    verdict_txt: str | None = None
    #: ``files``/``digests``/``none``/``skipped``: what the elected rank analyzed
    inputs: Mapping[str, Any] | None = None
    digest_bytes: Mapping[str, Any] | None = None
    time_ns: int | None = None
    seconds_after_flag: float | None = None
    #: frforensics-run's agent: its exit records of the members
    evidence: tuple[Mapping[str, Any], ...] | None = None
    #: who made it when not the recorder (``frforensics-run``, a dump directory)
    source: str | None = None
    analysis_s: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    _ORDER: ClassVar[tuple[str, ...]] = (
        "schema", "incident", "status", "culprit_ranks", "actions", "headline", "text",
        "elected_rank", "host", "verdict_json", "verdict_txt", "inputs", "digest_bytes",
        "time_ns", "seconds_after_flag", "evidence", "source", "error", "analysis_s")
    _ALWAYS: ClassVar[frozenset[str]] = frozenset(
        {"schema", "status", "culprit_ranks", "actions", "headline", "error"})

    def ranks_to(self, action: str) -> list[int]:
        """The ranks whose action is ``action``, sorted, each once."""
        return sorted({a.rank for a in self.actions if a.action == action})

    def to_json(self) -> dict[str, Any]:
        """The JSON object (the store key's value, what ``on_verdict`` hooks receive)."""
        values: dict[str, Any] = {
            "schema": SCHEMA, "incident": self.incident, "status": self.status,
            "culprit_ranks": list(self.culprit_ranks),
            "actions": [a.to_json() for a in self.actions], "headline": self.headline,
            "text": self.text, "elected_rank": self.elected_rank, "host": self.host,
            "verdict_json": self.verdict_json, "verdict_txt": self.verdict_txt,
            "inputs": None if self.inputs is None else dict(self.inputs),
            "digest_bytes": None if self.digest_bytes is None else dict(self.digest_bytes),
            "time_ns": self.time_ns, "seconds_after_flag": self.seconds_after_flag,
            "evidence": None if self.evidence is None else [dict(e) for e in self.evidence],
            "source": self.source, "error": self.error, "analysis_s": self.analysis_s,
        }
        out = {k: values[k] for k in self._ORDER
               if k in self._ALWAYS or values[k] is not None
               or (k == "seconds_after_flag" and self.time_ns is not None)}
        out.update(self.extra)
        return out

    def dumps(self) -> str:
        """``json.dumps(self.to_json())``: the value a store key holds."""
        return json.dumps(self.to_json())

    @classmethod
    def from_json(cls, obj: Any, *, require_schema: bool = True) -> Verdict:
        """A verdict read from untrusted JSON (a store value, a file, a hook's caller).

        Every field read is checked; the first wrong one raises :class:`VerdictError`
        naming it. ``require_schema=False`` accepts a document without ``schema``
        (a user's ``verdict_source`` may return one); a wrong ``schema`` is refused
        either way.
        """
        if not isinstance(obj, dict):
            raise VerdictError(f"{_type(obj)}, not an object")
        schema = obj.get("schema")
        if schema != SCHEMA and (require_schema or schema is not None):
            raise VerdictError(f"schema is {_short(schema)} (want {SCHEMA!r})")
        actions = _actions(obj)
        head = obj.get("headline", "")
        if not isinstance(head, str):
            raise VerdictError(f"headline is {_short(head)} (want a string)")
        evidence = _objects(obj, "evidence") if obj.get("evidence") is not None else None
        return cls(
            status=_str(obj, "status", ""), culprit_ranks=_ranks(obj, "culprit_ranks"),
            actions=actions, headline=head, error=_str(obj, "error", ""),
            incident=_int(obj, "incident", "", want="an incident number >= 0", minimum=0),
            text=_str(obj, "text", ""),
            elected_rank=_int(obj, "elected_rank", "", want="a rank: an int >= 0", minimum=0),
            host=_str(obj, "host", ""), verdict_json=_str(obj, "verdict_json", ""),
            verdict_txt=_str(obj, "verdict_txt", ""), inputs=_object(obj, "inputs", ""),
            digest_bytes=_object(obj, "digest_bytes", ""), time_ns=_int(obj, "time_ns", ""),
            seconds_after_flag=_number(obj, "seconds_after_flag", ""),
            evidence=evidence, source=_str(obj, "source", ""),
            analysis_s=_number(obj, "analysis_s", ""),
            extra=_extra(obj, cls._ORDER))

    @classmethod
    def loads(cls, raw: str | bytes | bytearray) -> Verdict:
        """A verdict from a store value or file's bytes: at most :data:`MAX_CHARS`
        characters of JSON, then :meth:`from_json`."""
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes | bytearray) else raw
        if len(text) > MAX_CHARS:
            raise VerdictError(f"{len(text)} characters (at most {MAX_CHARS})")
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise VerdictError(f"not JSON: {str(exc)[:100]}") from None
        return cls.from_json(obj)


@dataclass(frozen=True, slots=True)
class StragglerReport:
    """The live straggler document (``frforensics.stragglers/1``, ``stragglers.json``
    and the ``on_verdict`` hooks): the straggler findings of one round, as the
    analyzer's JSON report wrote them, and their ``replace_gpu_or_host`` actions."""

    round: int
    time_ns: int
    findings: tuple[Mapping[str, Any], ...]
    actions: tuple[Action, ...]
    culprit_ranks: tuple[int, ...]
    stragglers_json: str
    extra: Mapping[str, Any] = field(default_factory=dict)

    kind: ClassVar[str] = "straggler"
    _KNOWN: ClassVar[tuple[str, ...]] = ("schema", "kind", "round", "time_ns", "findings",
                                         "actions", "culprit_ranks", "stragglers_json")

    def to_json(self) -> dict[str, Any]:
        return {"schema": STRAGGLERS_SCHEMA, "kind": self.kind, "round": self.round,
                "time_ns": self.time_ns, "findings": [dict(f) for f in self.findings],
                "actions": [a.to_json() for a in self.actions],
                "culprit_ranks": list(self.culprit_ranks),
                "stragglers_json": self.stragglers_json, **self.extra}

    @classmethod
    def from_json(cls, obj: Any) -> StragglerReport:
        """A straggler document read from untrusted JSON; :class:`VerdictError` names
        the field."""
        if not isinstance(obj, dict):
            raise VerdictError(f"{_type(obj)}, not an object")
        if obj.get("schema") != STRAGGLERS_SCHEMA:
            raise VerdictError(f"schema is {_short(obj.get('schema'))} "
                               f"(want {STRAGGLERS_SCHEMA!r})")
        if obj.get("kind") != cls.kind:
            raise VerdictError(f"kind is {_short(obj.get('kind'))} (want 'straggler')")
        rnd = _int(obj, "round", "", want="an int >= 0", minimum=0, required=True)
        t = _int(obj, "time_ns", "", required=True)
        path = obj.get("stragglers_json")
        if not isinstance(path, str):
            raise VerdictError(f"stragglers_json is {_short(path)} (want a string)")
        assert rnd is not None and t is not None
        return cls(round=rnd, time_ns=t, findings=_objects(obj, "findings"),
                   actions=_actions(obj), culprit_ranks=_ranks(obj, "culprit_ranks"),
                   stragglers_json=path, extra=_extra(obj, cls._KNOWN))
