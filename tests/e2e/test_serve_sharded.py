"""`mirrorckpt serve` of sharded-optimizer jobs from one job file of [[ring]] tables (file sources):
generated FSDP2 HSDP (2 and 3 ranks per replica ring, with global-norm clipping across the shards)
and DeepSpeed ZeRO-2 jobs with 2 shard indices, LL and Simple: every shard's replica equals the
trainer's, one joint checkpoint, which dcp.load puts into the unsharded model bit-exactly; a pure
FSDP job followed for weights only: every step's snapshot equals the trainer's parameters and
says it is weights only; malformed job files refused in words."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mirrorckpt.config.training import ClipSpec, OptimizerSpec, TrainingSpec
from mirrorckpt.tools.generator.models import build_model
from mirrorckpt.tools.generator.sharded_wire import ShardedWireConfig, generate_sharded_wire
from mirrorckpt.tools.generator.train import build_optimizer
from mirrorckpt.updater import ckptdir, restore
from mirrorckpt.updater.manifest import read_manifest, tensor_sha256

MODEL = "mlp:16,33,8"  # 33 rows: FSDP2 pads a shard; ZeRO cuts a parameter between partitions
TRAINING = TrainingSpec(optimizer=OptimizerSpec(name="adamw", lr=0.01, weight_decay=0.01))
CLIPPED = TrainingSpec(optimizer=OptimizerSpec(name="adam", lr=0.01), clip=ClipSpec(max_norm=0.05))
STEPS = 3
CASES = {
    "hsdp-2x2-LL": ShardedWireConfig(scheme="hsdp", ranks=2, shard=2, model=MODEL, steps=STEPS, protocol="LL",
                                     training=TRAINING),
    "zero2-dp2-Simple": ShardedWireConfig(scheme="zero", ranks=2, model=MODEL, steps=STEPS, protocol="Simple",
                                          training=TRAINING),
    "hsdp-3x2-Simple-clip": ShardedWireConfig(scheme="hsdp", ranks=3, shard=2, model=MODEL, steps=STEPS,
                                              protocol="Simple", training=CLIPPED, seed=4),
}


def serve(job_dir: Path, tmp: Path, keep_last: int = 3) -> tuple[subprocess.CompletedProcess, Path]:
    root = tmp / "ck"
    text = (job_dir / "job.toml").read_text()
    text = text.replace("\n[training]", f'\n[persist]\ndirectory = "{root}"\nkeep_last = {keep_last}\n\n[training]', 1)
    cfg = tmp / "serve.toml"
    cfg.write_text(text.replace('source = "', f'source = "{job_dir}/').replace('shards = "', f'shards = "{job_dir}/')
                   .replace('initial = "', f'initial = "{job_dir}/'))
    res = subprocess.run([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=300)
    return res, root


def logs(res) -> list[dict]:
    return [json.loads(line) for line in res.stderr.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_job_served_from_one_job_file(case, tmp_path):
    cfg = CASES[case]
    job = generate_sharded_wire(cfg, tmp_path / "gen")
    res, root = serve(job.out, tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    records = logs(res)
    stopped = {r["ring"]: r for r in records if r["msg"] == "appliance stopped"}
    assert sorted(stopped) == sorted(g.name for g in job.layout.groups)
    assert all(r["iterations_applied"] == STEPS and r["iterations_incomplete"] == 0 for r in stopped.values())
    assert any(r["msg"].startswith("at stop the job was protected") and "ring" not in r for r in records)
    # one joint checkpoint of the whole model at the last step, equal to the trainer's state
    sel = restore.select(root, verify_data=True)
    assert sel.path == root / ckptdir.step_dirname(STEPS) and not sel.problems, sel.problems
    m = read_manifest(sel.path)
    assert m["joint"]["shards"] == job.layout.to_dict() and not m.get("weights_only")
    want = job.state()
    md = ckptdir.dcp_module().FileSystemReader(sel.path).read_metadata()
    got = restore._read_flat(sel.path, [k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")], md)
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    # the unsharded trainer resumes from it through dcp.load, bit-exactly
    model = build_model(MODEL, seed=99)  # other initial weights: every value must come from the checkpoint
    opt = build_optimizer(list(model.parameters()), cfg.training.optimizer)
    resumed = restore.load_into(model, opt, root)
    assert (resumed.iterations_done, resumed.step) == (STEPS, STEPS)
    for n, p in model.named_parameters():
        assert torch.equal(p, want[f"model.{n}"]), n
        for k, v in opt.state[p].items():
            assert torch.equal(v, want[f"optim.state.{n}.{k}"]), (n, k)
    if cfg.training.clip is not None:  # the shards clipped by the global norm, which was above max_norm
        norms = json.loads((job.out / "truth.json").read_text())["grad_norms"]
        assert len(norms) == STEPS and min(norms) > cfg.training.clip.max_norm


def test_pure_fsdp_followed_for_weights_only(tmp_path):
    cfg = ShardedWireConfig(scheme="fsdp", shard=2, model=MODEL, steps=STEPS, protocol="LL", training=TRAINING)
    job = generate_sharded_wire(cfg, tmp_path / "gen")
    truth = json.loads((job.out / "truth.json").read_text())
    res, root = serve(job.out, tmp_path, keep_last=10)
    assert res.returncode == 0, res.stderr[-3000:]
    records = logs(res)
    assert any("weights only" in r["msg"] or "weights only" in str(r.get("verdict", "")) for r in records)
    steps = [s for s, _ in ckptdir.step_dirs(root)]
    assert steps == list(range(STEPS))  # each step's all-gathers carry the weights before that step's update
    for s, d in ckptdir.step_dirs(root):
        m = read_manifest(d)
        assert m["weights_only"] is True and m["step"] == s
        assert {k.removeprefix("model."): t["sha256"] for k, t in m["tensors"].items()} == truth["params"][s]
    out = subprocess.run([sys.executable, "-m", "mirrorckpt.tools.cli", "restore", "--verify", str(root)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "WEIGHTS ONLY" in out.stdout and "every file and tensor sha256 matches" in out.stdout
    model = build_model(MODEL, seed=99)
    opt = build_optimizer(list(model.parameters()), cfg.training.optimizer)
    with pytest.raises(restore.CheckpointError, match="weights only"):
        restore.load_into(model, opt, root)
    with pytest.raises(restore.CheckpointError, match="weights only"):
        restore.read_state(root)
    resumed = restore.load_into(model, None, root, weights_only=True)
    assert resumed.iterations_done == STEPS - 1
    assert {n: tensor_sha256(p.detach()) for n, p in model.named_parameters()} == truth["params"][STEPS - 1]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return generate_sharded_wire(ShardedWireConfig(scheme="hsdp", ranks=2, shard=2, model=MODEL, steps=1),
                                 tmp_path_factory.mktemp("small")).out


@pytest.mark.parametrize("edit,words", [
    (lambda t: t.replace('group = "pp0-tp0-sh1"', 'group = "pp0-tp0-sh9"'),
     "[[ring]] #2 group: 'pp0-tp0-sh9' is not a group of shards.json"),
    (lambda t: t.replace('initial = "seed"\n', ""),
     "[job] initial: missing; FSDP2 broadcasts nothing at start"),
    (lambda t: t.replace("rank0_egress.pcapng", "absent.pcapng"),
     "[[ring]] #1 [[ring.mirror]] #1 source: no capture file"),
])
def test_serve_refuses_a_malformed_sharded_job_file(small, tmp_path, edit, words):
    cfg = small / f"bad-{tmp_path.name}.toml"
    cfg.write_text(edit((small / "job.toml").read_text()))
    res = subprocess.run([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and words in res.stderr, res.stderr[-2000:]


def test_sharded_job_attached_over_the_control_plane(tmp_path):
    """With [control] every ring's group has its control plane ([[ring]] listen): the trainer's sharded
    REGISTER of each group (its initial state, at step 0) brings the layout (the job file names none),
    its step metadata lets the replicas step; one joint checkpoint equal to the trainer's state."""
    from mirrorckpt.control import messages as m
    from mirrorckpt.control.endpoint import ControlClient
    from mirrorckpt.tools.testbed.harness import free_port
    from mirrorckpt.tools.testbed.joint import register_message

    cfg = ShardedWireConfig(scheme="hsdp", ranks=2, shard=2, model=MODEL, steps=STEPS, protocol="Simple",
                            training=TRAINING)
    job = generate_sharded_wire(cfg, tmp_path / "gen")
    secret = "serve-sharded-secret-0123456789ab"
    (tmp_path / "secret").write_text(secret)
    ports = {g.name: free_port() for g in job.layout.groups}
    text = (job.out / "job.toml").read_text().replace('initial = "seed"\n', "").replace('shards = "shards.json"\n',
                                                                                          "")
    for name, port in ports.items():
        text = text.replace(f'group = "{name}"\n', f'group = "{name}"\nlisten = "127.0.0.1:{port}"\n')
    root = tmp_path / "ck"
    text = text.replace("\n[training]", f'\n[control]\nsecret_file = "{tmp_path / "secret"}"\n\n[persist]\n'
                        f'directory = "{root}"\n\n[training]', 1)
    serve_toml = tmp_path / "serve.toml"
    serve_toml.write_text(text.replace('source = "', f'source = "{job.out}/'))
    proc = subprocess.Popen([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", str(serve_toml)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    initial = dict(build_model(MODEL, seed=cfg.seed).named_parameters())
    seed = _flat(job.out / "seed")
    assert all(torch.equal(seed[f"model.{k}"], v) for k, v in initial.items()), "REGISTER weights differ from the seed"
    clients = []
    truth = json.loads((job.out / "truth.json").read_text())["groups"]
    try:
        for name, port in ports.items():  # each group's REGISTER (its initial state), then its steps' metadata
            cli = ControlClient("127.0.0.1", port, secret, backoff_max=0.2).start()
            clients.append(cli)
            assert cli.wait_connected(60), f"plane of {name} not reachable"
            cli.send(register_message(job.layout, name, {k: v.detach() for k, v in initial.items()},
                                      cfg.training.to_dict()))
            for it in truth[name]["iterations"]:
                cli.send(m.make(m.STEP_META, step=it["step"], lr=it["lr"], loss_scale=None))
        out, err = proc.communicate(timeout=240)
    finally:
        for cli in clients:
            cli.close()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    sel = restore.select(root, verify_data=True)
    assert sel.path == root / ckptdir.step_dirname(STEPS) and not sel.problems, (sel.problems, err[-2000:])
    got = _flat(sel.path)
    wrong = {k: (float((got[k] - v).abs().max()), int((got[k] != v).sum())) for k, v in job.state().items()
             if not torch.equal(got[k], v)}
    if wrong:  # which committed step first left the trainer's parameters, and what the appliance said
        steps = {}
        for d in sorted(root.glob("step-*")):
            s = ckptdir.parse_step(d.name)
            if s < STEPS:
                ours = {k[6:]: tensor_sha256(t) for k, t in _flat(d).items() if k.startswith("model.")}
                steps[s] = sorted(n for n, h in job.params[s].items() if ours.get(n) != h)
        said = [line for line in err.splitlines() if '"warning"' in line or '"error"' in line]
        raise AssertionError(f"differs from the trainer (max |diff|, elements): {wrong}; earlier committed steps' "
                             f"differing parameters: {steps}; the appliance's warnings: {said[-20:]}")


def _flat(path: Path) -> dict:
    md = ckptdir.dcp_module().FileSystemReader(path).read_metadata()
    return restore._read_flat(path, [k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")], md)
