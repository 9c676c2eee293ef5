"""What PyTorch 2.13 DistributedDataParallel puts on the wire, replayed for R simulated ranks.

Default DDP options only: NCCL-style SUM all-reduce without comm hook, find_unused_parameters=False,
gradient_as_bucket_view=False, static_graph=False, no buffers, no ignored parameters. Facts, from
torch/nn/parallel/distributed.py of the 2.13 wheel and c10d reducer.cpp / comm.cpp:

* construction: ``_verify_params_across_processes`` all-gathers each rank's parameter count
  (int64[1]) and broadcasts from rank 0 the sizes then strides of every parameter (int64); then
  ``_sync_module_states`` broadcasts the parameters from rank 0 with ``broadcast_coalesced``:
  grouped by ``compute_bucket_assignment_by_size(params, [250 MiB])`` (per dtype; a group closes
  once it reaches the limit) and flattened, one broadcast per group;
* first iteration: buckets from ``compute_bucket_assignment_by_size(params, [sys.maxsize])``,
  reversed (one bucket holding every parameter in ``named_parameters`` order);
* each rank copies its gradient into the bucket as ``mul_out(view, grad, 1.0 / world_size)`` and
  the flat bucket is SUM all-reduced; buckets are issued in bucket index order; afterwards every
  parameter's ``.grad`` is a copy of its slice of the reduced bucket;
* at the start of the second iteration's forward, ``rebuild_buckets`` re-buckets the parameters
  in the order their gradients became ready in the first backward (rank 0's order is the one that
  counts), with limits ``[first_bucket_bytes_cap, bucket_bytes_cap]`` and *no* sorting, then
  ``sync_bucket_indices`` broadcasts from rank 0 an int32 ``[indices..., num_buckets]`` and an
  int32 tensor of per-bucket parameter counts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from mirrorckpt.config.ddp import (
    BROADCAST_BUCKET_BYTES,
    assign_buckets,
    bucket_caps,
    initial_buckets,
    rebuilt_buckets,
    reducer_params,
)
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec
from torch import nn

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.int32: "int32", torch.int64: "int64", torch.float64: "float64", torch.uint8: "uint8"}
TORCH_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"no wire name for {dtype}") from None


def to_wire(t: torch.Tensor) -> np.ndarray:
    """``t`` flattened as the numpy array the Comm carries (bfloat16 as uint16 bits); shares
    memory with a contiguous ``t``, so pass a tensor nobody changes afterwards."""
    t = t.detach().reshape(-1).contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_wire(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The flat tensor of ``dtype`` held by wire array ``a``; shares memory with a writable ``a``."""
    a = np.ascontiguousarray(a)
    if not a.flags.writeable:
        a = a.copy()
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a).to(dtype)


def shape_metadata(params: Sequence[torch.Tensor]) -> np.ndarray:
    """verify_params_across_processes' int64 payload: per parameter its sizes, then its strides."""
    vals: list[int] = []
    for p in params:
        vals.extend(p.shape)
        vals.extend(p.stride())
    return np.array(vals, dtype=np.int64)


