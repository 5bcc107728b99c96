"""The optional C stack walk (``_fastframes``) against the pure-Python walk it replaces.

On CPython 3.11 the extension is built by ``pip install -e .`` (setup.py) and these
tests require it; on other versions they are skipped and the recorder runs pure
Python. The recorder-level tests run both paths in one process by switching
``_pg._walk``, so they do not depend on ``FRFORENSICS_PURE_PYTHON``.
"""

from __future__ import annotations

import gc
import importlib
import os
import platform
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from frforensics.recorder import _ring as R

SUPPORTED = platform.python_implementation() == "CPython" and sys.version_info[:2] == (3, 11)


def _load() -> ModuleType:
    if not SUPPORTED:
        pytest.skip("the C walk exists for CPython 3.11 only")
    try:
        return importlib.import_module("frforensics.recorder._fastframes")
    except ImportError as exc:  # pragma: no cover - a broken build
        pytest.fail(f"_fastframes not built ({exc}); run `pip install -e .` with gcc present")


@pytest.fixture(name="walk")
def _walk() -> Callable[[int, int, R.FrameFilter], list[Any]]:
    walk: Callable[[int, int, R.FrameFilter], list[Any]] = _load().walk
    return walk


WalkFn = Callable[[int, int, R.FrameFilter], list[Any]]


def _leaf(fn: WalkFn, skip: int, depth: int, flt: R.FrameFilter) -> list[Any]:
    return fn(skip, depth, flt)


def _mid(fn: WalkFn, skip: int, depth: int, flt: R.FrameFilter) -> list[Any]:
    return _leaf(fn, skip, depth, flt)


def _gen(fn: WalkFn, skip: int, depth: int, flt: R.FrameFilter) -> Iterator[list[Any]]:
    yield _mid(fn, skip, depth, flt)


def _top(fn: WalkFn, skip: int, depth: int, flt: R.FrameFilter) -> list[Any]:
    return next(_gen(fn, skip, depth, flt))


def _frames(stack: list[Any]) -> list[tuple[str, str, int]]:
    return [(stack[i].co_filename, stack[i].co_name, R.line_of(stack[i], stack[i + 1]))
            for i in range(0, len(stack), 2)]


@pytest.mark.parametrize("skip", [0, 1, 2, 3, 5, 10_000])
@pytest.mark.parametrize("depth", [0, 1, 3, 8, 64])
def test_c_walk_gives_the_python_walks_frames_and_lines(walk, skip, depth):
    flt = R.FrameFilter(("/nowhere/",))
    c_stack, py_stack = (_top(fn, skip, depth, flt) for fn in (walk, R.capture_caller))
    assert [type(x) for x in c_stack] == [type(x) for x in py_stack]
    # Codes are the same objects; offsets may differ only where a frame is calling
    # into C (3.11's specialized PRECALL runs the call itself), never their lines.
    assert c_stack[::2] == py_stack[::2]
    assert _frames(c_stack) == _frames(py_stack)
    assert len(c_stack) <= 2 * depth
    if depth > 0 and skip == 0:
        assert [c.co_name for c in c_stack[:8:2]] == ["_leaf", "_mid", "_gen", "_top"][:depth]


def test_c_walk_skips_what_the_filter_skips_and_asks_it_about_new_code_once(walk):
    flt = R.FrameFilter((os.path.abspath(__file__),))
    kept = walk(0, 4, flt)[::2]
    assert kept  # pytest's own frames remain
    assert all(code.co_filename != os.path.abspath(__file__) for code in kept)
    this_code = sys._getframe(0).f_code
    assert id(this_code) in flt.skip_ids and this_code in flt.codes
    known = len(flt.codes)
    walk(0, 4, flt)
    assert len(flt.codes) == known  # verdicts reused, not asked again


def test_c_walk_stops_past_its_frame_cap_on_a_deep_skipped_stack(walk):
    flt = R.FrameFilter((os.path.abspath(__file__),))  # every frame here is skipped

    def deep(k: int) -> list[Any]:
        return deep(k - 1) if k else walk(0, 8, flt)

    # 300 skipped frames: the cap (256 frames examined) ends the walk before pytest's.
    assert deep(300) == []
    keep_all = R.FrameFilter(("/nowhere/",))

    def deep_kept(k: int) -> list[Any]:
        return deep_kept(k - 1) if k else walk(0, 500, keep_all)

    assert len(deep_kept(400)) == 2 * 256


def test_c_walk_holds_references_to_what_it_returns(walk):
    flt = R.FrameFilter(("/nowhere/",))

    def make() -> list[Any]:
        src = "def f(walk, flt):\n    return walk(0, 1, flt)\n"
        ns: dict[str, Any] = {}
        exec(compile(src, "<generated>", "exec"), ns)
        stack = list(ns["f"](walk, flt))
        ns.clear()  # f and its globals hold each other: break the cycle
        return stack

    stack = make()
    flt.codes.clear()  # the only other owner of the generated code object
    flt.keep_ids.clear()
    gc.collect()
    held = sys.getrefcount(stack[0])  # before pytest's assert rewriting keeps temporaries
    assert held == 2  # the list's reference, and the call's
    assert stack[0].co_name == "f" and stack[0].co_filename == "<generated>"
    code = sys._getframe(0).f_code
    walk(0, 8, flt)  # classify every frame once (the filter keeps its codes)
    before = sys.getrefcount(code)
    for _ in range(1000):
        walk(0, 8, flt)
    assert sys.getrefcount(code) == before
    stacks = []
    for _ in range(10):  # not a comprehension: that is a frame of its own in 3.11
        stacks.append(walk(0, 1, flt))
    assert sys.getrefcount(code) == before + 10
    del stacks
    assert sys.getrefcount(code) == before


