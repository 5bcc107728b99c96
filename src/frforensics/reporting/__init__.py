"""Reporters: render a :class:`~frforensics.report.Report`; they decide nothing.

``render(report, fmt)`` returns the text of one format; each reporter is a
module with a ``render(report) -> str`` function.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from frforensics.errors import UsageError
from frforensics.report import Report
from frforensics.reporting import json_report, text

__all__ = ["FORMATS", "render"]

FORMATS: dict[str, Callable[[Report], str]] = {
    "text": text.render,
    "json": json_report.render,
}


def render(report: Report, fmt: str) -> str:
    """The report in format ``fmt`` (one of ``FORMATS``)."""
    try:
        renderer = FORMATS[fmt]
    except KeyError:
        raise UsageError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}") from None
    return renderer(report)


def write_all(
    report: Report,
    out_dir: str | os.PathLike[str],
    *,
    dump_paths: list[str] | None = None,
    prefix: str | None = None,
) -> list[Path]:
    """Write every format into ``out_dir`` (``report.txt``, ``report.json``, ...).

    Used by ``--output-dir`` for CI artifacts. Returns the paths written.
    """
    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    suffix = {"text": "txt", "json": "json", "markdown": "md", "html": "html", "junit": "xml"}
    written = []
    for fmt, renderer in FORMATS.items():
        path = target / f"report.{suffix.get(fmt, fmt)}"
        path.write_text(renderer(report), encoding="utf-8")
        written.append(path)
    return written
