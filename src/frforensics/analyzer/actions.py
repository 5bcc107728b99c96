"""``actions``: what an orchestrator should do about each culprit rank.

Rule (docs/detectors.md, "What to do about a culprit"): each culprit rank takes
the action of the first finding that names it, findings in the report's order
(errors first, root causes first):

* ``replace_gpu_or_host`` — the fault is below the program, so excluding the
  GPU or host helps: a ``timeout`` where every member entered the collective
  (a kernel, NCCL or the network hung below the framework), a ``dead_rank`` that
  died without an exception (no dump: SIGKILL, the OOM killer, a lost node), a
  ``straggler`` (persistently late; the detector only reports persistent ones),
  unless it was judged from enqueue times taking the hosts' clocks to agree
  (PyTorch's gloo dumps): a clock running ahead shows the same, so ``inspect``.
* ``fix_code`` — the program itself is wrong, and the same code on new hardware
  hangs again: ``op_mismatch``, ``size_mismatch``, ``dtype_mismatch``,
  ``p2p_deadlock``, ``cross_pg_deadlock``, a ``dead_rank`` that raised an
  exception in the program's own code (the detail names its line), and a ``missing_rank`` whose main
  thread was in the user's own Python code at dump time (not inside a library
  call that could be waiting on the device).
* ``inspect`` — anything else: a ``missing_rank`` blocked inside a library
  call or without a stack, a ``dead_rank`` that exited, ran out of memory, or
  whose failure is unknown or tied with another root's, a ``missing_dump``, a ``timeout`` where a member entered only after its peers
  had given up.

Worked example (4 ranks; rank 2 skipped one all_reduce and sleeps in
``train.py``)::

    missing_rank, culprit 2; rank 2's main thread innermost frame: train.py:40
    -> actions: [{rank: 2, action: fix_code, because: missing_rank, ...}]
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from frforensics.analyzer.context import Context
from frforensics.model import is_library_file
from frforensics.report import Action, Finding, FindingKind, RankFacts, code_sides

__all__ = ["action_for", "derive_actions"]

_FIX_CODE = {
    FindingKind.OP_MISMATCH: "ranks disagree at the same collective: the program's code path "
                             "differs between ranks; new hardware will not fix it",
    FindingKind.SIZE_MISMATCH: "ranks pass different sizes to the same collective: a bug in the "
                               "program; new hardware will not fix it",
    FindingKind.DTYPE_MISMATCH: "ranks pass different dtypes to the same collective: a bug in the "
                                "program; new hardware will not fix it",
    FindingKind.P2P_DEADLOCK: "sends and receives do not pair up: a bug in the program's "
                              "communication order; new hardware will not fix it",
    FindingKind.CROSS_PG_DEADLOCK: "ranks wait on each other across process groups in a cycle: "
                                   "a bug in the order of collectives; new hardware will not fix it",
}


# Installed code, not the program's own: the standard library and installed
# packages live under .../lib/pythonX.Y/ (venvs, conda, system Pythons alike).
_INSTALLED = re.compile(r"/lib/python\d+(\.\d+)?/|[/\\](site|dist)-packages[/\\]")


def _is_program_code(file: str) -> bool:
    return not (is_library_file(file) or _INSTALLED.search(file) or file.startswith("<"))


def _main_frames(ctx: Context, rank: int) -> tuple[str, bool] | None:
    """The main thread's innermost frame at dump time, and whether it is user code."""
    d = ctx.job.digests.get(rank)
    if d is None:
        return None
    for thread in d.threads:
        if thread.is_main and thread.frames:
            top = thread.frames[0]
            return str(top), _is_program_code(top.file)
    return None


def _arrived_late(finding: Finding, rank: int) -> bool:
    """A ``timeout`` whose culprit entered after its peers had given up.

    The detector's late-entry form says so in its evidence (``late_entry``, or
    ``late_by_s``); otherwise the states tell: the waiting members' ops
    ``failed`` (their timeout fired) while the culprit's did not, or every
    member is in the same state and the detector still told the culprit apart
    (``distinguishable``) — which only arrival times can do.
    """
    ev = finding.evidence
    if ev.get("late_entry") or "late_by_s" in ev:
        return True
    states = ev.get("states")
    if not isinstance(states, Mapping) or not finding.waiting_ranks:
        return False
    mine = states.get(str(rank))
    waiting = [states.get(str(r)) for r in finding.waiting_ranks]
    if mine not in (None, "failed") and all(s == "failed" for s in waiting):
        return True
    return bool(ev.get("distinguishable")) and all(s == mine for s in waiting)


