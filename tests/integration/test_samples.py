"""Every sample in ``sample_dumps/`` gets the verdict written by hand in its
``expected.json`` (from what ``scripts/make_samples.py`` did, never from the
analyzer's output), through the real CLI: ``fr-analyze DIR --format json``.

Each sample has the recorder's dumps (``frdump/``) and, where PyTorch's own
recorder could produce them, PyTorch's native dumps (``native/``, with their own
expectation under ``"native"``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# one fr-analyze process per sample and check (slow lane); the fast loop checks every
# sample's report byte for byte in one process (test_sample_reports.py)
pytestmark = pytest.mark.slow

SAMPLES = Path(__file__).resolve().parents[2] / "sample_dumps"
KINDS = sorted(p.name for p in SAMPLES.iterdir() if (p / "expected.json").exists()) \
    if SAMPLES.exists() else []

# Known gaps, each a strict xfail: it turns into a failure the day it is fixed.
VERDICT_GAPS: dict[tuple[str, str], str] = {}
LOCATION_GAPS: dict[tuple[str, str], str] = {}


def _cases() -> list[Any]:
    out = []
    for kind in KINDS:
        expected = json.loads((SAMPLES / kind / "expected.json").read_text())
        out.append(pytest.param(kind, "frdump", expected, id=f"{kind}-frdump"))
        if expected.get("native") and (SAMPLES / kind / "native").is_dir():
            out.append(pytest.param(kind, "native", expected["native"], id=f"{kind}-native"))
    return out


def _analyze(path: Path) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "frforensics", str(path), "--format", "json", "--world-size", "4"],
        capture_output=True, text=True, timeout=120, check=False)
    try:
        return proc.returncode, json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(f"no JSON (exit {proc.returncode}): {proc.stderr[-2000:]}") from None


def _finding(report: dict[str, Any], kind: str) -> dict[str, Any]:
    found = [f for f in report["findings"] if f["kind"] == kind]
    assert found, f"no {kind} finding: {[f['kind'] for f in report['findings']]}"
    return found[0]


def test_every_failure_kind_has_a_sample() -> None:
    assert set(KINDS) >= {"healthy", "missing_rank", "op_mismatch", "size_mismatch",
                          "dtype_mismatch", "timeout", "dead_rank", "p2p_deadlock",
                          "cross_pg_deadlock", "straggler", "missing_dump"}
    for kind in KINDS:
        readme = (SAMPLES / kind / "README.md").read_text()
        assert "scripts/make_samples.py" in readme and "fr-analyze" in readme


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("kind", "variant", "expected"), _cases())
def test_sample_gets_the_expected_verdict(kind: str, variant: str, expected: dict[str, Any],
                                          request: pytest.FixtureRequest) -> None:
    gap = VERDICT_GAPS.get((kind, variant))
    if gap:
        request.applymarker(pytest.mark.xfail(reason=gap, strict=True))
    code, report = _analyze(SAMPLES / kind / variant)
    assert report["status"] == expected["status"], report
    assert code == (1 if expected["status"] in ("hang", "desync") else 0)
    assert report["load_problems"] == []
    if expected["kind"] is None:
        assert report["culprit_ranks"] == [] and report["findings"] == []
        return
    want = expected["culprit_ranks"]
    assert sorted(report["culprit_ranks"][:len(want)]) == sorted(want), report["culprit_ranks"]
    finding = _finding(report, expected["kind"])
    assert sorted(finding["culprit_ranks"]) == sorted(want), finding
    errors = [f for f in report["findings"] if f["severity"] == "error"]
    top = errors[0] if errors else report["findings"][0]
    assert top["kind"] == expected["kind"], [f["kind"] for f in report["findings"]]
    for rank in expected.get("missing_dumps", []):
        assert rank in report["ranks_missing"]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("kind", "variant", "expected"), _cases())
def test_sample_finding_names_the_group_and_seq(kind: str, variant: str,
                                                expected: dict[str, Any],
                                                request: pytest.FixtureRequest) -> None:
    if expected["kind"] is None or expected.get("group") is None:
        pytest.skip("no group to locate (healthy)")
    gap = LOCATION_GAPS.get((kind, variant))
    if gap:
        request.applymarker(pytest.mark.xfail(reason=gap, strict=True))
    _, report = _analyze(SAMPLES / kind / variant)
    finding = _finding(report, expected["kind"])
    assert finding["pg"] is not None, finding
    assert finding["pg"]["name"] == expected["group"]["name"], finding["pg"]
    assert finding["pg"]["ranks"] == expected["group"]["ranks"], finding["pg"]
    if expected["seq"] is not None:
        assert (finding["seq"], finding["seq_kind"]) == (expected["seq"], expected["seq_kind"])
        assert finding["op"] == expected["op"]
    for group in expected.get("groups", []):
        names = {(g["name"], tuple(g["ranks"])) for g in finding["evidence"]["groups"]}
        assert (group["name"], tuple(group["ranks"])) in names, finding["evidence"]
