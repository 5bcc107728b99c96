"""The typed verdict documents (frforensics.verdict): every producer's JSON round-trips
unchanged, untrusted input is refused naming the field, one headline rule."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from frforensics import recovery, verdict
from frforensics.errors import FrForensicsError
from frforensics.recorder import _live, _verdict
from frforensics.verdict import Action, StragglerReport, Verdict, VerdictError

SAMPLES = Path(__file__).resolve().parents[2] / "sample_dumps"

#: docs/orchestrators.md: the store key's document, in the order the recorder writes it
RECORDER_KEYS = ["schema", "incident", "status", "culprit_ranks", "actions", "headline", "text",
                 "elected_rank", "host", "verdict_json", "verdict_txt", "inputs", "digest_bytes",
                 "time_ns", "seconds_after_flag", "error", "analysis_s"]


def _analyze(sample: str, out: Path) -> tuple[dict[str, Any], str]:
    """The recorder's analysis child on a sample's frdumps (``_verdict._lead``'s command)."""
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(str(p) for p in (SAMPLES / sample / "frdump").glob("frdump_rank_*"))
    listing = out / "paths.txt"
    listing.write_text("\n".join(files) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "frforensics", "verdict", "--paths-from", str(listing),
         "--out-dir", str(out), "--world-size", str(len(files)), "--jobs", "1"],
        capture_output=True, timeout=120, check=False, stdin=subprocess.DEVNULL)
    assert proc.returncode in (0, 1), proc.stderr.decode()[-2000:]
    report = json.loads((out / "verdict.json").read_text(encoding="utf-8"))
    return report, proc.stdout.decode("utf-8", "replace")


def _round_trips(doc: dict[str, Any]) -> Verdict:
    """The document parses, and writes back the same JSON text (key order included)."""
    v = Verdict.loads(json.dumps(doc))
    assert json.dumps(v.to_json()) == json.dumps(doc)
    assert Verdict.from_json(v.to_json()) == v
    return v


@pytest.mark.parametrize("sample", ["missing_rank", "op_mismatch", "straggler"])
def test_the_recorders_verdict_from_a_real_analysis_round_trips_with_the_documented_fields(
        tmp_path: Path, sample: str) -> None:
    report, text = _analyze(sample, tmp_path)
    inputs = {"files": [0, 1, 2, 3], "digests": [], "none": [], "skipped": []}
    made = dataclasses.replace(
        _verdict.compact(0, report, text, inputs, None, tmp_path, elected_rank=0, host="vm",
                         digest_bytes={"ranks": 4, "total": 0, "max": 0},
                         flag_ns=10**18, now_ns=10**18 + 5_716_000_000),
        analysis_s=1.25)
    doc = made.to_json()
    assert list(doc) == RECORDER_KEYS
    # the contract: the report's culprits and actions, unchanged
    assert doc["actions"] == report["actions"] and doc["culprit_ranks"] == report["culprit_ranks"]
    assert doc["status"] == report["status"] and doc["error"] is None
    assert doc["seconds_after_flag"] == 5.716
    # the one headline rule: the text reporter's first line, whole where the terminal
    # width wrapped it (op_mismatch's is longer than 100 columns)
    assert doc["headline"] == verdict.report_headline(report)
    first = (tmp_path / "verdict.txt").read_text(encoding="utf-8").splitlines()[0].rstrip()
    assert doc["headline"].startswith(first) and len(first) > 40
    assert doc["text"].startswith(first)
    v = _round_trips(doc)
    assert v.actions and all(isinstance(a, Action) for a in v.actions)
    assert [a.to_json() for a in v.actions] == report["actions"]


def test_a_failed_analysis_is_an_error_verdict_with_the_headline_rule(tmp_path: Path) -> None:
    v = _verdict.compact(3, None, "", {"files": [], "digests": [], "none": [], "skipped": []},
                         "the analysis took longer than 60 s", tmp_path, elected_rank=1,
                         host="h", digest_bytes={}, flag_ns=None, now_ns=1)
    doc = v.to_json()
    assert (doc["status"], doc["actions"], doc["culprit_ranks"]) == ("error", [], [])
    assert doc["headline"] == "ERROR — the analysis took longer than 60 s"
    assert doc["seconds_after_flag"] is None and "seconds_after_flag" in doc
    _round_trips(doc)


def test_a_report_whose_actions_are_not_the_contract_is_an_error_verdict(
        tmp_path: Path) -> None:
    report = {"status": "hang", "culprit_ranks": [2], "actions": [{"rank": "2",
                                                                    "action": "fix_code"}]}
    v = _verdict.compact(0, report, "HANG — x\n", {}, None, tmp_path, elected_rank=0,
                         host="h", digest_bytes={}, flag_ns=None, now_ns=1)
    assert v.status == "error" and v.actions == ()
    assert v.error is not None and "actions[0].rank is '2'" in v.error


