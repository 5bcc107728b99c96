"""The decoders' membership interning lives on the model side
(:mod:`frforensics._members`, below ``formats`` in the part map): ``model`` rebuilds
progressions with it too, and must not import ``formats``."""

from __future__ import annotations

from frforensics._members import shared_ranks

__all__ = ["shared_ranks"]
