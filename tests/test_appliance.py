"""updater.appliance: the pipeline driver and the appliance's commit rules.

A replica stale for missing data still holds a state the trainer had: closing commits it (a
SIGTERM in the middle of an iteration must not lose the iterations already applied). A replica
that drifted holds a wrong state: closing commits nothing new."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec
from mirrorckpt.config.training import OptimizerSpec, PersistSpec, TrainingSpec
from mirrorckpt.parser.iteration import InitialWeights, ReducedBucket, ReducedIteration
from mirrorckpt.updater import ckptdir
from mirrorckpt.updater.appliance import Appliance
from mirrorckpt.updater.drive import drive
from mirrorckpt.updater.replica import ReplicaStale
from mirrorckpt.updater.restore import read_state

LAYOUT = JobLayout(params=[ParamSpec("w", (8, 4), "float32"), ParamSpec("b", (8,), "float32")],
                   buckets=[BucketSpec((1, 0))], first_buckets=[BucketSpec((1, 0))])


def _grads(i: int) -> list[np.ndarray]:
    return [np.random.default_rng(i).standard_normal(40).astype(np.float32)]


def _items(n_good: int, partial: bool = True):
    yield InitialWeights(LAYOUT, np.random.default_rng(99).standard_normal(40).astype(np.float32))
    for i in range(n_good):
        yield ReducedIteration(i, _grads(i))
    if partial:  # the iteration on the wire when the capture stopped
        yield ReducedIteration(n_good, [], complete=False, holes={0: [(0, 17)]})


def _appliance(tmp_path, **kw) -> Appliance:
    training = TrainingSpec(optimizer=OptimizerSpec(name="adam", lr=1e-2))
    persist = PersistSpec(directory=str(tmp_path / "ck"), every_iterations=100, keep_last=3)
    return Appliance(None, training, persist, **kw)


def _reference(n: int) -> dict[str, torch.Tensor]:
    """The same steps with torch's Adam by hand."""
    flat = torch.from_numpy(np.random.default_rng(99).standard_normal(40).astype(np.float32))
    w = torch.nn.Parameter(flat[:32].reshape(8, 4).clone())  # initial weights: layout order
    b = torch.nn.Parameter(flat[32:].clone())
    opt = torch.optim.Adam([w, b], lr=1e-2, foreach=False)
    for i in range(n):
        g = torch.from_numpy(_grads(i)[0])
        b.grad, w.grad = g[:8].clone(), g[8:].reshape(8, 4).clone()  # the bucket holds b, then w
        opt.step()
    return {"w": w.detach(), "b": b.detach()}


def test_stale_for_missing_data_still_commits_its_last_good_step(tmp_path):
    app = _appliance(tmp_path)
    seen = []
    drive(_items(8), app, seen.append)
    assert isinstance(app.replica.stale, ReplicaStale) and app.replica.stale.state_good
    assert [type(x).__name__ for x in seen][:2] == ["InitialWeights", "ReducedIteration"]
    summary = app.close()
    assert summary.iterations_applied == 8 and summary.iterations_incomplete == 1
    assert app.close() is summary  # `serve` closes it, then the control plane that owns it
    latest = ckptdir.read_pointer(tmp_path / "ck")
    assert latest is not None and ckptdir.parse_step(latest.name) == 8
    got = read_state(latest)
    want = _reference(8)
    for n in ("w", "b"):
        assert torch.equal(got.params[n], want[n]), n


def test_a_drifted_replica_commits_nothing_new(tmp_path):
    app = _appliance(tmp_path)
    drive(_items(5, partial=False), app)
    r = app.replica
    r.stale = ReplicaStale(r.step, r.iterations_done, {}, state_good=False)  # what a fingerprint mismatch does
    app.close()
    assert ckptdir.read_pointer(tmp_path / "ck") is None


def test_drive_without_a_sink_only_reports():
    seen = []
    drive(_items(2), None, seen.append)
    assert [type(x).__name__ for x in seen] == ["InitialWeights", "ReducedIteration", "ReducedIteration",
                                                "ReducedIteration"]


LAYOUT2 = JobLayout(params=[ParamSpec("w", (8, 4), "float32"), ParamSpec("b", (8,), "float32")],
                    buckets=[BucketSpec((1,)), BucketSpec((0,))], first_buckets=[BucketSpec((1,)), BucketSpec((0,))])


