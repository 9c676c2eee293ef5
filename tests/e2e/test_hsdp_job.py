"""A real FSDP2 HSDP CPU job (gloo, 4 processes, mesh dp_replicate=2 x dp_shard=2, AdamW, global-norm
clipping) attached through the control plane to two appliance processes, one per shard index: the
layout read from FSDP2's placements (and what FSDP2 all-reduces checked against it every step),
both shards followed through their GoCkpt fallbacks, one joint checkpoint equal to the trainer's
full state, and a resumed job that restores it rank after rank (no collective): from the
appliances and from disk into HSDP 2 x 2 (the appliance-restored job then trains on bit-exactly),
into FSDP2 with 4 shards, into HSDP with 4 replicas, and in this process into the unsharded model.
The resumed job also reports that attach refuses pure FSDP (naming dp_replicate) and HSDP reducing
in bf16, and that plain ``attach`` refuses the HSDP model (it names attach_sharded)."""

from __future__ import annotations

import time

import pytest
import torch
from mirrorckpt.tools.testbed import sharded_rig as rig
from mirrorckpt.tools.testbed.hsdp_job import DIMS, MAX_NORM, trainer_main
from mirrorckpt.tools.testbed.tp_dp_job import appliance_main
from mirrorckpt.updater import ckptdir, restore
from mirrorckpt.updater.manifest import read_manifest

GROUPS = ["pp0-tp0-sh0", "pp0-tp0-sh1"]
STEPS, HOLD, PARTS = 8, 1, 2  # the fallbacks start after step 2 (iterations_done 2) and end at 2 + 2
JOINT = HOLD + 1 + PARTS


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hsdp")
    t0 = time.monotonic()
    with rig.appliances(appliance_main, tmp, GROUPS, PARTS) as (ports, results, procs):
        job = rig.run_job(trainer_main, tmp / "job", ports, (STEPS, HOLD, PARTS, ""))
        joint = [rig.wait_file(res, 60, procs) for res in results]
        resumed = rig.run_job(trainer_main, tmp / "resumed", ports, (STEPS, HOLD, PARTS, str(tmp / "root")))
    print(f"job, fallbacks, joint checkpoint and resumed job: {time.monotonic() - t0:.1f} s")
    return {"tmp": tmp, "root": tmp / "root", "job": job, "joint": joint, "resumed": resumed}


def _state(run, tag: str, name: str) -> dict:
    return torch.load(run["tmp"] / tag / f"{name}.pt")


def test_layout_read_from_fsdp2_and_its_all_reduces_match_it(run):
    job = run["job"]
    assert [r["group"] for r in job] == ["pp0-tp0-sh0", "pp0-tp0-sh1"] * 2  # shard index = mesh column
    assert [r["rank"] for r in job if r["leader"]] == [0, 1]
    assert len({r["layout_digest"] for r in job}) == 1  # each rank read it alone, all the same
    lay = job[0]["layout"]
    assert (lay["scheme"], lay["shards"], lay["dp"], lay["average"]) == ("fsdp2", 2, 2, "avg")
    assert [g["ranks"] for g in lay["groups"]] == [[0, 2], [1, 3]]  # the replicate groups
    w = {s["fqn"]: (s["offset"], s["shape"]) for s in lay["groups"][1]["shards"]}
    assert w["0.weight"] == ([17, 0], [16, 16]) and w["0.bias"] == ([17], [16])
    # every rank, every step: FSDP2's replicate all-reduce buffers are laid out as registered
    assert all(r["wire_checked"] == STEPS for r in job)
    assert all(r["clipped_steps"] == STEPS for r in job)  # the clipping was real


def test_both_shards_fall_back_and_one_joint_checkpoint_equals_the_trainer(run):
    job, joint, root = run["job"], run["joint"], run["root"]
    for r in job:
        if r["leader"]:
            assert r["held_for_request"] is True
            assert [(f["start"], f["parts"]) for f in r["fallbacks"]] == [(HOLD + 1, PARTS)]
    for a, g in zip(joint, GROUPS):
        assert "fatal" not in a, a.get("fatal")
        assert a["registered_steps"] == {g: 0}
        assert a["fallbacks"][g]["done"] == 1 and a["fallbacks"][g]["failed"] == 0
        assert a["steps"] == {g: JOINT}
        assert a["rounds"][-1] == str(root / ckptdir.step_dirname(JOINT)), a["rounds"]
    sel = restore.select(root, verify_data=True)
    assert sel.path == root / ckptdir.step_dirname(JOINT) and not sel.problems
    m = read_manifest(sel.path)
    assert m["joint"]["appliances"] == 2 and m["joint"]["shards"]["scheme"] == "fsdp2"
    assert m["training"]["clip"]["max_norm"] == MAX_NORM and m["training"]["optimizer"]["name"] == "adamw"
    rig.assert_model_and_optimizer_equal(sel.path, _state(run, "job", f"state_{JOINT}"))


def test_restored_rank_by_rank_into_hsdp_and_other_shard_counts(run):
    want = _state(run, "job", f"state_{JOINT}")
    for r in run["resumed"]:
        assert r["restored"] == {"source": f"appliance:pp0-tp0-sh{r['rank'] % 2}", "iterations_done": JOINT}
        assert r["from_disk"]["iterations_done"] == JOINT
    for name in ("state", "disk_hsdp", "fsdp4", "hsdp41"):  # appliance; disk into HSDP 2x2, FSDP 4, HSDP 4x1
        rig.assert_tensors_equal(_state(run, "resumed", f"{name}_{JOINT}"), want, name)
    model = torch.nn.Sequential(torch.nn.Linear(DIMS[0], DIMS[1]), torch.nn.ReLU(), torch.nn.Linear(DIMS[1], DIMS[2]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    assert restore.load_into(model, opt, run["root"]).iterations_done == JOINT
    for n, p in model.named_parameters():  # and the unsharded model
        assert torch.equal(p, want[f"model.{n}"]), n
        for k, v in opt.state[p].items():
            assert torch.equal(v, want[f"optim.state.{n}.{k}"]), (n, k)


def test_pure_fsdp_and_plain_attach_are_refused_in_words(run):
    for r in run["resumed"]:
        said = r["refused"]
        assert "pure FSDP" in said["pure_fsdp"] and "dp_replicate >= 2" in said["pure_fsdp"]
        assert "attach_sharded" in said["plain_attach"]
        assert "reduces its gradients in torch.bfloat16" in said["bf16_reduce"]


def test_job_restored_from_the_appliances_trains_on_bit_exactly(run):
    for s in range(JOINT + 1, STEPS + 1):
        rig.assert_tensors_equal(_state(run, "resumed", f"state_{s}"), _state(run, "job", f"state_{s}"), s)
