"""pytest plugin: flight-recorder post-mortems for distributed tests (opt-in).

Inert unless a run passes ``--frforensics`` (every test) or a test carries
``@pytest.mark.frforensics``. For such a test the plugin

1. sets ``FRFORENSICS_ENABLE=1``, ``FRFORENSICS_DUMP_DIR=<artifacts>/<test>/dumps``,
   ``FRFORENSICS_TIMEOUT_S`` and ``FRFORENSICS_STORE_POLL_INTERVAL_S`` in the
   environment for the duration of the test, so every rank the test spawns
   (subprocesses, ``mp.spawn``, ``torchrun``) turns the recorder on when it
   imports torch (the recorder's ``torch.backends`` autoload hook) and dumps on a
   hang;
2. when the test fails or times out (pytest-timeout's default ``signal``
   method), waits briefly for the ranks' dumps to settle, analyzes them, adds
   the verdict to the test report (a ``frforensics`` section shown with the
   failure, and ``user_properties`` for ``--junitxml``), writes ``report.md``,
   ``report.html``, ``report.json``, ``report.xml``, ``report.txt`` and
   ``timeline.json`` next to the dumps, and appends the markdown to
   ``$GITHUB_STEP_SUMMARY`` when that is set;
3. when the test passes, removes its folder (``--frforensics-keep`` keeps it).

The analysis never imports torch. Options: ``--frforensics-artifacts DIR``
(default ``frforensics-artifacts`` under the rootdir),
``--frforensics-deadline S`` (the recorder's watchdog deadline in the ranks;
keep it below the test's timeout), ``--frforensics-settle S`` (how long to wait
for dumps after a failure).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["artifact_dir_name"]

_STATE = pytest.StashKey[dict[str, Any]]()
_ENV_KEYS = ("FRFORENSICS_ENABLE", "FRFORENSICS_DUMP_DIR", "FRFORENSICS_TIMEOUT_S",
             "FRFORENSICS_STORE_POLL_INTERVAL_S")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("frforensics", "flight-recorder post-mortems of distributed tests")
    group.addoption("--frforensics", action="store_true", default=False,
                    help="Record collectives in every test's spawned ranks; analyze them when "
                    "a test fails or times out (else only tests marked frforensics).")
    group.addoption("--frforensics-artifacts", metavar="DIR", default=None,
                    help="Folder for dumps and reports, one subfolder per test "
                    "(default: frforensics-artifacts under the rootdir).")
    group.addoption("--frforensics-deadline", metavar="S", type=float, default=10.0,
                    help="Recorder watchdog deadline in the ranks, seconds (default 10).")
    group.addoption("--frforensics-settle", metavar="S", type=float, default=10.0,
                    help="After a failure, wait up to this long for dumps to settle (default 10).")
    group.addoption("--frforensics-keep", action="store_true", default=False,
                    help="Keep the folders of passing tests too.")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "frforensics: record collectives in this test's ranks; analyze the dumps when it fails")


def artifact_dir_name(nodeid: str) -> str:
    """A file-system-safe folder name for a test id (readable, unique)."""
    clean = re.sub(r"[^A-Za-z0-9._-]+", "_", nodeid).strip("_")
    if len(clean) > 100:
        digest = hashlib.sha1(nodeid.encode()).hexdigest()[:10]
        clean = f"{clean[:88]}_{digest}"
    return clean or "test"


def _active(item: pytest.Item) -> bool:
    return bool(item.config.getoption("--frforensics")) or \
        item.get_closest_marker("frforensics") is not None


def _artifacts_root(config: pytest.Config) -> Path:
    opt = config.getoption("--frforensics-artifacts")
    return Path(opt) if opt else Path(config.rootpath) / "frforensics-artifacts"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    if _active(item):
        folder = _artifacts_root(item.config).resolve() / artifact_dir_name(item.nodeid)
        shutil.rmtree(folder, ignore_errors=True)  # a previous run's leftovers
        dumps = folder / "dumps"
        dumps.mkdir(parents=True, exist_ok=True)
        saved = {k: os.environ.get(k) for k in _ENV_KEYS}
        os.environ.update({
            "FRFORENSICS_ENABLE": "1",
            "FRFORENSICS_DUMP_DIR": str(dumps),
            "FRFORENSICS_TIMEOUT_S": str(item.config.getoption("--frforensics-deadline")),
            "FRFORENSICS_STORE_POLL_INTERVAL_S": os.environ.get(
                "FRFORENSICS_STORE_POLL_INTERVAL_S", "0.2"),
        })
        item.stash[_STATE] = {"folder": folder, "dumps": dumps, "saved": saved,
                              "failed": False, "analyzed": False}
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    state = item.stash.get(_STATE, None)
    if state is None or not isinstance(report, pytest.TestReport):
        return report
    if report.failed and report.when in ("setup", "call"):
        state["failed"] = True
        if not state["analyzed"]:
            state["analyzed"] = True
            try:
                _post_mortem(item, report, state)
            except Exception as exc:  # never turn a test failure into an internal error
                report.sections.append(("frforensics", f"analysis failed: "
                                        f"{type(exc).__name__}: {exc}"))
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    try:
        return (yield)
    finally:
        state = item.stash.get(_STATE, None)
        if state is not None:
            for key, value in state["saved"].items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            if not state["failed"] and not item.config.getoption("--frforensics-keep"):
                shutil.rmtree(state["folder"], ignore_errors=True)


def _settle(dumps: Path, limit_s: float) -> list[Path]:
    """Wait until the dump folder stops changing (or ``limit_s``); its dump files."""
    def snapshot() -> dict[str, int]:
        out = {}
        for p in dumps.rglob("*"):
            if p.is_file() and not p.name.startswith("."):
                with contextlib.suppress(OSError):
                    out[str(p)] = p.stat().st_mtime_ns
        return out

    deadline = time.monotonic() + limit_s
    last = snapshot()
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = snapshot()
        if now != last:
            last, quiet_since = now, time.monotonic()
        elif last and time.monotonic() - quiet_since >= 1.0:
            break
    return [Path(p) for p in sorted(last)]


def _post_mortem(item: pytest.Item, report: pytest.TestReport, state: dict[str, Any]) -> None:
    from frforensics.analyzer import AnalyzeOptions, analyze, load_dumps
    from frforensics.analyzer.timeline import write_timeline_file
    from frforensics.reporting import render, write_all

    folder: Path = state["folder"]
    dumps: Path = state["dumps"]
    files = _settle(dumps, float(item.config.getoption("--frforensics-settle")))
    if not files:
        report.sections.append((
            "frforensics",
            f"no flight-recorder dump in {dumps}: the ranks did not dump (no hang past the "
            f"{item.config.getoption('--frforensics-deadline')} s deadline, or the recorder "
            "was not enabled in them: spawned ranks must import torch with this environment)"))
        return
    dump_set = load_dumps([str(dumps)], jobs=1)
    result = analyze(dump_set, options=AnalyzeOptions())
    write_all(result, folder)
    write_timeline_file([dumps], folder / "timeline.json")
    text = render(result, "text")
    report.sections.append(("frforensics", f"{text}\nartifacts: {folder}"))
    report.user_properties.append(("frforensics_status", result.status.value))
    report.user_properties.append(("frforensics_culprit_ranks",
                                   ",".join(map(str, result.culprit_ranks))))
    report.user_properties.append(("frforensics_artifacts", str(folder)))
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        markdown = render(result, "markdown")
        with open(summary, "a", encoding="utf-8") as fh:
            fh.write(f"### `{item.nodeid}`\n\n{markdown}\n")
