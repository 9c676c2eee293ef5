"""The replica against a plain-torch reference trainer written here from ARCHITECTURE.md's
"Trainer semantics": same random reduced gradients, bit-identical state after every iteration."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec
from mirrorckpt.config.training import (
    ClipSpec,
    LossScaleSpec,
    LRScheduleSpec,
    OptimizerSpec,
    PersistSpec,
    SpecError,
    TrainingSpec,
)
from mirrorckpt.parser.iteration import ReducedIteration
from mirrorckpt.updater.dcp_keys import ReplicaState
from mirrorckpt.updater.fingerprint import state_sha256
from mirrorckpt.updater.replica import LayoutMismatch, Replica, ReplicaStale
from torch import nn

PARAMS = [("embed.weight", (8, 4)), ("layers.0.fc.weight", (6, 8)), ("layers.0.fc.bias", (6,)),
          ("layers.1.fc.weight", (3, 6)), ("layers.1.fc.bias", (3,)), ("head.scale", (1,))]


def make_layout(grad_dtype="float32") -> JobLayout:
    # DDP fills buckets roughly in reverse registration order and rebuilds them after iteration 0.
    return JobLayout(
        params=[ParamSpec(n, s) for n, s in PARAMS],
        buckets=[BucketSpec((5, 4, 3)), BucketSpec((2, 1)), BucketSpec((0,))],
        first_buckets=[BucketSpec((5, 4)), BucketSpec((3, 2, 1, 0))],
        grad_dtype=grad_dtype,
    )


def build_module(layout: JobLayout) -> nn.Module:
    """An nn.Module whose parameter FQNs are the layout's names (registered in layout order)."""
    root = nn.Module()
    for spec in layout.params:
        *path, leaf = spec.name.split(".")
        m = root
        for part in path:
            if part not in m._modules:
                m.add_module(part, nn.Module())
            m = m._modules[part]
        m.register_parameter(leaf, nn.Parameter(torch.zeros(spec.shape)))
    return root


class RefTrainer:
    """The trainer's step in plain torch calls, independent of mirrorckpt.updater."""

    def __init__(self, layout: JobLayout, training: TrainingSpec, init: dict[str, torch.Tensor]):
        self.layout, self.t = layout, training
        self.model = build_module(layout)
        with torch.no_grad():
            for n, v in init.items():
                self.model.get_parameter(n).copy_(v)
        self.masters = [self.model.get_parameter(p.name) for p in layout.params]
        o = training.optimizer
        if o.name == "sgd":
            self.opt = torch.optim.SGD(self.masters, lr=o.lr, momentum=o.momentum, dampening=o.dampening,
                                       nesterov=o.nesterov, weight_decay=o.weight_decay, maximize=o.maximize,
                                       foreach=o.foreach, fused=o.fused)
        else:
            cls = torch.optim.Adam if o.name == "adam" else torch.optim.AdamW
            self.opt = cls(self.masters, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                           amsgrad=o.amsgrad, maximize=o.maximize, foreach=o.foreach, fused=o.fused)
        ls = training.lr_schedule
        self.sched = getattr(torch.optim.lr_scheduler, ls.name)(self.opt, **ls.kwargs) if ls.enabled else None
        self.scale = training.loss_scale.init_scale if training.loss_scale else None
        self.tracker = 0
        self.steps = 0

    def step(self, index: int, buckets: list[np.ndarray]):
        for spec, flat in zip(self.layout.bucket_list(index), buckets):
            pos = 0
            for i in spec.params:
                p = self.masters[i]
                chunk = flat[pos:pos + p.numel()].copy()
                pos += p.numel()
                if self.t.grad_dtype == "bfloat16":
                    g = torch.from_numpy(chunk.view(np.int16)).view(torch.bfloat16).float()
                else:
                    g = torch.from_numpy(chunk).float()
                p.grad = g.view(p.shape)
        skip = False
        if self.scale is not None:
            ls = self.t.loss_scale
            skip = any(not bool(torch.isfinite(p.grad).all()) for p in self.masters)
            inv = torch.tensor(1.0 / self.scale, dtype=torch.float32)
            for p in self.masters:
                p.grad.mul_(inv)
            if skip:
                self.scale *= ls.backoff_factor
                self.tracker = 0
            else:
                self.tracker += 1
                if self.tracker == ls.growth_interval:
                    self.scale *= ls.growth_factor
                    self.tracker = 0
        if not skip:
            if self.t.clip:
                torch.nn.utils.clip_grad_norm_(self.masters, self.t.clip.max_norm, self.t.clip.norm_type)
            self.opt.step()
            self.steps += 1
        if self.sched is not None and (not skip or self.t.loss_scale.scheduler_step_on_skip):
            self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    def sha(self):
        return state_sha256(self.masters, self.opt)


