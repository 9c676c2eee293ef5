"""GoCkpt fallback checkpoints in one process: a real training loop attached to a real appliance
plane over loopback TCP. The appliance asks for a fallback, the trainer answers with k parts over
k steps, the appliance rebuilds one consistent version S_{N+k} that must equal the trainer's state
at that step bit for bit (parameters, optimizer state, LR schedule, RNG, data position)."""

from __future__ import annotations

import functools
import hashlib
import threading
import time

import common
import pytest
import torch
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec
from mirrorckpt.config.training import OptimizerSpec, TrainingSpec
from mirrorckpt.control import gockpt
from mirrorckpt.control.appliance_side import AppliancePlane
from mirrorckpt.control.trainer import attach
from mirrorckpt.tools.testbed.harness import Shard, build_model, digest
from mirrorckpt.updater.fingerprint import fingerprint, state_sha256
from torch import nn

SECRET = "gockpt-test-secret-0123456789abcdef"
DIMS = (16, 48, 40, 8)


wait_for = functools.partial(common.wait_for, timeout=20.0)


def replica_digest(r) -> dict:
    ps, os_ = state_sha256(r.params, r.optimizer)
    return {"params": ps, "optim": os_, "lr": r.optimizer.param_groups[0]["lr"], "sched": r.scheduler.last_epoch,
            "rng": hashlib.sha256(r.rng["torch"].numpy().tobytes()).hexdigest(), "data": r.data_position}


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
        self.digests[self.link.iterations_done] = digest(self.link, self.model, self.opt, self.sched, self.shard)


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
    return t, {"params": ["a"], "lr": 0.1}


@pytest.mark.parametrize("mutate, text", [
    (lambda t, s: t.__setitem__("p:a", torch.zeros(3, 4)), "shape"),
    (lambda t, s: t.__setitem__("g:a", torch.zeros(4, 3, dtype=torch.float64)), "dtype"),
    (lambda t, s: t.pop("g:a"), "missing"),
    (lambda t, s: t.__setitem__("g:b", torch.zeros(5)), "unexpected"),
    (lambda t, s: t.pop("o:a:exp_avg"), "neither complete"),
    (lambda t, s: s.__setitem__("params", ["b"]), "other than the split"),
    (lambda t, s: s.__setitem__("lr", -1.0), "lr"),
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
    assert all(torch.equal(a, b) for a, b in zip(before, rb.params))
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
    s1 = {"params": ["b"], "lr": 0.1, "tail": {}}
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
    job = c.copy({"x": x})
    c.fence(job)
    x.add_(1)  # queued after the copy on the training stream
    assert torch.equal(c.result(job)["x"], (x - 1).cpu())
    assert gockpt.torch_fingerprint(x) == fingerprint(x.cpu())
