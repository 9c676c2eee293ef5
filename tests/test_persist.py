"""DCP checkpoints written by the appliance: key names equal the trainer's get_state_dict, a trainer
in another process loads them bit-exactly, the commit protocol, retention and the background
persister's memory budget."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from mirrorckpt.config.training import PersistSpec
from mirrorckpt.updater import ckptdir, persist
from mirrorckpt.updater.fingerprint import state_sha256
from mirrorckpt.updater.persist import CheckpointExists, Persister, prune, recover, write_checkpoint
from mirrorckpt.updater.replica import Replica
from mirrorckpt.updater.restore import latest, verify
from torch.distributed.checkpoint.state_dict import get_state_dict


def _load_sibling(name):
    spec = importlib.util.spec_from_file_location(f"_mirrorckpt_{name}", Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


R = _load_sibling("test_replica")  # layout, reference trainer and gradient generator


def trained(name="adamw-bf16-clip-cosine", iterations=3, seed=2):
    training = R.CONFIGS[name]
    layout = R.make_layout(training.grad_dtype)
    init = R.random_init(layout, seed)
    ref = R.RefTrainer(layout, training, init)
    rep = Replica(layout, training, init)
    rng = np.random.default_rng(seed)
    for i in range(iterations):
        it = R.random_iteration(layout, i, rng)
        ref.step(i, it.buckets)
        rep.apply(it)
    return training, layout, ref, rep, rng


def stored_keys(directory) -> dict[str, tuple]:
    md = dcp.FileSystemReader(directory).read_metadata()
    return {k: (tuple(v.size), v.properties.dtype) if hasattr(v, "chunks") else "bytes"
            for k, v in md.state_dict_metadata.items()}


@pytest.mark.parametrize("name,iterations", [("adamw-bf16-clip-cosine", 2), ("sgd-nesterov-clip-step", 2),
                                             ("adam-fp16-amsgrad-linear", 1), ("adam-fp32", 0)])
def test_keys_and_shapes_equal_the_trainers_get_state_dict(tmp_path, name, iterations):
    training, layout, ref, rep, _ = trained(name, iterations)
    mine = write_checkpoint(tmp_path / "mine", rep.state_dict_for_checkpoint())
    msd, osd = get_state_dict(ref.model, ref.opt)  # a fresh optimizer gets its state initialised here
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "trainer", no_dist=True)
    theirs = stored_keys(tmp_path / "trainer")
    ours = {k: v for k, v in stored_keys(mine).items() if not k.startswith("extra.")}
    assert ours == theirs
    assert any(k.startswith("optim.state.layers.0.fc.weight.") for k in ours)


TRAINER = r'''
import json, sys, numpy as np, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from mirrorckpt.updater.fingerprint import state_sha256
from mirrorckpt.updater.restore import load_into

cfg = json.load(open(sys.argv[1]))

def build():
    root = torch.nn.Module()
    for p in cfg["params"]:
        *path, leaf = p["name"].split(".")
        m = root
        for part in path:
            if part not in m._modules:
                m.add_module(part, torch.nn.Module())
            m = m._modules[part]
        m.register_parameter(leaf, torch.nn.Parameter(torch.zeros(p["shape"])))
    masters = [root.get_parameter(p["name"]) for p in cfg["params"]]
    opt = torch.optim.AdamW(masters, lr=cfg["lr"], weight_decay=cfg["weight_decay"], foreach=False)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, **cfg["sched"])
    return root, masters, opt, sched

out = {}
# 1. the trainer's own resume path, plain DCP calls
model, masters, opt, sched = build()
msd, osd = get_state_dict(model, opt)
sd = {"model": msd, "optim": osd}
dcp.load(sd, checkpoint_id=cfg["checkpoint"])
set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
out["dcp_load"] = state_sha256(masters, opt)
# 2. mirrorckpt's load_into, then two more training iterations
model, masters, opt, sched = build()
info = load_into(model, opt, cfg["root"], scheduler=sched)
out["load_into"] = state_sha256(masters, opt)
out["resumed"] = [info.iterations_done, info.step, info.data_position, {k: v.tolist() for k, v in info.rng.items()}]
grads = np.load(cfg["grads"])
for i in range(2):
    for p in cfg["params"]:
        g = torch.from_numpy(grads[f"{i}/{p['name']}"].view(np.int16)).view(torch.bfloat16).float()
        model.get_parameter(p["name"]).grad = g.view(p["shape"])
    torch.nn.utils.clip_grad_norm_(masters, cfg["max_norm"])
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
out["continued"] = state_sha256(masters, opt)
print(json.dumps(out))
'''


def test_trainer_in_another_process_loads_the_checkpoint_bit_exactly(tmp_path):
    training, layout, ref, rep, rng = trained("adamw-bf16-clip-cosine", 3)
    meta = {"rng": {"torch": torch.tensor([7, 8, 9], dtype=torch.uint8)}, "data_position": {"epoch": 0, "sample": 96}}
    it = R.random_iteration(layout, 3, rng)
    it.meta = meta
    rep.apply(it)
    path = write_checkpoint(tmp_path / "ck", rep.state_dict_for_checkpoint())
    want = rep.state_sha256()
    # the same two iterations for the replica and (as per-parameter bf16 bits) for the trainer
    grads = {}
    for i in (4, 5):
        it = R.random_iteration(layout, i, rng)
        for spec, flat in zip(layout.bucket_list(i), it.buckets):
            for p, a, z in layout.bucket_slices(spec):
                grads[f"{i - 4}/{layout.params[p].name}"] = flat[a:z]
        rep.apply(it)
    np.savez(tmp_path / "grads.npz", **grads)
    cfg = {"params": [{"name": p.name, "shape": list(p.shape)} for p in layout.params],
           "lr": training.optimizer.lr, "weight_decay": training.optimizer.weight_decay,
           "sched": training.lr_schedule.kwargs, "max_norm": training.clip.max_norm,
           "checkpoint": str(path), "root": str(tmp_path / "ck"), "grads": str(tmp_path / "grads.npz")}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-c", TRAINER, str(tmp_path / "cfg.json")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert tuple(out["dcp_load"]) == want
    assert tuple(out["load_into"]) == want
    assert out["resumed"] == [4, 4, {"epoch": 0, "sample": 96}, {"torch": [7, 8, 9]}]
    assert tuple(out["continued"]) == rep.state_sha256()


def test_dcp_to_torch_save_converts_a_checkpoint(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    training, layout, ref, rep, _ = trained("sgd-nesterov-clip-step", 3)
    path = write_checkpoint(tmp_path / "ck", rep.state_dict_for_checkpoint())
    dcp_to_torch_save(path, tmp_path / "full.pt")
    sd = torch.load(tmp_path / "full.pt", weights_only=False)
    for name, p in zip(rep.names, rep.params):
        assert torch.equal(sd["model"][name], p)
        assert torch.equal(sd["optim"]["state"][name]["momentum_buffer"], rep.optimizer.state[p]["momentum_buffer"])
    assert sd["optim"]["param_groups"][0]["params"] == rep.names
    assert sd["extra"]["iterations_done"] == 3 and sd["extra"]["format"] == "mirrorckpt/1"


def test_a_dcp_save_that_returns_no_storage_data_is_read_back(tmp_path, monkeypatch):
    """torch 2.11's dcp.save (the GPU machine's) returns its metadata without storage_data: the
    byte ranges are read from the written .metadata, and the checkpoint verifies."""
    real = dcp.save

    def save(*a, **k):
        md = real(*a, **k)
        md.storage_data = None
        return md
    monkeypatch.setattr(dcp, "save", save)
    training, layout, ref, rep, _ = trained("sgd-nesterov-clip-step", 3)
    path = write_checkpoint(tmp_path / "ck", rep.state_dict_for_checkpoint())
    r = verify(path)
    assert r.ok and not r.problems and r.tensors > 0, r


def test_commit_protocol_pointer_retention_and_no_overwrite(tmp_path):
    training, layout, ref, rep, rng = trained("adam-fp32", 1)
    root = tmp_path / "root"
    seen = []
    for i in range(1, 6):
        p = write_checkpoint(root, rep.state_dict_for_checkpoint(), keep_last=2)
        seen.append(p.name)
        assert (root / "latest").read_text() == p.name + "\n" and latest(root) == p
        assert verify(p).ok
        rep.apply(R.random_iteration(layout, i, rng))
    assert sorted(x.name for x in root.iterdir() if x.name.startswith("step-")) == seen[-2:]
    assert not [x for x in root.iterdir() if x.name.startswith(".")]
    before = (root / seen[-1] / "manifest.json").read_bytes()
    older = rep.state_dict_for_checkpoint()
    older["extra"]["iterations_done"] = 5
    with pytest.raises(CheckpointExists, match="never overwritten"):
        write_checkpoint(root, older)
    older["extra"]["iterations_done"] = 2
    with pytest.raises(CheckpointExists, match="older than the committed step-00000005"):
        write_checkpoint(root, older)
    assert (root / seen[-1] / "manifest.json").read_bytes() == before
    assert prune(root, 1) == [root / seen[-2]] and latest(root) == root / seen[-1]


def test_recover_cleans_leftovers_and_never_takes_a_torn_directory(tmp_path):
    training, layout, ref, rep, rng = trained("adam-fp32", 2)
    root = tmp_path / "root"
    good = write_checkpoint(root, rep.state_dict_for_checkpoint())
    rep.apply(R.random_iteration(layout, 2, rng))
    newer = write_checkpoint(root, rep.state_dict_for_checkpoint())
    (root / "latest").write_text(good.name + "\n")  # a crash between rename and pointer flip
    (root / ".partial-step-00000009-1-ab").mkdir()
    (root / ".partial-step-00000009-1-ab" / "__0_0.distcp").write_bytes(b"torn")
    (root / ".deleting-step-00000001-cd").mkdir()
    (root / ".latest.tmp-77").write_text("step-00000009\n")
    torn = root / "step-00000007"  # a final name without a manifest: never committed by us
    torn.mkdir()
    (torn / ".metadata").write_bytes(b"x")
    assert latest(root) == newer  # the pointer lags; the torn one is never taken
    info = recover(root)
    assert sorted(info["removed"]) == [".deleting-step-00000001-cd", ".latest.tmp-77", ".partial-step-00000009-1-ab"]
    assert info["uncommitted"] == ["step-00000007"] and info["latest"] == newer
    assert (root / "latest").read_text() == newer.name + "\n"
    (root / "latest").write_text("step-00000007\n")  # even a pointer to it is not followed
    assert latest(root) == newer
    assert [s for s, _ in ckptdir.committed(root)] == [2, 3]


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_persister_interval_budget_and_submit_never_waits(tmp_path, monkeypatch):
    training, layout, ref, rep, rng = trained("adam-fp32", 1)
    snap_bytes = sum(v.numel() * v.element_size() for v in persist.flatten(rep.state_dict_for_checkpoint()).values()
                     if isinstance(v, torch.Tensor))
    gate, entered = threading.Event(), threading.Event()
    real = persist.write_checkpoint

    def slow_write(*a, **kw):
        entered.set()
        gate.wait(30)
        return real(*a, **kw)

    monkeypatch.setattr(persist, "write_checkpoint", slow_write)
    clock = _Clock()
    spec = PersistSpec(str(tmp_path / "root"), every_iterations=2, every_seconds=100.0, keep_last=5,
                       memory_budget_bytes=snap_bytes + 10)
    with Persister(spec, clock=clock) as per:
        assert not per.submit(rep)  # 1 iteration since start: not due
        rep.apply(R.random_iteration(layout, 1, rng))
        assert per.submit(rep)  # 2 iterations: due; returns while the writer is blocked
        assert entered.wait(30)
        rep.apply(R.random_iteration(layout, 2, rng))
        clock.t = 150.0
        rep.apply(R.random_iteration(layout, 3, rng))
        assert not per.submit(rep)  # due by time, but the only staging buffer is being written
        assert per.stats.skipped_budget == 1 and per.stats.committed == 0
        gate.set()
        assert per.flush(30)
        assert per.submit(rep)  # the buffer is back
        assert per.flush(30)
        rep.apply(R.random_iteration(layout, 4, rng))
        assert not per.submit(rep)  # 1 iteration, 0 s since the last one
    assert per.stats.committed == 2 and per.stats.failed == 0
    assert [s for s, _ in ckptdir.committed(tmp_path / "root")] == [2, 4]
    assert per.stats.last_committed.endswith("step-00000004")


def test_persister_writes_what_does_not_fit_unstaged_and_skips_a_half_applied_iteration(tmp_path, caplog):
    training, layout, ref, rep, rng = trained("adam-fp32", 1)
    with Persister(PersistSpec(str(tmp_path / "a"), memory_budget_bytes=1000)) as per:
        assert per.submit(rep)  # larger than the whole budget: written while the caller waits, never skipped
        want = rep.state_sha256()
        rep.apply(R.random_iteration(layout, 1, rng))
        assert per.submit(rep)
        assert per.stats.unstaged == 2 and per.stats.skipped_budget == 0 and per.stats.committed == 2
    said = [r.getMessage() for r in caplog.records if "exceeds persist memory_budget_bytes (1000)" in r.getMessage()]
    assert len(said) == 1 and "written from the replica tensor by tensor while it waits" in said[0]  # once
    first = ckptdir.committed(tmp_path / "a")[0][1]
    assert verify(first).ok and verify(latest(tmp_path / "a")).ok
    assert Replica(layout, training, first).state_sha256() == want
    assert Replica(layout, training, tmp_path / "a").state_sha256() == rep.state_sha256()
    with Persister(PersistSpec(str(tmp_path / "b"))) as per:
        it = R.random_iteration(layout, 2, rng)
        rep.apply_bucket(2, 0, it.buckets[0])
        assert not per.submit(rep) and per.stats.skipped_busy == 1
        rep.apply_bucket(2, 1, it.buckets[1])
        rep.apply_bucket(2, 2, it.buckets[2])
        assert per.submit(rep)
    assert per.stats.committed == 1 and verify(latest(tmp_path / "b")).ok


def test_one_writer_per_root_and_resume_numbering(tmp_path):
    training, layout, ref, rep, rng = trained("adam-fp32", 2)
    spec = PersistSpec(str(tmp_path / "root"))
    with Persister(spec) as per:
        with pytest.raises(RuntimeError, match="another writer holds"):
            Persister(spec)
        assert per.submit(rep)
    with Persister(spec) as per:  # a restarted appliance does not rewrite what is committed
        assert not per.submit(rep)
        rep.apply(R.random_iteration(layout, 2, rng))
        assert per.submit(rep)
    assert per.stats.committed == 1 and per.stats.failed == 0


def test_snapshot_is_a_copy(tmp_path):
    training, layout, ref, rep, rng = trained("adam-fp32", 2)
    want = rep.state_sha256()
    with Persister(PersistSpec(str(tmp_path / "root"))) as per:
        assert per.submit(rep)
        for i in range(2, 4):  # keep training while the writer runs
            rep.apply(R.random_iteration(layout, i, rng))
    back = Replica(layout, training, tmp_path / "root")
    assert back.state_sha256() == want and back.iterations_done == 2
    assert state_sha256(back.params, back.optimizer) != rep.state_sha256()
