"""The wrapper: a Python ``ProcessGroup`` that records every op and forwards it.

:class:`RecordingProcessGroup` holds one real backend per device type (built by
``_c10d`` through the creator the installed torch registered), registers each on
itself (C++ callers of non-virtual entry points still reach them) and dispatches
every Python-visible call by tensor device. It writes entries into the
recorder's ring (``_core``) and knows nothing of how it was installed.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch as _torch
import torch.distributed as _dist
from torch.distributed import distributed_c10d as _c10d

from frforensics.recorder import _ring as R
from frforensics.recorder._core import Entry, GroupState, Recorder, Tracked

# torch's stubs do not describe the private c10d surface this module drives.
torch: Any = _torch
dist: Any = _dist
c10d: Any = _c10d


# torch 2.15's trampoline takes the (store, rank, size) constructor for a Python
# subclass; 2.13's raises ("not an alias instance") and has no C++ split path
# that needs the store. Probed once, on a throwaway subclass.
def _store_ctor_works() -> bool:
    class _Probe(dist.ProcessGroup):  # type: ignore[misc]
        pass

    try:
        _Probe(dist.HashStore(), 0, 1)
    except Exception:
        return False
    return True


_STORE_CTOR = _store_ctor_works()

_mono = time.monotonic_ns
_get_ident = threading.get_ident
_getframe = sys._getframe
_capture = R.capture_stack
# The C walk when built (no frame objects made; docs/recorder.md, "Overhead"),
# else None and the pure-Python walk. Module-level so tests and the bench can switch.
_walk = R.fast_walk
_untrack = R.untrack
_Tensor = torch.Tensor
_AllreduceOptions = dist.AllreduceOptions


def _as_list(tensors: Any) -> list[Any]:
    if type(tensors) is list:
        return tensors
    if isinstance(tensors, _Tensor):
        return [tensors]
    return list(tensors) if tensors is not None else []


def _meta(tensors: Sequence[Any]) -> tuple[Any, ...]:
    if len(tensors) == 1:
        t = tensors[0]
        return ((t.shape, t.dtype),)
    return tuple((t.shape, t.dtype) for t in tensors)


def _meta_nested(lists: Sequence[Sequence[Any]]) -> tuple[Any, ...]:
    return tuple((t.shape, t.dtype) for sub in lists for t in sub)


def _advance(st: GroupState, op: str, peer: int, is_p2p: bool,
             block: int) -> tuple[int, int, int]:
    """Sequence numbers of a p2p op or of an op inside a coalescing block."""
    if block < 0:
        st.p2p_seq += 1  # a p2p op outside a block (collectives take the fast path)
        seq, p2p_seq = st.seq, st.p2p_seq
    else:  # inside a coalescing block: every op shares the closing seq
        if st.block_p2p < 0:
            st.block_p2p = 1 if is_p2p else 0
        if st.block_p2p:
            seq, p2p_seq = st.seq, st.p2p_seq + 1
        else:
            seq, p2p_seq = st.seq + 1, st.p2p_seq
    peer_seq = -1
    if is_p2p:
        counts = st.send_count if op == "send" else st.recv_count
        peer_seq = counts.get(peer, 0) + 1
        counts[peer] = peer_seq
    return seq, p2p_seq, peer_seq


def _cuda_info(rec: Recorder, tensor: Any) -> tuple[str, int, Any]:
    """Device, caller's stream handle and (when enabled) an event recorded on it."""
    dev = tensor.device
    stream = torch.cuda.current_stream(dev)
    event = None
    if rec.config.cuda_events:
        event = torch.cuda.Event()
        event.record(stream)
    return f"cuda:{dev.index}", int(stream.cuda_stream), event