def random_init(layout, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {p.name: torch.randn(p.shape, generator=g) * 0.5 for p in layout.params}


def random_iteration(layout: JobLayout, index: int, rng: np.random.Generator, scale=1.0, inject_inf=False):
    """Reduced gradient buckets as the parser hands them (bf16 as uint16 bits)."""
    out = []
    for b, spec in enumerate(layout.bucket_list(index)):
        x = (rng.standard_normal(layout.bucket_count(spec)) * 0.1 * scale).astype(np.float32)
        if inject_inf and b == 0:
            x[1] = np.inf
        if layout.grad_dtype == "bfloat16":
            out.append(torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
        elif layout.grad_dtype == "float16":
            out.append(x.astype(np.float16))
        else:
            out.append(x)
    return ReducedIteration(index=index, buckets=out)


CONFIGS = {
    "adam-fp32": TrainingSpec(optimizer=OptimizerSpec("adam", lr=1e-2, weight_decay=0.01)),
    "adamw-bf16-clip-cosine": TrainingSpec(
        optimizer=OptimizerSpec("adamw", lr=3e-3, weight_decay=0.1),
        lr_schedule=LRScheduleSpec("CosineAnnealingLR", {"T_max": 5}),
        clip=ClipSpec(max_norm=0.05), grad_dtype="bfloat16"),
    "sgd-nesterov-clip-step": TrainingSpec(
        optimizer=OptimizerSpec("sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),
        lr_schedule=LRScheduleSpec("StepLR", {"step_size": 2, "gamma": 0.5}), clip=ClipSpec(0.1, 1.0)),
    "sgd-dampening": TrainingSpec(optimizer=OptimizerSpec("sgd", lr=0.05, momentum=0.8, dampening=0.1)),
    "adam-fp16-amsgrad-linear": TrainingSpec(
        optimizer=OptimizerSpec("adam", lr=1e-2, amsgrad=True),
        lr_schedule=LRScheduleSpec("LinearLR", {"start_factor": 0.5, "total_iters": 4}),
        clip=ClipSpec(1.0), grad_dtype="float16",
        loss_scale=LossScaleSpec(init_scale=1024.0, growth_interval=2)),
    "adamw-fp16-onecycle": TrainingSpec(
        optimizer=OptimizerSpec("adamw", lr=1e-2, weight_decay=0.05, maximize=True),
        lr_schedule=LRScheduleSpec("OneCycleLR", {"max_lr": 1e-2, "total_steps": 20}),
        grad_dtype="float16", loss_scale=LossScaleSpec(init_scale=256.0, growth_interval=3,
                                                       scheduler_step_on_skip=False)),
    "adam-foreach": TrainingSpec(optimizer=OptimizerSpec("adam", lr=1e-2, foreach=True)),
    "adam-clip-inf": TrainingSpec(optimizer=OptimizerSpec("adam", lr=1e-2), clip=ClipSpec(0.02, math.inf)),
    "adamw-fp16-clip3": TrainingSpec(
        optimizer=OptimizerSpec("adamw", lr=1e-2), clip=ClipSpec(0.5, 3.0), grad_dtype="float16",
        loss_scale=LossScaleSpec(init_scale=512.0, growth_interval=2)),
}
INF_AT = {"adam-fp16-amsgrad-linear": {2}, "adamw-fp16-onecycle": {0, 4}, "adamw-fp16-clip3": {3}}


def _run_pair(name, n_iter=7, seed=1):
    training = CONFIGS[name]
    layout = make_layout(training.grad_dtype)
    init = random_init(layout, seed)
    ref = RefTrainer(layout, training, init)
    rep = Replica(layout, training, init)
    assert rep.state_sha256() == ref.sha()
    rng = np.random.default_rng(seed)
    scale = training.loss_scale.init_scale if training.loss_scale else 1.0
    return training, layout, ref, rep, rng, scale


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bit_exact_against_reference_trainer(name):
    training, layout, ref, rep, rng, _ = _run_pair(name)
    for i in range(7):
        scale = ref.scale if ref.scale is not None else 1.0
        it = random_iteration(layout, i, rng, scale=scale, inject_inf=i in INF_AT.get(name, ()))
        ref.step(i, it.buckets)
        stepped = rep.apply(it)
        assert rep.state_sha256() == ref.sha(), f"iteration {i}"
        assert rep.step == ref.steps and rep.iteration == i
        assert stepped == (i not in INF_AT.get(name, ()))
        assert [g["lr"] for g in rep.optimizer.param_groups] == [g["lr"] for g in ref.opt.param_groups]
        if ref.scale is not None:
            assert rep.scaler.state_dict()["scale"] == ref.scale
            assert rep.scaler.state_dict()["growth_tracker"] == ref.tracker
    if name in INF_AT:
        assert rep.step == 7 - len(INF_AT[name])


def test_initial_weights_from_flat_bf16_wire_buffer():
    layout = make_layout("bfloat16")
    init = random_init(layout, 3)
    flat = torch.cat([init[p.name].reshape(-1) for p in layout.params]).to(torch.bfloat16)
    bits = flat.view(torch.int16).numpy().view(np.uint16)
    rep = Replica.from_initial_weights(layout, CONFIGS["adamw-bf16-clip-cosine"], bits)
    for p, t in zip(layout.params, rep.params):
        assert torch.equal(t, init[p.name].to(torch.bfloat16).float())
    assert rep.step == 0 and rep.iterations_done == 0 and not rep.optimizer.state


def test_incomplete_iteration_is_not_applied_and_replica_stays_stale_until_resync():
    training, layout, ref, rep, rng, _ = _run_pair("adamw-bf16-clip-cosine")
    for i in range(2):
        it = random_iteration(layout, i, rng)
        ref.step(i, it.buckets)
        rep.apply(it)
    before = rep.state_sha256()
    good = random_iteration(layout, 2, rng)
    torn = ReducedIteration(2, [b.copy() for b in good.buckets], complete=False, holes={1: [(4, 10)]})
    torn.buckets[1][4:14] = 0
    with pytest.raises(ReplicaStale) as e:
        rep.apply(torn)
    assert (e.value.iteration, e.value.step, e.value.holes) == (2, 2, {1: [(4, 10)]})
    assert rep.state_sha256() == before and rep.iterations_done == 2
    for attempt in (good, random_iteration(layout, 3, rng)):
        with pytest.raises(ReplicaStale) as e:
            rep.apply(attempt)
        assert e.value.iteration == 2
    with pytest.raises(ReplicaStale):
        rep.apply_bucket(2, 0, good.buckets[0])
    assert rep.state_sha256() == before

    # The trainer took iteration 2; resync from its registration (get_state_dict form), continue.
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ref.step(2, good.buckets)
    msd, osd = get_state_dict(ref.model, ref.opt)
    rep.resync(ReplicaState(params=msd, optim=copy.deepcopy(osd), iterations_done=3, step=ref.steps,
                            lr_scheduler=ref.sched.state_dict(), training=training.to_dict()))
    assert rep.state_sha256() == ref.sha()
    for i in range(3, 6):
        it = random_iteration(layout, i, rng)
        ref.step(i, it.buckets)
        rep.apply(it)
        assert rep.state_sha256() == ref.sha()


def test_missed_iteration_turns_stale_and_duplicates_are_refused():
    training, layout, ref, rep, rng, _ = _run_pair("adam-fp32")
    rep.apply(random_iteration(layout, 0, rng))
    with pytest.raises(ValueError, match="already applied"):
        rep.apply(random_iteration(layout, 0, rng))
    before = rep.state_sha256()
    with pytest.raises(ReplicaStale) as e:
        rep.apply(random_iteration(layout, 2, rng))
    assert e.value.iteration == 1 and rep.state_sha256() == before


def test_layout_mismatch_names_the_bucket_and_applies_nothing():
    training, layout, ref, rep, rng, _ = _run_pair("adam-fp32")
    it = random_iteration(layout, 0, rng)
    before = rep.state_sha256()
    bad = ReducedIteration(0, [it.buckets[0], it.buckets[1][:-1]])
    with pytest.raises(LayoutMismatch, match="iteration 0 bucket 1: .* layout says"):
        rep.apply(bad)
    with pytest.raises(LayoutMismatch, match="3 buckets, layout says 2"):
        rep.apply(ReducedIteration(0, it.buckets + [it.buckets[0]]))
    with pytest.raises(LayoutMismatch, match="dtype"):
        rep.apply(ReducedIteration(0, [b.astype(np.float16) for b in it.buckets]))
    assert rep.state_sha256() == before and rep.stale is None
    rep.apply(it)


@pytest.mark.parametrize("name", ["adam-fp32", "sgd-dampening", "adam-foreach", "adamw-bf16-clip-cosine",
                                  "adam-fp16-amsgrad-linear", "sgd-nesterov-clip-step", "adam-clip-inf",
                                  "adamw-fp16-clip3", "adamw-fp16-onecycle"])
def test_pipelined_buckets_equal_whole_iteration(name):
    training, layout, ref, whole, rng, _ = _run_pair(name, seed=5)
    piped = Replica(layout, training, random_init(layout, 5))
    assert piped.separable == (training.clip is None and training.grad_dtype != "float16")
    order_rng = np.random.default_rng(9)
    for i in range(6):
        scale = whole.scaler.state_dict()["scale"] if whole.scaler else 1.0
        it = random_iteration(layout, i, rng, scale=scale, inject_inf=i in INF_AT.get(name, ()))
        whole.apply(it)
        order = order_rng.permutation(len(it.buckets))
        before = piped.state_sha256()
        for k, b in enumerate(order):
            done = piped.apply_bucket(i, int(b), it.buckets[b].copy())
            assert done == (k == len(order) - 1)
            if not done and not piped.separable:
                assert piped.state_sha256() == before  # buffered until the last bucket
        assert piped.state_sha256() == whole.state_sha256(), f"iteration {i}"
        assert piped.iterations_done == whole.iterations_done and piped.step == whole.step


@pytest.mark.parametrize("name", ["sgd-nesterov-clip-step", "adamw-bf16-clip-cosine", "adam-clip-inf",
                                  "adamw-fp16-clip3"])
def test_pipelined_clip_norms_are_taken_per_bucket_as_it_arrives(name, monkeypatch):
    """Global-norm clipping: each bucket's gradient norms are computed when the bucket arrives
    (one ``_foreach_norm`` over that bucket's gradients), the last bucket only combines them; the
    state is bit-identical to the whole-iteration step (and so to clip_grad_norm_)."""
    training, layout, ref, whole, rng, _ = _run_pair(name, seed=11)
    piped = Replica(layout, training, random_init(layout, 11))
    calls = []
    real = torch._foreach_norm

    def counting(tensors, *a, **kw):
        calls.append(len(tensors))
        return real(tensors, *a, **kw)

    for i in range(5):
        scale = whole.scaler.state_dict()["scale"] if whole.scaler else 1.0
        it = random_iteration(layout, i, rng, scale=scale * (40.0 if i == 2 else 1.0))  # i=2: clipped hard
        ref.step(i, it.buckets)
        whole.apply(it)
        sizes = [len(layout.bucket_list(i)[b].params) for b in range(len(it.buckets))]
        calls.clear()
        monkeypatch.setattr(torch, "_foreach_norm", counting)
        for b in reversed(range(len(it.buckets))):
            assert piped.apply_bucket(i, b, it.buckets[b].copy()) == (b == 0)
            if b:  # this bucket's norms, measured on arrival
                assert calls == sizes[b:][::-1], (i, b, calls)
        monkeypatch.setattr(torch, "_foreach_norm", real)
        assert calls == sizes[::-1], f"iteration {i}: norms over {calls}, buckets of {sizes}"
        assert piped.state_sha256() == whole.state_sha256() == ref.sha(), f"iteration {i}"
        assert piped.step == whole.step


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_clip_norm_in_two_halves_is_torchs_bit_for_bit(norm_type):
    """The per-bucket half and the combining half give clip_grad_norm_'s total norm and clipped
    gradients exactly, for tensors large enough that torch reduces them on several threads."""
    from mirrorckpt.updater.replica import _param_norms, _total_norm

    g = torch.Generator().manual_seed(int(norm_type) if norm_type != math.inf else 99)
    sizes = [1, 7, 4097, 300_001, 33, 65_536]
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.numel(), generator=g) * 3
    grads = [p.grad.clone() for p in params]
    want = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type)
    norms = {}
    for bucket in ([4, 1], [0, 5, 3], [2]):
        norms.update(zip(bucket, _param_norms([grads[i] for i in bucket], norm_type)))
    total = _total_norm([norms[i] for i in range(len(sizes))], norm_type)
    assert torch.equal(total, want)
    twins = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    for t, gr in zip(twins, grads):
        t.grad = gr
    torch.nn.utils.clip_grads_with_norm_(twins, 0.5, total)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(params, twins))


