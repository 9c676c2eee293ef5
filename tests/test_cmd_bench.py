"""BENCHMARKS.md rendering: every table names the machine, the command and the date."""

from __future__ import annotations

import json
from pathlib import Path

from mirrorckpt.tools.cmd_bench import render

REPO = Path(__file__).resolve().parents[1]


def _tables_are_captioned(md: str, caption) -> int:
    """``caption``: the caption every table has, or a function of the section's heading."""
    lines = md.splitlines()
    starts = [i for i, x in enumerate(lines) if x.startswith("|") and not lines[i - 1].startswith("|")]
    for i in starts:
        heading = next(x for x in reversed(lines[:i]) if x.startswith("## "))
        want = caption(heading) if callable(caption) else caption
        assert lines[i - 1] == "" and lines[i - 2] == want, lines[i - 3:i + 1]
    return len(starts)


def _caption(info: dict) -> str:
    return f"*{info['cpu']}, {info['cores']} cores · `{info['command']}` · {info['date']}*"


def test_every_table_has_machine_command_and_date():
    doc = json.loads((REPO / "BENCHMARKS.json").read_text())
    info, runs = doc["machine"], doc.get("runs", {})
    md = render(doc["results"], info, runs)
    titles = {name: _heading(name, res, info) for name, res in doc["results"].items()}

    def caption(heading):  # the run that measured the section under this heading
        name = next(n for n, t in titles.items() if t == heading)
        return _caption(runs.get(name, info))

    assert _tables_are_captioned(md, caption) >= 7
    assert md == (REPO / "BENCHMARKS.md").read_text()  # the committed report is this rendering


def _heading(name, res, info) -> str:
    return next(x for x in render({name: res}, info).splitlines() if x.startswith("## "))


def test_a_section_run_alone_replaces_only_its_section():
    from mirrorckpt.tools.cmd_bench import merge

    old = {"machine": {"date": "1", "cpu": "X", "cores": 2, "load_average": [0, 0, 0], "torch": "t", "numpy": "n",
                       "command": "mirrorckpt bench"},
           "results": {"stall": {"job": {"params": 1, "state_MB": 1.0}}, "capture": {"error": "E"}}}
    later = dict(old["machine"], date="2", command="mirrorckpt bench --only capture")
    doc = merge(old, {"capture": {"error": "F"}}, later)
    assert doc["results"] == {"stall": old["results"]["stall"], "capture": {"error": "F"}}
    assert doc["machine"] == old["machine"] and doc["runs"] == {"capture": later}
    md = render(doc["results"], doc["machine"], doc["runs"])
    assert "capture by `mirrorckpt bench --only capture` on 2" in md


def test_unrecorded_command_is_said_and_failed_sections_keep_their_error():
    info = {"date": "2026-01-01T00:00:00", "cpu": "X", "cores": 2, "load_average": [0, 0, 0], "torch": "t",
            "numpy": "n"}
    stall = {"job": {"params": 1, "state_MB": 1.0}, "torch.save": {"stall": {"median_ms": 2.0, "min_ms": 1.0,
                                                                             "max_ms": 3.0, "n": 3}}}
    md = render({"stall": stall, "capture": {"error": "RuntimeError: no interface"}}, info)
    assert _tables_are_captioned(md, "*X, 2 cores · `command not recorded` · 2026-01-01T00:00:00*") == 1
    assert "RuntimeError: no interface" in md
