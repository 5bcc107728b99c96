"""Dump strings and file names made safe to print: one line, no terminal control.

Everything a report shows that came from a dump or a directory (op names, group
descriptions, host names, code locations, file names, error messages quoting
them) is untrusted. :func:`printable` turns every control character — ANSI
escapes, carriage returns, newlines, the Unicode line and paragraph separators,
bidirectional overrides — into a visible escape, so a dump cannot forge a
verdict line (``"\\nCulprit: rank 3"``) or restyle the terminal.
:func:`xml_text` removes what XML 1.0 cannot hold at all.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["printable", "xml_text"]

# C0 and C1 controls, DEL, line/paragraph separators, bidi embeddings/overrides/isolates
_UNSAFE: Final = re.compile(
    "[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\ufeff]"
)
_NAMED: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\x1b": "\\x1b"}

# XML 1.0 Char: #x9 | #xA | #xD | [#x20-#xD7FF] | [#xE000-#xFFFD] | [#x10000-#x10FFFF]
_XML_ILLEGAL: Final = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _escape(match: re.Match[str]) -> str:
    ch = match.group(0)
    named = _NAMED.get(ch)
    if named is not None:
        return named
    code = ord(ch)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` on one line with every control character shown as an escape."""
    return _UNSAFE.sub(_escape, text)


def xml_text(text: str) -> str:
    """``text`` with the characters XML 1.0 forbids shown as escapes (lone
    surrogates too); ElementTree escapes the rest (``<``, ``&``, quotes)."""
    return _XML_ILLEGAL.sub(_escape, text)
