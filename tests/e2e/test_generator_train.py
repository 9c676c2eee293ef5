"""The generator's trainer and DDP emulation, checked against real torch DDP.

Real DDP runs in 2 and 3 subprocesses over gloo on 127.0.0.1 (this file is also the worker
script). A ProcessGroup subclass wraps the gloo group and records every collective DDP's C++
Reducer issues through it: kind, dtype, shape and the result bytes. With 2 ranks gloo's SUM is
a + b, as LocalComm's, so everything must agree bit for bit; with 3 ranks gloo adds in its ring
order, so the all-reduce results agree only up to rounding.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mirrorckpt.config import ddp as cddp
from mirrorckpt.config.layout import numpy_dtype
from mirrorckpt.config.training import TrainingSpec
from mirrorckpt.tools.generator import ddp as gddp
from mirrorckpt.tools.generator import models, truth
from mirrorckpt.tools.generator.train import (
    LocalComm,
    build_optimizer,
    build_scheduler,
    run_training,
    sum_in_rank_order,
)
from mirrorckpt.tools.testbed.harness import free_port
from mirrorckpt.updater.fingerprint import state_sha256

HERE = Path(__file__).resolve()
KEEP_BYTES = 8 << 20  # the workers keep payloads up to this size, digests of all
GPT = "gpt:layers=2,d=32,heads=4,vocab=64,ctx=16"

# Jobs run by real DDP and by the generator. bucket_cap_mb=0.02 splits the tiny GPT into several
# buckets in gradient-ready order; the MLPs cross the default 1 MiB first-bucket cap.
ADAMW_CLIP_STEPLR = {"optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1},
                     "lr_schedule": {"name": "StepLR", "kwargs": {"step_size": 2, "gamma": 0.5}},
                     "clip": {"max_norm": 0.5}}
SGD_BF16 = {"optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "grad_dtype": "bfloat16"}
JOBS = {
    2: [dict(model=GPT, seed=7, batch=3, steps=4, bucket_cap_mb=0.02, training=ADAMW_CLIP_STEPLR),
        dict(model="mlp:64,2000,300,10", seed=11, batch=4, steps=3, bucket_cap_mb=None, training=SGD_BF16),
        # 256 MiB + 0.5 MiB of parameters: DDP's start-up broadcast splits at 250 MiB (no training)
        dict(model="mlp:8192,8192,16", seed=3, batch=1, steps=0, bucket_cap_mb=None, training={})],
    3: [dict(model=GPT, seed=7, batch=3, steps=2, bucket_cap_mb=0.02, training=ADAMW_CLIP_STEPLR),
        dict(model="mlp:64,1200,300,10", seed=5, batch=4, steps=2, bucket_cap_mb=None, training={})],
}


# ---------------------------------------------------------------------------------------------
# worker side (runs in the subprocesses)

class RecordingGroup(dist.ProcessGroup):
    """Delegates to the real gloo group, waits, and records (kind, dtype, shape, result bytes)."""

    def __init__(self, inner):
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self.log: list[tuple[str, str, tuple, str, bytes | None]] = []

    def _record(self, kind, tensors):
        h, keep = hashlib.sha256(), []
        for t in tensors:  # hashed in place: the large job broadcasts 256 MiB
            a = t.detach().contiguous()
            a = (a.view(torch.int16) if a.dtype == torch.bfloat16 else a).numpy()
            h.update(memoryview(a).cast("B"))
            keep.append(a.tobytes() if a.nbytes <= KEEP_BYTES else None)
        data = None if None in keep else b"".join(keep)
        self.log.append((kind, gddp.dtype_name(tensors[0].dtype), tuple(tensors[0].shape), h.hexdigest(), data))

    def broadcast(self, tensor_list, opts=None):
        assert opts.rootRank == 0 and len(tensor_list) == 1
        work = self.inner.broadcast(tensor_list, opts)
        work.wait()
        self._record("broadcast", tensor_list)
        return work

    def allgather(self, output_tensors, input_tensor, opts=None):
        work = self.inner.allgather(output_tensors, input_tensor, opts)
        work.wait()
        self._record("all_gather", output_tensors[0])
        return work

    def allreduce(self, tensor_list, opts=None):
        assert opts.reduceOp == dist.ReduceOp.SUM and len(tensor_list) == 1
        work = self.inner.allreduce(tensor_list, opts)
        work.wait()
        self._record("all_reduce", tensor_list)
        return work


def reducer_buckets(ddp_model, params) -> list[list[int]]:
    """The Reducer's current buckets as parameter indices."""
    index = {id(p): i for i, p in enumerate(params)}
    buckets = ddp_model.reducer._get_zeros_like_grad_buckets()
    return [[index[id(p)] for p in b.parameters()] for b in sorted(buckets, key=lambda b: b.index())]


