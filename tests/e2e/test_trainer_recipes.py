"""Recipes as loops write them, followed through the wire and the control plane: a 2-rank gloo DDP
job (tools.testbed.harness) that clips with torch's own ``clip_grad_norm_`` (attach is told only
``max_grad_norm``), accumulates gradients over 4 micro-steps under ``no_sync`` and reads its data
through torchdata's StatefulDataLoader. The appliance follows every optimizer step from the
mirrored all-reduces with the clip coefficients the link found on the gradients, a lost
all-reduce is repaired by a GoCkpt fallback, and the replica equals the trainer at every step;
the job killed and resumed from the appliance goes on bit-identically (state, schedule, data)."""

from __future__ import annotations

import functools

import common
from mirrorckpt.tools.testbed import harness
from test_gockpt import recording_plane

SECRET = "recipes-secret-0123456789abcdef"
WORLD = 2
KEYS = ("params", "optim", "lr", "sched", "rng", "data")
RECIPE = ["--clip-norm", "0.05", "--accumulate", "4", "--loader", "stateful", "--dims", "16,32,8"]
wait_for = functools.partial(common.wait_for, timeout=60.0)


def test_clip_accumulation_and_data_loader_followed_and_resumed(tmp_path):
    plane, states = recording_plane(SECRET)
    frames, follower = harness.followed(plane, WORLD)
    run = tmp_path / "run"
    try:
        procs = harness.spawn_ranks(WORLD, run, SECRET, control_port=plane.port, frames_port=frames.port, steps=200,
                                    extra=[*RECIPE, "--drop", "3:0", "--step-delay", "0.05"])
        try:
            assert wait_for(lambda: plane.stats.fallbacks_done and plane.replica.iterations_done >= 10, timeout=150)
        finally:
            harness.kill_ranks(procs)
        frames.stop()
        follower.join(30)
        assert follower.error is None
        with plane.lock:
            n = plane.replica.iterations_done
        trainer = harness.read_digests(run)
        assert plane.stats.fallbacks_done >= 1 and plane.stats.drift_events == 0, plane.stats
        clipped = [s for s in range(1, n + 1) if trainer[s]["clip_total_norm"] > 0.05]
        assert len(clipped) >= n // 2, "the recipe did not clip: nothing was tested"
        resynced = [d["step"] for kind, d in plane.stats.events if kind == "resynced"][0]
        followed = [s for s in states if s <= n]
        assert set(range(1, 4)) | set(range(resynced, n + 1)) <= set(followed)  # all but the gap before the resync
        for s in followed:
            assert states[s] == {k: trainer[s][k] for k in KEYS}, f"step {s}"

        resumed = tmp_path / "resumed"
        harness.wait_ranks(harness.spawn_ranks(WORLD, resumed, SECRET, control_port=plane.port, steps=4,
                                               extra=[*RECIPE, "--restore", "appliance"]), resumed, timeout=120)
        ref = tmp_path / "reference"
        harness.wait_ranks(harness.spawn_ranks(WORLD, ref, SECRET, steps=n + 4, extra=RECIPE), ref, timeout=200)
    finally:
        plane.stop()
    want = harness.read_digests(ref)
    assert all({k: trainer[s][k] for k in KEYS} == {k: want[s][k] for k in KEYS} for s in range(1, n + 1))
    for rank in range(WORLD):
        got, ref_rank = harness.read_digests(resumed, rank), harness.read_digests(ref, rank)
        assert sorted(got) == list(range(n + 1, n + 5))
        for s in got:
            assert {k: got[s][k] for k in KEYS} == {k: ref_rank[s][k] for k in KEYS}, (rank, s)
