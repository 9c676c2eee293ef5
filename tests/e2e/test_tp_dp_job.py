"""A real TP=2 x DP=2 CPU job (gloo, DeviceMesh, DTensor ColwiseParallel/RowwiseParallel, 4
processes) attached through the control plane to two appliance processes, one per DP group:
both groups' GoCkpt fallbacks rebuild and verify, the appliances write one joint checkpoint equal
to the trainer's own full state, and a new TP=2 x DP=2 job resumes bit-exactly whether its ranks
each pull their own shard from their group's appliance or load their DTensor shards of the joint
checkpoint (dcp.load)."""

from __future__ import annotations

import json
import time

import pytest
import torch
from mirrorckpt.tools.testbed import sharded_rig as rig
from mirrorckpt.tools.testbed.tp_dp_job import DIMS, appliance_main, trainer_main
from mirrorckpt.updater import ckptdir, restore
from mirrorckpt.updater.manifest import read_manifest

GROUPS = ["pp0-tp0", "pp0-tp1"]
STEPS, HOLD, PARTS = 8, 2, 3  # the fallbacks start after step 3 (iterations_done 3) and end at 3 + 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tpdp")
    t0 = time.monotonic()
    with rig.appliances(appliance_main, tmp, GROUPS, PARTS) as (ports, results, procs):
        def job(tag, restore_):
            return rig.run_job(trainer_main, tmp / tag, ports, (STEPS, HOLD, PARTS, restore_))

        first = job("job", "")
        t_job = time.monotonic() - t0
        joint = [rig.wait_file(res, 60, procs) for res in results]
        resumed = job("resumed", "appliance")
        from_disk = job("from_disk", str(tmp / "root"))
    final = [json.loads(res.read_text()) for res in results]
    print(f"job + fallbacks {t_job:.1f} s, total {time.monotonic() - t0:.1f} s")
    return {"tmp": tmp, "root": tmp / "root", "job": first, "joint": joint, "resumed": resumed,
            "from_disk": from_disk, "final": final}


def _state(run, tag: str, step: int) -> dict:
    return torch.load(run["tmp"] / tag / f"state_{step}.pt")


def test_both_groups_fall_back_and_verify(run):
    job, joint = run["job"], run["joint"]
    leaders = [r for r in job if r["leader"]]
    assert [r["rank"] for r in leaders] == [0, 1]  # DP rank 0 of each TP rank's group
    assert len({r["layout_digest"] for r in job}) == 1
    for r in leaders:
        assert r["held_for_request"] is True
        assert [(f["start"], f["parts"]) for f in r["fallbacks"]] == [(HOLD + 1, PARTS)]
    for a, g in zip(joint, GROUPS):
        assert "fatal" not in a, a.get("fatal")
        assert a["registered_steps"] == {g: 0}  # registered with the initial state
        assert a["fallbacks"][g]["done"] == 1 and a["fallbacks"][g]["failed"] == 0
        assert a["steps"] == {g: HOLD + 1 + PARTS}


def test_joint_checkpoint_equals_the_trainers_state(run):
    root, joint = run["root"], run["joint"]
    step = HOLD + 1 + PARTS
    for a in joint:
        assert a["rounds"][-1] == str(root / ckptdir.step_dirname(step)), a["rounds"]
        assert a["joint"]["committed"] == 1
    sel = restore.select(root, verify_data=True)
    assert sel.path == root / ckptdir.step_dirname(step) and not sel.problems
    m = read_manifest(sel.path)
    assert m["joint"]["appliances"] == 2
    shards = m["joint"]["shards"]
    assert [g["ranks"] for g in shards["groups"]] == [[0, 2], [1, 3]]
    dims = {s["fqn"]: s["tp_dim"] for g in shards["groups"] for s in g["shards"]}
    assert dims == {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": None}  # Colwise, Rowwise
    want = _state(run, "job", step)
    rig.assert_model_and_optimizer_equal(sel.path, want)
    # an unsharded trainer loads it with plain torch modules
    model = torch.nn.Sequential(torch.nn.Linear(DIMS[0], DIMS[1]), torch.nn.ReLU(), torch.nn.Linear(DIMS[1], DIMS[2]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    r = restore.load_into(model, opt, root)
    assert r.iterations_done == step
    for n, p in model.named_parameters():
        assert torch.equal(p, want[f"model.{n}"]), n


def test_restored_job_pulls_its_shards_and_resumes_bit_exactly(run):
    step = HOLD + 1 + PARTS
    for r in run["resumed"]:
        assert r["restored"] == {"source": f"appliance:pp0-tp{r['rank'] % 2}", "iterations_done": step}
    assert [f["restores"] for f in run["final"]] == [{"pp0-tp0": {"memory": 2, "disk": 0}},
                                                     {"pp0-tp1": {"memory": 2, "disk": 0}}]
    for s in range(step, STEPS + 1):  # the state restored, then every step after it
        a, b = _state(run, "job", s), _state(run, "resumed", s)
        assert set(a) == set(b)
        for k in a:
            assert torch.equal(a[k], b[k]), (s, k)


def test_job_loading_its_dtensor_shards_of_the_joint_checkpoint_resumes_bit_exactly(run):
    """Every rank reads only its own slices of the joint checkpoint (dcp.load of its DTensor state
    dict, updater.restore.load_into) and the job goes on exactly as the one that was never stopped."""
    step = HOLD + 1 + PARTS
    for r in run["from_disk"]:
        assert r["restored"] == {"source": str(run["root"] / ckptdir.step_dirname(step)), "iterations_done": step}
    for s in range(step, STEPS + 1):
        a, b = _state(run, "job", s), _state(run, "from_disk", s)
        assert set(a) == set(b)
        for k in a:
            assert torch.equal(a[k], b[k]), (s, k)
