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


def test_fig10_counts_cores_per_port_speed_and_the_bytes_of_each_job():
    from mirrorckpt.benchmarks.bench_e2e import FIG10, FIG10_RANKS, fig10

    fig = fig10({"Simple": 2.5, "LL": 1.25})
    cores = {c["protocol"]: c["cores"] for c in fig["cores"]}
    assert cores["Simple"] == {"100": 5.0, "400": 20.0} and cores["LL"]["400"] == 40.0  # 50 GB/s at 1.25 per core
    assert len(fig["jobs"]) == len(FIG10) * len(FIG10_RANKS) * 2
    row = next(j for j in fig["jobs"] if j["job"] == "Llama2-7B" and j["ranks"] == 64 and j["protocol"] == "LL")
    user = 2 * 63 / 64 * 6.74e9 * 2  # bf16 gradient bytes in one rank's egress
    assert abs(row["port_GB_per_iteration"] - 2 * user / 1e9) < 1e-9  # LL: 8 wire bytes per 4 of data
    assert abs(row["wire_seconds"]["400"] * 50e9 - 2 * user) < 1
    assert abs(row["seconds_one_core"] - 2 * user / 1.25e9) < 1e-9
    doc = json.loads((Path(__file__).parents[1] / "BENCHMARKS.json").read_text())
    doc["results"]["e2e"]["fig10"] = fig
    text = render({"e2e": doc["results"]["e2e"]}, doc["machine"])
    assert "| LL | 1.25 | 10.0 | 40.0 |" in text and "| Llama2-70B | 64 | Simple |" in text


def test_more_channels_are_a_row_of_their_own_with_the_cores_their_rate_needs():
    doc = json.loads((Path(__file__).parents[1] / "BENCHMARKS.json").read_text())
    e2e = dict(doc["results"]["e2e"])
    e2e["memcpy_GBps"] = 10.0
    ll = dict(e2e["LL"], per_cpu_second_GB=2.5, slope_GBps=3.0, exact=True, steps=[2, 22], longer=62,
              slope_longer_GBps=4.0, per_cpu_second_longer_GB=2.0)
    ll8 = dict(ll, channels=8, per_cpu_second_GB=1.25, slope_GBps=1.5, exact=False, longer=None,
               slope_longer_GBps=None, per_cpu_second_longer_GB=None)
    e2e["LL"] = ll
    e2e["channels"] = {"count": 8, "results": {"LL": ll8}}
    text = render({"e2e": e2e}, doc["machine"])
    assert "| LL | 2 | 62 steps | 4.00 | 40.0% | 2.00 | 6.2 / 25.0 | yes |" in text  # the longest capture's slope
    assert "| LL | 8 | 22 steps | 1.50 | 15.0% | 1.25 | 10.0 / 40.0 | NO |" in text  # a wrong all-reduce is said
    e2e.pop("channels")
    assert "| LL | 8 |" not in render({"e2e": e2e}, doc["machine"])


def test_e2e_run_derives_each_protocols_share_of_memcpy_from_its_own_slopes(monkeypatch):
    from mirrorckpt.benchmarks import bench_e2e

    def fake(protocol, model, short, long, repeat, tmp, longer=None, channels=2):
        k = {"Simple": 3.0, "LL": 2.0, "LL128": 1.0}[protocol] / (channels // 2)
        return {"slope_GBps": k, "slope_longer_GBps": (k + 0.5) if longer and channels == 2 else None,
                "per_cpu_second_GB": k, "channels": channels, "exact": True}

    monkeypatch.setattr(bench_e2e, "measure", fake)
    monkeypatch.setattr(bench_e2e, "memcpy_GBps", lambda: 10.0)
    out = bench_e2e.run(memory_steps=None)
    assert [round(out[p]["of_memcpy_longer"], 2) for p in ("Simple", "LL", "LL128")] == [0.35, 0.25, 0.15]
    assert [round(out[p]["of_memcpy"], 2) for p in ("Simple", "LL", "LL128")] == [0.3, 0.2, 0.1]
    more = out["channels"]["results"]
    assert out["channels"]["count"] == 8 and sorted(more) == ["LL", "Simple"]
    assert round(more["Simple"]["of_memcpy"], 3) == 0.075 and "of_memcpy_longer" not in more["LL"]
