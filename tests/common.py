"""Paths and loaders shared by the tests (importable: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
FLOWCHECK = SHARED / "captures" / "flowcheck"
PCAPS = REPO / "tests" / "pcaps"


def flowcheck_truth() -> dict:
    return json.loads((FLOWCHECK / "truth.json").read_text())["captures"]


def flowcheck_captures() -> list[str]:
    return sorted(flowcheck_truth())


def wait_for(cond, timeout: float, poll: float = 0.01) -> bool:
    """Polls ``cond`` until it holds or ``timeout`` seconds passed; its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(poll)
    return cond()
