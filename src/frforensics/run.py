"""``frforensics-run``: torchrun whose agent keeps the survivors alive for recovery.

    frforensics-run --nproc-per-node 4 [--spares 1] train.py ...   # torchrun's arguments

Built on torch's own elastic agent, not a process manager of its own: the
arguments are torchrun's (``torch.distributed.run.get_args_parser``, then
``run(args)``: ``config_from_args`` and ``elastic_launch``), and
``torch.distributed.launcher.api.launch_agent`` builds :class:`RecoveringAgent`,
a ``LocalElasticAgent`` that overrides one method, ``_monitor_workers``.

Why: torchrun's ``LocalElasticAgent._monitor_workers`` polls its
``SubprocessContext``, whose ``_poll`` closes every worker as soon as one exited
non-zero (``torch/distributed/elastic/multiprocessing/api.py``,
``SubprocessContext._poll``: "if ALL procs are finished or ANY have failed:
self.close()"); ``SimpleElasticAgent._invoke_run`` then restarts or fails the
whole group. So a rank that dies takes the survivors with it while they wait for
the verdict.

What the agent does instead, once the job called ``recovery.setup()`` (store key
``frforensics/recovery/setup``; before that, and for jobs that never call it,
it is torchrun's monitor unchanged):

- it polls each worker's process itself (``proc.poll()``, nothing is closed); a
  worker that exits non-zero is recorded in the job's store
  (``exit/<rank>``: exit code, signal, host, pid) and logged, and the others keep
  running. The survivors' recovery reads it: a SIGKILL (the OOM killer, or the
  host) is a ``replace_gpu_or_host`` verdict at once; every record is evidence in
  the verdict (``recovery._agents._agent_verdict``);
- a survivor whose recovery refused or failed sets ``gave_up``: the agent then
  returns ``FAILED`` and torchrun's own code stops the workers and fails the job
  (or restarts it, ``--max-restarts``), as torchrun would;
- every local worker gone: ``SUCCEEDED`` when at least one exited 0 and each of
  the others was excluded by a recovery (exit 79, or no longer a member), else
  ``FAILED``;
- ``--spares K``: K standby processes per node, started with the workers (same
  command, ``FRFORENSICS_STANDBY=1``, a member id of their own past the world,
  ``WORLD_SIZE`` = that id + 1 so ``init_process_group`` works on the agent's
  store), waiting in ``recovery.standby()``; when a recovery admits one, the agent
  watches it as a worker and starts a new standby. Started with torch's own
  ``SubprocessHandler``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from typing import Any

from frforensics.recovery import EXIT_EXCLUDED  # no torch: recovery imports it lazily

__all__ = ["main"]

log = logging.getLogger("frforensics.run")

#: How long an excluded worker that has not exited (frozen, stuck) is left before SIGKILL.
EXCLUDED_GRACE_S = 5.0
#: How long a standby may take to notice the job finished and exit 0 on its own.
STANDBY_GRACE_S = 15.0


def _say(message: str) -> None:
    print(f"[frforensics-run {socket.gethostname()}] {message}", file=sys.stderr, flush=True)


def _agent_class(spares: int) -> type:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        SubprocessHandler,
    )
    from torch.distributed.elastic.utils import macros  # type: ignore[attr-defined]

    from frforensics import recovery

    class RecoveringAgent(LocalElasticAgent):
        """torch's LocalElasticAgent whose monitor lets the survivors recover."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._job_store: Any = None
            self._recovering_job = False
            self._exits: dict[int, int] = {}         # member id -> exit code
            self._standbys: dict[int, Any] = {}      # member id -> SubprocessHandler
            self._admitted: dict[int, Any] = {}      # standbys that became workers
            self._members: list[int] | None = None
            self._excluded_since: dict[int, float] = {}
            self._killed: set[int] = set()

        # ------------------------------------------------------------ workers
        def _start_workers(self, worker_group: Any) -> dict[int, Any]:
            pids: dict[int, Any] = super()._start_workers(worker_group)
            self._exits.clear()
            self._excluded_since.clear()
            self._killed.clear()
            self._recovering_job = False
            self._job_store = None
            self._members = None
            for _ in range(spares):
                self._start_standby(worker_group)
            return pids

        def _job(self, worker_group: Any) -> Any:
            if self._job_store is None:
                raw = TCPStore(worker_group.master_addr, worker_group.master_port,
                               is_master=False, timeout=timedelta(seconds=30))
                restart = worker_group.spec.max_restarts - self._remaining_restarts
                self._job_store = recovery.job_store(raw, str(restart))
            return self._job_store

        def _start_standby(self, worker_group: Any) -> None:
            spec = worker_group.spec
            store = self._job(worker_group)
            world = worker_group.workers[0].world_size
            member = world + int(store.add("standby_seq", 1)) - 1
            local = spec.local_world_size + len(self._standbys) + len(self._admitted)
            env = {
                "RANK": str(member), "WORLD_SIZE": str(member + 1),
                "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(spec.local_world_size),
                "GROUP_RANK": str(worker_group.group_rank),
                "MASTER_ADDR": worker_group.master_addr,
                "MASTER_PORT": str(worker_group.master_port),
                "TORCHELASTIC_USE_AGENT_STORE": str(spec.rdzv_handler.use_agent_store),
                "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
                "TORCHELASTIC_RESTART_COUNT": str(spec.max_restarts - self._remaining_restarts),
                recovery.ENV_STANDBY: "1", recovery.ENV_JOB_WORLD: str(world),
                recovery.ENV_RUN: "1",
            }
            args = tuple(macros.substitute(list(spec.args), str(local)))
            kw: dict[str, Any] = {"entrypoint": spec.entrypoint, "args": args, "env": env,
                                  "stdout": None, "stderr": None, "local_rank_id": local}
            try:
                handler = SubprocessHandler(**kw, numa_options=getattr(spec, "numa_options",
                                                                       None))
            except TypeError:  # torch < 2.15: no NUMA options
                handler = SubprocessHandler(**kw)
            self._standbys[member] = handler
            _say(f"standby started: member id {member} (pid {handler.proc.pid})")

        def _close_standbys(self, grace_s: float = 0.0) -> None:
            # At a job's successful end the standbys learn it from the store (every
            # member closed its Recovery) and exit 0 themselves: give them grace_s.
            end = time.monotonic() + grace_s
            while any(h.proc.poll() is None for h in self._standbys.values()) \
                    and time.monotonic() < end:
                time.sleep(0.05)
            for member, handler in [*self._standbys.items(), *self._admitted.items()]:
                if handler.proc.poll() is None:
                    if grace_s:
                        _say(f"standby {member} did not exit within {grace_s:g} s of the "
                             "job's end; stopping it")
                    handler.close()
            for handler in list(self._standbys.values()) + list(self._admitted.values()):
                try:
                    handler.proc.wait(10)
                except Exception:
                    handler.close(death_sig=signal.SIGKILL)
            self._standbys.clear()
            self._admitted.clear()

        def _stop_workers(self, worker_group: Any) -> None:
            self._close_standbys()
            super()._stop_workers(worker_group)

        def _shutdown(self, *args: Any, **kwargs: Any) -> None:
            self._close_standbys()
            super()._shutdown(*args, **kwargs)

        # ------------------------------------------------------------ monitor
        def _monitor_workers(self, worker_group: Any) -> Any:
            pc = self._pcontext
            handlers = getattr(pc, "subprocess_handlers", None)
            if not handlers:
                return super()._monitor_workers(worker_group)
            store = None
            try:
                store = self._job(worker_group)
                if not self._recovering_job:
                    self._recovering_job = bool(store.check(["setup"]))
            except Exception as exc:  # the store is gone: torchrun's view decides
                log.debug("frforensics-run: store unreachable: %s", exc)
            if not self._recovering_job or store is None:
                return super()._monitor_workers(worker_group)
            procs = {w.global_rank: (w.local_rank, handlers[w.local_rank])
                     for w in worker_group.workers}
            self._admit(store)
            for member, handler in self._admitted.items():
                procs[member] = (-1, handler)
            for member, (_, handler) in procs.items():
                code = handler.proc.poll()
                if code is None or member in self._exits:
                    continue
                self._exits[member] = code
                if code == 0:
                    continue
                rec = recovery.exit_record(member, code, host=socket.gethostname(),
                                           pid=handler.proc.pid)
                _say(f"rank {member} exited with code {code}"
                     f"{' (' + rec['signal'] + ')' if rec['signal'] else ''}"
                     f"{'' if code == EXIT_EXCLUDED else '; the other workers keep running'}")
                try:
                    store.set(f"exit/{member}", json.dumps(rec))
                    store.add("exits", 1)
                except Exception as exc:
                    log.debug("frforensics-run: could not record the exit: %s", exc)
            gave_up = None
            try:
                if store.check(["gave_up"]):
                    gave_up = json.loads(bytes(store.get("gave_up")))
            except Exception:
                gave_up = None
            failures = {m: ProcessFailure(local_rank=max(local, 0), pid=h.proc.pid,
                                          exitcode=self._exits[m], error_file="")
                        for m, (local, h) in procs.items()
                        if self._exits.get(m, 0) != 0}
            if gave_up is not None and failures:
                _say(f"recovery gave up ({gave_up.get('kind')}: {gave_up.get('reason')}); "
                     "failing the job as torchrun would")
                return RunResult(state=WorkerState.FAILED, failures=failures)
            members = self._current(store)
            self._stop_excluded(procs, members)
            if len(self._exits) < len(procs):
                return RunResult(state=WorkerState.HEALTHY)
            real = {m: f for m, f in failures.items()
                    if f.exitcode != EXIT_EXCLUDED and (members is None or m in members)}
            if real or gave_up is not None or len(failures) == len(procs):
                return RunResult(state=WorkerState.FAILED, failures=failures or real)
            self._close_standbys(grace_s=STANDBY_GRACE_S)
            # Every worker must be named (SimpleElasticAgent._get_worker_state): the
            # excluded ones too; their exits are in the log and in the store's records.
            return RunResult(state=WorkerState.SUCCEEDED, return_values=dict.fromkeys(procs))

        def _stop_excluded(self, procs: dict[int, Any], members: list[int] | None) -> None:
            """A worker a recovery excluded that is still there (frozen: SIGSTOP, or
            stuck) gets :data:`EXCLUDED_GRACE_S` to exit 79 itself, then SIGKILL."""
            if members is None:
                return
            now = time.monotonic()
            for member, (_, handler) in procs.items():
                if member in members or member in self._exits or handler.proc.poll() is not None:
                    continue
                first = self._excluded_since.setdefault(member, now)
                if now - first >= EXCLUDED_GRACE_S and member not in self._killed:
                    self._killed.add(member)
                    _say(f"rank {member} was excluded and is still there after "
                         f"{EXCLUDED_GRACE_S:g} s: SIGKILL")
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(handler.proc.pid, signal.SIGKILL)

        def _current(self, store: Any) -> list[int] | None:
            try:
                if store.check(["current"]):
                    return [int(m) for m in json.loads(bytes(store.get("current")))["members"]]
            except Exception:
                return self._members
            return self._members

        def _admit(self, store: Any) -> None:
            """A standby that a recovery admitted becomes a worker; start a new one."""
            if not self._standbys:
                return
            members = self._current(store)
            if members is None or members == self._members:
                return
            self._members = members
            for member in [m for m in self._standbys if m in members]:
                self._admitted[member] = self._standbys.pop(member)
                _say(f"standby {member} was admitted; starting a new standby")
                self._start_standby(self._worker_group)

    return RecoveringAgent


def main(argv: list[str] | None = None) -> None:
    """torchrun's command line, with ``--spares K``; the job fails as torchrun's would."""
    try:
        from torch.distributed import run as torchrun
        from torch.distributed.elastic.multiprocessing.errors import record
        from torch.distributed.launcher import api as launcher_api
    except ImportError as exc:
        print(f"frforensics-run needs torch: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    parser = torchrun.get_args_parser()
    parser.prog = "frforensics-run"
    parser.add_argument("--spares", type=int, default=0,
                        help="warm standby processes per node (frforensics.recovery)")
    args = parser.parse_args(argv)
    if args.spares < 0:
        parser.error("--spares must be >= 0")
    # launch_agent (torch/distributed/launcher/api.py) builds the agent from this name.
    launcher_api.LocalElasticAgent = _agent_class(  # type: ignore[attr-defined,assignment]
        args.spares)
    os.environ[_env_run()] = "1"
    started = time.monotonic()
    record(torchrun.run)(args)
    log.debug("frforensics-run: done in %.1f s", time.monotonic() - started)


def _env_run() -> str:
    return "FRFORENSICS_RUN"


if __name__ == "__main__":
    main()
