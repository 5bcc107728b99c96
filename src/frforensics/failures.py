"""One failure classifier: is a rank's failure its own (*root*) or another's (*consequence*)?

Every recorded exception, failed op, death or exit status is classified once,
here, by the recorder (its excepthook), by ``frforensics.recovery`` (is a failed
step a communication failure? did a peer die?) and by the analyzer (who is the
culprit of a crash cascade). Pure: the standard library only.

* ``ROOT`` — the rank's own failure: an exception raised in its code, a signal
  that killed it (SIGKILL: the OOM killer or an operator; SIGSEGV/SIGBUS/SIGILL/
  SIGFPE/SIGABRT: it crashed), a hardware error (CUDA errors, ECC, Xid, NCCL's
  "unhandled cuda/system error" and "internal error").
* ``CONSEQUENCE`` — it failed because another rank failed first: the transport
  lost its peer (gloo's "Connection closed by peer ... typically caused by a
  remote worker crashing", "Connection reset by peer", "Broken pipe", NCCL's
  ``ncclRemoteError`` "remote process exited or there was a network error"), an
  abort or timeout that follows a peer's failure (gloo's "Timed out waiting ...
  for recv operation", "Application timeout caused pair closure", "NCCL
  communicator was aborted", the NCCL watchdog's timeout, ``DistNetworkError``),
  a peer's desynced collective aborting this receiver (gloo's "Received data
  size doesn't match expected size"), the launcher's teardown (SIGTERM, SIGINT,
  SIGHUP; torchelastic's ``SignalException``).
* ``UNKNOWN`` — nothing above matched (a bare exit status 1, an empty message).

Each marker carries the source that emits it (``MARKERS``; the table is also in
docs/detectors.md, "The failure classifier"). The first marker that matches
decides, in table order: specific consequences, then hardware roots, then the
generic consequences, so "NCCL communicator was aborted ... Original reason for
failure was: CUDA error: an illegal memory access" is the rank's own CUDA error.

Worked example (4 ranks under torchrun; rank 1 raises in its own code)::

    rank 1: "RuntimeError: bad batch"                       -> ROOT, exception
    rank 0: "RuntimeError: [../pair.cc:534] Connection closed by peer [10.0.0.2]:
             ... typically caused by a remote worker crashing"  -> CONSEQUENCE, peer_lost
    rank 2: exit status -15 (SIGTERM from the agent)        -> CONSEQUENCE, teardown
"""

from __future__ import annotations

import enum
import re
import signal as _signal
from dataclasses import dataclass

__all__ = [
    "MARKERS",
    "Failure",
    "FailureClass",
    "Marker",
    "classify_death",
    "classify_exit",
    "classify_message",
    "classify_signal",
    "is_comm_failure",
    "is_peer_loss",
]


class FailureClass(str, enum.Enum):
    """Whose failure it is."""

    ROOT = "root"
    CONSEQUENCE = "consequence"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Marker:
    """A substring (matched case-insensitively) that classifies a failure message.

    ``comm`` is true when the message is a communication op's failure (recovery
    treats those as recoverable by re-forming the group).
    """

    text: str
    cls: FailureClass
    cause: str
    source: str
    comm: bool = True


@dataclass(frozen=True, slots=True)
class Failure:
    """A classified failure: its class, a cause word, and the marker and source that decided."""

    cls: FailureClass
    cause: str
    marker: str | None = None
    source: str | None = None
    comm: bool = False

    @property
    def is_root(self) -> bool:
        return self.cls is FailureClass.ROOT

    @property
    def is_consequence(self) -> bool:
        return self.cls is FailureClass.CONSEQUENCE

    def to_json(self) -> dict[str, object]:
        return {"class": self.cls.value, "cause": self.cause, "marker": self.marker,
                "source": self.source}


_C, _R = FailureClass.CONSEQUENCE, FailureClass.ROOT
_GLOO = "gloo/transport/tcp/"
_NCCL_ERR = "NCCL src/init.cc:ncclGetErrorString"

