"""A real DeepSpeed ZeRO-2 CPU job (2 processes, gloo, tools/testbed/deepspeed_job.py) attached
with attach_deepspeed to an in-process sharded appliance (one control plane per partition): each
partition registers its own slices, both fall back (GoCkpt) at one step and the rebuilt replicas
verify and equal the engine's partitions there; a fresh job restored from the planes at that step
reports what it restored, has the engine's full parameters back, and trains on bit-exactly like
the job that was never stopped (a step ZeRO skips for a non-finite norm included)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from mirrorckpt.control.sharded_appliance import ShardedAppliance
from mirrorckpt.tools.testbed import sharded_rig as rig
from mirrorckpt.tools.testbed.tp_dp_job import SECRET

GROUPS = ["pp0-tp0-sh0", "pp0-tp0-sh1"]
STEPS, HOLD, PARTS = 7, 1, 2  # the fallbacks start after step 2 (iterations_done 2) and end at 2 + 2
RESTORED = HOLD + 1 + PARTS
SKIPPED = 6  # the step of the job's NaN batch (tools/testbed/deepspeed_job.NAN_BATCH), which ZeRO skips


def _need_deepspeed():
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        pytest.fail("deepspeed is not installed: `make test` installs it (pip install --no-build-isolation "
                    "'deepspeed>=0.19,<0.20')")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    _need_deepspeed()
    from mirrorckpt.tools.testbed.deepspeed_job import trainer_main

    tmp = tmp_path_factory.mktemp("deepspeed")
    sa = ShardedAppliance(SECRET, "appliance-0", GROUPS, parts=PARTS, fallback_timeout=60).start()
    asked = {}

    def ask():  # the plane follows no mirror traffic: the state comes by GoCkpt
        asked["registered"] = sa.wait_registered(60)
        asked["requests"] = sa.request_fallbacks("this test follows no mirror traffic")

    t0 = time.monotonic()
    try:
        addrs = {g: ["127.0.0.1", p] for g, p in sa.ports().items()}
        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        job = rig.run_job(trainer_main, tmp / "job", addrs, (STEPS, HOLD, PARTS, 0), world=2)
        asker.join(5)
        planes = {g: {"stats": p.stats, "steps": p.replica.iterations_done if p.replica else None,
                      "state": {k: v.clone() for k, v in p.replica.named_tensors().items()} if p.replica else None}
                  for g, p in sa.planes.items()}
        resumed = rig.run_job(trainer_main, tmp / "resumed", addrs, (STEPS, HOLD, PARTS, RESTORED), world=2)
    finally:
        sa.stop()
    print(f"job, fallbacks and resumed job: {time.monotonic() - t0:.1f} s")
    return {"tmp": tmp, "job": job, "resumed": resumed, "planes": planes, "asked": asked}


def _state(run, tag: str, rank: int, step: int) -> dict:
    return torch.load(run["tmp"] / tag / f"rank{rank}_{step}.pt")


def test_each_partition_registers_its_own_slices(run):
    job = run["job"]
    assert [(r["rank"], r["group"], r["leader"]) for r in job] == [(0, GROUPS[0], True), (1, GROUPS[1], True)]
    lay = job[0]["layout"]
    assert (lay["scheme"], lay["dp"], lay["shards"]) == ("zero", 2, 2)
    # the first partition ends inside 0.weight (96 of its 128 elements), the second holds the rest
    assert [(s["fqn"], s["flat"]) for s in lay["groups"][1]["shards"]] == [
        ("0.weight", [96, 128]), ("2.weight", [0, 64]), ("0.bias", [10, 16]), ("2.bias", [0, 4])]
    training = job[1]["training"]
    assert training["clip"]["max_norm"] == 0.05 and training["optimizer"]["name"] == "adamw"
    assert [g["params"] for g in training["param_groups"]] == [["0.weight", "2.weight"], ["0.bias", "2.bias"]]
    assert all(r["steps_done"] == STEPS == r["engine_steps"] for r in job)


def test_the_attached_engine_trains_as_deepspeed_alone_does(run):
    """The link runs ZeRO's param groups' steps together: the engine's parameters after every step
    are those of the same job trained without it."""
    for rank in (0, 1):
        for step in range(1, STEPS + 1):
            want = torch.load(run["tmp"] / "resumed" / f"plain{rank}_{step}.pt")
            got = {k: v for k, v in _state(run, "job", rank, step).items() if k.startswith("module.")}
            rig.assert_tensors_equal(got, want, (rank, step))


def test_both_partitions_fall_back_and_verify_equal_to_the_engine(run):
    assert run["asked"] == {"registered": True, "requests": 2}
    for r in run["job"]:
        assert r["held_for_request"] is True
        assert [(f["start"], f["parts"]) for f in r["fallbacks"]] == [(HOLD + 1, PARTS)]
        # every step ZeRO clipped both param groups' gradients by one factor, which the link found
        coefs = r["clip_coefs"]
        assert all(len(c) == 2 and c[0] == c[1] and 0 < c[0] < 1 for c in coefs[:SKIPPED - 1] + coefs[SKIPPED:]), coefs
        assert coefs[SKIPPED - 1] == [] and r["skipped"] == {"link": 1, "engine": 1}  # and the skip was said
    for rank, g in enumerate(GROUPS):
        plane = run["planes"][g]
        st = plane["stats"]
        assert st.fallbacks_done == 1 and st.fallbacks_failed == 0, st
        assert not [e for e in st.events if e[0] == "fallback_unverified"], st.events
        assert plane["steps"] == RESTORED
        want = _state(run, "job", rank, RESTORED)
        rig.assert_tensors_equal(plane["state"], {k: v for k, v in want.items() if not k.startswith("module.")}, g)


def test_a_fresh_job_restored_from_the_planes_trains_on_bit_exactly(run):
    for r in run["resumed"]:
        assert r["restored"] == {"source": f"appliance:{GROUPS[r['rank']]}", "iterations_done": RESTORED,
                                 "data": {"next": RESTORED}, "engine_steps": RESTORED}
        assert r["steps_done"] == STEPS == r["engine_steps"] and r["skipped"] == {"link": 1, "engine": 1}
    for rank in (0, 1):  # the restored step (full module parameters all-gathered included), then every step on
        for step in range(RESTORED, STEPS + 1):
            rig.assert_tensors_equal(_state(run, "resumed", rank, step), _state(run, "job", rank, step), (rank, step))
