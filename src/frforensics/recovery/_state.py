"""What one recovery holds: its options, its state, the errors, the verdict's sources.

The bottom of the recovery package (docs/design.md, "recovery/"): every other
module of it reads these; none of them is read here.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from frforensics.errors import FrForensicsError
from frforensics.failures import is_comm_failure
from frforensics.recovery._handover import CHUNK_BYTES, LoadStateDictFn, StateDictFn
from frforensics.verdict import Verdict

log = logging.getLogger("frforensics.recovery")

#: Recovery's keys in the job's store (``job_store``).
_NS = "frforensics/recovery/"


#: Set by frforensics-run in the standby processes it starts (``--spares``).
ENV_STANDBY = "FRFORENSICS_STANDBY"


#: The job's world size (torchrun's WORLD_SIZE), given to standbys by frforensics-run.
ENV_JOB_WORLD = "FRFORENSICS_JOB_WORLD_SIZE"


#: Set by frforensics-run in every process it starts: its agent reports exits.
ENV_RUN = "FRFORENSICS_RUN"


class RecoveryError(FrForensicsError):
    """Base of the recovery errors; ``verdicts`` holds the job verdicts involved."""

    def __init__(self, message: str,
                 verdicts: Sequence[Verdict | dict[str, Any]] = ()) -> None:
        # each verdict's JSON object (what orchestrators and logs read), and its
        # headline, made by the one rule (frforensics.verdict.headline)
        docs = [v.to_json() if isinstance(v, Verdict) else v for v in verdicts]
        heads = [str(v.get("headline", "")) for v in docs if isinstance(v, dict) and v]
        full = message + "".join(f"\n  verdict: {h}" for h in heads if h)
        super().__init__(full)
        self.reason = message
        self.verdicts = docs

    @property
    def verdict(self) -> dict[str, Any] | None:
        """The first verdict (the incident that started the recovery), if any."""
        return self.verdicts[0] if self.verdicts else None


class RecoveryUnavailable(RecoveryError):
    """This torch cannot re-form a process group (needs torch >= 2.15)."""


class RecoveryRefused(RecoveryError):
    """The verdict says excluding a rank will not help (``fix_code``) or names nobody."""


class RecoveryFailed(RecoveryError):
    """Recovery was attempted and did not complete within its bounds."""


class HandoverLost(RecoveryFailed):
    """The groups were re-formed, then a member was lost during the state hand-over
    (a sender that died mid-transfer): the members recover again, and the standbys
    that hold no state yet receive it in the next hand-over (``_reform.recover``)."""


def _torch() -> tuple[Any, Any, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    return torch, dist, c10d


def available() -> str | None:
    """None when this torch can reconfigure groups, else the one-line reason."""
    try:
        torch, _, c10d = _torch()
    except Exception as exc:  # pragma: no cover - torch missing
        return f"frforensics.recovery needs torch >= 2.15 (torch not importable: {exc})"
    if not hasattr(c10d, "_reconfigure") or not hasattr(c10d, "_get_reconfigure_handle"):
        return (f"frforensics.recovery needs torch >= 2.15 (process-group reconfigure); "
                f"this is torch {torch.__version__}")
    return None


class VerdictSource(Protocol):
    """Where a recovery gets the job's verdict when a step failed.

    ``source(timeout_s, detail)``: the verdict (a :class:`~frforensics.verdict.Verdict`,
    or its ``frforensics.verdict/1`` JSON object) within ``timeout_s`` seconds, or None when there is none (then recovery fails
    with "no verdict", never guessing whom to exclude). ``detail`` says what failed
    (``"recovery: DistBackendError: ..."``). Two come with frforensics: the
    recorder's (``frforensics.recorder.RecorderVerdicts``, the default) and
    :func:`verdict_from_dump_dir`; a plain function of the same shape is one too.
    Exceptions it raises are logged and count as no verdict.
    """

    def __call__(self, timeout_s: float, detail: str, /) -> Verdict | dict[str, Any] | None: ...


class JobRecorder(VerdictSource, Protocol):
    """What recovery tells the job's recorder, and asks it, beyond the verdict.

    ``frforensics.recorder.RecorderVerdicts`` (recorder/_source.py) is the one
    implementation; none of its methods raises.
    """

    def settle_s(self, detail: str) -> float:
        """Seconds to wait before asking for the verdict after the failure ``detail``."""
        ...

    def note_reconfigure(self, group: Any, *, uuid: int, old_members: Sequence[int],
                         members: Sequence[int], reason: str) -> None:
        """``group`` was re-formed over ``members`` (member ids)."""
        ...

    def next_incident(self) -> None:
        """A recovery ended the incident: the next hang is a new one."""
        ...


@dataclass
class Options:
    """Bounds of one recovery, in seconds."""

    verdict_timeout_s: float = 90.0
    arrival_timeout_s: float = 20.0
    reconfigure_timeout_s: float = 20.0
    check_timeout_s: float = 10.0
    exit_excluded: bool = True
    #: Where the verdict comes from (a :class:`VerdictSource`); the same as
    #: ``setup(source=...)``. None: the recorder's verdict at hang time.
    verdict_source: VerdictSource | None = None
    #: The most ranks this job may exclude over its life (None: no limit).
    max_exclusions: int | None = None
    #: Never exclude below this many survivors (standbys not counted).
    min_world_size: int = 1
    #: The member id whose process hosts the c10d store; excluding it would take the
    #: store with it. "auto": none under torchrun/frforensics-run (the agent's store,
    #: ``TORCHELASTIC_USE_AGENT_STORE=True``), else rank 0. None: the store is external.
    store_host: int | str | None = "auto"
    #: Planned exclusions (a slow GPU): every this many successful guarded steps the
    #: members agree, with one 1-element all_reduce, whether an exclusion was
    #: proposed (:func:`propose_exclusion`); 0 (default): never checked, no extra op.
    plan_check_every: int = 0
    #: The state hand-over's chunk (bytes sent per message; one such buffer per side).
    state_chunk_bytes: int = CHUNK_BYTES
    #: How long the members wait for the standbys to load the handed-over state.
    handover_timeout_s: float = 600.0


@dataclass
class _Sub:
    group: Any  # None on a process outside it
    members: list[int]  # member ids, in group-rank order


@dataclass
class _Mesh:
    """A device mesh made by ``Recovery.device_mesh``: its shape and its dims' subgroups."""

    device_type: str
    shape: tuple[int, ...]
    names: tuple[str, ...] | None
    #: per dimension, the indices in ``State.subgroups`` of its slices (in grid order)
    dims: list[list[int]]
    mesh: Any = None  # this process's DeviceMesh (built lazily on an admitted standby)


