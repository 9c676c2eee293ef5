"""GoCkpt fallback checkpoints in one process: a real training loop attached to a real appliance
plane over loopback TCP. The appliance asks for a fallback, the trainer answers with k parts over
k steps, the appliance rebuilds one consistent version S_{N+k} that must equal the trainer's state
at that step bit for bit (parameters, optimizer state, LR schedule, RNG, data position)."""

from __future__ import annotations

import functools
import hashlib
import math
import threading
import time

import common
import pytest
import torch
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec
from mirrorckpt.config.training import OptimizerSpec, TrainingSpec
from mirrorckpt.control import gockpt
from mirrorckpt.control import trainer as trainer_mod
from mirrorckpt.control.appliance_side import AppliancePlane
from mirrorckpt.control.link import meta as link_meta
from mirrorckpt.control.trainer import attach
from mirrorckpt.tools.testbed.harness import Shard, build_model, digest
from mirrorckpt.updater.fingerprint import fingerprint, state_sha256
from torch import nn

SECRET = "gockpt-test-secret-0123456789abcdef"
DIMS = (16, 48, 40, 8)


wait_for = functools.partial(common.wait_for, timeout=20.0)


def _core(d: dict) -> dict:
    """The trainer's digest without the whole-group and whole-scheduler JSON (checked bit for bit
    by the state hashes and the lr/epoch here; torch's own unset options differ only in notation)."""
    return {k: v for k, v in d.items() if k not in ("groups", "sched_state")}


def replica_digest(r) -> dict:
    ps, os_ = state_sha256(r.params, r.optimizer)
    return {"params": ps, "optim": os_, "lr": r.optimizer.param_groups[0]["lr"], "sched": r.scheduler.last_epoch,
            "rng": hashlib.sha256(r.rng["torch"].numpy().tobytes()).hexdigest(), "data": r.data_position}


def recording_plane(secret: str) -> tuple[AppliancePlane, dict[int, dict]]:
    """A started plane (2-part fallbacks, fingerprints every 2 steps) and the replica's digest at each
    step it applies, by step."""
    states: dict[int, dict] = {}
    plane = AppliancePlane(secret, parts=2, fingerprint_every=2, fallback_timeout=60,
                           on_iteration=lambda _i, r: states.__setitem__(r.iterations_done, replica_digest(r))).start()
    return plane, states


class Job:
    """A plain (single-process) training job: the hooks do not need a process group."""

    def __init__(self, plane: AppliancePlane, parts: int, copier=None):
        torch.manual_seed(0)
        self.model = build_model(DIMS, 3)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2, foreach=False)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.5)
        self.shard = Shard(DIMS, 3, 0)
        self.link = attach(self.model, self.opt, appliance=("127.0.0.1", plane.port), secret=SECRET,
                           scheduler=self.sched, data=self.shard, parts=parts, fingerprint_every=4,
                           connect_timeout=10)
        if copier is not None:
            self.link.copier = copier
        self.digests = {}

    def step(self) -> None:
        x, y = self.shard.next()
        x = x + 0.01 * torch.randn_like(x)
        self.opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(self.model(x), y).backward()
        self.opt.step()
        self.sched.step()
        self.digests[self.link.iterations_done] = _core(digest(self.link, self.model, self.opt, self.sched, self.shard))


@pytest.fixture
def plane():
    p = AppliancePlane(SECRET, parts=3, fingerprint_every=4, fallback_timeout=60).start()
    yield p
    p.stop()


def run_fallback(plane, job, max_steps=60):
    job.step()
    assert wait_for(lambda: plane.replica is not None), "REGISTER did not create the replica"
    assert plane.replica.iterations_done == 0
    job.step()
    assert plane.request_fallback("test")
    assert wait_for(lambda: job.link.fallback_pending)  # a late request on a loaded machine is not a lost one
    for _ in range(max_steps):
        job.step()
        time.sleep(0.01)  # let the control plane move (the hooks never wait for it)
        if plane.stats.fallbacks_done:
            break
    assert plane.stats.fallbacks_done == 1, plane.stats
    return plane.replica