def test_c_walk_passes_on_errors_and_bad_arguments_without_crashing(walk):
    class Failing(R.FrameFilter):
        __slots__ = ()

        def keep(self, code: Any) -> bool:
            raise RuntimeError("filter broke")

    with pytest.raises(RuntimeError, match="filter broke"):
        walk(0, 4, Failing(()))
    with pytest.raises(AttributeError):
        walk(0, 4, object())
    with pytest.raises(TypeError):
        walk("0", 4, R.FrameFilter(()))
    with pytest.raises(TypeError):
        walk(0, 4)
    assert walk(0, 0, object()) == []  # depth 0 never looks at the filter


def test_c_walk_on_a_fresh_threads_shallow_stack(walk):
    flt = R.FrameFilter(("/nowhere/",))
    out: list[list[Any]] = []
    thread = threading.Thread(target=lambda: out.append(walk(0, 64, flt)))
    thread.start()
    thread.join(10)
    names = [c.co_name for c in out[0][::2]]
    assert names[0] == "<lambda>" and names[-1] == "_bootstrap"
    assert "test_c_walk_on_a_fresh_threads_shallow_stack" not in names  # other thread's


# ---------------------------------------------------------------- through the recorder


def _user_leaf(pg: Any, t: Any, opts: Any) -> None:
    pg.allreduce([t], opts)


def _user_mid(pg: Any, t: Any, opts: Any) -> None:
    _user_leaf(pg, t, opts)


def _user_top(pg: Any, t: Any, opts: Any) -> None:
    for _ in range(2):  # the second call runs with the call sites specialized
        _user_mid(pg, t, opts)


def _noop_recording_group(tmp_path: Path) -> tuple[Any, Any]:
    """A recorder and its recording group over a backend whose ops finish at once."""
    from frforensics.recorder import _pg
    from frforensics.recorder._core import Recorder, RecorderConfig

    class Done:
        def is_completed(self) -> bool:
            return True

    class Noop:
        def allreduce(self, tensors: Any, opts: Any) -> Any:
            return Done()

        def name(self) -> str:
            return "noop"

    rec = Recorder(RecorderConfig(dump_dir=tmp_path, stack_depth=4))
    state = rec.new_group(name="0", desc="default_pg", ranks=(0,), backend="noop",
                          timeout_ms=60_000)
    return rec, _pg.RecordingProcessGroup(rec, state, 0, 1, {"cpu": Noop()}, "cpu")


def _recorded_stacks(tmp_path: Path, walk: WalkFn | None) -> list[list[tuple[str, str, int]]]:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from frforensics.recorder import _pg

    rec, pg = _noop_recording_group(tmp_path)
    saved = _pg._walk
    _pg._walk = walk
    try:
        _user_top(pg, torch.ones(4), dist.AllreduceOptions())
    finally:
        _pg._walk = saved
    entries, _ = rec.ring.snapshot()
    return [_frames(e[R.STACK]) for e in entries]


def test_recorded_stacks_are_the_same_with_and_without_the_c_walk(tmp_path, walk):
    with_c = _recorded_stacks(tmp_path, walk)
    pure = _recorded_stacks(tmp_path, None)
    assert with_c == pure
    names = [[name for _, name, _ in stack] for stack in pure]
    expected = ["_user_leaf", "_user_mid", "_user_top", "_recorded_stacks"]
    assert names == [expected, expected]
    assert with_c[0][0][2] == _user_leaf.__code__.co_firstlineno + 1


@pytest.mark.timeout(120)
@pytest.mark.slow  # two interpreters started per case: the slow lane
@pytest.mark.parametrize("pure", [True, False])
def test_env_var_forces_the_pure_python_walk(pure):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FRFORENSICS_")}
    if pure:
        env["FRFORENSICS_PURE_PYTHON"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", "from frforensics.recorder import _pg, _ring; "
         "print(_ring.fast_walk is None, _pg._walk is _ring.fast_walk)"],
        capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(pure or not SUPPORTED), "True"]


def test_untrack_takes_an_entry_and_its_shape_tuples_out_of_the_gc_and_keeps_them_alive() -> None:
    import weakref

    mod = _load()
    torch = pytest.importorskip("torch")
    t = torch.ones(2, 3)
    meta = ((t.shape, t.dtype),)

    class Held:  # something the entry refers to, collectable only by refcount here
        pass

    held = Held()
    ref = weakref.ref(held)
    inner: list[Any] = [1]
    entry = [7, "all_reduce", meta, held, inner, (("deep",),)]
    assert mod.untrack(entry) is entry
    assert not gc.is_tracked(entry)
    assert not gc.is_tracked(meta) and not gc.is_tracked(meta[0])
    assert not gc.is_tracked(meta[0][0])  # torch.Size, a tuple subclass
    assert gc.is_tracked(inner)  # only tuples are untracked below the entry
    del held
    gc.collect()
    assert ref() is not None  # the untracked entry still keeps what it holds alive
    del entry
    assert ref() is None  # freed by reference counting alone
    assert mod.untrack(5) == 5 and mod.untrack(entry := [1]) is entry


def test_the_recorders_entries_are_untracked_when_the_extension_is_built(tmp_path) -> None:
    _load()
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from frforensics.recorder import _pg

    assert _pg._untrack is not R._keep_tracked

    rec, pg = _noop_recording_group(tmp_path)
    pg.allreduce([torch.ones(4)], dist.AllreduceOptions())
    entries, _ = rec.ring.snapshot()
    assert len(entries) == 1
    (entry,) = entries
    assert not gc.is_tracked(entry) and not gc.is_tracked(entry[R.STACK])
    assert entry[R.STACK]  # the stack is still there
