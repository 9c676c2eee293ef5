"""Every option and argument of every `mirrorckpt` command fed malformed values: each ends in an
`error:` line that names the option or the value, a non-zero exit and no traceback (with --json,
also one JSON object with "error" on stdout).

The values come from each parameter's click type (introspected, so a new option is swept as soon
as it exists): a wrong type, out of range, nan, a missing file, a directory for a file, a file for a
directory, binary junk for a text file or a capture, and a path nobody can write (a path under a
regular file: even root cannot create it). Free-text options list their malformed values in
TEXT; one missing there fails the sweep. The rest of each command line is valid (BASE), so the
error must be about the value under test.
"""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner
from common import PCAPS
from mirrorckpt.tools import cmd_bench
from mirrorckpt.tools.cli import COMMANDS, main
from mirrorckpt.tools.cliutil import NcclVersion, Pace
from mirrorckpt.tools.cmd_plan import Count

DEMO = PCAPS / "demo"
CAPTURES = [str(DEMO / "rank0_egress.pcapng"), str(DEMO / "rank1_egress.pcapng")]

# Malformed values of free-text options (a STRING type says nothing about what is valid).
TEXT = {
    ("gen", "ring_orders"): ["x", "0,1;0,1", "1,0"],
    ("gen", "model"): ["junk", "linear:abc", "linear:0", "mlp:", "gpt:layers=x"],
    ("gen", "betas"): ["1", "a,b", "0.9,0.999,1"],
    ("gen", "lr_schedule"): ["Nope"],
    ("gen", "lr_schedule_kwargs"): ["{", "[1]", '{"nope": 1}'],
    ("gen", "mirror"): ["junk", "9:egress", "0:sideways"],
    ("gen", "noise"): ["junk"],
    ("gen", "encap"): ["junk", "vendor:xyz", "vendor:0x8949:abc", "vendor:0x8949:-4"],
    ("gen", "outer_vlan"): ["x", "5000", "1,2,3"],
    ("gen", "inner_vlan"): ["x", "-1", "1,2,3"],
    ("gen", "p2p_send"): ["junk", "0>1", "0>9:100", "a>b:c", "0>1:-5"],
    ("status", "url"): ["notaurl", "http://", "ftp://127.0.0.1/metrics"],
    ("record", "gpu"): ["x", "-1", "0,1"],
    ("record", "algo"): ["Bogus", "Ring,,Tree", "allreduce:Ring;broadcast:Nope"],
    ("record", "env_pairs"): ["junk", "PATH=/x", "NCCL_PROTO=LL"],  # the last: NCCL's, not gloo's
    ("record", "model"): ["junk", "linear:0"],
}
# Numbers with a range the option's type does not carry (checked where the value is used).
BOUNDS = {
    ("gen", "qps_per_connection"): ["0", "99"],
    ("gen", "lr"): ["-1"], ("gen", "eps"): ["-1"], ("gen", "weight_decay"): ["-1"],
    ("gen", "clip_norm"): ["0"],
    **{("gen", k): ["-0.5", "2"] for k in ("loss", "reorder", "duplicate", "corrupt", "truncate", "message_loss")},
}
# Path parameters the command reads without click checking that they exist.
READ = {("inspect", "capture"), ("restore", "checkpoint_dir")}
# Paths read as text (TOML, JSON): binary junk must be refused as such, not as a decoding traceback.
TEXT_FILES = {("replay", "config_path"), ("serve", "config_path"), ("status", "config_path"),
              ("plan", "job_file"), ("plan", "measured_file")}


