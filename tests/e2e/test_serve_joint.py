"""One sharded job followed by two `mirrorckpt serve` processes, one per appliance ([joint]): a
generated FSDP2 HSDP job with global-norm clipping, each appliance's serve following its own
group's ring from its own job file; the two agree on every iteration's global norm through their
process group's store and write one joint checkpoint equal to the trainer's state. A job file
whose [[ring]] is another appliance's group, and an appliance whose peer never joins, are refused
in words. With [control] each appliance's plane takes its group's registration and the trainer's
coefficients."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mirrorckpt.config.jobfile import dump_job, load_job
from mirrorckpt.config.training import ClipSpec, OptimizerSpec, TrainingSpec
from mirrorckpt.tools.generator.sharded_wire import ShardedWireConfig, generate_sharded_wire
from mirrorckpt.tools.testbed.harness import free_port
from mirrorckpt.updater import ckptdir, restore
from mirrorckpt.updater.manifest import read_manifest

MODEL = "mlp:16,33,8"
STEPS = 3
CLIPPED = TrainingSpec(optimizer=OptimizerSpec(name="adam", lr=0.01), clip=ClipSpec(max_norm=0.05))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    cfg = ShardedWireConfig(scheme="hsdp", ranks=2, shard=2, model=MODEL, steps=STEPS, protocol="Simple",
                            training=CLIPPED, seed=4)
    return generate_sharded_wire(cfg, tmp_path_factory.mktemp("joint") / "gen")


def appliance_file(job, tmp: Path, appliance: str, address: str, groups: list[str], root: Path,
                   control: dict | None = None, ports: dict | None = None) -> Path:
    """The generated job file cut to ``groups``' [[ring]]s, as appliance ``appliance``'s serve; with
    ``control`` (and each group's plane port) the trainer registers the layout and initial state."""
    cfg = load_job(job.out / "job.toml")
    rings = [dataclasses.replace(rc, listen=f"127.0.0.1:{ports[rc.group]}" if ports else None)
             for rc in cfg.rings if rc.group in groups]
    joint = {"appliance": appliance, "address": address, "timeout_seconds": 60}
    changes = dict(rings=rings, shards_path=str(job.out / "shards.json"), joint=joint, persist={"directory": str(root)})
    if control is not None:
        joint.update(rank=job.layout.appliances.index(appliance), world=len(job.layout.appliances))
        changes.update(shards_path="", initial=None, control=control)
    path = tmp / f"{appliance}.toml"
    path.write_text(dump_job(dataclasses.replace(cfg, **changes)))
    return path


def serve(path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def logs(err: str) -> list[dict]:
    return [json.loads(line) for line in err.splitlines() if line.startswith("{")]


def test_two_appliances_write_one_joint_checkpoint_with_global_norm_clipping(job, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    root = tmp_path / "ck"
    names = {g.appliance: g.name for g in job.layout.groups}
    assert len(names) == 2
    procs = {a: serve(appliance_file(job, tmp_path, a, address, [g], root)) for a, g in names.items()}
    out = {}
    try:
        for a, p in procs.items():
            out[a] = p.communicate(timeout=180)[1]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for a, p in procs.items():
        assert p.returncode == 0, (a, out[a][-3000:])
        records = logs(out[a])
        stopped = [r for r in records if r["msg"] == "appliance stopped"]
        assert [r["ring"] for r in stopped] == [names[a]]  # each serve followed its own group alone
        assert stopped[0]["iterations_applied"] == STEPS and stopped[0]["iterations_incomplete"] == 0
        assert any(r["msg"].startswith("at stop the job was protected") for r in records), out[a][-2000:]
    # the global norm was above max_norm every step: a replica that did not clip by it would differ
    norms = json.loads((job.out / "truth.json").read_text())["grad_norms"]
    assert len(norms) == STEPS and min(norms) > CLIPPED.clip.max_norm
    sel = restore.select(root, verify_data=True)
    assert sel.path == root / ckptdir.step_dirname(STEPS) and not sel.problems, sel.problems
    m = read_manifest(sel.path)
    assert m["joint"]["appliances"] == 2 and m["joint"]["shards"] == job.layout.to_dict()
    md = ckptdir.dcp_module().FileSystemReader(sel.path).read_metadata()
    got = restore._read_flat(sel.path, [k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")], md)
    want = job.state()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_a_ring_of_another_appliance_is_refused(job, tmp_path):
    g0 = job.layout.groups[0]
    other = next(g for g in job.layout.groups if g.appliance != g0.appliance)
    path = appliance_file(job, tmp_path, g0.appliance, f"127.0.0.1:{free_port()}", [g0.name, other.name],
                          tmp_path / "ck")
    res = subprocess.run([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr[-2000:]
    assert (f"[[ring]] #2 group: {other.name!r} is followed by appliance {other.appliance!r} in shards.json, not "
            f"by this serve's [joint] appliance {g0.appliance!r}") in res.stderr, res.stderr[-2000:]


def test_a_peer_that_never_joins_is_not_protected(job, tmp_path):
    g0 = job.layout.groups[0]
    path = appliance_file(job, tmp_path, g0.appliance, f"127.0.0.1:{free_port()}", [g0.name], tmp_path / "ck")
    path.write_text(path.read_text().replace("timeout_seconds = 60", "timeout_seconds = 2"))
    res = subprocess.run([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "job NOT PROTECTED: the appliances' process group at 127.0.0.1:" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "ck").exists() or not ckptdir.step_dirs(tmp_path / "ck")


def test_two_appliances_attached_over_the_control_plane(job, tmp_path):
    """With [control] and no layout in the job files ([joint] gives rank and world): each group's
    trainer registers at its appliance's plane and reports the clipping coefficient it applied;
    one joint checkpoint equal to the trainer's state."""
    from mirrorckpt.control import messages as m
    from mirrorckpt.control.endpoint import ControlClient
    from mirrorckpt.tools.generator.models import build_model
    from mirrorckpt.tools.testbed.joint import register_message
    from mirrorckpt.updater.shard_clip import clip_coefficient

    secret = "serve-joint-secret-0123456789abcdef"
    (tmp_path / "secret").write_text(secret)
    address, root = f"127.0.0.1:{free_port()}", tmp_path / "ck"
    ports = {g.name: free_port() for g in job.layout.groups}
    procs = {}
    control = {"secret_file": str(tmp_path / "secret")}
    for g in job.layout.groups:
        procs[g.appliance] = serve(appliance_file(job, tmp_path, g.appliance, address, [g.name], root, control, ports))
    initial = {k: v.detach() for k, v in build_model(MODEL, seed=job.cfg.seed).named_parameters()}
    truth = json.loads((job.out / "truth.json").read_text())
    coefs = [float(clip_coefficient(torch.tensor(n, dtype=torch.float32), CLIPPED.clip.max_norm))
             for n in truth["grad_norms"]]
    clients, out = [], {}
    try:
        for name, port in ports.items():
            cli = ControlClient("127.0.0.1", port, secret, backoff_max=0.2).start()
            clients.append(cli)
            assert cli.wait_connected(60), f"plane of {name} not reachable"
            cli.send(register_message(job.layout, name, initial, CLIPPED.to_dict()))
            for it, norm, coef in zip(truth["groups"][name]["iterations"], truth["grad_norms"], coefs):
                cli.send(m.make(m.STEP_META, step=it["step"], lr=it["lr"], loss_scale=None,
                                clip={"total_norm": norm, "coef": coef}))
        for a, p in procs.items():
            out[a] = p.communicate(timeout=180)[1]
    finally:
        for cli in clients:
            cli.close()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    for a, p in procs.items():
        assert p.returncode == 0, (a, out[a][-3000:])
    sel = restore.select(root, verify_data=True)
    assert sel.path == root / ckptdir.step_dirname(STEPS) and not sel.problems, sel.problems
    md = ckptdir.dcp_module().FileSystemReader(sel.path).read_metadata()
    got = restore._read_flat(sel.path, [k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")], md)
    for k, v in job.state().items():
        assert torch.equal(got[k], v), k


def test_a_peer_lost_while_following_is_not_protected(job, tmp_path):
    """Appliance 1's serve (paced: its captures take ~40 s) is killed once both follow: appliance 0,
    which already replayed its ring and waits for its peer's norms and rounds, says the group lost a
    member, commits nothing partial and exits 1."""
    address, root = f"127.0.0.1:{free_port()}", tmp_path / "ck"
    first, second = job.layout.groups
    paths = {g.appliance: appliance_file(job, tmp_path, g.appliance, address, [g.name], root) for g in (first, second)}
    survivor = serve(paths[first.appliance])
    doomed = subprocess.Popen([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--pace", "0.00001",
                               "--config", str(paths[second.appliance])],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in doomed.stderr:
            if '"following 1 rings of one job"' in line:
                break
        doomed.kill()
        doomed.wait(30)
        err = survivor.communicate(timeout=120)[1]
    finally:
        for p in (survivor, doomed):
            if p.poll() is None:
                p.kill()
    assert survivor.returncode == 1, err[-3000:]
    said = [r for r in logs(err) if r["msg"].startswith("at stop the job was not protected") and "ring" not in r]
    assert said and "the appliances' group lost a member (RuntimeError: " in said[0]["msg"], err[-3000:]
    assert ".cc:" not in said[0]["msg"]  # gloo's source location is not the operator's business
    assert not list(root.glob(".partial*"))
    assert not ckptdir.step_dirs(root) or not restore.select(root, verify_data=True).problems


def test_appliances_that_do_not_share_the_checkpoint_directory_are_refused(job, tmp_path):
    """Each appliance's [persist] directory a different one (no shared filesystem): both say which
    appliance does not see rank 0's directory, NOT PROTECTED, before following anything."""
    address = f"127.0.0.1:{free_port()}"
    procs = {g.appliance: serve(appliance_file(job, tmp_path, g.appliance, address, [g.name], tmp_path / g.appliance))
             for g in job.layout.groups}
    out = {a: p.communicate(timeout=120)[1] for a, p in procs.items()}
    for a, p in procs.items():
        assert p.returncode == 1, out[a][-2000:]
        assert ("job NOT PROTECTED: [persist] directory: appliance rank(s) [1] do not see the directory of rank 0's"
                in out[a]), out[a][-2000:]
        assert not any(r["msg"] == "following 1 rings of one job" for r in logs(out[a]))
    assert not list((tmp_path / job.layout.appliances[0]).iterdir())  # the probe is gone