def sync_indices_payloads(buckets: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """sync_bucket_indices' two int32 payloads: [indices..., num_buckets] and per-bucket counts."""
    flat = [i for b in buckets for i in b] + [len(buckets)]
    return np.array(flat, dtype=np.int32), np.array([len(b) for b in buckets], dtype=np.int32)


def buckets_from_payloads(indices: np.ndarray, sizes: np.ndarray) -> list[list[int]]:
    out, pos = [], 0
    for n in sizes.tolist():
        out.append(indices[pos:pos + n].tolist())
        pos += n
    return out


class DDP:
    """One model shared by ``world_size`` simulated ranks; talks to the others through ``comm``.

    Construction issues DDP's start-up collectives. Per iteration: ``begin_iteration(i)`` (the
    forward pre-hook: bucket rebuild before iteration 1), ``record_ready_order()`` around rank 0's
    first backward, and ``reduce(i, per_rank_grads)``.
    """

    def __init__(self, model: nn.Module, world_size: int, comm, bucket_cap_mb: float | None = None):
        if world_size < 2:
            raise ValueError(f"DDP needs at least 2 ranks, got {world_size}")
        if list(model.named_buffers()):
            raise ValueError("models with buffers are not supported (DDP would broadcast them every iteration)")
        self.model = model
        self.world_size = world_size
        self.comm = comm
        self.bucket_cap_mb = bucket_cap_mb
        named = reducer_params(model)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"all parameters must share one dtype, got {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.verify_params()
        self.sync_module_states()
        self.first_buckets = initial_buckets(self.params)
        self.buckets = self.first_buckets
        self.ready_order: list[int] | None = None
        self.rebuilt = False

    # -- construction -------------------------------------------------------------------------

    def verify_params(self) -> None:
        counts = [np.array([len(self.params)], dtype=np.int64)] * self.world_size
        gathered = self.comm.all_gather(counts, "param_count")
        if any(int(c[0]) != len(self.params) for c in gathered):
            raise RuntimeError(f"ranks disagree on the parameter count: {[int(c[0]) for c in gathered]}")
        meta = shape_metadata(self.params)
        got = self.comm.broadcast(meta, 0, "shapes")
        if not np.array_equal(got, meta):
            raise RuntimeError("rank 0's parameter shapes differ from this model's")

    def sync_module_states(self) -> None:
        states = [p.detach() for _, p in self.model.named_parameters()]
        for k, group in enumerate(assign_buckets(states, [BROADCAST_BUCKET_BYTES])):
            tensors = [states[i] for i in group]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            got = from_wire(self.comm.broadcast(to_wire(flat), 0, f"init_params:{k}"), flat.dtype)
            pos = 0
            with torch.no_grad():
                for t in tensors:
                    t.copy_(got[pos:pos + t.numel()].view(t.shape))
                    pos += t.numel()

    # -- iterations ---------------------------------------------------------------------------

    @contextmanager
    def record_ready_order(self) -> Iterator[None]:
        """Record the order gradients become ready (AccumulateGrad post hooks, as the Reducer's
        autograd_hook sees them) during the first backward; later calls record nothing."""
        if self.ready_order is not None or self.rebuilt:
            yield
            return
        order: list[int] = []
        handles = [p.register_post_accumulate_grad_hook(lambda _p, i=i: order.append(i))
                   for i, p in enumerate(self.params)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        if sorted(order) != list(range(len(self.params))):
            raise RuntimeError(f"first backward marked {len(order)} gradients ready, "
                               f"expected each of {len(self.params)} once (unused parameters?)")
        self.ready_order = order

    def begin_iteration(self, index: int) -> None:
        """DDP's forward pre-hook: the one bucket rebuild, once the first backward has run."""
        if index > 0 and not self.rebuilt:
            if self.ready_order is None:
                raise RuntimeError("bucket rebuild needs the first backward's ready order")
            self.rebuild()

    def rebuild(self) -> None:
        mine = rebuilt_buckets(self.params, self.ready_order, *bucket_caps(self.bucket_cap_mb))
        indices, sizes = sync_indices_payloads(mine)
        got_indices = self.comm.broadcast(indices, 0, "rebuild_indices")
        got_sizes = self.comm.broadcast(sizes, 0, "rebuild_sizes")
        self.buckets = buckets_from_payloads(got_indices, got_sizes)
        self.rebuilt = True

    def bucket_slices(self, bucket: Sequence[int]) -> list[tuple[int, int, int]]:
        out, pos = [], 0
        for i in bucket:
            n = self.params[i].numel()
            out.append((i, pos, pos + n))
            pos += n
        return out

    def reduce(self, index: int, per_rank_grads: Sequence[Sequence[torch.Tensor]]) -> list[np.ndarray]:
        """All-reduce rank gradients (per rank, in parameter order) bucket by bucket; set each
        parameter's .grad to its reduced slice; return the reduced flat buckets (wire arrays)."""
        if len(per_rank_grads) != self.world_size:
            raise ValueError(f"expected gradients of {self.world_size} ranks, got {len(per_rank_grads)}")
        scale = 1.0 / self.world_size  # Reducer: wrapped_scalar_tensor(double(1.) / div_factor_)
        reduced = []
        for b, bucket in enumerate(self.buckets):
            slices = self.bucket_slices(bucket)
            per_rank = []
            for grads in per_rank_grads:
                flat = torch.empty(slices[-1][2], dtype=self.dtype)
                for i, start, stop in slices:
                    torch.mul(grads[i], scale, out=flat[start:stop].view(self.params[i].shape))
                per_rank.append(to_wire(flat))
            out = self.comm.all_reduce(per_rank, f"grad:iter={index}:bucket={b}")
            flat_out = from_wire(out, self.dtype)
            for i, start, stop in slices:
                self.params[i].grad = flat_out[start:stop].view(self.params[i].shape).clone()
            reduced.append(out)
        return reduced

    # -- description --------------------------------------------------------------------------

    def layout(self, master_dtype: str = "float32") -> JobLayout:
        """The JobLayout of this job; before the rebuild, the rebuilt buckets it will use."""
        if self.rebuilt:
            after = self.buckets
        elif self.ready_order is not None:
            after = rebuilt_buckets(self.params, self.ready_order, *bucket_caps(self.bucket_cap_mb))
        else:
            raise RuntimeError("the rebuilt layout is known only after the first backward")
        first = [BucketSpec(tuple(b)) for b in self.first_buckets]
        buckets = [BucketSpec(tuple(b)) for b in after]
        return JobLayout(
            params=[ParamSpec(n, tuple(p.shape), master_dtype) for n, p in zip(self.names, self.params)],
            buckets=buckets,
            first_buckets=first,  # always explicit: DDP 2.13's first iteration has its own layout
            grad_dtype=dtype_name(self.dtype),
        )
