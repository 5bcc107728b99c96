"""Hypothesis structure mutations of frdump files: a value anywhere in the document
replaced by anything msgpack can hold, or removed. The reader answers with a trace
whose every column is in its domain, or one ``DumpError`` — never another
exception — and a trace it returns digests without error."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frforensics.analyzer.digest import digest
from frforensics.errors import DumpError
from frforensics.formats import decode_dump, frdump
from frforensics.formats.limits import DEFAULT_LIMITS
from frforensics.formats.sources import check_trace
from frforensics.model import DeathInfo, Frame, OpState, PeerHeartbeat, RankTrace, ThreadStack

DATA = Path(__file__).resolve().parents[1] / "data" / "native" / "timeout" / "pickle"


def _base() -> dict[str, Any]:
    trace = decode_dump((DATA / "nccl_trace_rank_1").read_bytes(), source="x", rank_hint=1)
    frames = (Frame("train.py", 3, "step"),)
    header = replace(
        trace.header, world_size=4, host="node01", pid=7, dump_time_ns=10**18,
        threads=(ThreadStack("MainThread", 1, True, frames),),
        stale_peers=(PeerHeartbeat(2, 1.5),), death=DeathInfo("exception", "boom", frames))
    trace = replace(trace, header=header, stacks=(*trace.stacks, frames), notes=("n",))
    doc: dict[str, Any] = msgpack.unpackb(frdump.encode(trace)[len(frdump.MAGIC):], raw=False,
                                          strict_map_key=False)
    return doc


BASE = _base()


def _paths(node: Any, prefix: tuple[Any, ...] = (), depth: int = 0) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if depth >= 4:
        return out
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k), depth + 1)
    elif isinstance(node, list):
        for i, v in enumerate(node[:3]):
            out += _paths(v, (*prefix, i), depth + 1)
    return out


PATHS = _paths(BASE)

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True),
    st.text(max_size=12), st.binary(max_size=40),
    st.sampled_from([-1, 0, 200, 2**31 - 1, 2**31, 2**63 - 1, 10**7, 10**9, b"\xff" * 8]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-(2**63), 2**63 - 1)), inner,
                                            max_size=3)),
    max_leaves=8,
)
_DELETE = object()


def _mutate(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    node = doc
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value


def _domains_hold(trace: RankTrace) -> None:
    e = trace.entries
    assert len(e) <= DEFAULT_LIMITS.max_entries
    if len(e):
        assert int(e.state.max()) <= OpState.FAILED
        assert int(e.seq.max()) < DEFAULT_LIMITS.max_seq and int(e.seq.min()) >= -1
        for col in (e.t_enqueue_ns, e.t_start_ns, e.t_complete_ns, e.timeout_ms):
            assert int(col.min()) >= 0
    for g in trace.groups:
        assert g.ranks is None or all(0 <= r < DEFAULT_LIMITS.max_rank for r in g.ranks)
    assert all(len(s) <= DEFAULT_LIMITS.max_string_chars + 40 for s in trace.strings)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(PATHS) - 1),
                          st.one_of(_values, st.just(_DELETE))), min_size=1, max_size=3))
def test_mutated_frdump_is_a_trace_or_one_dump_error(mutations: list[tuple[int, Any]]) -> None:
    doc = msgpack.unpackb(msgpack.packb(BASE, use_bin_type=True), raw=False, strict_map_key=False)
    for index, value in mutations:
        try:
            _mutate(doc, PATHS[index], value)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed the path
    data = frdump.MAGIC + msgpack.packb(doc, use_bin_type=True)
    try:
        trace = frdump.decode(data, source="m")
    except DumpError:
        return
    _domains_hold(trace)
    checked = check_trace(replace(trace, rank=1) if trace.rank is None else trace)
    if isinstance(checked, RankTrace):
        assert checked.rank is not None
        digest(checked, rank=checked.rank)


def test_declared_entry_count_without_columns_allocates_nothing() -> None:
    doc = dict(BASE, entries={"n": 10**7, "dropped": 0, "columns": {}})
    data = frdump.MAGIC + msgpack.packb(doc, use_bin_type=True)
    try:
        frdump.decode(data, source="m")
    except DumpError as exc:
        assert "carries no entry columns" in str(exc) or "limit" in str(exc)
    else:
        raise AssertionError("10^7 entries without columns were accepted")
    assert np.dtype("<i8").itemsize * 10**7 > len(data)  # what accepting it would have cost
