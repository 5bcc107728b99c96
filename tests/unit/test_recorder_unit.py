"""Recorder pieces that need no multi-process job: autoload, imports, ring, single-rank dumps."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from frforensics.recorder import _ring as R


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("FRFORENSICS_")}
    full["FRFORENSICS_RECORDER_PATH"] = os.environ["FRFORENSICS_RECORDER_PATH"]  # tests/conftest.py
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full, timeout=120, check=False)


@pytest.mark.timeout(120)
def test_import_torch_without_the_env_var_leaves_torch_untouched():
    proc = _run("import sys, torch; import torch.distributed.distributed_c10d as c; "
                "print('frforensics.recorder._pg' in sys.modules, "
                "hasattr(c._new_process_group_helper, '__wrapped__'))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False"]


@pytest.mark.timeout(120)
def test_import_torch_with_the_env_var_routes_new_groups(tmp_path):
    proc = _run("import torch; import torch.distributed.distributed_c10d as c; "
                "import frforensics.recorder as r; "
                "print(r.is_enabled(), hasattr(c._new_process_group_helper, '__wrapped__'))",
                env={"FRFORENSICS_ENABLE": "1", "FRFORENSICS_DUMP_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]


@pytest.mark.timeout(120)
def test_a_bad_env_value_never_breaks_import_torch(tmp_path):
    proc = _run("import torch; print('ok')",
                env={"FRFORENSICS_ENABLE": "1", "FRFORENSICS_TIMEOUT_S": "not-a-number"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    assert "recorder not enabled" in proc.stderr


def test_recorder_package_imports_neither_analyzer_nor_rich_nor_typer():
    proc = _run("import sys, frforensics.recorder, frforensics.recorder._core, "
                "frforensics.recorder._dump, frforensics.recorder._watchdog; "
                "print(sorted(m for m in sys.modules if m.split('.')[0] in ('rich', 'typer') "
                "or m.startswith('frforensics.analyzer') or m == 'frforensics.cli'))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_ring_keeps_the_newest_entries_oldest_first_and_counts_the_dropped():
    ring = R.Ring(3)
    for rid in range(5):
        entry = [None] * R.N_SLOTS
        entry[R.RECORD_ID] = rid
        ring.slots[rid % ring.capacity] = entry
        ring.count = rid + 1
    entries, dropped = ring.snapshot()
    assert [e[R.RECORD_ID] for e in entries] == [2, 3, 4]
    assert dropped == 2


def test_stack_capture_skips_filtered_frames_and_keeps_the_innermost_first():
    flt = R.FrameFilter((os.path.abspath(__file__) + "-nothing",))

    def inner():
        return R.capture_stack(sys._getframe(0), 2, flt)

    def outer():
        return inner()

    stack = outer()
    names = [stack[i].co_name for i in range(0, len(stack), 2)]
    assert names == ["inner", "outer"]
    skip_me = R.FrameFilter((os.path.abspath(__file__),))
    kept = R.capture_stack(sys._getframe(0), 4, skip_me)[::2]
    assert kept  # pytest's own frames remain
    assert all(code.co_filename != os.path.abspath(__file__) for code in kept)


def test_captured_bytecode_offsets_resolve_to_the_calling_lines():
    flt = R.FrameFilter((os.path.abspath(__file__) + "-nothing",))
    expected: list[int] = []

    def inner():
        frame = sys._getframe(0)
        stack = R.capture_stack(frame, 3, flt)
        expected.extend([frame.f_lineno, frame.f_back.f_lineno, frame.f_back.f_back.f_lineno])
        return stack

    def outer():
        return inner()

    stack = outer()
    lines = [R.line_of(stack[i], stack[i + 1]) for i in range(0, len(stack), 2)]
    assert lines[1:] == expected[1:]  # the innermost frame moved on between the two reads
    assert lines[0] == expected[0] - 1


def test_frame_filter_forgets_its_verdicts_past_its_limit():
    flt = R.FrameFilter(("/nowhere/",), limit=3)
    codes = [compile(f"x = {i}", f"f{i}.py", "exec") for i in range(5)]
    assert all(flt.keep(c) for c in codes)
    assert len(flt.codes) <= 3 and id(codes[-1]) in flt.keep_ids


SINGLE_RANK = """
import sys, torch, torch.distributed as dist, frforensics.recorder as fr
from frforensics.formats import decode_dump
fr.enable(sys.argv[1], timeout_s=30)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
t = torch.ones(3, 2, dtype=torch.float16)
for _ in range(5):
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
path = fr.dump(detail="checkpoint")
trace = decode_dump(open(path, "rb").read(), source=str(path))
e = trace.entries
print(len(e), e.seq.tolist(), trace.string(int(e.reduce_op[0])), trace.string(int(e.in_shapes[0])),
      trace.string(int(e.in_dtypes[0])), int(e.in_numel[0]), trace.dump_reason.value,
      trace.dump_detail, trace.world_size, trace.main_thread().frames[0].name)
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_single_rank_api_dump_holds_shapes_dtypes_reduce_op_and_seq(tmp_path):
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _run(SINGLE_RANK.replace("sys.argv[1]", repr(str(tmp_path))).replace(
        "sys.argv[2]", repr(str(port))))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["5", "[1,", "2,", "3,", "4,", "5]", "MAX", "[[3,", "2]]",
                                   "Half", "6", "api", "checkpoint", "1", "<module>"]


def test_stale_peers_fall_back_to_the_last_reading_when_the_store_host_is_gone(tmp_path):
    import time

    from frforensics.recorder._core import Recorder, RecorderConfig

    class Store:
        alive = True

        def check(self, keys):
            if not self.alive:
                raise RuntimeError("Connection reset by peer")
            return True

        def multi_get(self, keys):
            return [str(time.time_ns() - 5_000_000_000).encode()]  # 5 s old

    rec = Recorder(RecorderConfig(dump_dir=tmp_path, heartbeat_stale_s=2.0))
    rec.store, rec.rank, rec.world_size = Store(), 0, 2
    first = rec.stale_peers()
    assert [p.rank for p in first] == [1] and first[0].age_s >= 5.0
    rec.store.alive = False
    assert rec.stale_peers() == first
