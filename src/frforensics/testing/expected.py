"""The verdict a scenario states by construction (never computed by an analyzer)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Expected", "ExpectedGroup"]


@dataclass(frozen=True, slots=True)
class ExpectedGroup:
    """A process group as the report names it: name, description, global ranks."""

    name: str
    desc: str
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Expected:
    """What a correct analysis of the scenario reports.

    ``kinds`` lists the finding kinds in order of preference; the first is the
    planted one. ``also_acceptable`` holds kinds the dumps cannot tell apart from
    it (e.g. a skipped collective whose rank then blocks in another group looks
    exactly like a cross-group order inversion). ``culprit_ranks`` are the root
    causes, most likely first. ``group``/``seq``/``seq_kind``/``op`` locate the
    collective (or p2p op) where the fault shows; ``waiting_ranks`` are the members
    that entered it and wait. ``groups`` lists every group of a wait cycle.
    ``blocked`` says, for every rank with an unfinished op, where it is really
    blocked: ``(rank, group name, group ranks, "collective"|"p2p", seq)`` of its
    earliest unfinished op (a coalesced block counted by its closing entry);
    ranks absent from it have nothing unfinished (finished, stuck in Python, or
    dead).
    """

    status: str
    kinds: tuple[str, ...] = ()
    culprit_ranks: tuple[int, ...] = ()
    group: ExpectedGroup | None = None
    seq: int | None = None
    seq_kind: str | None = None
    op: str | None = None
    waiting_ranks: tuple[int, ...] = ()
    groups: tuple[ExpectedGroup, ...] = ()
    also_acceptable: tuple[str, ...] = ()
    missing_dumps: tuple[int, ...] = ()
    notes: tuple[str, ...] = field(default=())
    blocked: tuple[tuple[int, str, tuple[int, ...], str, int], ...] = ()

    @property
    def kind(self) -> str | None:
        """The planted finding kind (``None`` when healthy)."""
        return self.kinds[0] if self.kinds else None
