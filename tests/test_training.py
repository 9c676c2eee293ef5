"""Training recipes as LLM jobs run them: several param groups with their own hyper-parameters,
and every step-driven torch LR scheduler (LambdaLR and SequentialLR with importable functions,
cycling momentum) plus ReduceLROnPlateau on reported metrics. The replica against plain torch
written here: bit-identical state and hyper-parameters after every iteration, and checkpoints
whose keys are get_state_dict's for several groups."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec
from mirrorckpt.config.training import LRScheduleSpec, OptimizerSpec, TrainingSpec
from mirrorckpt.parser.iteration import ReducedIteration
from mirrorckpt.updater.dcp_keys import flatten
from mirrorckpt.updater.fingerprint import state_sha256
from mirrorckpt.updater.persist import write_checkpoint
from mirrorckpt.updater.replica import LayoutMismatch, Replica
from mirrorckpt.updater.restore import load_into, read_state, verify
from torch import nn

PARAMS = [("embed.weight", (8, 4)), ("block.fc.weight", (6, 8)), ("block.fc.bias", (6,)),
          ("block.norm.weight", (6,)), ("head.weight", (3, 6)), ("head.bias", (3,))]
LAYOUT = JobLayout([ParamSpec(n, s) for n, s in PARAMS],
                   [BucketSpec((5, 4, 3)), BucketSpec((2, 1, 0))],
                   first_buckets=[BucketSpec((5, 4, 3, 2, 1, 0))])
DECAY = [n for n, s in PARAMS if len(s) == 2]  # weights: decay; biases and norms: none
NO_DECAY = [n for n, s in PARAMS if len(s) == 1]


def warmup(epoch: int) -> float:
    """An LR lambda named by its importable path."""
    return min(1.0, (epoch + 1) / 4) * 0.95 ** epoch


def half_life(epoch: int) -> float:
    return 0.5 ** (epoch / 3)


PATH = f"{__name__}:warmup"
HALF = f"{__name__}:half_life"


def two_groups(**second) -> list[dict]:
    return [{"params": DECAY, "options": {"weight_decay": 0.1}},
            {"params": NO_DECAY, "options": {"weight_decay": 0.0, **second}}]


# name -> (TrainingSpec, the same recipe in plain torch: model -> (optimizer, scheduler))
def _adamw_groups(m):
    return torch.optim.AdamW([{"params": [m.get_parameter(n) for n in DECAY], "weight_decay": 0.1},
                              {"params": [m.get_parameter(n) for n in NO_DECAY], "weight_decay": 0.0}],
                             lr=3e-3, foreach=False)


RECIPES = {
    "adamw-2groups-onecycle": (
        TrainingSpec(optimizer=OptimizerSpec("adamw", lr=3e-3), param_groups=two_groups(),
                     lr_schedule=LRScheduleSpec("OneCycleLR", {"max_lr": [1e-2, 2e-2], "total_steps": 12})),
        lambda m: (o := _adamw_groups(m),
                   torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[1e-2, 2e-2], total_steps=12))),
    "sgd-2groups-cyclic-momentum": (
        TrainingSpec(optimizer=OptimizerSpec("sgd", lr=0.01, momentum=0.9),
                     param_groups=[{"params": DECAY, "options": {"weight_decay": 1e-4}},
                                   {"params": NO_DECAY, "options": {"lr": 0.02, "nesterov": True}}],
                     lr_schedule=LRScheduleSpec("CyclicLR", {"base_lr": 0.01, "max_lr": 0.1, "step_size_up": 3,
                                                             "mode": "triangular2"})),
        lambda m: (o := torch.optim.SGD(
            [{"params": [m.get_parameter(n) for n in DECAY], "weight_decay": 1e-4},
             {"params": [m.get_parameter(n) for n in NO_DECAY], "lr": 0.02, "nesterov": True}],
            lr=0.01, momentum=0.9, foreach=False),
            torch.optim.lr_scheduler.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=3, mode="triangular2"))),
    "adamw-2groups-lambda": (
        TrainingSpec(optimizer=OptimizerSpec("adamw", lr=3e-3), param_groups=two_groups(),
                     lr_schedule=LRScheduleSpec("LambdaLR", {"lr_lambda": [PATH, HALF]})),
        lambda m: (o := _adamw_groups(m), torch.optim.lr_scheduler.LambdaLR(o, [warmup, half_life]))),
    "adamw-2groups-sequential": (
        TrainingSpec(optimizer=OptimizerSpec("adamw", lr=3e-3), param_groups=two_groups(),
                     lr_schedule=LRScheduleSpec("SequentialLR", {
                         "schedulers": [{"name": "LinearLR", "kwargs": {"start_factor": 0.1, "total_iters": 3}},
                                        {"name": "MultiplicativeLR", "kwargs": {"lr_lambda": HALF}},
                                        {"name": "CosineAnnealingLR", "kwargs": {"T_max": 6}}],
                         "milestones": [3, 5]})),
        lambda m: (o := _adamw_groups(m), torch.optim.lr_scheduler.SequentialLR(o, [
            torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=3),
            torch.optim.lr_scheduler.MultiplicativeLR(o, half_life),
            torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=6)], milestones=[3, 5]))),
    "adam-chained": (
        TrainingSpec(optimizer=OptimizerSpec("adam", lr=1e-2, amsgrad=True),
                     lr_schedule=LRScheduleSpec("ChainedScheduler", {"schedulers": [
                         {"name": "ConstantLR", "kwargs": {"factor": 0.5, "total_iters": 2}},
                         {"name": "ExponentialLR", "kwargs": {"gamma": 0.9}}]})),
        lambda m: (o := torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True, foreach=False),
                   torch.optim.lr_scheduler.ChainedScheduler([
                       torch.optim.lr_scheduler.ConstantLR(o, factor=0.5, total_iters=2),
                       torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9)]))),
    "adamw-2groups-plateau": (
        TrainingSpec(optimizer=OptimizerSpec("adamw", lr=3e-3), param_groups=two_groups(),
                     lr_schedule=LRScheduleSpec("ReduceLROnPlateau", {"patience": 1, "factor": 0.5})),
        lambda m: (o := _adamw_groups(m), torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=1, factor=0.5))),
}
LOSSES = [3.0, 2.0, 2.5, 2.4, 2.6, 1.0, 1.1, 1.2, 1.3, 0.5]  # plateaus: the LR is cut twice


def build_module() -> nn.Module:
    root = nn.Module()
    for name, shape in PARAMS:
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if part not in m._modules:
                m.add_module(part, nn.Module())
            m = m._modules[part]
        m.register_parameter(leaf, nn.Parameter(torch.zeros(shape)))
    return root


def init_weights(seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * 0.5 for n, s in PARAMS}


class Ref:
    """The recipe in plain torch: gradients from the buckets, step, scheduler step."""

    def __init__(self, name):
        self.model = build_module()
        with torch.no_grad():
            for n, v in init_weights().items():
                self.model.get_parameter(n).copy_(v)
        self.opt, self.sched = RECIPES[name][1](self.model)
        self.plateau = isinstance(self.sched, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def step(self, it: ReducedIteration):
        for spec, flat in zip(LAYOUT.bucket_list(it.index), it.buckets):
            pos = 0
            for i in spec.params:
                p = self.model.get_parameter(PARAMS[i][0])
                p.grad = torch.from_numpy(flat[pos:pos + p.numel()].copy()).view(p.shape)
                pos += p.numel()
        self.opt.step()
        if self.plateau:
            self.sched.step(LOSSES[it.index])
            it.meta = {"lr_scheduler": self.sched.state_dict()}  # what the trainer reports
        else:
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    def sha(self):
        return state_sha256([self.model.get_parameter(n) for n, _ in PARAMS], self.opt)


def iteration(i: int, rng) -> ReducedIteration:
    bufs = [(rng.standard_normal(LAYOUT.bucket_count(b)) * 0.1).astype(np.float32) for b in LAYOUT.bucket_list(i)]
    return ReducedIteration(index=i, buckets=bufs)


def hyper(opt) -> list[dict]:
    # foreach/fused: None on the trainer, False in a spec; both pick the same for-loop kernels
    return [{k: v for k, v in g.items() if k not in ("params", "foreach", "fused")} for g in opt.param_groups]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_bit_exact_against_plain_torch(name):
    ref = Ref(name)
    rep = Replica(LAYOUT, RECIPES[name][0], init_weights())
    assert hyper(rep.optimizer) == hyper(ref.opt)
    rng = np.random.default_rng(7)
    seen = set()
    for i in range(len(LOSSES)):
        it = iteration(i, rng)
        ref.step(it)
        rep.apply(it)
        assert rep.state_sha256() == ref.sha(), f"iteration {i}"
        assert hyper(rep.optimizer) == hyper(ref.opt), f"iteration {i}"
        assert rep.scheduler.state_dict().keys() == ref.sched.state_dict().keys()
        seen.add(tuple((g["lr"], g.get("betas"), g.get("momentum")) for g in rep.optimizer.param_groups))
    assert len(seen) >= 3  # the schedule really moved the hyper-parameters
    if name.endswith("plateau"):
        assert [g["lr"] for g in rep.optimizer.param_groups] == [3e-3 / 4, 3e-3 / 4]


def test_cycling_momentum_changes_beta1_every_step():
    ref = Ref("adamw-2groups-onecycle")
    rep = Replica(LAYOUT, RECIPES["adamw-2groups-onecycle"][0], init_weights())
    rng = np.random.default_rng(1)
    betas = []
    for i in range(6):
        it = iteration(i, rng)
        ref.step(it)
        rep.apply(it)
        betas.append(rep.optimizer.param_groups[0]["betas"][0])
    assert len(set(betas)) == 6 and rep.state_sha256() == ref.sha()


def test_two_group_checkpoint_has_get_state_dict_keys_and_loads_into_the_trainer(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    name = "adamw-2groups-onecycle"
    ref = Ref(name)
    rep = Replica(LAYOUT, RECIPES[name][0], init_weights())
    rng = np.random.default_rng(3)
    for i in range(4):
        it = iteration(i, rng)
        ref.step(it)
        rep.apply(it)
    path = write_checkpoint(tmp_path / "root", rep.state_dict_for_checkpoint())
    assert verify(path).ok
    msd, osd = get_state_dict(ref.model, ref.opt)
    want = flatten({"model": msd, "optim": osd})
    have = flatten(rep.state_dict_for_checkpoint())
    assert set(want) <= set(have)
    assert have["optim.param_groups.0.params"] == want["optim.param_groups.0.params"] == DECAY
    assert have["optim.param_groups.1.params"] == NO_DECAY
    for k in want:
        if "param_groups" in k and not k.endswith((".foreach", ".fused")):
            assert have[k] == want[k], k
    # the trainer resumes from it: params, Adam state, both groups' hyper-parameters, scheduler
    fresh = Ref(name)
    load_into(fresh.model, fresh.opt, tmp_path / "root", scheduler=fresh.sched)
    assert fresh.sha() == ref.sha() and hyper(fresh.opt) == hyper(ref.opt)
    assert fresh.sched.state_dict() == ref.sched.state_dict()
    # and so does a replica (the restart path)
    again = Replica(LAYOUT, RECIPES[name][0], read_state(path))
    it = iteration(4, rng)
    ref.step(it)
    again.apply(it)
    assert again.state_sha256() == ref.sha() and hyper(again.optimizer) == hyper(ref.opt)


def test_groups_must_cover_the_layout_exactly():
    t = TrainingSpec(optimizer=OptimizerSpec("adamw"), param_groups=[{"params": DECAY}])
    with pytest.raises(LayoutMismatch, match="missing"):
        Replica(LAYOUT, t, init_weights())


def test_an_unresolvable_lambda_is_a_clear_error():
    t = TrainingSpec(lr_schedule=LRScheduleSpec("LambdaLR", {"lr_lambda": "no_such_module_x:f"}))
    with pytest.raises(ValueError, match="no_such_module_x:f: cannot be resolved"):
        Replica(LAYOUT, t, init_weights())
    assert math.isfinite(warmup(3))
