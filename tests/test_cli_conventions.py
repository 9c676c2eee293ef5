"""What a user expects of every `mirrorckpt` command: a progress line on a terminal for the long
ones (restore --verify, gen, inspect, doctor; replay's is in test_cmd_replay), `gen` ending with the
command that replays what it made, and with --json, failures as one JSON object on stdout."""

from __future__ import annotations

import io
import json
import os
import shlex
import subprocess
import sys

import pytest
from click.testing import CliRunner
from common import PCAPS
from mirrorckpt.tools import cmd_doctor, cmd_gen, cmd_inspect, cmd_restore
from mirrorckpt.tools.cli import main
from mirrorckpt.tools.progress import Progress

DEMO = PCAPS / "demo"


@pytest.fixture
def terminal(monkeypatch):
    """Each command module's progress line drawn as a terminal would see it; returns what was drawn."""
    drawn = []

    class Terminal(Progress):
        def __init__(self, *a, **kw):
            kw.update(stream=io.StringIO(), enabled=True)
            super().__init__(*a, **kw)
            drawn.append(self.stream)

    for mod in (cmd_doctor, cmd_gen, cmd_inspect, cmd_restore):
        monkeypatch.setattr(mod, "Progress", Terminal)
    return lambda: "".join(s.getvalue() for s in drawn)


def test_inspect_and_doctor_show_their_progress_on_a_terminal_only(terminal):
    cap = str(DEMO / "rank0_egress.pcapng")
    res = CliRunner().invoke(main, ["inspect", cap], catch_exceptions=False)
    assert res.exit_code == 0 and "[inspect]" not in res.output  # stdout and stderr are not terminals
    assert "[inspect]  " in terminal() and " MB" in terminal()
    res = CliRunner().invoke(main, ["doctor", cap, str(DEMO / "rank1_egress.pcapng")], catch_exceptions=False)
    assert res.exit_code == 0 and "[doctor]" not in res.output
    assert "[doctor]  " in terminal()


def test_restore_verify_shows_the_bytes_hashed_and_read_back(tmp_path, terminal):
    res = CliRunner().invoke(main, ["replay", "--quiet", "--checkpoint-dir", str(tmp_path / "ck")],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["restore", "--verify", str(tmp_path / "ck")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    line = terminal().split("\r")[-1]
    # the newest checkpoint's files hashed and its tensors read back: done equals the total
    done, total = line.split("  ")[1].removesuffix(" MB").split("/")
    assert line.startswith("[verify] step-00000010  ") and done == total, line


def test_gen_shows_its_iterations_and_ends_with_the_command_that_replays_it(tmp_path, terminal):
    out = tmp_path / "my run"
    res = CliRunner().invoke(main, ["gen", "--out", str(out), "--steps", "3", "--model", "linear:40"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "[gen]  3/3 iterations" in terminal()
    last = res.stdout.splitlines()[-1]
    assert last == f"replay it: mirrorckpt replay --config {shlex.quote(str(out / 'job.toml'))}"
    args = shlex.split(last.removeprefix("replay it: mirrorckpt "))
    again = CliRunner().invoke(main, args + ["--quiet"], catch_exceptions=False)
    assert again.exit_code == 0 and "3/3 iterations complete" in again.stdout, again.output


@pytest.mark.parametrize("args", [
    ["inspect", "--json", "NOFILE"],  # a missing capture
    ["inspect", "--json", "--nccl-version", "9.99", str(DEMO / "rank0_egress.pcapng")],
    ["doctor", "--json", str(DEMO / "job.toml")],  # not a capture
    ["replay", "--json", "--checkpoint-dir", "FILE/ck"],
    ["restore", "--json", "FILE"],
    ["plan", "--json", "--mtbf-hours", "1", "--job", str(DEMO / "rank0_egress.pcapng")],
])
def test_json_errors_are_one_json_object_on_stdout(tmp_path, args):
    (tmp_path / "FILE").write_bytes(b"\x00\xff" * 8)
    args = [str(tmp_path / a) if a in ("NOFILE", "FILE") else a.replace("FILE/", f"{tmp_path}/FILE/")
            for a in args]
    res = CliRunner().invoke(main, args)
    assert res.exit_code != 0 and "Traceback" not in res.output
    doc = json.loads(res.stdout)  # stdout holds exactly the one object
    err = next(x for x in res.stderr.splitlines() if x.startswith("error: "))
    assert doc["error"] and doc["error"] in err, (doc, err)


@pytest.mark.parametrize("given", [None, "3"])
def test_the_command_keeps_numpys_blas_to_one_thread_unless_the_operator_says_otherwise(given):
    """numpy's OpenBLAS threads spin at start-up for work no command gives them: the command starts
    with one, and an operator's OPENBLAS_NUM_THREADS stands."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if given:
        env["OPENBLAS_NUM_THREADS"] = given
    code = ("import os, mirrorckpt.tools.cli, numpy; "
            "print(os.environ['OPENBLAS_NUM_THREADS'], len(os.listdir('/proc/self/task')))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    setting, threads = out.split()
    assert setting == (given or "1")
    if not given:
        assert threads == "1"  # the process's own thread only: no BLAS thread started
