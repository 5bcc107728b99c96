"""Real 4-rank gloo jobs that hang on purpose: every live rank dumps, the culprit is named.

Each job uses a 2 s watchdog deadline and a 0.2 s store poll; gloo's own timeout
is 60 s, so every dump checked here comes from the recorder, not from the
backend giving up. ``run_job`` kills every process when the test ends.
"""

from __future__ import annotations

import time

import pytest

from frforensics.model import DumpReason, OpState

pytestmark = [pytest.mark.slow, pytest.mark.torch215]

DEADLINE_S = 2.0
# Startup (4 interpreters importing torch on 2 cores) is not part of the budget:
# the clock for "2x the deadline" starts when the waiting ranks enter the op.
STARTUP_ALLOWANCE_S = 40.0

SKIP_ONE_ALL_REDUCE = """
t = torch.ones(8)
for step in range(1, 6):
    if rank == 2 and step == 3:
        continue  # rank 2 skips one all_reduce
    dist.all_reduce(t)
time.sleep(50)  # rank 2 goes on with something else; the others wait in all_reduce #5
"""


def _entries(trace, op: str | None = None):
    e = trace.entries
    rows = []
    for i in range(len(e)):
        name = trace.string(int(e.op[i]))
        if op is None or name == op:
            rows.append((name, int(e.seq[i]), int(e.state[i]), trace.groups[int(e.pg[i])]))
    return rows


@pytest.mark.timeout(90)
def test_rank_that_skips_an_all_reduce_is_named_by_every_dump(run_job, fr_analyze):
    job = run_job(SKIP_ONE_ALL_REDUCE, deadline_s=DEADLINE_S)
    seen = job.wait_for_dumps([0, 1, 2, 3], STARTUP_ALLOWANCE_S)
    assert sorted(seen) == [0, 1, 2, 3], job.logs()
    # All four land within 2x the deadline of each other once the hang starts.
    assert max(seen.values()) - min(seen.values()) < 2 * DEADLINE_S, seen
    traces = {r: job.decode(r) for r in range(4)}
    for r in (0, 1, 3):
        t = traces[r]
        assert t.rank == r and t.world_size == 4
        assert t.dump_reason in (DumpReason.WATCHDOG_TIMEOUT, DumpReason.PEER_SIGNAL)
        rows = _entries(t, "all_reduce")
        assert [s for _, s, _, _ in rows] == [1, 2, 3, 4, 5]
        assert [st for _, _, st, _ in rows][:4] == [OpState.COMPLETED] * 4
        assert rows[-1][2] != OpState.COMPLETED
        assert rows[-1][3].desc == "default_pg" and rows[-1][3].ranks == (0, 1, 2, 3)
        main = t.main_thread()
        assert main is not None
        assert any(f.name == "all_reduce" for f in main.frames), main.frames[:8]
    culprit = traces[2]
    assert culprit.dump_reason is DumpReason.PEER_SIGNAL
    assert "all_reduce" in culprit.dump_detail
    rows = _entries(culprit, "all_reduce")
    assert [s for _, s, _, _ in rows] == [1, 2, 3, 4]
    assert all(st == OpState.COMPLETED for _, _, st, _ in rows)
    main = culprit.main_thread()
    assert main is not None and main.frames[0].name == "<module>"  # in time.sleep
    assert culprit.completion_resolution_ns > 0

    report = fr_analyze(job.dump_dir)
    assert report["culprit_ranks"][:1] == [2], report
    finding = next(f for f in report["findings"] if 2 in f.get("culprit_ranks", []))
    assert finding["kind"] == "missing_rank", finding
    assert finding["pg"]["ranks"] == [0, 1, 2, 3]
    assert finding["seq"] == 5
    assert finding["op"] == "all_reduce"


@pytest.mark.timeout(90)
def test_rank_that_issues_a_different_op_shows_the_mismatch(run_job, fr_analyze):
    body = """
    t = torch.ones(8)
    for step in range(1, 4):
        dist.all_reduce(t)
    if rank == 1:
        out = [torch.zeros(8) for _ in range(world_size)]
        dist.all_gather(out, t)      # rank 1 issues all_gather where others all_reduce
    else:
        dist.all_reduce(t)
    time.sleep(50)
    """
    job = run_job(body, deadline_s=DEADLINE_S)
    seen = job.wait_for_dumps([0, 1, 2, 3], STARTUP_ALLOWANCE_S)
    assert sorted(seen) == [0, 1, 2, 3], job.logs()
    ops_at_4 = {}
    for r in range(4):
        rows = [row for row in _entries(job.decode(r)) if row[1] == 4]
        assert len(rows) == 1, rows
        ops_at_4[r] = rows[0][0]
    assert ops_at_4 == {0: "all_reduce", 1: "all_gather", 2: "all_reduce", 3: "all_reduce"}
    report = fr_analyze(job.dump_dir)
    assert report["culprit_ranks"][:1] == [1], report
    kinds = {f["kind"] for f in report["findings"]}
    assert "op_mismatch" in kinds, report