def worker_job(job: dict, rank: int) -> dict:
    """Plain user DDP training code (fp32 masters for bf16); returns what this rank saw."""
    spec = TrainingSpec.from_dict(job["training"])
    dtype = getattr(torch, spec.grad_dtype)
    low = dtype != torch.float32
    model = models.build_model(job["model"], job["seed"]).to(dtype)
    group = RecordingGroup(dist.group.WORLD)
    ddp_model = torch.nn.parallel.DistributedDataParallel(model, process_group=group,
                                                          bucket_cap_mb=job["bucket_cap_mb"])
    params = ddp_model._build_params_for_reducer()[0]
    first = reducer_buckets(ddp_model, params)
    masters = [p.detach().float().clone() for p in params] if low else params
    opt = build_optimizer(masters, spec.optimizer)
    sched = build_scheduler(opt, spec.lr_schedule)
    rebuilt, states = None, []
    for step in range(job["steps"]):
        x, y = models.make_batch(job["model"], job["seed"], rank, step, job["batch"], dtype)
        opt.zero_grad()
        ddp_model.zero_grad()  # bf16: the model's own grads are not the optimizer's
        out = ddp_model(x)
        if step == 1:  # the forward pre-hook has rebuilt the buckets
            rebuilt = reducer_buckets(ddp_model, params)
        if low:
            out, y = out.float(), y.float()
        models.compute_loss(job["model"], out, y).backward()
        if low:
            for m, p in zip(masters, params):
                m.grad = p.grad.float()
        if spec.clip:
            torch.nn.utils.clip_grad_norm_(masters, spec.clip.max_norm)
        opt.step()
        if sched:
            sched.step()
        if low:
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
        states.append(state_sha256(masters, opt))
    return {"log": group.log, "first": first, "rebuilt": rebuilt, "states": states}


