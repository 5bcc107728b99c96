"""Bytes in, :class:`~frforensics.model.RankTrace` out (and back, for frdump).

The only package that touches bytes. ``decode_dump`` sniffs the format from the
content, never from the file name: our own ``frdump``, PyTorch's native pickle,
or PyTorch's native JSON.
"""

from __future__ import annotations

from frforensics.errors import NotADumpError
from frforensics.formats import frdump, native
from frforensics.model import RankTrace, SourceFormat

__all__ = ["decode_dump", "sniff_format"]


def sniff_format(head: bytes) -> SourceFormat | None:
    """The format whose signature ``head`` starts with, or ``None``."""
    if frdump.is_frdump(head):
        return SourceFormat.FRDUMP
    if native.looks_like_pickle(head):
        return SourceFormat.NATIVE_PICKLE
    if head.lstrip(b" \t\r\n\xef\xbb\xbf")[:1] == b"{":
        return SourceFormat.NATIVE_JSON
    return None


def decode_dump(data: bytes, *, source: str, rank_hint: int | None = None) -> RankTrace:
    """Decode one dump of any supported format.

    ``rank_hint`` is the rank taken from the file name; it is used only when the
    dump's content carries no rank (PyTorch's native dumps never do).
    Raises a :class:`~frforensics.errors.DumpError` subclass on bad input.
    """
    fmt = sniff_format(data[:64])
    if fmt is SourceFormat.FRDUMP:
        trace = frdump.decode(data, source=source)
        if trace.rank is None and rank_hint is not None:
            from dataclasses import replace

            trace = replace(trace, rank=rank_hint, rank_from="filename")
        return trace
    if fmt is SourceFormat.NATIVE_PICKLE:
        return native.pickle_to_trace(data, source=source, rank=rank_hint)
    if fmt is SourceFormat.NATIVE_JSON:
        doc = native.decode_json(data, source=source)
    else:
        raise NotADumpError(f"{source}: not a flight-recorder dump (unknown content)")
    return native.to_trace(doc, source=source, fmt=fmt, rank=rank_hint)