#: Consequence markers that name their cause precisely: checked first.
_SPECIFIC: tuple[Marker, ...] = (
    Marker("connection closed by peer", _C, "peer_lost",
           f"{_GLOO}pair.cc:554 Pair::read (EOF on the peer's socket); tls/pair.cc:201"),
    Marker("typically caused by a remote worker crashing", _C, "peer_lost",
           f"{_GLOO}pair.cc:557 Pair::read"),
    Marker("connection reset by peer", _C, "peer_lost",
           f"strerror(ECONNRESET) in {_GLOO}pair.cc:538 \"Read error\" / pair.cc:339 \"writev\""),
    Marker("broken pipe", _C, "peer_lost",
           f"strerror(EPIPE) in {_GLOO}pair.cc:339 \"writev\""),
    Marker("socket unexpectedly closed", _C, "peer_lost",
           f"{_GLOO}pair.cc:201 Pair::setSync"),
    Marker("remote process exited or there was a network error", _C, "peer_lost",
           f"{_NCCL_ERR} (ncclRemoteError, init.cc:3430)"),
    Marker("ncclremoteerror", _C, "peer_lost", "NCCL nccl.h ncclResult_t ncclRemoteError"),
    Marker("distnetworkerror", _C, "peer_lost",
           "torch/csrc/distributed/c10d/exception.h C10D_NETWORK_ERROR (TCPStore lost its "
           "peer; torch.distributed.DistNetworkError)"),
    Marker("received data size doesn't match expected size", _C, "desync",
           f"{_GLOO}pair.cc:459 Pair::prepareRead GLOO_ENFORCE_LE (a peer sent another "
           "size: EnforceNotMet, then std::terminate/SIGABRT)"),
    Marker("application timeout caused pair closure", _C, "aborted",
           f"{_GLOO}unbound_buffer.cc:76,127 (another op of this context timed out)"),
    Marker("signalexception", _C, "teardown",
           "torch/distributed/elastic/multiprocessing/api.py _terminate_process_handler "
           "(the launcher's SIGTERM/SIGINT)"),
)

#: The rank's own hardware failure.
_HARDWARE: tuple[Marker, ...] = (
    Marker("device-side assert", _R, "exception",
           "c10/cuda/CUDAException.h C10_CUDA_CHECK (a kernel's assert: the program's "
           "own indexing)", comm=False),
    Marker("cuda out of memory", _R, "oom",
           "c10/cuda/CUDACachingAllocator.cpp (torch.OutOfMemoryError)", comm=False),
    Marker("unhandled cuda error", _R, "hardware", f"{_NCCL_ERR} (ncclUnhandledCudaError, "
           "init.cc:3420)"),
    Marker("unhandled system error", _R, "hardware", f"{_NCCL_ERR} (ncclSystemError, "
           "init.cc:3422)"),
    Marker("internal error - please report", _R, "hardware", f"{_NCCL_ERR} (ncclInternalError, "
           "init.cc:3424)"),
    Marker("cuda error", _R, "hardware", "c10/cuda/CUDAException.h C10_CUDA_CHECK", comm=False),
    Marker("ecc error", _R, "hardware", "CUDA cudaErrorECCUncorrectable", comm=False),
    Marker("xid", _R, "hardware", "NVIDIA driver Xid event", comm=False),
)

#: Consequences whose words are generic: checked after the hardware roots.
_GENERIC: tuple[Marker, ...] = (
    Marker("nccl communicator was aborted", _C, "aborted",
           "torch/csrc/distributed/c10d/NCCLUtils.cpp NCCLComm::getNcclComm (the "
           "communicator was aborted after an error or timeout)"),
    Marker("watchdog caught collective operation timeout", _C, "timeout",
           "torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp WorkNCCL::checkTimeout"),
    Marker("timed out waiting", _C, "timeout",
           f"{_GLOO}unbound_buffer.cc:79,130 \"Timed out waiting <ms>ms for recv/send "
           "operation to complete\""),
    Marker("operation timed out!", _C, "timeout",
           "ProcessGroupGloo work.wait(timeout) (measured, docs/recovery.md)"),
    Marker("read timeout", _C, "timeout", f"{_GLOO}pair.cc:523 Pair::read"),
    Marker("write timeout", _C, "timeout", f"{_GLOO}pair.cc:314 Pair::write"),
)

MARKERS: tuple[Marker, ...] = _SPECIFIC + _HARDWARE + _GENERIC
"""Every marker, in the order they are tried."""

_UNKNOWN = Failure(FailureClass.UNKNOWN, "unknown")

# "TypeName: text" or "pkg.TypeName: text", as the recorder writes an exception
_EXC = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|NotMet|Warning))\b")

