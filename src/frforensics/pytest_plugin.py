"""pytest plugin: flight-recorder post-mortems for distributed tests (opt-in).

Inert unless a run passes ``--frforensics`` or a test carries
``@pytest.mark.frforensics``.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("frforensics", "flight-recorder post-mortems")
    group.addoption("--frforensics", action="store_true", default=False,
                    help="Record collectives in spawned ranks and analyze them when a test fails.")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "frforensics: record collectives in this test's ranks; analyze on failure")
