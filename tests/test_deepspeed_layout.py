"""The ZeRO layout a DeepSpeed engine registers (control.integrations.deepspeed.zero_layout), from a
DeepSpeed-shaped engine holding what DeepSpeed 0.19's ZeRO-1/2 optimizer made for this model on 2
CPU ranks (two param groups, reduce_bucket_size 150): params_in_partition and first_offset per
rank, as read from real engines (torchrun, gloo, DS_ACCELERATOR=cpu). The layout agrees with them
on both ranks; a partition it does not model, and ZeRO-3, are refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from mirrorckpt.control.integrations.deepspeed import check_engine, check_partition, zero_layout
from mirrorckpt.control.link.checks import AttachError
from torch import nn

# DeepSpeed 0.19, 2 ranks: partition r of each param group, (parameters, offset in the first)
SEEN = {0: ([["0.weight"], ["0.bias"]], [0, 0]),
        1: ([["0.weight", "2.weight"], ["0.bias", "2.bias"]], [96, 10])}


def engine(stage: int = 2, rank: int = 0, offsets=None):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    by_name = dict(module.named_parameters())
    groups = [[by_name["0.weight"], by_name["2.weight"]], [by_name["0.bias"], by_name["2.bias"]]]
    members, first = SEEN[rank]
    zo = SimpleNamespace(bit16_groups=groups, reduce_bucket_size=150, round_robin_gradients=False,
                         reduce_scatter=True, use_multi_rank_bucket_allreduce=True, dp_process_group=None,
                         params_in_partition=[[by_name[n] for n in g] for g in members],
                         first_offset=list(offsets if offsets is not None else first))
    return SimpleNamespace(module=module, optimizer=zo, dp_world_size=2, zero_optimization_stage=lambda: stage,
                           fp16_enabled=lambda: False, bfloat16_enabled=lambda: False,
                           gradient_accumulation_steps=lambda: 1)


def test_the_layout_agrees_with_deepspeeds_partition_on_every_rank():
    layout = zero_layout(engine())
    assert layout.scheme == "zero" and len(layout.groups) == 2
    assert [(s.fqn, s.flat) for s in layout.groups[1].shards] == [
        ("0.weight", (96, 128)), ("2.weight", (0, 64)), ("0.bias", (10, 16)), ("2.bias", (0, 4))]
    one = engine(rank=1)
    check_partition(layout, one.optimizer, {id(p): n for n, p in one.module.named_parameters()}, 1)


def test_a_partition_the_layout_does_not_model_and_zero_3_are_refused():
    with pytest.raises(AttachError, match="DeepSpeed partitioned the optimizer state of DP rank 0"):
        zero_layout(engine(offsets=[0, 2]))
    with pytest.raises(AttachError, match="ZeRO stage 3"):
        zero_layout(engine(stage=3))


def test_engine_settings_the_link_does_not_follow_are_refused_by_name():
    def refused(**change):
        e = engine()
        e.optimizer.single_partition_of_fp32_groups, e.optimizer._optimizer_step = [], None
        for k, v in change.items():
            setattr(e.optimizer if k in ("cpu_offload", "zenflow") else e, k, v)
        with pytest.raises(AttachError) as err:
            check_engine(e)
        return str(err.value)

    assert "fp16/bf16" in refused(fp16_enabled=lambda: True)
    assert "fp16/bf16" in refused(bfloat16_enabled=lambda: True)
    assert "offload_optimizer" in refused(cpu_offload=True)
    assert "ZenFlow" in refused(zenflow=True)
    assert "gradient_accumulation_steps=4" in refused(gradient_accumulation_steps=lambda: 4)
    plain = engine()
    with pytest.raises(AttachError, match="follows DeepSpeedZeroOptimizer"):
        check_engine(plain)  # no flat fp32 partitions: not ZeRO-1/2's optimizer
    plain.optimizer.single_partition_of_fp32_groups, plain.optimizer._optimizer_step = [], None
    check_engine(plain)
