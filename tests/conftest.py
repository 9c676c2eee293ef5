"""Shared fixtures: the real captures in ../shared (never copied into the repo) and their truth."""

from __future__ import annotations

import pytest
from common import FLOWCHECK, flowcheck_truth


@pytest.fixture(scope="session")
def truth() -> dict:
    if not FLOWCHECK.is_dir():
        pytest.fail(f"the real captures are missing: {FLOWCHECK} (tests read them from ../shared)")
    return flowcheck_truth()