@pytest.mark.parametrize("k", [1, 3, 7])
def test_fallback_rebuilds_the_trainers_state_bit_exact(plane, k):
    plane.parts = k
    job = Job(plane, parts=k)
    try:
        r = run_fallback(plane, job)
        rb = plane.stats.events[-1][1]
        assert rb["parts"] == min(k, len(list(job.model.parameters())))
        assert r.iterations_done == rb["start"] + rb["parts"]
        assert replica_digest(r) == job.digests[r.iterations_done]
        rec = job.link.stats.fallbacks[-1]
        assert rec["start"] == rb["start"] and rec["parts"] == rb["parts"]
        assert rec["stall_s"] >= 0
    finally:
        job.link.close()


class LateCopier(gockpt.HostCopier):
    """A copy engine that never finishes a copy before the step needs it: each copy starts only
    when it is fenced, so every part is late whatever the machine's speed."""

    def copy(self, tensors):
        src, gate = dict(tensors), threading.Event()

        def late():
            gate.wait(10)
            return {n: t.detach().clone() for n, t in src.items()}
        c = gockpt.Copy(future=self._pool.submit(late))
        c.gate = gate
        return c

    def fence(self, c):
        if hasattr(c, "gate"):
            c.gate.set()
        super().fence(c)


def test_parts_not_done_in_their_step_are_finished_blocking(plane):
    job = Job(plane, parts=3, copier=LateCopier())
    try:
        r = run_fallback(plane, job)
        rec = job.link.stats.fallbacks[-1]
        assert rec["blocked_parts"] == 3  # each part was waited for: GoCkpt's blocking rule
        assert replica_digest(r) == job.digests[r.iterations_done]
    finally:
        job.link.close()


# ------------------------------------------------------------------------ pieces

def test_split_is_contiguous_balanced_and_never_empty():
    layout = JobLayout([ParamSpec(f"p{i}", (s,)) for i, s in enumerate([10, 1000, 5, 5, 300, 2000, 1])],
                       [BucketSpec(tuple(range(7)))])
    for k in (1, 2, 3, 5, 7, 20):
        parts = gockpt.split(layout, k)
        assert [i for p in parts for i in p] == list(range(7))
        assert all(parts) and len(parts) == min(k, 7)


@pytest.mark.parametrize("t", [torch.randn(1000), torch.randn(3, 5).bfloat16(), torch.tensor(3.0),
                               torch.randn(7).half(), torch.arange(10, dtype=torch.int64)])
def test_torch_fingerprint_equals_the_reference(t):
    assert gockpt.torch_fingerprint(t) == fingerprint(t)


def small_rebuild(parts=2):
    layout = JobLayout([ParamSpec("a", (4, 3)), ParamSpec("b", (5,))], [BucketSpec((1, 0))])
    training = TrainingSpec(optimizer=OptimizerSpec(name="adam", lr=0.1))
    return gockpt.Rebuild(layout, training, parts), layout


def part0():
    g = torch.Generator().manual_seed(1)
    t = {"p:a": torch.randn(4, 3, generator=g), "o:a:step": torch.tensor(5.0),
         "o:a:exp_avg": torch.randn(4, 3, generator=g), "o:a:exp_avg_sq": torch.rand(4, 3, generator=g),
         "g:a": torch.randn(4, 3, generator=g)}
    return t, {"params": ["a"], "hparams": [{"lr": 0.1, "betas": [0.9, 0.999]}]}


@pytest.mark.parametrize("mutate, text", [
    (lambda t, s: t.__setitem__("p:a", torch.zeros(3, 4)), "shape"),
    (lambda t, s: t.__setitem__("g:a", torch.zeros(4, 3, dtype=torch.float64)), "dtype"),
    (lambda t, s: t.pop("g:a"), "missing"),
    (lambda t, s: t.__setitem__("g:b", torch.zeros(5)), "unexpected"),
    (lambda t, s: t.pop("o:a:exp_avg"), "neither complete"),
    (lambda t, s: s.__setitem__("params", ["b"]), "other than the split"),
    (lambda t, s: s.__setitem__("hparams", [{"lr": -1.0}]), "lr"),
    (lambda t, s: s.__setitem__("hparams", [{"lr": 0.1}, {"lr": 0.1}]), "each of the 1 param group"),
    (lambda t, s: s.__setitem__("hparams", [{"lr": 0.1, "betas": [0.9]}]), "betas must be 2 finite"),
    (lambda t, s: s.__setitem__("hparams", [{"lr": 0.1, "amsgrad": True}]), "amsgrad must stay False"),
    (lambda t, s: s.__setitem__("hparams", [{"lr": 0.1, "foreach": True}]), "not a hyper-parameter"),
    (lambda t, s: s.__setitem__("tail", {}), "tail comes with the last part"),
])
def test_malformed_parts_change_nothing(mutate, text):
    rb, _ = small_rebuild()
    before = [p.clone() for p in rb.params]
    t, s = part0()
    mutate(t, s)
    with pytest.raises(gockpt.PartError, match=text):
        rb.add_part(10, 0, 2, s, t)
    assert rb.received == 0 and rb.start is None
    # bit for bit: the buffers are allocated empty, and garbage may hold NaN (never equal to itself)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(before, rb.params))
    assert not rb.optimizer.state


