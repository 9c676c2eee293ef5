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
    """Every end-to-end test not marked ``offline`` is ``serial``: tests/run_suite.py (`make test`)
    runs those one at a time in one pytest process, and everything else in another beside it."""
    for item in items:
        if "e2e" in item.path.parts and item.get_closest_marker("offline") is None:
            item.add_marker(pytest.mark.serial)
