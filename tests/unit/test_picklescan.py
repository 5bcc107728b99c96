"""The C opcode scanner reads native pickles exactly as the Python readers do.

``native.pickle_to_trace`` sends a pickle through ``_picklescan.scan`` first; it
must give the same trace as ``to_trace(decode_pickle(data))`` on every document
it accepts, give way (``None``) on everything else, and call a stream corrupt
(a ``str``) only where the unpickler fails too.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import platform
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_perf_paths import _doc, _resolved

from frforensics.errors import CorruptDumpError, DumpError, UnsafeDumpError
from frforensics.formats import native
from frforensics.model import RankTrace, SourceFormat
from frforensics.testing import JobBuilder

DATA = Path(__file__).resolve().parents[1] / "data" / "native"
SAMPLES = Path(__file__).resolve().parents[2] / "sample_dumps"

scanner = pytest.mark.skipif(native._picklescan is None, reason="C scanner not compiled")


def _python_path(data: bytes, **kw: Any) -> RankTrace:
    doc = native.decode_pickle(data, source="x")
    return native.to_trace(doc, source="x", fmt=SourceFormat.NATIVE_PICKLE, rank=0, **kw)


def _scanned(data: bytes, **kw: Any) -> RankTrace | None:
    sc = native._picklescan.scan(data)
    if sc is None:
        return None
    assert not isinstance(sc, str), sc
    return native._trace_from_scan(sc, source="x", rank=0, detail_tail=kw.get("detail_tail"))


def _same(a: RankTrace, b: RankTrace) -> None:
    assert _resolved(a) == _resolved(b)
    # not only the same values: the same tables, in the same order
    assert (a.strings, a.stacks, a.groups, a.version, a.rank) == (
        b.strings, b.stacks, b.groups, b.version, b.rank)


def _captured() -> list[bytes]:
    paths = sorted(DATA.glob("*/pickle/nccl_trace_rank_*")) + sorted(SAMPLES.glob("*/native/*"))
    return [d for d in (p.read_bytes() for p in paths) if native.looks_like_pickle(d[:2])]


@pytest.mark.skipif(platform.python_implementation() != "CPython", reason="built for CPython only")
def test_scanner_is_compiled_on_cpython() -> None:
    # setup.py marks the extension optional; on CI's CPython a silent compile
    # failure would quietly slow every native read, so it is checked here.
    assert native._picklescan is not None
    assert native.scanner_available()


@scanner
@pytest.mark.parametrize("tail", [None, 8])
def test_scanner_reads_real_torch_dumps_like_the_unpickler(tail: int | None) -> None:
    datas = _captured()
    assert len(datas) > 20
    for data in datas:
        got = _scanned(data, detail_tail=tail)
        assert got is not None  # real dumps are regular: the fast path takes them all
        _same(got, _python_path(data, detail_tail=tail))


@scanner
@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_scanner_reads_builder_dumps_of_every_protocol(protocol: int) -> None:
    dumps = (JobBuilder(world_size=8, tp=2, pp=2, dp=2, ring_size=120, seed=5).steps(6)
             .skip(rank=3, group="tp", step=5).build())
    for r in dumps.native_ranks[:3]:
        doc = pickle.loads(dumps.native_bytes(r))
        data = pickle.dumps(doc, protocol=protocol)
        got = _scanned(data, detail_tail=4)
        assert got is not None
        _same(got, _python_path(data, detail_tail=4))
        assert (got.entries.stack >= 0).all() and (got.entries.in_numel > 0).any()


@scanner
def test_pickle_to_trace_uses_the_scanner_and_can_be_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = pickle.dumps(_doc(), protocol=2)
    calls: list[bytes] = []
    real = native.decode_pickle
    monkeypatch.setattr(native, "decode_pickle", lambda d, **kw: calls.append(d) or real(d, **kw))
    fast = native.pickle_to_trace(data, source="x", rank=0)
    assert calls == []
    monkeypatch.setenv("FRFORENSICS_PICKLE_SCAN", "0")
    slow = native.pickle_to_trace(data, source="x", rank=0)
    assert calls == [data]
    _same(fast, slow)


# ---- odd documents: the scanner agrees or gives way --------------------------------

_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 2**40), st.integers(2**63, 2**70),
    st.floats(allow_nan=False), st.text(max_size=6), st.binary(max_size=3),
)
_value = st.recursive(
    _scalar,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner, inner),
        st.dictionaries(st.sampled_from(["name", "filename", "line", "x"]), inner, max_size=3),
    ),
    max_leaves=6,
)
_shape = st.lists(st.integers(0, 9), max_size=3)
_FIELDS = sorted(_doc(1)["entries"][0])


@st.composite
def _odd_doc(draw: st.DrawFn) -> dict[str, Any]:
    doc = _doc(draw(st.integers(0, 4)))
    for e in doc["entries"]:
        for _ in range(draw(st.integers(0, 2))):
            key = draw(st.sampled_from(_FIELDS))
            if draw(st.booleans()):
                e.pop(key, None)
            elif key in ("input_sizes", "output_sizes") and draw(st.booleans()):
                e[key] = draw(st.one_of(st.lists(_shape, max_size=3), st.tuples(_shape)))
            else:
                e[key] = draw(_value)
    if draw(st.booleans()):
        doc["pg_config"] = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}
    return doc


@scanner
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=_odd_doc(), protocol=st.integers(2, 5))
def test_scanner_agrees_with_the_python_readers_on_odd_documents(
    doc: dict[str, Any], protocol: int
) -> None:
    data = pickle.dumps(copy.deepcopy(doc), protocol=protocol)
    sc = native._picklescan.scan(data)
    assert not isinstance(sc, str)  # a well-formed stream is never called corrupt
    try:
        expected: RankTrace | Exception = _python_path(data)
    except DumpError as exc:
        expected = exc
    if sc is None:
        return  # gave way: the Python reader answered above
    assert not isinstance(expected, Exception), f"scanner accepted what Python refuses: {expected}"
    _same(native._trace_from_scan(sc, source="x", rank=0, detail_tail=None), expected)


@scanner
def test_mutated_dumps_never_read_differently() -> None:
    """Flipped and cut bytes of real dumps: same trace, give way, or corrupt on both paths."""
    rng = random.Random(7)
    datas = _captured()
    verdicts = {"same": 0, "gave_way": 0, "corrupt": 0}
    for _ in range(1500):
        d = bytearray(rng.choice(datas))
        if rng.random() < 0.3:
            d = d[: rng.randrange(len(d))]
        else:
            for _ in range(rng.randrange(1, 4)):
                d[rng.randrange(len(d))] = rng.randrange(256)
        data = bytes(d)
        sc = native._picklescan.scan(data)
        if sc is None:
            verdicts["gave_way"] += 1
            continue
        if isinstance(sc, str):
            verdicts["corrupt"] += 1
            if "memo index past" in sc:
                continue  # the unpickler would first allocate gigabytes
            with pytest.raises(DumpError):
                _python_path(data)
            continue
        verdicts["same"] += 1
        _same(native._trace_from_scan(sc, source="x", rank=0, detail_tail=None), _python_path(data))
    assert all(verdicts.values()), verdicts


# ---- hostile and broken files ------------------------------------------------------


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("pwned",))


def test_globals_are_refused_through_the_fast_entry_point() -> None:
    doc = _doc()
    doc["entries"][1]["state"] = _Evil()
    with pytest.raises(UnsafeDumpError, match=r"refused unread"):
        native.pickle_to_trace(pickle.dumps(doc, protocol=2), source="f", rank=0)


def test_truncated_pickle_is_one_clear_error() -> None:
    data = pickle.dumps(_doc(), protocol=2)
    with pytest.raises(CorruptDumpError, match=r"^f: truncated or corrupt pickle"):
        native.pickle_to_trace(data[: len(data) // 2], source="f", rank=0)


@scanner
def test_memo_index_past_the_file_is_refused_at_once() -> None:
    # EMPTY_DICT, LONG_BINPUT 2**31 - 1, STOP: the unpickler would size its memo to it
    data = b"\x80\x02}r\xff\xff\xff\x7f."
    with pytest.raises(CorruptDumpError, match="memo index past the size of the file"):
        native.pickle_to_trace(data, source="f", rank=0)


def _scanner_hash_8(words: Any) -> Any:
    """``hash_bytes`` of ``_picklescan.c`` on 8-byte strings (one word, no tail), vectorized."""
    import numpy as np

    m = np.uint64(0xFFFFFFFFFFFFFFFF)
    with np.errstate(over="ignore"):
        h = np.uint64(14695981039346656037) ^ words
        h = (h * np.uint64(1099511628211)) & m
        h ^= h >> np.uint64(29)
        h ^= np.uint64(8)
        h ^= h >> np.uint64(32)
        h = (h * np.uint64(0x9E3779B97F4A7C15)) & m
        return h ^ (h >> np.uint64(29))


def _colliding_strings(count: int, bits: int) -> list[str]:
    """``count`` ASCII strings of 8 letters whose scanner hashes share their low ``bits``."""
    import numpy as np

    rng = np.random.default_rng(7)
    letters = rng.integers(ord("a"), ord("z") + 1, size=(1 << 22, 8), dtype=np.uint8)
    h = _scanner_hash_8(letters.view("<u8").reshape(-1))
    low = h & np.uint64((1 << bits) - 1)
    values, counts = np.unique(low, return_counts=True)
    assert counts.max() < count  # a single draw rarely reaches count: widen on the most common
    hit = letters[low == values[counts.argmax()]]
    while len(hit) < count:
        more = rng.integers(ord("a"), ord("z") + 1, size=(1 << 22, 8), dtype=np.uint8)
        low_more = _scanner_hash_8(more.view("<u8").reshape(-1)) & np.uint64((1 << bits) - 1)
        hit = np.concatenate([hit, more[low_more == values[counts.argmax()]]])
    return sorted({bytes(row).decode() for row in hit})[:count]


@scanner
def test_strings_crafted_to_collide_give_way_instead_of_probing_every_one() -> None:
    # The scanner's tables probe linearly with an unseeded hash: strings crafted to
    # share its low bits would each probe every one before them (n²/2 probes: by
    # estimate seconds for 50,000 of them in a 1 MB pickle, minutes for 500,000;
    # with the cap removed this test fails: those 300 probe past it). Past MAX_PROBES
    # (128) slots a lookup gives way to the Python reader (randomized dict hashes).
    crafted = _colliding_strings(300, 16)
    assert len(crafted) == 300
    doc = _doc()
    for i, e in enumerate(doc["entries"]):
        e["pad"] = crafted if i == 0 else []
    data = pickle.dumps(doc, protocol=4)
    assert native._picklescan.scan(data) is None  # gave way
    _same(native.pickle_to_trace(data, source="x", rank=0), _python_path(data))
    # the same number of ordinary strings: taken by the scanner, the same trace
    doc["entries"][0]["pad"] = [f"s{i:07d}" for i in range(300)]
    plain = pickle.dumps(doc, protocol=4)
    got = _scanned(plain)
    assert got is not None
    _same(got, _python_path(plain))


def _first_seen_oracle(codes: list[int]) -> tuple[list[int], list[int]]:
    calls: list[int] = []
    got: dict[int, int] = {}
    for c in codes:
        if c not in got:
            calls.append(c)
            got[c] = 3 * c + 1
    return [got[c] for c in codes], calls


@given(st.lists(st.one_of(st.integers(0, 40), st.integers(-5, 5), st.integers(0, 1 << 40)),
                max_size=60))
@settings(max_examples=300, deadline=None)
def test_first_seen_calls_fill_once_per_code_in_first_seen_order(codes: list[int]) -> None:
    """Both of ``_first_seen``'s ways (a table for small codes, a sort for large or
    negative ones) map every code and call ``fill`` once per code in first-seen order:
    the Python reader interns strings in that order."""
    import numpy as np
    calls: list[int] = []

    def fill(c: int) -> int:
        calls.append(c)
        return 3 * c + 1

    out = native._first_seen(np.asarray(codes, dtype=np.int64), fill, np.int64)
    want, want_calls = _first_seen_oracle(codes)
    assert out.tolist() == want
    assert calls == want_calls


@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), max_size=40))
@settings(max_examples=200, deadline=None)
def test_group_codes_name_and_description_pairs_in_first_seen_order(pairs: list[tuple[int, int]]) -> None:
    import numpy as np
    strings = [f"s{i}" for i in range(10)]
    seen: list[tuple[str, str]] = []

    class Ctx:
        def group_of(self, name: str, desc: str) -> int:
            seen.append((name, desc))
            return len(seen) - 1

    name = np.asarray([p[0] for p in pairs], dtype=np.int32)
    desc = np.asarray([p[1] for p in pairs], dtype=np.int32)
    out = native._group_codes(name, desc, strings, Ctx())  # type: ignore[arg-type]
    order = list(dict.fromkeys((strings[a], strings[b]) for a, b in pairs))
    assert seen == order
    assert out.tolist() == [order.index((strings[a], strings[b])) for a, b in pairs]


@scanner
def test_memo_slots_written_by_binput_shift_memoize_as_in_pickle() -> None:
    """MEMOIZE stores at ``len(memo)``, the slots already filled, not at a count of
    MEMOIZE opcodes: a stream that also writes slots with BINPUT (legal, only a crafted
    file does it) reads the same on both paths, or is corrupt on both. A review found
    the scanner reading ``nccl:broadcast`` where pickle read ``nccl:all_reduce``."""
    import pickletools
    rng = random.Random(11)
    # the captured dumps are protocol 2 (BINPUT only): the same documents in protocol 4
    datas = [pickle.dumps(native.decode_pickle(d, source="x"), protocol=4) for d in _captured()[:12]]
    verdicts = {"same": 0, "corrupt": 0, "read_otherwise": 0}
    for _ in range(300):
        data = rng.choice(datas)
        memoize = [pos for op, _arg, pos in pickletools.genops(data) if op.name == "MEMOIZE"]
        out = bytearray(data)
        for pos in sorted(rng.sample(memoize, min(len(memoize), rng.randrange(1, 4))),
                          reverse=True):
            # BINPUT after it, to a slot not yet filled (or one that is)
            out[pos + 1:pos + 1] = b"q" + bytes([rng.choice((rng.randrange(8), 200 + rng.randrange(56)))])
        d = bytes(_unframed(out))
        sc = native._picklescan.scan(d)
        if isinstance(sc, str):
            verdicts["corrupt"] += 1
            with pytest.raises(DumpError):
                _python_path(d)
            continue
        if sc is None:  # gave way: the unpickler decides
            continue
        verdicts["same"] += 1
        expected = _python_path(d)
        _same(native._trace_from_scan(sc, source="x", rank=0, detail_tail=None), expected)
        # the shifted slots make pickle read other objects than the file's writer meant
        verdicts["read_otherwise"] += _resolved(expected) != _resolved(_python_path(data))
    assert verdicts["same"] and verdicts["read_otherwise"], verdicts


def _unframed(data: bytearray) -> bytearray:
    """``data`` without protocol 4's FRAME opcodes (whose lengths inserted bytes break):
    frames are optional, a stream reads the same without them."""
    import pickletools
    out = bytearray()
    last = 0
    for op, _arg, pos in pickletools.genops(bytes(data)):
        if op.name == "FRAME":
            out += data[last:pos]
            last = pos + 9
    return out + data[last:]


@scanner
def test_an_int_written_longer_than_it_needs_is_the_same_int() -> None:
    # LONG1 of 9 bytes holding 5 (a writer's non-minimal form): a duration of 5 ms,
    # not "unknown"; a real big int still is
    doc = _doc()
    doc["entries"][0]["duration_ms"] = 5
    data = pickle.dumps(doc, protocol=2)
    five = b"\x8a\x09" + (5).to_bytes(9, "little")
    small = pickle.dumps(5, protocol=2)[2:-1]  # BININT1 5
    assert small in data
    for long in (five, b"\x8a\x09" + (-3).to_bytes(9, "little", signed=True)):
        d = data.replace(small, long, 1)
        _same(_scanned(d), _python_path(d))  # type: ignore[arg-type]


@scanner
def test_more_entries_than_the_limit_are_refused_before_their_columns_are_made() -> None:
    # one byte an entry (DUP of one record): the scanner's columns would be 122 bytes each
    doc = _doc()
    one = doc["entries"][0]
    doc["entries"] = [one] * 5000
    data = pickle.dumps(doc, protocol=4)
    limits = dataclasses.replace(native.DEFAULT_LIMITS, max_entries=4999)
    assert native._picklescan.scan(data, 64, 4096, 65536, 4999) == (
        "5000 entries (limit 4999 per rank)",)
    with pytest.raises(DumpError, match="5000 entries"):
        native.pickle_to_trace(data, source="x", rank=0, limits=limits)


def test_a_huge_int_in_a_text_field_is_text() -> None:
    doc = _doc()
    doc["version"] = 10 ** 5000
    trace = _python_path(pickle.dumps(doc, protocol=4))
    assert trace.version.startswith("<int of ")


@pytest.mark.parametrize("scan", ["1", "0"])
def test_text_built_from_memo_references_is_bounded_by_the_file_size(
        scan: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # each entry's dtype list: one 60 KB string (pickled once, the memo) and its own
    monkeypatch.setenv("FRFORENSICS_PICKLE_SCAN", scan)
    doc = _doc(200)
    long = "Float" * 12_000
    for i, e in enumerate(doc["entries"]):
        e["input_dtypes"] = [long, str(i)]
    data = pickle.dumps(doc, protocol=4)
    assert len(data) < 200_000  # 12 MB of text from it
    limits = dataclasses.replace(native.DEFAULT_LIMITS, text_ratio_floor_bytes=1 << 20)
    assert limits.text_budget(len(data)) < 4 << 20
    with pytest.raises(DumpError, match="characters of text"):
        native.pickle_to_trace(data, source="x", rank=0, limits=limits)
    # a budget above it: the same file reads, on either path
    roomy = dataclasses.replace(limits, text_ratio_floor_bytes=64 << 20)
    trace = native.pickle_to_trace(data, source="x", rank=0, limits=roomy)
    assert len(trace.entries) == 200
