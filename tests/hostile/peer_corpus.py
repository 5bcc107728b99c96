"""Hostile wire payloads: what a broken or hostile Dask worker (or peer) can send.

Each case is a real payload of the four good ranks' digests (``hostile_corpus.GOOD``)
with one thing changed, or a bomb; ``payloads()`` returns ``{name: bytes}`` and
``EXPECTED[name]`` a fragment of the one error each must give. The cases are the
classes of issue 22 (each was a crash, a MemoryError, minutes of CPU or a
silently wrong digest before), plus their neighbours.
"""

from __future__ import annotations

import lzma
import zlib
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from frforensics.analyzer import wire
from frforensics.analyzer.digest import RankDigest

_Doc = dict[str, Any]


def _unpack(payload: bytes) -> tuple[_Doc, list[dict[str, Any]]]:
    body = zlib.decompress(payload[5:])
    doc = msgpack.unpackb(body, raw=False, strict_map_key=False)
    digests = msgpack.unpackb(doc["digests"], raw=False, strict_map_key=False,
                              ext_hook=lambda code, data: msgpack.ExtType(code, data))
    return doc, digests


def _pack(doc: _Doc, digests: list[dict[str, Any]]) -> bytes:
    doc = dict(doc, digests=msgpack.packb(digests, use_bin_type=True))
    return wire._MAGIC + wire._ZLIB + zlib.compress(msgpack.packb(doc, use_bin_type=True), 6)


def _set_field(name: str, value: Any, index: int = 0) -> Callable[[_Doc, list[Any]], None]:
    def edit(doc: _Doc, digests: list[Any]) -> None:
        digests[index][name] = value
    return edit


def _groups(members: list[Any]) -> Callable[[_Doc, list[Any]], None]:
    def edit(doc: _Doc, digests: list[Any]) -> None:
        doc["groups"] = [[f"g{i}", "", m, "gloo"] for i, m in enumerate(members)]
    return edit


def _group_name_int(doc: _Doc, digests: list[Any]) -> None:
    doc["groups"][0][0] = 5


def _column_named_rank(doc: _Doc, digests: list[Any]) -> None:
    doc["columns"][0][0] = "rank"


def _detail_kinds_all_i(doc: _Doc, digests: list[Any]) -> None:
    doc["details"][2] = ["i"] * len(doc["details"][2])


def _thread_frames_5(doc: _Doc, digests: list[Any]) -> None:
    digests[0]["threads"] = [msgpack.ExtType(4, msgpack.packb(["MainThread", 1, True, 5]))]


def _frame_string_index(value: int) -> Callable[[_Doc, list[Any]], None]:
    def edit(doc: _Doc, digests: list[Any]) -> None:
        n = len(wire._get_column(memoryview(doc["blob"]), doc["frames"][0]))
        blob = wire._Blob()
        blob.add(doc["blob"])
        doc["frames"][0] = wire._put_column(blob, np.full(n, value, dtype=np.int64))
        doc["blob"] = b"".join(blob.parts)
    return edit


def _group_ref(value: int) -> Callable[[_Doc, list[Any]], None]:
    def edit(doc: _Doc, digests: list[Any]) -> None:
        digests[0]["groups"] = [msgpack.ExtType(3, msgpack.packb(value))]
    return edit


def _column_twice(doc: _Doc, digests: list[Any]) -> None:
    name, members, spec = doc["columns"][0]
    doc["columns"][0] = [name, [members[0], members[0]], spec]


def _group_column_past_table(doc: _Doc, digests: list[Any]) -> None:
    for col in doc["columns"]:
        if col[0] == "group":
            blob = wire._Blob()
            blob.add(doc["blob"])
            lengths = col[2][1]
            col[2] = wire._put_segments(blob, [np.full(k, 999, dtype=np.int32) for k in lengths],
                                        [0] * len(lengths))
            doc["blob"] = b"".join(blob.parts)


def _not_a_map(doc: _Doc, digests: list[Any]) -> None:
    doc.clear()


