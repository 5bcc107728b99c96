"""The one failure classifier (``frforensics.failures``): every marker, every signal."""

from __future__ import annotations

import signal

import pytest

from frforensics import failures
from frforensics.failures import (
    MARKERS,
    FailureClass,
    classify_death,
    classify_exit,
    classify_message,
    classify_signal,
    is_comm_failure,
    is_peer_loss,
)

ROOT, CONSEQUENCE, UNKNOWN = FailureClass.ROOT, FailureClass.CONSEQUENCE, FailureClass.UNKNOWN

# Real messages, as the libraries print them (gloo pair.cc / unbound_buffer.cc
# with their GLOO_ERROR_MSG prefix, NCCL's ncclGetErrorString, ProcessGroupNCCL).
REAL = [
    ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
     "[127.0.0.1]:4567. This is typically caused by a remote worker crashing. Check the logs "
     "of the remote worker before reporting an error.", CONSEQUENCE, "peer_lost"),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:525] Read error [127.0.0.1]:3891: "
     "Connection reset by peer", CONSEQUENCE, "peer_lost"),
    ("[../gloo/transport/tcp/pair.cc:339] writev [127.0.0.1]:3891: Broken pipe", CONSEQUENCE,
     "peer_lost"),
    ("[gloo/transport/tcp/pair.cc:201] Socket unexpectedly closed [127.0.0.1]:1", CONSEQUENCE,
     "peer_lost"),
    ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms "
     "for recv operation to complete", CONSEQUENCE, "timeout"),
    ("Application timeout caused pair closure", CONSEQUENCE, "aborted"),
    ("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network "
     "error, NCCL version 2.20.5\nncclRemoteError: A call failed possibly due to a network "
     "error", CONSEQUENCE, "peer_lost"),
    ("NCCL communicator was aborted on rank 12.", CONSEQUENCE, "aborted"),
    ("[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
     "OpType=ALLREDUCE) ran for 600011 milliseconds before timing out.", CONSEQUENCE, "timeout"),
    ("torch.distributed.DistNetworkError: failed to recv, got 0 bytes", CONSEQUENCE,
     "peer_lost"),
    ("[enforce fail at ../gloo/transport/tcp/pair.cc:459] op.preamble.length <= op.nbytes. "
     "Received data size doesn't match expected size. Is there a distributed collective "
     "mismatch in your code?", CONSEQUENCE, "desync"),
    ("SignalException: Process 4121 got signal: 15", CONSEQUENCE, "teardown"),
    ("KeyboardInterrupt: ", CONSEQUENCE, "teardown"),
    ("RuntimeError: Operation timed out!", CONSEQUENCE, "timeout"),
    ("RuntimeError: CUDA error: an illegal memory access was encountered", ROOT, "hardware"),
    ("RuntimeError: CUDA error: uncorrectable ECC error encountered", ROOT, "hardware"),
    ("NVRM: Xid (PCI:0000:8a:00): 79, GPU has fallen off the bus", ROOT, "hardware"),
    ("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error (run with "
     "NCCL_DEBUG=INFO for details)", ROOT, "hardware"),
    ("NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO for details)", ROOT,
     "hardware"),
    ("NCCL error: internal error - please report this issue to the NCCL developers", ROOT,
     "hardware"),
    ("RuntimeError: CUDA error: device-side assert triggered", ROOT, "exception"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", ROOT, "oom"),
    # the communicator aborted because of this rank's own CUDA error: root
    ("NCCL communicator was aborted on rank 2. Original reason for failure was: CUDA error: "
     "an illegal memory access was encountered", ROOT, "hardware"),
    ("RuntimeError: bad batch", ROOT, "exception"),
    ("ValueError: loss is NaN", ROOT, "exception"),
    ("torch.distributed.DistBackendError: NCCL error in: ..., invalid usage", UNKNOWN,
     "comm_error"),
    ("", UNKNOWN, "unknown"),
    ("something went wrong", UNKNOWN, "unknown"),
]


@pytest.mark.parametrize(("message", "cls", "cause"), REAL)
def test_real_messages_are_classified_by_their_marker(message, cls, cause):
    got = classify_message(message)
    assert (got.cls, got.cause) == (cls, cause), got


