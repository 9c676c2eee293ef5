"""Kill a trainer rank mid-run, restore the job from the appliance's memory and from its latest
committed checkpoint on disk: the resumed run's next 5 steps are bit-identical to an uninterrupted
run in all five state components (parameters, optimizer state, LR schedule and step counters,
RNG state, data position)."""

from __future__ import annotations

import functools

import common
from mirrorckpt.config.training import PersistSpec
from mirrorckpt.control.appliance_side import AppliancePlane
from mirrorckpt.parser.roce.streams import MirrorStreams
from mirrorckpt.tools.testbed import harness
from mirrorckpt.tools.testbed.follower import MirrorFollower
from mirrorckpt.updater import ckptdir, restore

SECRET = "restore-secret-0123456789abcdef"
WORLD = 2
KEYS = ("params", "optim", "lr", "sched", "rng", "data")


wait_for = functools.partial(common.wait_for, timeout=60.0)


def test_restore_from_appliance_memory_and_disk(tmp_path):
    root = tmp_path / "ckpt"
    plane = AppliancePlane(SECRET, parts=3, fingerprint_every=2,
                           persist=PersistSpec(directory=str(root), every_iterations=1, keep_last=3)).start()
    frames = harness.FrameStreamServer(WORLD)
    ring, topo = harness.ring_for(WORLD)
    follower = MirrorFollower(plane, MirrorStreams(frames.sources()), ring, channels=harness.channels_for(topo, ring),
                              psn_window=16)
    follower.start()
    try:
        run = tmp_path / "killed"
        procs = harness.spawn_ranks(WORLD, run, SECRET, control_port=plane.port, frames_port=frames.port,
                                    steps=200, extra=["--step-delay", "0.2"])
        try:
            assert wait_for(lambda: plane.replica is not None and plane.replica.iterations_done >= 6, timeout=120)
        finally:
            harness.kill_ranks(procs)
        frames.stop()
        follower.join(30)
        assert follower.error is None
        with plane.lock:
            n = plane.replica.iterations_done
            assert plane.replica.stale is None
        assert plane.app.persister.flush(60)
        # the checkpoint a restore from disk gives: the newest one proven equal to the trainer
        chosen = restore.select(root)
        m = ckptdir.parse_step(chosen.path.name)
        assert m == ckptdir.parse_step(ckptdir.latest(root).name) or "proven equal" in chosen.reason, chosen
        assert 1 <= m <= n

        ref = tmp_path / "reference"
        harness.wait_ranks(harness.spawn_ranks(WORLD, ref, SECRET, steps=n + 5), ref, timeout=200)
        want = harness.read_digests(ref)
        killed = harness.read_digests(run)
        assert all(killed[s] == want[s] for s in killed if s <= n + 5)  # same history before the kill

        mem = tmp_path / "from_memory"
        harness.wait_ranks(harness.spawn_ranks(WORLD, mem, SECRET, control_port=plane.port, steps=5,
                                               extra=["--restore", "appliance"]), mem, timeout=200)
        disk = tmp_path / "from_disk"
        harness.wait_ranks(harness.spawn_ranks(WORLD, disk, SECRET, steps=5, extra=["--restore", str(root)]),
                           disk, timeout=200)
    finally:
        plane.stop()
    assert plane.stats.restores["memory"] == WORLD  # every rank pulled the state
    for out, start in ((mem, n), (disk, m)):
        for rank in range(WORLD):
            got = harness.read_digests(out, rank)
            assert sorted(got) == list(range(start + 1, start + 6)), (out, sorted(got))
            ref_rank = harness.read_digests(ref, rank)
            for s in got:
                assert {k: got[s][k] for k in KEYS} == {k: ref_rank[s][k] for k in KEYS}, (out.name, rank, s)