@pytest.fixture(scope="module")
def where(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    (d / "junk.bin").write_bytes(bytes(range(256)) * 16)
    (d / "a_file").write_text("")
    (d / "a_dir").mkdir()
    # a serve configuration that stops in its preflight (no rank addresses): serve never runs here
    text = (DEMO / "job.toml").read_text().replace('source = "', f'source = "{DEMO}/')
    (d / "serve.toml").write_text("\n".join(x for x in text.splitlines() if not x.startswith("addresses")))
    (d / "root").mkdir()
    return d


def base(command: str, d) -> dict[str, list[str]]:
    """A valid command line, by the parameter each part sets ('' for the rest)."""
    return {
        "inspect": {"capture": CAPTURES[:1]},
        "doctor": {"captures": CAPTURES},
        "replay": {"captures": CAPTURES, "config_path": ["--config", str(DEMO / "job.toml")], "": ["--quiet"]},
        "gen": {"out_dir": ["--out", str(d / "gen")], "steps": ["--steps", "1"], "model": ["--model", "linear:10"]},
        "restore": {"checkpoint_dir": [str(d / "root")]},
        "serve": {"config_path": ["--config", str(d / "serve.toml")]},
        "status": {},
        "bench": {"out": ["--out", str(d / "bench" / "B.md")]},
        "plan": {"mtbf_hours": ["--mtbf-hours", "1"], "params": ["--params", "7B"]},
        # gloo on the CPU, so that a value the command accepts would record (and must be refused first)
        "record": {"out_dir": ["--out", str(d / "rec")], "backend": ["--backend", "gloo"], "steps": ["--steps", "2"],
                   "model": ["--model", "linear:10"], "": ["--no-replay"]},
    }[command]


def malformed(command: str, p: click.Parameter, d) -> list[str]:
    t, key = p.type, (command, p.name)
    if key in TEXT:
        return TEXT[key]
    if isinstance(t, click.Choice):
        return ["no-such-choice"]
    if isinstance(t, NcclVersion):
        return ["9.99", "abc", "2"]
    if isinstance(t, Pace):
        return ["fast", "0", "-3"]
    if isinstance(t, Count):
        return ["abc", "-5", "7X"]
    if isinstance(t, click.Path):
        return _paths(t, key, d)
    if isinstance(t, (click.types.IntParamType, click.types.FloatParamType)):
        values = ["abc", "nan"] + BOUNDS.get(key, [])
        if isinstance(t, click.types._NumberRangeBase):
            values += [str(t.min - 1) if not t.min_open else str(t.min)] if t.min is not None else []
            values += [str(t.max + 1) if not t.max_open else str(t.max)] if t.max is not None else []
        return values
    raise AssertionError(f"{command} {p.opts or p.name}: no malformed values for a {type(t).__name__}; "
                         "add them to TEXT")


def _paths(t: click.Path, key, d) -> list[str]:
    reads = t.exists or key in READ
    values = [str(d / "missing")] if reads else []
    if not t.dir_okay:
        values.append(str(d / "a_dir"))
    if not t.file_okay:
        values.append(str(d / "a_file"))
    if reads and (t.file_okay or key == ("restore", "checkpoint_dir")):
        values.append(str(d / "junk.bin"))  # not a capture, not TOML, not a checkpoint
    if not reads:
        values.append(str(d / "a_file" / "below"))  # unwritable, even by root
    assert key not in TEXT_FILES or str(d / "junk.bin") in values
    return values


def cases():
    out = []
    for command in sorted(COMMANDS):
        cmd = main.get_command(None, command)
        for p in cmd.params:
            if isinstance(p, click.Option) and (p.is_flag or p.name == "help"):
                continue
            out.append((command, p.name))
    return out


def _line(command, p, value, d, as_json):
    parts = base(command, d)
    parts.pop(p.name, None)
    args = [a for v in parts.values() for a in v]
    given = [value] if isinstance(p, click.Argument) else [p.opts[0], value]
    return [command, *given, *args, *(["--json"] if as_json else [])]


@pytest.mark.parametrize("command,name", cases())
def test_malformed_values_end_in_an_error_line(command, name, where, monkeypatch):
    monkeypatch.setattr(cmd_bench, "SECTIONS", {})  # bench: never a benchmark, whatever happens
    monkeypatch.chdir(where)
    cmd = main.get_command(None, command)
    p = next(x for x in cmd.params if x.name == name)
    has_json = any(x.name == "as_json" for x in cmd.params)
    for value in malformed(command, p, where):
        for as_json in (False, True) if has_json else (False,):
            args = _line(command, p, value, where, as_json)
            res = CliRunner().invoke(main, args)
            what = f"mirrorckpt {' '.join(args)}"
            assert res.exception is None or isinstance(res.exception, SystemExit), \
                f"{what}: {type(res.exception).__name__}: {res.exception}"
            assert res.exit_code != 0, f"{what}: accepted (exit 0)\n{res.output[-2000:]}"
            assert "Traceback" not in res.output, f"{what}\n{res.output[-3000:]}"
            errors = [x for x in res.stderr.splitlines() if x.startswith("error: ")]
            names = [*p.opts, value, value.rsplit("/", 1)[-1]]
            assert any(n in e for e in errors for n in names), f"{what}: no error line naming it:\n{res.stderr}"
            if as_json:
                assert json.loads(res.stdout)["error"], what


def test_the_issues_bad_inputs_each_end_in_an_error_line(where):
    """The eleven inputs of issue 37 that ended in a traceback, as a user gives them (config-file values
    included, which the option sweep does not reach)."""
    d = where
    cap = CAPTURES[0]
    serve_cfg = (DEMO / "job.toml").read_text().replace('source = "', f'source = "{DEMO}/')
    (d / "secret5").write_bytes(b"12345")
    control = f'\n[control]\nlisten = "127.0.0.1:0"\nsecret_file = "{d}/secret5"\n'
    (d / "short_secret.toml").write_text(serve_cfg + control)
    (d / "no_port.toml").write_text(serve_cfg + '\n[metrics]\nlisten = "127.0.0.1"\n')
    cases = {
        "inspect --nccl-version 9.99": (["inspect", "--nccl-version", "9.99", cap], "NCCL 9.99 is outside"),
        "inspect --nccl-version abc": (["inspect", "--nccl-version", "abc", cap], "'abc' is not of the form"),
        "doctor --nccl-version 9.99": (["doctor", "--nccl-version", "9.99", cap], "NCCL 9.99 is outside"),
        "doctor --nccl-version abc": (["doctor", "--nccl-version", "abc", cap], "'abc' is not of the form"),
        "replay --nccl-version 9.99": (["replay", "--nccl-version", "9.99", cap], "NCCL 9.99 is outside"),
        "replay --nccl-version abc": (["replay", "--nccl-version", "abc", cap], "'abc' is not of the form"),
        "serve --pace fast": (["serve", "--config", str(d / "no_port.toml"), "--pace", "fast"], "'fast': expected"),
        "[metrics] listen without a port": (["serve", "--config", str(d / "no_port.toml")],
                                            "[metrics] listen: expected HOST:PORT"),
        "status of [metrics] listen without a port": (["status", "--config", str(d / "no_port.toml")],
                                                      "[metrics] listen: expected HOST:PORT"),
        "a 5-byte secret": (["serve", "--config", str(d / "short_secret.toml")], "secret5 holds 5 bytes"),
        "an unwritable --checkpoint-dir": (["replay", "--checkpoint-dir", str(d / "a_file" / "ck")],
                                           "cannot write there (Not a directory)"),
        "an unwritable gen --out": (["gen", "--out", str(d / "a_file" / "g")], "cannot write there"),
        "plan --job on a binary file": (["plan", "--mtbf-hours", "1", "--job", str(d / "junk.bin")],
                                        "not a TOML job file"),
        "status --url notaurl": (["status", "--url", "notaurl"], "expected the metrics endpoint as http://"),
    }
    for what, (args, said) in cases.items():
        if args[0] == "serve":  # a serve that got past the check would run on: a process with a deadline
            res = subprocess.run([sys.executable, "-m", "mirrorckpt.tools.cli", *args], capture_output=True,
                                 text=True, timeout=60)
            code, stderr = res.returncode, res.stderr
        else:
            res = CliRunner().invoke(main, args)
            assert res.exception is None or isinstance(res.exception, SystemExit), (what, res.exception)
            code, stderr = res.exit_code, res.stderr
        assert code != 0 and "Traceback" not in stderr, (what, stderr)
        assert any(x.startswith("error: ") and said in x for x in stderr.splitlines()), (what, stderr)
