"""BENCHMARKS.md rendering: every table names the machine, the command and the date."""

from __future__ import annotations

import json
from pathlib import Path

from mirrorckpt.tools.cmd_bench import render

REPO = Path(__file__).resolve().parents[1]


def _tables_are_captioned(md: str, caption: str | set[str]) -> int:
    captions = {caption} if isinstance(caption, str) else caption
    lines = md.splitlines()
    starts = [i for i, x in enumerate(lines) if x.startswith("|") and not lines[i - 1].startswith("|")]
    for i in starts:
        assert lines[i - 1] == "" and lines[i - 2] in captions, lines[i - 3:i + 1]
    return len(starts)


def _caption(info: dict) -> str:
    return f"*{info['cpu']}, {info['cores']} cores · `{info['command']}` · {info['date']}*"


def test_every_table_has_machine_command_and_date():
    """Sections run with `--only` keep their own machine, command and date."""
    doc = json.loads((REPO / "BENCHMARKS.json").read_text())
    info = doc["machine"]
    sections = doc.get("sections") or {n: info for n in doc["results"]}
    md = render(doc["results"], info, sections)
    assert _tables_are_captioned(md, {_caption(i) for i in sections.values()}) >= 6
    assert md == (REPO / "BENCHMARKS.md").read_text()  # the committed report is this rendering


def test_only_keeps_the_other_sections_with_their_own_caption(tmp_path):
    from mirrorckpt.tools.cmd_bench import _keep_others

    old = {"date": "2026-01-01T00:00:00", "cpu": "X", "cores": 2, "command": "mirrorckpt bench"}
    new = dict(old, date="2026-02-02T00:00:00", command="mirrorckpt bench --only e2e")
    path = tmp_path / "B.json"
    path.write_text(json.dumps({"machine": old, "results": {"replay": {"a": 1}, "e2e": {"b": 1}}}))
    results, infos = _keep_others(path, {"e2e": {"b": 2}}, new)
    assert results == {"replay": {"a": 1}, "e2e": {"b": 2}}
    assert infos == {"replay": old, "e2e": new}


def test_unrecorded_command_is_said_and_failed_sections_keep_their_error():
    info = {"date": "2026-01-01T00:00:00", "cpu": "X", "cores": 2, "load_average": [0, 0, 0], "torch": "t",
            "numpy": "n"}
    stall = {"job": {"params": 1, "state_MB": 1.0}, "torch.save": {"stall": {"median_ms": 2.0, "min_ms": 1.0,
                                                                             "max_ms": 3.0, "n": 3}}}
    md = render({"stall": stall, "capture": {"error": "RuntimeError: no interface"}}, info)
    assert _tables_are_captioned(md, "*X, 2 cores · `command not recorded` · 2026-01-01T00:00:00*") == 1
    assert "RuntimeError: no interface" in md
