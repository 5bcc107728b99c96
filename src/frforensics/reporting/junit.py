"""``--format junit``: JUnit XML for CI systems that show test reports.

One ``<testsuite name="frforensics">``; one ``<testcase>`` per finding (a
finding is one kind with its culprit ranks), named
``<kind>: ranks <culprits> in <op #seq> on <group>``; error findings carry a
``<failure>`` (type = the kind, message = the headline, body = the details),
warnings pass with the message in ``<system-out>``. A healthy report has one
passing ``verdict`` case; load problems are one case with the list in its
output. ``max_findings_per_kind`` in the analyzer caps the cases, so a
10,000-rank job stays a short file.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from frforensics.report import Finding, Report, Severity, Status, format_ranks
from frforensics.reporting._escape import xml_text
from frforensics.reporting._shared import seq_label

MAX_CASES = 200


def _case_name(f: Finding) -> str:
    parts = [f.kind.value]
    if f.culprit_ranks:
        parts.append(f"ranks {format_ranks(f.culprit_ranks)}")
    where = []
    if f.op is not None:
        where.append(seq_label(f))
    if f.pg is not None:
        where.append(f"on {f.pg.label()}")
    name = parts[0] + (": " + parts[1] if len(parts) > 1 else "")
    return name + (f" in {' '.join(where)}" if where else "")


def _details(f: Finding) -> str:
    lines = [f.message]
    if f.culprit_ranks:
        lines.append(f"culprit ranks: {format_ranks(f.culprit_ranks)}")
    if f.waiting_ranks:
        lines.append(f"waiting ranks: {format_ranks(f.waiting_ranks)}")
    if f.pg is not None:
        lines.append(f"group: {f.pg.label()}")
    if f.op is not None:
        lines.append(f"collective: {seq_label(f)}")
    if f.location:
        lines.append(f"code: {f.location}")
    return "\n".join(lines)


def _xml_safe(root: ET.Element) -> None:
    """Replace what XML 1.0 cannot hold (control characters from dumps) with escapes."""
    for el in root.iter():
        if el.text:
            el.text = xml_text(el.text)
        if el.tail:
            el.tail = xml_text(el.tail)
        for key, value in el.attrib.items():
            el.attrib[key] = xml_text(value)


def render(report: Report) -> str:
    """The report as a JUnit XML document."""
    suite = ET.Element("testsuite", name="frforensics")
    cases: list[ET.Element] = []
    failures = 0
    if report.status is Status.UNREADABLE:
        case = ET.Element("testcase", classname="frforensics", name="dumps readable")
        fail = ET.SubElement(case, "failure", type="unreadable",
                             message="no dump could be read")
        fail.text = "\n".join(f"{p.path}: {p.error}" for p in report.load_problems[:50])
        cases.append(case)
        failures += 1
    for f in report.findings[:MAX_CASES]:
        case = ET.Element("testcase", classname=f"frforensics.{f.kind.value}",
                          name=_case_name(f))
        if f.severity is Severity.ERROR:
            fail = ET.SubElement(case, "failure", type=f.kind.value, message=f.message)
            fail.text = _details(f)
            failures += 1
        else:
            out = ET.SubElement(case, "system-out")
            out.text = _details(f)
        cases.append(case)
    if report.load_problems and report.status is not Status.UNREADABLE:
        case = ET.Element("testcase", classname="frforensics.load", name="load problems")
        out = ET.SubElement(case, "system-out")
        out.text = "\n".join(f"{p.path}: {p.error}" for p in report.load_problems[:50])
        cases.append(case)
    if not cases:
        case = ET.Element("testcase", classname="frforensics", name="verdict")
        out = ET.SubElement(case, "system-out")
        out.text = (f"healthy: {len(report.ranks_loaded)} rank(s) analyzed, no hang, "
                    "desync or straggler found")
        cases.append(case)
    suite.set("tests", str(len(cases)))
    suite.set("failures", str(failures))
    suite.set("errors", "0")
    suite.set("skipped", "0")
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="status", value=report.status.value)
    ET.SubElement(props, "property", name="culprit_ranks",
                  value=format_ranks(report.culprit_ranks) if report.culprit_ranks else "")
    ET.SubElement(props, "property", name="ranks_loaded", value=str(len(report.ranks_loaded)))
    suite.extend(cases)
    if report.notes:
        out = ET.SubElement(suite, "system-out")
        out.text = "\n".join(report.notes)
    _xml_safe(suite)
    ET.indent(suite)
    body = ET.tostring(suite, encoding="unicode")
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + body + "\n"
