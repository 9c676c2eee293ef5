"""The collectives one ring of a sharded-optimizer job carries, in issue order, from the
framework's rules (the facts: ../shared/docs/sharded-optimizers.md; the layouts:
config.shard_rules). The generator issues them and the parser expects them from this one place.

A followed ring is one NCCL communicator. Its job model needs every collective on it, not only
the ones it follows: flags, CTS indices and PSNs count on from one collective to the next. Labels
(``CollSpec.label``; ``bucket`` numbers the collective among those of its label in an iteration):

  grad            all-reduce of ``DpGroup.wire[bucket]``: the group's reduced gradient, padded
  params          an all-gather that carries parameters (``RingSteps.gathers[bucket]`` says where)
  norm            an all-reduce of a squared gradient norm (ZeRO's per param group; FSDP2's clipping)
  overflow        ZeRO's all-reduce of its overflow flag (``check_grad_overflow``: uint8, MAX)
  reduce_scatter  FSDP2's gradient reduce-scatter: its result never crosses the wire
  init_params:K   the start-up broadcast of parameter K (DeepSpeed's ``_broadcast_model``)

Per framework:

- FSDP2 HSDP, the ring of shard index k (mesh column k, the replicate group): per step one
  all-reduce per ``fully_shard`` unit in reduce order; nothing at start (FSDP2 broadcasts nothing:
  the replica starts from a seed checkpoint or the trainer's registration). The shard groups'
  all-gathers and reduce-scatters run on other connections (``shard_group_ring``).
- FSDP2 shard group (the one ring of pure FSDP, followed for weights only): per step one
  all-gather per unit in forward order (the root's first: the reverse of the reduce order), one
  reduce-scatter per unit in reduce order, and with clipping the all-reduce of the squared norm.
  Units with ``reshard_after_forward=False`` (all-gathered once per step); a unit resharded after
  its forward all-gathers again in the backward, which is not modelled.
- DeepSpeed ZeRO-1/2 with its defaults, the one DP ring all partitions share: at start one
  broadcast per parameter from DP rank 0 (model order); per step the bucket all-reduces, the
  overflow flag when checked, each param group's squared norm (float32, SUM), then each param
  group's all-gather of its partitions (``all_gather_into_tensor``, float32 for a float32 job).
- Megatron with several distributed-optimizer instances, the ring across instances: per step one
  all-reduce per bucket shard; its parameter all-gathers run inside each instance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mirrorckpt.config.ddp import ALLGATHER, ALLREDUCE, BROADCAST, REDUCESCATTER, CollSpec
from mirrorckpt.config.layout import JobLayout
from mirrorckpt.config.shard_rules import zero_partitions
from mirrorckpt.config.shards import PAD, ShardedLayout

GRAD, PARAMS, NORM, OVERFLOW, REDUCE_SCATTER = "grad", "params", "norm", "overflow", "reduce_scatter"
INIT_PARAMS = "init_params:"


@dataclass
class RingSteps:
    """One communicator's collectives. ``gathers[g]``: per rank (local, ring rank order), the
    segments of its part of "params" collective g: (index in ``ShardedLayout.params`` or PAD,
    first element in that parameter's flat order, elements)."""

    ranks: list[int]  # global ranks, local rank i = ranks[i]
    startup: list[CollSpec] = field(default_factory=list)
    per_iteration: list[CollSpec] = field(default_factory=list)
    gathers: list[list[list[tuple[int, int, int]]]] = field(default_factory=list)
    weights: JobLayout | None = None  # the whole model, when the start-up broadcasts carry it


def gradient_ring(layout: ShardedLayout, group: str) -> RingSteps:
    """The ring whose all-reduces carry ``group``'s reduced gradient (see the module text)."""
    g = layout.group(group)
    if g.wire is None:
        raise ValueError(f"group {group}: a {layout.scheme} layout without the framework's all-reduces "
                         "(DDP buckets are registered by the trainer)")
    if layout.refusal is not None:
        raise ValueError(f"group {group}: {layout.refusal}")
    grads = [CollSpec(ALLREDUCE, n, g.shards[0].dtype, GRAD, bucket=b) for b, n in enumerate(g.wire_numel())]
    if layout.scheme in ("fsdp2", "megatron"):
        return RingSteps(list(g.ranks), [], grads)
    if layout.scheme != "zero":
        raise ValueError(f"group {group}: no per-step collective sequence is modelled for scheme {layout.scheme!r}")
    steps = layout.steps or {}
    partitions = zero_partitions(layout.params, layout.dp, steps.get("param_groups"))
    index = {p.name: i for i, p in enumerate(layout.params)}
    startup = [CollSpec(BROADCAST, p.numel, p.dtype, f"{INIT_PARAMS}{k}") for k, p in enumerate(layout.params)]
    per = list(grads)
    if steps.get("check_grad_overflow"):
        per.append(CollSpec(ALLREDUCE, 1, "uint8", OVERFLOW))
    per += [CollSpec(ALLREDUCE, 1, "float32", NORM, bucket=k) for k in range(len(partitions))]
    gathers = []
    for k, (size, members) in enumerate(partitions):
        per.append(CollSpec(ALLGATHER, size, layout.params[0].dtype, PARAMS, bucket=k))
        gathers.append([_partition_segments(members, index, r * size, size) for r in range(layout.dp)])
    return RingSteps(list(g.ranks), startup, per, gathers, layout.global_layout())


def _partition_segments(members, index: dict[str, int], lo: int, size: int) -> list[tuple[int, int, int]]:
    """Elements [lo, lo + size) of a ZeRO flat buffer as segments of its parameters (tail: PAD)."""
    out, pos = [], lo
    for p, at in members:
        a, b = max(at, lo), min(at + p.numel, lo + size)
        if a < b:
            out.append((index[p.name], a - at, b - a))
            pos = b
    if lo + size > pos:
        out.append((PAD, 0, lo + size - pos))
    return out


def shard_group_ring(layout: ShardedLayout, replica: int = 0, clip: bool = False) -> RingSteps:
    """FSDP2's shard group of ``replica`` (a row of the mesh; pure FSDP has one): the ring whose
    all-gathers carry every unit's parameters (see the module text); ``clip``: the job clips by the
    global norm (one all-reduce of the squared norm after the reduce-scatters)."""
    if layout.scheme != "fsdp2":
        raise ValueError(f"a {layout.scheme} layout has no FSDP2 shard group")
    if not 0 <= replica < layout.dp:
        raise ValueError(f"replica {replica} outside 0..{layout.dp - 1}")
    groups = sorted(layout.groups, key=lambda g: g.shard_index)
    index = {p.name: i for i, p in enumerate(layout.params)}
    units = len(groups[0].wire)
    forward = list(reversed(range(units)))  # the root's unit reduces last and gathers first
    per, gathers = [], []
    for k, u in enumerate(forward):
        parts = [[(PAD, 0, n) if i == PAD else (index[g.shards[i].fqn], _first(g.shards[i]), n)
                  for i, n in g.wire[u]] for g in groups]
        per.append(CollSpec(ALLGATHER, sum(n for _, _, n in parts[0]), groups[0].shards[0].dtype, PARAMS, bucket=k))
        gathers.append(parts)
    per += [CollSpec(REDUCESCATTER, n, groups[0].shards[0].dtype, REDUCE_SCATTER, bucket=u)
            for u, n in enumerate(groups[0].wire_numel())]
    if clip:
        per.append(CollSpec(ALLREDUCE, 1, "float32", NORM))
    return RingSteps([g.ranks[replica] for g in groups], [], per, gathers)


def _first(s) -> int:
    """A dim-0 block's first element in its parameter's flat order."""
    inner = 1
    for n in s.global_shape[1:]:
        inner *= n
    return s.offset[0] * inner