EDITS: dict[str, Callable[[_Doc, list[Any]], None]] = {
    "rank_three": _set_field("rank", "three"),
    "rank_minus_5": _set_field("rank", -5),
    "rank_2_to_the_40": _set_field("rank", 1 << 40),
    "world_abc": _set_field("world_size", "abc"),
    "world_zero": _set_field("world_size", 0),
    "dump_time_2_64_minus_1": _set_field("dump_time_ns", (1 << 64) - 1),
    "dump_time_negative": _set_field("dump_time_ns", -1),
    "host_is_a_list": _set_field("host", [1, 2]),
    "notes_are_ints": _set_field("notes", [1, 2, 3]),
    "pid_2_to_the_64_minus_1": _set_field("pid", (1 << 64) - 1),
    "group_name_int": _group_name_int,
    "column_named_rank": _column_named_rank,
    "column_names_a_digest_twice": _column_twice,
    "group_column_past_its_table": _group_column_past_table,
    "detail_kinds_all_i": _detail_kinds_all_i,
    "thread_frames_5": _thread_frames_5,
    "frame_string_index_minus_1": _frame_string_index(-1),
    "frame_string_index_past_table": _frame_string_index(1 << 30),
    "group_reference_minus_1": _group_ref(-1),
    "one_group_0_1_2_24": _groups([[0, 1, 1 << 24]]),
    "eight_groups_start_1_2_24": _groups([[s, 1, 1 << 24] for s in range(8)]),
    "eight_groups_0_1_2_20": _groups([[0, 1, 1 << 20]] * 8),
    "group_member_2_to_the_20": _groups([[0, 1 << 20]]),
    "group_member_negative_packed": _groups([np.asarray([0, -7], "<i4").tobytes()]),
    "body_not_a_map": _not_a_map,
}

#: a fragment of the one error each case gives
EXPECTED: dict[str, str] = {
    "rank_three": "rank 'three'", "rank_minus_5": "rank -5", "rank_2_to_the_40": "rank 1099511627776",
    "world_abc": "world size 'abc'", "world_zero": "world size 0",
    "dump_time_2_64_minus_1": "dump_time_ns 18446744073709551615",
    "dump_time_negative": "dump_time_ns -1", "host_is_a_list": "host",
    "notes_are_ints": "notes", "pid_2_to_the_64_minus_1": "pid",
    "group_name_int": "bad group table", "column_named_rank": "unknown column 'rank'",
    "column_names_a_digest_twice": "names a digest twice",
    "group_column_past_its_table": "group index", "detail_kinds_all_i": "field kinds",
    "thread_frames_5": "threads", "frame_string_index_minus_1": "string index",
    "frame_string_index_past_table": "string index", "group_reference_minus_1": "group index -1",
    "one_group_0_1_2_24": "progression 0, 1, 16777216",
    "eight_groups_start_1_2_24": "progression 0, 1, 16777216",
    "eight_groups_0_1_2_20": "more than 4194304",
    "group_member_2_to_the_20": "ranks outside", "group_member_negative_packed": "ranks outside",
    "body_not_a_map": "malformed digest payload",
    "zlib_bomb_1mb": "inflates past", "lzma_bomb_39kb": "inflates past",
    "truncated_zlib": "truncated", "not_a_payload": "not a frforensics digest payload",
    "forged_duplicate_rank_0": "not asked to read",
}


def _zlib_bomb(size: int) -> bytes:
    c = zlib.compressobj(9)
    chunk = bytes(1 << 20)
    out = [c.compress(chunk) for _ in range(size >> 20)]
    return wire._MAGIC + wire._ZLIB + b"".join(out) + c.flush()


def _lzma_bomb(size: int) -> bytes:
    c = lzma.LZMACompressor(preset=9)
    chunk = bytes(1 << 20)
    out = [c.compress(chunk) for _ in range(size >> 20)]
    return wire._MAGIC + wire._LZMA + b"".join(out) + c.flush()


def payloads(good: list[RankDigest], *, bombs: bool = True) -> dict[str, bytes]:
    """Every hostile payload, built from a real payload of ``good`` (the bombs take
    seconds to build: ``bombs=False`` leaves them out)."""
    base = wire.encode_batch(good)
    out = {}
    for name, edit in EDITS.items():
        doc, digests = _unpack(base)
        edit(doc, digests)
        out[name] = _pack(doc, digests)
    if bombs:
        out["zlib_bomb_1mb"] = _zlib_bomb(1 << 30)  # 1 MiB that inflates to 1 GiB
        out["lzma_bomb_39kb"] = _lzma_bomb(1 << 28)  # ~40 KB that inflates to 256 MiB
    out["truncated_zlib"] = base[: len(base) // 2]
    out["not_a_payload"] = b"\x80\x04garbage"
    return out
