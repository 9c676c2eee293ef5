"""`mirrorckpt replay` shows its progress on a terminal, and the demo ends with its numbers: the
iterations, the checkpoints and the pipeline's throughput without the start-up."""

from __future__ import annotations

import io
import json

from click.testing import CliRunner
from mirrorckpt.tools import cmd_replay
from mirrorckpt.tools.cli import main
from mirrorckpt.tools.progress import Progress


def test_the_demo_ends_with_iterations_checkpoints_and_the_pipelines_throughput(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lines = []

    class Terminal(Progress):  # stderr as a terminal would see it
        def __init__(self, *a, **kw):
            kw.update(stream=io.StringIO(), enabled=True)
            super().__init__(*a, **kw)
            lines.append(self.stream)

    monkeypatch.setattr(cmd_replay, "Progress", Terminal)
    res = CliRunner().invoke(main, ["replay"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = res.stdout.splitlines()
    assert out[-4].startswith("replica: 10 iterations applied")
    assert out[-3] == "checkpoints: 10 committed, latest mirrorckpt-demo/step-00000010"
    assert out[-2].startswith("throughput: 1.4 MB of capture in ")
    assert out[-1].startswith("pipeline after start-up (") and "9 iterations in " in out[-1]
    drawn = lines[0].getvalue()
    assert "[replay]  10 iterations applied" in drawn and "step 10" in drawn

    again = CliRunner().invoke(main, ["replay", "--json", "--quiet", "--checkpoint-dir", str(tmp_path / "b")],
                               catch_exceptions=False)
    t = json.loads(again.stdout)["timing"]
    assert t["steady_iterations"] == 9 and t["iterations_per_s"] > 0
    assert t["start_up_s"] + t["steady_s"] <= t["parse_s"] <= t["total_s"]
    assert t["imports_s"] > 0  # measured apart: not replay time


def test_timing_without_a_replica_reports_totals_only():
    t = cmd_replay.timing(0.0, [], 1.0, 1.5, 1000, 0)
    assert t == {"total_s": 1.5, "parse_s": 1.0, "close_s": 0.5}


def test_replay_pipelined_steps_buckets_as_they_arrive_and_commits_the_same_checkpoints(tmp_path, monkeypatch):
    """`replay --pipelined` (or [updater] pipelined) steps each bucket of the demo as it is final,
    and every committed checkpoint is the whole-iteration replay's, byte for byte."""
    from mirrorckpt.updater.replica import Replica

    stepped = []
    real = Replica.apply_bucket
    monkeypatch.setattr(Replica, "apply_bucket", lambda self, *a, **kw: stepped.append(a[:2]) or real(self, *a, **kw))
    for name, flags in (("whole", []), ("pipelined", ["--pipelined"])):
        res = CliRunner().invoke(main, ["replay", "--quiet", "--checkpoint-dir", str(tmp_path / name)] + flags,
                                 catch_exceptions=False)
        assert res.exit_code == 0, res.output
    assert len(stepped) == 1 + 9 * 2  # one bucket, then two after DDP's rebuild; none without the flag
    files = sorted(p.relative_to(tmp_path / "whole") for p in (tmp_path / "whole").rglob("*.distcp"))
    assert len({f.parent for f in files}) == 3  # the retention keeps the last three
    for f in files:
        assert (tmp_path / "whole" / f).read_bytes() == (tmp_path / "pipelined" / f).read_bytes(), f


def test_replay_without_a_replica_does_not_import_torch():
    """Verifying the wire needs no replica: torch (a second of start-up) is imported only to keep one."""
    import subprocess
    import sys

    from common import PCAPS

    code = ("import sys\nfrom mirrorckpt.tools.cli import main\n"
            f"try:\n    main(['replay', '--config', {str(PCAPS / 'demo' / 'job.toml')!r}, '--quiet'])\n"
            "except SystemExit as e:\n    assert not e.code, e.code\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "False"
    assert "10/10 iterations complete" in out


def test_replay_says_that_workers_are_serves(tmp_path):
    """A job file written for serve, with ``[[mirror]] workers``, replays as it is, and replay says
    that it decodes each capture on one thread rather than ignoring the setting in silence."""
    from common import PCAPS

    demo = PCAPS / "demo"
    text = (demo / "job.toml").read_text().replace('source = "', f'source = "{demo}/')
    text = text.replace('direction = "egress"', 'direction = "egress"\nworkers = 2')
    (tmp_path / "job.toml").write_text(text)
    res = CliRunner().invoke(main, ["replay", "--config", str(tmp_path / "job.toml")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "note: [[mirror]] workers is serve's" in res.stderr
    assert "10/10 iterations complete" in res.stdout
