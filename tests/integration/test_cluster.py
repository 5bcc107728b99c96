"""fr-analyze --dask: three workers, each reading its own folder as if it were a host.

A 64-rank job with a planted hang (rank 13 skips a tensor-parallel collective)
is spread over three folders, ``hosts/0``, ``hosts/1``, ``hosts/2`` (rank r on
host r % 3); the ``{worker}`` placeholder makes worker N read ``hosts/N`` only.
Skipped only where Dask's ``distributed`` is not installed, and never in CI
(``CI`` set), which installs it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from frforensics.analyzer import analyze, load_dumps
from frforensics.cli import main
from frforensics.report import Report
from frforensics.testing import JobBuilder

if os.environ.get("CI"):
    import cloudpickle
    import distributed  # CI installs frforensics[dask]: a missing package fails here
else:
    distributed = pytest.importorskip("distributed")
    cloudpickle = pytest.importorskip("cloudpickle")  # a dependency of distributed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORLD = 64
HOSTS = 3
PLANTED = 13


@pytest.fixture(scope="module")
def spread(tmp_path_factory: pytest.TempPathFactory) -> Path:
    job = (JobBuilder(world_size=WORLD, tp=8, dp=8, ring_size=200, seed=0).steps(20)
           .skip(rank=PLANTED, group="tp", step=18))
    root = tmp_path_factory.mktemp("cluster")
    for path in job.build().write_native(root / "all", jobs=1):
        rank = int(path.name.rsplit("_", 1)[1])
        host = root / "hosts" / str(rank % HOSTS)
        host.mkdir(parents=True, exist_ok=True)
        path.rename(host / path.name)
    return root / "hosts"


@pytest.fixture
def cluster() -> Iterator[Any]:
    """Three single-threaded worker processes named 0, 1, 2 (2 shared cores: be patient)."""
    with (distributed.LocalCluster(n_workers=HOSTS, threads_per_worker=1, processes=True,
                                   dashboard_address=None, silence_logs=40) as c,
          distributed.Client(c, set_as_default=False) as client):
        client.wait_for_workers(HOSTS, timeout=120)
        yield client


def _worker(client: Any, name: str) -> str:
    workers = client.scheduler_info(n_workers=-1)["workers"]
    return next(addr for addr, w in workers.items() if str(w["name"]) == name)


def _block_decoding() -> None:
    """Run on one worker: its decode tasks never return (a hung host, or one about to die)."""
    from frforensics.analyzer import cluster

    def blocked(*args: object) -> None:
        time.sleep(600)

    cluster._decode_here = blocked  # type: ignore[assignment]


def _fail_decoding() -> None:
    """Run on one worker: its decode tasks raise (a bug, or a bad install on that host)."""
    from frforensics.analyzer import cluster

    def broken(*args: object) -> None:
        raise RuntimeError("broken install on this host")

    cluster._decode_here = broken  # type: ignore[assignment]


def _comparable(report: Report) -> dict[str, Any]:
    doc = report.to_json()
    for facts in doc["ranks"].values():
        facts.pop("source")  # host:path on the cluster, path locally
    return doc


def test_cluster_verdict_is_the_local_verdict(spread: Path, cluster: Any) -> None:
    from frforensics.analyzer.cluster import load_dumps_dask

    seen: list[tuple[int, int]] = []
    remote = load_dumps_dask([str(spread / "{worker}")], cluster,
                             progress=lambda done, total: seen.append((done, total)))
    local = load_dumps([spread], jobs=1)
    assert remote.ranks == local.ranks == list(range(WORLD))
    assert remote.problems == []
    ours, theirs = analyze(remote), analyze(local)
    assert ours.culprit_ranks == (PLANTED,)
    assert _comparable(ours) == _comparable(theirs)
    assert seen[-1] == (WORLD, WORLD)
    # a rank's source says which host read it
    assert ours.ranks[PLANTED].source.startswith(f"{PLANTED % HOSTS}:")


def test_manifest_names_each_hosts_files_and_a_host_without_worker_is_a_load_problem(
        spread: Path, cluster: Any) -> None:
    from frforensics.analyzer.cluster import load_dumps_dask

    manifest = {str(h): sorted(str(p) for p in (spread / str(h)).iterdir()) for h in (0, 1)}
    manifest["node-gone"] = [f"/var/tmp/fr/nccl_trace_rank_{r}" for r in range(WORLD) if r % HOSTS == 2]
    dumps = load_dumps_dask([], cluster, manifest=manifest)
    lost = [r for r in range(WORLD) if r % HOSTS == 2]
    assert dumps.ranks == [r for r in range(WORLD) if r % HOSTS != 2]
    assert sorted(int(p.path.rsplit("_", 1)[1]) for p in dumps.problems) == lost
    assert all(p.path.startswith("node-gone:") and "no Dask worker runs on node-gone" in p.error
               for p in dumps.problems)
    assert list(analyze(dumps).ranks_missing) == lost


def test_killed_worker_becomes_load_problems_for_its_ranks(spread: Path, cluster: Any) -> None:
    from frforensics.analyzer.cluster import load_dumps_dask

    victim = _worker(cluster, "2")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests
    cluster.run(_block_decoding, workers=[victim])
    pid = cluster.run(os.getpid, workers=[victim])[victim]
    lost = [r for r in range(WORLD) if r % HOSTS == 2]
    killed: list[int] = []

    def progress(done: int, total: int) -> None:
        # hosts 0 and 1 are done and host 2 is stuck in its first batch: kill it mid-run
        if done >= WORLD - len(lost) and not killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    started = time.monotonic()
    dumps = load_dumps_dask([str(spread / "{worker}")], cluster, progress=progress,
                            host_deadline_s=240)
    assert killed, "the victim was killed mid-run"
    assert time.monotonic() - started < 120, "a dead worker is noticed, not waited for"
    assert dumps.ranks == [r for r in range(WORLD) if r % HOSTS != 2]
    not_read = sorted(int(p.path.rsplit("_", 1)[1]) for p in dumps.problems)
    assert not_read == lost
    assert all("left the cluster" in p.error for p in dumps.problems)
    report = analyze(dumps)
    assert list(report.ranks_missing) == lost
    assert report.exit_code in (1, 2)
    assert report.has_errors


def test_failing_tasks_cost_their_files_only(spread: Path, cluster: Any) -> None:
    from frforensics.analyzer.cluster import load_dumps_dask

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests
    cluster.run(_fail_decoding, workers=[_worker(cluster, "0")])
    dumps = load_dumps_dask([str(spread / "{worker}")], cluster, host_deadline_s=240)
    lost = [r for r in range(WORLD) if r % HOSTS == 0]
    assert dumps.ranks == [r for r in range(WORLD) if r % HOSTS != 0]
    assert sorted(int(p.path.rsplit("_", 1)[1]) for p in dumps.problems) == lost
    assert all("decoding on 0 failed: RuntimeError: broken install on this host" in p.error
               for p in dumps.problems)


def test_hung_host_is_cut_at_its_deadline_and_the_exit_code_follows_the_report(
        spread: Path, cluster: Any, capsys: pytest.CaptureFixture[str]) -> None:
    hung = _worker(cluster, "1")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests
    cluster.run(_block_decoding, workers=[hung])
    address = cluster.scheduler.address
    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_:
        main([str(spread / "{worker}"), "--dask", address, "--host-deadline", "8",
              "--format", "json", "--no-progress"])
    assert time.monotonic() - started < 120
    doc = json.loads(capsys.readouterr().out)
    lost = [r for r in range(WORLD) if r % HOSTS == 1]
    assert doc["ranks_missing"] == lost
    problems = doc["load_problems"]
    assert sorted(int(p["path"].rsplit("_", 1)[1]) for p in problems) == lost
    assert all("did not finish within 8 s" in p["error"] for p in problems)
    errors = any(f["severity"] == "error" for f in doc["findings"])
    assert errors, "ranks missing from their groups' collectives are a hang"
    assert exit_.value.code == 1


def test_unreachable_scheduler_is_one_usage_error(tmp_path: Path) -> None:
    from frforensics.analyzer.cluster import load_dumps_dask
    from frforensics.errors import UsageError

    started = time.monotonic()
    with pytest.raises(UsageError, match=r"cannot reach the Dask scheduler at tcp://127\.0\.0\.1:9"):
        load_dumps_dask([str(tmp_path)], "tcp://127.0.0.1:9", connect_timeout_s=2)
    assert time.monotonic() - started < 60
