"""Crash cascades: which failures are a rank's own, and which followed another's.

Rule: every failure the dumps record — a death record (uncaught exception,
exit with ops unfinished), a teardown signal, a heartbeat others saw stop — is
classified once by :mod:`frforensics.failures` as *root*, *consequence* or
*unknown*. Only roots are culprits:

* the roots with a dump are ordered by their dumps' own times (a death dump is
  written as the exception propagates); the first is the culprit. Two roots
  closer than ``TIE_NS`` cannot be told apart (host clocks and the time to
  write a dump): both are named, to inspect;
* a rank without a dump whose heartbeat others saw stop died without an
  exception (SIGKILL, ``os._exit``, a lost node): a root, timed by the stale
  heartbeat;
* when the dumped failures are all consequences (peer lost, aborts, timeouts,
  teardown) and no root has a dump, the ranks *without* a dump are the ranks
  the others lost: they are the roots (``lost``);
* after a desync (``Context.mismatches``) in a group, a member that left no
  dump, or died of gloo's "Received data size doesn't match", failed because of
  the desync: a consequence, never another culprit.

Consequence ranks are listed as "failed because rank R failed"; unknown ones
are culprits only when no root is known.

Worked example (4 ranks under torchrun; rank 1 raises ``RuntimeError("bad
batch")``)::

    rank 1 dump: death exception "RuntimeError: bad batch" at train.py:14  -> root
    rank 0 dump: death exception "... Connection closed by peer ..."        -> consequence
    rank 2 dump: signal SIGTERM (the agent's teardown)                      -> consequence
    -> culprit 1 (fix_code, train.py:14); ranks 0, 2 failed because rank 1 failed
"""

from __future__ import annotations

from dataclasses import dataclass

from frforensics.analyzer.context import Context
from frforensics.analyzer.digest import RankDigest
from frforensics.analyzer.merge import _superseded_groups
from frforensics.failures import Failure, FailureClass, classify_death, classify_message

__all__ = ["TIE_NS", "Cascade", "RankFailure", "cascade"]

#: Two roots closer than this cannot be ordered: host clocks on one LAN agree to
#: about a millisecond (NTP), a death dump is written within tens of ms of the
#: raise; 100 ms covers both with room.
TIE_NS = 100_000_000


@dataclass(frozen=True, slots=True)
class RankFailure:
    """One rank's recorded failure and how it was classified."""

    rank: int
    failure: Failure
    time_ns: int | None  # when (the dump's own clock), None when unknown
    evidence: str  # "death", "signal", "stale_heartbeat", "no_dump", "desync"
    message: str

    def to_json(self) -> dict[str, object]:
        return {"rank": self.rank, **self.failure.to_json(), "evidence": self.evidence,
                "message": self.message[:300]}


@dataclass(frozen=True, slots=True)
class Cascade:
    """The job's failures sorted into roots (first one first) and consequences."""

    roots: tuple[RankFailure, ...]
    consequences: tuple[RankFailure, ...]
    unknown: tuple[RankFailure, ...]
    #: ranks of ``roots`` that cannot be told apart from the first root
    tied: tuple[int, ...]
    #: missing ranks that are consequences of a desync (not culprits)
    desync_victims: tuple[int, ...]

    @property
    def culprits(self) -> tuple[RankFailure, ...]:
        """The roots to name (the first and those tied with it, then later ones);
        unknown failures only when there is no root."""
        return self.roots if self.roots else self.unknown

    @property
    def first(self) -> RankFailure | None:
        got = self.culprits
        return got[0] if got else None

    def claimed(self) -> set[int]:
        """Every rank this cascade reports (roots, unknown, consequences)."""
        return {f.rank for f in (*self.roots, *self.unknown, *self.consequences)}


def _signal_failure(detail: str) -> Failure | None:
    for name in ("SIGTERM", "SIGINT", "SIGHUP"):
        if name in detail:
            return classify_message(f"SignalException: {name}")
    return None


def cascade(ctx: Context) -> Cascade:
    """Classify every recorded failure of the job (see the module doc): once per
    context (three rules and the report read it; each pass walks every rank)."""
    done: Cascade | None = ctx.memo.get("cascade")
    if done is None:
        done = ctx.memo["cascade"] = _cascade(ctx)
    return done


