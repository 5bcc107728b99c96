"""The HTML report, rendered by a real headless Chromium (Debian's ``chromium`` and
``chromium-driver`` packages, driven by selenium): what a person sees names the
culprit and draws the per-rank timeline.

Skipped, with the reason, where chromium, chromedriver or selenium is missing;
``.ci/run`` installs them (``apt-get install -y chromium chromium-driver``,
``pip install selenium``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.browser]

REPO = Path(__file__).resolve().parents[2]
NATIVE = REPO / "tests" / "data" / "native"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def _missing() -> str | None:
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} not installed (apt-get install -y chromium chromium-driver)"
    if not Path(CHROMEDRIVER).exists():
        return f"{CHROMEDRIVER} not installed (apt-get install -y chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium not installed (pip install selenium)"
    return None


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    reason = _missing()
    if reason is not None:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1280,2000"):
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _html_report(dumps: Path, out: Path) -> Path:
    proc = subprocess.run(
        [sys.executable, "-m", "frforensics", str(dumps), "--format", "html", "-o", str(out)],
        capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode in (0, 1), proc.stderr
    return out


@pytest.mark.timeout(120)
def test_html_report_names_the_culprit_and_draws_every_ranks_timeline(browser, tmp_path):
    from selenium.webdriver.common.by import By

    page = _html_report(NATIVE / "missing_rank" / "pickle", tmp_path / "report.html")
    browser.get(page.as_uri())
    assert "HANG" in browser.title and "missing_rank" in browser.title
    assert browser.find_element(By.ID, "status").text == "HANG"
    assert browser.find_element(By.ID, "kind").text == "missing_rank"
    assert browser.find_element(By.ID, "culprits").text.startswith("rank 2")
    assert "Rank 2 never entered all_reduce #17" in browser.find_element(By.ID, "headline").text
    chain = browser.find_element(By.CSS_SELECTOR, ".chain")
    culprit_nodes = chain.find_elements(By.CSS_SELECTOR, ".node.culprit")
    assert [n.text.splitlines()[0] for n in culprit_nodes] == ["rank 2"]
    assert "all_reduce #17" in chain.text

    svg = browser.find_element(By.ID, "timeline")
    assert svg.is_displayed() and svg.size["width"] > 500
    rows = svg.find_elements(By.CSS_SELECTOR, "g.rank-row")
    assert sorted(int(r.get_attribute("data-rank")) for r in rows) == [0, 1, 2, 3]
    assert rows[0].get_attribute("data-rank") == "2"  # culprit first
    # ranks 0,1,3 are blocked in all_reduce #17; rank 2 never entered it
    blocking = svg.find_elements(By.CSS_SELECTOR, "rect.op.blocking")
    assert sorted((b.get_attribute("data-rank"), b.get_attribute("data-seq")) for b in blocking) \
        == [("0", "17"), ("1", "17"), ("3", "17")]
    for b in blocking:
        assert b.is_displayed() and b.size["width"] >= 1
    rank2_ops = svg.find_elements(By.CSS_SELECTOR, 'rect.op[data-rank="2"]')
    assert rank2_ops and max(int(r.get_attribute("data-seq")) for r in rank2_ops) == 16
    # Nothing on the page came from the network: one document, no subresources.
    resources = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)")
    assert resources == []


@pytest.mark.timeout(120)
def test_html_report_of_a_cross_group_deadlock_draws_the_wait_cycle(browser, tmp_path):
    from selenium.webdriver.common.by import By

    page = _html_report(NATIVE / "cross_group" / "pickle", tmp_path / "report.html")
    browser.get(page.as_uri())
    assert browser.find_element(By.ID, "kind").text == "cross_pg_deadlock"
    chain = browser.find_element(By.CSS_SELECTOR, '.chain[data-kind="cross_pg_deadlock"]')
    nodes = [n.text.splitlines()[0] for n in chain.find_elements(By.CSS_SELECTOR, ".node")]
    assert nodes == ["rank 0", "rank 1"]
    assert "↺" in chain.text
    groups = {r.get_attribute("data-group")
              for r in browser.find_elements(By.CSS_SELECTOR, "rect.op.blocking")}
    assert groups == {"0", "1"}


def test_chromium_and_driver_are_installed_together():
    """Either both Debian packages are there or neither (a half install fails here)."""
    have = [shutil.which(CHROMIUM) is not None, shutil.which(CHROMEDRIVER) is not None]
    if not any(have):
        pytest.skip("chromium not installed")
    assert all(have), "install both: apt-get install -y chromium chromium-driver"
