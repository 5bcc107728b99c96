"""``fr-analyze convert``: any supported dumps -> frforensics' frdump files.

Users keep compact archives of incidents and re-analyze them fast: a native
pickle of 2000 entries becomes a columnar frdump that decodes in about a
millisecond. Ranks come from content or file names, as for analysis.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from frforensics._gc import gc_paused
from frforensics.analyzer.load import DumpSource, _executor, discover, rank_from_name
from frforensics.errors import DumpError
from frforensics.formats import decode_dump, frdump, sniff_format

__all__ = ["ConvertResult", "convert_dumps"]


@dataclass(slots=True)
class ConvertResult:
    """What a conversion wrote and what it skipped (label, reason)."""

    written: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)


def _convert_one(source: DumpSource, dst: str, prefix: str | None) -> tuple[str, str | None, str]:
    with gc_paused():
        return _convert(source, dst, prefix)


def _convert(source: DumpSource, dst: str, prefix: str | None) -> tuple[str, str | None, str]:
    rank = rank_from_name(source.label, prefix)
    try:
        if source.data is not None:
            data = source.data
        else:
            assert source.path is not None
            with open(source.path, "rb") as fh:
                data = fh.read()
        if sniff_format(data[:64]) is None and rank is None:
            return source.label, None, "not a dump"
        trace = decode_dump(data, source=source.label, rank_hint=rank)
        if trace.rank is None:
            return source.label, None, "cannot tell its rank (pass --prefix)"
        trace = replace(trace, notes=(*trace.notes, f"converted from {source.label} "
                                      f"({trace.format.value} {trace.version})"))
        path = frdump.write_atomic(Path(dst) / f"frdump_rank_{trace.rank}", frdump.encode(trace))
        return source.label, str(path), ""
    except DumpError as exc:
        return source.label, None, str(exc)
    except OSError as exc:
        return source.label, None, f"cannot read or write: {exc}"


def convert_dumps(
    paths: Sequence[str | os.PathLike[str]],
    dst: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    jobs: int | None = None,
) -> ConvertResult:
    """Convert every dump under ``paths`` into ``dst/frdump_rank_<rank>``."""
    sources, problems = discover(paths)
    result = ConvertResult(failed=[(p.path, p.error) for p in problems])
    Path(dst).mkdir(parents=True, exist_ok=True)
    jobs = max(1, jobs or os.cpu_count() or 1)
    args = ([s, str(dst), prefix] for s in sources)
    if jobs == 1 or len(sources) < 8:
        outcomes = [_convert_one(*a) for a in args]  # type: ignore[arg-type]
    else:
        pool: ProcessPoolExecutor = _executor(jobs)  # type: ignore[assignment]
        with pool:
            outcomes = list(pool.map(_convert_one, sources, [str(dst)] * len(sources),
                                     [prefix] * len(sources), chunksize=16))
    for label, written, error in outcomes:
        if written:
            result.written.append(written)
        elif error != "not a dump":
            result.failed.append((label, error))
    return result
