"""Reporters: render a :class:`~frforensics.report.Report`; they decide nothing.

``render(report, fmt)`` returns the text of one format; each reporter is a
module with a ``render(report) -> str`` function. ``timeline`` is the exception:
it renders the full traces ``formats.read_sources`` yields (every entry) as
Chrome-trace JSON.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from frforensics._atomic import atomic_file, write_atomic
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


def write_all(
    report: Report,
    out_dir: str | os.PathLike[str],
    *,
    dump_paths: list[str] | None = None,
    prefix: str | None = None,
) -> list[Path]:
    """Write every format into ``out_dir`` (``report.txt``, ``report.json``, ``report.md``,
    ``report.html``, ``report.xml``) and, when ``dump_paths`` are given, the
    Chrome-trace timeline ``timeline.json`` of those dumps.

    Used by ``--output-dir`` and the pytest plugin for CI artifacts. Each file
    is written atomically (a reader never sees half of one). Returns the paths
    written.
    """
    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for fmt, renderer in FORMATS.items():
        path = target / f"report.{SUFFIXES.get(fmt, fmt)}"
        _write_atomic(path, renderer(report))
        written.append(path)
    if dump_paths:
        from frforensics.formats import read_sources
        from frforensics.reporting.timeline import write_timeline

        path = target / "timeline.json"
        with atomic_file(path) as fh:
            write_timeline(read_sources(dump_paths, prefix=prefix), fh)
        written.append(path)
    return written


def _write_atomic(path: Path, text_: str) -> None:
    write_atomic(path, text_)
