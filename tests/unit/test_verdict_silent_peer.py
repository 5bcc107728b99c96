"""A half-dead peer never holds the verdict (issue 28 item 6), over a real TCPStore.

Four ranks published their dumps as ``_publish`` does (digest, then ``dumped``
record, then ``n`` and ``ranks``), from the real ``missing_rank`` sample (rank 2
skipped a collective). Rank 3 is half-dead: its record claims a digest that never
arrives, or that vanishes as the elected rank reads it. The elected rank's store
client has a 20 s timeout, where a ``get``/``multi_get``/``wait`` of a missing key
blocks (``check`` answers at once). The verdict must come within its own input
deadline from what did arrive, rank 3 listed in ``inputs`` as skipped.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
import types
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

dist = pytest.importorskip("torch.distributed")

from frforensics.formats import frdump  # noqa: E402
from frforensics.recorder._config import RecorderConfig  # noqa: E402
from frforensics.recorder._tail import tail_bytes  # noqa: E402
from frforensics.recorder._verdict import VerdictAgent  # noqa: E402

SAMPLE = Path(__file__).resolve().parents[2] / "sample_dumps" / "missing_rank" / "frdump"
STORE_TIMEOUT_S = 20.0  # a get of a missing key blocks this long
POLL_S = 0.2  # store poll: the late-digest grace is two polls (0.4 s)
NS = "frforensics/0"
SILENT = "rank 3: digest missing (its record claims one)"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Job:
    """A master TCPStore, the elected rank's client (its agent) and a peer's client."""

    def __init__(self, tmp: Path, world: int = 4) -> None:
        port = _port()
        self.master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)

        def client() -> Any:
            return dist.PrefixStore(NS, dist.TCPStore(
                "127.0.0.1", port, is_master=False,
                timeout=timedelta(seconds=STORE_TIMEOUT_S)))

        self.store, self.peer = client(), client()
        self.world = world
        self.dump_dir = tmp / "dumps"
        self.dump_dir.mkdir()
        self.work = tmp / "work"
        self.work.mkdir()
        config = RecorderConfig.build(self.dump_dir, store_poll_interval_s=POLL_S,
                                      verdict_source="store", store_timeout_s=STORE_TIMEOUT_S)
        self.errors: list[str] = []
        rec = types.SimpleNamespace(
            config=config, namespace=NS, rank=0, world_size=world, store=self.store,
            flag_key="dump_flag", note_error=lambda what, exc: self.errors.append(f"{what}: {exc}"))
        self.agent = VerdictAgent(rec, None)  # type: ignore[arg-type]

    def publish(self, r: int, *, digest: bool = True) -> None:
        """Rank ``r``'s dump, announced as ``VerdictAgent._publish`` does it."""
        trace = frdump.decode((SAMPLE / f"frdump_rank_{min(r, 3)}").read_bytes())
        # more ranks than the sample has: rank 3's trace under their number
        blob = tail_bytes(dataclasses.replace(trace, rank=r) if r > 3 else trace)
        if digest:
            self.peer.set(f"verdict/0/digest/{r}", blob)
        self.peer.set(f"verdict/0/dumped/{r}", json.dumps({
            "rank": r, "host": "node", "pid": 100 + r, "path": f"/nowhere/frdump_rank_{r}",
            "size": 1, "mtime_ns": 1, "reason": "watchdog_timeout", "digest": True,
            "digest_bytes": len(blob)}))
        self.peer.add("verdict/0/n", 1)
        self.peer.append("verdict/0/ranks", f"{r},")


class _Vanishing:
    """The elected rank's store, where rank 3 deletes one of its keys (through its
    own client) the moment the elected rank reads it, after it was seen present."""

    def __init__(self, job: _Job, key: str) -> None:
        self.inner, self.peer, self.key, self.done = job.store, job.peer, key, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _read(self, keys: list[str]) -> None:
        if not self.done and self.key in keys:
            self.done = True
            self.peer.delete_key(self.key)

    def get(self, key: str) -> Any:
        self._read([key])
        return self.inner.get(key)

    def multi_get(self, keys: list[str]) -> Any:
        self._read(list(keys))
        return self.inner.multi_get(keys)

    def compare_set(self, key: str, expected: Any, desired: Any) -> Any:
        self._read([key])
        return self.inner.compare_set(key, expected, desired)


class _Slow:
    """The elected rank's store answering every call ``latency_s`` late (a loaded
    store host): the reads, not the peers, would hold the verdict."""

    def __init__(self, inner: Any, latency_s: float) -> None:
        self.inner, self.latency_s = inner, latency_s

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.inner, name)

        def slow(*args: Any) -> Any:
            time.sleep(self.latency_s)
            return call(*args)

        return slow


def _timed_inputs(job: _Job, store: Any) -> tuple[float, dict[str, Any]]:
    t0 = time.monotonic()
    _, inputs = job.agent._inputs(0, store, job.world, job.work)
    return time.monotonic() - t0, inputs