def test_parts_out_of_order_or_at_the_wrong_step_are_refused():
    rb, _ = small_rebuild()
    t, s = part0()
    with pytest.raises(gockpt.PartError, match="expected part 0"):
        rb.add_part(10, 1, 2, s, t)
    with pytest.raises(gockpt.PartError, match="3 parts, the rebuild has 2"):
        rb.add_part(10, 0, 3, s, t)
    rb.add_part(10, 0, 2, s, t)
    snap = [p.clone() for p in rb.params]
    t1 = {"p:b": torch.zeros(5), "g:a": torch.zeros(4, 3), "g:b": torch.zeros(5)}
    s1 = {"params": ["b"], "hparams": [{"lr": 0.1}], "tail": {}}
    with pytest.raises(gockpt.PartError, match="holds step 12, expected 11"):
        rb.add_part(12, 1, 2, s1, t1)
    assert rb.received == 1 and all(torch.equal(a, b) for a, b in zip(snap, rb.params))


def test_concurrent_copy_thread_copies_a_consistent_state():
    """The CPU copy engine copies while the caller keeps running; ``fence`` returns the bytes as
    they were when the copy was started (the state is not changed before the fence)."""
    c = gockpt.HostCopier()
    x = torch.randn(1 << 16)
    want = x.clone()
    job = c.copy({"x": x})
    threading.Event().wait(0.01)
    c.fence(job)
    assert torch.equal(c.result(job)["x"], want)
    c.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here: the CUDA copy engine is not run")
def test_cuda_copier_matches_host_copies():
    dev = torch.device("cuda")
    c = gockpt.CudaCopier(dev)
    x = torch.randn(1 << 20, device=dev)
    want = x.cpu()
    job = c.copy({"x": x})
    c.fence(job)
    x.add_(1)  # queued after the copy on the training stream
    assert torch.equal(c.result(job)["x"], want)
    assert gockpt.torch_fingerprint(x) == fingerprint(x.cpu())


# ------------------------------------------------------------------------ recipes

def warmup(epoch: int) -> float:
    return min(1.0, (epoch + 1) / 5)


def decay(epoch: int) -> float:
    return 0.97 ** epoch


def warmup_then_decay(warmup: int, epoch: int, *, rate: float, floor: float | None = None) -> float:
    return min(1.0, (epoch + 1) / warmup) * max(rate ** epoch, floor or 0.0)


def make_recipe(model, name):
    """Real recipes: weight decay on weights only (two groups), schedulers that move lr, betas or
    momentum every step."""
    lrs = torch.optim.lr_scheduler
    w = [p for p in model.parameters() if p.dim() == 2]
    b = [p for p in model.parameters() if p.dim() == 1]
    groups = [{"params": w, "weight_decay": 0.1}, {"params": b, "weight_decay": 0.0}]
    if name == "cyclic-momentum":
        opt = torch.optim.SGD(groups, lr=0.01, momentum=0.9, foreach=False)
        return opt, lrs.CyclicLR(opt, base_lr=0.01, max_lr=0.05, step_size_up=3, cycle_momentum=True)
    opt = torch.optim.AdamW(groups, lr=1e-3, foreach=False)
    if name == "onecycle":
        return opt, lrs.OneCycleLR(opt, max_lr=[1e-2, 2e-2], total_steps=300)
    if name == "lambda":
        return opt, lrs.LambdaLR(opt, [warmup, decay])
    if name == "partial":  # how transformers' get_*_schedule_with_warmup build theirs
        return opt, lrs.LambdaLR(opt, [functools.partial(warmup_then_decay, 4, rate=0.95),
                                       functools.partial(warmup_then_decay, 2, rate=0.9, floor=0.5)])
    if name == "sequential":
        return opt, lrs.SequentialLR(opt, [lrs.LinearLR(opt, 0.1, total_iters=4), lrs.CosineAnnealingLR(opt, 20)],
                                     milestones=[4])
    if name == "plateau":
        return opt, lrs.ReduceLROnPlateau(opt, patience=0, factor=0.7)
    raise AssertionError(name)


