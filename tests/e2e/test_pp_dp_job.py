"""A real pipeline-parallel CPU job, PP=2 x DP=2 (gloo, 4 processes, each stage holding only its
own layer under its global FQNs), attached through the control plane to two appliance processes,
one per stage's DP group: the sharded layout read from the stages, both groups' GoCkpt fallbacks,
one joint checkpoint equal to both stages' state, and a resume in which every rank pulls its
stage's shard from its group's appliance."""

from __future__ import annotations

import pytest
import torch
from mirrorckpt.tools.testbed import sharded_rig as rig
from mirrorckpt.tools.testbed.pp_dp_job import trainer_main
from mirrorckpt.tools.testbed.tp_dp_job import appliance_main
from mirrorckpt.updater import ckptdir, restore

GROUPS = ["pp0-tp0", "pp1-tp0"]
STEPS, HOLD, PARTS = 7, 1, 2  # fallbacks from iterations_done 2 to 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ppdp")
    with rig.appliances(appliance_main, tmp, GROUPS, PARTS) as (ports, results, procs):
        job = rig.run_job(trainer_main, tmp / "job", ports, (STEPS, HOLD, PARTS, ""))
        joint = [rig.wait_file(res, 60, procs) for res in results]
        resumed = rig.run_job(trainer_main, tmp / "resumed", ports, (STEPS, HOLD, PARTS, "appliance"))
    return {"tmp": tmp, "root": tmp / "root", "job": job, "joint": joint, "resumed": resumed}


def _state(run, tag: str, step: int) -> dict:
    out = {}
    for s in (0, 1):
        out.update(torch.load(run["tmp"] / tag / f"state_{step}_stage{s}.pt"))
    return out


def test_stages_register_their_groups_and_fall_back(run):
    job = run["job"]
    assert [r["rank"] for r in job if r["leader"]] == [0, 2]  # DP rank 0 of each stage
    lay = job[0]["layout"]
    assert all(r["layout"] == lay for r in job)
    assert (lay["tp"], lay["pp"], lay["dp"]) == (1, 2, 2)
    assert [(g["name"], g["pp_stage"], g["ranks"], g["appliance"], [s["fqn"] for s in g["shards"]])
            for g in lay["groups"]] == [("pp0-tp0", 0, [0, 1], "appliance-0", ["fc1.weight", "fc1.bias"]),
                                        ("pp1-tp0", 1, [2, 3], "appliance-1", ["fc2.weight", "fc2.bias"])]
    assert [p["name"] for p in lay["params"]] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    for r in job:
        if r["leader"]:
            assert r["held_for_request"] is True
            assert [(f["start"], f["parts"]) for f in r["fallbacks"]] == [(HOLD + 1, PARTS)]
    for a, g in zip(run["joint"], GROUPS):
        assert "fatal" not in a, a.get("fatal")
        assert a["fallbacks"][g]["done"] == 1 and a["fallbacks"][g]["failed"] == 0
        assert a["steps"] == {g: HOLD + 1 + PARTS}


def test_joint_checkpoint_of_both_stages_equals_the_trainer(run):
    step = HOLD + 1 + PARTS
    root = run["root"]
    for a in run["joint"]:
        assert a["rounds"][-1] == str(root / ckptdir.step_dirname(step)), a["rounds"]
    sel = restore.select(root, verify_data=True)
    assert sel.path == root / ckptdir.step_dirname(step) and not sel.problems
    want = _state(run, "job", step)
    rig.assert_model_and_optimizer_equal(sel.path, want)


def test_stages_pull_their_shards_and_resume_bit_exactly(run):
    step = HOLD + 1 + PARTS
    for r in run["resumed"]:
        assert r["restored"] == {"source": f"appliance:pp{r['rank'] // 2}-tp0", "iterations_done": step}
    for s in range(step, STEPS + 1):
        a, b = _state(run, "job", s), _state(run, "resumed", s)
        assert set(a) == set(b)
        for k in a:
            assert torch.equal(a[k], b[k]), (s, k)