def test_a_bucket_stepped_ahead_is_undone_when_its_iteration_is_incomplete(tmp_path):
    """Pipelined: bucket 0 of iteration 3 is stepped as soon as it is final; bucket 1 never
    completes, so the iteration is incomplete and bucket 0's step is rolled back: the state
    committed at close is the one after iteration 2, bit for bit the plain whole-iteration one."""
    init = np.random.default_rng(7).standard_normal(40).astype(np.float32)

    def grads(i):
        g = np.random.default_rng(100 + i).standard_normal(40).astype(np.float32)
        return [g[:8], g[8:]]  # bucket 0 holds b, bucket 1 holds w

    def items(pipelined_buckets: bool):
        yield InitialWeights(LAYOUT2, init)
        for i in range(3):
            if pipelined_buckets:
                yield from (ReducedBucket(i, k, v) for k, v in enumerate(grads(i)))
            yield ReducedIteration(i, grads(i))
        if pipelined_buckets:
            yield ReducedBucket(3, 0, grads(3)[0])
        yield ReducedIteration(3, [], complete=False, holes={1: [(0, 5)]})

    states = []
    for pipelined in (True, False):
        app = _appliance(tmp_path / str(pipelined), pipelined=pipelined)
        drive(items(pipelined), app)
        assert app.replica.iterations_done == 3 and app.replica.stale.state_good
        app.close()
        states.append(read_state(ckptdir.read_pointer(tmp_path / str(pipelined) / "ck")))
    a, b = states
    assert a.iterations_done == b.iterations_done == 3
    for n in ("w", "b"):
        assert torch.equal(a.params[n], b.params[n]), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a.optim["state"][n][k], b.optim["state"][n][k]), (n, k)


def test_a_restarted_runs_first_iteration_follows_ddps_first_bucket_layout():
    """After a restart DDP lays out its first iteration in one bucket again, while the job-wide
    iteration index goes on: the layout follows ``wire_index``."""
    from mirrorckpt.updater.replica import Replica

    layout = JobLayout(params=[ParamSpec("w", (8, 4), "float32"), ParamSpec("b", (8,), "float32")],
                       buckets=[BucketSpec((1,)), BucketSpec((0,))], first_buckets=[BucketSpec((1, 0))])
    training = TrainingSpec(optimizer=OptimizerSpec(name="adam", lr=1e-2))
    init = np.random.default_rng(3).standard_normal(40).astype(np.float32)
    g = np.random.default_rng(4).standard_normal(40).astype(np.float32)  # b then w, as DDP packs them
    a, b = (Replica.from_initial_weights(layout, training, init) for _ in range(2))
    for r in (a, b):
        r.iterations_done = 3  # resumed at step 3
    a.apply(ReducedIteration(3, [g[:8], g[8:]]))  # the rebuilt layout: two buckets
    b.apply(ReducedIteration(3, [g], wire_index=0))  # a restarted run's first iteration: one bucket
    for pa, pb in zip(a.params, b.params):
        assert torch.equal(pa, pb)


# -- pipelined against whole-iteration steps on a generated capture ---------------------------

GEN_STEPS, TORN = 8, 4  # iteration TORN loses its second bucket; the replica is resynced after TORN + 1


@pytest.fixture(scope="module", params=["adam", "adamw-clip"])
def generated(request, tmp_path_factory):
    """A 3-rank job (two buckets after DDP's rebuild, two mirrored egress ports), its job file and
    its items as the parser hands them; the clip job's norm is clipped in most iterations."""
    from mirrorckpt.config.jobfile import load_job
    from mirrorckpt.config.training import ClipSpec
    from mirrorckpt.tools.cmd_replay import open_stream
    from mirrorckpt.tools.generator.gen import GenConfig, generate

    clip = request.param.endswith("clip")
    opt = OptimizerSpec(name="adamw" if clip else "adam", lr=1e-2, weight_decay=0.01 if clip else 0.0)
    d = tmp_path_factory.mktemp(request.param)
    generate(GenConfig(ranks=3, channels=1, model="mlp:32,64,16,4", steps=GEN_STEPS, seed=3, bucket_cap_mb=0.004,
                       training=TrainingSpec(optimizer=opt, clip=ClipSpec(0.05) if clip else None),
                       mirrors="0:egress,1:egress", send_truth=False), d)
    job = load_job(d / "job.toml")
    items = list(open_stream([m.source for m in job.mirrors], job))
    assert sum(isinstance(x, ReducedBucket) for x in items) == 1 + 2 * (GEN_STEPS - 1)
    return job, items, json.loads((d / "truth.json").read_text())["iterations"]


def _torn(items: list, resync) -> Iterator:
    """The items with iteration TORN incomplete (its first bucket final and handed on, the second
    never), and ``resync()`` called after iteration TORN + 1 (a fallback's state arriving)."""
    for x in items:
        if isinstance(x, ReducedBucket) and x.iteration == TORN and x.bucket == 1:
            continue
        if isinstance(x, ReducedIteration) and x.index == TORN:
            x = ReducedIteration(TORN, [], complete=False, holes={1: [(0, 5)]})
        yield x
        if isinstance(x, ReducedIteration) and x.index == TORN + 1:
            resync()


