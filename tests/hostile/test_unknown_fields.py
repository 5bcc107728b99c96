"""Issue 12, item 3: a dump without a creation time or a timeout is an unknown, never "healthy".

The reader's side (formats/): columns hold 0 (the model's "unknown") and the
trace says which field was missing; the analyzer's side: the verdict says what
could not be judged and is never HEALTHY.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from frforensics.analyzer import analyze, load_dumps
from frforensics.formats import decode_dump, frdump, native
from frforensics.report import Status

TIMEOUT = Path(__file__).resolve().parents[1] / "data" / "native" / "timeout" / "pickle"
FIELDS = {"time_created_ns": "t_enqueue_ns", "timeout_ms": "timeout_ms"}


def _without(fields: list[str], dst: Path) -> Path:
    dst.mkdir()
    for f in TIMEOUT.iterdir():
        doc = native.decode_pickle(f.read_bytes())
        for entry in doc["entries"]:
            for key in fields:
                entry.pop(key, None)
        (dst / f.name).write_bytes(pickle.dumps(doc, protocol=2))
    return dst


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_missing_field_is_unknown_and_named_in_the_notes(tmp_path: Path, field: str) -> None:
    folder = _without([field], tmp_path / "d")
    path = folder / "nccl_trace_rank_0"
    trace = decode_dump(path.read_bytes(), source=str(path), rank_hint=0)
    assert (getattr(trace.entries, FIELDS[field]) == 0).all()
    assert any(note.startswith(f"{field} missing in {len(trace.entries)} of ") for note in trace.notes)


@pytest.mark.parametrize("column", sorted(FIELDS.values()))
def test_frdump_without_the_column_says_so(column: str) -> None:
    import msgpack

    trace = decode_dump((TIMEOUT / "nccl_trace_rank_0").read_bytes(), source="x", rank_hint=0)
    doc = msgpack.unpackb(frdump.encode(trace)[len(frdump.MAGIC):], raw=False)
    del doc["entries"]["columns"][column]
    back = frdump.decode(frdump.MAGIC + msgpack.packb(doc, use_bin_type=True), source="x")
    assert (getattr(back.entries, column) == 0).all()
    assert any(f"no {column} column" in note for note in back.notes)


@pytest.mark.parametrize("fields", [["time_created_ns"], ["timeout_ms"],
                                    ["time_created_ns", "timeout_ms"]])
def test_dump_without_creation_time_or_timeout_is_never_healthy(
    tmp_path: Path, fields: list[str]
) -> None:
    assert analyze(load_dumps([TIMEOUT], jobs=1)).status is Status.HANG  # with the fields
    report = analyze(load_dumps([_without(fields, tmp_path / "d")], jobs=1))
    assert report.status is not Status.HEALTHY
    assert any(field in note for note in report.notes for field in fields)