@pytest.mark.timeout(90)
def test_rank_sleeping_in_python_dumps_its_stack_on_the_peer_signal(run_job, fr_analyze):
    body = """
    t = torch.ones(8)
    dist.all_reduce(t)

    def load_batch():
        time.sleep(50)  # a stuck data loader

    if rank == 3:
        load_batch()
    dist.all_reduce(t)
    """
    job = run_job(body, deadline_s=DEADLINE_S)
    seen = job.wait_for_dumps([0, 1, 2, 3], STARTUP_ALLOWANCE_S)
    assert sorted(seen) == [0, 1, 2, 3], job.logs()
    sleeper = job.decode(3)
    assert sleeper.dump_reason is DumpReason.PEER_SIGNAL
    main = sleeper.main_thread()
    assert main is not None
    assert main.frames[0].name == "load_batch", main.frames[:3]
    assert any(t.name == "frforensics-watchdog" for t in sleeper.threads)
    report = fr_analyze(job.dump_dir)
    assert report["culprit_ranks"][:1] == [3], report
    assert "load_batch" in report["ranks"]["3"]["stuck_at"]


@pytest.mark.timeout(90)
def test_recv_without_a_send_is_recorded_with_its_peer_and_peer_seq(run_job, fr_analyze):
    body = """
    t = torch.ones(4)
    if rank == 0:
        dist.send(t, 1)
        dist.send(t, 1)      # second send: rank 1 posts only one recv... then waits
    elif rank == 1:
        dist.recv(t, 0)
        dist.recv(t, 0)
        dist.recv(t, 2)      # nobody sends this
    time.sleep(50)
    """
    job = run_job(body, world_size=4, deadline_s=DEADLINE_S)
    seen = job.wait_for_dumps([0, 1, 2, 3], STARTUP_ALLOWANCE_S)
    assert sorted(seen) == [0, 1, 2, 3], job.logs()
    t1 = job.decode(1)
    assert t1.dump_reason is DumpReason.WATCHDOG_TIMEOUT
    e = t1.entries
    rows = [(t1.string(int(e.op[i])), int(e.peer[i]), int(e.peer_seq[i]), int(e.p2p_seq[i]),
             int(e.state[i])) for i in range(len(e))]
    assert rows == [
        ("recv", 0, 1, 1, OpState.COMPLETED),
        ("recv", 0, 2, 2, OpState.COMPLETED),
        ("recv", 2, 1, 3, OpState.SCHEDULED),
    ]
    t0 = job.decode(0)
    sends = [(int(t0.entries.peer[i]), int(t0.entries.peer_seq[i])) for i in range(len(t0.entries))]
    assert sends == [(1, 1), (1, 2)]
    report = fr_analyze(job.dump_dir)
    kinds = {f["kind"] for f in report["findings"]}
    assert "p2p_deadlock" in kinds or "missing_rank" in kinds, report
    assert 2 in report["culprit_ranks"] or 1 in report["culprit_ranks"], report


@pytest.mark.timeout(120)
def test_rank_that_exits_early_is_reported_stale_by_the_others(run_job, fr_analyze):
    # Under load this once failed: the peers die of gloo's "connection closed by
    # peer", wait for rank 1's heartbeat to go stale, and dump; rank 0 (the store's
    # host) may exit before the others read the heartbeats. They now keep the last
    # reading taken while they waited. Startup gets more room (4 torch imports).
    body = """
    t = torch.ones(8)
    dist.all_reduce(t)
    if rank == 1:
        os._exit(0)          # gone without a word: no dump, no teardown
    time.sleep(1.5)          # let its heartbeat go stale
    dist.all_reduce(t)
    time.sleep(50)
    """
    job = run_job(body, deadline_s=DEADLINE_S, env={})
    seen = job.wait_for_dumps([0, 2, 3], STARTUP_ALLOWANCE_S + 20)
    assert sorted(seen) == [0, 2, 3], job.logs()
    assert not job.dump_path(1).exists()
    for r in (0, 2, 3):
        # Peers either wait (watchdog/peer signal) or die of gloo's "connection closed
        # by peer"; either way their dump names rank 1 as the one that went silent.
        t = job.decode(r)
        assert t.stale_peers, (r, t.dump_reason, t.dump_detail)
        assert t.stale_peers[0].rank == 1, (r, t.stale_peers)
    report = fr_analyze(job.dump_dir)
    assert report["culprit_ranks"][0] == 1, report
    assert 1 in report["ranks_missing"], report


