"""Updater benchmarks: replica step throughput against the memory-bandwidth bound measured in the
same run, and checkpoint persist bandwidth against a plain sequential write of the same bytes.

Each function returns a dict and writes nothing but its scratch files (removed afterwards).
`python benchmarks/bench_updater.py [nparams]` runs them all and prints JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec
from mirrorckpt.config.training import OptimizerSpec, PersistSpec, TrainingSpec
from mirrorckpt.parser.iteration import ReducedIteration
from mirrorckpt.updater.ckptdir import dcp_module
from mirrorckpt.updater.persist import Persister, write_checkpoint
from mirrorckpt.updater.replica import Replica
from mirrorckpt.updater.restore import verify

ADAM_BYTES_PER_PARAM = 28  # fp32 Adam: read param, grad, exp_avg, exp_avg_sq; write param and both moments


def memory_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict:
    """Copy of ``nbytes``, the faster of numpy (one thread) and torch ``copy_`` (every thread torch
    uses, as the multi-threaded optimizer steps do): bytes copied per second (DRAM traffic is at
    least twice that)."""
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    ts, td = torch.from_numpy(src), torch.from_numpy(dst)
    out = {"bytes": nbytes, "threads": torch.get_num_threads()}
    for name, copy in (("numpy", lambda: np.copyto(dst, src)), ("torch", lambda: td.copy_(ts))):
        copy()  # fault the pages in
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            copy()
            times.append(time.perf_counter() - t)
        out[f"{name}_copy_GBps"] = nbytes / min(times) / 1e9
    out["copy_GBps"] = max(out["numpy_copy_GBps"], out["torch_copy_GBps"])
    # STREAM triad a = b + s*c (torch, every thread): two reads and a write per element, counted like
    # the optimizer's bytes (explicit reads and writes only), so the two ratios are comparable.
    n = nbytes // 8 // 2
    a = torch.empty(n, dtype=torch.float64)
    b, c = torch.ones(n, dtype=torch.float64), torch.ones(n, dtype=torch.float64)
    torch.add(b, c, alpha=0.5, out=a)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.add(b, c, alpha=0.5, out=a)
        times.append(time.perf_counter() - t)
    out["triad_GBps"] = 3 * 8 * n / min(times) / 1e9
    out["traffic_GBps"] = max(2 * out["copy_GBps"], out["triad_GBps"])
    return out


def _layout(nparams: int, ntensors: int, nbuckets: int, grad_dtype: str) -> JobLayout:
    per = nparams // ntensors
    params = [ParamSpec(f"layers.{i}.weight", (per,)) for i in range(ntensors)]
    idx = list(reversed(range(ntensors)))
    buckets = [BucketSpec(tuple(idx[b::nbuckets])) for b in range(nbuckets)]
    return JobLayout(params, buckets, first_buckets=buckets, grad_dtype=grad_dtype)


def _iteration(layout: JobLayout, index: int, seed: int = 0) -> ReducedIteration:
    rng = np.random.default_rng(seed)
    out = []
    for b in layout.bucket_list(index):
        x = rng.standard_normal(layout.bucket_count(b), dtype=np.float32) * np.float32(1e-3)
        if layout.grad_dtype == "bfloat16":
            x = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        out.append(x)
    return ReducedIteration(index, out)


def _replica(nparams, ntensors, nbuckets, optimizer, impl, grad_dtype):
    layout = _layout(nparams, ntensors, nbuckets, grad_dtype)
    spec = OptimizerSpec(optimizer, lr=1e-3, weight_decay=0.01, foreach=impl == "foreach", fused=impl == "fused")
    training = TrainingSpec(optimizer=spec, grad_dtype=grad_dtype)
    init = {p.name: torch.full(p.shape, 0.5) for p in layout.params}
    return layout, Replica(layout, training, init)


def replica_update(nparams: int = 50_000_000, ntensors: int = 100, nbuckets: int = 4, optimizer: str = "adamw",
                   impl: str = "forloop", grad_dtype: str = "float32", steps: int = 4, pipelined: bool = False,
                   threads: int | None = None) -> dict:
    """Time Replica.apply (gradient copy + torch optimizer step) per iteration after one warm-up.
    ``threads`` sets torch's intra-op threads for the run (None: leave as is)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _replica_update(nparams, ntensors, nbuckets, optimizer, impl, grad_dtype, steps, pipelined)
    finally:
        torch.set_num_threads(before)


