"""Hostile and broken inputs through the real CLI: bounded, one line, verdict kept.

Every case of ``hostile_corpus`` runs ``fr-analyze DIR --format json`` in its
own process (forked from one warm subprocess, ``fork_runner.py``) with its
address space capped at 1.5 GiB and a 30 s alarm: it must exit 0-2 with no
traceback, and where the four good ranks sit beside the bad thing their verdict
(hang, culprit rank 2) must not change. The time and peak RSS of every case
are written to ``$FRFORENSICS_HOSTILE_STATS`` when set (docs/security.md
quotes the worst).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import hostile_corpus
import pytest

# a forked, capped fr-analyze per hostile case: minutes of CPU (slow lane)
pytestmark = pytest.mark.slow

ADDRESS_SPACE = int(1.5 * (1 << 30))
TIMEOUT_S = 30
RUNNER = Path(__file__).with_name("fork_runner.py")


def run_cases(cases: dict[str, dict[str, Any]], tmp: Path) -> dict[str, dict[str, Any]]:
    """Every case through ``fork_runner.py``: one subprocess, one capped child per case."""
    spec = tmp / "cases.json"
    results = tmp / "results.json"
    spec.write_text(json.dumps(cases))
    env = {**os.environ, "HOSTILE_AS_BYTES": str(ADDRESS_SPACE), "HOSTILE_TIMEOUT_S": str(TIMEOUT_S)}
    subprocess.run([sys.executable, str(RUNNER), str(spec), str(results)], check=True,
                   timeout=TIMEOUT_S * len(cases), env=env, stdin=subprocess.DEVNULL)
    out: dict[str, dict[str, Any]] = json.loads(results.read_text())
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("hostile")
    cases = hostile_corpus.build(root / "corpus")
    assert sorted(cases) == sorted(hostile_corpus.CASE_NAMES)
    spec = {name: {"args": [*(c.args or [str(c.path)]), "--format", "json"], "env": c.env}
            for name, c in cases.items()}
    spec["__baseline__"] = {"args": [str(hostile_corpus.GOOD), "--format", "json"], "env": {}}
    results = run_cases(spec, root)
    stats = os.environ.get("FRFORENSICS_HOSTILE_STATS")
    if stats:
        size = sum(f.stat().st_size for f in (root / "corpus").rglob("*")
                   if f.is_file() and not f.is_symlink())
        Path(stats).write_text(json.dumps({
            "cases": len(cases), "corpus_bytes": size,
            "runs": {k: {x: v[x] for x in ("exit", "seconds", "peak_rss_mib")}
                     for k, v in results.items()}}, indent=1))
    return results


@pytest.fixture(scope="module")
def baseline(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    run = runs["__baseline__"]
    assert run["exit"] == 1, run["stderr"]
    report: dict[str, Any] = json.loads(run["stdout"])
    assert report["status"] == "hang" and report["culprit_ranks"] == [2]
    return report


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", hostile_corpus.CASE_NAMES)
def test_hostile_input_is_bounded_and_keeps_the_verdict(
    name: str, runs: dict[str, dict[str, Any]], baseline: dict[str, Any]
) -> None:
    run = runs[name]
    assert "Traceback" not in run["stderr"], run["stderr"]
    assert run["exit"] in (0, 1, 2), run["stderr"]
    assert run["seconds"] < TIMEOUT_S
    report = json.loads(run["stdout"])
    if hostile_corpus.KEEPS_VERDICT.get(name, True):
        assert report["status"] == baseline["status"], report["load_problems"]
        assert report["culprit_ranks"] == baseline["culprit_ranks"]
        assert set(hostile_corpus.GOOD_RANKS) <= set(report["ranks_loaded"])
        assert [f["kind"] for f in report["findings"]] == [
            f["kind"] for f in baseline["findings"]]
    assert run["peak_rss_mib"] < hostile_corpus.MAX_RSS_MIB
    for problem in report["load_problems"]:
        assert "\n" not in problem["error"]
    if name in hostile_corpus.EXPECTED_PROBLEM:
        expected = hostile_corpus.EXPECTED_PROBLEM[name]
        errors = [p["error"] for p in report["load_problems"]]
        if expected is None:
            assert errors == []
        else:
            assert any(expected in e for e in errors), errors
