"""Layouts of sharded-optimizer jobs from each framework's partition rules (the facts and where
they were read: ../shared/docs/sharded-optimizers.md). Each builder returns a
``config.shards.ShardedLayout`` with one group per optimizer shard index: the slices that index
holds, the ranks of the ring whose all-reduce carries its fully reduced gradient, the appliance
that follows it, and that all-reduce's flat buffer (``DpGroup.wire``: padding included). A job
whose finished gradient never crosses the wire gets ``refusal``: the reason, and the setting that
makes the job followable (``control.sharded.attach_sharded`` refuses it).

- ``hsdp``: FSDP2 ``fully_shard`` on a (replicate, shard) mesh. Each parameter is cut on dim 0
  as ``torch.chunk`` cuts it (ceil-sized rows; shard k holds rows k*c .. min((k+1)*c, n)); a
  ``fully_shard`` unit reduce-scatters one flat buffer per rank (each parameter's shard padded to
  c rows, in the unit's parameter order), then all-reduces that buffer over the replicate group
  (ncclAvg): shard k's ring is mesh column k. A 1-d shard mesh (pure FSDP) is refused.
- ``zero``: DeepSpeed ZeRO-1/2. Each optimizer param group is flattened (its parameters in order,
  or round robin over the ranks with ``round_robin_gradients``), padded to a multiple of 2*dp
  elements and cut into dp equal partitions: partition r holds flat ranges of the parameters it
  overlaps. Gradients fill one bucket of up to ``reduce_bucket_size`` elements in the order they
  become ready; with the defaults (``reduce_scatter``, ``use_multi_rank_bucket_allreduce``) each
  bucket, divided by dp first, is all-reduced whole over the DP group and every rank keeps its
  slices: all partitions share the one ring. ``use_multi_rank_bucket_allreduce=False`` reduces
  each slice to its owner instead and is refused.
- ``megatron``: Megatron-core's distributed optimizer. The gradient buffer holds the parameters in
  reverse order, each starting at a multiple of 64 elements; a bucket closes once it holds
  ``bucket_size`` elements and its end is padded to a multiple of lcm(D, 128) (lcm(D, 128, 2^16)
  with ``pad_buckets_for_high_nccl_busbw``), D the ranks of one optimizer instance; each bucket is
  cut into D equal shards. Instance i is DP ranks i*D .. i*D+D-1; a bucket's shard r is
  reduce-scattered within the instance, then all-reduced across the instances: shard r's ring is
  rank r of every instance. One instance is refused.

Shared-embedding buckets (Megatron), MoE expert groups, ZeRO-3 and TP/PP inside these builders
are not modelled.
"""

from __future__ import annotations

import math

from mirrorckpt.config.layout import ParamSpec
from mirrorckpt.config.shards import PAD, DpGroup, Shard, ShardedLayout, group_name, tp_range

ZERO_ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor: partitions start 4-byte aligned in fp16
MEGATRON_PARAM_ALIGN = 64  # parameters start at 128-byte addresses in 16-bit buffers
MEGATRON_BUCKET_ALIGN = 128
MEGATRON_BUSBW_ALIGN = 1 << 16


