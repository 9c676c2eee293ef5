"""The trainer API's promises, through ``attach`` and ``restore_from_appliance`` against an in-process
appliance plane: arguments checked at attach, the optimizer's implementation choice kept by a
restore (from the appliance and from disk), a refused restore never loads anything, and the
job's last fingerprint reaches the appliance at close."""

from __future__ import annotations

import functools
import logging
import re

import common
import pytest
import torch
import torch.distributed as dist
from mirrorckpt.config.training import PersistSpec
from mirrorckpt.control import messages as m
from mirrorckpt.control.appliance_side import AppliancePlane
from mirrorckpt.control.trainer import AttachError, RestoreRefused, attach, restore_from_appliance
from mirrorckpt.tools.testbed.harness import Shard, build_model, free_port
from mirrorckpt.updater import restore
from torch import nn

SECRET = "attach-test-secret-0123456789abcdef"
DIMS = (8, 16, 4)
IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")
wait_for = functools.partial(common.wait_for, timeout=20.0)


@pytest.fixture
def group():
    """A one-rank gloo process group (what DDP needs to be built)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def train(link, model, opt, shard, steps: int) -> None:
    for _ in range(steps):
        x, y = shard.next()
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def adamw(model, **kw):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=None, fused=None, **kw)


# ------------------------------------------------------------------------ checks at attach

def test_a_plain_dataloader_is_refused_naming_statefuldataloader():
    model = build_model(DIMS, 1)
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    with pytest.raises(AttachError, match="StatefulDataLoader"):
        attach(model, adamw(model), appliance=None, secret=SECRET, data=loader)


@pytest.mark.parametrize("what, kw, words", [
    ("data", {"data": object()}, "data: builtins.object has no state_dict"),
    ("scheduler", {"scheduler": object()}, "scheduler: builtins.object is not a torch.optim.lr_scheduler"),
    ("scaler", {"scaler": "fp16"}, "scaler: builtins.str is not a torch.amp.GradScaler"),
    ("appliance", {"appliance": "127.0.0.1:7070"}, "appliance: '127.0.0.1:7070' is not a"),
    ("restore", {"restore": "appliance"}, "restore='appliance' needs appliance"),
])
def test_wrong_argument_types_are_named_at_attach(what, kw, words):
    model = build_model(DIMS, 1)
    opt = adamw(model)
    args = {"appliance": None, **kw}
    with pytest.raises(AttachError, match=words.replace("(", r"\(").replace(".", r"\.")):
        attach(model, opt, secret=SECRET, **args)
    assert not opt._optimizer_step_pre_hooks  # nothing was hooked


def test_a_scheduler_of_another_optimizer_is_refused():
    model = build_model(DIMS, 1)
    other = adamw(build_model(DIMS, 2))
    with pytest.raises(AttachError, match="another optimizer"):
        attach(model, adamw(model), appliance=None, secret=SECRET,
               scheduler=torch.optim.lr_scheduler.StepLR(other, 3))


def test_static_graph_is_refused_with_the_reason_and_find_unused_parameters_followed(group):
    ddp = nn.parallel.DistributedDataParallel(build_model(DIMS, 1), static_graph=True)
    with pytest.raises(AttachError, match=r"static_graph=True\): .*used-parameter map"):
        attach(ddp, adamw(ddp), appliance=None, secret=SECRET)
    ddp = nn.parallel.DistributedDataParallel(build_model(DIMS, 1), find_unused_parameters=True)
    attach(ddp, adamw(ddp), appliance=None, secret=SECRET).close()  # tests/e2e/test_ddp_unused.py follows it


# ------------------------------------------------------------------------ restore

@pytest.fixture
def plane(tmp_path):
    p = AppliancePlane(SECRET, parts=2, fingerprint_every=4, fallback_timeout=60,
                       persist=PersistSpec(str(tmp_path / "ckpt"), every_iterations=1)).start()
    yield p
    p.stop()


def fallback_job(plane, opt_kw: dict, steps: int = 12):
    """A job whose state the plane holds after one fallback (so memory and disk have it)."""
    torch.manual_seed(0)
    model = build_model(DIMS, 3)
    opt = adamw(model, **opt_kw)
    shard = Shard(DIMS, 3, 0)
    link = attach(model, opt, appliance=("127.0.0.1", plane.port), secret=SECRET, data=shard, parts=2,
                  fingerprint_every=4, connect_timeout=10)
    train(link, model, opt, shard, 1)
    assert wait_for(lambda: plane.replica is not None)
    plane.request_fallback("test")
    # on a loaded machine the request could reach the link after the last step: the fallback never ran
    assert wait_for(lambda: link.fallback_pending)
    for _ in range(steps):
        train(link, model, opt, shard, 1)
        if plane.stats.fallbacks_done:
            break
    # its parts all went out within the steps; the plane installs the rebuilt replica on its own thread
    assert wait_for(lambda: plane.stats.fallbacks_done == 1), plane.stats
    link.close()
    return model, opt


@pytest.mark.parametrize("opt_kw", [{}, {"capturable": True}, {"differentiable": True}])
def test_restore_keeps_the_trainers_implementation_choice(plane, tmp_path, opt_kw):
    """AdamW(foreach=None, fused=None) (torch's default: its best kernel for the device) stays
    so after a restore from the appliance and from disk (both hold the replica's foreach=False,
    fused=False); capturable/differentiable likewise."""
    fallback_job(plane, {})
    assert wait_for(lambda: any((tmp_path / "ckpt").glob("step-*")))  # committed off the plane's thread
    # torch's get_state_dict (load_into) initialises an empty optimizer by one step, which neither
    # a capturable AdamW (on a CPU) nor a differentiable one (outside a graph) can take
    for source in ("appliance", "disk") if not opt_kw else ("appliance",):
        model = build_model(DIMS, 4)
        opt = adamw(model, **opt_kw)
        want = {k: opt.param_groups[0][k] for k in IMPLEMENTATION}
        if source == "appliance":
            r = restore_from_appliance(model, opt, appliance=("127.0.0.1", plane.port), secret=SECRET)
        else:
            r = restore.load_into(model, opt, tmp_path / "ckpt")
        assert r.iterations_done > 0
        assert {k: opt.param_groups[0][k] for k in IMPLEMENTATION} == want, source
        assert want["foreach"] is None and want["fused"] is None
        if not opt_kw:  # (a capturable step needs a GPU, a differentiable one a graph to step in)
            x = torch.randn(4, DIMS[0])
            nn.functional.mse_loss(model(x), torch.zeros(4, DIMS[-1])).backward()
            opt.step()  # and it still steps


def test_a_refused_restore_raises_with_the_appliances_reason_and_loads_nothing(caplog):
    plane = AppliancePlane(SECRET).start()  # holds no state at all
    try:
        model = build_model(DIMS, 1)
        before = [p.detach().clone() for p in model.parameters()]
        sent = []
        orig = m.make

        def record(mtype, *a, **kw):
            if mtype == m.RESTORE_REQUEST:
                sent.append(kw)
            return orig(mtype, *a, **kw)
        m.make = record
        try:
            with pytest.raises(RestoreRefused, match="refused the restore: .*no consistent state"):
                attach(model, adamw(model), appliance=("127.0.0.1", plane.port), secret=SECRET,
                       restore="appliance", allow_behind=True)
        finally:
            m.make = orig
        assert sent == [{"step": None, "allow_behind": True}]
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    finally:
        plane.stop()


def test_restore_logs_the_step_and_its_source(plane, caplog):
    fallback_job(plane, {})
    model = build_model(DIMS, 4)
    with caplog.at_level(logging.INFO, logger="mirrorckpt.control.trainer"):
        r = restore_from_appliance(model, adamw(model), appliance=("127.0.0.1", plane.port), secret=SECRET)
    line = [rec.message for rec in caplog.records if rec.message.startswith("restored step")]
    assert line and line[0].startswith(f"restored step {r.iterations_done} from appliance 127.0.0.1:{plane.port}")


# ------------------------------------------------------------------------ fingerprints

def test_the_last_fingerprint_is_sent_at_close():
    plane = AppliancePlane(SECRET, fingerprint_every=4).start()
    try:
        torch.manual_seed(0)
        model = build_model(DIMS, 3)
        opt = adamw(model)
        shard = Shard(DIMS, 3, 0)
        link = attach(model, opt, appliance=("127.0.0.1", plane.port), secret=SECRET, data=shard,
                      fingerprint_every=4, connect_timeout=10)
        train(link, model, opt, shard, 4)  # the fingerprint of step 4 waits for a step 5 that never comes
        link.close()
        assert link.stats.fingerprints_sent == 1
        assert wait_for(lambda: 4 in plane.drift.pending())
    finally:
        plane.stop()


# ------------------------------------------------------------------------ DDP options followed

@pytest.mark.parametrize("options", [
    {"gradient_as_bucket_view": True},
    {"bucket_cap_mb": 0.001},
    {"bucket_cap_mb_list": [0.0005, 0.002]},
    {"bucket_cap_mb": 0.001, "gradient_as_bucket_view": True},
])
def test_registered_buckets_are_the_ones_ddp_reduces(group, options):
    """Each option's buckets, as DDP's reducer hands them to its communication hook in iterations
    0, 1 and 2 (iteration 0's assignment, then the rebuild in backward order), are the layout the
    link registers."""
    plane = AppliancePlane(SECRET).start()
    try:
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(build_model((8, 32, 24, 4), 1), **options)
        seen: list[list[list[int]]] = []
        index = {id(p): i for i, p in enumerate(ddp.parameters())}

        def hook(_state, bucket):
            if bucket.index() == 0:
                seen.append([])
            seen[-1].append([index[id(p)] for p in bucket.parameters()])
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        ddp.register_comm_hook(None, hook)
        opt = adamw(ddp)
        shard = Shard((8, 32, 24, 4), 3, 0)
        link = attach(ddp, opt, appliance=("127.0.0.1", plane.port), secret=SECRET, connect_timeout=10)
        train(link, ddp, opt, shard, 3)
        link.close()
        layout = link.layout
        assert seen[0] == [list(b.params) for b in layout.first_buckets]
        assert seen[1] == seen[2] == [list(b.params) for b in layout.buckets]
        assert len(seen[1]) > 1 or "bucket_cap_mb" not in str(options)  # the caps made several buckets
    finally:
        plane.stop()


# ------------------------------------------------------------------------ schedules of partials

def scaled(factor: float, epoch: int, *, table: dict) -> float:
    return factor * table.get(str(epoch), 1.0)


@pytest.mark.parametrize("fn, words", [
    (functools.partial(scaled, 0.5, table={"a": torch.ones(1)}), r"kwargs\.table\.a is a Tensor"),
    (functools.partial(scaled, 0.5, table={"a": (1, 2)}), r"kwargs\.table\.a is a tuple"),
    (functools.partial(scaled, float("nan"), table={}), r"args\[0\] is nan"),
    (functools.partial(lambda f, e: f, 0.5), "not a module-level function"),
])
def test_a_partial_whose_function_or_arguments_cannot_travel_is_reported_not_rebuilt(fn, words, caplog):
    """The appliance follows such a schedule from the trainer's per-step reports
    (tests/test_reported_schedule.py), and the log says why it is not rebuilt."""
    model = build_model(DIMS, 1)
    opt = adamw(model)
    with caplog.at_level(logging.INFO, logger="mirrorckpt.control.trainer"):
        link = attach(model, opt, appliance=None, secret=SECRET, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, fn))
    link.close()
    assert link.training.lr_schedule.reported
    assert any(re.search(words, r.getMessage()) for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_transformers_warmup_schedules_are_rebuilt_step_for_step():
    """HF transformers' get_*_schedule_with_warmup (a LambdaLR of a functools.partial) as the spec
    records it, rebuilt as the appliance does: the same lr at every step."""
    optimization = pytest.importorskip("transformers.optimization",
                                       reason="the frameworks extra is not installed: pip install -e '.[frameworks]'")
    from mirrorckpt.config.training import LRScheduleSpec
    from mirrorckpt.control.trainer import schedule_spec
    from mirrorckpt.updater.optim import build_scheduler

    for make in (optimization.get_linear_schedule_with_warmup, optimization.get_cosine_schedule_with_warmup,
                 optimization.get_polynomial_decay_schedule_with_warmup):
        opt = adamw(build_model(DIMS, 1))
        sched = make(opt, 5, 40)
        spec = LRScheduleSpec.from_dict(schedule_spec(sched).to_dict())
        assert spec.callable_paths()[0].startswith("transformers.optimization:_get_")
        twin = adamw(build_model(DIMS, 1))
        rebuilt = build_scheduler(spec, twin)
        for _ in range(45):
            opt.step()
            sched.step()
            twin.step()
            rebuilt.step()
            assert opt.param_groups[0]["lr"] == twin.param_groups[0]["lr"]


def test_a_data_position_that_is_not_json_is_refused_at_attach():
    stateful = pytest.importorskip("torchdata.stateful_dataloader",
                                   reason="torchdata is not installed: pip install -e '.[test]'")
    data = [torch.randn(4) for _ in range(16)]
    model = build_model(DIMS, 1)
    loader = stateful.StatefulDataLoader(data, batch_size=4, shuffle=True)
    next(iter(loader))
    with pytest.raises(AttachError, match=r"state_dict\(\).* is a Tensor.*DistributedSampler"):
        attach(model, adamw(model), appliance=None, secret=SECRET, data=loader)
    plain = stateful.StatefulDataLoader(data, batch_size=4)  # a sequential one: integers
    attach(model, adamw(model), appliance=None, secret=SECRET, data=plain).close()


# ------------------------------------------------------------------------ clipping seen on the gradients

def clipping_job(plane, steps: int, clip, **attach_kw):
    """A loop that clips with its own call (``clip(params)``) while attached; the coefficient torch
    multiplied by at each step, as torch forms it."""
    torch.manual_seed(0)
    model = build_model(DIMS, 3)
    opt = adamw(model)
    shard = Shard(DIMS, 3, 0)
    link = attach(model, opt, appliance=("127.0.0.1", plane.port), secret=SECRET, data=shard, fingerprint_every=0,
                  connect_timeout=10, **attach_kw)
    coefs = {}
    for _ in range(steps):
        x, y = shard.next()
        opt.zero_grad(set_to_none=True)
        (100 * nn.functional.mse_loss(model(x), y)).backward()
        total = clip(list(model.parameters()))
        if total is not None:
            coefs[link.iterations_done + 1] = float(torch.clamp(0.05 / (total + 1e-6), max=1.0))
        opt.step()
    link.close()
    return coefs


def test_a_clip_by_torchs_own_call_is_seen_on_the_gradients():
    """attach(max_grad_norm=) only: the loop's torch.nn.utils.clip_grad_norm_ is unchanged, and each
    STEP_META carries exactly the coefficient torch multiplied by."""
    plane = AppliancePlane(SECRET).start()
    try:
        coefs = clipping_job(plane, 6, lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05), max_grad_norm=0.05)
        assert wait_for(lambda: all(s in plane._metas for s in range(2, 7)))
        assert plane.training.clip.max_norm == 0.05
        assert all(coefs[s] < 1 for s in coefs)  # a clip at every step: each one is tested
        assert {s: plane._metas[s]["clip"]["coef"] for s in range(2, 7)} == {s: coefs[s] for s in range(2, 7)}
    finally:
        plane.stop()


def test_a_clip_attach_was_not_told_of_or_that_is_no_scaling_is_an_error(caplog):
    plane = AppliancePlane(SECRET).start()
    try:
        with caplog.at_level(logging.ERROR, logger="mirrorckpt.control.trainer"):
            clipping_job(plane, 2, lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05))
            clipping_job(plane, 2, lambda ps: torch.nn.utils.clip_grad_value_(ps, 1e-4), max_grad_norm=0.05)
        said = [r.message for r in caplog.records if r.levelname == "ERROR"]
        assert any("was given no max_grad_norm" in s for s in said), said
        assert any("no single float32 factor" in s for s in said), said
    finally:
        plane.stop()


def test_an_appliance_that_does_not_answer_at_attach_is_said(caplog):
    """A stopped appliance: attach returns after connect_timeout (training must not stop for it) and
    says the job trains unprotected."""
    model = build_model(DIMS, 3)
    link = attach(model, adamw(model), appliance=("127.0.0.1", free_port()), secret=SECRET, connect_timeout=0.5)
    try:
        assert "training goes on unprotected" in caplog.text
    finally:
        link.close()
