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


def collect(js):
    """A job stream's typed items, sorted: (finished collectives, iterations, initial weights or None)."""
    from mirrorckpt.parser.concat import CollectiveResult
    from mirrorckpt.parser.iteration import InitialWeights, ReducedIteration

    results, iterations, weights = [], [], None
    for item in js:
        if isinstance(item, CollectiveResult):
            results.append(item)
        elif isinstance(item, ReducedIteration):
            iterations.append(item)
        elif isinstance(item, InitialWeights):
            weights = item
    return results, iterations, weights