@dataclass
class State:
    """This process's view of the job's membership (``recovery.state()``)."""

    me: int
    members: list[int]
    uuid: int
    store: Any
    options: Options
    restart: str
    incident: int = 0
    spares: list[int] = field(default_factory=list)
    subgroups: list[_Sub] = field(default_factory=list)
    meshes: list[_Mesh] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    recovering: bool = False
    #: Attempts at the next membership refused so far (each refusal is seen by every
    #: member, who all count it): the next attempt's store keys are fresh
    #: (:func:`_ns`), never the refused one's verdict, plan, handles or decision.
    attempt: int = 0
    closed: bool = False
    #: Every member id this job ever had (a verdict may name no other rank).
    known: set[int] = field(default_factory=set)
    #: The member id hosting the store, None when it is outside the ranks.
    store_host: int | None = None
    #: Successful guarded steps since the last (re)configuration (the same on every member).
    steps: int = 0
    #: Planned exclusions already refused (their store value), not tried again.
    refused_plans: set[bytes] = field(default_factory=set)
    #: Where this job's verdicts come from (None: nowhere; recovery then fails).
    source: VerdictSource | None = None
    #: The job's recorder, told about re-formed groups (None: not importable).
    recorder: JobRecorder | None = None
    #: The training state's callables (torchft's shape); None: no state is handed over.
    state_dict: StateDictFn | None = None
    load_state_dict: LoadStateDictFn | None = None
    #: Called by the guard when a step failed, before the recovery: puts the model
    #: back between steps (FSDP2: the root module's ``reset_iter_state``).
    reset_step: Callable[[], None] | None = None
    #: Successful guarded steps since setup (the state version; a standby takes the
    #: sender's with its state).
    version: int = 0
    #: An admitted standby whose hand-over has not completed: it holds no training
    #: state, so it receives in the next hand-over and never sends.
    stateless: bool = False
    #: A standby admitted into the job (its subgroups and meshes are the members').
    joined: bool = False
    #: The exclusion watcher (joined by ``Recovery.close``) and the event that wakes it.
    watcher: threading.Thread | None = None
    stop: threading.Event = field(default_factory=threading.Event)


@dataclass
class Guard:
    """What one guarded step did: ``reconfigured``, and this process's new place."""

    reconfigured: bool = False
    rank: int = -1
    world_size: int = -1
    excluded: list[int] = field(default_factory=list)
    verdict: dict[str, Any] | None = None
    seconds: float = 0.0
    error: BaseException | None = None
    #: Where the recovery's seconds went: ``verdict_s`` (the failure or planned check
    #: to the agreed verdict), ``reform_s`` (arrival, decision, reconfigure, check),
    #: ``handover_s`` (the state to the standbys and the agreement; 0 without one).
    phases: dict[str, float] = field(default_factory=dict)


def _ns(uuid: int, attempt: int) -> str:
    """The store prefix of one attempt at membership ``uuid`` (``<uuid>``, then
    ``<uuid>.<k>`` after ``k`` refused attempts): a refused attempt's keys (its
    agreed verdict, plan, handles, standbys' entries, decision) are never read again."""
    return f"{uuid}" if attempt == 0 else f"{uuid}.{attempt}"


def _is_comm_failure(exc: BaseException) -> bool:
    _, dist, _ = _torch()
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        # The messages failed ops raise (the one classifier, frforensics.failures); a
        # program's own RuntimeError is not a communication failure.
        return is_comm_failure(text)
    return False


def _current_rank(st: State) -> int:
    return st.members.index(st.me) if st.me in st.members else -1


def _say(st: State, message: str) -> None:
    line = f"[frforensics.recovery rank {st.me}] {message}"
    log.info(line)
    with contextlib.suppress(Exception):
        print(line, file=sys.stderr, flush=True)


