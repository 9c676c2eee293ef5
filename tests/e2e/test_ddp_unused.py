"""DDP with find_unused_parameters=True (the HF Trainer's default), followed from the wire: a 2-rank
gloo job (tools.testbed.harness) whose spare layer backward reaches on every third step only.
DDP's used-parameter map all-reduce does not go through a comm hook; the harness puts it on the
wire where DDP issues it (after the last bucket), the job's collective sequence expects it
(config.ddp), and the replica skips the parameters the trainer reports without a gradient, as
torch's optimizer does: it equals the trainer at every step."""

from __future__ import annotations

import functools

import common
from mirrorckpt.tools.testbed import harness
from test_gockpt import recording_plane

SECRET = "unused-secret-0123456789abcdef"
WORLD = 2
STEPS = 9
KEYS = ("params", "optim", "lr", "sched", "rng", "data")
wait_for = functools.partial(common.wait_for, timeout=60.0)


def test_find_unused_parameters_is_followed_bit_for_bit(tmp_path):
    plane, states = recording_plane(SECRET)
    frames, follower = harness.followed(plane, WORLD)
    run = tmp_path / "run"
    try:
        procs = harness.spawn_ranks(WORLD, run, SECRET, control_port=plane.port, frames_port=frames.port, steps=STEPS,
                                    extra=["--find-unused", "--dims", "16,32,8", "--step-delay", "0.05"])
        harness.wait_ranks(procs, run, timeout=120)
        frames.stop()
        follower.join(30)
        assert follower.error is None
        assert wait_for(lambda: STEPS in states), sorted(states)
    finally:
        plane.stop()
    assert plane.layout.used_map and plane.layout.first_buckets is None
    trainer = harness.read_digests(run)
    assert plane.stats.drift_events == 0 and plane.stats.fallbacks_done == 0, plane.stats
    for s in range(1, STEPS + 1):
        assert states[s] == {k: trainer[s][k] for k in KEYS}, f"step {s}"