class _Store:
    def __init__(self, values: dict[str, bytes] | None = None) -> None:
        self.values = dict(values or {})

    def compare_set(self, key: str, expected: str, value: str) -> bytes:
        if self.values.get(key, b"").decode() == expected:
            self.values[key] = value.encode()
        return self.values[key]

    def add(self, key: str, n: int) -> int:
        return len([k for k in self.values if k.startswith("exit/")])

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.values[k] for k in keys]


def test_a_planned_exclusion_writes_the_document_it_always_wrote(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = _Store()
    st = type("St", (), {"store": store, "uuid": 1, "attempt": 0, "members": [0, 1, 2, 3]})()
    monkeypatch.setattr(recovery, "state", lambda: st)
    assert recovery.propose_exclusion([3, 1, 3], "straggler in 3 windows") is True
    raw = store.values["2/plan"].decode()
    assert raw == json.dumps({
        "schema": "frforensics.verdict/1", "status": "planned", "culprit_ranks": [1, 3],
        "actions": [{"rank": 1, "action": "replace_gpu_or_host", "because": "planned"},
                    {"rank": 3, "action": "replace_gpu_or_host", "because": "planned"}],
        "headline": "PLANNED — straggler in 3 windows", "error": None})
    v = _round_trips(json.loads(raw))
    assert v.ranks_to("replace_gpu_or_host") == [1, 3]
    assert recovery.exclusion_from(json.loads(raw), [0, 1, 2, 3]) == [1, 3]


def test_the_agents_verdict_names_the_killed_rank_with_its_evidence() -> None:
    record = recovery.exit_record(3, -9, host="node3", pid=42)
    other = recovery.exit_record(1, 1, host="node1", pid=41)
    store = _Store({"exit/3": json.dumps(record).encode(), "exit/1": json.dumps(other).encode()})
    st = type("St", (), {"store": store, "members": [0, 1, 2, 3]})()
    found = recovery._agent_verdict(st)  # type: ignore[arg-type]
    assert isinstance(found, verdict.Verdict)  # typed from the source to the exclusion
    doc = found.to_json()
    evidence = sorted([other, record], key=lambda r: r["time_ns"])
    assert json.dumps(doc) == json.dumps({
        "schema": "frforensics.verdict/1", "status": "dead", "culprit_ranks": [3],
        "actions": [{"rank": 3, "action": "replace_gpu_or_host", "because": "killed"}],
        "headline": "DEAD — rank 3 on node3 killed by SIGKILL (exit code -9, pid 42): the OOM "
                    "killer or the host (frforensics-run's agent)",
        "evidence": evidence, "source": "frforensics-run", "error": None})
    v = _round_trips(doc)
    assert v.evidence is not None and len(v.evidence) == 2


def test_the_dump_directory_verdict_uses_the_report_and_the_headline_rule(
        tmp_path: Path) -> None:
    for p in (SAMPLES / "missing_rank" / "frdump").glob("frdump_rank_*"):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    found = recovery.verdict_from_dump_dir(tmp_path, world_size=4)(120.0, "test")
    assert isinstance(found, verdict.Verdict)
    doc = found.to_json()
    assert list(doc) == ["schema", "status", "culprit_ranks", "actions", "headline", "text",
                         "source", "error"]
    assert doc["headline"].startswith("HANG — missing_rank: Rank 2 never entered all_reduce")
    assert doc["text"] == doc["headline"] and doc["source"] == str(tmp_path)
    assert [a["rank"] for a in doc["actions"]] == [2] == doc["culprit_ranks"]
    _round_trips(doc)


def test_the_live_straggler_document_round_trips(tmp_path: Path) -> None:
    report, _ = _analyze("straggler", tmp_path)
    doc = _live.straggler_report(report, 4, tmp_path, 77).to_json()
    found = [f for f in report["findings"] if f["kind"] == "straggler"]
    assert found, report["findings"]
    # what LiveStragglers._analyze writes (stragglers.json, docs/orchestrators.md)
    assert json.dumps(doc) == json.dumps({
        "schema": "frforensics.stragglers/1", "kind": "straggler", "round": 4, "time_ns": 77,
        "findings": found,
        "actions": [a for a in report["actions"] if a["because"] == "straggler"],
        "culprit_ranks": sorted({r for f in found for r in f["culprit_ranks"]}),
        "stragglers_json": str(tmp_path / "stragglers.json")})
    back = StragglerReport.from_json(json.loads(json.dumps(doc)))
    assert back.to_json() == doc and back.actions[0].action == "replace_gpu_or_host"


def test_unknown_fields_are_kept_in_order_after_the_known_ones() -> None:
    doc = {"schema": verdict.SCHEMA, "status": "hang", "culprit_ranks": [1],
           "actions": [{"rank": 1, "action": "inspect", "because": "x", "why_not": [1]}],
           "headline": "HANG — x", "error": None, "zz_new": {"a": 1}, "aa_new": 2}
    v = _round_trips(doc)
    assert v.extra == {"zz_new": {"a": 1}, "aa_new": 2}
    assert v.actions[0].extra == {"why_not": [1]}


_BASE: dict[str, Any] = {
    "schema": "frforensics.verdict/1", "incident": 0, "status": "hang", "culprit_ranks": [2],
    "actions": [{"rank": 2, "action": "replace_gpu_or_host", "host": "n2", "local_rank": 2,
                 "cuda_device": 2, "gpu_uuid": "GPU-1", "pci_bus_id": "0:1", "because": "x",
                 "detail": "d"}],
    "headline": "HANG — x", "text": "HANG — x", "elected_rank": 0, "host": "n0",
    "verdict_json": "/d/verdict.json", "verdict_txt": "/d/verdict.txt",
    "inputs": {"files": [0]}, "digest_bytes": {"max": 1}, "time_ns": 5,
    "seconds_after_flag": 1.5, "error": None, "analysis_s": 0.5,
}


def _with(path: str, value: Any) -> dict[str, Any]:
    doc = json.loads(json.dumps(_BASE))
    *parents, last = path.split(".")
    target: Any = doc
    for p in parents:
        target = target[int(p)] if p.isdigit() else target[p]
    if value is _DROP:
        del target[int(last) if last.isdigit() else last]
    else:
        target[int(last) if last.isdigit() else last] = value
    return doc


_DROP = object()
_HUGE = verdict.MAX_ITEMS + 1


@pytest.mark.parametrize(("path", "value", "message"), [
    ("schema", "frforensics.verdict/2", "schema is 'frforensics.verdict/2'"),
    ("schema", _DROP, "schema is None"),
    ("status", 3, "status is 3 (want a string)"),
    ("culprit_ranks", "2", "culprit_ranks is str, not a list"),
    ("culprit_ranks", [True], "culprit_ranks[0] is True"),
    ("culprit_ranks", [1.0], "culprit_ranks[0] is 1.0"),
    ("culprit_ranks", [-1], "culprit_ranks[0] is -1"),
    ("culprit_ranks", [0] * _HUGE, f"culprit_ranks has {_HUGE} entries"),
    ("actions", {"rank": 1}, "actions is dict, not a list"),
    ("actions", [{"rank": 0, "action": "inspect"}] * _HUGE, f"actions has {_HUGE} entries"),
    ("actions.0", "rank 1", "actions[0] is str, not an object"),
    ("actions.0.rank", _DROP, "actions[0].rank is missing"),
    ("actions.0.rank", "two", "actions[0].rank is 'two' (want an int member id)"),
    ("actions.0.rank", True, "actions[0].rank is True"),
    ("actions.0.rank", 1.5, "actions[0].rank is 1.5"),
    ("actions.0.rank", None, "actions[0].rank is None"),
    ("actions.0.action", _DROP, "actions[0].action is None"),
    ("actions.0.action", 3, "actions[0].action is 3"),
    ("actions.0.because", 3, "actions[0].because is 3"),
    ("actions.0.detail", ["d"], "actions[0].detail is ['d']"),
    ("actions.0.host", 1, "actions[0].host is 1"),
    ("actions.0.local_rank", "2", "actions[0].local_rank is '2'"),
    ("actions.0.cuda_device", False, "actions[0].cuda_device is False"),
    ("actions.0.gpu_uuid", 7, "actions[0].gpu_uuid is 7"),
    ("headline", None, "headline is None"),
    ("text", 5, "text is 5"),
    ("error", {}, "error is {}"),
    ("incident", -1, "incident is -1"),
    ("incident", True, "incident is True"),
    ("elected_rank", "0", "elected_rank is '0'"),
    ("host", 0, "host is 0"),
    ("verdict_json", ["x"], "verdict_json is ['x']"),
    ("inputs", [], "inputs is list, not an object"),
    ("digest_bytes", "1", "digest_bytes is str, not an object"),
    ("time_ns", 1.5, "time_ns is 1.5"),
    ("seconds_after_flag", "1", "seconds_after_flag is '1' (want a number)"),
    ("analysis_s", True, "analysis_s is True"),
    ("evidence", {}, "evidence is dict, not a list"),
    ("evidence", [1], "evidence[0] is int, not an object"),
    ("source", 1, "source is 1"),
])
def test_a_hostile_verdict_is_refused_naming_the_field(path: str, value: Any,
                                                       message: str) -> None:
    _round_trips(_BASE)
    with pytest.raises(VerdictError) as info:
        Verdict.from_json(_with(path, value))
    assert message in str(info.value) and str(info.value).startswith("malformed verdict: ")
    assert isinstance(info.value, FrForensicsError) and isinstance(info.value, ValueError)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


@pytest.mark.parametrize(("raw", "message"), [
    ("x" * (verdict.MAX_CHARS + 1), "characters (at most"),
    ("{not json", "not JSON"),
    ("[" * 100_000 + "]" * 100_000, "not JSON"),
    ("[1, 2]", "list, not an object"),
    (b"\xff\xfe{}", "not JSON"),
])
def test_bytes_that_are_no_verdict_are_one_error(raw: str | bytes, message: str) -> None:
    with pytest.raises(VerdictError, match="malformed verdict: ") as info:
        Verdict.loads(raw)
    assert message in str(info.value)


@pytest.mark.parametrize(("doc", "message"), [
    ({"kind": "straggler"}, "schema is None"),
    ({"schema": verdict.STRAGGLERS_SCHEMA, "kind": "hang"}, "kind is 'hang'"),
    ({"schema": verdict.STRAGGLERS_SCHEMA, "kind": "straggler", "round": True},
     "round is True"),
    ({"schema": verdict.STRAGGLERS_SCHEMA, "kind": "straggler", "round": 1, "time_ns": 1},
     "stragglers_json is None"),
    ({"schema": verdict.STRAGGLERS_SCHEMA, "kind": "straggler", "round": 1, "time_ns": 1,
      "stragglers_json": "s", "actions": [{"rank": "3", "action": "inspect"}]},
     "actions[0].rank is '3'"),
    ({"schema": verdict.STRAGGLERS_SCHEMA, "kind": "straggler", "round": 1, "time_ns": 1,
      "stragglers_json": "s", "findings": ["f"]}, "findings[0] is str, not an object"),
])
def test_a_hostile_straggler_document_is_refused_naming_the_field(
        doc: dict[str, Any], message: str) -> None:
    with pytest.raises(VerdictError) as info:
        StragglerReport.from_json(doc)
    assert message in str(info.value)


def test_a_verdict_source_may_omit_the_schema_but_not_name_another() -> None:
    doc = {"status": "hang", "actions": [{"rank": 1, "action": "fix_code"}]}
    assert Verdict.from_json(doc, require_schema=False).actions == (
        Action(rank=1, action="fix_code"),)
    with pytest.raises(VerdictError, match="schema is None"):
        Verdict.from_json(doc)
    with pytest.raises(VerdictError, match="schema is 'other/1'"):
        Verdict.from_json({**doc, "schema": "other/1"}, require_schema=False)


@pytest.mark.parametrize(("status", "what", "expected"), [
    ("hang", "missing_rank: Rank 2 never entered", "HANG — missing_rank: Rank 2 never entered"),
    ("planned", "slow", "PLANNED — slow"),
    ("dead", "rank 3 killed", "DEAD — rank 3 killed"),
    ("error", "fr-analyze failed", "ERROR — fr-analyze failed"),
])
def test_one_headline_rule(status: str, what: str, expected: str) -> None:
    assert verdict.headline(status, what) == expected


@pytest.mark.parametrize(("message", "clause"), [
    ("rank 2 never entered the op; its peers waited. More here", "Rank 2 never entered the op"),
    ("late (by 3 ms. on average) in 9 of 10. Next", "Late (by 3 ms. on average) in 9 of 10"),
    ("", ""),
])
def test_a_reports_headline_is_its_first_findings_first_clause(message: str,
                                                               clause: str) -> None:
    report = {"status": "hang", "findings": [{"kind": "k", "message": message}]}
    assert verdict.report_headline(report) == f"HANG — k: {clause}"
    assert verdict.report_headline({"status": "ok", "findings": []}) == "OK — no finding"


def test_the_exit_codes_are_defined_once_and_importable_where_they_were() -> None:
    import inspect
    import re

    import frforensics.recorder as recorder

    assert (verdict.EXIT_VERDICT, verdict.EXIT_NO_VERDICT, verdict.EXIT_EXCLUDED) == (75, 76, 79)
    assert recorder.EXIT_VERDICT == _verdict.EXIT_VERDICT == verdict.EXIT_VERDICT
    assert recorder.EXIT_NO_VERDICT == _verdict.EXIT_NO_VERDICT == verdict.EXIT_NO_VERDICT
    assert recovery.EXIT_EXCLUDED == verdict.EXIT_EXCLUDED
    for module in (recorder, _verdict, recovery):
        assert not re.search(r"(?m)^EXIT_\w+(: \w+)? = \d", inspect.getsource(module)), module
