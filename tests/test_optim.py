"""updater.optim alone: what it builds from a TrainingSpec steps bit-identically to torch's own
optimizer, scheduler and GradScaler built by hand with the same hyper-parameters (written out
literally here, never read back from the spec), and specs it cannot build are refused by name.
"""

from __future__ import annotations

import math

import pytest
import torch
from mirrorckpt.config.training import LossScaleSpec, LRScheduleSpec, OptimizerSpec, SpecError, TrainingSpec
from mirrorckpt.updater.optim import LossScaler, build_optimizer, build_scheduler, fresh_state, state_keys

SHAPES = [(17, 33), (33,), (1,), (4, 3, 5)]
STEPS = 5

# name -> (spec fields, torch class, the same hyper-parameters as torch keywords)
OPTIMIZERS = {
    "adam": (dict(name="adam", lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01),
             torch.optim.Adam, dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.01)),
    "adam-amsgrad-maximize": (dict(name="adam", lr=2e-2, betas=(0.5, 0.9), eps=1e-4, amsgrad=True, maximize=True),
                              torch.optim.Adam, dict(lr=2e-2, betas=(0.5, 0.9), eps=1e-4, amsgrad=True, maximize=True)),
    "adamw": (dict(name="adamw", lr=1e-2, betas=(0.85, 0.98), eps=1e-7, weight_decay=0.2),
              torch.optim.AdamW, dict(lr=1e-2, betas=(0.85, 0.98), eps=1e-7, weight_decay=0.2)),
    "adamw-amsgrad": (dict(name="adamw", lr=5e-3, amsgrad=True, weight_decay=0.05),
                      torch.optim.AdamW, dict(lr=5e-3, amsgrad=True, weight_decay=0.05)),
    "sgd": (dict(name="sgd", lr=0.05), torch.optim.SGD, dict(lr=0.05)),
    "sgd-momentum-dampening": (dict(name="sgd", lr=0.03, momentum=0.8, dampening=0.1, weight_decay=1e-3),
                               torch.optim.SGD, dict(lr=0.03, momentum=0.8, dampening=0.1, weight_decay=1e-3)),
    "sgd-nesterov-maximize": (dict(name="sgd", lr=0.02, momentum=0.9, nesterov=True, maximize=True),
                              torch.optim.SGD, dict(lr=0.02, momentum=0.9, nesterov=True, maximize=True)),
}
IMPLS = {"for-loop": dict(foreach=False, fused=False), "foreach": dict(foreach=True, fused=False),
         "fused": dict(foreach=False, fused=True)}


def params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g) * (10.0 ** (k - 2)) for k, s in enumerate(SHAPES)]


