"""``Report.from_json`` reads back what ``Report.to_json`` writes (``verdict.json``,
``fr-analyze --format json``), and refuses a malformed document with one error
naming the field."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from frforensics.analyzer import AnalyzeOptions, analyze, load_dumps
from frforensics.rankset import RankSet
from frforensics.report import GroupRef, Report, ReportFormatError
from frforensics.reporting import json_report

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = sorted((ROOT / "tests" / "data" / "sample_reports").glob("*.json"))
SAMPLES = sorted(p for p in (ROOT / "sample_dumps").iterdir() if p.is_dir())


def test_there_are_sample_reports_to_read() -> None:
    assert len(EXPECTED) >= 20 and len(SAMPLES) >= 10


@pytest.mark.parametrize("path", EXPECTED, ids=lambda p: p.stem)
def test_every_committed_sample_report_reads_back_byte_identical(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    report = Report.from_json(json.loads(text))
    assert json_report.render(report) == text
    assert Report.from_json(report.to_json()) == report


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_an_analysis_report_survives_its_own_json(sample: Path) -> None:
    report = analyze(load_dumps([sample], jobs=1), options=AnalyzeOptions(world_size=4))
    back = Report.from_json(report.to_json())
    # the drawn timeline is not part of the document
    assert back == replace(report, timeline=())
    assert json.dumps(back.to_json()) == json.dumps(report.to_json())
    assert back.status is report.status and back.exit_code == report.exit_code


def test_groups_and_missing_ranks_too_many_to_list_read_back_as_rank_sets() -> None:
    base = json.loads(EXPECTED[0].read_text(encoding="utf-8"))
    doc = {**base, "ranks_missing": None, "ranks_missing_count": 7,
           "ranks_missing_ranges": [[4, 9], [20, 20]]}
    report = Report.from_json(doc)
    assert report.ranks_missing == RankSet([range(4, 10), range(20, 21)])
    assert report.to_json() == doc
    big = GroupRef("0", "default_pg", range(1 << 20), listed=False)
    assert GroupRef.from_json(big.to_json()).to_json() == big.to_json()


def _sample_doc() -> dict[str, Any]:
    # a report with findings, a pg, evidence and actions
    for path in EXPECTED:
        doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        if doc["actions"] and any(f["pg"] for f in doc["findings"]):
            return doc
    raise AssertionError("no sample report with actions and a group")


def _set(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


_DELETE = object()


@pytest.mark.parametrize(("path", "value", "named"), [
    (("schema",), "frforensics.report/9", "schema"),
    (("status",), "on fire", "status"),
    (("status",), "healthy", "status"),  # not what its findings say
    (("world_size",), "4", "world_size"),
    (("ranks_loaded",), [0, -1], "ranks_loaded[1]"),
    (("ranks_missing",), "0-3", "ranks_missing"),
    (("culprit_ranks",), _DELETE, "culprit_ranks"),
    (("ranks", "0"), [], "ranks.0"),
    (("ranks", "0", "pid"), "12", "ranks.0.pid"),
    (("findings", 0, "kind"), "explosion", "findings[0].kind"),
    (("findings", 0, "severity"), 1, "findings[0].severity"),
    (("findings", 0, "culprit_ranks"), [True], "findings[0].culprit_ranks[0]"),
    (("findings", 0, "evidence"), [], "findings[0].evidence"),
    (("findings", 0, "message"), _DELETE, "findings[0].message"),
    (("actions", 0, "action"), "reboot_datacenter", "actions[0].action"),
    (("actions", 0, "rank"), None, "actions[0].rank"),
    (("load_problems",), [{"path": "x"}], "load_problems[0].error"),
    (("notes",), [1], "notes[0]"),
])
def test_a_malformed_document_is_one_error_naming_the_field(
        path: tuple[Any, ...], value: Any, named: str) -> None:
    doc = _set(_sample_doc(), path, value)
    with pytest.raises(ReportFormatError, match=f"report field {re.escape(named)}:"):
        Report.from_json(doc)


def test_a_bad_group_in_a_finding_is_named() -> None:
    doc = _sample_doc()
    at = next(i for i, f in enumerate(doc["findings"]) if f["pg"])
    with pytest.raises(ReportFormatError, match=rf"findings\[{at}\]\.pg\.ranks\[0\]"):
        Report.from_json(_set(doc, ("findings", at, "pg", "ranks"), ["a"]))


@pytest.mark.parametrize("doc", [None, [], "{}", 3])
def test_a_document_that_is_not_an_object_is_refused(doc: Any) -> None:
    with pytest.raises(ReportFormatError, match="report field report: expected an object"):
        Report.from_json(doc)


def test_evidence_nested_without_bound_is_refused() -> None:
    deep: Any = []
    for _ in range(100):
        deep = [deep]
    doc = _set(_sample_doc(), ("findings", 0, "evidence"), {"x": deep})
    with pytest.raises(ReportFormatError, match="nested deeper"):
        Report.from_json(doc)


def test_keys_a_newer_writer_adds_are_ignored() -> None:
    doc = {**_sample_doc(), "new_in_v2": {"anything": 1}}
    assert Report.from_json(doc).to_json() == _sample_doc()
