"""DeepSpeed ZeRO-1/2: the sharded layout a DeepSpeed engine's job registers.

    layout = zero_layout(engine)        # after deepspeed.initialize, on every rank

The layout is ``config.shard_rules.zero`` fed from the engine's own settings: its ZeRO stage,
data-parallel group, the optimizer's param groups (``bit16_groups``), ``reduce_bucket_size``,
``round_robin_gradients``, ``reduce_scatter`` and ``use_multi_rank_bucket_allreduce``, and fp16's
overflow check. It is then checked against the partition the engine actually made
(``params_in_partition``, ``first_offset``, ``partition_size`` on this rank): a DeepSpeed whose rules
differ from the builder's is refused by name, never registered wrong. The gradient buckets assume
the ready order is the reverse of the model's (the builder's default).

Attaching the engine is not done yet: ``control.sharded.attach_sharded`` refuses the ``zero``
scheme (the link does not yet register the optimizer's flat partitions as its tensors).
"""

from __future__ import annotations

from mirrorckpt.config import shard_rules
from mirrorckpt.config.layout import ParamSpec
from mirrorckpt.config.shards import ShardedLayout
from mirrorckpt.control.link.checks import AttachError
from mirrorckpt.control.link.describe import DTYPE_NAMES


def zero_layout(engine, appliances: list[str] | None = None) -> ShardedLayout:
    """The ShardedLayout of a DeepSpeed ZeRO-1/2 engine (see the module text); AttachError when the
    engine is not ZeRO-1/2 or its partition differs from the layout's."""
    import torch.distributed as dist

    stage = engine.zero_optimization_stage()
    if stage not in (1, 2):
        raise AttachError(f"DeepSpeed ZeRO stage {stage}: the appliance follows ZeRO-1 and ZeRO-2 (stage 3 gathers "
                          "parameters per layer; stage 0 is plain data parallelism: use attach on engine.module)")
    zo = engine.optimizer
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    names = {id(p): n for n, p in named}
    params = [ParamSpec(n, tuple(p.shape), DTYPE_NAMES[p.dtype]) for n, p in named]
    groups = [[names[id(p)] for p in g] for g in zo.bit16_groups]
    ranks = dist.get_process_group_ranks(zo.dp_process_group) if dist.is_initialized() else None
    layout = shard_rules.zero(params, engine.dp_world_size, param_groups=groups,
                              reduce_bucket_size=int(zo.reduce_bucket_size), round_robin=bool(zo.round_robin_gradients),
                              reduce_scatter=bool(zo.reduce_scatter),
                              multi_rank_bucket_allreduce=bool(getattr(zo, "use_multi_rank_bucket_allreduce", True)),
                              check_grad_overflow=bool(engine.fp16_enabled()), ranks=ranks, appliances=appliances)
    check_partition(layout, zo, names, dist.get_rank(group=zo.dp_process_group) if dist.is_initialized() else 0)
    return layout


def check_partition(layout: ShardedLayout, zo, names: dict[int, str], dp_rank: int) -> None:
    """The slices ``layout`` gives partition ``dp_rank`` (parameter, start) against those the ZeRO
    optimizer holds there: per param group, ``params_in_partition`` from ``first_offset`` in the first."""
    got = [(s.fqn, s.flat[0]) for s in layout.groups[dp_rank].shards]
    want = [(names[id(p)], offset if k == 0 else 0)
            for members, offset in zip(zo.params_in_partition, zo.first_offset) for k, p in enumerate(members)]
    if got != want:
        raise AttachError(f"DeepSpeed partitioned the optimizer state of DP rank {dp_rank} as {want[:4]} (parameter, "
                          f"start), the ZeRO layout says {got[:4]}: this DeepSpeed's partition rules are not the ones "
                          "config.shard_rules models")
