"""Run the real-workload corpus and judge fr-analyze's verdict on each run.

    python scripts/workloads/run_corpus.py [--torch-python PATH] [--subset ci|all]
        [--only WORKLOAD[:FAULT]] [--out DIR] [--table FILE]

For every case (workload × fault) the job runs once under ``torchrun --standalone``
(gloo, CPU) with the recorder on; its dump directory then gives two dump sets:
``ours`` (the recorder's ``frdump_rank_*``) and ``native`` (PyTorch's own flight
recorder, saved by the recorder as ``nccl_trace_rank_*``). ``fr-analyze --format
json`` runs on each (the analyzer of this checkout, ``src/`` first on the path) and
the verdict is judged against the planted fault:

* healthy: exit 0 and no culprit;
* a fault: ``culprit_ranks`` is exactly the planted rank and that rank's action is
  one the fault allows (``EXPECTED_ACTIONS``);
* where the dumps hold no trace of the fault (``NO_TRACE``: PyTorch's gloo recorder
  does not record send/recv), an abstention — no culprit, and either a non-healthy
  status or a note saying what could not be seen — counts as right.

Prints (and with ``--table`` writes) a markdown table and the counts; exit status 0
when every verdict is right, 1 otherwise. The pieces (``CASES``, ``run_case``,
``analyze``, ``judge``) are what tests/integration/test_real_workloads.py uses.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SRC = REPO / "src"

COLLECTIVE_FAULTS = ("none", "hang", "skip", "op", "size", "exit", "kill", "raise", "slow")
PIPELINE_FAULTS = ("none", "hang", "exit", "kill", "raise", "slow", "stop_send")
FRAMEWORK_FAULTS = ("none", "hang", "exit", "kill", "raise", "slow", "stop")
MOE_FAULTS = ("none", "splits", "hang", "kill")
SOURCES = ("ours", "native")


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    script: str
    nproc: int
    faults: tuple[str, ...]


WORKLOADS = (
    Workload("ddp", "ddp.py", 4, COLLECTIVE_FAULTS),
    Workload("fsdp2", "fsdp2.py", 4, COLLECTIVE_FAULTS),
    Workload("tp", "tp.py", 4, COLLECTIVE_FAULTS),
    Workload("dp_tp", "dp_tp.py", 4, COLLECTIVE_FAULTS),
    Workload("pipeline", "pipeline.py", 4, PIPELINE_FAULTS),
    Workload("dp_tp8", "dp_tp.py", 8, ("none", "hang")),
    Workload("moe", "moe.py", 4, MOE_FAULTS),
    # jobs written with the frameworks people use (the `frameworks` extra)
    Workload("lightning", "lightning_ddp.py", 4, (*FRAMEWORK_FAULTS, "none_return")),
    Workload("hf_trainer", "hf_trainer.py", 4, FRAMEWORK_FAULTS),
    Workload("accelerate", "accelerate_loop.py", 4, FRAMEWORK_FAULTS),
)
FRAMEWORKS = frozenset({"lightning", "hf_trainer", "accelerate"})
BY_NAME = {w.name: w for w in WORKLOADS}

#: The CI-sized core set (a few minutes on 2 cores): one of each kind of fault.
CI_CASES = (
    ("ddp", "none"), ("ddp", "hang"), ("ddp", "raise"), ("ddp", "size"),
    ("tp", "none"), ("fsdp2", "kill"), ("pipeline", "stop_send"), ("moe", "splits"),
)

#: The framework stage's set (CI): each framework, a healthy run and faults that set off
#: the framework's own error handling.
FRAMEWORK_CI_CASES = (
    ("lightning", "none"), ("lightning", "exit"), ("lightning", "none_return"),
    ("hf_trainer", "raise"), ("hf_trainer", "stop"), ("accelerate", "kill"),
    ("accelerate", "none"),
)

#: The action(s) a culprit may be given for each fault (docs/detectors.md, "What to
#: do about a culprit"; issue 19: an exception in the program's code -> fix_code, a
#: death without an exception -> replace_gpu_or_host).
EXPECTED_ACTIONS: dict[str, frozenset[str]] = {
    "hang": frozenset({"fix_code", "inspect"}),
    "skip": frozenset({"fix_code"}),
    "op": frozenset({"fix_code"}),
    "size": frozenset({"fix_code"}),
    "exit": frozenset({"replace_gpu_or_host", "inspect"}),
    "kill": frozenset({"replace_gpu_or_host"}),
    "raise": frozenset({"fix_code"}),
    "slow": frozenset({"replace_gpu_or_host", "inspect"}),
    "stop_send": frozenset({"fix_code", "inspect"}),
    "stop": frozenset({"fix_code", "inspect"}),
    "none_return": frozenset({"fix_code"}),
    "splits": frozenset({"fix_code"}),
}

#: PyTorch's own dumps record no death and no exception (docs/native-format.md): from
#: them a dead or raising rank is only "missing" or "never entered", and ``inspect``
#: is an honest action too.
NATIVE_ACTIONS: dict[str, frozenset[str]] = {
    "raise": frozenset({"fix_code", "inspect"}),
    "kill": frozenset({"replace_gpu_or_host", "inspect"}),
    "exit": frozenset({"replace_gpu_or_host", "inspect"}),
    "none_return": frozenset({"fix_code", "inspect"}),
}

#: (workload, fault, source) whose dumps hold no trace of the fault: PyTorch's gloo
#: recorder records no send/recv (torch-2.13-facts.md), and a pipeline fault happens
#: between p2p ops; an abstention is right there.
NO_TRACE = {("pipeline", f, "native") for f in ("hang", "slow", "stop_send", "exit", "kill",
                                                 "raise")}

#: A note that says the dumps cannot show point-to-point traffic.
ABSTAIN_NOTE = re.compile(r"\b(send|recv|p2p|point-to-point)\b", re.I)


@dataclass(frozen=True, slots=True)
class Case:
    workload: str
    fault: str
    fault_rank: int = 1

    @property
    def id(self) -> str:
        return f"{self.workload}-{self.fault}"


def cases(subset: str) -> list[Case]:
    """The CI set, or every case ordered fault by fault (each fault on every workload)."""
    if subset == "ci":
        return [Case(w, f) for w, f in CI_CASES]
    if subset == "frameworks-ci":
        return [Case(w, f) for w, f in FRAMEWORK_CI_CASES]
    order = {f: i for i, f in enumerate(dict.fromkeys(f for w in WORKLOADS for f in w.faults))}
    every = [Case(w.name, f) for w in WORKLOADS for f in w.faults
             if (subset == "frameworks") == (w.name in FRAMEWORKS) or subset == "all"]
    return sorted(every, key=lambda c: order[c.fault])


@dataclass
class Run:
    case: Case
    dump_dir: Path
    returncode: int | None
    wall_s: float
    log: str


@dataclass
class Judged:
    case: Case
    source: str
    rc: int
    status: str
    culprits: list[int]
    actions: dict[int, str]
    kinds: list[str]
    right: bool
    why: str
    headline: str = ""
    extra: dict[str, object] = field(default_factory=dict)


def run_case(case: Case, torch_python: str, out: Path, *, checkout: bool = True,
             deadline_s: float = 8.0, pg_timeout_s: float = 15.0,
             hard_kill_s: float = 150.0) -> Run:
    """One torchrun job; the whole process tree is killed after ``hard_kill_s``.

    ``checkout``: the job imports frforensics from this checkout's ``src/`` (else
    from wherever ``torch_python`` finds it: the installed package)."""
    w = BY_NAME[case.workload]
    dump_dir = out / case.id / "dumps"
    if dump_dir.exists():
        shutil.rmtree(dump_dir)
    dump_dir.mkdir(parents=True)
    env = dict(os.environ)
    env.update({
        "FRFORENSICS_ENABLE": "1",
        "FRFORENSICS_DUMP_DIR": str(dump_dir),
        "FRFORENSICS_TIMEOUT_S": str(deadline_s),
        "FRFORENSICS_STORE_POLL_INTERVAL_S": "0.5",
        "FRFORENSICS_DUMP_ON_EXIT": "always",
        # PyTorch's dumps as PyTorch's own default writes them (with stacks): what
        # a user brings (docs/workloads.md, "The dump sources")
        "FRFORENSICS_NATIVE_STACKS": "1",
        "FRFORENSICS_VERDICT": "0",
        "WL_PG_TIMEOUT_S": str(pg_timeout_s),
        "WL_HARD_EXIT_S": str(hard_kill_s + 5),
        "OMP_NUM_THREADS": "1",
    })
    if checkout:
        env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [torch_python, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={w.nproc}", str(HERE / w.script),
           "--fault", case.fault, "--fault-rank", str(case.fault_rank)]
    log_path = out / case.id / "job.log"
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = _wait(proc, dump_dir, hard_kill_s, quiet_s=2 * pg_timeout_s)
        finally:
            _kill_tree(proc)
    return Run(case, dump_dir, rc, time.monotonic() - t0,
               log_path.read_text(errors="replace")[-4000:])


def _wait(proc: subprocess.Popen[bytes], dump_dir: Path, hard_kill_s: float,
          quiet_s: float) -> int | None:
    """The job's exit status; None when it was still running after ``hard_kill_s``, or
    when nothing changed in its dump directory for ``quiet_s`` after the first dump
    of an unfinished job (a 2-D job whose peers never time out: no more evidence is
    coming, and gloo's timeout has passed twice)."""
    start = time.monotonic()
    last_change, last_state = start, None
    while True:
        try:
            return proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if now - start > hard_kill_s:
            return None
        state = sorted((f.name, f.stat().st_mtime_ns) for f in dump_dir.iterdir())
        if state != last_state:
            last_change, last_state = now, state
        elif state and now - last_change > quiet_s:
            return None


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the launcher and every process under it (torchrun's workers may sit in
    sessions of their own), by pid."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def split_sources(dump_dir: Path, dest: Path) -> dict[str, Path]:
    """Copy the dump set of each source into its own directory."""
    out = {}
    for source, prefix in (("ours", "frdump_rank_"), ("native", "nccl_trace_rank_")):
        d = dest / source
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        for f in sorted(dump_dir.iterdir()):
            if f.name.startswith(prefix) and f.name[len(prefix):].isdigit():
                shutil.copy(f, d / f.name)
        out[source] = d
    return out


def analyze(dumps: Path, world_size: int) -> tuple[int, dict[str, object] | None, str]:
    """``fr-analyze DUMPS --format json`` of this checkout (its ``main``, in this process:
    one import of the analyzer for the whole corpus); (exit code, report or None, stderr)."""
    from frforensics.cli import main as fr_analyze

    argv = ["analyze", str(dumps), "--format", "json", "--world-size", str(world_size),
            "--no-progress", "--jobs", "1"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            fr_analyze(argv)
            rc = 0
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 3
    try:
        report = json.loads(out.getvalue())
    except ValueError:
        report = None
    return rc, report, err.getvalue().strip()[-2000:]


def judge(case: Case, source: str, rc: int, report: dict[str, object] | None,
          stderr: str = "") -> Judged:
    if report is None:
        return Judged(case, source, rc, "-", [], {}, [], False,
                      f"no report (exit {rc}): {stderr.splitlines()[-1] if stderr else ''}")
    culprits = sorted(int(r) for r in report.get("culprit_ranks", []))  # type: ignore[union-attr]
    actions = {int(a["rank"]): str(a["action"]) for a in report.get("actions", [])}  # type: ignore[union-attr]
    findings = report.get("findings", []) or []
    kinds = [str(f["kind"]) for f in findings]  # type: ignore[index]
    status = str(report.get("status"))
    headline = str(findings[0]["message"]) if findings else ""  # type: ignore[index]
    base = dict(case=case, source=source, rc=rc, status=status, culprits=culprits,
                actions=actions, kinds=kinds, headline=headline)
    if case.fault == "none":
        ok = rc == 0 and not culprits
        return Judged(**base, right=ok, why="healthy" if ok else "healthy job flagged")
    want = case.fault_rank
    if culprits == [want]:
        allowed = (NATIVE_ACTIONS.get(case.fault) if source == "native" else None) \
            or EXPECTED_ACTIONS[case.fault]
        act = actions.get(want, "-")
        if act in allowed:
            return Judged(**base, right=True, why="planted rank")
        return Judged(**base, right=False,
                      why=f"planted rank, but action {act} (want {'/'.join(sorted(allowed))})")
    if not culprits and (case.workload, case.fault, source) in NO_TRACE:
        notes = [str(n) for n in report.get("notes", []) or []]  # type: ignore[union-attr]
        if status != "healthy" or any(ABSTAIN_NOTE.search(n) for n in notes):
            return Judged(**base, right=True, why="abstains (no trace in these dumps)")
        return Judged(**base, right=False, why="silent: healthy, no note that p2p is unseen")
    if not culprits:
        return Judged(**base, right=False, why=f"no culprit (status {status})")
    extra = [r for r in culprits if r != want]
    if want in culprits:
        return Judged(**base, right=False, why=f"planted rank plus victims {extra}")
    return Judged(**base, right=False, why=f"wrong rank(s) {extra}")


def table(judged: list[Judged], version: str) -> str:
    lines = [f"torch {version}", "",
             "| workload | fault | source | status | exit | culprits | action | findings | verdict | why |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for j in judged:
        act = ", ".join(f"{r}:{a}" for r, a in sorted(j.actions.items())) or "-"
        kinds = ",".join(dict.fromkeys(j.kinds)) or "-"
        lines.append(f"| {j.case.workload} | {j.case.fault} | {j.source} | {j.status} | {j.rc} | "
                     f"{j.culprits or '-'} | {act} | {kinds} | "
                     f"{'right' if j.right else '**WRONG**'} | {j.why} |")
    right = sum(j.right for j in judged)
    lines += ["", f"right {right} / {len(judged)} (wrong {len(judged) - right})"]
    for s in SOURCES:
        sub = [j for j in judged if j.source == s]
        if sub:
            lines.append(f"- {s}: right {sum(j.right for j in sub)} / {len(sub)}")
    return "\n".join(lines) + "\n"


def torch_version(py: str) -> str:
    p = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                       capture_output=True, text=True, timeout=120)
    return p.stdout.strip() or "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--torch-python", default=sys.executable,
                    help="the Python whose torch runs the jobs (default: this one)")
    ap.add_argument("--subset", choices=("ci", "all", "core", "frameworks", "frameworks-ci"),
                    default="ci", help="ci: the core set; core: every case of PyTorch's own "
                    "APIs; frameworks(-ci): Lightning, transformers, accelerate; all: both")
    ap.add_argument("--only", action="append", default=[],
                    help="WORKLOAD or WORKLOAD:FAULT (repeatable)")
    ap.add_argument("--out", type=Path, default=None, help="keep dumps and logs here")
    ap.add_argument("--table", type=Path, default=None, help="also write the table here")
    ap.add_argument("--jsonl", type=Path, default=None, help="append one JSON line per verdict")
    ap.add_argument("--resume", action="store_true",
                    help="skip cases already in --jsonl for this torch version")
    ap.add_argument("--reanalyze", action="store_true",
                    help="run no job: judge the dumps kept under --out again (after an "
                         "analyzer change; seconds for the whole corpus)")
    a = ap.parse_args()
    sys.path.insert(0, str(SRC))  # the analyzer of this checkout
    todo = cases("all" if a.only else a.subset)
    if a.only:
        keep = [o.split(":") for o in a.only]  # in the order given
        todo = [c for k in keep for c in todo
                if c.workload == k[0] and (len(k) == 1 or c.fault == k[1])]
    out = a.out or Path(tempfile.mkdtemp(prefix="frf-corpus-"))
    version = torch_version(a.torch_python)
    if a.resume and a.jsonl and a.jsonl.exists():
        done = set()
        for line in a.jsonl.read_text().splitlines():
            r = json.loads(line)
            if r["torch"] == version:
                done.add((r["workload"], r["fault"]))
        todo = [c for c in todo if (c.workload, c.fault) not in done]
    judged: list[Judged] = []
    for case in todo:
        if a.reanalyze:
            if not (out / case.id / "dumps").is_dir():
                continue
            run = Run(case, out / case.id / "dumps", None, 0.0, "")
        else:
            run = run_case(case, a.torch_python, out)
        sets = split_sources(run.dump_dir, out / case.id)
        for source in SOURCES:
            rc, report, err = analyze(sets[source], BY_NAME[case.workload].nproc)
            j = judge(case, source, rc, report, err)
            judged.append(j)
            line = (f"{case.id:22s} {source:6s} job={run.returncode} {run.wall_s:5.1f}s "
                    f"exit={j.rc} {j.status:9s} culprits={j.culprits} "
                    f"{'right' if j.right else 'WRONG'}: {j.why}")
            print(line, flush=True)
            if a.jsonl:
                with open(a.jsonl, "a") as fh:
                    fh.write(json.dumps({
                        "torch": version, "workload": case.workload, "fault": case.fault,
                        "source": source, "job_rc": run.returncode, "wall_s": round(run.wall_s, 1),
                        "rc": j.rc, "status": j.status, "culprits": j.culprits,
                        "actions": j.actions, "kinds": j.kinds, "right": j.right, "why": j.why,
                        "headline": j.headline[:400], "dir": str(out / case.id)}) + "\n")
    text = table(judged, version)
    print(text)
    if a.table:
        a.table.write_text(text)
    return 0 if all(j.right for j in judged) else 1


if __name__ == "__main__":
    sys.exit(main())