def test_pipelined_iteration_that_turns_incomplete_is_rolled_back():
    training, layout, ref, rep, rng, _ = _run_pair("adam-fp32")
    rep.apply(random_iteration(layout, 0, rng))
    before, fps = rep.state_sha256(), rep.fingerprints(optimizer=True)
    it = random_iteration(layout, 1, rng)
    assert not rep.apply_bucket(1, 2, it.buckets[2])
    assert not rep.apply_bucket(1, 0, it.buckets[0])
    assert rep.state_sha256() != before
    with pytest.raises(RuntimeError, match="half applied"):
        rep.state()
    with pytest.raises(ReplicaStale) as e:
        rep.apply(ReducedIteration(1, [], complete=False, holes={1: [(0, 3)]}))
    assert e.value.iteration == 1
    assert rep.state_sha256() == before and rep.fingerprints(optimizer=True) == fps

    # a bucket of the next iteration before the previous one completed: stale at the previous one
    _, _, _, rep2, rng2, _ = _run_pair("sgd-dampening")
    it0, it1 = random_iteration(layout, 0, rng2), random_iteration(layout, 1, rng2)
    rep2.apply_bucket(0, 0, it0.buckets[0])
    with pytest.raises(ReplicaStale) as e:
        rep2.apply_bucket(1, 0, it1.buckets[0])
    assert e.value.iteration == 0 and rep2.iterations_done == 0 and not rep2.optimizer.state


