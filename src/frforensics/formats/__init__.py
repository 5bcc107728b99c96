"""Bytes in, :class:`~frforensics.model.RankTrace` out (and back, for frdump).

The only package that touches bytes. ``decode_dump`` sniffs the format from the
content, never from the file name: our own ``frdump``, PyTorch's native pickle,
or PyTorch's native JSON.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from frforensics.errors import NotADumpError
from frforensics.formats import frdump, native
from frforensics.formats.limits import DEFAULT_LIMITS, Limits
from frforensics.model import RankTrace, SourceFormat

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence
    from os import PathLike

    from frforensics.report import LoadProblem

__all__ = ["DEFAULT_LIMITS", "Limits", "decode_dump", "read_sources", "sniff_format"]


def sniff_format(head: bytes) -> SourceFormat | None:
    """The format whose signature ``head`` starts with, or ``None``."""
    if frdump.is_frdump(head):
        return SourceFormat.FRDUMP
    if native.looks_like_pickle(head):
        return SourceFormat.NATIVE_PICKLE
    if head.lstrip(b" \t\r\n\xef\xbb\xbf")[:1] == b"{":
        return SourceFormat.NATIVE_JSON
    return None


def decode_dump(
    data: bytes,
    *,
    source: str,
    rank_hint: int | None = None,
    limits: Limits = DEFAULT_LIMITS,
    detail_tail: int | None = None,
) -> RankTrace:
    """Decode one dump of any supported format, within ``limits``.

    ``rank_hint`` is the rank taken from the file name; it is used only when the
    dump's content carries no rank (PyTorch's native dumps never do).
    ``detail_tail``: see :func:`frforensics.formats.native.to_trace`.
    Raises a :class:`~frforensics.errors.DumpError` subclass on bad input.
    """
    fmt = sniff_format(data[:64])
    if fmt is SourceFormat.FRDUMP:
        trace = frdump.decode(data, source=source, limits=limits)
        if trace.rank is None and rank_hint is not None:
            trace = replace(trace, rank=rank_hint,
                            header=replace(trace.header, rank_from="filename"))
        return trace
    if fmt is SourceFormat.NATIVE_PICKLE:
        return native.pickle_to_trace(data, source=source, rank=rank_hint, detail_tail=detail_tail,
                                      limits=limits)
    if fmt is SourceFormat.NATIVE_JSON:
        doc = native.decode_json(data, source=source)
    else:
        raise NotADumpError(f"{source}: not a flight-recorder dump (unknown content)")
    return native.to_trace(doc, source=source, fmt=fmt, rank=rank_hint, detail_tail=detail_tail,
                           limits=limits)


def read_sources(
    paths: Sequence[str | PathLike[str]],
    *,
    prefix: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    detail_tail: int | None = None,
) -> Iterator[RankTrace | LoadProblem]:
    """Every dump under ``paths``, decoded one at a time (see :mod:`frforensics.formats.sources`)."""
    from frforensics.formats import sources

    return sources.read_sources(paths, prefix=prefix, limits=limits, detail_tail=detail_tail)