def _push(st: GroupState, pending: deque[Tracked], entry: Entry, work: Any) -> None:
    """Make ``(entry, work)`` the group's newest op; settle the previous one.

    Most ops are finished when the next one is issued (``dist.*`` waits on
    them): those are stamped ``completed`` here, so the watchdog only polls each
    group's newest op and the few ops still running when their successor was
    issued. The stamp is no later than the watchdog's would have been. Either
    way the op goes to ``pending``: the watchdog reads a stamped op's result
    once (a failed op followed by more ops stays ``failed``) and drops it; the
    training thread never pays for reading results. CUDA works go to the
    watchdog unstamped (``is_completed`` queries events there).
    """
    prev = st.last
    st.last = (entry, work)
    if prev is not None:
        pe = prev[0]
        if pe[13] < 2:  # R.STATE < R.COMPLETED
            if not st.cuda and prev[1].is_completed():
                pe[16] = _mono()  # R.T_COMPLETE
                pe[13] = 2
            pending.append(prev)


class RecordedWork(dist.Work):  # type: ignore[misc]
    """Forwards to the real work and stamps completion at ``wait()``.

    Used only for works that have no future (gloo reduce_scatter and p2p), whose
    ``is_completed()`` stays False until somebody waits on them.
    """

    def __init__(self, inner: Any, entry: Entry) -> None:
        super().__init__()
        self._inner = inner
        self._entry = entry

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        entry = self._entry
        try:
            ok = bool(self._inner.wait(timeout)) if timeout else bool(self._inner.wait())
        except BaseException:
            with contextlib.suppress(Exception):
                if entry[R.STATE] < R.COMPLETED:
                    entry[R.T_COMPLETE] = _mono()
                    entry[R.STATE] = R.FAILED
            raise
        if entry[R.STATE] < R.COMPLETED:
            entry[R.T_COMPLETE] = _mono()
            entry[R.STATE] = R.COMPLETED
        return ok

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())

    def is_success(self) -> bool:
        return bool(self._inner.is_success())

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return int(self._inner.source_rank())

    def result(self) -> Any:
        return self._inner.result()

    def synchronize(self) -> None:
        self._inner.synchronize()

    def get_future(self) -> Any:
        return self._inner.get_future()

    def block_current_stream(self) -> None:
        self._inner.block_current_stream()


