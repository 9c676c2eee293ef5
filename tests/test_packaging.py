"""What the wheel holds, read from pyproject.toml (building one compiles every kernel: minutes):
the version written once, the demo capture that `mirrorckpt replay` with no argument runs, the
test rigs left out; and `bench` from an installed package: its report in the working directory,
the rig-driven sections saying they need a source checkout."""

from __future__ import annotations

import importlib.metadata
import json
import sys
import tomllib
from fnmatch import fnmatch

import mirrorckpt
from click.testing import CliRunner
from common import REPO
from mirrorckpt.tools import cmd_bench, cmd_replay
from mirrorckpt.tools.cli import main

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_the_version_is_written_once():
    assert "version" not in PYPROJECT["project"] and PYPROJECT["project"]["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "mirrorckpt.__version__"}
    assert importlib.metadata.version("mirrorckpt") == mirrorckpt.__version__  # the installed metadata agrees


def test_the_wheel_holds_the_demo_capture_and_not_the_rigs():
    data = PYPROJECT["tool"]["setuptools"]["package-data"]["mirrorckpt"]
    demo = cmd_replay.DEMO.relative_to(REPO)
    files = [p.relative_to(REPO).as_posix() for p in cmd_replay.DEMO.iterdir()]
    assert {"job.toml", "rank0_egress.pcapng", "rank1_egress.pcapng"} <= {p.name for p in cmd_replay.DEMO.iterdir()}
    assert all(any(fnmatch(f, g) for g in data) for f in files), (demo, data)
    packages = PYPROJECT["tool"]["setuptools"]["packages"]
    rigs = {"mirrorckpt.tools.testbed", "mirrorckpt.tools.record"}
    assert not rigs & set(packages)
    # every other package folder is shipped
    folders = {"mirrorckpt." + ".".join(p.parent.relative_to(REPO).parts) for p in REPO.glob("*/**/__init__.py")
               if ".venv" not in p.parts and "tests" not in p.parts and "build" not in p.parts}
    assert folders - rigs == set(packages) - {"mirrorckpt"}


def test_bench_writes_into_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cmd_bench, "SECTIONS", {})
    before = (REPO / "BENCHMARKS.md").stat().st_mtime_ns
    res = CliRunner().invoke(main, ["bench"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert (tmp_path / "BENCHMARKS.md").is_file() and (tmp_path / "BENCHMARKS.json").is_file()
    assert (REPO / "BENCHMARKS.md").stat().st_mtime_ns == before


def test_a_section_that_drives_the_rigs_says_it_needs_a_source_checkout(tmp_path, monkeypatch):
    """As from the wheel: the rigs cannot be imported."""
    monkeypatch.chdir(tmp_path)
    gone = ("mirrorckpt.tools.testbed", "mirrorckpt.benchmarks.bench_goodput")
    for name in [m for m in sys.modules if m.startswith(gone)]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mirrorckpt.tools.testbed", None)
    res = CliRunner().invoke(main, ["bench", "--only", "goodput"], catch_exceptions=False)
    assert res.exit_code == 1
    err = json.loads((tmp_path / "BENCHMARKS.json").read_text())["results"]["goodput"]["error"]
    assert err.startswith("needs a source checkout: this section drives the test rigs (tools/testbed)"), err
    assert "[bench] goodput: needs a source checkout" in res.stderr


def test_record_from_the_wheel_says_it_needs_a_source_checkout(monkeypatch):
    for name in [m for m in sys.modules if m.startswith("mirrorckpt.tools.record")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mirrorckpt.tools.record", None)
    res = CliRunner().invoke(main, ["record", "--check"], catch_exceptions=False)
    assert res.exit_code == 1
    assert "record runs from a source checkout" in res.stderr, res.stderr