@pytest.mark.timeout(60)
def test_a_digest_its_record_claims_but_never_written_is_skipped_after_the_grace(
        tmp_path: Path) -> None:
    job = _Job(tmp_path)
    for r in range(3):
        job.publish(r)
    job.publish(3, digest=False)  # half-dead: the record says digest=True
    elapsed, inputs = _timed_inputs(job, job.store)
    assert elapsed < 2 * POLL_S + 1.5, elapsed  # the grace, never the 20 s store timeout
    assert inputs == {"files": [], "digests": [0, 1, 2], "none": [3], "skipped": [SILENT]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("key", "note"), [
    ("verdict/0/digest/3", SILENT),
    ("verdict/0/dumped/3", "rank 3: dumped record missing (its rank is listed)")])
def test_a_key_that_vanishes_as_it_is_read_costs_only_that_rank(
        tmp_path: Path, key: str, note: str) -> None:
    job = _Job(tmp_path)
    for r in range(4):
        job.publish(r)
    assert job.store.check([key])
    elapsed, inputs = _timed_inputs(job, _Vanishing(job, key))
    assert elapsed < 2 * POLL_S + 1.5, elapsed
    assert inputs == {"files": [], "digests": [0, 1, 2], "none": [3], "skipped": [note]}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_slow_store_cannot_hold_the_collection_past_its_deadline(tmp_path: Path) -> None:
    world, latency = 24, 0.15  # 49 reads: 7.4 s of store time
    job = _Job(tmp_path, world=world)
    for r in range(world):
        job.publish(r)
    limit = 2 * POLL_S + 3.0 + 0.001 * world  # the grace, 3 s and 1 ms per rank of reads
    elapsed, inputs = _timed_inputs(job, _Slow(job.store, latency))
    assert elapsed < limit + 2 * latency + 0.5, (elapsed, limit)
    assert job.agent._collect_limit() == pytest.approx(limit)
    late = [int(n.split(":")[0].removeprefix("rank ")) for n in inputs["skipped"]]
    assert all(n.endswith(f"not read within the verdict's {limit:g} s input deadline")
               for n in inputs["skipped"]), inputs
    # the ranks before the cut are whole, those after it are named; none is lost
    assert inputs["digests"] and late and max(inputs["digests"]) < min(late), inputs
    assert sorted(inputs["digests"] + late) == list(range(world)), inputs
    assert inputs["none"] == late


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag", [True, False], ids=["flag", "no-flag-key"])
def test_the_verdict_comes_from_the_digests_that_arrived_and_names_the_silent_rank(
        tmp_path: Path, flag: bool) -> None:
    """The whole elected-rank path (``_lead``: inputs, the analysis child, the store
    key) and a follower that learns the verdict from the key; with the incident's
    flag key in the store or not (its compare_set failed): never a blocking read."""
    job = _Job(tmp_path)
    for r in range(3):
        job.publish(r)
    job.publish(3, digest=False)  # half-dead: the record says digest=True
    if flag:
        job.peer.set("dump_flag", json.dumps({"rank": 2, "time_ns": time.time_ns()}))
    follower = _Job.__new__(_Job)
    follower.__dict__.update(job.__dict__)
    follower.store = dist.PrefixStore(NS, dist.TCPStore(
        "127.0.0.1", job.master.port, is_master=False, timeout=timedelta(seconds=STORE_TIMEOUT_S)))
    rec1 = types.SimpleNamespace(**{**vars(job.agent.rec), "rank": 1, "store": follower.store})
    agent1 = VerdictAgent(rec1, None)  # type: ignore[arg-type]
    inc1 = agent1._incident(0)
    thread = threading.Thread(target=agent1._follow, daemon=True,
                              args=(inc1, follower.store, 1, 4, time.monotonic() + 1000))
    thread.start()
    inc = job.agent._incident(0)
    t0 = time.monotonic()
    job.agent._lead(inc, job.store, 4)
    elapsed = time.monotonic() - t0
    thread.join(30)
    verdict = inc.verdict
    assert verdict is not None
    assert elapsed < STORE_TIMEOUT_S - 5, elapsed  # inputs in 0.4 s, the rest is the analysis
    assert verdict["error"] is None, verdict
    assert verdict["headline"].startswith("HANG — missing_rank: Rank 2 never entered"), verdict
    # rank 2 as in a clean run; rank 3, whose dump was never read, a missing dump to inspect
    actions = {a["rank"]: (a["action"], a["because"]) for a in verdict["actions"]}
    assert actions == {2: ("fix_code", "missing_rank"), 3: ("inspect", "missing_dump")}, actions
    assert verdict["inputs"] == {"files": [], "digests": [0, 1, 2], "none": [3],
                                 "skipped": [SILENT]}
    assert (verdict["seconds_after_flag"] is not None) is flag
    assert json.loads(job.master.get(f"{NS}/verdict/0")) == verdict
    assert inc1.verdict == verdict  # the follower heard it
    assert not job.errors
