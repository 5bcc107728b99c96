"""Hostile wire payloads (``peer_corpus``): each one ``WireError``, bounded, with one line.

Every payload is decoded in its own forked child under the file corpus' caps
(1.5 GiB of address space, a 30 s alarm: ``capped.run_capped``); it must end in
exactly one :class:`WireError` whose message is one line naming what is wrong,
within 512 MiB peak RSS. The good payload the cases were made from decodes to
the same digests as the local reader. ``$FRFORENSICS_HOSTILE_STATS`` (a path
prefix) gets every case's time and peak RSS (docs/security.md quotes the worst).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import capped
import hostile_corpus
import peer_corpus
import pytest

from frforensics.analyzer import wire
from frforensics.analyzer.digest import RankDigest
from frforensics.analyzer.load import digest_paths

MAX_RSS_MIB = 512


#: every payload is decoded in a forked child under memory and time caps: the slow lane
pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def good() -> list[RankDigest]:
    digests = [d for d in digest_paths([hostile_corpus.GOOD]) if isinstance(d, RankDigest)]
    assert sorted(d.rank for d in digests) == hostile_corpus.GOOD_RANKS
    return digests


@pytest.fixture(scope="module")
def payloads(good: list[RankDigest]) -> dict[str, bytes]:
    return peer_corpus.payloads(good)


@pytest.fixture(scope="module")
def runs(payloads: dict[str, bytes]) -> dict[str, dict[str, Any]]:
    def decode(data: bytes) -> str:
        try:
            wire.decode_batch(data)
        except wire.WireError as exc:
            return f"WireError: {exc}"
        return "decoded"

    results = {name: capped.run_capped(lambda data=data: decode(data))
               for name, data in payloads.items()}
    stats = os.environ.get("FRFORENSICS_HOSTILE_STATS")
    if stats:
        Path(f"{stats}.wire.json").write_text(json.dumps(
            {k: {x: v[x] for x in ("exit", "seconds", "peak_rss_mib")} for k, v in results.items()},
            indent=1))
    return results


def test_the_corpus_holds_every_class_of_the_issue(payloads: dict[str, bytes]) -> None:
    assert set(payloads) <= set(peer_corpus.EXPECTED)
    assert len(payloads["lzma_bomb_39kb"]) < 64 << 10
    assert len(payloads["zlib_bomb_1mb"]) < 2 << 20


@pytest.mark.parametrize("name", sorted(set(peer_corpus.EDITS) | {
    "zlib_bomb_1mb", "lzma_bomb_39kb", "truncated_zlib", "not_a_payload"}))
def test_a_hostile_payload_is_one_wire_error_within_the_caps(
        runs: dict[str, dict[str, Any]], name: str) -> None:
    run = runs[name]
    assert run["exit"] == 0, run["out"]  # no traceback, no signal, no MemoryError
    out = run["out"]
    assert out.startswith("WireError: "), out
    assert "\n" not in out.strip()
    assert peer_corpus.EXPECTED[name] in out, out
    assert run["peak_rss_mib"] < MAX_RSS_MIB, run


def test_the_unedited_payload_decodes_to_the_same_digests(good: list[RankDigest]) -> None:
    back = wire.decode_batch(wire.encode_batch(good))
    assert [d.rank for d in back] == [d.rank for d in good]
    for d in back:
        wire.check_digest(d)


def test_out_of_memory_in_one_payload_is_one_wire_error(
        monkeypatch: pytest.MonkeyPatch, good: list[RankDigest]) -> None:
    def exhausted(*args: Any) -> Any:
        raise MemoryError

    monkeypatch.setattr(wire, "_decode_doc", exhausted)
    with pytest.raises(wire.WireError, match="out of memory"):
        wire.decode_batch(wire.encode_batch(good))


@pytest.mark.parametrize("value", [None, "text", 3, ("a", "b"), bytearray(b"FRW1z")])
def test_a_payload_that_is_no_bytes_is_one_wire_error(value: Any) -> None:
    with pytest.raises(wire.WireError):
        wire.decode_batch(value)
