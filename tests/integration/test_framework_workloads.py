"""The framework corpus as tests: jobs written with Lightning, transformers and accelerate.

Each case runs one of scripts/workloads/{lightning_ddp,hf_trainer,accelerate_loop}.py
under ``torchrun --standalone`` (4 ranks, gloo, CPU, the recorder on) with one fault
planted on rank 1 through the framework's own hooks (a Lightning ``Callback``, a
transformers ``TrainerCallback``, the accelerate loop), including faults that set off
the framework's own error handling (Lightning raising on a ``None`` training step, its
teardown after an exception; a local early stop). Both dump sets — the recorder's and
PyTorch's flight recorder's — must give the right verdict (run_corpus.judge).

Marker ``frameworks`` (deselected by default); needs ``pip install -e .[frameworks]``
and fails, not skips, without it. ``.ci/run``'s framework stage runs the CI set
(``run_corpus.FRAMEWORK_CI_CASES``: ``-m "frameworks and not corpus"``); ``-m frameworks``
runs every case (about 20 s per case on 2 cores, a hang about 30 s).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

_RUNNER = Path(__file__).resolve().parents[2] / "scripts" / "workloads" / "run_corpus.py"
_spec = importlib.util.spec_from_file_location("frf_run_corpus_fw", _RUNNER)
assert _spec is not None and _spec.loader is not None
corpus: Any = importlib.util.module_from_spec(_spec)
sys.modules["frf_run_corpus_fw"] = corpus
_spec.loader.exec_module(corpus)

pytestmark = [pytest.mark.frameworks]

_MODULES = {"lightning": "lightning", "hf_trainer": "transformers", "accelerate": "accelerate"}

#: Verdicts wrong in some runs, with the cause (never strict: they turn on races in
#: gloo and the launcher). Measured on torch 2.13.0 (docs/workloads.md, "The framework
#: corpus"). Lightning's exit/kill from PyTorch's dumps where every survivor's failed
#: barrier was retired are named since the runner has the recorder save PyTorch's dumps
#: with their stacks (FRFORENSICS_NATIVE_STACKS=1, as its own default dump) and the
#: survivors are read as stopped inside one call (docs/detectors.md). Lightning's exit
#: where a slower rank was terminated in the middle of _sync_ddp while the others went
#: one op on (CI, 6 December) names rank 1 alone since consequences.torn_down_mid_call.
WRONG_TODAY: dict[tuple[str, str, str], str] = {}


def _params() -> list[Any]:
    ci = set(corpus.FRAMEWORK_CI_CASES)
    out = []
    for case in corpus.cases("frameworks"):
        base: list[Any] = [] if (case.workload, case.fault) in ci else [pytest.mark.corpus]
        for source in corpus.SOURCES:
            marks = list(base)
            wrong = WRONG_TODAY.get((case.workload, case.fault, source))
            if wrong:
                marks.append(pytest.mark.xfail(strict=False, reason=wrong))
            out.append(pytest.param(case, source, marks=marks, id=f"{case.id}-{source}"))
    return out


@pytest.fixture(scope="module")
def job_runs() -> dict[str, Any]:
    """Each case's job, run once for both dump sources."""
    return {}


@pytest.mark.timeout(420)
@pytest.mark.parametrize(("case", "source"), _params())
def test_framework_job_verdict_names_the_planted_rank(
        case: Any, source: str, job_runs: dict[str, Any],
        tmp_path_factory: pytest.TempPathFactory) -> None:
    module = _MODULES[case.workload]
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"{module} is not installed: pip install -e '.[frameworks]'")
    if case.id not in job_runs:
        out = tmp_path_factory.mktemp(case.id)
        run = corpus.run_case(case, sys.executable, out, checkout=False)
        job_runs[case.id] = (run, corpus.split_sources(run.dump_dir, out / case.id))
    run, sets = job_runs[case.id]
    dumps = sorted(p.name for p in sets[source].iterdir())
    rc, report, err = corpus.analyze(sets[source], corpus.BY_NAME[case.workload].nproc)
    j = corpus.judge(case, source, rc, report, err)
    assert j.right, (
        f"{case.id} ({source}): {j.why}; status {j.status}, exit {j.rc}, culprits {j.culprits}, "
        f"actions {j.actions}, findings {j.kinds}; headline: {j.headline[:300]}; "
        f"dumps {dumps}; job exit {run.returncode} after {run.wall_s:.0f} s; log tail: "
        f"{run.log[-800:]}")
