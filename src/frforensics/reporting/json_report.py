"""``--format json``: exactly one ``frforensics.report/1`` object (DESIGN §3)."""

from __future__ import annotations

import json

from frforensics.report import Report


def render(report: Report) -> str:
    """The report as indented JSON text (same data as every other format)."""
    return json.dumps(report.to_json(), indent=2, sort_keys=False) + "\n"
