"""A real 4-rank gloo job where one rank writes garbage into the store keys the elected rank reads.

Rank 1 skips a collective (the culprit); rank 3, after publishing its dump as
usual, replaces what it published with garbage: its ``dumped`` record as a JSON
list, ``digest_bytes`` of ``"lots"`` or ``1e400``, a record claiming a digest
that it then deletes, or a digest that claims rank 0 (a forged newer duplicate).
Every case: a verdict is had (not "no verdict"), it names rank 1 as a clean job's
does (rank 3, whose inputs were refused, is at most a missing dump to inspect), rank 3's inputs are skipped with exactly one log line naming rank 3, and
the verdict's ``inputs`` say so. (It lives here, not in tests/hostile/, for the
``run_job`` fixture of real jobs.)
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

DEADLINE_S = 2.0
STORE_POLL_S = 0.2
STARTUP_S = 90.0

POISON = """
import json, dataclasses
import frforensics.recorder as recorder
from frforensics.recorder import _verdict as V
from frforensics.recorder._tail import tail_bytes

ROOT = os.path.dirname(DUMP_DIR)

def save(verdict):  # atomically: the test polls for the file and reads it at once
    path = os.path.join(ROOT, f"learned_{rank}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(verdict, fh)
    os.replace(path + ".tmp", path)

recorder.add_verdict_listener(save)
if rank == 3:
    real = V.VerdictAgent._publish
    def poisoned(self, inc, trace, path):
        ok = real(self, inc, trace, path)
        store, mode = self._store(), os.environ["FRT_POISON"]
        key, digest = self._key(inc.k, "dumped", 3), self._key(inc.k, "digest", 3)
        record = json.loads(store.get(key))
        if mode == "list":
            store.set(key, "[1, 2]")
        elif mode == "lots":
            store.set(key, json.dumps({**record, "digest_bytes": "lots"}))
        elif mode == "1e400":
            store.set(key, json.dumps(record)[:-1] + ', "digest_bytes": 1e400}')
        elif mode == "digest_never_set":
            store.delete_key(digest)
        elif mode == "forged_rank_0":
            store.set(digest, tail_bytes(dataclasses.replace(trace, rank=0)))
        return ok
    V.VerdictAgent._publish = poisoned
recorder.enable(DUMP_DIR, timeout_s=float(os.environ["FRT_DEADLINE_S"]),
                store_poll_interval_s=float(os.environ["FRT_STORE_POLL_S"]),
                verdict_source="store")
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
t = torch.ones(8)
for step in range(1, 6):
    if rank == 1 and step == 3:
        continue
    dist.all_reduce(t)
time.sleep(100)
"""

EXPECTED = {"list": "dumped record is a list", "lots": "digest_bytes 'lots'",
            "1e400": "digest_bytes 'inf'", "digest_never_set": "digest missing",
            "forged_rank_0": "digest claims rank 0"}


def _learned(job: Any, rank: int) -> dict[str, Any] | None:
    path = job.dump_dir.parent / f"learned_{rank}.json"
    return json.loads(path.read_text()) if path.exists() else None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_garbage_in_one_ranks_store_keys_costs_only_that_rank(run_job: Any, mode: str) -> None:
    job = run_job(POISON, world_size=4, deadline_s=DEADLINE_S, store_poll_s=STORE_POLL_S,
                  hard_exit_s=200, env={"FRT_ENABLE": "0", "FRT_INIT": "0", "FRT_POISON": mode})
    deadline = time.monotonic() + STARTUP_S + DEADLINE_S + 20
    while _learned(job, 0) is None:
        assert time.monotonic() < deadline, f"no verdict learned\n{job.logs()}"
        time.sleep(0.2)
    verdict = _learned(job, 0)
    assert verdict is not None
    assert verdict["error"] is None, verdict
    assert verdict["elected_rank"] == 0
    # rank 1 is named as in a clean run; rank 3, whose inputs were refused, is at most
    # a missing dump to inspect (never a code fix, never a replacement)
    assert verdict["headline"].startswith("HANG — missing_rank: Rank 1 never entered"), verdict
    actions = {a["rank"]: (a["action"], a["because"]) for a in verdict["actions"]}
    assert actions[1] == ("fix_code", "missing_rank"), actions
    assert set(actions) <= {1, 3} and actions.get(3, ("inspect", "missing_dump")) == (
        "inspect", "missing_dump"), actions
    inputs = verdict["inputs"]
    assert inputs["digests"] == [0, 1, 2] and 3 in inputs["none"], inputs
    assert len(inputs["skipped"]) == 1 and inputs["skipped"][0].startswith("rank 3: "), inputs
    assert EXPECTED[mode] in inputs["skipped"][0], inputs
    log = (job.log_dir / "rank0.log").read_text(errors="replace")
    lines = [line for line in log.splitlines() if "verdict inputs skipped" in line]
    assert len(lines) == 1 and "rank 3: " in lines[0], log[-3000:]
    assert "Traceback" not in log