class RecipeJob(Job):
    def __init__(self, plane, parts, recipe):
        torch.manual_seed(0)
        self.model = build_model(DIMS, 3)
        self.opt, self.sched = make_recipe(self.model, recipe)
        self.plateau = recipe == "plateau"
        self.shard = Shard(DIMS, 3, 0)
        self.link = attach(self.model, self.opt, appliance=("127.0.0.1", plane.port), secret=SECRET,
                           scheduler=self.sched, data=self.shard, parts=parts, fingerprint_every=4,
                           connect_timeout=10)
        self.digests, self.hyper, self.sched_states = {}, {}, {}

    def step(self) -> None:
        x, y = self.shard.next()
        self.opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.sched.step(float(loss)) if self.plateau else self.sched.step()
        t = self.link.iterations_done
        self.digests[t] = _core(digest(self.link, self.model, self.opt, self.sched, self.shard))
        self.hyper[t] = trainer_mod.group_dicts(self.opt)
        self.sched_states[t] = self.sched.state_dict()


def recipe_plane(**kw):
    return AppliancePlane(SECRET, parts=3, fingerprint_every=4, fallback_timeout=60,
                          lambda_modules=(__name__,), **kw).start()


def groups_of(opt):
    return [{k: v for k, v in g.items() if k not in ("params", "foreach", "fused")} for g in opt.param_groups]


@pytest.mark.parametrize("recipe", ["onecycle", "cyclic-momentum", "lambda", "partial", "sequential", "plateau"])
def test_fallback_replays_every_scheduled_hyper_parameter_bit_exact(recipe):
    """Two param groups, parts that mix them, and a schedule that moves lr, beta1 or momentum
    every step: the rebuild steps each part with the hyper-parameters of its own step, verifies
    against the trainer's fingerprints, and ends with both groups and the scheduler equal."""
    plane = recipe_plane()
    job = RecipeJob(plane, 3, recipe)
    try:
        r = run_fallback(plane, job)
        t = r.iterations_done
        assert replica_digest(r) == job.digests[t]
        want = [{k: v for k, v in g.items() if k not in ("foreach", "fused")} for g in job.hyper[t]]
        assert groups_of(r.optimizer) == want
        assert r.scheduler.state_dict() == job.sched_states[t]
        assert len(r.optimizer.param_groups) == 2 and r.optimizer.param_groups[1]["weight_decay"] == 0.0
        if recipe == "onecycle":  # beta1 moved during the fallback's steps
            betas = {job.hyper[s][0]["betas"][0] for s in range(t - 3, t + 1)}
            assert len(betas) == 4
    finally:
        job.link.close()
        plane.stop()


def test_registered_recipe_is_followed_from_step_0(tmp_path):
    """REGISTER carries the recipe and the initial groups and schedule: the appliance's replica
    starts equal to the trainer's, both groups included."""
    plane = recipe_plane()
    job = RecipeJob(plane, 3, "onecycle")
    try:
        at0 = groups_of(job.opt), job.sched.state_dict()
        job.step()
        assert wait_for(lambda: plane.replica is not None)
        tr = plane.training
        assert [g.options for g in tr.param_groups] == [{}, {"lr": 2e-2 / 25, "weight_decay": 0.0}]
        assert tr.lr_schedule.name == "OneCycleLR"
        r = plane.replica
        assert r.iterations_done == 0 and (groups_of(r.optimizer), r.scheduler.state_dict()) == at0
    finally:
        job.link.close()
        plane.stop()