@pytest.mark.parametrize("torn", [False, True])
def test_pipelined_and_whole_iteration_replicas_and_checkpoints_are_bit_identical(generated, tmp_path, monkeypatch,
                                                                                   torn):
    """The same generated capture through the appliance both ways: every committed checkpoint and
    the final replica are bit-identical (and the trainer's own, from the generator's truth). With
    ``torn``, iteration TORN's first bucket is stepped ahead, the iteration turns out incomplete, the
    step is rolled back, the replica stays stale (later iterations skipped) until a resync brings
    the trainer's state after TORN + 1, and both ways go on from it. With clipping, each bucket's
    gradient norms are taken as the bucket arrives (pipelined) and combined at the last one."""
    from mirrorckpt.config.training import TrainingSpec as T
    from mirrorckpt.updater.fingerprint import state_sha256
    from mirrorckpt.updater.replica import Replica

    job, items, truth = generated
    training = T.from_dict(job.training)
    ref = Replica.from_initial_weights(job.layout, training, next(x for x in items
                                                                   if isinstance(x, InitialWeights)).values)
    for x in items:
        if isinstance(x, ReducedIteration) and x.index <= TORN + 1:
            ref.apply(x)
    fallback_state = ref.state()
    real_norm, norm_calls = torch._foreach_norm, []

    def counting(tensors, *a, **kw):
        norm_calls.append(len(tensors))
        return real_norm(tensors, *a, **kw)

    monkeypatch.setattr(torch, "_foreach_norm", counting)
    runs = {}
    for pipelined in (True, False):
        norm_calls.clear()
        persist = PersistSpec(directory=str(tmp_path / str(pipelined)), every_iterations=1, keep_last=100,
                              memory_budget_bytes=1)  # every snapshot written at once: the same steps both ways
        app = Appliance(None, training, persist, pipelined=pipelined)
        stream = _torn(items, lambda a=app: a.replica.resync(copy.deepcopy(fallback_state))) if torn else items
        drive(stream, app)
        s = app.close()
        steps = sorted(ckptdir.parse_step(p.name) for p in (tmp_path / str(pipelined)).glob("step-*"))
        runs[pipelined] = (s, steps, {n: read_state(tmp_path / str(pipelined) / ckptdir.step_dirname(n))
                                      for n in steps}, state_sha256(app.replica.params, app.replica.optimizer))
        if training.clip is not None:  # one norm call per bucket handed on (not while stale), or per iteration
            skipped = {TORN + 1} if torn else set()
            buckets = [len(job.layout.bucket_list(x.iteration)[x.bucket].params)
                       for x in (_torn(items, lambda: None) if torn else items)
                       if isinstance(x, ReducedBucket) and x.iteration not in skipped]
            whole = [len(job.layout.params)] * s.iterations_applied
            assert norm_calls == (buckets if pipelined else whole), (pipelined, norm_calls)
    (s1, steps1, ck1, sha1), (s0, steps0, ck0, sha0) = runs[True], runs[False]
    assert s1.to_dict() | {"seconds": 0, "checkpoints": []} == s0.to_dict() | {"seconds": 0, "checkpoints": []}
    assert s1.iterations_applied == GEN_STEPS - 2 * torn  # TORN incomplete, TORN + 1 skipped (stale)
    assert s1.iterations_incomplete == int(torn) and s1.stale_events == int(torn)
    assert steps1 == steps0 == [n for n in range(1, GEN_STEPS + 1) if not (torn and TORN < n <= TORN + 2)]
    for n in steps1:
        a, b = ck1[n], ck0[n]
        assert (a.iterations_done, a.step) == (b.iterations_done, b.step) == (n, n)
        for k in a.params:
            assert torch.equal(a.params[k], b.params[k]), (n, k)
        for k, st in a.optim["state"].items():
            for key, v in st.items():
                assert torch.equal(v, b.optim["state"][k][key]), (n, k, key)
    assert sha1 == sha0 == (truth[-1]["params_sha256"], truth[-1]["optim_sha256"])


def test_an_appliance_imports_what_its_first_optimizer_needs_before_any_iteration():
    """torch's first optimizer imports its compiler stack (seconds): done when the appliance is
    built, not in the updater's first step (checked in a fresh interpreter, where nothing did it)."""
    import subprocess
    import sys

    code = ("import sys\nfrom mirrorckpt.config.training import OptimizerSpec, TrainingSpec\n"
            "from mirrorckpt.updater.appliance import Appliance\n"
            "assert 'torch._dynamo' not in sys.modules\n"
            "Appliance(None, TrainingSpec(optimizer=OptimizerSpec(name='adamw', lr=0.01)))\n"
            "assert 'torch._dynamo' in sys.modules\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