def worker_main(config_path: str, rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    jobs = json.loads(Path(config_path).read_text())["jobs"][str(world)]
    results = [worker_job(job, rank) for job in jobs]
    dist.destroy_process_group()
    torch.save(results, out)


# ---------------------------------------------------------------------------------------------
# test side


def launch_ranks(config_path: str, outdir: str) -> None:
    """Fork the rank processes of each world in turn from one process that has imported torch and
    what DDP's constructor imports (torch._dynamo): seconds of CPU saved per rank."""
    import multiprocessing

    import torch._dynamo  # noqa: F401  (DistributedDataParallel.__init__ imports it)

    ctx = multiprocessing.get_context("fork")
    for world in json.loads(Path(config_path).read_text())["worlds"]:
        port = free_port()
        procs = [ctx.Process(target=worker_main, args=(config_path, r, world, port, f"{outdir}/w{world}_rank{r}.pt"))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            sys.exit(f"world {world}: exit codes {[p.exitcode for p in procs]}")


def run_real_ddp(tmp_path: Path, jobs: dict[int, list[dict]]) -> dict[int, list[list[dict]]]:
    """Run each world's jobs in that many gloo processes; per world, per rank, per job the results."""
    cfg = tmp_path / "jobs.json"
    cfg.write_text(json.dumps({"worlds": sorted(jobs), "jobs": {str(w): j for w, j in jobs.items()}}))
    proc = subprocess.run([sys.executable, str(HERE), "launch", str(cfg), str(tmp_path)],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, proc.stdout.decode(errors="replace")[-3000:]
    return {w: [torch.load(tmp_path / f"w{w}_rank{r}.pt", weights_only=False) for r in range(w)] for w in jobs}


@pytest.fixture(autouse=True)
def one_thread():
    # intra-op threads change float summation order; the workers run with one thread too
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    runs = run_real_ddp(tmp_path_factory.mktemp("ddp"), JOBS)
    return runs.__getitem__


class RecordingLocal(LocalComm):
    """LocalComm keeping (kind, what, dtype, shape, result bytes) of every collective."""

    def __init__(self):
        super().__init__()
        self.log: list[tuple[str, str, str, tuple, bytes]] = []

    def _rec(self, kind, what, arrays):
        self.log.append((kind, what, truth.wire_dtype_name(arrays[0]), arrays[0].shape,
                         b"".join(a.tobytes() for a in arrays)))

    def all_gather(self, per_rank, what):
        out = super().all_gather(per_rank, what)
        self._rec("all_gather", what, out)
        return out

    def broadcast(self, data, root, what):
        out = super().broadcast(data, root, what)
        self._rec("broadcast", what, [out])
        return out

    def all_reduce(self, per_rank, what):
        out = super().all_reduce(per_rank, what)
        self._rec("all_reduce", what, [out])
        return out


def emulate_startup(job: dict, world: int) -> tuple[gddp.DDP, RecordingLocal]:
    """The emulator's start-up collectives, first iteration and bucket rebuild for ``job``."""
    dtype = getattr(torch, TrainingSpec.from_dict(job["training"]).grad_dtype)
    model = models.build_model(job["model"], job["seed"]).to(dtype)
    comm = RecordingLocal()
    ddp = gddp.DDP(model, world, comm, bucket_cap_mb=job["bucket_cap_mb"])
    ddp.begin_iteration(0)
    grads = []
    for r in range(world):
        x, y = models.make_batch(job["model"], job["seed"], r, 0, job["batch"], dtype)
        model.zero_grad(set_to_none=True)
        out = model(x)
        if dtype != torch.float32:
            out, y = out.float(), y.float()
        loss = models.compute_loss(job["model"], out, y)
        if r == 0:
            with ddp.record_ready_order():
                loss.backward()
        else:
            loss.backward()
        grads.append([p.grad for p in ddp.params])
    model.zero_grad(set_to_none=True)
    ddp.reduce(0, grads)
    ddp.begin_iteration(1)
    return ddp, comm


def assert_close_sum(dtype: str, emu: bytes, real: bytes, what: str):
    a, b = (gddp.from_wire(np.frombuffer(x, numpy_dtype(dtype)), gddp.TORCH_DTYPES[dtype]).double()
            for x in (emu, real))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()), msg=what)


def train_job(job: dict, world: int, **kw):
    return run_training(job["model"], world, job["steps"], job["seed"], TrainingSpec.from_dict(job["training"]),
                        batch_size=job["batch"], bucket_cap_mb=job["bucket_cap_mb"], **kw)


# ---------------------------------------------------------------------------------------------
# models

def test_linear_5000_seed_2024_has_the_capture_weights():
    torch.manual_seed(2024)
    expected = torch.nn.Linear(5000, 1, bias=False)
    model = models.build_model("linear:5000", 2024)
    assert isinstance(model, torch.nn.Linear) and model.bias is None
    assert torch.equal(model.weight, expected.weight)
    # and that is what the generator broadcasts as rank 0's initial parameters
    result = run_training("linear:5000", 2, 1, 2024)
    assert torch.equal(result.initial_params[0], expected.weight.detach())
    init = [c for c in result.collectives if c.what == "init_params:0"]
    assert init[0].sha256 == hashlib.sha256(expected.weight.detach().numpy().tobytes()).hexdigest()


def test_model_specs():
    mlp = models.build_model("mlp:1024,1024,512,10", 0)
    assert [n for n, _ in mlp.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert 1_500_000 < sum(p.numel() for p in mlp.parameters()) < 1_600_000
    assert isinstance(mlp[1], torch.nn.ReLU)
    gpt = models.build_model(GPT, 0)
    assert list(gpt.named_buffers()) == []
    assert models.parse_spec(GPT).text == GPT
    for bad in ("linear:x", "mlp:5", "gpt:layers=1,d=30,heads=4,vocab=8,ctx=4", "gpt:layers=1", "cnn:3"):
        with pytest.raises(ValueError, match="model spec"):
            models.parse_spec(bad)
    # the same seed gives the same weights
    a, b = models.build_model(GPT, 3), models.build_model(GPT, 3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_data_shards_per_rank_and_step():
    x00 = models.make_batch(GPT, 1, 0, 0, 2)[0]
    assert torch.equal(x00, models.make_batch(GPT, 1, 0, 0, 2)[0])
    for other in ((1, 1, 0), (1, 0, 1), (2, 0, 0)):
        assert not torch.equal(x00, models.make_batch(GPT, other[0], other[1], other[2], 2)[0])
    x, y = models.make_batch("mlp:8,4,3", 1, 0, 0, 5, torch.bfloat16)
    assert x.shape == (5, 8) and y.shape == (5, 3) and x.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# DDP against real DDP

@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("job_index", [0, 1])
def test_startup_and_rebuild_match_real_ddp(real_runs, world, job_index):
    job = JOBS[world][job_index]
    real = real_runs(world)
    ddp, comm = emulate_startup(job, world)
    assert ddp.first_buckets == real[0][job_index]["first"] == [list(range(len(ddp.params)))]
    assert ddp.buckets == real[0][job_index]["rebuilt"]
    assert len(ddp.buckets) > 1
    assert [w for _, w, *_ in comm.log] == ["param_count", "shapes", "init_params:0", "grad:iter=0:bucket=0",
                                            "rebuild_indices", "rebuild_sizes"]
    for r in range(world):  # every rank received the same results
        log = real[r][job_index]["log"]
        for (kind, what, dtype, shape, data), (rkind, rdtype, rshape, rsha, rdata) in zip(comm.log, log):
            assert (kind, dtype, shape) == (rkind, rdtype, rshape), what
            if kind == "all_reduce" and world > 2:
                assert_close_sum(dtype, data, rdata, what)
            else:
                assert hashlib.sha256(data).hexdigest() == rsha, f"{what}: payload differs"
    # what the payloads say
    indices, sizes = (np.frombuffer(comm.log[k][4], np.int32) for k in (4, 5))
    assert indices[-1] == len(ddp.buckets) and sizes.tolist() == [len(b) for b in ddp.buckets]
    assert np.frombuffer(comm.log[0][4], np.int64).tolist() == [len(ddp.params)] * world
    # the next collectives are the rebuilt buckets' all-reduces, in bucket order
    counts = [sum(ddp.params[i].numel() for i in b) for b in ddp.buckets]
    after = real[0][job_index]["log"][len(comm.log):len(comm.log) + len(counts)]
    assert [(k, s[0]) for k, _, s, *_ in after] == [("all_reduce", n) for n in counts]


def test_large_model_start_up_broadcasts_in_250_mib_groups(real_runs):
    job = JOBS[2][2]
    model = models.build_model(job["model"], job["seed"])
    comm = RecordingLocal()
    gddp.DDP(model, 2, comm)
    sizes = [p.numel() for p in model.parameters()]
    assert [(w, s[0]) for _, w, _, s, _ in comm.log] == [
        ("param_count", 1), ("shapes", 12), ("init_params:0", sizes[0]), ("init_params:1", sum(sizes[1:]))]
    real = real_runs(2)[0][2]["log"]
    assert [(k, dt, s, sha) for k, dt, s, sha, _ in real] == [
        (k, dt, s, hashlib.sha256(d).hexdigest()) for k, _, dt, s, d in comm.log]


@pytest.mark.parametrize("job_index", [0, 1])
def test_training_matches_real_ddp_bit_for_bit(real_runs, job_index):
    job = JOBS[2][job_index]
    real = real_runs(2)[0][job_index]
    result = train_job(job, 2)
    got = [(c.kind, c.dtype, c.count, c.sha256) for c in result.collectives]
    want = [(k, dt, math.prod(shape), sha) for k, dt, shape, sha, _ in real["log"]]
    assert got == want
    assert [(it.params_sha256, it.optim_sha256) for it in result.iterations] == [tuple(s) for s in real["states"]]
    assert result.layout.first_buckets == [gddp.BucketSpec(tuple(real["first"][0]))]
    assert [list(b.params) for b in result.layout.buckets] == real["rebuilt"]
    n_grad = sum(1 for c in result.collectives if c.kind == "all_reduce")
    assert n_grad == 1 + (job["steps"] - 1) * len(result.layout.buckets)


# ---------------------------------------------------------------------------------------------
# the trainer

def test_per_iteration_reduced_gradients_are_rank_means():
    result = run_training("mlp:6,5,3", 3, 2, 4, keep_reduced=True,
                          training=TrainingSpec.from_dict({"optimizer": {"name": "sgd", "lr": 0.0}}))
    layout = result.layout
    model = models.build_model("mlp:6,5,3", 4)  # lr 0: the weights stay the initial ones
    for it in range(2):
        per_rank = []
        for r in range(3):
            model.zero_grad()
            x, y = models.make_batch("mlp:6,5,3", 4, r, it, 4)
            models.compute_loss("mlp:6,5,3", model(x), y).backward()
            per_rank.append([p.grad.clone() for p in model.parameters()])
        for b, bucket in enumerate(layout.bucket_list(it)):
            flat = gddp.from_wire(result.reduced[it][b], torch.float32)
            for i, start, stop in layout.bucket_slices(bucket):
                mean = (per_rank[0][i] * (1 / 3) + per_rank[1][i] * (1 / 3)) + per_rank[2][i] * (1 / 3)
                assert torch.equal(flat[start:stop], mean.reshape(-1))
            assert result.iterations[it].buckets_sha256[b] == truth.sha256_arrays([result.reduced[it][b]])


def test_fp16_forced_overflow_skips_the_step():
    spec = TrainingSpec.from_dict({"grad_dtype": "float16", "optimizer": {"name": "adam", "lr": 1e-3},
                                   "lr_schedule": {"name": "StepLR", "kwargs": {"step_size": 1, "gamma": 0.5}},
                                   "clip": {"max_norm": 1.0},
                                   "loss_scale": {"init_scale": 1024.0, "growth_interval": 2}})
    result = run_training(GPT, 2, 5, 1, spec, force_overflow_at=2, keep_reduced=True, bucket_cap_mb=0.02)
    its = result.iterations
    assert [it.skipped for it in its] == [False, False, True, False, False]
    assert [it.step for it in its] == [1, 2, 2, 3, 4]
    assert [it.loss_scale for it in its] == [1024.0, 1024.0, 2048.0, 1024.0, 1024.0]
    assert [it.lr for it in its] == [1e-3, 5e-4, 2.5e-4, 1.25e-4, 6.25e-5]  # scheduler steps on skip
    assert (its[2].params_sha256, its[2].optim_sha256) == (its[1].params_sha256, its[1].optim_sha256)
    assert its[3].params_sha256 != its[2].params_sha256
    def finite(it):
        return all(bool(torch.isfinite(gddp.from_wire(b, torch.float16)).all()) for b in result.reduced[it])
    assert not finite(2) and finite(3)  # the inf travels on the wire
    assert result.layout.grad_dtype == "float16" and result.masters[0].dtype == torch.float32
    assert all(p.dtype == torch.float16 for p in result.model.parameters())
    with pytest.raises(ValueError, match="float16"):
        run_training(GPT, 2, 2, 1, force_overflow_at=1)


def test_bf16_masters_and_model_copy():
    spec = TrainingSpec.from_dict({"grad_dtype": "bfloat16", "optimizer": {"name": "adamw", "lr": 1e-2}})
    result = run_training("mlp:8,16,4", 2, 3, 9, spec)
    assert result.collectives[2].dtype == "bfloat16"
    for m, p in zip(result.masters, result.model.parameters()):
        assert m.dtype == torch.float32 and torch.equal(p, m.to(torch.bfloat16))
    assert state_sha256(result.masters, result.optimizer) == (result.iterations[-1].params_sha256,
                                                              result.iterations[-1].optim_sha256)


def test_sum_in_rank_order_rounds_each_addition():
    one, eps = np.float32(1.0), np.float32(2.0 ** -24)
    a, b, c = (np.array([x], np.float32) for x in (one, eps, eps))
    assert sum_in_rank_order([a, b, c])[0] == one  # (1 + e) + e rounds twice
    assert sum_in_rank_order([b, c, a])[0] == one + 2 * eps
    bf = [gddp.to_wire(torch.tensor([v], dtype=torch.bfloat16)) for v in (1.0, 2.0 ** -8)]
    out = sum_in_rank_order(bf)
    assert out.dtype == np.uint16
    assert gddp.from_wire(out, torch.bfloat16).item() == 1.0  # 1 + 2^-8 rounds to even in bf16
    ints = [np.array([2 ** 31 - 1], np.int32), np.array([1], np.int32)]
    assert sum_in_rank_order(ints)[0] == -2 ** 31


def test_broadcast_coalesced_splits_at_the_limit(monkeypatch):
    monkeypatch.setattr(gddp, "BROADCAST_BUCKET_BYTES", 4096)
    comm = RecordingLocal()
    model = models.build_model("mlp:16,40,40,4", 0)  # 640, 40, 1600, 40, 160, 4 floats
    gddp.DDP(model, 2, comm)
    init = [(w, np.frombuffer(d, np.float32)) for k, w, _, _, d in comm.log if w.startswith("init_params")]
    assert [w for w, _ in init] == ["init_params:0", "init_params:1"]
    # a group closes with the tensor that makes it reach 4096 bytes
    assert [a.size for _, a in init] == [640 + 40 + 1600, 40 + 160 + 4]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    assert np.array_equal(np.concatenate([a for _, a in init]), flat)


def test_bucket_caps_follow_ddp_2_13():
    assert cddp.bucket_caps(None) == (25 * 2 ** 20, 2 ** 20) == (cddp.bucket_caps(None)[0],
                                                               dist._DEFAULT_FIRST_BUCKET_BYTES)
    assert cddp.bucket_caps(4) == (4 * 2 ** 20, 4 * 2 ** 20)  # a user value is used for both
    params = [torch.empty(n) for n in (200_000, 100_000, 300_000, 10)]  # 800, 400, 1200, 0.04 kB
    order = [3, 2, 1, 0]

    def rebuilt(cap_mb):
        return cddp.rebuilt_buckets(params, order, *cddp.bucket_caps(cap_mb))

    assert rebuilt(None) == [[3, 2], [1, 0]]  # 1 MiB first bucket
    assert rebuilt(1) == [[3, 2], [1, 0]]
    assert rebuilt(0.5) == [[3, 2], [1, 0]]
    assert rebuilt(0.3) == [[3, 2], [1], [0]]
    assert rebuilt(4) == [[3, 2, 1, 0]]
    assert cddp.initial_buckets(params) == [[0, 1, 2, 3]]


@pytest.mark.parametrize("training,overflow_at", [
    (ADAMW_CLIP_STEPLR, None),
    (SGD_BF16, None),
    ({"grad_dtype": "float16", "optimizer": {"name": "adam", "lr": 1e-3}, "clip": {"max_norm": 1.0},
      "loss_scale": {"init_scale": 1024.0, "growth_interval": 2},
      "lr_schedule": {"name": "StepLR", "kwargs": {"step_size": 1, "gamma": 0.5}}}, 2),
])
def test_replica_fed_the_reduced_buckets_follows_the_trainer(training, overflow_at):
    # the updater's replica implements the trainer semantics independently
    from mirrorckpt.parser.iteration import ReducedIteration
    from mirrorckpt.updater.replica import Replica

    spec = TrainingSpec.from_dict(training)
    result = run_training(GPT, 2, 4, 1, spec, keep_reduced=True, bucket_cap_mb=0.02, force_overflow_at=overflow_at)
    init = torch.cat([p.reshape(-1) for p in result.initial_params])
    flat = gddp.to_wire(init) if init.dtype == torch.bfloat16 else init.float().numpy()
    replica = Replica.from_initial_weights(result.layout, spec, flat)
    for buckets, rec in zip(result.reduced, result.iterations):
        assert replica.apply(ReducedIteration(rec.index, buckets)) is not rec.skipped
        assert replica.state_sha256() == (rec.params_sha256, rec.optim_sha256)
        assert replica.step == rec.step
    assert any(rec.skipped for rec in result.iterations) == (overflow_at is not None)


# ---------------------------------------------------------------------------------------------
# truth

def test_truth_files_are_deterministic(tmp_path):
    spec = TrainingSpec.from_dict({"grad_dtype": "float16", "loss_scale": {"growth_interval": 1}})
    runs = [run_training(GPT, 2, 3, 5, spec, force_overflow_at=1, bucket_cap_mb=0.02) for _ in range(2)]
    paths = [truth.write_truth(r, tmp_path / f"run{i}") for i, r in enumerate(runs)]
    assert paths[0].read_bytes() == paths[1].read_bytes()
    t = truth.read_truth(paths[0].parent)
    assert t["config"]["model"] == GPT and t["config"]["ranks"] == 2
    assert [c["what"] for c in t["collectives"]][:3] == ["param_count", "shapes", "init_params:0"]
    assert [c["index"] for c in t["collectives"]] == list(range(len(t["collectives"])))
    assert len(t["iterations"]) == 3 and t["iterations"][1]["skipped"] is True
    assert t["iterations"][0]["buckets_sha256"][0] == [c for c in t["collectives"]
                                                       if c["what"] == "grad:iter=0:bucket=0"][0]["sha256"]
    init = truth.read_initial_params(paths[0].parent)
    assert all(torch.equal(a, b) for a, b in zip(init, runs[0].initial_params))
    assert init[0].dtype == torch.float16
    assert t["initial_params"]["sha256"] == [c for c in t["collectives"] if c["what"] == "init_params:0"][0]["sha256"]
    assert json.loads(paths[0].read_text()) == json.loads(json.dumps(truth.truth_dict(runs[1]), sort_keys=True))


if __name__ == "__main__" and sys.argv[1:2] == ["launch"]:
    launch_ranks(sys.argv[2], sys.argv[3])
