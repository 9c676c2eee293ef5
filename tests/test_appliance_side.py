"""control.appliance_side.AppliancePlane's re-arm rules, in process (handlers called directly, no
sockets): a REGISTER with the run id it already knows is a reconnection; one with a new run id is
the job restarted on a new communicator. The plane goes on from its replica when that holds the
resumed step, asks for a fallback when it does not, counts the new run's wire iterations from the
resumed step (laid out in DDP's first-iteration buckets again) and drops what the ended run's
wire still delivers."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec
from mirrorckpt.config.training import OptimizerSpec, PersistSpec, TrainingSpec
from mirrorckpt.control import messages as m
from mirrorckpt.control.appliance_side import AppliancePlane
from mirrorckpt.parser.iteration import ReducedIteration
from mirrorckpt.updater import ckptdir
from mirrorckpt.updater.replica import Replica

SECRET = "unit-secret-0123456789abcdef-xyz"
# DDP's first iteration all-reduces w then b; after the rebuild b then w
LAYOUT = JobLayout([ParamSpec("w", (4, 3)), ParamSpec("b", (4,))], [BucketSpec((1, 0))],
                   first_buckets=[BucketSpec((0, 1))])
TRAINING = TrainingSpec(optimizer=OptimizerSpec(name="adam", lr=0.1))


def initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"p:w": torch.randn(4, 3, generator=g), "p:b": torch.randn(4, generator=g)}


def register(run: str, step: int, state: bool = False) -> m.Message:
    return m.make(m.REGISTER, initial() if state else {}, job="t", step=step, run=run, layout=LAYOUT.to_dict(),
                  ring=None, training=TRAINING.to_dict())


def grads(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal(12).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}


def iteration(index: int, step: int, *, first: bool, run: int = 0, complete: bool = True) -> ReducedIteration:
    """The wire's iteration ``index`` carrying the gradients of optimizer step ``step``, in DDP's
    first-iteration order (w, b) or the rebuilt one (b, w)."""
    g = grads(step)
    flat = np.concatenate([g["w"], g["b"]] if first else [g["b"], g["w"]])
    if not complete:
        return ReducedIteration(index, [], False, {0: [(0, 4)]}, run=run)
    return ReducedIteration(index, [flat], run=run)


def meta(step: int) -> m.Message:
    return m.make(m.STEP_META, step=step, lr=0.1, loss_scale=None, data_position={"position": step})


def feed(plane: AppliancePlane, it: ReducedIteration, step: int) -> None:
    plane._on_step_meta(meta(step), None)
    plane.apply(it)


def reference(steps: int) -> Replica:
    """The trainer's state after ``steps`` steps (the first gradient in the first-iteration order)."""
    st = {k[2:]: v for k, v in initial().items()}
    r = Replica(LAYOUT, TRAINING, st)
    for i in range(steps):
        r.apply(iteration(i, i + 1, first=i == 0))
    return r


def follow(p: AppliancePlane) -> AppliancePlane:
    """``p`` with its replica following run "a" for 3 steps."""
    p.rearmed = []
    p.on_rearm = p.rearmed.append
    assert p._on_register(register("a", 0, state=True), None).body["info"] == {"step": 0}
    for i in range(3):
        feed(p, iteration(i, i + 1, first=i == 0), i + 1)
    assert p.replica.iterations_done == 3 and p.replica.state_sha256() == reference(3).state_sha256()
    return p


@pytest.fixture
def plane():
    p = follow(AppliancePlane(SECRET, parts=2))  # no layout configured: the REGISTER brings it
    yield p
    p.stop()


def test_reconnect_with_the_same_run_is_not_a_rearm(plane):
    replica = plane.replica
    ack = plane._on_register(register("a", 3), None)
    assert ack.body["info"] == {"step": 3}
    assert plane.stats.rearms == 0 and plane.run == 0 and plane.rearmed == []
    assert plane.replica is replica and replica.stale is None and plane.fallback is None
    feed(plane, iteration(3, 4, first=False), 4)  # the same wire goes on
    assert plane.replica.state_sha256() == reference(4).state_sha256()