def test_fingerprints_change_with_every_step():
    training, layout, ref, rep, rng, _ = _run_pair("adam-fp32")
    f0 = rep.fingerprints()
    assert set(f0) == {f"model.{n}" for n, _ in PARAMS}
    rep.apply(random_iteration(layout, 0, rng))
    f1 = rep.fingerprints(optimizer=True)
    assert all(f1[k] != f0[k] for k in f0)
    assert "optim.state.embed.weight.exp_avg_sq" in f1


def test_training_spec_round_trip_and_errors():
    t = TrainingSpec(optimizer=OptimizerSpec("sgd", momentum=0.9),
                     lr_schedule=LRScheduleSpec("StepLR", {"step_size": 3}), clip=ClipSpec(1.0, math.inf),
                     persist=PersistSpec("/tmp/x", every_seconds=5.0), grad_dtype="float16")
    assert t.loss_scale == LossScaleSpec()
    assert TrainingSpec.from_dict(t.to_dict()) == t
    cases = [
        (lambda: OptimizerSpec("lamb"), "optimizer: name must be one of adam, adamw, sgd"),
        (lambda: OptimizerSpec("adam", lr=-1), "lr must be >= 0"),
        (lambda: OptimizerSpec("adam", betas=(0.9, 1.0)), r"betas\[1\] must be < 1"),
        (lambda: OptimizerSpec("adam", momentum=0.9), "apply to sgd only"),
        (lambda: OptimizerSpec("sgd", nesterov=True), "nesterov needs momentum"),
        (lambda: OptimizerSpec("adam", foreach=True, fused=True), "mutually exclusive"),
        (lambda: LRScheduleSpec("LambdaLRX", {}), "lr_schedule: name must be 'none', 'reported' or one of"),
        (lambda: LRScheduleSpec("LambdaLR", {}), "LambdaLR needs argument.* lr_lambda"),
        (lambda: LRScheduleSpec("LambdaLR", {"lr_lambda": "lambda e: 0.9 ** e"}), "importable path"),
        (lambda: LRScheduleSpec("SequentialLR", {"schedulers": [{"name": "ReduceLROnPlateau"}], "milestones": []}),
         "step-driven"),
        (lambda: TrainingSpec(param_groups=[{"params": ["a"]}, {"params": ["a", "b"]}]), "two param groups"),
        (lambda: TrainingSpec(param_groups=[{"params": ["a"], "options": {"momentum": 0.9}}]),
         r"param_groups\[0\]: optimizer: momentum/dampening/nesterov apply to sgd only"),
        (lambda: TrainingSpec(param_groups=[{"params": ["a"], "options": {"foreach": True}}]), "unknown option"),
        (lambda: LRScheduleSpec("StepLR", {}), "StepLR needs argument.* step_size"),
        (lambda: LRScheduleSpec("StepLR", {"step_size": 1, "gama": 0.1}),
         "unknown argument.* gama .*accepts: step_size, gamma"),
        (lambda: ClipSpec(max_norm=0), "clip: max_norm must be > 0"),
        (lambda: LossScaleSpec(backoff_factor=1.5), "backoff_factor must be < 1"),
        (lambda: PersistSpec(keep_last=0), "keep_last must be an integer >= 1"),
        (lambda: TrainingSpec(grad_dtype="int8"),
         "training: grad_dtype must be one of float32, bfloat16, float16, got 'int8'"),
        (lambda: TrainingSpec(loss_scale=LossScaleSpec()), "loss_scale applies to float16 gradients only"),
        (lambda: TrainingSpec.from_dict({"optimizer": {"name": "adam", "lrr": 1}}), r"optimizer: unknown key\(s\) lrr"),
    ]
    for make, msg in cases:
        with pytest.raises(SpecError, match=msg):
            make()


def test_replica_refuses_a_layout_that_does_not_match_the_training_spec():
    with pytest.raises(LayoutMismatch, match="grad_dtype"):
        Replica(make_layout("bfloat16"), CONFIGS["adam-fp32"], random_init(make_layout()))
    layout = make_layout()
    init = random_init(layout)
    init["embed.weight"] = torch.zeros(4, 8)
    with pytest.raises(LayoutMismatch, match=r"embed.weight: shape \(4, 8\)"):
        Replica(layout, CONFIGS["adam-fp32"], init)
    del init["embed.weight"]
    with pytest.raises(LayoutMismatch, match="missing"):
        Replica(layout, CONFIGS["adam-fp32"], init)
