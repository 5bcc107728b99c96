"""``fr-analyze convert``: any supported dumps -> frforensics' frdump files.

Users keep compact archives of incidents and re-analyze them fast: a native
pickle of 2000 entries becomes a columnar frdump that decodes in about a
millisecond. Dumps are read by :func:`frforensics.formats.read_sources` (the one
reader: limits, archives, ranks from content or file names, duplicates), one at
a time, and written atomically as ``dst/frdump_rank_<rank>``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from frforensics.errors import OutputError
from frforensics.formats import frdump
from frforensics.formats.limits import DEFAULT_LIMITS, Limits
from frforensics.formats.sources import read_sources
from frforensics.report import LoadProblem

__all__ = ["ConvertResult", "convert_dumps"]


@dataclass(slots=True)
class ConvertResult:
    """What a conversion wrote and what it skipped (label, reason)."""

    written: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)


def convert_dumps(
    paths: Sequence[str | os.PathLike[str]],
    dst: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    jobs: int | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> ConvertResult:
    """Convert every dump under ``paths`` into ``dst/frdump_rank_<rank>``.

    Raises :class:`~frforensics.errors.OutputError` when ``dst`` cannot be a
    folder or a file cannot be written there. ``jobs`` is accepted for
    compatibility; dumps are converted one at a time (memory: one dump).
    """
    del jobs
    target = Path(dst)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{target}: cannot create the output folder "
                          f"({exc.strerror or exc})") from None
    if not target.is_dir():
        raise OutputError(f"{target}: is not a folder")
    result = ConvertResult()
    for item in read_sources(paths, prefix=prefix, limits=limits):
        if isinstance(item, LoadProblem):
            result.failed.append((item.path, item.error))
            continue
        trace = replace(item, notes=(*item.notes, f"converted from {item.source} "
                                     f"({item.format.value} {item.version})"))
        path = target / f"frdump_rank_{trace.rank}"
        try:
            frdump.write_atomic(path, frdump.encode(trace))
        except OSError as exc:
            raise OutputError(f"{path}: cannot write ({exc.strerror or exc})") from None
        result.written.append(str(path))
    return result
