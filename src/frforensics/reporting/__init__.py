"""Reporters: render a :class:`~frforensics.report.Report`; they decide nothing.

``render(report, fmt)`` returns the text of one format; each reporter is a
module with a ``render(report) -> str`` function. Reporters read no dumps: the
Chrome-trace timeline of every entry is an exporter beside ``convert``
(:mod:`frforensics.analyzer.timeline`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from frforensics._atomic import write_atomic
from frforensics.errors import UsageError
from frforensics.report import Report
from frforensics.reporting import html, json_report, junit, markdown, text

__all__ = ["FORMATS", "SUFFIXES", "render", "write_all"]

FORMATS: dict[str, Callable[[Report], str]] = {
    "text": text.render,
    "json": json_report.render,
    "markdown": markdown.render,
    "html": html.render,
    "junit": junit.render,
}

#: File suffix of each format in ``write_all``'s folder.
SUFFIXES: dict[str, str] = {"text": "txt", "json": "json", "markdown": "md", "html": "html",
                            "junit": "xml"}


def render(report: Report, fmt: str) -> str:
    """The report in format ``fmt`` (one of ``FORMATS``)."""
    try:
        renderer = FORMATS[fmt]
    except KeyError:
        raise UsageError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}") from None
    return renderer(report)


def write_all(report: Report, out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write every format into ``out_dir`` (``report.txt``, ``report.json``, ``report.md``,
    ``report.html``, ``report.xml``).

    Used by ``--output-dir`` and the pytest plugin for CI artifacts (they write the
    timeline beside it: :func:`frforensics.analyzer.timeline.write_timeline_file`).
    Each file is written atomically (a reader never sees half of one). Returns the
    paths written.
    """
    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for fmt, renderer in FORMATS.items():
        path = target / f"report.{SUFFIXES.get(fmt, fmt)}"
        _write_atomic(path, renderer(report))
        written.append(path)
    return written


def _write_atomic(path: Path, text_: str) -> None:
    write_atomic(path, text_)
