"""`mirrorckpt replay` shows its progress on a terminal, and the demo ends with its numbers: the
iterations, the checkpoints and the pipeline's throughput without the start-up. A replay that
reassembles nothing exits 1 and says why in one sentence; a replica steps only with an optimizer
the job file or the command line names; incomplete all-reduces are summarised."""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import pytest
from click.testing import CliRunner
from common import FLOWCHECK, PCAPS
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


# ---------------------------------------------------------------- work that matches nothing

DEMO = PCAPS / "demo"
DEMO_CAPTURES = [str(DEMO / "rank0_egress.pcapng"), str(DEMO / "rank1_egress.pcapng")]
A0, A1 = "fe80::e42:a1ff:fed7:8eb7", "fe80::ac0:ebff:fe95:31e9"  # the demo's ranks 0 and 1


def _job(tmp_path, old: str = "", new: str = "", source=DEMO / "job.toml"):
    text = source.read_text()
    assert old in text
    p = tmp_path / "job.toml"
    p.write_text(text.replace(old, new))
    return str(p)


@pytest.mark.parametrize("case", ["swapped", "another job", "Simple on LL"])
def test_a_job_file_that_fits_none_of_the_wires_connections_fails_with_one_sentence(tmp_path, case):
    """Exit 1 and one sentence setting what the wire shows against what the file names (exit 0 with
    `0 all-reduces, 0/0 iterations complete` before), the same in the --json report."""
    job, why = {
        "swapped": (lambda: _job(tmp_path, f'"{A0}", "{A1}"', f'"{A1}", "{A0}"'),
                    f"{A0} -> {A1} (rank 1 -> rank 0 by the job file: not a link of its ring)"),
        "another job": (lambda: str(PCAPS / "ll_r2_noise_faults" / "job.toml"),
                        f"{A0} and {A1} not among the ranks the job file names"),
        "Simple on LL": (lambda: _job(tmp_path, 'protocol = "LL"', 'protocol = "Simple"'),
                         "rank 0 -> rank 1, a ring link whose sends fit no channel under protocol Simple"),
    }[case]
    job = job()
    res = CliRunner().invoke(main, ["replay", "--quiet", "--config", job, *DEMO_CAPTURES], catch_exceptions=False)
    assert res.exit_code == 1 and "Traceback" not in res.output
    (err,) = [x for x in res.stderr.splitlines() if x.startswith("error: ")]
    assert err.startswith("error: the job file names ") and why in err, err
    assert "the wire shows 1 connection " in err and err.endswith(": none of its 164 sends placed"), err
    as_json = CliRunner().invoke(main, ["replay", "--json", "--config", job, *DEMO_CAPTURES])
    assert as_json.exit_code == 1 and json.loads(as_json.stdout)["error"] == err.removeprefix("error: ")


def _without_roce(tmp_path):
    """The noisy generated capture with its RoCEv2 frames left out: what a mirror of the wrong port or
    VLAN gives (ARP, PTP, TCP)."""
    from scapy.all import UDP, rdpcap, wrpcap

    frames = [f for f in rdpcap(str(PCAPS / "ll_r2_noise_faults" / "rank1_both.pcapng"))
              if not (UDP in f and f[UDP].dport == 4791)]
    p = tmp_path / "no_roce.pcap"
    wrpcap(str(p), frames)
    return str(p), len(frames)


def test_a_capture_without_roce_fails_with_what_it_holds(tmp_path):
    cap, n = _without_roce(tmp_path)
    for extra in ([], ["--config", str(DEMO / "job.toml")]):
        res = CliRunner().invoke(main, ["replay", "--quiet", cap, *extra], catch_exceptions=False)
        assert res.exit_code == 1, res.output
        assert f"error: no RoCEv2 traffic (UDP port 4791) in {n} frames (" in res.stderr
        assert "arp " in res.stderr and "tcp " in res.stderr


def test_a_replica_without_training_needs_the_optimizer_stated(tmp_path):
    """Without a job file's [training], --checkpoint-dir is refused unless --optimizer or --lr says
    what the replica steps with; stated, the assumption is said and the checkpoints committed."""
    args = ["replay", "--quiet", *DEMO_CAPTURES, "--checkpoint-dir", str(tmp_path / "ck")]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 2 and "the replica needs the trainer's optimizer and the job names none" in res.stderr
    assert not (tmp_path / "ck").exists()
    res = CliRunner().invoke(main, args + ["--optimizer", "adam", "--lr", "1e-3"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "warning: the replica steps with adam at lr 0.001 (torch's defaults otherwise), as stated" in res.stderr
    assert f"checkpoints: 10 committed, latest {tmp_path / 'ck'}/step-00000010" in res.stdout
    # with [training] in the job file, stated options are not used, and it says so
    res = CliRunner().invoke(main, ["replay", "--quiet", "--config", str(DEMO / "job.toml"), "--lr", "0.5",
                                    "--checkpoint-dir", str(tmp_path / "ck2")], catch_exceptions=False)
    assert res.exit_code == 0 and "note: --lr ignored: the job file's [training] names" in res.stderr


def test_an_unwritable_checkpoint_dir_is_refused_before_the_replay(tmp_path):
    (tmp_path / "file").write_text("")
    res = CliRunner().invoke(main, ["replay", "--checkpoint-dir", str(tmp_path / "file" / "ck")])
    assert res.exit_code == 2 and f"error: --checkpoint-dir {tmp_path / 'file' / 'ck'}: cannot write there (" \
        in res.stderr


def test_replay_lists_the_first_incomplete_allreduces_and_all_with_verbose():
    """20 incomplete all-reduces (rank 0's egress lacks a chunk of each): 5 listed and a count;
    --verbose lists every one."""
    cap = str(FLOWCHECK / "iter_40000_p2p_iter10.pcapng")
    short = CliRunner().invoke(main, ["replay", cap], catch_exceptions=False)
    assert short.exit_code == 0
    listed = [x for x in short.stdout.splitlines() if x.startswith("incomplete: all-reduce ")]
    assert len(listed) == 5 and listed[0].startswith("incomplete: all-reduce 0 (iteration 0, bucket 0): 5000 x "
                                                     "float32, coverage 0.6144, holes [[3072, 1928]]")
    assert "incomplete: 15 more (--verbose lists them" in short.stdout
    assert "20 all-reduces (0 complete, 20 incomplete), 0/20 iterations complete" in short.stdout
    full = CliRunner().invoke(main, ["replay", "--verbose", cap], catch_exceptions=False)
    assert len([x for x in full.stdout.splitlines() if x.startswith("incomplete: all-reduce ")]) == 20
    assert "more (--verbose" not in full.stdout


def test_digests_hashed_side_by_side_are_each_results_own(monkeypatch):
    """Several hashing threads: each all-reduce's digest is still its own bytes' sha256, whatever
    order the threads finish in, and the default asks for one thread per two cores past two."""
    rng = np.random.default_rng(5)
    bufs = [rng.integers(0, 256, int(n), dtype=np.uint8) for n in rng.integers(1, 3 << 20, 24)]
    d = cmd_replay.Digests(workers=3)
    assert d.depth == 6
    futures = [d.submit(b) for b in bufs]
    d.close()
    assert [f.result() for f in futures] == [hashlib.sha256(b).hexdigest() for b in bufs]
    for cores, want in ((1, 1), (2, 1), (3, 1), (4, 2), (8, 4), (64, 4)):
        monkeypatch.setattr(cmd_replay.os, "sched_getaffinity", lambda _, n=cores: set(range(n)))
        assert cmd_replay.Digests.default_workers() == want