def _replica_update(nparams, ntensors, nbuckets, optimizer, impl, grad_dtype, steps, pipelined) -> dict:
    layout, rep = _replica(nparams, ntensors, nbuckets, optimizer, impl, grad_dtype)
    it = _iteration(layout, 0)
    times = []
    for i in range(steps + 1):
        it.index = i
        if i == 1:
            it = _iteration(layout, 1)  # rebuilt buckets from iteration 1 on (same here)
        t = time.perf_counter()
        if pipelined:
            for b, flat in enumerate(it.buckets):
                rep.apply_bucket(i, b, flat)
        else:
            rep.apply(it)
        times.append(time.perf_counter() - t)
    t = statistics.median(times[1:])
    n = layout.total_numel
    return {"nparams": n, "ntensors": ntensors, "optimizer": optimizer, "impl": impl, "grad_dtype": grad_dtype,
            "pipelined": pipelined, "threads": torch.get_num_threads(), "step_s_median": t,
            "step_s_best": min(times[1:]),
            "Mparams_per_s": n / t / 1e6, "GBps_at_28B": n * ADAM_BYTES_PER_PARAM / t / 1e9}


def plain_write_seconds(tensors: list[torch.Tensor], path: str) -> float:
    """A plain sequential write + fsync of the tensors' bytes (then removed): what a commit is held against."""
    t = time.perf_counter()
    with open(path, "wb") as f:
        for x in tensors:
            f.write(memoryview(x.numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    os.unlink(path)
    return dt


def persist_bandwidth(nparams: int = 50_000_000, ntensors: int = 100, directory: str | None = None) -> dict:
    """A checkpoint of an Adam replica (params + two moments) written by write_checkpoint and by the
    background Persister, against writing the same bytes sequentially with one fsync."""
    dcp_module()
    layout, rep = _replica(nparams, ntensors, 4, "adamw", "forloop", "float32")
    rep.apply(_iteration(layout, 0))
    sd = rep.state_dict_for_checkpoint()
    tensors = [v for v in [*sd["model"].values(), *(x for s in sd["optim"]["state"].values() for x in s.values())]
               if isinstance(v, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    scratch = tempfile.mkdtemp(prefix="bench-persist-", dir=directory)
    try:
        plain_s = plain_write_seconds(tensors, os.path.join(scratch, "plain.bin"))

        t = time.perf_counter()
        path = write_checkpoint(os.path.join(scratch, "sync"), sd)
        sync_s = time.perf_counter() - t
        t = time.perf_counter()
        report = verify(path)
        verify_s = time.perf_counter() - t
        on_disk = report.bytes
        shutil.rmtree(os.path.join(scratch, "sync"))

        # Background: the first submit allocates its staging buffer, the second reuses it.
        per = Persister(PersistSpec(os.path.join(scratch, "bg"), every_iterations=1, keep_last=1,
                                    memory_budget_bytes=nbytes + (64 << 20)))
        submit_s, bg_s = [], []
        for i in (1, 2):
            t = time.perf_counter()
            queued = per.submit(rep)
            submit_s.append(time.perf_counter() - t)
            per.flush()
            bg_s.append(time.perf_counter() - t)
            rep.apply(_iteration(layout, i))
        per.close()
        assert queued and per.stats.committed == 2, per.stats
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"nparams": layout.total_numel, "state_bytes": nbytes, "checkpoint_bytes": on_disk,
            "plain_write_s": plain_s, "plain_GBps": nbytes / plain_s / 1e9,
            "write_checkpoint_s": sync_s, "write_checkpoint_GBps": nbytes / sync_s / 1e9,
            "verify_s": verify_s, "verify_GBps": on_disk / verify_s / 1e9,
            "submit_cold_s": submit_s[0], "submit_warm_s": submit_s[1], "submit_warm_GBps": nbytes / submit_s[1] / 1e9,
            "background_commit_s": bg_s, "ratio_to_plain": plain_s / sync_s}


def run_all(nparams: int = 50_000_000) -> dict:
    return {
        "memory": memory_bandwidth(),
        "replica": [replica_update(nparams, impl=i, threads=t) for t in (1, 2) for i in ("forloop", "foreach", "fused")]
        + [replica_update(nparams, grad_dtype="bfloat16"), replica_update(nparams, pipelined=True)],
        "persist": persist_bandwidth(nparams),
    }


if __name__ == "__main__":
    print(json.dumps(run_all(int(sys.argv[1]) if len(sys.argv) > 1 else 50_000_000), indent=1))
