"""verify() and `mirrorckpt restore` catch damaged checkpoints and name what is damaged; load_into
resumes a trainer (model, optimizer, scheduler, GradScaler) bit-exactly."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from mirrorckpt.tools.cmd_restore import restore as restore_cmd
from mirrorckpt.updater.manifest import read_manifest, write_manifest
from mirrorckpt.updater.persist import write_checkpoint
from mirrorckpt.updater.replica import LayoutMismatch, Replica
from mirrorckpt.updater.restore import CheckpointError, load_into, read_state, verify


def _load_sibling(name):
    spec = importlib.util.spec_from_file_location(f"_mirrorckpt_{name}", Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


R = _load_sibling("test_replica")


def make_checkpoint(root, name="adamw-bf16-clip-cosine", iterations=3, seed=4):
    training = R.CONFIGS[name]
    layout = R.make_layout(training.grad_dtype)
    init = R.random_init(layout, seed)
    ref = R.RefTrainer(layout, training, init)
    rep = Replica(layout, training, init)
    rng = np.random.default_rng(seed)
    for i in range(iterations):
        scale = ref.scale if ref.scale is not None else 1.0
        it = R.random_iteration(layout, i, rng, scale=scale, inject_inf=i in R.INF_AT.get(name, ()))
        it.meta = {"data_position": {"sample": 32 * (i + 1)}}
        ref.step(i, it.buckets)
        rep.apply(it)
    return write_checkpoint(root, rep.state_dict_for_checkpoint()), rep, ref


def flip(path: Path, offset: int):
    b = bytearray(path.read_bytes())
    b[offset] ^= 0x40
    path.write_bytes(bytes(b))


def test_verify_passes_a_good_checkpoint(tmp_path):
    path, rep, _ = make_checkpoint(tmp_path)
    r = verify(path)
    assert r.ok and r.problems == [] and r.step == 3 and r.optimizer_step == 3
    assert r.files == 2 and r.tensors == len(read_manifest(path)["tensors"]) == 6 * 4


def test_verify_names_the_damaged_value_of_a_flipped_byte(tmp_path):
    path, _, _ = make_checkpoint(tmp_path)
    item = read_manifest(path)["items"]["optim.state.layers.0.fc.weight.exp_avg"]
    flip(path / item["file"], item["offset"] + item["length"] - 30)
    r = verify(path)
    assert not r.ok
    assert r.first_problem == (f"{path}/__0_0.distcp: sha256 does not match the manifest; "
                               "first damaged value: optim.state.layers.0.fc.weight.exp_avg")


def test_verify_catches_missing_manifest_truncation_and_strays(tmp_path):
    path, _, _ = make_checkpoint(tmp_path)
    data = path / "__0_0.distcp"
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[: size - 100])
    r = verify(path)
    assert not r.ok
    assert r.first_problem.startswith(f"{data}: {size - 100} bytes, manifest says {size}; first damaged value: ")

    path2, _, _ = make_checkpoint(tmp_path / "b")
    (path2 / "notes.txt").write_text("x")
    flip(path2 / ".metadata", 10)
    r = verify(path2)
    assert r.problems == [f"{path2}/notes.txt: not listed in the manifest",
                          f"{path2}/.metadata: sha256 does not match the manifest; damage outside the stored values"]

    (path2 / "manifest.json").unlink()
    r = verify(path2)
    assert r.problems == [f"{path2}: no manifest.json (not a committed checkpoint)"]

    path3, _, _ = make_checkpoint(tmp_path / "c")
    m = path3 / "manifest.json"
    m.write_bytes(m.read_bytes().replace(b'"optimizer_step": 3', b'"optimizer_step": 4'))
    assert verify(path3).first_problem == f"{m}: manifest_sha256 does not match its contents"
    (path3 / "__0_0.distcp").unlink()
    m.write_bytes(m.read_bytes().replace(b'"optimizer_step": 4', b'"optimizer_step": 3'))
    assert verify(path3).first_problem == f"{path3}/__0_0.distcp: missing"


def test_verify_reads_tensors_back_and_checks_required_keys(tmp_path):
    path, _, _ = make_checkpoint(tmp_path)
    m = read_manifest(path)
    m["tensors"]["model.head.scale"]["sha256"] = "0" * 64  # files intact, recorded value differs
    write_manifest(path, m)
    assert verify(path).problems == [
        f"{path}: tensor model.head.scale: values read back do not match the manifest sha256"]
    assert verify(path, tensors=False).ok

    m = read_manifest(path)
    m["layout"]["params"].append({"name": "tail.weight", "shape": [2], "dtype": "float32"})
    write_manifest(path, m)
    assert verify(path).first_problem == f"{path}: required key model.tail.weight missing (+3 more)"


def test_cli_restore(tmp_path):
    path, rep, _ = make_checkpoint(tmp_path / "root")
    runner = CliRunner()
    res = runner.invoke(restore_cmd, [str(tmp_path / "root")])
    assert res.exit_code == 0 and f"checkpoint  {path}" in res.output and "3 iterations" in res.output
    res = runner.invoke(restore_cmd, [str(path), "--verify", "--json"])
    assert res.exit_code == 0
    out = json.loads(res.output)
    assert out["ok"] and out["verified"] and out["tensors"] == 24 and out["step"] == 3

    flip(path / "__0_0.distcp", 200)
    res = runner.invoke(restore_cmd, [str(path)])  # sizes still match: only --verify sees it
    assert res.exit_code == 0
    res = runner.invoke(restore_cmd, [str(path), "--verify"])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert f"error: {path}/__0_0.distcp: sha256 does not match the manifest" in res.stderr
    res = runner.invoke(restore_cmd, [str(path), "--verify", "--json"])
    assert res.exit_code == 1 and not json.loads(res.stdout)["ok"]

    res = runner.invoke(restore_cmd, [str(tmp_path / "nowhere")])
    assert res.exit_code == 1 and res.stderr == f"error: {tmp_path / 'nowhere'}: no such directory\n"
    (tmp_path / "empty").mkdir()
    res = runner.invoke(restore_cmd, [str(tmp_path / "empty"), "--json"])
    assert res.exit_code == 1 and "no committed checkpoint" in json.loads(res.stdout)["problems"][0]


def test_load_into_resumes_an_fp16_trainer_with_scheduler_and_grad_scaler(tmp_path):
    name = "adam-fp16-amsgrad-linear"
    path, rep, ref = make_checkpoint(tmp_path / "root", name, iterations=5)
    trainer = R.RefTrainer(rep.layout, rep.training, R.random_init(rep.layout, 99))
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=rep.training.loss_scale.growth_interval)
    info = load_into(trainer.model, trainer.opt, tmp_path / "root", scheduler=trainer.sched, scaler=scaler)
    assert R.state_sha256(trainer.masters, trainer.opt) == rep.state_sha256() == ref.sha()
    assert (info.path, info.iterations_done, info.step) == (path, 5, 4)
    assert info.data_position == {"sample": 160} and info.missing_buffers == []
    assert scaler.state_dict()["scale"] == ref.scale and scaler.state_dict()["_growth_tracker"] == ref.tracker
    assert trainer.sched.state_dict() == ref.sched.state_dict()
    assert [g["lr"] for g in trainer.opt.param_groups] == [g["lr"] for g in ref.opt.param_groups]


def test_load_into_refuses_a_different_model_and_tolerates_buffers(tmp_path):
    make_checkpoint(tmp_path / "root", "adam-fp32")
    layout = R.make_layout()
    model = R.build_module(layout)
    model.register_buffer("running_mean", torch.zeros(3))
    opt = torch.optim.Adam([model.get_parameter(p.name) for p in layout.params], lr=1e-2)
    info = load_into(model, opt, tmp_path / "root")
    assert info.missing_buffers == ["model.running_mean"]

    model.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))
    opt = torch.optim.Adam(list(model.parameters()), lr=1e-2)
    with pytest.raises(CheckpointError, match="the checkpoint has no model.extra .*different model"):
        load_into(model, opt, tmp_path / "root")


def test_replica_resync_from_a_checkpoint_continues_bit_exactly(tmp_path):
    path, rep, ref = make_checkpoint(tmp_path / "root", "sgd-nesterov-clip-step", iterations=3)
    back = Replica(rep.layout, rep.training, R.random_init(rep.layout, 7))
    back.resync(tmp_path / "root")
    assert back.state_sha256() == ref.sha() and back.iterations_done == 3 and back.step == 3
    assert back.data_position == {"sample": 96}
    rng = np.random.default_rng(11)
    for i in range(3, 6):
        it = R.random_iteration(rep.layout, i, rng)
        ref.step(i, it.buckets)
        back.apply(it)
        assert back.state_sha256() == ref.sha()

    other = R.CONFIGS["adam-fp32"]
    with pytest.raises(LayoutMismatch, match="state was made by optimizer 'sgd'"):
        Replica(R.make_layout(), other, path)
    flip(path / "__0_0.distcp", 300)
    with pytest.raises(CheckpointError, match="failed verification: .*__0_0.distcp: sha256"):
        read_state(path)


@pytest.mark.parametrize("path", ["replica", "load_into", "restore_message"])
def test_sgd_with_dampening_resumed_before_its_first_step_steps_like_a_fresh_one(tmp_path, path):
    """A checkpoint taken before the first optimizer step holds placeholder state (DCP needs the
    keys); SGD with dampening clones its first gradient undamped, which no buffer value repeats.
    Every way back (the appliance's replica, a trainer from disk, a trainer from the appliance)
    must step like an optimizer that was never stepped, bit for bit."""
    from mirrorckpt.control.appliance_side import restore_message
    from mirrorckpt.control.trainer import load_restore_state

    name = "sgd-dampening"
    make_checkpoint(tmp_path / "root", name, iterations=0, seed=4)
    training = R.CONFIGS[name]
    layout = R.make_layout(training.grad_dtype)
    fresh = R.RefTrainer(layout, training, R.random_init(layout, 4))  # the run that was never checkpointed
    if path == "replica":
        resumed = Replica(layout, training, R.random_init(layout, 7))
        resumed.load_state(tmp_path / "root")
        assert read_state(tmp_path / "root").unstepped == sorted(p.name for p in layout.params)
    else:
        resumed = R.RefTrainer(layout, training, R.random_init(layout, 7))
        if path == "load_into":
            load_into(resumed.model, resumed.opt, tmp_path / "root")
        else:
            load_restore_state(resumed.model, resumed.opt, None, restore_message(read_state(tmp_path / "root"), "disk"))
    rng = np.random.default_rng(9)
    for i in range(3):
        it = R.random_iteration(layout, i, rng)
        fresh.step(i, it.buckets)
        if path == "replica":
            resumed.apply(it)
        else:
            resumed.step(i, it.buckets)
        assert (resumed.state_sha256() if path == "replica" else resumed.sha()) == fresh.sha(), (path, i)