@pytest.mark.parametrize("recipe", ["lambda", "partial"])
def test_a_lambda_from_a_module_not_allowed_is_refused(recipe):
    plane = AppliancePlane(SECRET, parts=3, fingerprint_every=4).start()
    job = RecipeJob(plane, 3, recipe)
    try:
        job.step()
        time.sleep(1.0)
        assert plane.replica is None and plane.training is None
    finally:
        job.link.close()
        plane.stop()


def test_retries_are_bounded_and_end_in_a_clear_error_state(monkeypatch, caplog):
    """A trainer that reports only the lr of each step (not the cycled beta1) gives rebuilds that
    never verify: after max_attempts the plane gives up once, says why, and stops asking."""
    monkeypatch.setattr(link_meta, "hyper_parameters",
                        lambda opt: [{"lr": float(g["lr"])} for g in opt.param_groups])
    plane = recipe_plane(max_attempts=2)
    job = RecipeJob(plane, 2, "onecycle")
    try:
        job.step()
        assert wait_for(lambda: plane.replica is not None)
        job.step()
        assert plane.request_fallback("test")
        assert wait_for(lambda: job.link.fallback_pending)
        for _ in range(80):
            job.step()
            time.sleep(0.01)
            if plane.stats.fallbacks_abandoned:
                break
        st = plane.stats
        assert st.fallbacks_abandoned == 1 and st.fallbacks_done == 0 and st.fallbacks_failed == 2, st
        assert "abandoned after 2 attempt(s)" in st.fallback_error and "differs from the trainer" in st.fallback_error
        assert [k for k, _ in st.events].count("fallback_unverified") == 2
        assert plane.fallback is None
        assert not plane.request_fallback("again")  # no asking forever
        for _ in range(10):
            job.step()
        assert st.fallbacks_requested == 1 and plane.fallback is None
        assert any("abandoned after 2 attempt(s)" in r.message for r in caplog.records if r.levelname == "ERROR")
    finally:
        job.link.close()
        plane.stop()


# ------------------------------------------------------------------------ bf16 / fp16 jobs

class LowPrecisionJob:
    """A bf16 or fp16 model with fp32 masters, as ARCHITECTURE.md's "Trainer semantics" states it:
    ``master.grad = reduced.float()``, fp16 through torch's GradScaler (unscaled before the clip),
    clipped by the link; the model is copied from the masters after each step."""

    def __init__(self, plane: AppliancePlane, parts: int, dtype: torch.dtype):
        torch.manual_seed(0)
        self.dtype = dtype
        self.model = build_model(DIMS, 3).to(dtype)
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.model.parameters()]
        self.opt = torch.optim.AdamW(self.masters, lr=1e-2, foreach=False)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.5)
        # a small growth interval: the scale moves during the fallback's steps (it overflows
        # fp16 only after about 25 steps: a skip abandons a fallback)
        self.scaler = (torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=2)
                       if dtype == torch.float16 else None)
        self.shard = Shard(DIMS, 3, 0)
        self.link = attach(self.model, self.opt, appliance=("127.0.0.1", plane.port), secret=SECRET,
                           scheduler=self.sched, scaler=self.scaler, data=self.shard, parts=parts,
                           fingerprint_every=4, connect_timeout=10)
        self.digests, self.scales, self.parts = {}, {}, []
        self.inf_at: set[int] = set()  # iterations whose gradient gets an inf (GradScaler skips them)
        send = self.link.client.send

        def record(msg):  # what each GOCKPT_PART carries, as handed to the wire
            if msg.type == "GOCKPT_PART":
                self.parts.append((dict(msg.body["slices"]), {n: t.detach().clone() for n, t in msg.tensors.items()}))
            return send(msg)
        self.link.client.send = record

    def step(self) -> None:
        x, y = self.shard.next()
        for p in self.model.parameters():
            p.grad = None
        loss = nn.functional.mse_loss(self.model(x.to(self.dtype)), y.to(self.dtype))
        (self.scaler.scale(loss) if self.scaler else loss).backward()
        if self.link.iterations_done + 1 in self.inf_at:
            next(self.model.parameters()).grad.view(-1)[0] = math.inf
        for mp, p in zip(self.masters, self.model.parameters()):
            mp.grad = p.grad.float()
        if self.scaler:
            self.scaler.unscale_(self.opt)
        self.link.clip_grad_norm_(0.5)
        if self.scaler:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.sched.step()
        with torch.no_grad():
            for mp, p in zip(self.masters, self.model.parameters()):
                p.copy_(mp)
        t = self.link.iterations_done
        ps, os_ = state_sha256(self.masters, self.opt)
        self.digests[t] = {"params": ps, "optim": os_, "lr": self.opt.param_groups[0]["lr"],
                           "sched": self.sched.last_epoch,
                           "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
                           "data": self.shard.state_dict()}
        if self.scaler:
            self.scales[t] = {"scale": self.scaler.get_scale(),
                              "growth_tracker": int(self.scaler._get_growth_tracker())}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_fallback_sends_2_byte_gradients_and_rebuilds_bit_exact(plane, dtype):
    """The parts' gradients travel in the job's gradient dtype (half the bytes of fp32); the
    rebuild forms the fp32 master gradients from them (``.float()``, fp16: 1/loss scale, then the
    clip coefficient) and ends bit-exact with the trainer's masters and optimizer state."""
    job = LowPrecisionJob(plane, 3, dtype)
    try:
        r = run_fallback(plane, job)
        t = r.iterations_done
        assert replica_digest(r) == job.digests[t]
        assert len(job.parts) == 3
        numel = {n: p.numel() for n, p in zip(job.link.names, job.masters)}
        for slices, tensors in job.parts:
            grads = {n: g for n, g in tensors.items() if n.startswith("g:")}
            assert grads and all(g.dtype == dtype and g.element_size() == 2 for g in grads.values())
            assert sum(g.nbytes for g in grads.values()) == 2 * sum(numel[n[2:]] for n in grads)
            assert all(v.dtype == torch.float32 for n, v in tensors.items() if n.startswith(("p:", "o:"))
                       and not n.endswith(":step"))
            assert 0 < slices["clip"] < 1  # the clip was active: the coefficient travelled
            assert ("loss_scale" in slices) == (dtype == torch.float16)
        if dtype == torch.float16:
            assert len({s["loss_scale"] for s, _ in job.parts}) > 1  # the scale moved during the fallback
            assert r.scaler.state_dict() == job.scales[t]
    finally:
        job.link.close()


