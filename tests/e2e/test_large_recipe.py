"""Issue 15 acceptance: a large model with a real recipe through `mirrorckpt serve`, as a user runs it.

A 2-process CPU DDP job of 84M fp32 parameters (tools.testbed.harness, recipe ``llm``: AdamW in two
param groups, weight decay on the matrices only, OneCycleLR, which moves beta1 every step) is
attached to `mirrorckpt serve` started through the CLI with a job file that has no layout and no
[training] (the trainer's REGISTER brings both), `fallback_parts = 1` and a 256 MiB persist memory
budget. Mid-run the appliance is killed (SIGKILL) and started again: it holds no state, asks the
trainer for a one-part GoCkpt fallback (about 1.3 GB in 64 MiB frames), rebuilds, verifies and
commits it. Every committed checkpoint equals the trainer's state at its step bit for bit
(parameters, both groups' hyper-parameters, Adam state, scheduler, RNG, data position), and so does
a job restored with `restore_from_appliance`. The appliance's peak RSS (VmHWM) stays within 2.5x
the replica's own state (parameters and Adam's two moments).

The appliance captures an idle mirror port (AF_PACKET in a namespace: needs root, as CI has): the
job's all-reduce is not put on the wire here (672 MB of frames a step is more than this 2-core
machine carries in a bounded test), so the state comes from the fallback alone.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import subprocess
import sys

import common
import pytest
from mirrorckpt.tools.testbed import harness
from mirrorckpt.tools.testbed.netns import Topology
from mirrorckpt.updater import ckptdir
from mirrorckpt.updater.dcp_keys import loads
from mirrorckpt.updater.fingerprint import optim_sha256, params_sha256

pytestmark = pytest.mark.root

SECRET = "large-recipe-secret-0123456789abcdef"
WORLD = 2
DIMS = "4096,4096,4096,4096,4096,4096"  # five 4096x4096 Linear layers: 83,906,560 parameters
NPARAMS = 5 * (4096 * 4096 + 4096)
STEPS = 5
BUDGET = 256 << 20
DEADLINE = 240  # seconds for any one wait on a loaded machine (never a timing assertion)

wait_for = functools.partial(common.wait_for, timeout=DEADLINE, poll=0.1)


def job_file(tmp, ring, monitor, control_port: int) -> str:
    secret = tmp / "secret"
    secret.write_text(SECRET)
    addrs = ", ".join(f'"{ring.addresses[r]}"' for r in range(WORLD))
    cfg = tmp / "serve.toml"
    cfg.write_text(f"""
[ring]
nranks = {WORLD}
nchannels = 1
protocol = "Simple"
nccl_version = "{ring.nccl_version}"
addresses = [{addrs}]

[job]
name = "llm-84m"
kind = "ddp"
startup = false

[persist]
directory = "{tmp / 'ckpt'}"
every_iterations = 1
keep_last = 100
memory_budget_bytes = {BUDGET}

[[mirror]]
rank = 0
direction = "egress"
source = "afpacket:{monitor.ifname}@{monitor.netns}"

[capture]
queue_bytes = 67108864

[control]
listen = "127.0.0.1:{control_port}"
secret_file = "{secret}"
fallback_parts = 1
fingerprint_every = 2
""")
    return str(cfg)


class Serve:
    """`mirrorckpt serve` as a subprocess, with its peak RSS read from /proc before it ends."""

    def __init__(self, cfg: str, log):
        self.log = open(log, "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", cfg],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.hwm = 0

    def peak(self) -> int:
        """VmHWM of the appliance process (bytes), kept as it was last seen."""
        try:
            text = open(f"/proc/{self.proc.pid}/status").read()
        except OSError:
            return self.hwm
        for line in text.splitlines():
            if line.startswith("VmHWM:"):
                self.hwm = max(self.hwm, int(line.split()[1]) * 1024)
        return self.hwm

    def stop(self, sig) -> int:
        self.peak()
        self.proc.send_signal(sig)
        rc = self.proc.wait(DEADLINE)
        self.log.close()
        return rc


def listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def committed(root) -> list[int]:
    return [s for s, _ in ckptdir.committed(root)] if root.exists() else []


def plain(v):
    """Tagged-JSON values with tuples as lists (a checkpoint stores betas as a list)."""
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    return v


def groups(gs) -> list:
    """Param groups without params; the implementation flags torch leaves at None (its default,
    off on the CPU) read as False, as the replica's optimizer states them."""
    out = []
    for g in gs:
        g = {k: v for k, v in g.items() if k != "params"}
        out.append(plain({k: (False if k in ("foreach", "fused", "capturable") and v is None else v)
                          for k, v in g.items()}))
    return out


