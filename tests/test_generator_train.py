"""The generator's trainer and DDP emulation against real torch DDP.

Real DDP runs in 2 and 3 subprocesses over gloo on 127.0.0.1 (this file is also the worker
script). A ProcessGroup subclass wraps the gloo group and records every collective DDP's C++
Reducer issues through it: kind, dtype, shape and the result bytes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mirrorckpt.config.layout import numpy_dtype
from mirrorckpt.tools.generator import ddp as gddp
from mirrorckpt.tools.generator import models
from mirrorckpt.tools.generator.train import LocalComm

HERE = Path(__file__).resolve()


# ---------------------------------------------------------------------------------------------
# worker side (runs in the subprocesses)

class RecordingGroup(dist.ProcessGroup):
    """Delegates to the real gloo group, waits, and records (kind, dtype, shape, result bytes)."""

    def __init__(self, inner):
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self.log: list[tuple[str, str, tuple, bytes]] = []

    def _record(self, kind, tensors):
        data = b"".join(gddp.to_wire(t).tobytes() for t in tensors)
        self.log.append((kind, gddp.dtype_name(tensors[0].dtype), tuple(tensors[0].shape), data))

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
    index = {id(p): i for i, p in enumerate(params)}
    buckets = ddp_model.reducer._get_zeros_like_grad_buckets()
    return [[index[id(p)] for p in b.parameters()] for b in sorted(buckets, key=lambda b: b.index())]


def worker_job(job: dict, rank: int, world: int) -> dict:
    """Plain user DDP training code for one job; returns what rank 0 saw."""
    dtype = getattr(torch, job.get("dtype", "float32"))
    model = models.build_model(job["model"], job["seed"]).to(dtype)
    group = RecordingGroup(dist.group.WORLD)
    ddp_model = torch.nn.parallel.DistributedDataParallel(
        model, process_group=group, bucket_cap_mb=job.get("bucket_cap_mb"))
    params = ddp_model._build_params_for_reducer()[0]
    first = reducer_buckets(ddp_model, params)
    masters = [p.detach().float().clone() for p in params] if dtype != torch.float32 else params
    opt = torch.optim.SGD(masters, lr=job.get("lr", 0.01))
    rebuilt = None
    for step in range(job["steps"]):
        x, y = models.make_batch(job["model"], job["seed"], rank, step, job["batch"], dtype)
        opt.zero_grad()
        loss = models.compute_loss(job["model"], ddp_model(x), y)
        if step == 1:
            rebuilt = reducer_buckets(ddp_model, params)
        loss.backward()
        if dtype != torch.float32:
            for m, p in zip(masters, params):
                m.grad = p.grad.float()
        opt.step()
        if dtype != torch.float32:
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
    return {"log": group.log, "first": first, "rebuilt": rebuilt,
            "masters": [m.detach().clone() for m in masters]}


def worker_main(config_path: str, rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    jobs = json.loads(Path(config_path).read_text())
    results = [worker_job(job, rank, world) for job in jobs]
    dist.destroy_process_group()
    torch.save(results, out)


# ---------------------------------------------------------------------------------------------
# test side

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_real_ddp(tmp_path: Path, jobs: list[dict], world: int) -> list[list[dict]]:
    """Run ``jobs`` in ``world`` gloo processes; per rank, per job the worker's results."""
    cfg = tmp_path / f"jobs{world}.json"
    cfg.write_text(json.dumps(jobs))
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    outs = [tmp_path / f"rank{world}_{r}.pt" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(HERE), str(cfg), str(r), str(world), str(port), str(outs[r])],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=180)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [torch.load(o, weights_only=False) for o in outs]


class RecordingLocal(LocalComm):
    def __init__(self):
        super().__init__()
        self.log: list[tuple[str, str, str, tuple, bytes]] = []

    def _rec(self, kind, what, arrays):
        dt = {np.dtype(np.uint16): "bfloat16"}.get(arrays[0].dtype, str(arrays[0].dtype))
        self.log.append((kind, what, dt, arrays[0].shape, b"".join(a.tobytes() for a in arrays)))

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
    dtype = getattr(torch, job.get("dtype", "float32"))
    model = models.build_model(job["model"], job["seed"]).to(dtype)
    comm = RecordingLocal()
    ddp = gddp.DDP(model, world, comm, bucket_cap_mb=job.get("bucket_cap_mb"))
    ddp.begin_iteration(0)
    grads = []
    for r in range(world):
        x, y = models.make_batch(job["model"], job["seed"], r, 0, job["batch"], dtype)
        model.zero_grad(set_to_none=True)
        loss = models.compute_loss(job["model"], model(x), y)
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


GPT = "gpt:layers=2,d=32,heads=4,vocab=64,ctx=16"
JOBS = {
    # bucket_cap_mb=0.02 splits the tiny GPT into several buckets in gradient-ready order;
    # the MLPs cross the default 1 MiB first-bucket cap, so the rebuild gives two buckets.
    2: [dict(model=GPT, seed=7, batch=3, steps=3, bucket_cap_mb=0.02),
        dict(model="mlp:64,2000,300,10", seed=11, batch=4, steps=2, dtype="bfloat16")],
    3: [dict(model=GPT, seed=7, batch=3, steps=2, bucket_cap_mb=0.02),
        dict(model="mlp:64,1200,300,10", seed=5, batch=4, steps=2)],
}


@pytest.fixture(autouse=True)
def one_thread():
    # intra-op threads change float summation order; the workers run with one thread too
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = run_real_ddp(tmp_path_factory.mktemp(f"ddp{world}"), JOBS[world], world)
        return cache[world]
    return get


def assert_same_bytes(kind, dtype, emu: bytes, real: bytes, exact: bool, what: str):
    if exact or kind != "all_reduce":
        assert emu == real, f"{what}: payload differs"
        return
    # 3 ranks: gloo's ring adds in another order than rank order; equal up to rounding
    a = gddp.from_wire(np.frombuffer(emu, numpy_dtype(dtype)), gddp.TORCH_DTYPES[dtype]).double()
    b = gddp.from_wire(np.frombuffer(real, numpy_dtype(dtype)), gddp.TORCH_DTYPES[dtype]).double()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("job_index", [0, 1])
def test_startup_and_rebuild_match_real_ddp(real_runs, world, job_index):
    job = JOBS[world][job_index]
    real = real_runs(world)
    ddp, comm = emulate_startup(job, world)
    assert ddp.first_buckets == real[0][job_index]["first"]
    assert ddp.buckets == real[0][job_index]["rebuilt"]
    assert len(ddp.buckets) > 1
    expected = ["param_count", "shapes", "init_params:0", "grad:iter=0:bucket=0", "rebuild_indices",
                "rebuild_sizes"]
    assert [w for _, w, *_ in comm.log] == expected
    for r in range(world):  # every rank received the same results
        log = real[r][job_index]["log"]
        assert len(log) > len(comm.log)
        for (kind, what, dtype, shape, data), (rkind, rdtype, rshape, rdata) in zip(comm.log, log):
            assert (kind, dtype, shape) == (rkind, rdtype, rshape), what
            assert_same_bytes(kind, dtype, data, rdata, world == 2, what)
    # the next collectives are the rebuilt buckets' all-reduces, in bucket order
    sizes = [sum(ddp.params[i].numel() for i in b) for b in ddp.buckets]
    after = real[0][job_index]["log"][len(comm.log):len(comm.log) + len(sizes)]
    assert [(k, s[0]) for k, _, s, _ in after] == [("all_reduce", n) for n in sizes]


if __name__ == "__main__":
    worker_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
