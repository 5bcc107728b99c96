"""fr-analyze on real PyTorch 2.13 gloo dumps (tests/data/native), against verdicts
written by hand from what each capture script did (expected.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# one fr-analyze process per recorded scenario and format (slow lane)
pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[1] / "data" / "native"
SCENARIOS = sorted(p.name for p in DATA.iterdir() if (p / "expected.json").exists())


def run_json(*args: str) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run([sys.executable, "-m", "frforensics", *args, "--format", "json"],
                          capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def _matches(report: dict[str, Any], want: dict[str, Any]) -> bool:
    for f in report["findings"]:
        if f["kind"] != want["kind"] or f["severity"] != "error":
            continue
        if "pg_name" in want and (f["pg"] is None or f["pg"]["name"] != want["pg_name"]):
            continue
        if "seq" in want and f["seq"] != want["seq"]:
            continue
        if "groups" in want:
            names = {g["name"] for g in f["evidence"].get("groups", [])}
            if not set(want["groups"]) <= names:
                continue
        return sorted(f["culprit_ranks"]) == sorted(want["culprit_ranks"])
    return False


@pytest.mark.parametrize("fmt", ["pickle", "json"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_native_gloo_dumps_give_the_hand_written_verdict(scenario: str, fmt: str) -> None:
    expected = json.loads((DATA / scenario / "expected.json").read_text())
    folder = DATA / scenario / fmt
    assert folder.is_dir(), f"every recorded scenario has {fmt} dumps: {folder} is missing"
    code, report = run_json(str(folder), "--world-size", "4")
    kind = expected.get("kind")
    assert report["status"] == expected["status"], report["findings"]
    if expected["status"] == "healthy":
        assert code == 0 and report["culprit_ranks"] == [] and report["findings"] == []
        return
    if kind == "straggler":
        assert code == 0
        assert report["culprit_ranks"] == expected["culprit_ranks"]
        return
    assert code == 1
    alternatives = expected.get("acceptable") or [
        {k: expected[k] for k in ("kind", "culprit_ranks", "pg_name", "seq") if k in expected}]
    for sets in expected.get("acceptable_culprit_sets", []):
        alternatives.append({"kind": kind, "culprit_ranks": sets})
    assert any(_matches(report, alt) for alt in alternatives), report["findings"]
    named = {r for alt in alternatives for r in alt["culprit_ranks"]}
    if named:
        assert report["culprit_ranks"][0] in named
    else:  # the dumps cannot tell the root: nothing may be named
        assert report["culprit_ranks"] == []


def test_torchfrtrace_layout_with_prefix_and_no_world_size() -> None:
    code, report = run_json(str(DATA / "missing_rank" / "pickle"), "--prefix", "nccl_trace_rank_")
    assert code == 1 and report["culprit_ranks"] == [2]
    assert report["world_size"] is None
    assert any("world size unknown" in n for n in report["notes"])