@pytest.mark.parametrize("marker", MARKERS, ids=lambda m: m.text)
def test_every_marker_of_the_table_classifies_a_message_that_holds_it(marker):
    got = classify_message(f"RuntimeError: [somewhere] {marker.text.upper()} [10.0.0.1]:1")
    assert (got.cls, got.cause, got.marker) == (marker.cls, marker.cause, marker.text)
    assert got.source == marker.source and marker.source


@pytest.mark.parametrize("marker", MARKERS, ids=lambda m: m.text)
def test_every_marker_names_where_it_comes_from(marker):
    # a source file (with a line where the text is a literal of that file) or a
    # named producer: never an empty string
    assert any(s in marker.source for s in (".cc", ".cpp", ".h", ".py", "NCCL", "NVIDIA",
                                            "CUDA", "measured")), marker


@pytest.mark.parametrize(("signum", "cls", "cause"), [
    (signal.SIGKILL, ROOT, "killed"),
    (signal.SIGSEGV, ROOT, "crash"),
    (signal.SIGBUS, ROOT, "crash"),
    (signal.SIGABRT, ROOT, "crash"),
    (signal.SIGFPE, ROOT, "crash"),
    (signal.SIGILL, ROOT, "crash"),
    (signal.SIGTERM, CONSEQUENCE, "teardown"),
    (signal.SIGINT, CONSEQUENCE, "teardown"),
    (signal.SIGHUP, CONSEQUENCE, "teardown"),
    (signal.SIGUSR1, UNKNOWN, "signal"),
])
def test_signals_are_roots_crashes_or_the_launchers_teardown(signum, cls, cause):
    got = classify_signal(int(signum))
    assert (got.cls, got.cause) == (cls, cause)
    # the same through exit statuses: subprocess's -N and the shell's 128+N
    assert classify_exit(-int(signum)) == got
    assert classify_exit(128 + int(signum)) == got


@pytest.mark.parametrize(("code", "cls", "cause"), [
    (0, UNKNOWN, "none"), (1, UNKNOWN, "exit_status"), (99, UNKNOWN, "exit_status"),
])
def test_a_plain_exit_status_says_nothing_of_whose_failure_it_was(code, cls, cause):
    got = classify_exit(code)
    assert (got.cls, got.cause) == (cls, cause)


@pytest.mark.parametrize(("kind", "message", "cls", "cause"), [
    ("exception", "RuntimeError: bad batch", ROOT, "exception"),
    ("exception", "RuntimeError: [pair.cc:534] Connection closed by peer [::1]:5", CONSEQUENCE,
     "peer_lost"),
    ("exception", "weird text without a type", ROOT, "exception"),
    ("exit", "process exited with ops unfinished", ROOT, "exit"),
    ("signal", "SIGTERM", CONSEQUENCE, "teardown"),
    ("signal", "SIGKILL", ROOT, "killed"),
])
def test_a_dumps_death_record_is_classified_by_kind_and_message(kind, message, cls, cause):
    got = classify_death(kind, message)
    assert (got.cls, got.cause) == (cls, cause)


def test_peer_loss_and_comm_failure_are_questions_to_the_same_table():
    assert is_peer_loss("Connection closed by peer [127.0.0.1]:1")
    assert is_peer_loss("NCCL error: remote process exited or there was a network error")
    assert not is_peer_loss("Timed out waiting 2000ms for recv operation to complete")
    assert is_comm_failure("Timed out waiting 2000ms for recv operation to complete")
    assert is_comm_failure("NCCL error in: x.cpp:1, invalid usage")
    assert not is_comm_failure("bad batch")
    assert not is_comm_failure("CUDA error: an illegal memory access was encountered")


def test_the_classifier_is_pure_standard_library():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(failures.__file__).read_text())
    imported = {n.module if isinstance(n, ast.ImportFrom) else a.name
                for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in (n.names if isinstance(n, ast.Import) else [n])}
    assert not {m for m in imported if m and m.split(".")[0] in {"torch", "numpy", "frforensics"}}