def test_an_fp16_gradscaler_skip_is_followed_bit_exact(plane):
    """A step GradScaler skips for inf (the optimizer never steps; the scale backs off) counts as
    an iteration with a skipped STEP_META; a fallback after it rebuilds the trainer's state, its
    step count and its loss scale exactly."""
    job = LowPrecisionJob(plane, 3, torch.float16)
    job.inf_at = {3}
    try:
        r = run_fallback(plane, job)
        t = r.iterations_done
        assert job.link.stats.skipped_steps == 1 and job.link.iterations_done == job.link.stats.steps + 1
        assert replica_digest(r) == job.digests[t]
        assert r.scaler.state_dict() == job.scales[t]
        assert float(next(iter(r.optimizer.state.values()))["step"]) == t - 1  # the skipped step did not count
    finally:
        job.link.close()


def test_low_precision_part_without_its_scaling_changes_nothing():
    layout = JobLayout([ParamSpec("a", (4, 3)), ParamSpec("b", (5,))], [BucketSpec((1, 0))], grad_dtype="float16")
    rb = gockpt.Rebuild(layout, TrainingSpec(optimizer=OptimizerSpec(name="adam", lr=0.1), grad_dtype="float16"), 2)
    t, s = part0()
    with pytest.raises(gockpt.PartError, match="g:a: dtype torch.float32, expected torch.float16"):
        rb.add_part(10, 0, 2, {**s, "loss_scale": 1024.0}, t)
    t["g:a"] = t["g:a"].half()
    with pytest.raises(gockpt.PartError, match="loss_scale"):
        rb.add_part(10, 0, 2, s, t)
    with pytest.raises(gockpt.PartError, match="clip coefficient given"):
        rb.add_part(10, 0, 2, {**s, "loss_scale": 1024.0, "clip": 0.5}, t)
    t["g:a"][0, 0] = float("inf")
    with pytest.raises(gockpt.PartError, match="non-finite"):
        rb.add_part(10, 0, 2, {**s, "loss_scale": 1024.0}, t)
    assert rb.received == 0 and rb.start is None and not rb.optimizer.state
