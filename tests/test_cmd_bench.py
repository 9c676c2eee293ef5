"""BENCHMARKS.md rendering: every table names the machine, the command and the date."""

from __future__ import annotations

import json
from pathlib import Path

from mirrorckpt.tools.cmd_bench import render

REPO = Path(__file__).resolve().parents[1]


def _tables_are_captioned(md: str, caption) -> int:
    captions = {caption} if isinstance(caption, str) else set(caption)
    lines = md.splitlines()
    starts = [i for i, x in enumerate(lines) if x.startswith("|") and not lines[i - 1].startswith("|")]
    for i in starts:
        assert lines[i - 1] == "" and lines[i - 2] in captions, lines[i - 3:i + 1]
    return len(starts)


def test_every_table_has_machine_command_and_date():
    doc = json.loads((REPO / "BENCHMARKS.json").read_text())
    info = doc["machine"]
    md = render(doc["results"], info, doc.get("section_machine"))
    caption = [f"*{i['cpu']}, {i['cores']} cores · `{i['command']}` · {i['date']}*"
               for i in [info, *doc.get("section_machine", {}).values()]]  # sections run apart (--only)
    assert _tables_are_captioned(md, caption) >= 6
    assert md == (REPO / "BENCHMARKS.md").read_text()  # the committed report is this rendering


def test_unrecorded_command_is_said_and_failed_sections_keep_their_error():
    info = {"date": "2026-01-01T00:00:00", "cpu": "X", "cores": 2, "load_average": [0, 0, 0], "torch": "t",
            "numpy": "n"}
    stall = {"job": {"params": 1, "state_MB": 1.0}, "torch.save": {"stall": {"median_ms": 2.0, "min_ms": 1.0,
                                                                             "max_ms": 3.0, "n": 3}}}
    md = render({"stall": stall, "capture": {"error": "RuntimeError: no interface"}}, info)
    assert _tables_are_captioned(md, "*X, 2 cores · `command not recorded` · 2026-01-01T00:00:00*") == 1
    assert "RuntimeError: no interface" in md
