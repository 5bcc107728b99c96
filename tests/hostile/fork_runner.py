"""Run ``fr-analyze`` once per case, each in a forked child with capped memory and time.

Usage: ``python fork_runner.py CASES.json RESULTS.json``. CASES.json is
``{name: {"args": [...], "env": {...}}}``; the parent imports frforensics once,
then forks a child per case that sets ``RLIMIT_AS``, arms an alarm, runs the
CLI's ``main`` with stdout/stderr in files, and exits with its code. The parent
reaps each child with ``os.wait4`` for its exit status and peak RSS.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import tempfile
import time


def _warm_up(run: object, cases: dict[str, dict[str, object]]) -> None:
    """One throw-away run in the parent: typer imports its validators on first use."""
    assert callable(run)
    saved = os.dup(1), os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    try:
        run(["--format", "json", *cases.get("__baseline__", {}).get("args", [])])  # type: ignore[union-attr]
    except SystemExit:
        pass
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)


def main() -> None:
    with open(sys.argv[1]) as fh:
        cases = json.load(fh)
    limit = int(os.environ.get("HOSTILE_AS_BYTES", str(int(1.5 * (1 << 30)))))
    timeout = int(os.environ.get("HOSTILE_TIMEOUT_S", "30"))
    # imported once (the CLI imports these lazily): every child starts warm
    import frforensics.analyzer
    import frforensics.analyzer.timeline
    import frforensics.formats.sources
    import frforensics.reporting  # noqa: F401
    from frforensics import cli

    _warm_up(cli.main, cases)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in cases.items():
            out_path = os.path.join(tmp, f"{name}.out")
            err_path = os.path.join(tmp, f"{name}.err")
            start = time.perf_counter()
            pid = os.fork()
            if pid == 0:  # the child: never returns
                try:
                    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
                    signal.alarm(timeout)
                    os.environ.update(case.get("env", {}))
                    fd_out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    fd_err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(fd_out, 1)
                    os.dup2(fd_err, 2)
                    stdin = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(stdin, 0)
                    cli.main(case["args"])
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 1
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    sys.stderr.flush()
                    os._exit(99)
                os._exit(0)
            _, status, usage = os.wait4(pid, 0)
            elapsed = time.perf_counter() - start
            with open(out_path, encoding="utf-8", errors="replace") as fh:
                stdout = fh.read()
            with open(err_path, encoding="utf-8", errors="replace") as fh:
                stderr = fh.read()
            results[name] = {
                "exit": os.waitstatus_to_exitcode(status),
                "seconds": round(elapsed, 3),
                "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
                "stdout": stdout,
                "stderr": stderr,
            }
    with open(sys.argv[2], "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main()
