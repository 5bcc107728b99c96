"""Digests on the wire: compact, and decoded back into the identical RankDigest."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import pickle
import random
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frforensics.analyzer import wire
from frforensics.analyzer.digest import RankDigest
from frforensics.analyzer.load import digest_paths
from frforensics.model import DumpHeader
from frforensics.testing import JobBuilder


def assert_same_digest(a: RankDigest, b: RankDigest) -> None:
    for f in dataclasses.fields(RankDigest):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray), f.name
            assert x.dtype == y.dtype, f.name
            assert np.array_equal(x, y), f.name
        elif f.name == "details":  # a dict or a batch's table (``digest.Details``): as mappings
            assert isinstance(y, Mapping), f.name
            assert dict(x) == dict(y), f.name
        else:
            assert type(x) is type(y), f.name
            assert x == y, f.name
    for row, det in a.details.items():
        other = b.details[row]
        for name in det._fields:
            assert type(getattr(det, name)) is type(getattr(other, name)), name


def _digests(tmp: Path, job: JobBuilder, ring: int) -> dict[str, list[RankDigest]]:
    dumps = job.build()
    out = {}
    for kind, files in (("native", dumps.write_native(tmp / "native", jobs=1)),
                        ("frdump", dumps.write_frdump(tmp / "frdump", jobs=1))):
        outcomes = digest_paths([str(p) for p in files])
        out[kind] = [o for o in outcomes if isinstance(o, RankDigest)]
        assert len(out[kind]) == len(files)
        assert all(len(d) == ring for d in out[kind])
    return out


@pytest.fixture(scope="module")
def hang_digests(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[RankDigest]]:
    """A 3-D job with a hang (unfinished entries, p2p, several groups), 400-entry rings."""
    job = (JobBuilder(world_size=32, tp=2, pp=4, dp=4, ring_size=400, seed=3).steps(40)
           .skip(rank=5, group="tp", step=38))
    return _digests(tmp_path_factory.mktemp("hang"), job, 400)


@pytest.mark.parametrize("kind", ["native", "frdump"])
@pytest.mark.parametrize("codec", ["zlib", "lzma"])
def test_batch_round_trip_is_the_identical_digest(hang_digests: dict[str, list[RankDigest]],
                                                  kind: str, codec: str) -> None:
    digests = hang_digests[kind]
    back = wire.decode_batch(wire.encode_batch(digests, codec=codec))
    assert len(back) == len(digests)
    for a, b in zip(digests, back, strict=True):
        assert_same_digest(a, b)
    assert any(d.pending_rows().size for d in back), "the hang left unfinished entries"
    assert any(d.is_p2p.any() for d in back), "the pipeline stages send and receive"


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_any_subset_and_order_of_ranks_round_trips(hang_digests: dict[str, list[RankDigest]],
                                                   data: st.DataObject) -> None:
    pool = hang_digests["native"] + hang_digests["frdump"]
    picked = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=6))
    for a, b in zip(picked, wire.decode_batch(wire.encode_batch(picked)), strict=True):
        assert_same_digest(a, b)


def test_empty_batches_and_empty_rings_round_trip(hang_digests: dict[str, list[RankDigest]]) -> None:
    assert wire.decode_batch(wire.encode_batch([])) == []
    d = hang_digests["frdump"][0]
    empty = dataclasses.replace(d, details={}, **{
        f.name: getattr(d, f.name)[:0] for f in dataclasses.fields(d)
        if isinstance(getattr(d, f.name), np.ndarray)})
    for a, b in zip([empty, d, empty], wire.decode_batch(wire.encode_batch([empty, d, empty])),
                    strict=True):
        assert_same_digest(a, b)
    (back,) = wire.decode_batch(wire.encode_batch([empty]))
    assert_same_digest(empty, back)


def test_groups_travel_once_per_batch_and_are_shared_after(
        hang_digests: dict[str, list[RankDigest]]) -> None:
    digests = hang_digests["frdump"]
    cache = wire.WireCache()
    first = wire.decode_batch(wire.encode_batch(digests[:16]), cache=cache)
    second = wire.decode_batch(wire.encode_batch(digests[16:]), cache=cache)
    default = [next(g for g in d.groups if g.desc == "default_pg") for d in first + second]
    assert all(g is default[0] for g in default)
    # members as a range: a 16,384-rank default group costs a few bytes
    big = dataclasses.replace(digests[0], groups=(dataclasses.replace(
        digests[0].groups[0], ranks=tuple(range(16384))),))
    assert len(wire.encode_batch([big])) < len(wire.encode_batch([digests[0]])) + 64


@pytest.mark.parametrize("kind", ["native", "frdump"])
def test_a_2000_entry_digest_is_a_few_kib(tmp_path: Path, kind: str) -> None:
    """The benchmark's ring: pickled ~180 KiB, compressed on the wire well under 10 KiB."""
    digests = _digests(tmp_path, JobBuilder(world_size=8, tp=8, dp=1, ring_size=2000, seed=0)
                       .steps(200), 2000)[kind]
    for d in digests:
        size = len(wire.encode_batch([d]))
        assert size < 10 * 1024
        assert size * 20 < len(pickle.dumps(d, protocol=5))


