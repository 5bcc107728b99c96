"""The error tree of frforensics.

::

    FrForensicsError                 anything this package raises on purpose
    ├── DumpError                    one dump file could not be used
    │   ├── NotADumpError            the bytes are no flight-recorder dump we know
    │   ├── CorruptDumpError         a dump we know, but truncated or malformed
    │   ├── UnsafeDumpError          a pickle that asks for code (globals, reduce)
    │   ├── UnsupportedVersionError  written by a newer format than this reader knows
    │   └── LimitExceededError       past a documented budget (formats/limits.py)
    └── UsageError                   the caller asked for something impossible
        └── OutputError              an output path cannot be written

A ``DumpError`` never aborts an analysis: the loader turns it into a load problem
of the report and goes on with the other ranks. Messages are one line: what, where,
and what to do next.
"""

from __future__ import annotations


class FrForensicsError(Exception):
    """Base class of every error frforensics raises on purpose."""


class DumpError(FrForensicsError):
    """One dump file could not be used; the analysis goes on without it."""


class NotADumpError(DumpError):
    """The file is not a flight-recorder dump in any format we read."""


class CorruptDumpError(DumpError):
    """The file looks like a dump but is truncated or malformed."""


class UnsafeDumpError(DumpError):
    """A pickle that references globals or code: refused, never executed."""


class UnsupportedVersionError(DumpError):
    """A dump written by a newer format version than this reader understands."""


class LimitExceededError(DumpError):
    """A dump or archive goes past one of the limits in ``formats/limits.py``."""


class UsageError(FrForensicsError):
    """Bad arguments or options (exit code 2)."""


class OutputError(UsageError):
    """An output file or folder cannot be written (exit code 2)."""