def step(opt: torch.optim.Optimizer, ps: list[torch.Tensor], i: int) -> None:
    for p, g in zip(ps, grads(i)):
        p.grad = g.clone()
    opt.step()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN payloads and the sign of zero included)."""
    def raw(t):
        return t.detach().reshape(-1).contiguous().view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))


def assert_same(ours: torch.optim.Optimizer, ps, ref: torch.optim.Optimizer, rs, where: str) -> None:
    for k, (p, r) in enumerate(zip(ps, rs)):
        assert same_bits(p, r), f"{where}: parameter {k} differs"
        sa, sb = ours.state.get(p, {}), ref.state.get(r, {})
        assert sa.keys() == sb.keys(), f"{where}: state keys {sorted(sa)} vs {sorted(sb)}"
        for key in sa:
            assert same_bits(sa[key], sb[key]), f"{where}: state {k}.{key} differs"


def group(opt: torch.optim.Optimizer) -> dict:
    return {k: v for k, v in opt.param_groups[0].items() if k != "params"}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_optimizer_steps_like_torch_built_by_hand(name, impl):
    fields, cls, kw = OPTIMIZERS[name]
    ps, rs = params(), params()
    ours = build_optimizer(OptimizerSpec(**fields, **IMPLS[impl]), ps)
    ref = cls(rs, **kw, **IMPLS[impl])
    assert type(ours) is cls and group(ours) == group(ref)
    for i in range(STEPS):
        step(ours, ps, i)
        step(ref, rs, i)
        assert_same(ours, ps, ref, rs, f"{name} {impl} step {i}")
    assert not all(same_bits(p, q) for p, q in zip(ps, params()))  # it did move


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_keys_are_the_keys_torch_keeps(name, impl):
    fields, _, _ = OPTIMIZERS[name]
    spec = OptimizerSpec(**fields, **IMPLS[impl])
    ps = params()
    opt = build_optimizer(spec, ps)
    step(opt, ps, 0)
    for p in ps:
        assert set(opt.state.get(p, {})) == set(state_keys(spec))


# SGD with dampening clones its first gradient undamped: no buffer value steps like that, so a
# checkpoint lists such parameters as unstepped and loaders drop their placeholder state
# (tests/test_restore.py: test_sgd_with_dampening_resumed_before_its_first_step_steps_like_a_fresh_one)
FRESH_EQUIVALENT = [n for n in OPTIMIZERS if n != "sgd-momentum-dampening"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", FRESH_EQUIVALENT)
def test_fresh_state_steps_like_a_never_stepped_optimizer(name, impl):
    """A checkpoint written before a parameter's first step holds fresh_state; loading it must
    not change the steps that follow."""
    fields, cls, kw = OPTIMIZERS[name]
    spec = OptimizerSpec(**fields, **IMPLS[impl])
    ps, rs = params(), params()
    ours = build_optimizer(spec, ps)
    sd = ours.state_dict()
    sd["state"] = {i: fresh_state(spec, p) for i, p in enumerate(ps) if state_keys(spec)}
    ours.load_state_dict(sd)
    ref = cls(rs, **kw, **IMPLS[impl])
    for i in range(3):
        step(ours, ps, i)
        step(ref, rs, i)
        assert_same(ours, ps, ref, rs, f"{name} {impl} step {i}")


def test_fresh_state_has_the_shapes_and_dtypes_of_a_stepped_one():
    for name, (fields, _, _) in OPTIMIZERS.items():
        spec = OptimizerSpec(**fields)
        ps = params()
        opt = build_optimizer(spec, ps)
        step(opt, ps, 0)
        for p in ps:
            fresh = fresh_state(spec, p)
            assert fresh.keys() == opt.state.get(p, {}).keys(), name
            for k, v in fresh.items():
                real = opt.state[p][k]
                assert (v.dtype, v.shape) == (real.dtype, real.shape) and not v.any(), (name, k)


# -- LR schedules --------------------------------------------------------------------------------

# name -> (kwargs in the spec, the same as torch keywords)
SCHEDULES = {
    "StepLR": dict(step_size=3, gamma=0.5),
    "MultiStepLR": dict(milestones=[2, 5, 7], gamma=0.3),
    "LinearLR": dict(start_factor=0.25, total_iters=6),
    "ExponentialLR": dict(gamma=0.9),
    "PolynomialLR": dict(total_iters=8, power=2.0),
    "CosineAnnealingLR": dict(T_max=7, eta_min=1e-5),
    "CosineAnnealingWarmRestarts": dict(T_0=3, T_mult=2, eta_min=1e-6),
    "CyclicLR": dict(base_lr=1e-4, max_lr=1e-2, step_size_up=3, mode="triangular2"),
    "OneCycleLR": dict(max_lr=0.05, total_steps=12, pct_start=0.25),
}


@pytest.mark.parametrize("opt_name", ["adamw", "sgd-nesterov-maximize"])
@pytest.mark.parametrize("sched", SCHEDULES)
def test_the_scheduler_steps_like_torch_built_by_hand(sched, opt_name):
    fields, cls, kw = OPTIMIZERS[opt_name]
    ps, rs = params(), params()
    ours = build_optimizer(OptimizerSpec(**fields), ps)
    ours_s = build_scheduler(LRScheduleSpec(sched, dict(SCHEDULES[sched])), ours)
    ref = cls(rs, **kw, foreach=False, fused=False)
    ref_s = getattr(torch.optim.lr_scheduler, sched)(ref, **SCHEDULES[sched])
    assert type(ours_s) is type(ref_s)
    lrs = set()
    for i in range(12):
        step(ours, ps, i)
        step(ref, rs, i)
        ours_s.step()
        ref_s.step()
        assert ours_s.get_last_lr() == ref_s.get_last_lr() and group(ours) == group(ref), f"{sched} step {i}"
        assert_same(ours, ps, ref, rs, f"{sched} {opt_name} step {i}")
        lrs.add(ours_s.get_last_lr()[0])
    assert len(lrs) > 2  # the schedule did change the rate
    assert ours_s.state_dict() == ref_s.state_dict()


def test_no_schedule_builds_none():
    opt = build_optimizer(OptimizerSpec(), params())
    assert build_scheduler(LRScheduleSpec(), opt) is None
    assert build_scheduler(LRScheduleSpec.from_dict({"name": "none"}), opt) is None


# -- fp16 loss scaling ------------------------------------------------------------------------------


def test_the_loss_scaler_follows_torch_grad_scaler():
    """Same unscaled gradients, same skips and the same scale as torch.amp.GradScaler on CPU, over
    overflows, a growth interval and the backoff."""
    spec = LossScaleSpec(init_scale=2.0 ** 10, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    ours = LossScaler(spec)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_factor=4.0, backoff_factor=0.25,
                               growth_interval=3)
    rs = params()
    ref_opt = torch.optim.SGD(rs, lr=0.1)
    inf_at = {1: math.inf, 5: math.nan, 6: -math.inf}
    scales, skipped = [], 0
    for i in range(14):
        ref.scale(torch.ones(()))  # GradScaler makes its scale tensor on first use
        g = [x * float(ours.scale.item()) for x in grads(i)]
        if i in inf_at:
            g[i % len(g)].view(-1)[0] = inf_at[i]
        mine = [x.clone() for x in g]
        found = ours.unscale_(mine)
        for r, x in zip(rs, g):
            r.grad = x.clone()
        ref.unscale_(ref_opt)
        before = [r.clone() for r in rs]
        ref.step(ref_opt)
        ref_skipped = all(torch.equal(a, b) for a, b in zip(before, rs))
        assert found == (i in inf_at) == ref_skipped, f"step {i}"
        skipped += found
        if not found:
            for a, r in zip(mine, rs):
                assert same_bits(a, r.grad), f"step {i}: unscaled gradients differ"
        ours.update(found)
        ref.update()
        assert ours.scale.item() == ref.get_scale(), f"step {i}"
        assert ours.state_dict()["growth_tracker"] == ref.state_dict()["_growth_tracker"], f"step {i}"
        scales.append(ours.scale.item())
    pairs = list(zip(scales, scales[1:]))
    assert skipped == 3 and any(y > x for x, y in pairs) and any(y < x for x, y in pairs)  # grew and backed off


def test_the_loss_scale_state_round_trips_and_refuses_garbage():
    a = LossScaler(LossScaleSpec(init_scale=256.0, growth_interval=2))
    a.update(False)
    a.update(False)
    a.update(True)
    a.update(False)
    b = LossScaler(LossScaleSpec())
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() == {"scale": 256.0, "growth_tracker": 1}
    for bad in ({"scale": 1.0}, {"scale": "x", "growth_tracker": 0}, None):
        with pytest.raises(ValueError, match="loss-scale state needs numeric 'scale' and 'growth_tracker'"):
            b.load_state_dict(bad)
    assert b.state_dict() == a.state_dict()  # a refused load changes nothing


# -- what cannot be built -----------------------------------------------------------------------------


@pytest.mark.parametrize("d,msg", [
    ({"name": "rmsprop"}, "optimizer: name must be one of adam, adamw, sgd, got 'rmsprop'"),
    ({"name": "adam", "foreach": True, "fused": True}, "optimizer: foreach and fused are mutually exclusive"),
    ({"name": "sgd", "nesterov": True}, "optimizer: nesterov needs momentum > 0 and dampening == 0"),
    ({"name": "sgd", "momentum": 0.9, "dampening": 0.1, "nesterov": True}, "nesterov needs momentum > 0"),
    ({"name": "adamw", "momentum": 0.9}, "momentum/dampening/nesterov apply to sgd only, not adamw"),
    ({"name": "sgd", "amsgrad": True}, "amsgrad applies to adam/adamw only"),
    ({"name": "adam", "betas": [0.9]}, "betas must be two numbers"),
    ({"name": "adam", "betas": [0.9, 1.0]}, r"betas\[1\] must be < 1"),
    ({"name": "adam", "lr": -1e-3}, "lr must be >= 0"),
    ({"name": "adam", "eps": math.nan}, "eps must be a finite number"),
    ({"name": "adam", "fused": "yes"}, "fused must be true or false"),
    ({"name": "adam", "beta1": 0.9}, "unknown key"),
])
def test_an_optimizer_that_cannot_be_built_is_refused_by_name(d, msg):
    with pytest.raises(SpecError, match=msg):
        build_optimizer(OptimizerSpec.from_dict(d), params())


@pytest.mark.parametrize("d,msg", [
    ({"name": "WarmupLR"}, "lr_schedule: name must be 'none', 'reported' or one of"),
    ({"name": "LambdaLR"}, "LambdaLR needs argument"),
    ({"name": "ReduceLROnPlateau", "kwargs": {"mode": "sideways"}}, "ReduceLROnPlateau cannot be built: mode"),
    ({"name": "none", "kwargs": {"gamma": 0.5}}, "name 'none' takes no kwargs"),
    ({"name": "StepLR"}, "StepLR needs argument"),
    ({"name": "StepLR", "kwargs": {"step_size": 2, "warmup": 3}}, r"StepLR got unknown argument\(s\) warmup"),
    ({"name": "CyclicLR", "kwargs": {"base_lr": 0.1, "max_lr": 1.0, "scale_fn": "x"}},
     "scale_fn must name a function by its importable path"),
    ({"name": "StepLR", "kwargs": [2]}, "kwargs must be a table/dict"),
])
def test_a_schedule_that_cannot_be_built_is_refused_by_name(d, msg):
    with pytest.raises(SpecError, match=msg):
        build_scheduler(LRScheduleSpec.from_dict(d), build_optimizer(OptimizerSpec(), params()))


def test_torch_refuses_what_only_it_can_check():
    """Argument values the spec's signature check lets through reach torch, whose error names them."""
    opt = build_optimizer(OptimizerSpec(), params())
    with pytest.raises(ValueError, match="total_steps"):
        build_scheduler(LRScheduleSpec("OneCycleLR", {"max_lr": 0.1, "total_steps": -1}), opt)
    spec = TrainingSpec.from_dict({"optimizer": {"name": "sgd", "lr": 0.1}, "lr_schedule":
                                  {"name": "LinearLR", "kwargs": {"start_factor": 0.0}}})
    with pytest.raises(ValueError, match="multiplicative factor"):
        build_scheduler(spec.lr_schedule, build_optimizer(spec.optimizer, params()))


def test_an_optimizer_name_the_builder_does_not_know_is_an_error():
    spec = OptimizerSpec("adam")
    spec.name = "rmsprop"
    with pytest.raises(ValueError, match="rmsprop"):
        build_optimizer(spec, params())
