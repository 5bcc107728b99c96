"""CI-sized fuzz: the C scanner's entry point against the Python reader on broken real dumps.

Byte flips, truncations and spliced hostile opcodes of the captured dumps in
``tests/data/native``: ``pickle_to_trace`` with the scanner and without it
(``FRFORENSICS_PICKLE_SCAN=0``: guard, then ``NoGlobalsUnpickler``) must agree
— the same trace, or a ``DumpError`` on both — and the C guard ``check`` never
refuses a stream the Python guard (``pickletools``) accepts.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest

from frforensics.errors import DumpError
from frforensics.formats import native
from frforensics.model import ENTRY_COLUMNS, RankTrace

DATA = Path(__file__).resolve().parents[1] / "data" / "native"
pytestmark = pytest.mark.skipif(native._picklescan is None, reason="C scanner not compiled")


def _read(data: bytes, monkeypatch: pytest.MonkeyPatch, scan: bool) -> RankTrace | str:
    monkeypatch.setenv("FRFORENSICS_PICKLE_SCAN", "1" if scan else "0")
    try:
        return native.pickle_to_trace(data, source="f", rank=0, detail_tail=None)
    except DumpError as exc:
        return type(exc).__name__


def _fingerprint(t: RankTrace | str) -> object:
    if isinstance(t, str):
        return "error"
    cols = tuple(tuple(getattr(t.entries, name).tolist()) for name in ENTRY_COLUMNS
                 if name not in ("op", "in_shapes", "out_shapes", "in_dtypes", "out_dtypes",
                                 "thread", "stack"))
    # string and stack tables may be interned in another order: compare resolved values
    resolved = tuple(
        (t.string(int(t.entries.op[i])), t.string(int(t.entries.in_dtypes[i])),
         t.string(int(t.entries.in_shapes[i])), t.stack(int(t.entries.stack[i])))
        for i in range(len(t.entries)))
    return cols, resolved, t.groups, t.version, t.notes


def _mutations(rng: random.Random, n: int) -> list[bytes]:
    datas = [p.read_bytes() for p in sorted(DATA.glob("*/pickle/nccl_trace_rank_*"))]
    out = []
    for _ in range(n):
        d = bytearray(rng.choice(datas))
        roll = rng.random()
        if roll < 0.25:
            d = d[: rng.randrange(len(d))]
        elif roll < 0.85:
            for _ in range(rng.randrange(1, 5)):
                d[rng.randrange(len(d))] = rng.randrange(256)
        else:  # splice a hostile opcode: a far memo index, a huge length, a global
            at = rng.randrange(2, len(d))
            d[at:at] = rng.choice([b"r" + struct.pack("<I", rng.randrange(1 << 20, 1 << 32)),
                                   b"X" + struct.pack("<I", 0xFFFFFFF0),
                                   b"cos\nsystem\n", b"\x8f", b"(" * 64, b"h\xff"])
        out.append(bytes(d))
    return out


def test_scanner_and_python_reader_agree_on_broken_dumps(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(12)
    outcomes = {"same_trace": 0, "both_refused": 0}
    for data in _mutations(rng, 400):
        fast = _read(data, monkeypatch, scan=True)
        slow = _read(data, monkeypatch, scan=False)
        assert _fingerprint(fast) == _fingerprint(slow), (fast, slow)
        outcomes["both_refused" if isinstance(fast, str) else "same_trace"] += 1
    assert all(outcomes.values()), outcomes  # the fuzz reached both outcomes


def test_c_guard_never_refuses_what_the_python_guard_accepts() -> None:
    rng = random.Random(1212)
    refused = 0
    for data in _mutations(rng, 300):
        c_says = native._picklescan.check(data)
        if c_says is not None:
            refused += 1
            assert native._check_pickle_python(data) is not None, c_says
    assert refused