def action_for(ctx: Context, finding: Finding, rank: int) -> tuple[str, str]:
    """``(action, detail)`` for culprit ``rank`` of ``finding`` (rule in the module doc)."""
    kind = finding.kind
    if kind in _FIX_CODE:
        sides = code_sides(finding)
        return "fix_code", _FIX_CODE[kind] + (f" ({'; '.join(sides)})" if sides else "")
    if kind is FindingKind.MISSING_RANK:
        main = _main_frames(ctx, rank)
        if main is None:
            return "inspect", "never entered the collective; its main thread's stack is unknown"
        where, in_user_code = main
        if in_user_code:
            return "fix_code", (f"never entered the collective: its main thread was running the "
                                f"program's own Python code at {where}")
        return "inspect", (f"never entered the collective: its main thread was inside a library "
                           f"call at {where} (it may be waiting on the device)")
    if kind is FindingKind.TIMEOUT:
        if _arrived_late(finding, rank):
            return "inspect", ("entered the collective only after its peers had given up: "
                               "slow to get there, not stuck in it")
        return "replace_gpu_or_host", ("every member entered the collective and it never "
                                       "completed: the hang is below the framework (kernel, "
                                       "NCCL, network, device)")
    if kind is FindingKind.DEAD_RANK:
        return _dead_rank_action(finding)
    if kind is FindingKind.STRAGGLER:
        if finding.evidence.get("clocks") == "assumed_to_agree":
            return "inspect", ("persistently arrives last at collectives, judged from enqueue "
                               "times only: its host's clock running "
                               f"{finding.evidence.get('alternative_clock_offset_ms')} ms ahead "
                               "would show the same; check that clock before replacing anything")
        return "replace_gpu_or_host", "persistently arrives last at collectives"
    return "inspect", f"{kind.value}: nothing more specific is known"


# failures.py cause -> (action, detail) for the root of a crash cascade
_BY_CAUSE = {
    "hardware": ("replace_gpu_or_host", "its own hardware error ({what}): the device or host "
                 "failed, not the program"),
    "killed": ("replace_gpu_or_host", "killed without an exception ({what}: the OOM killer, "
               "an operator, a lost node)"),
    "crash": ("replace_gpu_or_host", "crashed in native code ({what})"),
    "no_dump": ("replace_gpu_or_host", "died without an exception and left no dump (killed: "
                "SIGKILL, the OOM killer, os._exit, a lost node)"),
    "oom": ("inspect", "ran out of device memory ({what}): the batch, the model or a leak; "
            "new hardware of the same size will not fix it"),
    "exit": ("inspect", "exited with ops unfinished: read why the program left"),
}


def _dead_rank_action(finding: Finding) -> tuple[str, str]:
    """The root of a crash cascade: the action follows its failure's class
    (``frforensics.failures``; rule in docs/detectors.md, "Crash cascades")."""
    ev = finding.evidence
    if ev.get("tied"):
        return "inspect", (f"failed of its own at the same time as rank(s) {ev['tied']}: "
                           "which came first cannot be told; read both ranks' logs")
    failure = ev.get("failure")
    death = ev.get("death")
    if not isinstance(failure, Mapping):  # a report from before the classifier
        if death is None:
            return "replace_gpu_or_host", ("died without an exception and left no dump "
                                           "(killed: SIGKILL, the OOM killer, a lost node)")
        return "inspect", "died: read its dump's traceback"
    cause = str(failure.get("cause"))
    what = failure.get("marker") or cause
    if cause == "exception":
        where = f" at {finding.location}" if finding.location else ""
        return "fix_code", (f"raised an exception in the program's own code{where}: "
                            f"{(death or {}).get('message', '')[:200]}")
    if cause in _BY_CAUSE:
        action, detail = _BY_CAUSE[cause]
        return action, detail.format(what=what)
    return "inspect", f"failed ({cause}): its failure could not be classified; read its logs"


def derive_actions(ctx: Context, findings: Sequence[Finding], culprits: Sequence[int],
                   facts: Mapping[int, RankFacts]) -> tuple[Action, ...]:
    """One :class:`Action` per culprit rank, in ``culprits`` order."""
    out: list[Action] = []
    for rank in culprits:
        finding = next((f for f in findings if rank in f.culprit_ranks), None)
        if finding is None:
            continue
        action, detail = action_for(ctx, finding, rank)
        fact = facts.get(rank)
        out.append(Action(
            rank=rank,
            action=action,
            because=finding.kind.value,
            detail=detail,
            host=None if fact is None else fact.host,
            local_rank=None if fact is None else fact.local_rank,
            cuda_device=None if fact is None else fact.cuda_device,
            gpu_uuid=None if fact is None else fact.gpu_uuid,
            pci_bus_id=None if fact is None else fact.pci_bus_id,
        ))
    return tuple(out)
