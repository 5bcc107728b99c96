"""A corpus of hostile and broken inputs, built in the test session (small on disk).

Each case is a folder: the four good ranks of ``tests/data/native/missing_rank``
(verdict: hang, culprit rank 2) plus one bad thing — a file, a link, a FIFO, an
archive — so a test can check both that the bad thing costs bounded time and
memory and that the good ranks' verdict is unchanged. ``build(root)`` returns
``{case name: Case}``; every file is made here, none is checked in.
"""

from __future__ import annotations

import io
import os
import pickle
import socket
import struct
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from frforensics.formats import frdump, native

GOOD = Path(__file__).resolve().parents[1] / "data" / "native" / "missing_rank" / "pickle"
GOOD_RANKS = [0, 1, 2, 3]
#: A name without a rank: the file is decoded in full, then refused for want of a
#: rank, so readable oddities (a deep frame name) cannot change the verdict.
RANKLESS = "nccl_trace_rank_x"
#: Every case ``build`` makes (a test checks the two agree).
CASE_NAMES = [
    'broken_symlink',
    'corrupt_deflate',
    'corrupt_tgz_sorts_first',
    'corrupt_xz',
    'deep_nesting_frame_name',
    'deep_nesting_input_sizes',
    'deep_nesting_pg_config_ranks',
    'deep_nesting_profiling_name',
    'deep_nesting_version',
    'deep_ranks_string',
    'empty_file',
    'encrypted_zip',
    'fifo',
    'frdump_columns_list',
    'frdump_entries_list',
    'frdump_frames_list',
    'frdump_group_rank_huge',
    'frdump_groups_list',
    'frdump_groups_str',
    'frdump_huge_count_no_columns',
    'frdump_notes_int',
    'frdump_rank_-3',
    'frdump_rank_1000000000',
    'frdump_seq_int64_max',
    'frdump_stacks_dict',
    'frdump_stale_peers_list',
    'frdump_state_200',
    'frdump_threads_dict',
    'frdump_world_size_1000000000',
    'huge_trailing_number',
    'jobs_10000',
    'json_deep_nesting',
    'json_huge_int',
    'memo_dtype_text_scan0',
    'memo_dtype_text_scan1',
    'memo_index_fallback',
    'native_group_rank_huge',
    'native_rank_-1',
    'native_rank_1000000000',
    'native_seq_int64_max',
    'not_a_zip',
    'one_byte',
    'pickle_garbage',
    'random_bytes',
    'same_file_twice',
    'shape_400k_dims',
    'shape_overflow',
    'shared_input_sizes_scan0',
    'shared_input_sizes_scan1',
    'shared_refs_expansion',
    'socket',
    'symlink_loop',
    'symlink_to_dev_zero',
    'symlink_to_fifo',
    'symlinked_dir_loop',
    'tar_gz_bomb',
    'timestamp_name',
    'unsupported_zip_method',
    'zip_bomb',
]


@dataclass
class Case:
    """One hostile input: a folder to analyze (and extra CLI arguments)."""

    path: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


#: What the load problem must say, for cases where a weaker outcome (out of
#: memory under the cap, a timeout) would otherwise pass; None: no problem at all.
EXPECTED_PROBLEM: dict[str, str | None] = {
    "fifo": "a FIFO, not a dump file",
    "symlink_to_fifo": "a FIFO, not a dump file",
    "symlink_to_dev_zero": "a device, not a dump file",
    "socket": "a socket, not a dump file",
    "symlink_loop": "symlink loop",
    "broken_symlink": "link to nothing",
    "same_file_twice": None,
    "symlinked_dir_loop": None,
    "huge_trailing_number": "cannot tell which rank",
    "timestamp_name": "cannot tell which rank",
    "zip_bomb": "expands to more than",
    "tar_gz_bomb": "expands to more than",
    "encrypted_zip": "encrypted zip member",
    "unsupported_zip_method": "compression method 93 is not supported",
    "corrupt_deflate": "corrupt zip member",
    "corrupt_xz": "cannot read archive",
    "corrupt_tgz_sorts_first": "cannot read archive",
    "frdump_huge_count_no_columns": "entries (limit",
    "frdump_state_200": "'state' holds a value outside",
    "frdump_seq_int64_max": "'seq' holds a value outside",
    "frdump_rank_-3": "not a plausible rank",
    "frdump_rank_1000000000": "not a plausible rank",
    "frdump_world_size_1000000000": "world size 1000000000 is not plausible",
    "frdump_group_rank_huge": "implausible ranks",
    "memo_index_fallback": "memo index past the size of the file",
    "shape_400k_dims": "400000 dims (limit 64)",
    "memo_dtype_text_scan1": "characters of text (shapes, dtype lists",
    "memo_dtype_text_scan0": "characters of text (shapes, dtype lists",
    "native_seq_int64_max": "not plausible",
    "native_rank_-1": "not a plausible rank",
    "native_rank_1000000000": "not a plausible rank",
    "json_deep_nesting": "nests too deeply",
    "jobs_10000": None,
}
#: Peak RSS any case may reach (the worst seen is ~140 MiB).
MAX_RSS_MIB = 512

