"""The analyzer's side of issue 12: a claimed world size costs what the dumps cost.

The reader accepts world sizes up to ``Limits.max_rank`` (2^20): a job that
size is rare but real. Four dumps that *say* ``world_size`` = 2^20 once made
``merge.py`` build ``tuple(range(world))`` and every pass walk it (> 300 s and
1.4 GB). The world is now sparse (``frforensics.rankset``): these tests hold
that, and that a real, listable world still names every rank without a dump.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from frforensics.analyzer import AnalyzeOptions, analyze, load_dumps
from frforensics.formats import decode_dump, frdump
from frforensics.formats.limits import DEFAULT_LIMITS
from frforensics.rankset import LISTED_RANKS_FLOOR, RankSet

GOOD = Path(__file__).resolve().parents[1] / "data" / "native" / "missing_rank" / "pickle"
RUNNER = Path(__file__).with_name("fork_runner.py")


def _claiming(tmp_path: Path, name: str, world_size: int | None, *,
              members: int = 0, desc: str = "default_pg") -> Path:
    """The four ``missing_rank`` dumps as frdumps that claim ``world_size``
    (with ``members``, their group lists that many members, described ``desc``)."""
    folder = tmp_path / name
    folder.mkdir()
    for f in sorted(GOOD.iterdir()):
        rank = int(f.name.rsplit("_", 1)[1])
        trace = decode_dump(f.read_bytes(), source=str(f), rank_hint=rank)
        trace = replace(trace, header=replace(trace.header, world_size=world_size))
        if members:
            trace = replace(trace, groups=tuple(replace(g, desc=desc, ranks=tuple(range(members)))
                                                for g in trace.groups))
        (folder / f"frdump_rank_{rank}").write_bytes(frdump.encode(trace))
    return folder


def _run_capped(tmp_path: Path, cases: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """Each case through ``fork_runner.py``: 1.5 GiB of address space, 15 s."""
    spec = tmp_path / "cases.json"
    results = tmp_path / "results.json"
    spec.write_text(json.dumps({name: {"args": args} for name, args in cases.items()}))
    env = {**os.environ, "HOSTILE_AS_BYTES": str(int(1.5 * (1 << 30))), "HOSTILE_TIMEOUT_S": "15"}
    subprocess.run([sys.executable, str(RUNNER), str(spec), str(results)], check=True,
                   timeout=120, env=env, stdin=subprocess.DEVNULL)
    out: dict[str, dict[str, Any]] = json.loads(results.read_text())
    return out


@pytest.mark.slow  # seconds of CPU: the slow lane
def test_claimed_world_size_costs_per_rank_seen(tmp_path: Path) -> None:
    folder = _claiming(tmp_path, "d", DEFAULT_LIMITS.max_rank)
    run = _run_capped(tmp_path, {"claimed": [str(folder), "--format", "json"]})["claimed"]
    assert run["exit"] in (0, 1, 2), (run["exit"], run["stderr"][-500:])


@pytest.mark.slow  # seconds of CPU: the slow lane
def test_claimed_world_of_2_20_costs_what_its_four_dumps_cost(tmp_path: Path) -> None:
    claimed = _claiming(tmp_path, "claimed", DEFAULT_LIMITS.max_rank)
    plain = _claiming(tmp_path, "plain", None)
    runs = _run_capped(tmp_path, {"plain": [str(plain), "--format", "json"],
                                  "claimed": [str(claimed), "--format", "json"]})
    for name, run in runs.items():
        assert run["exit"] == 1, (name, run["exit"], run["stderr"][-500:])
    # both children fork from one warm parent: the claim may add little memory
    assert runs["claimed"]["peak_rss_mib"] <= runs["plain"]["peak_rss_mib"] + 32, runs
    plain_doc, doc = (json.loads(runs[n]["stdout"]) for n in ("plain", "claimed"))
    # the same root cause, and the unnamed silent ranks as one bounded statement
    assert doc["status"] == plain_doc["status"] == "hang"
    assert doc["culprit_ranks"] == plain_doc["culprit_ranks"] == [2]
    assert doc["world_size"] == DEFAULT_LIMITS.max_rank
    assert doc["ranks_missing"] is None
    assert doc["ranks_missing_count"] == DEFAULT_LIMITS.max_rank - 4
    assert doc["ranks_missing_ranges"] == [[4, DEFAULT_LIMITS.max_rank - 1]]
    silent = [f for f in doc["findings"] if f["kind"] == "missing_dump"]
    assert len(silent) == 1
    assert silent[0]["severity"] == "error" and silent[0]["culprit_ranks"] == []
    assert silent[0]["waiting_ranks"] == [0, 1, 3]
    assert silent[0]["evidence"]["silent_count"] == DEFAULT_LIMITS.max_rank - 4
    assert silent[0]["pg"]["ranks"] is None
    assert silent[0]["pg"]["ranks_count"] == DEFAULT_LIMITS.max_rank
    assert [a["rank"] for a in doc["actions"]] == [2]


def test_listable_world_still_names_every_rank_without_a_dump() -> None:
    # 4 dumps of a 4096-rank job: 4092 ranks left no dump, few enough to list
    # (rankset.listable): each is named a culprit, as before the world became sparse
    dumps = load_dumps([GOOD])
    report = analyze(dumps, options=AnalyzeOptions(world_size=4096))
    assert report.exit_code == 1
    assert report.status.value == "hang"
    assert report.ranks_missing == tuple(range(4, 4096))
    assert report.culprit_ranks == (2, *range(4, 4096))
    kinds = [(f.kind.value, f.severity.value, f.culprit_ranks) for f in report.findings]
    assert kinds[0] == ("missing_rank", "error", (2,))
    # one finding for the ranks waited on in the same op (it was one per rank:
    # 4092 findings, each listing the default group's 4096 members)
    assert kinds[1:] == [("missing_dump", "error", tuple(range(4, 4096)))]
    assert all(f.waiting_ranks == (0, 1, 3) for f in report.findings)
    assert report.findings[1].pg is not None
    assert report.findings[1].pg.ranks == tuple(range(4096))
    assert report.to_json()["ranks_missing"] == list(range(4, 4096))


def test_just_past_the_listing_bound_the_silent_ranks_become_one_finding() -> None:
    dumps = load_dumps([GOOD])
    size = LISTED_RANKS_FLOOR + 5  # 4 dumps: LISTED_RANKS_FLOOR + 1 without one
    report = analyze(dumps, options=AnalyzeOptions(world_size=size))
    assert report.exit_code == 1
    assert report.culprit_ranks == (2,)
    assert isinstance(report.ranks_missing, RankSet)
    assert list(report.ranks_missing) == list(range(4, size))
    silent = [f for f in report.findings if f.kind.value == "missing_dump"]
    assert [(f.severity.value, f.culprit_ranks) for f in silent] == [("error", ())]
    assert silent[0].evidence["silent_ranges"] == [[4, size - 1]]
    assert f"4-{size - 1}" in silent[0].message


@pytest.mark.parametrize(("desc", "world_size"), [("default_pg", DEFAULT_LIMITS.max_rank),
                                                   ("tp", 4)])
@pytest.mark.slow  # seconds of CPU: the slow lane
def test_group_listing_2_20_members_is_held_as_ranges(desc: str, world_size: int,
                                                     tmp_path: Path) -> None:
    # frdump writes an arithmetic member list as three numbers: a 4 KB dump can
    # list 2^20 members — as the world, or beyond a world of 4 — and the
    # analyzer must not name each one
    folder = _claiming(tmp_path, "listed", world_size, members=DEFAULT_LIMITS.max_rank, desc=desc)
    assert max(f.stat().st_size for f in folder.iterdir()) < 16_384
    run = _run_capped(tmp_path, {"listed": [str(folder), "--format", "json"]})["listed"]
    assert run["exit"] == 1, (run["exit"], run["stderr"][-500:])
    doc = json.loads(run["stdout"])
    assert doc["culprit_ranks"] == [2]
    if world_size == 4:
        assert doc["ranks_missing"] == []
    else:
        assert doc["ranks_missing_count"] == DEFAULT_LIMITS.max_rank - 4
    silent = [f for f in doc["findings"] if f["kind"] == "missing_dump"]
    assert [(f["severity"], f["culprit_ranks"]) for f in silent] == [("error", [])]
    assert silent[0]["pg"]["ranks_ranges"] == [[0, DEFAULT_LIMITS.max_rank - 1]]
    assert silent[0]["evidence"]["silent_count"] == DEFAULT_LIMITS.max_rank - 4