@pytest.mark.timeout(90)
def test_uncaught_exception_writes_a_dump_with_death_info(run_job, fr_analyze):
    body = """
    t = torch.ones(8)
    dist.all_reduce(t)

    def forward():
        raise ValueError("loss is NaN")

    if rank == 0:
        forward()
    dist.all_reduce(t)
    time.sleep(50)
    """
    job = run_job(body, world_size=2, deadline_s=DEADLINE_S)
    seen = job.wait_for_dumps([0, 1], STARTUP_ALLOWANCE_S)
    assert sorted(seen) == [0, 1], job.logs()
    t0 = job.decode(0)
    assert t0.dump_reason is DumpReason.EXCEPTION
    assert t0.death is not None and t0.death.kind == "exception"
    assert "loss is NaN" in t0.death.message
    assert t0.death.frames[0].name == "forward"


@pytest.mark.timeout(90)
def test_an_op_that_times_out_in_gloo_is_recorded_failed(run_job):
    body = """
    t = torch.ones(8)
    dist.all_reduce(t)
    if rank == 1:
        time.sleep(50)       # never enters the second all_reduce
    dist.all_reduce(t)       # rank 0: gloo gives up after 2 s and raises
    """
    # The watchdog deadline is far away: the only dump is the exception's.
    job = run_job(body, world_size=2, deadline_s=30.0, gloo_timeout_s=2.0)
    seen = job.wait_for_dumps([0], STARTUP_ALLOWANCE_S)
    assert sorted(seen) == [0], job.logs()
    t0 = job.decode(0)
    assert t0.dump_reason is DumpReason.EXCEPTION, t0.dump_reason
    assert t0.death is not None and "Timed out" in t0.death.message
    rows = _entries(t0, "all_reduce")
    assert [st for _, _, st, _ in rows] == [OpState.COMPLETED, OpState.FAILED], rows
    assert t0.entries.t_complete_ns[-1] > t0.entries.t_enqueue_ns[-1]
    # The main thread's stack is the exception's traceback, not the recorder's hook.
    main = t0.main_thread()
    assert main is not None and main.frames == t0.death.frames
    assert not any("frforensics/recorder" in f.file for f in main.frames), main.frames[:4]
    assert main.frames[-1].name == "<module>"


@pytest.mark.timeout(90)
def test_a_later_peer_signal_dump_keeps_the_death_of_the_main_thread(run_job):
    body = """
    t = torch.ones(8)
    dist.all_reduce(t)

    def forward():
        raise ValueError("loss is NaN")

    if rank == 0:
        # A non-daemon thread keeps the process alive after the main thread dies,
        # so its watchdog still answers the dump flag rank 1 raises 2 s later.
        threading.Thread(target=time.sleep, args=(8,), daemon=False).start()
        forward()
    dist.all_reduce(t)       # rank 1 waits here: its watchdog raises the flag
    time.sleep(50)
    """
    job = run_job(body, world_size=2, deadline_s=DEADLINE_S)
    seen = job.wait_for_dumps([0, 1], STARTUP_ALLOWANCE_S)
    assert sorted(seen) == [0, 1], job.logs()
    # Wait until rank 0 has answered the flag (its log says so), then read its dump.
    log0 = job.log_dir / "rank0.log"
    deadline = time.monotonic() + 20
    while "dumped (peer_signal)" not in log0.read_text(errors="replace"):
        assert time.monotonic() < deadline, job.logs()
        time.sleep(0.1)
    t0 = job.decode(0)
    assert t0.dump_reason is DumpReason.PEER_SIGNAL
    assert t0.death is not None and t0.death.kind == "exception"
    assert "loss is NaN" in t0.death.message
    main = t0.main_thread()
    assert main is not None and main.frames[0].name == "forward", main.frames[:3]
