"""Paths and loaders shared by the tests (importable: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
FLOWCHECK = SHARED / "captures" / "flowcheck"
PCAPS = REPO / "tests" / "pcaps"


def flowcheck_truth() -> dict:
    return json.loads((FLOWCHECK / "truth.json").read_text())["captures"]


def flowcheck_captures() -> list[str]:
    return sorted(flowcheck_truth())