#: Signals the launcher sends when it tears the job down (a peer failed first).
_TEARDOWN = frozenset({_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP})
#: Signals of a process that crashed in native code.
_CRASH = frozenset({_signal.SIGSEGV, _signal.SIGBUS, _signal.SIGILL, _signal.SIGFPE,
                    _signal.SIGABRT})


def classify_message(message: str, *, exc_type: str | None = None) -> Failure:
    """Classify an exception's (or a failed op's) text; ``exc_type`` is its class name.

    A message no marker matches is the rank's own ``exception`` when it is an
    exception (``exc_type`` given, or the text starts ``TypeName:``), else unknown.
    """
    text = f"{exc_type}: {message}" if exc_type else message
    low = text.lower()
    for marker in MARKERS:
        if marker.text in low:
            return Failure(marker.cls, marker.cause, marker.text, marker.source, marker.comm)
    if "nccl error" in low:
        return Failure(FailureClass.UNKNOWN, "comm_error", "nccl error",
                       "torch/csrc/distributed/c10d/NCCLUtils.hpp C10D_NCCL_CHECK", comm=True)
    name = exc_type or (m.group(1) if (m := _EXC.match(text)) else None)
    if name is not None:
        short = name.rsplit(".", 1)[-1]
        if short == "KeyboardInterrupt":
            return Failure(_C, "teardown", "KeyboardInterrupt", "SIGINT (the launcher's or "
                           "an operator's Ctrl-C)")
        if short in ("DistError", "DistBackendError", "DistStoreError"):
            return Failure(FailureClass.UNKNOWN, "comm_error", short,
                           "torch/csrc/distributed/c10d/exception.h", comm=True)
        return Failure(_R, "exception", None, "raised in the rank's own code")
    return _UNKNOWN


def classify_death(kind: str, message: str) -> Failure:
    """Classify a dump's death record (``DeathInfo.kind``, ``.message``).

    ``exception``: by its message. ``exit``: the process left with ops
    unfinished, its own doing (root, ``exit``). ``signal``: by the signal named
    in the message. Anything else: by its message, else unknown.
    """
    if kind == "exception":
        got = classify_message(message)
        return got if got.cls is not FailureClass.UNKNOWN or got.cause != "unknown" else \
            Failure(_R, "exception", None, "raised in the rank's own code")
    if kind == "exit":
        got = classify_message(message)
        return got if got.cls is not FailureClass.UNKNOWN else \
            Failure(_R, "exit", None, "the process exited with ops unfinished")
    if kind == "signal":
        for sig in _signal.Signals:
            if sig.name in message:
                return classify_signal(int(sig))
    return classify_message(message)


def classify_signal(signum: int) -> Failure:
    """A process ended by signal ``signum``."""
    try:
        name = _signal.Signals(signum).name
    except ValueError:
        return _UNKNOWN
    if signum == _signal.SIGKILL:
        return Failure(_R, "killed", name, "SIGKILL: the OOM killer, an operator or a lost "
                       "node; no exception, no dump")
    if signum in _CRASH:
        return Failure(_R, "crash", name, "the process crashed in native code")
    if signum in _TEARDOWN:
        return Failure(_C, "teardown", name, "torch/distributed/elastic/agent/server/api.py: "
                       "the agent stops every worker once one failed")
    return Failure(FailureClass.UNKNOWN, "signal", name, None)


def classify_exit(code: int) -> Failure:
    """A process's exit status: negative (``subprocess``: -signal) or 128+signal
    (shells) means a signal; 0 is no failure; other codes are unknown."""
    if code < 0:
        return classify_signal(-code)
    if code > 128 and code - 128 in {int(s) for s in _signal.Signals}:
        return classify_signal(code - 128)
    if code == 0:
        return Failure(FailureClass.UNKNOWN, "none")
    return Failure(FailureClass.UNKNOWN, "exit_status", str(code), None)


def is_peer_loss(message: str) -> bool:
    """True when ``message`` says the transport lost a peer (it died or left)."""
    return classify_message(message).cause == "peer_lost"


def is_comm_failure(message: str, *, exc_type: str | None = None) -> bool:
    """True when ``message`` is a communication op's failure (peer lost, timeout,
    abort, NCCL error), not the program's own exception."""
    return classify_message(message, exc_type=exc_type).comm
