"""What PyTorch DDP (2.13, default options, no buffers) puts through the communicator, as data.

The parser uses this to know the job's collective sequence; the generator's emulation
(``tools/generator/ddp.py``) performs the same calls. Facts (torch 2.13 distributed.py,
c10d comm.cpp/reducer.cpp):

1. ``_verify_params_across_processes``: all-gather of each rank's parameter count (int64[1]),
   then a broadcast from rank 0 of every parameter's sizes then strides (int64).
2. ``_sync_module_states``: the parameters broadcast from rank 0 in groups of
   ``compute_bucket_assignment_by_size(params, [250 MiB])``, each group flattened.
3. Iteration 0: one bucket holding every parameter (limits ``[sys.maxsize]``).
4. Before iteration 1: ``sync_bucket_indices`` broadcasts from rank 0 int32
   ``[indices..., num_buckets]`` and int32 per-bucket parameter counts (the rebuilt layout).
5. Every iteration: one SUM all-reduce per bucket, in bucket order, in the gradient dtype.

What DDP's options change on the wire (Reducer, torch 2.13):

* ``bucket_cap_mb``: both caps become that value (``bucket_caps``); ``bucket_cap_mb_list``: the
  caps of iteration 0's buckets and of the rebuild are that list (``initial_buckets``,
  ``rebuilt_buckets`` with ``limits``). Same collectives, other counts: followed.
* ``gradient_as_bucket_view``: gradients are views of the buckets; nothing on the wire changes.
* ``find_unused_parameters`` (without ``static_graph``): iteration 0 is bucketed with the caps
  (``compute_bucket_size_limits``), the buckets are never rebuilt (no ``sync_bucket_indices``),
  and every iteration ends with one more all-reduce (``all_reduce_local_used_map``: int32 SUM,
  one element per parameter, the used-parameter map) issued once the last bucket's all-reduce is
  launched, on the process group itself, never through a DDP comm hook. A parameter whose map
  entry sums to 0 keeps ``grad=None`` (its bucket slot is zeros) and the optimizer skips it.
  Followed: ``JobLayout.used_map``; the trainer reports which parameters had no gradient.
* ``static_graph``: iteration 0's hooks only count; at the end of backward ``delay_all_reduce``
  issues the used-map all-reduce, then every bucket in bucket order (iteration 0's one bucket).
  No parameter is queued for the rebuild in iteration 0, so iteration 1 still runs iteration 0's
  layout; its ready order (the unused parameters last) is rebuilt before iteration 2. No used-map
  all-reduce after iteration 0. Not followed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec, dtype_size

MIB = 1024 * 1024
BROADCAST_BUCKET_BYTES = 250 * MIB  # DistributedDataParallel.broadcast_bucket_size
DEFAULT_BUCKET_CAP_MB = 25  # distributed._DEFAULT_BUCKET_CAP_MB
FIRST_BUCKET_BYTES = MIB  # dist._DEFAULT_FIRST_BUCKET_BYTES, used only with the default cap

ALLREDUCE, BROADCAST, ALLGATHER = "allreduce", "broadcast", "allgather"
REDUCESCATTER = "reducescatter"  # sharded optimizers' rings (config.shard_steps); never one of DDP's


@dataclass(frozen=True)
class CollSpec:
    """One collective of the job, in issue order."""

    kind: str  # allreduce | broadcast | allgather | reducescatter
    count: int  # elements (all-gather: per rank)
    dtype: str
    label: str  # grad | param_count | shapes | init_params:K | rebuild_indices | rebuild_sizes | ...
    root: int = 0  # broadcast root (global rank)
    iteration: int | None = None
    bucket: int | None = None
    protocol: str | None = None  # None: the ring's protocol


def reducer_params(model) -> list:
    """DDP's parameter list: named_modules order, each module's own parameters that require grad,
    shared ones once; with the names named_parameters() gives them. [(name, parameter)]"""
    out, seen = [], set()
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if p.requires_grad and p not in seen:
                seen.add(p)
                out.append((f"{mname}.{pname}" if mname else pname, p))
    return out


def size_groups(nbytes: list[int], limit: int) -> list[list[int]]:
    """c10d's compute_bucket_assignment_by_size for one dtype and one limit: tensors join the
    open group in order, and a group closes once its size reaches the limit."""
    out, cur, size = [], [], 0
    for i, n in enumerate(nbytes):
        cur.append(i)
        size += n
        if size >= limit:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def bucket_caps(bucket_cap_mb: float | None) -> tuple[int, int]:
    """(bucket_bytes_cap, first_bucket_bytes_cap) as _BucketCapacityConfig.create computes them:
    a user value is used for both caps; only the default keeps the 1 MiB first bucket."""
    if bucket_cap_mb is None:
        return int(DEFAULT_BUCKET_CAP_MB * MIB), FIRST_BUCKET_BYTES
    cap = int(bucket_cap_mb * MIB)
    return cap, cap


def assign_buckets(tensors: Sequence, limits: Sequence[int], indices: Sequence[int] | None = None) -> list[list[int]]:
    """torch's own compute_bucket_assignment_by_size (sorted by minimum index only when
    ``indices`` is not given, as in the C++)."""
    import torch.distributed as dist

    buckets, _ = dist._compute_bucket_assignment_by_size(list(tensors), list(limits), [], list(indices or []))
    return [list(b) for b in buckets]


USED_MAP = "used_map"  # CollSpec label of find_unused_parameters' used-parameter map all-reduce

UNFOLLOWED = {
    "static_graph": "iteration 0's all-reduces wait for the end of backward and start with an extra one (the int32 "
                    "used-parameter map), and the bucket rebuild comes before iteration 2, not 1",
}


def unfollowed_option(find_unused_parameters: bool, static_graph: bool) -> str | None:
    """The DDP option (of these two) whose collectives the appliance does not follow, or None
    (find_unused_parameters is followed: ``used_map_buckets``, ``iteration``)."""
    return "static_graph" if static_graph else None


def used_map_buckets(params: Sequence, cap: int, first_cap: int,
                     limits: Sequence[int] | None = None) -> list[list[int]]:
    """find_unused_parameters' buckets, every iteration: compute_bucket_size_limits' caps
    ([first_cap, cap] when the first is smaller, else [cap]; bucket_cap_mb_list's ``limits``),
    reversed as DDP reverses them, never rebuilt."""
    caps = list(limits) if limits else ([first_cap, cap] if first_cap < cap else [cap])
    return initial_buckets(params, caps)


def initial_buckets(params: Sequence, limits: Sequence[int] | None = None) -> list[list[int]]:
    """Iteration 0's buckets. compute_bucket_size_limits gives [sys.maxsize] when
    find_unused_parameters=False, else bucket_cap_mb_list's ``limits``; DDP reverses the assignment."""
    return list(reversed(assign_buckets(params, list(limits or [sys.maxsize]))))


def rebuilt_buckets(params: Sequence, ready_order: Sequence[int], cap: int, first_cap: int,
                    limits: Sequence[int] | None = None) -> list[list[int]]:
    """The buckets from iteration 1 on: parameters in first-backward ready order, DDP's caps
    (bucket_cap_mb_list's ``limits`` when given)."""
    return assign_buckets([params[i] for i in ready_order], list(limits or [first_cap, cap]), ready_order)


def broadcast_groups(layout: JobLayout) -> list[list[int]]:
    """Parameter index groups of ``_sync_module_states``' coalesced broadcasts."""
    es = dtype_size(layout.grad_dtype)
    return size_groups([p.numel * es for p in layout.params], BROADCAST_BUCKET_BYTES)


def startup(layout: JobLayout) -> list[CollSpec]:
    """DDP construction: parameter-count all-gather, shapes broadcast, parameter broadcasts."""
    ndims = sum(len(p.shape) for p in layout.params)
    out = [
        CollSpec(ALLGATHER, 1, "int64", "param_count"),
        CollSpec(BROADCAST, 2 * ndims, "int64", "shapes"),
    ]
    for k, g in enumerate(broadcast_groups(layout)):
        out.append(CollSpec(BROADCAST, sum(layout.params[i].numel for i in g), layout.grad_dtype,
                            f"init_params:{k}"))
    return out


def rebuild(layout: JobLayout) -> list[CollSpec]:
    """The two broadcasts of ``sync_bucket_indices`` before iteration 1."""
    return [
        CollSpec(BROADCAST, len(layout.params) + 1, "int32", "rebuild_indices"),
        CollSpec(BROADCAST, len(layout.buckets), "int32", "rebuild_sizes"),
    ]


def iteration(layout: JobLayout, i: int) -> list[CollSpec]:
    """Iteration ``i``'s collectives: one all-reduce per bucket, then with find_unused_parameters
    the used-parameter map (int32, one element per parameter)."""
    out = [CollSpec(ALLREDUCE, layout.bucket_count(b), layout.grad_dtype, "grad", iteration=i, bucket=k)
           for k, b in enumerate(layout.bucket_list(i))]
    if layout.used_map:
        out.append(CollSpec(ALLREDUCE, len(layout.params), "int32", USED_MAP, iteration=i))
    return out


# -- reading DDP's payloads back -------------------------------------------------------------


# PyTorch's limit on a tensor's dimensions: bounds a parameter's entry in the shapes broadcast
MAX_TENSOR_DIMS = 64
# parse_shapes' budget of segment tries per value: a real payload takes at most a tensor's dimensions
# per parameter (two values at least), a little more where size-1 dimensions make splits ambiguous
PARSE_TRIES_PER_VALUE = MAX_TENSOR_DIMS // 2


def parse_shapes(meta: np.ndarray, count: int | None = None) -> list[tuple[int, ...]]:
    """Parameter shapes from the int64 sizes-then-strides payload.

    Each parameter is ``dims`` sizes followed by ``dims`` contiguous strides; the split is found
    by backtracking so the whole payload parses into exactly ``count`` parameters (the count the
    all-gather carried). Size-1 dimensions can make two splits valid, e.g. (7, 1)+(1,) and
    (7,)+(1, 1); the one with more dimensions first is taken: the element counts, which are what
    place gradients, agree in every valid split of the same count."""
    vals = [int(v) for v in meta]

    def contiguous(shape):
        st, acc = [], 1
        for s in reversed(shape):
            st.append(acc)
            acc *= max(s, 1)
        return tuple(reversed(st))

    dead: set = set()  # (pos, left) that parse no further: garbage (another collective's bytes)
    # would otherwise be walked again from every way of reaching it, exponentially often
    budget = [PARSE_TRIES_PER_VALUE * len(vals) + 1024]  # a real payload parses in a few tries a value

    def walk(pos, left):
        if pos == len(vals):
            return [] if left in (None, 0) else None
        if left == 0 or (pos, left) in dead or (left is not None and 2 * left > len(vals) - pos):
            return None  # (a parameter takes two values at least)
        for d in range(min((len(vals) - pos) // 2, MAX_TENSOR_DIMS), 0, -1):
            budget[0] -= 1
            if budget[0] < 0:
                raise ValueError(f"int64 payload of {len(vals)} values: too irregular for DDP's sizes-and-strides "
                                 "list")
            if vals[pos + 2 * d - 1] != 1:  # a contiguous tensor's last stride
                continue
            shape = tuple(vals[pos:pos + d])
            if any(s < 0 for s in shape) or tuple(vals[pos + d:pos + 2 * d]) != contiguous(shape):
                continue
            rest = walk(pos + 2 * d, None if left is None else left - 1)
            if rest is not None:
                return [shape] + rest
        dead.add((pos, left))
        return None

    if len(vals) > 4096:
        raise ValueError("shape payload too long to parse")
    shapes = walk(0, count)
    if shapes is None:
        raise ValueError(f"int64 payload of {len(vals)} values is not DDP's sizes-and-strides list"
                         + (f" of {count} parameters" if count is not None else ""))
    return shapes


def parse_rebuild(indices: np.ndarray, sizes: np.ndarray, nparams: int) -> list[BucketSpec]:
    """The rebuilt bucket layout from sync_bucket_indices' two payloads (validated)."""
    idx = [int(v) for v in indices]
    if not idx or idx[-1] != len(sizes) or sum(int(s) for s in sizes) != len(idx) - 1:
        raise ValueError("rebuild broadcasts disagree: bucket count or sizes do not match the indices")
    flat = idx[:-1]
    if sorted(flat) != list(range(nparams)):
        raise ValueError(f"rebuild indices are not a permutation of the {nparams} parameters")
    out, pos = [], 0
    for n in sizes:
        out.append(BucketSpec(tuple(flat[pos:pos + int(n)])))
        pos += int(n)
    return out


def layout_from_wire(shapes: list[tuple[int, ...]], grad_dtype: str,
                     names: list[str] | None = None) -> JobLayout:
    """A layout known from the start-up broadcasts: DDP's one-bucket first iteration, parameters
    in order; the rebuilt buckets are filled in later from the rebuild broadcasts."""
    names = names or [f"param{i}" for i in range(len(shapes))]
    params = [ParamSpec(n, tuple(s), "float32") for n, s in zip(names, shapes)]
    one = [BucketSpec(tuple(range(len(params))))]
    return JobLayout(params=params, buckets=list(one), first_buckets=list(one), grad_dtype=grad_dtype)
