"""updater.appliance: the pipeline driver and the appliance's commit rules.

A replica stale for missing data still holds a state the trainer had: closing commits it (a
SIGTERM in the middle of an iteration must not lose the iterations already applied). A replica
that drifted holds a wrong state: closing commits nothing new."""

from __future__ import annotations

import numpy as np
import torch
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec
from mirrorckpt.config.training import OptimizerSpec, PersistSpec, TrainingSpec
from mirrorckpt.parser.iteration import InitialWeights, ReducedBucket, ReducedIteration
from mirrorckpt.updater import ckptdir
from mirrorckpt.updater.appliance import Appliance, drive
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
