"""Issue 14 re-arm acceptance: a CPU DDP job is killed and resumed from the appliance
(``restore_from_appliance``) while the same ``mirrorckpt serve`` keeps running; the appliance
follows the resumed run, and its checkpoints equal the trainer's state at every step after the
resume.

``serve`` runs as a user starts it, from a job file that holds no layout and no recipe (the
trainer's REGISTER brings them), only the ring as the first run shows it, the mirror source
(``afpacket:IFACE@NETNS``), the control plane, persistence and metrics. The ranks
(tools.testbed.harness) hand their NCCL frames to a relay that injects them from each rank's
namespace; tc mirrors both ranks' ports to the monitor. Both ranks are SIGKILLed mid-run and
started again with ``--restore appliance`` on a new communicator (another ring seed: other NIC
addresses, QPs and UDP ports). Needs root, as CI has.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mirrorckpt.config.layout import JobLayout
from mirrorckpt.config.training import TrainingSpec
from mirrorckpt.tools.cmd_status import fetch
from mirrorckpt.tools.testbed import harness
from mirrorckpt.updater import ckptdir, restore
from mirrorckpt.updater.replica import Replica

pytestmark = pytest.mark.root

SECRET = "serve-rearm-secret-0123456789abcdef"
WORLD = 2
KILL_AFTER = 6  # committed steps of the first run before both ranks are killed
RESUMED_STEPS = 10  # steps of the resumed run
DEADLINE = 120  # seconds for any one wait on a loaded machine (never a timing assertion)
JOB_ARGS = ["--dims", "64,128,32", "--fingerprint-every", "2"]


def job_file(tmp: Path, ring, mon, control: int, metrics: int) -> Path:
    """What an operator writes: no [[job.params]], no [training]."""
    (tmp / "secret").write_text(SECRET)
    addresses = ", ".join(f'"{ring.addresses[r]}"' for r in range(ring.nranks))
    path = tmp / "job.toml"
    path.write_text(f"""
[ring]
nranks = {ring.nranks}
nchannels = {ring.nchannels}
protocol = "{ring.protocol}"
nccl_version = "{ring.nccl_version}"
addresses = [{addresses}]

[job]
kind = "ddp"
startup = false

[[mirror]]
rank = 0
direction = "egress"
source = "afpacket:{mon.ifname}@{mon.netns}"

[persist]
directory = "{tmp / 'ckpt'}"
every_iterations = 1
keep_last = 1000

[control]
listen = "127.0.0.1:{control}"
secret_file = "{tmp / 'secret'}"
fallback_parts = 3
fingerprint_every = 2

[metrics]
listen = "127.0.0.1:{metrics}"
""")
    return path


def wait(cond, what: str, serve: subprocess.Popen, log: Path, procs=()) -> None:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        assert serve.poll() is None, f"serve exited ({serve.returncode}) before {what}:\n{log.read_text()[-4000:]}"
        for p in procs:
            assert p.poll() in (None, 0), f"a rank exited {p.returncode} before {what}"
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {DEADLINE} s:\n{log.read_text()[-4000:]}")


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def newest(root: Path) -> int:
    p = ckptdir.latest(root) if root.exists() else None
    return ckptdir.parse_step(p.name) if p is not None else 0


def metric(port: int, name: str) -> float:
    return sum(fetch(f"http://127.0.0.1:{port}/metrics").get(name, {}).values())


def test_killed_job_resumes_from_the_appliance_and_serve_follows(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("needs root (namespaces, tc, AF_PACKET); CI runs it as root")
    ring, _ = harness.ring_for(WORLD)  # the first run's communicator (ring seed 1)
    control, metrics = harness.free_port(), harness.free_port()
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "first", tmp_path / "second"
    frames = harness.FrameStreamServer(WORLD, end_on_close=False)  # the resumed rank 0 reconnects
    log = tmp_path / "serve.log"
    serve = None
    procs: list = []
    with harness.relayed_mirror(frames, WORLD) as topo:  # each rank's egress reaches the monitor
        cfg = job_file(tmp_path, ring, topo.monitors[0], control, metrics)
        try:
            with open(log, "w") as err:
                serve = subprocess.Popen([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", str(cfg)],
                                         stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
            wait(lambda: listening(control), "control plane", serve, log)
            procs = harness.spawn_ranks(WORLD, first, SECRET, control_port=control, frames_port=frames.port,
                                        steps=100_000, extra=[*JOB_ARGS, "--step-delay", "0.1"])
            wait(lambda: newest(ckpt) >= KILL_AFTER, f"checkpoint of step {KILL_AFTER}", serve, log, procs)
            for p in procs:
                p.send_signal(signal.SIGKILL)
            for p in procs:
                p.wait()
            killed_at = max(harness.read_digests(first))
            procs = harness.spawn_ranks(WORLD, second, SECRET, control_port=control, frames_port=frames.port,
                                        steps=RESUMED_STEPS,
                                        extra=[*JOB_ARGS, "--restore", "appliance", "--ring-seed", "2"])
            harness.wait_ranks(procs, second, timeout=DEADLINE)
            trainer = harness.read_digests(second)
            resumed, last = min(trainer) - 1, max(trainer)
            assert last == resumed + RESUMED_STEPS
            wait(lambda: newest(ckpt) >= last, f"checkpoint of step {last}", serve, log)
            rearms = metric(metrics, "mirrorckpt_rearms_total")
            status = subprocess.run([sys.executable, "-m", "mirrorckpt.tools.cli", "status", "--config", str(cfg)],
                                    capture_output=True, text=True, timeout=60)
            serve.send_signal(signal.SIGTERM)
            code = serve.wait(timeout=DEADLINE)
            assert code == 0, log.read_text()[-4000:]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            if serve is not None and serve.poll() is None:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait()
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    assert resumed <= killed_at
    # one appliance process throughout: it saw the restart as a re-arm, kept its replica (the
    # restored state was its own), and never needed a fallback
    assert rearms == 1 and "re-arms: 1" in status.stdout, status.stdout
    assert any("restarted from step" in d["msg"] and "from the replica as it is" in d["msg"] for d in lines)
    assert not any("fallback requested" in d["msg"] for d in lines), [d["msg"] for d in lines]
    # every committed checkpoint after the resume is the trainer's state at that step
    after = [(s, p) for s, p in ckptdir.committed(ckpt) if s > resumed]
    assert [s for s, _ in after] == list(range(resumed + 1, last + 1)), [s for s, _ in after]
    for step, path in after:
        assert restore.verify(path).ok, path
        st = restore.read_state(path)
        rep = Replica(JobLayout.from_dict(st.layout), TrainingSpec.from_dict(st.training), st)
        want = trainer[step]
        assert rep.state_sha256() == (want["params"], want["optim"]), f"step {step}"
        assert st.data_position == want["data"], f"step {step}"