#: Cases whose bad file is a readable dump that legitimately changes the verdict
#: (a rank 9 appears: ranks 4-8 are then missing).
KEEPS_VERDICT = {"native_group_rank_huge": False}


def _good_doc() -> Any:
    return native.decode_pickle((GOOD / "nccl_trace_rank_0").read_bytes())


def _pickle(doc: Any) -> bytes:
    return pickle.dumps(doc, protocol=2)


def _memo_sharing_cases(bad_file: Callable[..., None]) -> None:
    """Pickles whose memo shares one object across entries, on both readers."""
    for scan in ("1", "0"):
        env = {"FRFORENSICS_PICKLE_SCAN": scan}
        doc = _good_doc()
        shared = [[4, 4]] * 20_000
        entry = dict(doc["entries"][0], input_sizes=shared, output_sizes=shared)
        doc["entries"] = [entry] * 20_000
        bad_file(f"shared_input_sizes_scan{scan}", _pickle(doc), RANKLESS, env=env)
        # each entry's dtype list names one 60 KB string (pickled once: the memo) and
        # one of its own: 20,000 distinct texts, 1.2 GB from a file of a few MB
        doc = _good_doc()
        long = "Float" * 12_000
        entry = doc["entries"][0]
        doc["entries"] = [dict(entry, input_dtypes=[long, str(i)]) for i in range(20_000)]
        bad_file(f"memo_dtype_text_scan{scan}", _pickle(doc), RANKLESS, env=env)


def _with_placeholder(doc_fn: Callable[[Any, str], None], ops: bytes) -> bytes:
    """A protocol-2 pickle of a good dump where one value is replaced by raw opcodes."""
    doc = _good_doc()
    marker = "@@HOSTILE@@"
    doc_fn(doc, marker)
    data = _pickle(doc)
    encoded = marker.encode()
    needle = b"X" + struct.pack("<I", len(encoded)) + encoded
    assert data.count(needle) == 1, "the placeholder must be pickled once"
    return data.replace(needle, ops)


def _deep_list(depth: int) -> bytes:
    """Opcodes leaving one list nested ``depth`` deep on the stack (no recursion to build)."""
    return b"]" * depth + b"a" * (depth - 1)


def _frdump_doc() -> dict[str, Any]:
    from frforensics.formats import decode_dump

    trace = decode_dump((GOOD / "nccl_trace_rank_0").read_bytes(), source="x", rank_hint=7)
    doc: dict[str, Any] = msgpack.unpackb(frdump.encode(trace)[len(frdump.MAGIC):], raw=False,
                                          strict_map_key=False)
    return doc


def _frdump(doc: dict[str, Any]) -> bytes:
    return frdump.MAGIC + msgpack.packb(doc, use_bin_type=True)


def _set_column(doc: dict[str, Any], name: str, values: list[int]) -> None:
    import numpy as np

    dtype = doc["entries"]["columns"][name][0]
    raw = bytearray(doc["entries"]["columns"][name][1])
    arr = np.frombuffer(raw, dtype=dtype).copy()
    arr[: len(values)] = values
    doc["entries"]["columns"][name][1] = arr.tobytes()


