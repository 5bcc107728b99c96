"""Split pass: the members of an uneven ``all_to_all`` must agree pairwise.

Computed once, beside the signature pass (``analyzer.signatures``), from the
``splits`` our recorder keeps for ``all_to_all`` / ``all_to_all_single``
(``RankDigest.splits``: the elements a rank sends each member and expects from
each; PyTorch's own recorder keeps only the tensors' shapes, so its dumps give
this pass nothing). At one seq of one group, what rank i sends rank j must be what
j expects from i. The first seq of a group where some pair disagrees is a
mismatch (field ``"splits"``); the rule reads only rows in program order (before
a rank's error path and within the group's frontier, as the signature pass does).

Who is at fault: a member whose share to itself is not what it expects from
itself (no peer takes part in that); else the member that disagrees with the most peers, when it alone
does (a rank whose splits are wrong disagrees with every peer whose share it
changed, each of those only with it). A tie — one disagreeing pair — cannot be
told apart from the splits alone, except where members left no dump: a sender
whose sends fall short of what its dumped receivers expect, at an exchange that
failed or never finished on some member, sent the rest of its input (``sum(input_split_sizes) == input.size(0)``, c10d checks it) to members we
cannot see, and gloo aborts a receiver that gets more than it expects
(``gloo/transport/tcp/pair.cc``: ``op.preamble.length <= op.nbytes``, "Received
data size doesn't match expected size"), which is why they left none: that sender
is the culprit. Any other tie names both ranks, as the signature pass's ties do.

Worked example (4 ranks, MoE dispatch; rank 1 moves one 8-element token from
rank 0's share to rank 2's; rank 2 aborts, no dump)::

    rank 1 sends [16, 24, 64, 24]; rank 0 expects 24 from rank 1, rank 3 expects 24
    -> pair (1 -> 0) disagrees: 16 sent, 24 expected; rank 1's sends to dumped ranks
       fall 8 short of what they expect, rank 2 left no dump -> culprit rank 1
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from frforensics.analyzer.merge import JobModel
from frforensics.analyzer.signatures import Mismatch
from frforensics.model import OpState

__all__ = ["SplitPair", "find_split_mismatches"]

Splits = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class SplitPair:
    """One disagreeing pair: ``sender`` sends ``sent`` elements, ``receiver`` expects
    ``expected`` from it."""

    sender: int
    receiver: int
    sent: int
    expected: int


def find_split_mismatches(job: JobModel) -> tuple[Mismatch, ...]:
    """Every group's first all_to_all whose members' splits disagree pairwise."""
    at, rows = _splits_by_seq(job)
    found: list[Mismatch] = []
    for gid in sorted(at):
        members = list(job.groups[gid].ranks)
        first: tuple[int, _Exchange, dict[int, Splits]] | None = None
        later = 0
        for seq in sorted(at[gid]):
            x = _exchange(members, at[gid][seq])
            if x is None:
                continue
            if first is None:
                first = (seq, x, at[gid][seq])
            else:
                later += 1
        if first is not None:
            seq = first[0]
            unfinished = any(int(job.digests[r].state[row]) != OpState.COMPLETED
                             for r, row in rows[gid][seq].items())
            found.append(_mismatch(job, gid, members, *first, later, unfinished))
    return tuple(found)


def _splits_by_seq(job: JobModel) -> tuple[dict[int, dict[int, dict[int, Splits]]],
                                           dict[int, dict[int, dict[int, int]]]]:
    """gid -> seq -> rank -> (sent to each member, expected from each), and the same
    to the row; rows in program order only, lists as long as the group."""
    out: dict[int, dict[int, dict[int, Splits]]] = defaultdict(lambda: defaultdict(dict))
    rows: dict[int, dict[int, dict[int, int]]] = defaultdict(lambda: defaultdict(dict))
    for rank, d in job.digests.items():
        if not d.splits:
            continue
        stop = job.error_from.get(rank)
        for row, value in d.splits.items():
            if (stop is not None and row >= stop) or d.is_p2p[row] \
                    or (d.unit is not None and int(d.unit[row]) != row):
                continue
            gid = job.group_of.get((rank, int(d.group[row])))
            if gid is None or not job.groups[gid].ranks_known:
                continue
            seq = int(d.seq[row])
            limit = job.frontier_limit.get(gid)
            if (limit is not None and seq > limit) or len(value[0]) != len(job.groups[gid].ranks):
                continue
            out[gid][seq][rank] = value
            rows[gid][seq][rank] = row
    return out, rows


#: disagreeing pairs kept per mismatch (the counts come from the whole matrix)
MAX_PAIRS: Final = 64
#: ranks whose split lists a mismatch's ``values`` show, and entries shown of each
_SHOWN_RANKS: Final = 16
_SHOWN_SPLITS: Final = 32


@dataclass(frozen=True, slots=True)
class _Exchange:
    """One all_to_all's members with splits, as matrices (``ranks`` order): what
    ``ranks[a]`` sends ``ranks[b]`` (``sent[a, b]``) and what ``ranks[b]`` expects
    from ``ranks[a]`` (``expected[a, b]``); ``bad``: where they differ."""

    ranks: list[int]
    sent: npt.NDArray[np.int64]
    expected: npt.NDArray[np.int64]
    bad: npt.NDArray[np.bool_]

    def pairs(self, limit: int = MAX_PAIRS) -> list[SplitPair]:
        """The disagreeing pairs (the first ``limit``, sender by sender)."""
        at = np.argwhere(self.bad)[:limit]
        return [SplitPair(self.ranks[a], self.ranks[b], int(self.sent[a, b]),
                          int(self.expected[a, b])) for a, b in at.tolist()]


def _exchange(members: list[int], by_rank: dict[int, Splits]) -> _Exchange | None:
    """The members' splits at one seq as matrices (numpy: O(k^2) without a Python
    step per pair, for groups of thousands); None when every pair agrees."""
    index = {r: i for i, r in enumerate(members)}
    ranks = sorted(r for r in by_rank if r in index)
    if not ranks:
        return None
    cols = np.asarray([index[r] for r in ranks], dtype=np.int64)
    send = np.asarray([by_rank[r][0] for r in ranks], dtype=np.int64)
    recv = np.asarray([by_rank[r][1] for r in ranks], dtype=np.int64)
    sent = send[:, cols]  # sent[a, b]: what ranks[a] sends ranks[b]
    expected = recv[:, cols].T  # expected[a, b]: what ranks[b] expects from ranks[a]
    bad = sent != expected
    if not bad.any():
        return None
    return _Exchange(ranks, sent, expected, bad)


def _mismatch(job: JobModel, gid: int, members: list[int], seq: int, x: _Exchange,
              by_rank: dict[int, Splits], later: int, unfinished: bool) -> Mismatch:
    either = x.bad | x.bad.T
    selfish = [x.ranks[a] for a in np.flatnonzero(np.diag(x.bad)).tolist()]
    np.fill_diagonal(either, False)
    partners = either.sum(axis=1)
    most = int(partners.max())
    top = [x.ranks[a] for a in np.flatnonzero(partners == most).tolist()] if most else []
    unseen = [r for r in members if r not in job.digests]
    culprits = top
    reason = "disagrees with the most peers"
    if selfish:
        # its share to itself disagrees with what it expects from itself: no peer
        # takes part in that one (gloo raises on it at once, alltoallv.cc)
        culprits = selfish
        reason = "what it sends itself is not what it expects from itself"
    elif len(top) > 1:
        # only where the exchange itself went wrong (a member's op failed or never
        # finished there): a receiver that gets less than it expects completes
        short = _short_senders(x, top) if unseen and unfinished else []
        if len(short) == 1:
            culprits = short
            reason = (f"sends its dumped receivers less than they expect; the rest went to "
                      f"rank(s) without a dump ({', '.join(map(str, unseen[:16]))})")
        else:
            reason = "one pair disagrees: the splits cannot tell which side is wrong"
    shown = [r for r in x.ranks if r in culprits][:_SHOWN_RANKS]
    shown += [r for r in x.ranks if r not in shown][:_SHOWN_RANKS - len(shown)]
    values = {r: f"sends {_cut(by_rank[r][0])}, expects {_cut(by_rank[r][1])}"
              for r in sorted(shown)}
    raw = {r: int(n) for r, n in zip(x.ranks, partners.tolist(), strict=True)}
    return Mismatch(gid, seq, "splits", values, later, raw, culprits=tuple(culprits),
                    pairs=tuple(x.pairs()), reason=reason)


def _cut(values: tuple[int, ...]) -> str:
    if len(values) <= _SHOWN_SPLITS:
        return str(list(values))
    return str(list(values[:_SHOWN_SPLITS]))[:-1] + f", ... ({len(values)} members)]"


def _short_senders(x: _Exchange, top: list[int]) -> list[int]:
    """Tied ranks that send their dumped receivers less, in all, than those expect."""
    diff = x.sent - x.expected
    np.fill_diagonal(diff, 0)
    balance = diff.sum(axis=1)
    off = np.asarray(x.bad, dtype=np.bool_).copy()
    np.fill_diagonal(off, False)
    sends_bad = [bool(v) for v in np.asarray(off.any(axis=1))]
    short: list[bool] = (balance < 0).tolist()
    return [r for a, r in enumerate(x.ranks) if r in top and sends_bad[a] and short[a]]
