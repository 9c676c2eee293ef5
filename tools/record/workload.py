"""One rank of the recorder's workload: a DDP-shaped training job whose every collective is recorded.

The rank issues what PyTorch 2.13 DDP puts through its communicator (``config.ddp``: the
parameter-count all-gather, the shapes broadcast, the parameter broadcasts, iteration 0's one
bucket, the bucket-index broadcasts of the rebuild, then one SUM all-reduce per bucket), with the
generator's models and data shards (``tools.generator.models``), and an Adam step on fp32 masters.
It writes ``rank<R>.json``: per collective its input and result sha256 as this rank saw them
(``tools.record.truth`` merges the ranks into truth.json).

Backends: ``gloo`` (torch.distributed over TCP, CPU tensors; the CPU tests' stand-in) and
``nccl`` (a ``libnccl.so.2`` through ``tools.record.nccl``, CUDA tensors on the one visible GPU).

Run: ``python -m mirrorckpt.tools.record.workload --rank R --world W --master ADDR --out DIR
--backend gloo|nccl [--nccl-lib PATH]``, in the rank's namespace, with the environment the
recorder sets (GLOO_SOCKET_IFNAME or NCCL_*).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from datetime import timedelta
from pathlib import Path

import torch
from mirrorckpt.config.ddp import (
    BROADCAST_BUCKET_BYTES,
    assign_buckets,
    bucket_caps,
    initial_buckets,
    rebuilt_buckets,
    reducer_params,
)
from mirrorckpt.tools.generator import models
from mirrorckpt.tools.generator.ddp import buckets_from_payloads, dtype_name, shape_metadata, sync_indices_payloads
from mirrorckpt.tools.generator.train import TORCH_GRAD_DTYPES
from mirrorckpt.tools.generator.truth import INITIAL_PARAMS_FILE, params_bytes
from mirrorckpt.updater.fingerprint import state_sha256, tensor_bytes

STORE_PORT = 29500  # torch.distributed's default MASTER_PORT: gloo's replay finds rank 0 by it
RANK_FILE = "rank{rank}.json"


def sha256_of(t: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


class GlooComm:
    """torch.distributed's gloo process group (TCP rendezvous on the master's STORE_PORT)."""

    name = "gloo"

    def __init__(self, rank: int, world: int, master: str, timeout_s: float):
        import torch.distributed as dist

        self.dist = dist
        dist.init_process_group("gloo", init_method=f"tcp://{master}:{STORE_PORT}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        self.device = torch.device("cpu")
        self.version = f"gloo (torch {torch.__version__})"

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        out = [torch.empty_like(t) for _ in range(self.dist.get_world_size())]
        self.dist.all_gather(out, t)
        return torch.cat(out)

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        self.dist.broadcast(t, root)

    def all_reduce(self, t: torch.Tensor) -> None:
        self.dist.all_reduce(t)

    def close(self) -> None:
        self.dist.destroy_process_group()


class NcclComm:
    """A communicator of the given ``libnccl.so.2``; the unique id goes through a TCPStore on
    the master. Every call is synchronised before its result is read."""

    name = "nccl"

    def __init__(self, rank: int, world: int, master: str, timeout_s: float, lib_path: str):
        import torch.distributed as dist
        from mirrorckpt.tools.record.nccl import Library

        if not torch.cuda.is_available():
            raise RuntimeError("the nccl backend needs a CUDA GPU (torch.cuda.is_available() is False)")
        self.device = torch.device("cuda", 0)
        torch.cuda.set_device(self.device)
        self.lib = Library(lib_path)
        self.version = self.lib.version
        store = dist.TCPStore(master, STORE_PORT, world, is_master=rank == 0,
                              timeout=timedelta(seconds=timeout_s))
        if rank == 0:
            store.set("nccl_unique_id", self.lib.unique_id())
        uid = store.get("nccl_unique_id")
        self.store = store  # rank 0 serves the id until every rank has read it
        self.comm = self.lib.communicator(world, uid, rank)
        self.world = world

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    @staticmethod
    def _dtype(t: torch.Tensor) -> str:
        return dtype_name(t.dtype)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.world * t.numel(), dtype=t.dtype, device=self.device)
        self.comm.all_gather(t.data_ptr(), out.data_ptr(), t.numel(), self._dtype(t), self._stream())
        torch.cuda.synchronize(self.device)
        return out

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        self.comm.broadcast(t.data_ptr(), t.numel(), self._dtype(t), root, self._stream())
        torch.cuda.synchronize(self.device)

    def all_reduce(self, t: torch.Tensor) -> None:
        self.comm.all_reduce(t.data_ptr(), t.numel(), self._dtype(t), self._stream())
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.comm.destroy()


class RecordingRank:
    """Issues collectives through ``comm`` and records, per collective, what this rank put in
    and what came back."""

    def __init__(self, comm, rank: int):
        self.comm, self.rank = comm, rank
        self.records: list[dict] = []

    def _add(self, kind: str, what: str, t: torch.Tensor, before: str, result: torch.Tensor) -> None:
        self.records.append({"index": len(self.records), "kind": kind, "what": what, "dtype": dtype_name(t.dtype),
                             "count": t.numel(), "input_sha256": before, "sha256": sha256_of(result)})

    def all_gather(self, t: torch.Tensor, what: str) -> torch.Tensor:
        before = sha256_of(t)
        out = self.comm.all_gather(t)
        self._add("all_gather", what, t, before, out)
        return out

    def broadcast(self, t: torch.Tensor, what: str) -> None:
        before = sha256_of(t)
        self.comm.broadcast(t, 0)
        self._add("broadcast", what, t, before, t)

    def all_reduce(self, t: torch.Tensor, what: str) -> None:
        before = sha256_of(t)
        self.comm.all_reduce(t)
        self._add("all_reduce", what, t, before, t)


def train(comm, rank: int, world: int, a) -> dict:
    """The DDP-shaped job on this rank; returns what ``rank<R>.json`` holds."""
    device = comm.device
    dtype = TORCH_GRAD_DTYPES[a.dtype]
    spec = models.parse_spec(a.model)
    model = models.build_model(spec, a.seed + rank).to(dtype).to(device)  # per rank: the broadcast must fix it
    if list(model.named_buffers()):
        raise ValueError(f"model {a.model}: buffers would be broadcast every iteration")
    rec = RecordingRank(comm, rank)
    named = reducer_params(model)
    names, params = [n for n, _ in named], [p for _, p in named]

    # construction: verify_params_across_processes, then _sync_module_states
    count = torch.tensor([len(params)], dtype=torch.int64, device=device)
    got = rec.all_gather(count, "param_count")
    if any(int(c) != len(params) for c in got.cpu()):
        raise RuntimeError(f"ranks disagree on the parameter count: {got.tolist()}")
    rec.broadcast(torch.from_numpy(shape_metadata(params)).to(device), "shapes")
    states = [p.detach() for _, p in model.named_parameters()]
    for k, group in enumerate(assign_buckets(states, [BROADCAST_BUCKET_BYTES])):
        flat = torch.cat([states[i].reshape(-1) for i in group])
        rec.broadcast(flat, f"init_params:{k}")
        pos = 0
        with torch.no_grad():
            for i in group:
                states[i].copy_(flat[pos:pos + states[i].numel()].view(states[i].shape))
                pos += states[i].numel()
    if rank == 0:  # the weights every rank now holds, as DDP broadcast them
        (Path(a.out) / INITIAL_PARAMS_FILE).write_bytes(params_bytes(params))

    low = dtype != torch.float32
    masters = [p.detach().float().clone() for p in params] if low else params
    opt = torch.optim.Adam(masters, lr=a.lr, foreach=False)
    buckets = initial_buckets(params)
    first_buckets = buckets
    ready: list[int] = []
    iterations = []
    for it in range(a.steps):
        if it == 1:  # DDP's forward pre-hook of the second iteration: the one rebuild
            mine = rebuilt_buckets(params, ready, *bucket_caps(a.bucket_cap_mb))
            indices, sizes = (torch.from_numpy(x).to(device) for x in sync_indices_payloads(mine))
            rec.broadcast(indices, "rebuild_indices")
            rec.broadcast(sizes, "rebuild_sizes")
            buckets = buckets_from_payloads(indices.cpu().numpy(), sizes.cpu().numpy())
        x, y = (z.to(device) for z in models.make_batch(spec, a.seed, rank, it, a.batch_size, dtype))
        model.zero_grad(set_to_none=True)
        out = model(x)
        if low:
            out, y = out.float(), (y.float() if y.is_floating_point() else y)
        loss = models.compute_loss(spec, out, y)
        hooks = [p.register_post_accumulate_grad_hook(lambda _p, i=i: ready.append(i))
                 for i, p in enumerate(params)] if it == 0 else []
        loss.backward()
        for h in hooks:
            h.remove()
        reduced = []
        for b, bucket in enumerate(buckets):
            sizes_b = [params[i].numel() for i in bucket]
            flat = torch.empty(sum(sizes_b), dtype=dtype, device=device)
            pos = 0
            for i, n in zip(bucket, sizes_b):  # the Reducer's mul_out(view, grad, 1 / world_size)
                torch.mul(params[i].grad, 1.0 / world, out=flat[pos:pos + n].view(params[i].shape))
                pos += n
            rec.all_reduce(flat, f"grad:iter={it}:bucket={b}")
            pos = 0
            for i, n in zip(bucket, sizes_b):
                params[i].grad = flat[pos:pos + n].view(params[i].shape).clone()
                pos += n
            reduced.append(rec.records[-1]["sha256"])
        if low:
            for m, p in zip(masters, params):
                m.grad = p.grad.float()
        lr = float(opt.param_groups[0]["lr"])
        opt.step()
        if low:
            with torch.no_grad():
                for m, p in zip(masters, params):
                    p.copy_(m)
        psha, osha = state_sha256(masters, opt)
        iterations.append({"index": it, "step": it + 1, "lr": lr, "loss": float(loss.detach()),
                           "buckets_sha256": reduced, "params_sha256": psha, "optim_sha256": osha})
    return {
        "rank": rank, "world": world, "backend": comm.name, "library": comm.version,
        "names": names, "shapes": [list(p.shape) for p in params], "grad_dtype": a.dtype,
        "first_buckets": [list(b) for b in first_buckets], "buckets": [list(b) for b in buckets],
        "collectives": rec.records, "iterations": iterations,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", choices=["gloo", "nccl"], required=True)
    ap.add_argument("--nccl-lib", default="")
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--dtype", choices=sorted(TORCH_GRAD_DTYPES), default="float32")
    ap.add_argument("--bucket-cap-mb", type=float, default=None)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--timeout", type=float, default=120.0)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.monotonic()
    comm = GlooComm(a.rank, a.world, a.master, a.timeout) if a.backend == "gloo" else \
        NcclComm(a.rank, a.world, a.master, a.timeout, a.nccl_lib)
    print(f"rank {a.rank}: {comm.version} communicator in {time.monotonic() - t0:.2f} s", flush=True)
    result = train(comm, a.rank, a.world, a)
    comm.close()
    (Path(a.out) / RANK_FILE.format(rank=a.rank)).write_text(json.dumps(result, indent=1) + "\n")
    print(f"rank {a.rank}: {len(result['collectives'])} collectives in {time.monotonic() - t0:.2f} s", flush=True)


if __name__ == "__main__":
    main()
