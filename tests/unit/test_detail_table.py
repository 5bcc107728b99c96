"""A batch's kept entries as one table (``digest.DetailTable``), each rank's read when
asked (``digest.Details``): the same entries as the dicts they replace, in every path
that reads them, and the same verdicts."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pytest

from frforensics.analyzer import AnalyzeOptions, analyze, load_dumps, wire
from frforensics.analyzer.digest import Details, DetailTable, EntryDetail, RankDigest
from frforensics.analyzer.load import digest_paths, rank_from_name
from frforensics.reporting import render
from frforensics.testing import JobBuilder

ROOT = Path(__file__).resolve().parents[2]
HANG = ROOT / "sample_dumps" / "p2p_deadlock"


def _dicts(tmp: Path) -> list[dict[int, EntryDetail]]:
    """Real entries: a 3-D job with a hang (unfinished entries, p2p, several groups)."""
    job = (JobBuilder(world_size=16, tp=2, pp=2, dp=4, ring_size=200, seed=5).steps(20)
           .skip(rank=3, group="tp", step=18))
    files = job.build().write_frdump(tmp, jobs=1)
    out = []
    for d in digest_paths([str(p) for p in files]):
        assert isinstance(d, RankDigest)
        assert isinstance(d.details, Details)  # what the loader hands out
        out.append(dict(d.details))
    assert sum(map(len, out)) >= 16 * 32
    return out


def test_each_rank_reads_back_its_entries(tmp_path: Path) -> None:
    dicts = _dicts(tmp_path)
    tables = DetailTable.build(dicts)
    assert tables is not None
    assert len({id(t._table) for t in tables}) == 1  # one table for the batch
    for want, got in zip(dicts, tables, strict=True):
        assert len(got) == len(want)
        assert list(got) == list(want)
        for row, e in want.items():
            # one entry built on its own, before the whole dict exists
            one = got.get(np.int64(row))
            assert one == e and type(one) is EntryDetail
            assert all(type(a) is type(b) for a, b in zip(one, e, strict=True))
            assert row in got and np.int64(row) in got
        assert got.get(max(want) + 1) is None and got.get(-1, "x") == "x"
        assert (max(want) + 1) not in got and "3" not in got
        assert dict(got.items()) == want and got == want
        assert got[min(want)] == want[min(want)]
        with pytest.raises(KeyError):
            got[max(want) + 1]
        assert got.get(max(want)) is got[max(want)]  # after ``[]``: the built dict
    # equal stacks and texts are stored once
    table = tables[0]._table
    assert len(table.stacks) == len({e.frames for d in dicts for e in d.values()})
    assert len(table.texts) == len(set(table.texts))


def test_a_batch_pickles_its_table_once(tmp_path: Path) -> None:
    dicts = _dicts(tmp_path)
    tables = DetailTable.build(dicts)
    assert tables is not None
    blob = pickle.dumps(tables, protocol=5)
    back = pickle.loads(blob)
    assert [dict(d) for d in back] == dicts
    assert len({id(d._table) for d in back}) == 1
    assert len(blob) < len(pickle.dumps(tables[0], protocol=5)) * 2


@pytest.mark.parametrize("bad", ["descending", "row_not_key", "overflow"])
def test_entries_a_table_cannot_hold_are_left_as_they_are(tmp_path: Path, bad: str) -> None:
    dicts = _dicts(tmp_path)[:3]
    rows = sorted(dicts[1])
    if bad == "descending":
        dicts[1] = {r: dicts[1][r] for r in reversed(rows)}
    elif bad == "row_not_key":
        dicts[1][rows[0]] = dicts[1][rows[0]]._replace(row=rows[0] + 1)
    else:
        dicts[1][rows[0]] = dicts[1][rows[0]]._replace(t_start_ns=1 << 64)
    assert DetailTable.build(dicts) is None


def _dump_sets() -> list[Path]:
    roots = [ROOT / "sample_dumps", ROOT / "tests" / "data"]
    dirs = {p.parent for r in roots for p in r.rglob("*")
            if p.is_file() and rank_from_name(p.name) is not None}
    return sorted(dirs)


def test_the_verdicts_are_the_dicts_verdicts() -> None:
    """Every stored dump set: the JSON report with each rank's entries as a plain dict
    (as the in-process loader keeps them) equals the report with them in one table."""
    sets = _dump_sets()
    assert len(sets) > 30
    for where in sets:
        dumps = load_dumps([where], jobs=1)
        if not dumps.digests:
            continue
        ranks = sorted(dumps.digests)
        assert not any(isinstance(dumps.digests[r].details, Details) for r in ranks)
        options = AnalyzeOptions(world_size=max(ranks) + 1)
        plain = render(analyze(dumps, options=options), "json")
        tables = DetailTable.build([dumps.digests[r].details for r in ranks])
        assert tables is not None, where
        lazy = dataclasses.replace(dumps, digests={
            r: dataclasses.replace(dumps.digests[r], details=t) for r, t in zip(ranks, tables, strict=True)})
        assert render(analyze(lazy, options=options), "json") == plain, where


def test_the_pool_hands_over_tables(tmp_path: Path) -> None:
    """Through the local pool (pickled by its workers) as read in this process."""
    two = load_dumps([HANG], jobs=2)
    one = load_dumps([HANG], jobs=1)
    assert two.ranks == one.ranks
    for r, d in two.digests.items():
        assert isinstance(d.details, Details)
        assert dict(d.details) == dict(one.digests[r].details)


def test_the_wire_decodes_into_tables_and_odd_entries_into_dicts(tmp_path: Path) -> None:
    """``wire.decode_batch`` (``fr-analyze --dask``'s client) builds tables too; entries a
    table cannot hold (a key that is not its entry's row) still decode, as dicts."""
    job = JobBuilder(world_size=8, tp=2, dp=4, ring_size=120, seed=2).steps(12)
    digests = [d for d in digest_paths([str(p) for p in job.build().write_frdump(tmp_path, jobs=1)])
               if isinstance(d, RankDigest)]
    back = wire.decode_batch(wire.encode_batch(digests))
    assert all(isinstance(d.details, Details) for d in back)
    assert [dict(d.details) for d in back] == [dict(d.details) for d in digests]
    rows = sorted(digests[3].details)
    odd = {r: e._replace(row=r + 1000) if r == rows[0] else e for r, e in digests[3].details.items()}
    back = wire.decode_batch(wire.encode_batch([*digests[:3], dataclasses.replace(digests[3], details=odd)]))
    assert all(type(d.details) is dict for d in back)
    assert back[3].details == odd and [dict(d.details) for d in back[:3]] == [
        dict(d.details) for d in digests[:3]]