#: columns whose values index the digest's own tables (the decoder checks them)
_INDEX_COLUMNS = frozenset({"group", "unit", "state"})
_ARRAY_ALIASES = {"I8": np.int64, "I4": np.int32, "U4": np.uint32, "U1": np.uint8}


def _other_value(name: str, annotation: str, value: Any, n: int) -> Any:
    """A value of the field's type that differs from ``value`` (None: no rule for this type)."""
    if isinstance(value, np.ndarray):
        if name in _INDEX_COLUMNS:  # indices into the digest's tables: stay valid
            return value[::-1].copy()
        return (value[::-1] + 3).astype(value.dtype) if len(value) else value
    if value is None:
        alias = next((a for a in _ARRAY_ALIASES if a in annotation), None)
        if alias is not None:
            return np.arange(n, dtype=_ARRAY_ALIASES[alias])[::-1].copy()
        if name == "splits":  # rows to (sent, expected) element counts
            return {0: ((1, 2), (2, 1)), n - 1: ((0, 5), (5, 0))}
        if "int" in annotation:
            return 42
        if "str" in annotation:
            return "node-42"
        return None
    if isinstance(value, enum.Enum):
        return next(v for v in type(value) if v is not value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 12345
    if isinstance(value, str):
        return value + "-other"
    return None


def test_every_field_of_a_digest_travels(hang_digests: dict[str, list[RankDigest]]) -> None:
    """Each field in turn given another value (arrays where None, flags flipped, ...).

    A field added to RankDigest later is covered without touching this test; a
    type the wire cannot carry fails ``encode_batch`` loudly.
    """
    base = hang_digests["frdump"][5]
    changed = []
    own = [(False, f) for f in dataclasses.fields(RankDigest) if f.name != "header"]
    for in_header, f in [*own, *((True, f) for f in dataclasses.fields(DumpHeader))]:
        holder = base.header if in_header else base
        value = _other_value(f.name, str(f.type), getattr(holder, f.name), len(base))
        if value is None:
            continue
        d = (dataclasses.replace(base, header=dataclasses.replace(base.header, **{f.name: value}))
             if in_header else dataclasses.replace(base, **{f.name: value}))
        changed.append(f.name)
        (back,) = wire.decode_batch(wire.encode_batch([d]))
        assert_same_digest(d, back)
        # and among other ranks, whose values differ
        batch = [hang_digests["frdump"][0], d, hang_digests["native"][1]]
        for a, b in zip(batch, wire.decode_batch(wire.encode_batch(batch)), strict=True):
            assert_same_digest(a, b)
    assert {"unit", "gpu_states", "splits", "seq", "t_enqueue_ns", "dump_time_ns", "host", "format",
            "dump_reason", "job_id", "dump_monotonic_ns"} <= set(changed)


@pytest.mark.parametrize("sample", sorted(p.name for p in (
    Path(__file__).resolve().parents[1] / "data" / "native").iterdir() if p.is_dir()))
def test_sample_dumps_round_trip(sample: str) -> None:
    root = Path(__file__).resolve().parents[1] / "data" / "native" / sample
    digests = [d for d in digest_paths([root]) if isinstance(d, RankDigest)]
    assert digests
    for a, b in zip(digests, wire.decode_batch(wire.encode_batch(digests)), strict=True):
        assert_same_digest(a, b)


_INT_DTYPES = ["<i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "|b1"]


@settings(max_examples=300, deadline=None)
@given(dtype=st.sampled_from(_INT_DTYPES), data=st.data(),
       bases=st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=4))
def test_any_integer_columns_round_trip(dtype: str, data: st.DataObject, bases: list[int]) -> None:
    """One column per batch, a segment per rank: any values, lengths and bases come back."""
    dt = np.dtype(dtype)
    if dt.kind == "b":
        values: st.SearchStrategy[list[Any]] = st.lists(st.booleans(), max_size=200)
    else:
        info = np.iinfo(dt)
        ints = st.integers(int(info.min), int(info.max))
        small = st.integers(max(int(info.min), -3), min(int(info.max), 3))
        values = st.lists(st.one_of(ints, small), max_size=200) | st.lists(small, min_size=64,
                                                                            max_size=200)
    arrays = [np.asarray(data.draw(values), dtype=dt) for _ in bases]
    blob = wire._Blob()
    spec = wire._put_segments(blob, arrays, bases)
    back = wire._get_segments(memoryview(b"".join(blob.parts)), spec, bases)
    assert len(back) == len(arrays)
    for a, b in zip(arrays, back, strict=True):
        assert b.dtype == a.dtype
        assert np.array_equal(b, a)


def test_corrupt_payloads_fail_with_one_error(hang_digests: dict[str, list[RankDigest]]) -> None:
    payload = bytearray(wire.encode_batch(hang_digests["frdump"][:3], level=0))
    rng = random.Random(7)
    for _ in range(300):
        bad = bytearray(payload)
        for _ in range(rng.randint(1, 4)):
            bad[rng.randrange(5, len(bad))] = rng.randrange(256)
        with contextlib.suppress(wire.WireError):  # anything else fails the test
            wire.decode_batch(bytes(bad))
    for cut in (0, 3, 5, 40, len(payload) // 2, len(payload) - 1):
        with pytest.raises(wire.WireError):
            wire.decode_batch(bytes(payload[:cut]))
    with pytest.raises(wire.WireError):
        wire.decode_batch(pickle.dumps(hang_digests["frdump"][0]))


def _with_details(payload: bytes, edit: Any) -> bytes:
    """``payload`` with its entry-detail matrix (a row per field, ``wire._pack_details``)
    passed through ``edit`` (a hostile worker's payload)."""
    doc = msgpack.unpackb(zlib.decompress(payload[5:]), raw=False, strict_map_key=False)
    counts, names, kinds, off, ln = doc["details"]
    n = sum(counts)
    matrix = wire._unshuffle(doc["blob"][off:off + ln], np.dtype(np.int64),
                             (len(names) + 1) * n).reshape(-1, n).copy()
    edit(matrix)
    data = wire._shuffle(matrix.reshape(-1))
    doc["details"] = [counts, names, kinds, len(doc["blob"]), len(data)]
    doc["blob"] = doc["blob"] + data
    return wire._MAGIC + wire._ZLIB + zlib.compress(msgpack.packb(doc, use_bin_type=True))


def test_what_the_decoder_accepts_the_field_by_field_check_accepts(
        hang_digests: dict[str, list[RankDigest]]) -> None:
    # decode_batch checks its own digests' stacks and entry details once, at their
    # tables (check_digest(decoded=...)); the full check is the oracle, on payloads
    # whose detail matrix a hostile worker rewrote (row numbers, string, stack and
    # state indices, flags, times: small, negative, past every table, huge)
    payload = wire.encode_batch([*hang_digests["frdump"][:3], *hang_digests["native"][3:5]])
    rng = np.random.default_rng(11)
    picks = np.array([-(1 << 63), -2, -1, 0, 1, 2, 3, 7, 399, 400, 401, 1 << 20, (1 << 63) - 1])
    accepted = refused = 0
    for _ in range(300):
        def edit(m: np.ndarray) -> None:
            k = int(rng.integers(1, 6))
            m[rng.integers(0, m.shape[0], k), rng.integers(0, m.shape[1], k)] = rng.choice(picks, k)
        if _refused_or_fully_checked(_with_details(payload, edit)):
            refused += 1
        else:
            accepted += 1
    assert accepted > 20 and refused > 20, (accepted, refused)


def _refused_or_fully_checked(payload: bytes) -> bool:
    """True when the decoder refuses ``payload``; else every digest it gave must pass
    the full field-by-field check (the oracle), and False."""
    try:
        back = wire.decode_batch(payload)
    except wire.WireError:
        return True
    for d in back:
        wire.check_digest(d)
    return False


@pytest.mark.parametrize(("edit", "error"), [("row_past_the_entries", "row outside"),
                                             ("op_missing", "field op without its string")])
def test_entry_details_the_full_check_refuses_are_refused_by_the_decoder(
        hang_digests: dict[str, list[RankDigest]], edit: str, error: str) -> None:
    d = hang_digests["frdump"][5]
    row, det = next(iter(d.details.items()))
    details = dict(d.details)
    if edit == "row_past_the_entries":
        details[len(d) + 3] = det
    else:
        details[row] = det._replace(op=None)
    bad = dataclasses.replace(d, details=details)
    with pytest.raises(wire.WireError):
        wire.check_digest(bad)  # the oracle
    with pytest.raises(wire.WireError, match=error):
        wire.decode_batch(wire.encode_batch([hang_digests["frdump"][0], bad]))


def test_a_local_analysis_never_imports_dask() -> None:
    import subprocess
    import sys

    data = Path(__file__).resolve().parents[1] / "data" / "native" / "missing_rank" / "pickle"
    code = ("import sys\nfrom frforensics.cli import main\ntry:\n"
            f"    main([{str(data)!r}, '--format', 'json', '--jobs', '1'])\n"
            "except SystemExit:\n    pass\n"
            "assert 'distributed' not in sys.modules and 'dask' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_progression_of_members_on_the_wire_is_bounded_and_checked() -> None:
    from frforensics.analyzer.wire import WireError, _members, _members_back

    assert _members(tuple(range(10, 2, -2))) == [10, -2, 4]
    assert _members_back([10, -2, 4]) == (10, 8, 6, 4)
    assert _members_back(_members((5,))) == (5,)
    for bad in ([0, 1, 1 << 40], [0, 0, 5], [3, -2, 5], [-1, 1, 3]):
        with pytest.raises(WireError):
            _members_back(bad)


def _doc(payload: bytes) -> dict[str, Any]:
    return msgpack.unpackb(zlib.decompress(payload[5:]), raw=False, strict_map_key=False)


def _payload(doc: dict[str, Any]) -> bytes:
    return wire._MAGIC + wire._ZLIB + zlib.compress(msgpack.packb(doc, use_bin_type=True))


def test_a_group_seen_in_an_earlier_payload_is_not_decoded_again_but_still_checked(
        hang_digests: dict[str, list[RankDigest]]) -> None:
    # the cache knows a group by the form it was sent in: the 100,000-rank default
    # group is not expanded and hashed again for every payload of a load
    digests = hang_digests["frdump"]
    cache = wire.WireCache()
    payload = wire.encode_batch(digests[:4])
    first = wire.decode_batch(payload, cache=cache)
    calls = []
    real = wire._members_back
    try:
        wire._members_back = lambda *a, **k: calls.append(a) or real(*a, **k)  # type: ignore[assignment]
        again = wire.decode_batch(payload, cache=cache)
    finally:
        wire._members_back = real
    assert calls == []
    assert all(g is h for d, e in zip(first, again, strict=True)
               for g, h in zip(d.groups, e.groups, strict=True))
    # members of another type that compare equal (True == 1) are not the cached group:
    # decoded, and refused
    doc = _doc(payload)
    at = next(i for i, g in enumerate(doc["groups"]) if isinstance(g[2], list))
    doc["groups"][at][2] = [True if v == 1 else float(v) for v in doc["groups"][at][2]]
    with pytest.raises(wire.WireError, match="group members"):
        wire.decode_batch(_payload(doc), cache=cache)
    # nor under other limits: a world the cached group does not fit in
    small = dataclasses.replace(wire.DEFAULT_LIMITS, max_rank=4)
    with pytest.raises(wire.WireError, match="group members"):
        wire.decode_batch(payload, cache=cache, limits=small)


def test_equal_op_and_site_tables_are_one_checked_object(
        hang_digests: dict[str, list[RankDigest]]) -> None:
    digests = hang_digests["frdump"][:6]
    back = wire.decode_batch(wire.encode_batch(digests))
    for d, e in zip(digests, back, strict=True):
        assert e.op_names == d.op_names and e.sites == d.sites
    assert len({id(d.op_names) for d in back}) == 1
    # a hostile second table (equal names, one value not a string) is its own, and refused
    doc = _doc(wire.encode_batch(digests[:2]))
    rows = msgpack.unpackb(doc["digests"], raw=False, strict_map_key=False, use_list=True,
                           ext_hook=msgpack.ExtType)
    key = next(iter(rows[1]["op_names"]))
    rows[1]["op_names"][key] = 7
    doc["digests"] = msgpack.packb(rows, use_bin_type=True)
    with pytest.raises(wire.WireError, match="op_names is not a bounded table"):
        wire.decode_batch(_payload(doc))


def test_one_value_segments_are_shared_read_only_views() -> None:
    x = np.array([5, 5, 5, 5, 5, 5, 1, 2, 5, 5, 5], dtype=np.int64)
    parts = wire._one_value_views(x, [3, 3, 2, 0, 3])
    assert [p.tolist() for p in parts] == [[5, 5, 5], [5, 5, 5], [1, 2], [], [5, 5, 5]]
    assert parts[0] is parts[1] is parts[4]
    assert parts[0].strides == (0,) and not parts[0].flags.writeable


_BAD_COLUMNS = {
    "group_past_its_table": ("group", lambda d: _set(d.group, 0, len(d.groups)), "group index"),
    "group_below_minus_1": ("group", lambda d: _set(d.group, 1, -2), "group index"),
    "peer_past_the_world": ("peer", lambda d: _set(d.peer, 2, 1 << 20), "peer outside"),
    "peer_below_minus_1": ("peer", lambda d: _set(d.peer, 2, -5), "peer outside"),
    "state_that_does_not_exist": ("state", lambda d: _set(d.state, 3, 200), "op state"),
    "unit_past_the_rows": ("unit", lambda d: _set(np.arange(len(d)), 4, len(d)), "coalesced unit"),
    "unit_negative": ("unit", lambda d: _set(np.arange(len(d)), 4, -1), "coalesced unit"),
    "seq_one_row_short": ("seq", lambda d: np.array(d.seq[:-1]), "rows, not"),
    "seq_as_int32": ("seq", lambda d: d.seq.astype(np.int32), "one-dimensional <i8"),
    "size_as_float": ("size", lambda d: d.size.astype(np.float64), "one-dimensional <i8"),
}


def _set(a: np.ndarray, i: int, value: int) -> np.ndarray:
    out = np.array(a, dtype=a.dtype)
    out[i] = value
    return out


@pytest.mark.parametrize("case", sorted(_BAD_COLUMNS))
def test_a_column_the_full_check_refuses_is_refused_by_the_batch_check(
        hang_digests: dict[str, list[RankDigest]], case: str) -> None:
    # the decoder checks the columns of its batch at once (``_RowCounts``), not digest
    # by digest: the full check is the oracle, one bad column of one digest at a time
    name, make, error = _BAD_COLUMNS[case]
    good, d = hang_digests["frdump"][0], hang_digests["frdump"][5]
    bad = dataclasses.replace(d, **{name: make(d)})
    with pytest.raises(wire.WireError):
        wire.check_digest(bad)
    with pytest.raises(wire.WireError, match=error):
        wire.decode_batch(wire.encode_batch([good, bad]))


def test_what_the_batch_column_check_accepts_the_full_check_accepts(
        hang_digests: dict[str, list[RankDigest]]) -> None:
    # random bytes of the payload's blob (the columns, the detail matrix, the frame
    # table) rewritten by a hostile worker: refused, or every digest passes the full check
    payload = wire.encode_batch([*hang_digests["frdump"][:3], *hang_digests["native"][3:6]],
                                level=0)
    doc = _doc(payload)
    blob = bytes(doc["blob"])
    rng = random.Random(5)
    accepted = refused = 0
    for _ in range(400):
        b = bytearray(blob)
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
        doc["blob"] = bytes(b)
        if _refused_or_fully_checked(_payload(doc)):
            refused += 1
        else:
            accepted += 1
    assert accepted > 40 and refused > 40, (accepted, refused)


@pytest.mark.parametrize(("name", "value"), [("group", None), ("state", None), ("op_hash", None),
                                             ("unit", 5), ("numel", "x")])
def test_a_column_a_digest_lacks_or_sends_as_a_value_is_refused(
        hang_digests: dict[str, list[RankDigest]], name: str, value: Any) -> None:
    good, d = hang_digests["frdump"][0], hang_digests["frdump"][5]
    bad = dataclasses.replace(d, **{name: value})
    with pytest.raises(wire.WireError):
        wire.check_digest(bad)  # the oracle
    with pytest.raises(wire.WireError, match=f"column {name} of a digest is missing"):
        wire.decode_batch(wire.encode_batch([good, bad]))


# ---- a review's hostile payloads (7 December): each got past the decoder before

def _rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return msgpack.unpackb(doc["digests"], raw=False, strict_map_key=False, use_list=True,
                           ext_hook=msgpack.ExtType)


def _append(doc: dict[str, Any], data: bytes) -> int:
    offset = len(doc["blob"])
    doc["blob"] = doc["blob"] + data
    return offset


def test_a_column_sent_twice_is_refused(hang_digests: dict[str, list[RankDigest]]) -> None:
    # split in two entries, the bounds of the second stood in for the first's: digest
    # 0's group 99 (of 4) got past the batch check
    ds = hang_digests["frdump"][:2]
    doc = _doc(wire.encode_batch(ds))
    columns = []
    for name, members, spec in doc["columns"]:
        if name != "group":
            columns.append([name, members, spec])
            continue
        bad = ds[0].group.copy()
        bad[0] = 99
        for m, g in ((0, bad), (1, ds[1].group)):
            sp = wire._put_column(wire._Blob(), g)
            data = wire._shuffle(g.astype(np.dtype(sp[3])))
            sp[4], sp[5] = _append(doc, data), len(data)
            columns.append(["group", [m], sp])
    doc["columns"] = columns
    with pytest.raises(wire.WireError, match="sent twice"):
        wire.decode_batch(_payload(doc))


def test_a_digest_without_call_sites_vouches_for_no_other_none(
        hang_digests: dict[str, list[RankDigest]]) -> None:
    # ``sites`` None is legal; its id once joined the checked ones, and a later
    # digest's thread or death frames of None passed (a TypeError in the analysis)
    ds = hang_digests["frdump"][:2]
    doc = _doc(wire.encode_batch(ds))
    rows = _rows(doc)
    rows[0]["sites"] = None
    rows[1]["death"] = msgpack.ExtType(wire._EXT_DEATH, msgpack.packb(["exc", "boom", None]))
    doc["digests"] = msgpack.packb(rows, use_bin_type=True)
    with pytest.raises(wire.WireError, match="death"):
        wire.decode_batch(_payload(doc))
    rows[1].pop("death")
    rows[1]["death"] = None
    doc["digests"] = msgpack.packb(rows, use_bin_type=True)
    assert wire.decode_batch(_payload(doc))[0].sites is None  # alone, it is fine


@pytest.mark.parametrize("dtype, value", [("<f8", 1.5), ("<u8", 2**64 - 1), ("|b1", True)])
def test_frame_lines_that_are_not_int64_are_refused_and_never_cached(
        hang_digests: dict[str, list[RankDigest]], dtype: str, value: object) -> None:
    # the stacks built from the frame table are trusted, and cached for later payloads
    ds = hang_digests["frdump"][:2]
    honest = wire.encode_batch(ds)
    doc = _doc(honest)
    n = wire._get_column(memoryview(doc["blob"]), doc["frames"][1]).shape[0]
    a = np.full(n, value, dtype=dtype)
    data = wire._shuffle(a) if dtype == "<u8" else a.tobytes()
    doc["frames"][1] = [dtype, [n], 0, dtype, _append(doc, data), len(data), None]
    cache = wire.WireCache()
    with pytest.raises(wire.WireError, match="frame table"):
        wire.decode_batch(_payload(doc), cache=cache)
    back = wire.decode_batch(honest, cache=cache)
    for d in back:
        wire.check_digest(d)  # the full check: no frame of the refused payload came in
        assert all(type(f.line) is int for t in d.threads for f in t.frames)


def test_a_segment_longer_than_a_ring_is_refused_before_it_is_decoded(
        hang_digests: dict[str, list[RankDigest]]) -> None:
    ds = hang_digests["frdump"][:1]
    doc = _doc(wire.encode_batch(ds))
    long = 1 << 16
    offset = _append(doc, bytes(long))
    doc["columns"] = [[name, [0], [spec[0], [long], 0, "|u1" if spec[0] == "|u1" else "|i1",
                                   offset, long, None]]
                      for name, _members, spec in doc["columns"]]
    limits = dataclasses.replace(wire.DEFAULT_LIMITS, max_entries=long - 1)
    with pytest.raises(wire.WireError, match=f"more than {long - 1} rows"):
        wire.decode_batch(_payload(doc), limits=limits)


@pytest.mark.parametrize("name, dtype", [("seq", np.int32), ("size", np.float64)])
def test_a_column_of_another_dtype_is_refused_as_sent_when_every_digest_has_it(
        hang_digests: dict[str, list[RankDigest]], name: str, dtype: Any) -> None:
    # one entry for the column (no second dtype beside it): the check on its sent dtype
    # is the only one, made before it is decoded
    d = hang_digests["frdump"][5]
    bad = dataclasses.replace(d, **{name: getattr(d, name).astype(dtype)})
    with pytest.raises(wire.WireError, match=f"column {name} is not a one-dimensional <i8"):
        wire.decode_batch(wire.encode_batch([bad]))
