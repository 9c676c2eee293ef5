"""A generated TP=2 x DP=2 job followed by two appliance processes (and by one following both
rings): one joint DCP checkpoint, equal to the trainer, loadable unsharded and into a TP=2 DTensor
layout; a member killed during a joint save leaves the previous joint checkpoint as latest."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from mirrorckpt.tools.generator.models import build_model
from mirrorckpt.tools.generator.sharded import ShardedConfig, generate_sharded
from mirrorckpt.tools.generator.train import build_optimizer
from mirrorckpt.tools.testbed.harness import free_port
from mirrorckpt.tools.testbed.joint import appliance_main, dtensor_load_main
from mirrorckpt.updater import ckptdir, restore
from mirrorckpt.updater.manifest import read_manifest, tensor_sha256

CTX = mp.get_context("spawn")


def _address() -> str:
    return f"127.0.0.1:{free_port()}"


def _run(target, argsets, tmp: Path, timeout: float = 80) -> list[dict]:
    procs, results = [], []
    for i, args in enumerate(argsets):
        res = tmp / f"result-{target.__name__}-{i}.json"
        res.unlink(missing_ok=True)
        results.append(res)
        procs.append(CTX.Process(target=target, args=(*args, str(res))))
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
            pytest.fail(f"{target.__name__} process did not finish in {timeout} s")
    return [json.loads(r.read_text()) if r.exists() else {"died": True} for r in results]


def _appliances(gen, root, rounds_at, tmp, kill=None, names=None):
    """Appliance processes, one per entry of ``names`` (each following its groups; default two, one
    group each); ``rounds_at``: steps, or one list of steps per process; ``kill``: (rank, round) of a
    member that dies in that round."""
    names = names or [["appliance-0"], ["appliance-1"]]
    addr = _address()
    procs = []
    for r, mine in enumerate(names):
        res = tmp / f"appliance-{root.name}-{r}.json"
        res.unlink(missing_ok=True)
        steps = rounds_at[r] if isinstance(rounds_at[0], list) else rounds_at
        args = (mine[0], r, len(names), addr, str(gen.out), str(root), steps, str(res))
        kw = {"names": mine, "kill_in_round": kill[1] if kill and kill[0] == r else None}
        procs.append((CTX.Process(target=appliance_main, args=args, kwargs=kw), res))
    for p, _ in procs:
        p.start()
    for p, _ in procs:
        p.join(80)
        if p.is_alive():
            p.kill()
            pytest.fail("appliance process hung")
    return [json.loads(res.read_text()) if res.exists() else {"died": True} for _, res in procs]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return generate_sharded(ShardedConfig(tp=2, dp=2, steps=4, model="mlp:32,64,16"),
                            tmp_path_factory.mktemp("tp2dp2"))


@pytest.fixture(scope="module")
def two(job, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two")
    root = tmp / "root"
    # appliance-1 enters the first round one step behind: the joint checkpoint waits for it
    res = _appliances(job, root, [[2, 4], [1, 4]], tmp)
    return root, res


def _flat(d: Path) -> dict:
    md = ckptdir.dcp_module().FileSystemReader(d).read_metadata()
    return restore._read_flat(d, [k for k, m in md.state_dict_metadata.items() if hasattr(m, "chunks")], md)


def test_two_appliances_one_joint_checkpoint_equal_to_trainer(job, two):
    root, res = two
    for r in res:
        assert "fatal" not in r, r.get("fatal")
        assert r["errors"] == [] and r["rounds"] == [str(root / "step-00000001"), str(root / "step-00000004")]
        assert list(r["applied"].values()) == [4]
    sel = restore.select(root, verify_data=True)
    assert sel.path == root / "step-00000004" and not sel.problems
    m = read_manifest(sel.path)
    assert m["joint"]["appliances"] == 2
    assert sum(len(t["chunks"]) > 1 for t in m["tensors"].values()) >= 6  # sliced: weights and their Adam state
    want = job.state()
    got = _flat(sel.path)
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    # an unsharded (TP=1) trainer resumes through get_state_dict/dcp.load
    model = build_model(ShardedConfig().model, seed=99)  # other initial weights: all must come from the checkpoint
    opt = build_optimizer(list(model.parameters()), ShardedConfig().training.optimizer)
    resumed = restore.load_into(model, opt, root)
    assert resumed.iterations_done == 4 and resumed.step == 4
    for n, p in model.named_parameters():
        assert torch.equal(p, want[f"model.{n}"]), n
        for k, v in opt.state[p].items():
            assert torch.equal(v, want[f"optim.state.{n}.{k}"]), (n, k)


def test_joint_checkpoint_loads_into_tp2_dtensors(job, two, tmp_path):
    root, _ = two
    addr = _address()
    res = _run(dtensor_load_main, [(r, 2, addr, str(root)) for r in range(2)], tmp_path)
    want = job.state()
    layout = job.layout
    for rank, r in enumerate(res):
        assert "fatal" not in r, r.get("fatal")
        assert r["step"] == 4
        for key, got in r["shards"].items():
            full = want[key]
            fqn = key.split(".", 1)[1] if key.startswith("model.") else key[len("optim.state."):key.rfind(".")]
            shard = layout.group(f"pp0-tp{rank}").shard(fqn)
            part = full
            if full.dim() and shard.tp_dim is not None:
                part = full.narrow(shard.tp_dim, shard.offset[shard.tp_dim], shard.shape[shard.tp_dim])
                assert got["placement"].startswith("S(")
            assert got["sha256"] == tensor_sha256(part), (rank, key)


def test_one_appliance_following_both_rings_equals_two(job, two, tmp_path):
    root2, _ = two
    root1 = tmp_path / "one"
    r, = _appliances(job, root1, [2, 4], tmp_path, names=[["appliance-0", "appliance-1"]])
    assert "fatal" not in r, r.get("fatal")
    assert r["applied"] == {"pp0-tp0": 4, "pp0-tp1": 4}
    assert r["rounds"] == [str(root1 / "step-00000002"), str(root1 / "step-00000004")]
    a, b = _flat(ckptdir.latest(root1)), _flat(ckptdir.latest(root2))
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert restore.verify(ckptdir.latest(root1)).ok


def test_member_killed_during_joint_save_leaves_previous_latest(job, tmp_path):
    root = tmp_path / "root"
    res = _appliances(job, root, [1, 2, 3], tmp_path, kill=(1, 2))
    survivor, victim = res
    assert victim == {"died": True}
    assert "fatal" not in survivor, survivor.get("fatal")
    assert survivor["rounds"] == [str(root / "step-00000001")]
    assert len(survivor["errors"]) == 2 and "broken" in survivor["errors"][1]
    assert survivor["applied"] == {"pp0-tp0": 4}  # it kept following its ring
    assert ckptdir.read_pointer(root) == root / "step-00000001"
    assert not [p for p in root.iterdir() if p.name.startswith(ckptdir.PARTIAL)]
    sel = restore.select(root, verify_data=True)
    assert sel.path == root / "step-00000001" and not sel.problems


def test_tp2_dp4_rings_with_pp_noise_into_one_joint_checkpoint(tmp_path):
    """R = 4 per ring, TP=2 x PP=2 (four rings), every ring's TP/PP traffic on the mirrored ports;
    one appliance process follows all four rings."""
    job4 = generate_sharded(ShardedConfig(tp=2, pp=2, dp=4, steps=3, model="mlp:16,32,24,8"), tmp_path / "gen")
    assert [g.ranks for g in job4.layout.groups] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    root = tmp_path / "root"
    names = [g.appliance for g in job4.layout.groups]
    r, = _appliances(job4, root, [3], tmp_path, names=[names])
    assert "fatal" not in r, r.get("fatal")
    assert r["applied"] == {g.name: 3 for g in job4.layout.groups}
    assert r["rounds"] == [str(root / "step-00000003")]
    got, want = _flat(root / "step-00000003"), job4.state()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
