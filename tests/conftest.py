"""Shared fixtures: the real captures in ../shared (never copied into the repo) and their truth."""

from __future__ import annotations

import pytest
from common import FLOWCHECK, flowcheck_truth


@pytest.fixture(scope="session")
def truth() -> dict:
    if not FLOWCHECK.is_dir():
        pytest.fail(f"the real captures are missing: {FLOWCHECK} (tests read them from ../shared)")
    return flowcheck_truth()


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test` runs two workers), the end-to-end tests run one at a time, all
    on one worker: their trainer processes, namespaces and appliances never share the cores with
    each other, only with the unit tests on the other worker."""
    for item in items:
        if "e2e" in item.path.parts:
            item.add_marker(pytest.mark.xdist_group("e2e"))