def _ceil_to(n: int, k: int) -> int:
    return -(-n // k) * k


def _names(shards: int) -> list[str]:
    return [group_name(0, 0, k if shards > 1 else None) for k in range(shards)]


def _appliances(names: list[str], appliances: list[str] | None) -> list[str]:
    """The appliance that follows each group: round robin over ``appliances`` (default one each)."""
    names_of = list(appliances) if appliances else [f"appliance-{i}" for i in range(len(names))]
    return [names_of[k % len(names_of)] for k in range(len(names))]


def _by_name(params: list[ParamSpec], names: list[str], what: str) -> list[ParamSpec]:
    index = {p.name: p for p in params}
    unknown = [n for n in names if n not in index]
    if unknown:
        raise ValueError(f"{what} names {unknown[0]}, not a parameter of the model")
    return [index[n] for n in names]


def _partition(lists: list[list[str]], params: list[ParamSpec], what: str) -> list[list[ParamSpec]]:
    """``lists`` of FQNs as ParamSpecs; every parameter in exactly one of them."""
    out = [_by_name(params, names, what) for names in lists]
    flat = [p.name for part in out for p in part]
    if sorted(flat) != sorted(p.name for p in params) or len(set(flat)) != len(flat):
        raise ValueError(f"the {what} must hold every parameter exactly once")
    return out


def _layout(params, groups, *, dp, shards, scheme, average, refusal, appliances, steps=None) -> ShardedLayout:
    return ShardedLayout(1, 1, dp, list(params), groups, list(dict.fromkeys(appliances)), shards=shards,
                         scheme=scheme, average=average, refusal=refusal, steps=steps)


# ------------------------------------------------------------------------------------ FSDP2

def hsdp(params: list[ParamSpec], replicate: int, shard: int, *, units: list[list[str]] | None = None,
         ranks: list[list[int]] | None = None, appliances: list[str] | None = None) -> ShardedLayout:
    """FSDP2 on a (replicate, shard) mesh. ``units``: each ``fully_shard`` unit's parameters (in
    its order), in the order their gradients are reduced (default: one unit, the model's order);
    ``ranks``: the mesh's global ranks, [replicate][shard] (default row-major)."""
    ranks = ranks if ranks is not None else [[r * shard + s for s in range(shard)] for r in range(replicate)]
    if [len(row) for row in ranks] != [shard] * replicate:
        raise ValueError(f"mesh ranks {ranks} are not {replicate} x {shard}")
    unit_params = _partition(units if units is not None else [[p.name for p in params]], params, "FSDP units")
    names = _names(shard)
    follows = _appliances(names, appliances)
    groups = []
    for k, name in enumerate(names):
        slices, index = [], {}
        for p in params:
            if not p.shape:
                raise ValueError(f"{p.name}: a 0-d parameter; FSDP2 shards dim 0")
            start, rows = tp_range(p.shape[0], shard, k)
            if rows == 0:
                raise ValueError(f"{p.name}: dim 0 of size {p.shape[0]} leaves FSDP shard {k} of {shard} empty "
                                 "(a shard index holding no rows of a parameter is not supported)")
            index[p.name] = len(slices)
            slices.append(Shard(p.name, tuple(p.shape), 0 if shard > 1 else None,
                                (start,) + (0,) * (len(p.shape) - 1), (rows,) + tuple(p.shape[1:]), p.dtype))
        wire = []
        for unit in unit_params:
            segments = []
            for p in unit:
                inner = math.prod(p.shape[1:])
                rows = slices[index[p.name]].shape[0]
                segments.append((index[p.name], rows * inner))
                pad = (math.ceil(p.shape[0] / shard) - rows) * inner  # FSDP2 pads every shard to c rows
                if pad:
                    segments.append((PAD, pad))
            wire.append(segments)
        groups.append(DpGroup(name, 0, 0, [ranks[r][k] for r in range(replicate)], follows[k], slices,
                              k if shard > 1 else 0, wire))
    refusal = None
    if replicate < 2:
        refusal = (f"pure FSDP (fully_shard on a 1-d mesh of {shard} ranks) reduce-scatters its gradients: the "
                   "finished shard never crosses the wire (its owner adds its own part locally), so the optimizer "
                   "state cannot be followed exactly; train on a 2-d (replicate, shard) mesh with dp_replicate >= 2 "
                   "(HSDP), whose replicate all-reduce carries each shard's reduced gradient")
    return _layout(params, groups, dp=replicate, shards=shard, scheme="fsdp2", average="avg", refusal=refusal,
                   appliances=follows)


# ------------------------------------------------------------------------------------ ZeRO-1/2

def _round_robin(order: list[ParamSpec], dp: int) -> list[ParamSpec]:
    """DeepSpeed's round_robin_gradients order: parameters i, i+dp, i+2dp... for i = 0 .. dp-1."""
    return [order[i] for start in range(dp) for i in range(start, len(order), dp)]


def zero_partitions(params: list[ParamSpec], dp: int, param_groups: list[list[str]] | None = None,
                    round_robin: bool = False) -> list[tuple[int, list[tuple[ParamSpec, int]]]]:
    """Per optimizer param group, DeepSpeed's flat buffer: the size of each of its ``dp`` equal
    partitions (the buffer padded to a multiple of 2*dp elements) and its parameters in buffer
    order, each with its start in the buffer."""
    groups_of = _partition(param_groups if param_groups is not None else [[p.name for p in params]], params,
                           "param groups")
    out = []
    for members in groups_of:
        order = _round_robin(members, dp) if round_robin else members
        starts = [sum(p.numel for p in order[:i]) for i in range(len(order))]
        total = _ceil_to(sum(p.numel for p in order), ZERO_ALIGNMENT * dp)
        out.append((total // dp, list(zip(order, starts))))
    return out


def zero_buckets(params: list[ParamSpec], ready_order: list[str] | None = None,
                 reduce_bucket_size: int = 500_000_000) -> list[list[ParamSpec]]:
    """DeepSpeed's gradient buckets: parameters in the order their gradients become ready (default
    the reverse of the model's), a bucket closed before the parameter that would overflow it."""
    ready = _by_name(params, ready_order if ready_order is not None else [p.name for p in reversed(params)],
                     "ready_order")
    if sorted(p.name for p in ready) != sorted(p.name for p in params):
        raise ValueError("ready_order must list every parameter once")
    buckets, current, elements = [], [], 0
    for p in ready:
        if p.numel > reduce_bucket_size:
            raise ValueError(f"{p.name}: {p.numel} elements, more than reduce_bucket_size {reduce_bucket_size} "
                             "(DeepSpeed splits such a parameter's all-reduce; not modelled)")
        if elements + p.numel > reduce_bucket_size:
            buckets.append(current)
            current, elements = [], 0
        current.append(p)
        elements += p.numel
    buckets.append(current)
    return buckets


def zero(params: list[ParamSpec], dp: int, *, param_groups: list[list[str]] | None = None,
         ready_order: list[str] | None = None, reduce_bucket_size: int = 500_000_000, round_robin: bool = False,
         reduce_scatter: bool = True, multi_rank_bucket_allreduce: bool = True, check_grad_overflow: bool = False,
         ranks: list[int] | None = None, appliances: list[str] | None = None) -> ShardedLayout:
    """DeepSpeed ZeRO-1/2 over a DP group of ``dp`` ranks (``ranks``, default 0..dp-1).
    ``param_groups``: the optimizer's param groups' FQNs (default one group, the model's order);
    ``ready_order``: the order gradients become ready (default the reverse of the model's);
    ``check_grad_overflow``: the step's overflow all-reduce (config.shard_steps)."""
    if dp < 2:
        raise ValueError("ZeRO partitions over at least 2 ranks")
    ranks = list(ranks) if ranks is not None else list(range(dp))
    if len(ranks) != dp:
        raise ValueError(f"{len(ranks)} ranks for dp={dp}")
    partitions = zero_partitions(params, dp, param_groups, round_robin)
    # each parameter's place: (partition, start, stop) pieces of its own flat elements
    pieces: dict[str, list[tuple[int, int, int]]] = {}
    for size, members in partitions:
        for p, pos in members:
            cuts = [pos] + [r * size for r in range(pos // size + 1, (pos + p.numel - 1) // size + 1)] + \
                [pos + p.numel]
            pieces[p.name] = [(lo // size, lo - pos, hi - pos) for lo, hi in zip(cuts, cuts[1:])]
    names = _names(dp)
    follows = _appliances(names, appliances)
    slices: list[list[Shard]] = [[] for _ in range(dp)]
    index: dict[tuple[str, int], int] = {}
    for _, members in partitions:
        for p, _ in members:
            for r, lo, hi in pieces[p.name]:
                index[(p.name, r)] = len(slices[r])
                slices[r].append(Shard(p.name, tuple(p.shape), None, (0,) * len(p.shape), tuple(p.shape), p.dtype,
                                       (lo, hi)))
    buckets = zero_buckets(params, ready_order, reduce_bucket_size)
    groups = []
    for r, name in enumerate(names):
        wire = [[(index[(p.name, owner)] if owner == r else PAD, hi - lo) for p in bucket
                 for owner, lo, hi in pieces[p.name]] for bucket in buckets]
        groups.append(DpGroup(name, 0, 0, list(ranks), follows[r], slices[r], r, wire))
    refusal = None
    if reduce_scatter and not multi_rank_bucket_allreduce:
        refusal = ("DeepSpeed ZeRO with use_multi_rank_bucket_allreduce=False reduces each partition's gradient "
                   "slice to its owner: the finished gradient never crosses the wire, so the optimizer state cannot "
                   "be followed exactly; set use_multi_rank_bucket_allreduce=True (DeepSpeed's default), whose "
                   "bucket all-reduce carries every partition's reduced gradient")
    # each param group's parameters in flat-buffer order (round robin already applied)
    steps = {"param_groups": [[p.name for p, _ in members] for _, members in partitions],
             "check_grad_overflow": check_grad_overflow}
    return _layout(params, groups, dp=dp, shards=dp, scheme="zero", average="prediv" if reduce_scatter else "postmul",
                   refusal=refusal, appliances=follows, steps=steps)


# ------------------------------------------------------------------------------------ Megatron

def megatron(params: list[ParamSpec], dp: int, instances: int, *, bucket_size: int | None = None,
             overlap_grad_reduce: bool = True, pad_buckets_for_high_nccl_busbw: bool = False,
             average_in_collective: bool = False, ranks: list[int] | None = None,
             appliances: list[str] | None = None) -> ShardedLayout:
    """Megatron-core's distributed optimizer over ``dp`` data-parallel ranks (``ranks``, default
    0..dp-1, in the DP group's order) in ``instances`` optimizer instances
    (``num_distributed_optimizer_instances``). ``bucket_size``: elements (default Megatron's,
    max(40M, 1M x dp); one bucket without ``overlap_grad_reduce``)."""
    if instances < 1 or dp % instances:
        raise ValueError(f"dp={dp} is not a multiple of num_distributed_optimizer_instances={instances}")
    size = dp // instances  # ranks of one instance: the shards of every bucket
    ranks = list(ranks) if ranks is not None else list(range(dp))
    if len(ranks) != dp:
        raise ValueError(f"{len(ranks)} ranks for dp={dp}")
    if bucket_size is None and overlap_grad_reduce:
        bucket_size = max(40_000_000, 1_000_000 * dp)
    if not overlap_grad_reduce:
        bucket_size = None
    align = math.lcm(size, MEGATRON_BUCKET_ALIGN, *([MEGATRON_BUSBW_ALIGN] if pad_buckets_for_high_nccl_busbw else []))
    buckets: list[tuple[int, int, list[tuple[ParamSpec, int]]]] = []  # (start, end, [(param, start)])
    start = bucket_start = 0
    members: list[tuple[ParamSpec, int]] = []
    for p in reversed(params):
        start = _ceil_to(start, MEGATRON_PARAM_ALIGN)
        members.append((p, start))
        start += p.numel
        if bucket_size is not None and start - bucket_start >= bucket_size:
            end = _ceil_to(start, align)
            buckets.append((bucket_start, end, members))
            start = bucket_start = end
            members = []
    if members:
        buckets.append((bucket_start, _ceil_to(start, align), members))
    names = _names(size)
    follows = _appliances(names, appliances)
    groups = []
    for r, name in enumerate(names):
        slices, wire = [], []
        for lo_b, hi_b, bucket in buckets:
            step = (hi_b - lo_b) // size
            lo, hi = lo_b + r * step, lo_b + (r + 1) * step
            segments, pos = [], lo
            for p, at in bucket:
                a, b = max(at, lo), min(at + p.numel, hi)
                if a >= b:
                    continue
                if a > pos:
                    segments.append((PAD, a - pos))
                segments.append((len(slices), b - a))
                slices.append(Shard(p.name, tuple(p.shape), None, (0,) * len(p.shape), tuple(p.shape), p.dtype,
                                    (a - at, b - at)))
                pos = b
            if hi > pos:
                segments.append((PAD, hi - pos))
            wire.append(segments)
        groups.append(DpGroup(name, 0, 0, [ranks[i * size + r] for i in range(instances)], follows[r], slices,
                              r if size > 1 else 0, wire))
    refusal = None
    if instances < 2:
        refusal = ("Megatron's distributed optimizer with one instance (num_distributed_optimizer_instances=1) "
                   "reduce-scatters its gradient buckets: the finished shard never crosses the wire (its owner adds "
                   "its own part locally), so the optimizer state cannot be followed exactly; set "
                   "num_distributed_optimizer_instances >= 2, whose all-reduce across instances carries each "
                   "shard's reduced gradient")
    return _layout(params, groups, dp=instances, shards=size, scheme="megatron",
                   average="avg" if average_in_collective else "premul", refusal=refusal, appliances=follows)
