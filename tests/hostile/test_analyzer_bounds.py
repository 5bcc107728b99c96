"""Reproducers for the analyzer's side of issue 12 (lead's files), marked ``xfail(strict=True)``.

The reader accepts world sizes up to ``Limits.max_rank`` (2^20): a job that
size is rare but real. Four dumps that *say* ``world_size`` = 2^20 must still
cost what four dumps cost; today ``merge.py`` builds ``tuple(range(world))``
and every pass walks it (measured: > 300 s and 1.4 GB). When the analyzer is
sparse in the world size, the mark must go.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from frforensics.formats import decode_dump, frdump
from frforensics.formats.limits import DEFAULT_LIMITS

GOOD = Path(__file__).resolve().parents[1] / "data" / "native" / "missing_rank" / "pickle"
RUNNER = Path(__file__).with_name("fork_runner.py")


@pytest.mark.xfail(strict=True, reason="analyzer (lead): merge.py builds a dense range of the "
                   "claimed world size; 4 dumps claiming 2^20 ranks take minutes")
def test_claimed_world_size_costs_per_rank_seen(tmp_path: Path) -> None:
    folder = tmp_path / "d"
    folder.mkdir()
    for f in sorted(GOOD.iterdir()):
        rank = int(f.name.rsplit("_", 1)[1])
        trace = decode_dump(f.read_bytes(), source=str(f), rank_hint=rank)
        trace = replace(trace, world_size=DEFAULT_LIMITS.max_rank)
        (folder / f"frdump_rank_{rank}").write_bytes(frdump.encode(trace))
    spec = tmp_path / "cases.json"
    results = tmp_path / "results.json"
    spec.write_text(json.dumps({"claimed": {"args": [str(folder), "--format", "json"]}}))
    env = {**os.environ, "HOSTILE_AS_BYTES": str(int(1.5 * (1 << 30))), "HOSTILE_TIMEOUT_S": "15"}
    subprocess.run([sys.executable, str(RUNNER), str(spec), str(results)], check=True,
                   timeout=120, env=env, stdin=subprocess.DEVNULL)
    run = json.loads(results.read_text())["claimed"]
    assert run["exit"] in (0, 1, 2), (run["exit"], run["stderr"][-500:])
