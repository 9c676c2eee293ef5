"""Schedules the appliance cannot rebuild (closures, partials over nested functions, custom
classes, schedulers stepped per epoch) are followed from the trainer's reports: each STEP_META
carries every param group's hyper-parameters as the next step runs them and the scheduler's
state. An in-process plane is fed the trainer's own gradients as reduced iterations; the replica
equals the trainer bit for bit at every step (parameters, optimizer state, lr, betas, weight decay,
scheduler state), and a fallback rebuild with a reported schedule verifies."""

from __future__ import annotations

import functools
import math

import common
import pytest
import torch
from mirrorckpt.config.training import LRScheduleSpec, SpecError
from mirrorckpt.control.appliance_side import AppliancePlane
from mirrorckpt.control.link.schedules import schedule_spec
from mirrorckpt.control.trainer import attach
from mirrorckpt.parser.iteration import ReducedIteration
from mirrorckpt.tools.testbed.harness import Shard, build_model
from mirrorckpt.updater.dcp_keys import dumps
from mirrorckpt.updater.fingerprint import state_sha256
from mirrorckpt.updater.replica import ReplicaStale
from torch import nn

SECRET = "reported-schedule-secret-0123456789"
DIMS = (8, 16, 4)
wait_for = functools.partial(common.wait_for, timeout=20.0)


def nested_warmup(warmup: int):
    """torchtitan's shape: a partial over a function defined inside another (not importable)."""
    def linear_warmup(steps, current):
        return (current + 1) / (steps + 1) if current < steps else 0.5 ** (current - steps)
    return functools.partial(linear_warmup, warmup)


class Halving(torch.optim.lr_scheduler.LRScheduler):
    """A scheduler class of the user's own: halves lr and weight decay every 3 steps."""

    def get_lr(self):
        return [g["lr"] * (0.5 if self.last_epoch and self.last_epoch % 3 == 0 else 1.0)
                for g in self.optimizer.param_groups]

    def step(self, epoch=None):
        super().step(epoch)
        if self.last_epoch and self.last_epoch % 3 == 0:
            for g in self.optimizer.param_groups:
                g["weight_decay"] *= 0.5


def groups_of(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}]


RECIPES = {
    "closure": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)),
    "nested partial": lambda o: torch.optim.lr_scheduler.LambdaLR(o, nested_warmup(2)),
    "own class": Halving,
    # importable, but followed from the reports when asked (Lightning's interval="epoch"): betas move
    "onecycle reported": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 0.05, total_steps=40, pct_start=0.3),
}


def test_schedules_the_appliance_cannot_import_are_reported_and_importable_ones_rebuilt():
    opt = torch.optim.AdamW(groups_of(build_model(DIMS, 0)), lr=1e-2)
    for name in ("closure", "nested partial", "own class"):
        spec = schedule_spec(RECIPES[name](opt))
        assert spec.reported and spec.enabled, name
        assert LRScheduleSpec.from_dict(spec.to_dict()) == spec
    assert schedule_spec(torch.optim.lr_scheduler.StepLR(opt, 3)).name == "StepLR"
    assert schedule_spec(torch.optim.lr_scheduler.StepLR(opt, 3), report=True).reported
    with pytest.raises(SpecError, match="takes only kwargs.scheduler"):
        LRScheduleSpec("reported", {"lr_lambda": "m:f"})