def state_digest(st) -> dict:
    """A restored ReplicaState in the harness's digest terms."""
    names = list(st.params)
    return {"params": params_sha256([st.params[n] for n in names]),
            "optim": optim_sha256([st.optim["state"].get(n, {}) for n in names]),
            "groups": groups(st.optim["param_groups"]), "sched_state": plain(st.lr_scheduler),
            "rng": hashlib.sha256(st.rng["torch"].numpy().tobytes()).hexdigest(), "data": st.data_position}


def trainer_digest(d: dict) -> dict:
    return {"params": d["params"], "optim": d["optim"], "groups": groups(loads(d["groups"])),
            "sched_state": plain(loads(d["sched_state"])), "rng": d["rng"], "data": d["data"]}


def registered(log) -> bool:
    return log.exists() and "registered at step 0" in log.read_text()


def test_large_recipe_survives_an_appliance_restart(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("needs root (namespaces, AF_PACKET); CI runs it as root")
    from mirrorckpt.updater.restore import read_state

    ring, _ = harness.ring_for(WORLD, protocol="Simple")
    control_port = harness.free_port()
    root, job, restored = tmp_path / "ckpt", tmp_path / "job", tmp_path / "restored"
    pause = tmp_path / "pause"
    recipe = ["--recipe", "llm", "--total-steps", "20", "--dims", DIMS, "--protocol", "Simple", "--digest-ranks", "0"]
    procs, serves = None, []
    with Topology(hosts=WORLD, monitors=1) as topo:
        cfg = job_file(tmp_path, ring, topo.monitors[0], control_port)
        try:
            serves.append(Serve(cfg, tmp_path / "serve1.log"))
            assert wait_for(lambda: listening(control_port)), "serve did not come up"
            procs = harness.spawn_ranks(WORLD, job, SECRET, control_port=control_port, steps=STEPS,
                                        extra=[*recipe, "--parts", "1", "--fingerprint-every", "2",
                                               "--wait-file", str(pause)])
            assert wait_for(lambda: registered(tmp_path / "serve1.log") and len(harness.read_digests(job)) >= 2,
                            timeout=2 * DEADLINE), "the job did not register and take two steps"
            pause.touch()  # the job holds still while the appliance is away and comes back
            serves[0].stop(signal.SIGKILL)
            killed_at = max(harness.read_digests(job))
            serves.append(Serve(cfg, tmp_path / "serve2.log"))
            assert wait_for(lambda: listening(control_port)), "serve did not come back"
            pause.unlink()
            harness.wait_ranks(procs, job, timeout=4 * DEADLINE)
            assert wait_for(lambda: committed(root)), "nothing committed after the restart"
            harness.wait_ranks(harness.spawn_ranks(WORLD, restored, SECRET, control_port=control_port, steps=0,
                                                   extra=[*recipe, "--restore", "appliance", "--digest-restored"]),
                               restored, timeout=DEADLINE)
            serves[1].peak()
            assert serves[1].stop(signal.SIGTERM) == 0
        finally:
            for s in serves:
                if s.proc.poll() is None:
                    s.proc.kill()
            if procs:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
    events = [json.loads(x) for x in (tmp_path / "serve2.log").read_text().splitlines() if x.startswith("{")]
    resynced = [e["msg"] for e in events if "resynced at step" in e["msg"]]
    assert len(resynced) == 1, resynced  # one fallback, verified against the trainer's fingerprints
    trainer = harness.read_digests(job)
    assert sorted(trainer) == list(range(1, STEPS + 1))
    steps = committed(root)
    assert steps and min(steps) > killed_at, (steps, killed_at)  # the state came from the fallback
    for s in steps:  # every checkpoint is the trainer's state at its step
        assert state_digest(read_state(root / ckptdir.step_dirname(s))) == trainer_digest(trainer[s]), f"step {s}"
    got = harness.read_digests(restored)
    assert list(got) == [max(steps)] and got[max(steps)]["restored"]
    assert trainer_digest(got[max(steps)]) == trainer_digest(trainer[max(steps)])
    state_bytes = 12 * NPARAMS  # fp32 parameters and Adam's two moments
    peaks = [s.hwm for s in serves]
    print(f"appliance peak RSS {[round(p / 2**20) for p in peaks]} MiB, replica state {state_bytes / 2**20:.0f} MiB, "
          f"ratio {max(peaks) / state_bytes:.2f}")
    assert max(peaks) <= 2.5 * state_bytes, (peaks, state_bytes)
