"""The budgets every reader works within (docs/security.md lists them with their errors).

Dumps and the directories holding them are untrusted: a 1 KB file must not cost
gigabytes or minutes. Each limit is far above what a real job writes (PyTorch's
ring buffer holds 2,000 entries by default; the largest jobs have ~10^5 ranks)
and turns a hostile or damaged input into one load problem naming the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["DEFAULT_LIMITS", "Limits"]


@dataclass(frozen=True, slots=True)
class Limits:
    """Budgets for reading one set of dumps (all sizes in bytes)."""

    #: Largest dump file (or archive member) read at all.
    max_file_bytes: int = 4 << 30
    #: An archive may expand to at most this many bytes in total ...
    max_archive_bytes: int = 16 << 30
    #: ... and to at most ``max_archive_ratio`` times its own size, beyond
    #: ``archive_ratio_floor_bytes`` (small archives of tiny dumps compress well).
    max_archive_ratio: int = 200
    archive_ratio_floor_bytes: int = 64 << 20
    #: Members of one archive (a central directory of millions of names is a bomb too).
    max_archive_members: int = 1 << 20
    #: Entries of one rank's ring buffer (PyTorch's default ring holds 2,000).
    max_entries: int = 1 << 22
    #: Ranks and world sizes are below this (2^20 = 1,048,576 ranks); larger
    #: numbers in a dump or a file name are damage, timestamps or pids, not ranks.
    max_rank: int = 1 << 20
    #: Dimensions of one tensor shape.
    max_dims: int = 64
    #: Dims formatted into one entry's shapes text; beyond it the text is a summary.
    max_shape_text_dims: int = 4096
    #: Characters of one string kept from a dump (longer ones are cut, with a mark).
    max_string_chars: int = 1 << 16
    #: Collective and p2p sequence numbers are below this (2^48).
    max_seq: int = 1 << 48
    #: Text a pickle's entries build (shapes, dtype lists: each distinct one once) is
    #: at most ``max_text_ratio`` times the file's size, beyond
    #: ``text_ratio_floor_bytes``: its memo lets a few bytes an entry name one long
    #: string, so without it a 4.8 MB file built 2.5 GB of text. PyTorch's own
    #: dumps build well under their size (a shape's text is a few bytes a dim).
    max_text_ratio: int = 16
    text_ratio_floor_bytes: int = 64 << 20

    def text_budget(self, file_bytes: int) -> int:
        """Characters of text the entries of a pickle of ``file_bytes`` may build."""
        return max(self.text_ratio_floor_bytes, self.max_text_ratio * file_bytes)


DEFAULT_LIMITS: Final = Limits()