class Job:
    """One process training with ``make_scheduler`` attached to ``plane``; ``want[step]``: its state."""

    def __init__(self, plane, make_scheduler, **attach_kw):
        torch.manual_seed(0)
        self.plane, self.model = plane, build_model(DIMS, 3)
        self.opt = torch.optim.AdamW(groups_of(self.model), lr=1e-2, foreach=False)
        self.sched = make_scheduler(self.opt)
        self.shard = Shard(DIMS, 3, 0)
        self.link = attach(self.model, self.opt, appliance=("127.0.0.1", plane.port), secret=SECRET,
                           scheduler=self.sched, data=self.shard, parts=2, fingerprint_every=0, connect_timeout=10,
                           **attach_kw)
        self.want: dict[int, tuple] = {}

    def step(self, step: int) -> None:
        x, y = self.shard.next()
        self.opt.zero_grad(set_to_none=True)
        (10 * nn.functional.mse_loss(self.model(x), y)).backward()
        self.opt.step()
        self.sched.step()
        self.want[step] = state_of(list(self.model.parameters()), self.opt,
                                   dumps(self.sched.state_dict(), "lr_scheduler"))
        if step == 1:
            assert wait_for(lambda: self.plane.replica is not None)

    def feed(self, index: int) -> None:
        """Iteration ``index``'s reduced gradients as the wire would give them (one process: its own)."""
        grads = [p.grad.detach().reshape(-1) for p in self.model.parameters()]
        buckets = [torch.cat([grads[i] for i in b.params]).numpy().copy()
                   for b in self.plane.layout.bucket_list(index)]
        self.plane.apply(ReducedIteration(index, buckets))


def state_of(params, opt, sched_state) -> tuple:
    ps, os_ = state_sha256(params, opt)
    hp = [(g["lr"], tuple(g.get("betas", ())), g["weight_decay"]) for g in opt.param_groups]
    return ps, os_, hp, sched_state


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_reported_schedule_is_followed_bit_for_bit(recipe):
    seen: dict[int, tuple] = {}
    plane = AppliancePlane(SECRET, parts=2, fingerprint_every=0, fallback_timeout=60, on_iteration=lambda _i, r: (
        seen.__setitem__(r.iterations_done, state_of(r.params, r.optimizer,
                                                     dumps(r.reported_schedule, "lr_scheduler"))))).start()
    try:
        job = Job(plane, RECIPES[recipe], report_schedule=recipe.endswith("reported"))
        for step in range(1, 13):
            job.step(step)
            job.feed(step - 1)
            # the previous step's report went out at this step's start: keep the plane within its
            # max_meta_lag (beyond it an iteration is applied without its report: stale, by design)
            assert wait_for(lambda step=step: plane.replica.iterations_done >= step - 1)
        job.link.close()
        want = job.want
        assert wait_for(lambda: 12 in seen), sorted(seen)
        assert plane.training.lr_schedule.reported
        moved = {s: want[s][2] for s in want}
        assert len({repr(v) for v in moved.values()}) > 3, "the schedule did not move: nothing was tested"
        for s in range(1, 13):
            assert seen[s] == want[s], f"step {s}"
        assert plane.stats.drift_events == 0
    finally:
        plane.stop()


def test_a_fallback_with_a_reported_schedule_rebuilds_the_trainers_state():
    plane = AppliancePlane(SECRET, parts=2, fingerprint_every=0, fallback_timeout=60).start()
    try:
        job = Job(plane, lambda o: torch.optim.lr_scheduler.LambdaLR(o, nested_warmup(3)))
        for step in range(1, 10):
            job.step(step)
            if step == 1:
                assert plane.request_fallback("test")
                assert wait_for(lambda: job.link.fallback_pending)  # not reaching the link after step 9
            if plane.stats.fallbacks_done:
                break
        job.link.close()
        want = job.want
        assert plane.stats.fallbacks_done == 1, plane.stats
        r = plane.replica
        got = state_of(r.params, r.optimizer, dumps(r.reported_schedule, "lr_scheduler"))
        assert got == want[r.iterations_done]
        assert not math.isclose(want[r.iterations_done][2][0][0], 1e-2)  # the warm-up moved lr
    finally:
        plane.stop()


def test_a_step_without_its_report_leaves_the_replica_stale_not_guessing():
    plane = AppliancePlane(SECRET, parts=2, fingerprint_every=0, fallback_timeout=60).start()
    try:
        job = Job(plane, RECIPES["closure"])
        job.step(1)
        with plane.lock:
            r = plane.replica
            grads = [p.grad.detach().reshape(-1) for p in job.model.parameters()]
            buckets = [torch.cat([grads[i] for i in b.params]).numpy().copy() for b in plane.layout.bucket_list(0)]
            with pytest.raises(ReplicaStale):
                r.apply(ReducedIteration(0, buckets))  # no STEP_META: no hparams, no scheduler state
            assert not r.committable
        job.link.close()
    finally:
        plane.stop()