def _cascade(ctx: Context) -> Cascade:
    roots: list[RankFailure] = []
    conseq: list[RankFailure] = []
    unknown: list[RankFailure] = []
    for rank, d in sorted(ctx.job.digests.items()):
        if d.death is not None:
            waited_on = rank in ctx.graph.roots
            if d.death.kind == "exit" and not waited_on and len(d.pending_rows()) == 0:
                continue  # a clean exit at the end of the job
            f = classify_death(d.death.kind, d.death.message)
            rf = RankFailure(rank, f, d.dump_time_ns, "death", d.death.message)
        elif d.dump_reason == "signal" and (f0 := _signal_failure(d.dump_detail)) is not None:
            rf = RankFailure(rank, f0, d.dump_time_ns, "signal", d.dump_detail)
        else:
            continue
        {FailureClass.ROOT: roots, FailureClass.CONSEQUENCE: conseq,
         FailureClass.UNKNOWN: unknown}[rf.failure.cls].append(rf)

    # Ranks without a dump: a stale heartbeat says it died (no exception).
    stale: dict[int, int] = {}
    for d in ctx.job.digests.values():
        if not d.stale_peers:
            continue
        current = _current_members(d)
        for p in d.stale_peers:
            if current is not None and p.rank not in current:
                continue  # excluded by a reconfiguration: no longer a peer of this rank
            # a member without a dump only: a rank excluded by a reconfiguration
            # keeps a stale heartbeat in its old peers' view, yet is no longer a member
            if p.rank in ctx.job.digests or p.rank not in ctx.job.missing_dumps \
                    or not d.dump_time_ns:
                continue
            when = d.dump_time_ns - int(p.age_s * 1e9)
            stale[p.rank] = min(stale.get(p.rank, when), when)
    missing = list(ctx.job.missing_dumps) if ctx.job.silent_listed else \
        list(ctx.job.named_missing)
    victims = _desync_victims(ctx, missing)
    for r in victims:
        conseq.append(RankFailure(r, Failure(FailureClass.CONSEQUENCE, "desync", None,
                                             "a collective of its group desynced before it "
                                             "failed"), None, "desync", "left no dump"))
    no_exception = Failure(FailureClass.ROOT, "no_dump", None,
                           "died without an exception and left no dump")
    for r, when in sorted(stale.items()):
        if r not in victims:
            roots.append(RankFailure(r, no_exception, when, "stale_heartbeat",
                                     "heartbeat stopped"))
    if not roots and conseq and any(c.evidence != "desync" for c in conseq):
        # the dumped ranks failed of a lost peer: the ranks without a dump are it
        for r in missing:
            if r not in victims and r not in stale:
                roots.append(RankFailure(r, no_exception, None, "no_dump", "left no dump"))

    roots.sort(key=lambda f: (f.time_ns is None, f.time_ns or 0, f.rank))
    tied: list[int] = []
    if len(roots) > 1 and roots[0].time_ns is not None:
        t0 = roots[0].time_ns
        tied = [f.rank for f in roots if f.time_ns is not None and f.time_ns - t0 < TIE_NS]
        if len(tied) < 2:
            tied = []
    # desync victims that died with a dump are consequences already (marker "desync")
    return Cascade(tuple(roots), tuple(conseq), tuple(unknown), tuple(tied), tuple(victims))


def _current_members(d: RankDigest) -> set[int] | None:
    """The members of ``d``'s groups that no reconfiguration has replaced, or None
    when the rank never reconfigured (frforensics.recovery re-forms groups as
    ``<name>@r<uuid>``; ``merge._superseded_groups``)."""
    old = _superseded_groups(d)
    if not old:
        return None
    return {r for i, g in enumerate(d.groups) if i not in old for r in (g.ranks or ())}


def _desync_victims(ctx: Context, missing: list[int]) -> list[int]:
    """Missing ranks that are members of a group with a desync (a mismatch), the
    mismatch's own culprits excepted: gloo aborts a receiver of mismatched data."""
    if not ctx.mismatches or not missing:
        return []
    out: list[int] = []
    for m in ctx.mismatches:
        members = ctx.job.groups[m.gid].ranks
        for r in missing:
            if r in members and r not in out:
                out.append(r)
    return out