def test_new_run_at_the_replicas_step_keeps_the_replica(plane):
    replica = plane.replica
    plane._on_register(register("b", 3), None)
    assert plane.stats.rearms == 1 and plane.run == 1 and plane.rearmed == [1] and plane.wire_base == 3
    assert plane.replica is replica and replica.stale is None
    assert plane.fallback is None and plane.stats.fallbacks_requested == 0
    # the new communicator's wire counts from 0, and its DDP lays out the first iteration as at start
    for i in range(3):
        feed(plane, iteration(i, 4 + i, first=i == 0, run=1), 4 + i)
    ref = reference(3)
    for i in range(3):
        ref.apply(iteration(3 + i, 4 + i, first=False))
    assert plane.replica.iterations_done == 6
    assert plane.replica.state_sha256() == ref.state_sha256()
    assert plane.replica.data_position == {"position": 6}


def test_new_run_at_another_step_asks_for_a_fallback(plane):
    plane._on_register(register("b", 2), None)  # resumed from an older checkpoint
    r = plane.replica
    assert plane.stats.rearms == 1 and plane.rearmed == [1]
    assert plane.stats.fallbacks_requested == 1 and plane.fallback is not None
    assert r.stale is not None and r.committable  # a state the trainer had, still served and committed
    before = r.state_sha256()
    feed(plane, iteration(0, 3, first=True, run=1), 3)  # waits for the fallback
    assert r.state_sha256() == before and r.iterations_done == 3


def test_resuming_before_the_newest_checkpoint_is_said(tmp_path, caplog):
    p = follow(AppliancePlane(SECRET, parts=2, persist=PersistSpec(str(tmp_path), keep_last=10)))
    try:
        assert p.app.persister.flush(30) and ckptdir.latest(tmp_path).name == "step-00000003"
        caplog.set_level(logging.WARNING, logger="mirrorckpt")
        p._on_register(register("b", 2), None)
        said = [r.getMessage() for r in caplog.records if "diverged history" in r.getMessage()]
        assert len(said) == 1 and "step-00000003" in said[0], said
    finally:
        p.stop()


def test_new_run_from_scratch_starts_from_its_registered_state(plane):
    plane._on_register(register("b", 0, state=True), None)  # the job started over from step 0
    assert plane.stats.rearms == 1 and plane.stats.fallbacks_requested == 0
    assert plane.replica.iterations_done == 0 and plane.replica.stale is None
    feed(plane, iteration(0, 1, first=True, run=1), 1)
    assert plane.replica.state_sha256() == reference(1).state_sha256()


def test_iterations_of_the_ended_run_are_dropped(plane):
    plane._on_register(register("b", 3), None)
    before = plane.replica.state_sha256()
    plane.apply(iteration(3, 4, first=False))  # the killed run's tail, flushed after the re-arm
    plane.apply(iteration(4, 5, first=False, complete=False))
    assert plane.stats.dropped_other_run == 2
    assert plane.replica.state_sha256() == before and plane.replica.iterations_done == 3
    assert plane.stats.fallbacks_requested == 0 and plane.replica.stale is None


def restore(plane) -> int:
    return plane._on_restore(m.make(m.RESTORE_REQUEST, step=None), None).body["step"]


def test_a_resume_from_the_served_state_goes_on_from_it(plane):
    assert restore(plane) == 3
    feed(plane, iteration(3, 4, first=False), 4)  # the killed run's last iteration, after the restore
    assert plane.replica.iterations_done == 4
    assert restore(plane) == 3  # the job's other rank restores the same step
    plane._on_register(register("b", 3), None)
    assert plane.stats.rearms == 1 and plane.stats.fallbacks_requested == 0
    assert plane.replica.iterations_done == 3 and plane.replica.state_sha256() == reference(3).state_sha256()
    feed(plane, iteration(0, 4, first=True, run=1), 4)
    ref = reference(3)
    ref.apply(iteration(3, 4, first=False))
    assert plane.replica.state_sha256() == ref.state_sha256()
    assert restore(plane) == 4  # once the job registered, restores serve the replica again


def test_a_held_restore_expires(plane):
    assert restore(plane) == 3
    feed(plane, iteration(3, 4, first=False), 4)
    plane.restore_hold = 0.0
    assert restore(plane) == 4