def _zip_bytes(members: dict[str, bytes], method: int = zipfile.ZIP_DEFLATED) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=method) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _tar_bytes(members: dict[str, bytes], mode: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tf:  # type: ignore[call-overload]
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class _Zeros(io.RawIOBase):
    def __init__(self, n: int) -> None:
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        k = min(len(b), self.left)
        b[:k] = bytes(k)
        self.left -= k
        return k


def build(root: Path) -> dict[str, Case]:
    """Make every case under ``root``; returns them by name."""
    cases: dict[str, Case] = {}
    good_bytes = {f.name: f.read_bytes() for f in sorted(GOOD.iterdir())}

    def folder(name: str) -> Path:
        d = root / name
        d.mkdir(parents=True)
        for fname, data in good_bytes.items():
            (d / fname).write_bytes(data)
        return d

    def bad_file(name: str, data: bytes, fname: str = "nccl_trace_rank_7", **kw: Any) -> None:
        d = folder(name)
        (d / fname).write_bytes(data)
        cases[name] = Case(d, **kw)

    # ---- discovery: things that are not regular files
    d = folder("fifo")
    os.mkfifo(d / "nccl_trace_rank_7")
    cases["fifo"] = Case(d)
    d = folder("symlink_to_dev_zero")
    os.symlink("/dev/zero", d / "nccl_trace_rank_7")
    cases["symlink_to_dev_zero"] = Case(d)
    d = folder("symlink_to_fifo")
    os.mkfifo(root / "outside_fifo")
    os.symlink(root / "outside_fifo", d / "nccl_trace_rank_7")
    cases["symlink_to_fifo"] = Case(d)
    d = folder("socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    here = os.getcwd()
    try:  # a short relative name: AF_UNIX paths are limited to 108 bytes
        os.chdir(d)
        sock.bind("nccl_trace_rank_7")
    finally:
        os.chdir(here)
        sock.close()
    cases["socket"] = Case(d)
    d = folder("symlink_loop")
    os.symlink("nccl_trace_rank_8", d / "nccl_trace_rank_7")
    os.symlink("nccl_trace_rank_7", d / "nccl_trace_rank_8")
    cases["symlink_loop"] = Case(d)
    d = folder("broken_symlink")
    os.symlink("does-not-exist", d / "nccl_trace_rank_7")
    cases["broken_symlink"] = Case(d)
    d = folder("symlinked_dir_loop")
    os.symlink(".", d / "loop")
    os.symlink(d, d / "up")
    cases["symlinked_dir_loop"] = Case(d)
    d = folder("same_file_twice")
    os.symlink("nccl_trace_rank_1", d / "nccl_trace_rank_1.alias")
    cases["same_file_twice"] = Case(d, args=[str(d / "nccl_trace_rank_0"), str(d)])
    # ---- names: numbers that are no ranks
    bad_file("huge_trailing_number", good_bytes["nccl_trace_rank_0"], "nccl_trace_rank_10000000")
    bad_file("timestamp_name", good_bytes["nccl_trace_rank_0"], "nccl_trace_20261201101500")
    # ---- plain garbage
    bad_file("empty_file", b"")
    bad_file("one_byte", b"\x80")
    bad_file("random_bytes", os.urandom(4096))
    bad_file("pickle_garbage", b"\x80\x04garbage")
    # ---- archives
    zeros = 100 << 20
    d = folder("zip_bomb")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf, \
            zf.open("nccl_trace_rank_7", "w", force_zip64=True) as fh:
        chunk = bytes(1 << 20)
        for _ in range(zeros >> 20):
            fh.write(chunk)
    (d / "bomb.zip").write_bytes(buf.getvalue())
    cases["zip_bomb"] = Case(d)
    d = folder("tar_gz_bomb")
    with tarfile.open(d / "aaa_bomb.tar.gz", "w:gz", compresslevel=1) as tf:
        info = tarfile.TarInfo("nccl_trace_rank_7")
        info.size = zeros
        tf.addfile(info, _Zeros(zeros))  # type: ignore[arg-type]
    cases["tar_gz_bomb"] = Case(d)
    d = folder("encrypted_zip")
    data = _zip_bytes({"nccl_trace_rank_7": good_bytes["nccl_trace_rank_0"]},
                      method=zipfile.ZIP_STORED)
    blob = bytearray(data)
    for sig, off in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        at = blob.index(sig)
        blob[at + off] |= 0x1  # the "encrypted" flag bit
    (d / "secret.zip").write_bytes(bytes(blob))
    cases["encrypted_zip"] = Case(d)
    d = folder("unsupported_zip_method")
    blob = bytearray(_zip_bytes({"nccl_trace_rank_7": good_bytes["nccl_trace_rank_0"]},
                                method=zipfile.ZIP_STORED))
    for sig, off in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):
        at = blob.index(sig)
        blob[at + off:at + off + 2] = struct.pack("<H", 93)  # zstandard
    (d / "zstd.zip").write_bytes(bytes(blob))
    cases["unsupported_zip_method"] = Case(d)
    d = folder("corrupt_deflate")
    blob = bytearray(_zip_bytes({"nccl_trace_rank_7": good_bytes["nccl_trace_rank_0"] * 4}))
    for i in range(200, 400):
        blob[i] ^= 0x5A
    (d / "corrupt.zip").write_bytes(bytes(blob))
    cases["corrupt_deflate"] = Case(d)
    d = folder("corrupt_xz")
    blob = bytearray(_tar_bytes({"nccl_trace_rank_7": good_bytes["nccl_trace_rank_0"]}, "w:xz"))
    for i in range(100, 160):
        blob[i] ^= 0xA5
    (d / "aaa.tar.xz").write_bytes(bytes(blob))
    cases["corrupt_xz"] = Case(d)
    d = folder("corrupt_tgz_sorts_first")
    blob = bytearray(_tar_bytes({"nccl_trace_rank_7": good_bytes["nccl_trace_rank_0"]}, "w:gz"))
    (d / "000.tar.gz").write_bytes(bytes(blob[: len(blob) // 2]))
    cases["corrupt_tgz_sorts_first"] = Case(d)
    bad_file("not_a_zip", b"PK\x03\x04" + os.urandom(500), "dumps.zip")
    # ---- frdump: declared counts, shapes, values
    doc = _frdump_doc()
    doc["entries"] = {"n": 10**7, "dropped": 0, "columns": {}}
    bad_file("frdump_huge_count_no_columns", _frdump(doc), "frdump_rank_7")
    for section, value in (("groups", "x"), ("groups", [1, 2]), ("entries", [1, 2]),
                           ("frames", [1]), ("threads", {"a": 1}), ("stacks", {"a": 1}),
                           ("stale_peers", [{"rank": -1}]), ("notes", 5)):
        doc = _frdump_doc()
        doc[section] = value
        bad_file(f"frdump_{section}_{type(value).__name__}", _frdump(doc), "frdump_rank_7")
    doc = _frdump_doc()
    doc["entries"]["columns"] = [1, 2]
    bad_file("frdump_columns_list", _frdump(doc), "frdump_rank_7")
    doc = _frdump_doc()
    _set_column(doc, "state", [200])
    bad_file("frdump_state_200", _frdump(doc), "frdump_rank_7")
    doc = _frdump_doc()
    _set_column(doc, "seq", [2**63 - 1])
    bad_file("frdump_seq_int64_max", _frdump(doc), "frdump_rank_7")
    for key, value in (("rank", -3), ("rank", 10**9), ("world_size", 10**9)):
        doc = _frdump_doc()
        doc[key] = value
        bad_file(f"frdump_{key}_{value}", _frdump(doc), "frdump_rank_7")
    doc = _frdump_doc()
    doc["groups"][0]["ranks"] = struct.pack("<i", 10**9)
    bad_file("frdump_group_rank_huge", _frdump(doc), "frdump_rank_7")
    # ---- native pickles: nesting, sharing, memo, shapes, numbers
    depth = 200_000
    for where, setter in (
        ("version", lambda doc, m: doc.__setitem__("version", m)),
        ("profiling_name", lambda doc, m: doc["entries"][0].__setitem__("profiling_name", m)),
        ("frame_name", lambda doc, m: doc["entries"][0]["frames"][0].__setitem__("name", m)),
        ("input_sizes", lambda doc, m: doc["entries"][-1].__setitem__("input_sizes", m)),
        ("pg_config_ranks", lambda doc, m: next(iter(doc["pg_config"].values()))
         .__setitem__("ranks", m)),
    ):
        bad_file(f"deep_nesting_{where}", _with_placeholder(setter, _deep_list(depth)), RANKLESS)
    doc = _good_doc()
    next(iter(doc["pg_config"].values()))["ranks"] = "[" * depth + "]" * depth
    bad_file("deep_ranks_string", _pickle(doc), RANKLESS)
    doc = _good_doc()
    x: Any = [0]
    for _ in range(10):
        x = [x] * 10  # 10^10 leaves, a few hundred bytes pickled (the memo shares them)
    doc["junk"] = x
    bad_file("shared_refs_expansion", _pickle(doc), RANKLESS)
    # an opcode the scanner leaves to the unpickler (EMPTY_SET), then a memo index of 2^28
    evil = b"\x80\x04\x8f" + b"r" + struct.pack("<I", 1 << 28) + b"0}."
    bad_file("memo_index_fallback", evil)
    _memo_sharing_cases(bad_file)
    doc = _good_doc()
    doc["entries"][0]["input_sizes"] = [[2] * 400_000]
    bad_file("shape_400k_dims", _pickle(doc), RANKLESS)
    doc = _good_doc()
    doc["entries"][0]["input_sizes"] = [[2**62, 2**62, 2**62]]
    bad_file("shape_overflow", _pickle(doc), RANKLESS)
    doc = _good_doc()
    doc["entries"][0]["collective_seq_id"] = 2**63 - 1
    bad_file("native_seq_int64_max", _pickle(doc), RANKLESS)
    for value in (-1, 10**9):
        doc = _good_doc()
        doc["rank"] = value
        bad_file(f"native_rank_{value}", _pickle(doc))
    doc = _good_doc()
    next(iter(doc["pg_config"].values()))["ranks"] = "[0, 1000000000]"
    cases_doc = _pickle(doc)
    bad_file("native_group_rank_huge", cases_doc, "nccl_trace_rank_9")
    bad_file("json_deep_nesting", b'{"version": ' + b"[" * depth + b"]" * depth + b"}",
             "nccl_trace_rank_7.json")
    bad_file("json_huge_int", b'{"version": "2.10", "entries": [{"collective_seq_id": 1'
             + b"0" * 5000 + b"}]}", "nccl_trace_rank_7.json")
    # ---- the CLI itself
    d = folder("jobs_10000")
    cases["jobs_10000"] = Case(d, args=[str(d), "--jobs", "10000"])
    return cases