class RecordingProcessGroup(dist.ProcessGroup):  # type: ignore[misc]
    """A process group that records each op into the recorder's ring, then forwards it."""

    def __init__(self, recorder: Recorder, state: GroupState, rank: int, size: int,
                 backends: dict[str, Any], default_device: str, store: Any = None) -> None:
        # ``store``: the group's store (torch's helper builds every group with one;
        # c10d's C++ ``splitGroup`` derives the split groups' stores from it).
        # ``backends``: device type -> what serves that device's ops: the backend
        # torch's creator built, or (torch 2.15, backends that do not record
        # themselves) a plain ProcessGroup over it carrying torch's
        # FlightRecorderHook, whose hooks fire only on c10d's dispatcher path.
        if store is not None and _STORE_CTOR:
            super().__init__(store, rank, size)
        else:
            super().__init__(rank, size)
        self._frf_rec = recorder
        self._frf_state = state
        self._frf_backends = backends
        self._frf_default = backends[default_device]
        self._frf_default_device = default_device
        # One backend object for every device (plain "gloo" maps cpu and cuda to it).
        self._frf_single = len({id(b) for b in backends.values()}) == 1
        self._frf_cuda = bool(state.cuda)
        self._frf_fr_hook: Any = None  # torch's FlightRecorderHook handle, if any
        self._frf_split_from: Any = None  # the group split_group made, kept alive

    # ------------------------------------------------------------ plumbing

    def _frf_inner(self, tensor: Any) -> Any:
        if self._frf_single:
            return self._frf_default
        try:
            return self._frf_backends[tensor.device.type]
        except (AttributeError, KeyError):
            return self._frf_default

    def _frf_inner_for_device(self, device: Any) -> Any:
        dtype = getattr(device, "type", device)
        return self._frf_backends.get(str(dtype), self._frf_default)

    def _frf_record(self, op: str, inputs: tuple[Any, ...], outputs: tuple[Any, ...],
                    reduce_op: Any, root: int, peer: int, is_p2p: bool,
                    first: Any) -> Entry | None:
        # The hot path: every statement here is paid per op (see docs/recorder.md,
        # "Overhead"). References only; names and strings are made at dump time.
        rec = self._frf_rec
        if not rec.active:
            return None
        try:
            st = self._frf_state
            block = st.block_id
            if block < 0 and not is_p2p:  # the common case: a collective
                st.seq = seq = st.seq + 1
                p2p_seq = st.p2p_seq
                peer_seq = -1
            else:
                seq, p2p_seq, peer_seq = _advance(st, op, peer, is_p2p, block)
            if self._frf_cuda and first is not None and first.is_cuda:
                device, stream, event = _cuda_info(rec, first)
            else:
                device, stream, event = None, -1, None
            rid = rec.count
            entry = [
                rid, st.index, seq, p2p_seq, peer_seq, op, is_p2p, peer, root, block,
                inputs, outputs, reduce_op, 0, _mono(), 0, 0, st.timeout_ms,
                _get_ident(), device, stream,
                _walk(2, rec.stack_depth, rec.frame_filter) if _walk is not None
                else _capture(_getframe(2), rec.stack_depth, rec.frame_filter), event,
            ]
            ring = rec.ring
            ring.slots[rid % ring.capacity] = _untrack(entry)
            ring.count = rec.count = rid + 1
            return entry
        except Exception as exc:  # recording must never break the job
            rec.note_error("record", exc)
            return None

    def _frf_track(self, entry: Entry | None, work: Any, wrap: bool) -> Any:
        if entry is None or work is None:
            return work
        try:
            if wrap:
                work = RecordedWork(work, entry)
            _push(self._frf_state, self._frf_rec.pending, entry, work)
        except Exception as exc:
            self._frf_rec.note_error("track", exc)
        return work

    # ------------------------------------------------------------ collectives

    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        # The most frequent op (DDP, most training loops): written out flat.
        if type(tensors) is not list:
            tensors = _as_list(tensors)
        if opts is None or not isinstance(opts, _AllreduceOptions):
            op = opts
            opts = _AllreduceOptions()
            if op is not None:
                opts.reduceOp = op
        if len(tensors) == 1:
            first = tensors[0]
            meta: tuple[Any, ...] = ((first.shape, first.dtype),)
        else:
            first = tensors[0] if tensors else None
            meta = _meta(tensors)
        # The options object stands for its reduce op (read at dump time): reading
        # ``opts.reduceOp`` builds a new ReduceOp per call (~150 ns).
        entry = self._frf_record("all_reduce", meta, meta, opts, -1, -1, False, first)
        inner = self._frf_default if self._frf_single else self._frf_inner(first)
        work = inner.allreduce(tensors, opts)
        if entry is not None and work is not None:
            try:
                _push(self._frf_state, self._frf_rec.pending, entry, work)
            except Exception as exc:
                self._frf_rec.note_error("track", exc)
        return work

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Any:
        tensors = _as_list(tensors)
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        first = tensors[0] if tensors else None
        meta = _meta(tensors)
        entry = self._frf_record("all_reduce_coalesced", meta, meta, opts.reduceOp, -1, -1,
                                 False, first)
        inner = self._frf_inner(first).allreduce_coalesced(tensors, opts)
        return self._frf_track(entry, inner, False)

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        input_tensors = _as_list(input_tensors)
        opts = opts if opts is not None else c10d.AllgatherOptions()
        first = input_tensors[0] if input_tensors else None
        entry = self._frf_record("all_gather", _meta(input_tensors),
                                 _meta_nested(output_tensors), None, -1, -1, False, first)
        inner = self._frf_inner(first).allgather(output_tensors, input_tensors, opts)
        return self._frf_track(entry, inner, False)

    def _allgather_base(self, output: Any, input: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else c10d.AllgatherOptions()
        entry = self._frf_record("all_gather_into_tensor", ((input.shape, input.dtype),),
                                 ((output.shape, output.dtype),), None, -1, -1, False, input)
        inner = self._frf_inner(input)._allgather_base(output, input, opts)
        return self._frf_track(entry, inner, False)

    all_gather_single = _allgather_base

    def allgather_coalesced(self, output_lists: Any, input_list: Any, opts: Any = None) -> Any:
        input_list = _as_list(input_list)
        opts = opts if opts is not None else c10d.AllgatherOptions()
        first = input_list[0] if input_list else None
        entry = self._frf_record("all_gather_coalesced", _meta(input_list),
                                 _meta_nested(output_lists), None, -1, -1, False, first)
        inner = self._frf_inner(first).allgather_coalesced(output_lists, input_list, opts)
        return self._frf_track(entry, inner, False)

    def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        inputs = _as_list(inputs)
        outputs = _as_list(outputs)
        opts = opts if opts is not None else c10d.AllgatherOptions()
        first = inputs[0] if inputs else None
        entry = self._frf_record("all_gather_into_tensor_coalesced", _meta(inputs),
                                 _meta(outputs), None, -1, -1, False, first)
        inner_pg = self._frf_inner(first)
        if hasattr(inner_pg, "allgather_into_tensor_coalesced"):
            work = inner_pg.allgather_into_tensor_coalesced(outputs, inputs, opts)
        else:  # gloo has no fused form: one _allgather_base per tensor, one work
            work = _chain([inner_pg._allgather_base(o, i, opts)
                           for o, i in zip(outputs, inputs, strict=True)])
        return self._frf_track(entry, work, False)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def broadcast(self, tensors: Any, opts: Any = None) -> Any:
        tensors = _as_list(tensors)
        if opts is None or not isinstance(opts, dist.BroadcastOptions):
            root = opts
            opts = dist.BroadcastOptions()
            if isinstance(root, int):
                opts.rootRank = root
        first = tensors[0] if tensors else None
        meta = _meta(tensors)
        root = self._frf_state.global_rank(opts.rootRank)
        entry = self._frf_record("broadcast", meta, meta, None, root, -1, False, first)
        return self._frf_track(entry, self._frf_inner(first).broadcast(tensors, opts), False)

    def reduce(self, tensors: Any, opts: Any = None) -> Any:
        tensors = _as_list(tensors)
        opts = opts if opts is not None else dist.ReduceOptions()
        first = tensors[0] if tensors else None
        meta = _meta(tensors)
        root = self._frf_state.global_rank(opts.rootRank)
        entry = self._frf_record("reduce", meta, meta, opts.reduceOp, root, -1, False, first)
        return self._frf_track(entry, self._frf_inner(first).reduce(tensors, opts), False)

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        input_tensors = _as_list(input_tensors)
        opts = opts if opts is not None else dist.GatherOptions()
        first = input_tensors[0] if input_tensors else None
        root = self._frf_state.global_rank(opts.rootRank)
        entry = self._frf_record("gather", _meta(input_tensors), _meta_nested(output_tensors),
                                 None, root, -1, False, first)
        inner = self._frf_inner(first).gather(output_tensors, input_tensors, opts)
        return self._frf_track(entry, inner, False)

    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        output_tensors = _as_list(output_tensors)
        opts = opts if opts is not None else dist.ScatterOptions()
        first = output_tensors[0] if output_tensors else None
        root = self._frf_state.global_rank(opts.rootRank)
        entry = self._frf_record("scatter", _meta_nested(input_tensors), _meta(output_tensors),
                                 None, root, -1, False, first)
        inner = self._frf_inner(first).scatter(output_tensors, input_tensors, opts)
        return self._frf_track(entry, inner, False)

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        output_tensors = _as_list(output_tensors)
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        first = output_tensors[0] if output_tensors else None
        entry = self._frf_record("reduce_scatter", _meta_nested(input_tensors),
                                 _meta(output_tensors), opts.reduceOp, -1, -1, False, first)
        inner_pg = self._frf_inner(first)
        work = inner_pg.reduce_scatter(output_tensors, input_tensors, opts)
        return self._frf_track(entry, work, _no_future(inner_pg))

    def _reduce_scatter_base(self, output: Any, input: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        entry = self._frf_record("reduce_scatter_tensor", ((input.shape, input.dtype),),
                                 ((output.shape, output.dtype),), opts.reduceOp, -1, -1,
                                 False, input)
        inner_pg = self._frf_inner(input)
        work = inner_pg._reduce_scatter_base(output, input, opts)
        return self._frf_track(entry, work, _no_future(inner_pg))

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        inputs = _as_list(inputs)
        outputs = _as_list(outputs)
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        first = inputs[0] if inputs else None
        entry = self._frf_record("reduce_scatter_tensor_coalesced", _meta(inputs),
                                 _meta(outputs), opts.reduceOp, -1, -1, False, first)
        inner_pg = self._frf_inner(first)
        if hasattr(inner_pg, "reduce_scatter_tensor_coalesced"):
            work = inner_pg.reduce_scatter_tensor_coalesced(outputs, inputs, opts)
        else:
            work = _chain([inner_pg._reduce_scatter_base(o, i, opts)
                           for o, i in zip(outputs, inputs, strict=True)])
        return self._frf_track(entry, work, _no_future(inner_pg))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall_base(self, output: Any, input: Any, output_split_sizes: Any,
                      input_split_sizes: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllToAllOptions()
        entry = self._frf_record("all_to_all_single", ((input.shape, input.dtype),),
                                 ((output.shape, output.dtype),), None, -1, -1, False, input)
        if entry is not None and (input_split_sizes or output_split_sizes):
            # uneven: what this rank sends each member and expects from each (rows of
            # dim 0; issue 29), checked pairwise by the analyzer. Copies: the caller
            # may reuse its lists
            with contextlib.suppress(Exception):
                entry.append((tuple(input_split_sizes or ()), tuple(output_split_sizes or ())))
        inner = self._frf_inner(input).alltoall_base(output, input, output_split_sizes,
                                                     input_split_sizes, opts)
        return self._frf_track(entry, inner, False)

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        input_tensors = _as_list(input_tensors)
        opts = opts if opts is not None else dist.AllToAllOptions()
        first = input_tensors[0] if input_tensors else None
        entry = self._frf_record("all_to_all", _meta(input_tensors), _meta(output_tensors),
                                 None, -1, -1, False, first)
        inner = self._frf_inner(first).alltoall(output_tensors, input_tensors, opts)
        return self._frf_track(entry, inner, False)

    def barrier(self, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.BarrierOptions()
        entry = self._frf_record("barrier", (), (), None, -1, -1, False, None)
        inner_pg = self._frf_default
        if not self._frf_single and getattr(opts, "device", None) is not None:
            inner_pg = self._frf_inner_for_device(opts.device)
        return self._frf_track(entry, inner_pg.barrier(opts), False)

    # ------------------------------------------------------------ p2p

    def send(self, tensors: Any, dstRank: int, tag: int = 0) -> Any:
        tensors = _as_list(tensors)
        first = tensors[0] if tensors else None
        peer = self._frf_state.global_rank(dstRank)
        meta = _meta(tensors)
        entry = self._frf_record("send", meta, meta, None, -1, peer, True, first)
        inner_pg = self._frf_inner(first)
        return self._frf_track(entry, inner_pg.send(tensors, dstRank, tag), _no_future(inner_pg))

    def recv(self, tensors: Any, srcRank: int, tag: int = 0) -> Any:
        tensors = _as_list(tensors)
        first = tensors[0] if tensors else None
        peer = self._frf_state.global_rank(srcRank)
        meta = _meta(tensors)
        entry = self._frf_record("recv", meta, meta, None, -1, peer, True, first)
        inner_pg = self._frf_inner(first)
        return self._frf_track(entry, inner_pg.recv(tensors, srcRank, tag), _no_future(inner_pg))

    def recv_anysource(self, tensors: Any, tag: int = 0) -> Any:
        tensors = _as_list(tensors)
        first = tensors[0] if tensors else None
        meta = _meta(tensors)
        entry = self._frf_record("recv_any_source", meta, meta, None, -1, -1, True, first)
        inner_pg = self._frf_inner(first)
        return self._frf_track(entry, inner_pg.recv_anysource(tensors, tag), _no_future(inner_pg))

    # ------------------------------------------------------------ coalescing

    def _start_coalescing(self, device: Any) -> None:
        st = self._frf_state
        inner = self._frf_inner_for_device(device)
        if isinstance(inner, dist.ProcessGroup):  # a hooked inner group takes the device
            inner._start_coalescing(device)
        else:
            inner._start_coalescing()  # Backend's takes no device
        st.block_id = self._frf_rec.next_block_id()
        st.block_p2p = -1

    def _end_coalescing(self, device: Any) -> Any:
        st = self._frf_state
        inner = self._frf_inner_for_device(device)
        try:
            if isinstance(inner, dist.ProcessGroup):
                work = inner._end_coalescing(device)
            else:
                work = inner._end_coalescing()
        finally:
            block, kind = st.block_id, st.block_p2p
            st.block_id = -1
            st.block_p2p = -1
        if block < 0 or kind < 0:
            return work  # an empty block issues nothing
        entry = self._frf_record_closing(block, bool(kind))
        return self._frf_track(entry, work, False)

    def _frf_record_closing(self, block: int, is_p2p: bool) -> Entry | None:
        st = self._frf_state
        if is_p2p:
            st.p2p_seq += 1
        else:
            st.seq += 1
        # Recorded like any op (same counters already advanced), outside a block.
        rec = self._frf_rec
        if not rec.active:
            return None
        try:
            rid = rec.count
            entry = [
                rid, st.index, st.seq, st.p2p_seq, -1, "coalesced", is_p2p, -1, -1, block,
                (), (), None, R.SCHEDULED, _mono(), 0, 0, st.timeout_ms, _get_ident(),
                None, -1, _walk(2, rec.stack_depth, rec.frame_filter) if _walk is not None
                else _capture(_getframe(2), rec.stack_depth, rec.frame_filter),
                None,
            ]
            ring = rec.ring
            ring.slots[rid % ring.capacity] = _untrack(entry)
            ring.count = rec.count = rid + 1
            return entry
        except Exception as exc:
            rec.note_error("record", exc)
            return None

    # ------------------------------------------------------------ misc

    def getBackendName(self) -> str:
        return str(self._frf_default.name())

    def _frf_describe(self) -> str:
        st = self._frf_state
        return f"{st.name} ({st.desc})"


class _ChainedWork(dist.Work):  # type: ignore[misc]
    """One work standing for several (gloo has no fused coalesced all_gather/reduce_scatter)."""

    def __init__(self, works: list[Any]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        for w in self._works:
            if timeout:
                w.wait(timeout)
            else:
                w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def exception(self) -> Any:
        for w in self._works:
            exc = w.exception()
            if exc is not None:
                return exc
        return None

    def synchronize(self) -> None:
        for w in self._works:
            w.synchronize()

    def get_future(self) -> Any:
        futures = [w.get_future() for w in self._works]
        if len(futures) == 1:
            return futures[0]
        return torch.futures.collect_all(futures)


def _chain(works: list[Any]) -> Any:
    return works[0] if len(works) == 1 else _ChainedWork(works)


def _no_future(inner_pg: Any) -> bool:
    """True for backends whose reduce_scatter/p2p works have no future (gloo)."""
    try:
        return bool(inner_pg.name() == "gloo")
    except Exception:
        return False
