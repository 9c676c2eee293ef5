"""Sharded-optimizer layouts (config.shard_rules: FSDP2 HSDP, DeepSpeed ZeRO-1/2, Megatron's
distributed optimizer), flat-range slices (config.shards) and their place in a joint checkpoint
(updater.joint.shard_chunks)."""

from __future__ import annotations

import math

import pytest
import torch
from mirrorckpt.config import shard_rules, shards
from mirrorckpt.config.layout import ParamSpec
from mirrorckpt.config.shards import PAD
from mirrorckpt.updater.joint import shard_chunks

# an MLP 16 -> 33 -> 8: 33 rows do not split evenly, so FSDP2 pads and ZeRO/Megatron cut mid-parameter
MLP = [ParamSpec("0.weight", (33, 16)), ParamSpec("0.bias", (33,)), ParamSpec("2.weight", (8, 33)),
       ParamSpec("2.bias", (8,))]


def full_tensors(params=MLP) -> dict[str, torch.Tensor]:
    return {p.name: torch.arange(p.numel, dtype=torch.float32).reshape(p.shape) + 1000 * i
            for i, p in enumerate(params)}


def slice_of(s: shards.Shard, full: torch.Tensor) -> torch.Tensor:
    """What a group holds of ``full`` (the global tensor) for slice ``s``."""
    block = full[tuple(slice(o, o + n) for o, n in zip(s.offset, s.shape))]
    return block if s.flat is None else block.reshape(-1)[s.flat[0]:s.flat[1]]


@pytest.mark.parametrize("shape", [(7,), (3, 4), (3, 4, 5), (2, 3, 2, 4)])
def test_flat_boxes_are_contiguous_pieces_of_the_range_in_order(shape):
    full = torch.arange(math.prod(shape)).reshape(shape)
    n = full.numel()
    for start in range(0, n, 3):
        for stop in range(start + 1, n + 1, 5):
            boxes = shards.flat_boxes(shape, start, stop)
            assert len(boxes) <= 2 * len(shape) - 1
            pos = start
            for off, sh, a, b in boxes:
                assert a == pos and b - a == math.prod(sh)
                box = full[tuple(slice(o, o + k) for o, k in zip(off, sh))]
                assert torch.equal(box.reshape(-1), full.reshape(-1)[a:b])
                pos = b
            assert pos == stop
    with pytest.raises(ValueError, match="outside a tensor"):
        shards.flat_boxes(shape, 0, n + 1)


def test_hsdp_cuts_dim0_as_fsdp2_and_pads_its_reduce_buffer():
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_dim0_padded_size

    units = [["2.weight", "2.bias"], ["0.weight", "0.bias"]]
    lay = shard_rules.hsdp(MLP, 2, 2, units=units)
    assert (lay.scheme, lay.shards, lay.dp, lay.average, lay.refusal) == ("fsdp2", 2, 2, "avg", None)
    assert [(g.name, g.ranks, g.shard_index) for g in lay.groups] == [("pp0-tp0-sh0", [0, 2], 0),
                                                                     ("pp0-tp0-sh1", [1, 3], 1)]
    full = full_tensors()
    by = {p.name: p for p in MLP}
    for k, g in enumerate(lay.groups):
        for s in g.shards:  # FSDP2's sharded parameter: torch.chunk on dim 0
            assert torch.equal(slice_of(s, full[s.fqn]), torch.chunk(full[s.fqn], 2, dim=0)[k])
        # each all-reduce is one unit's reduce-scatter output: its padded dim-0 shards, in unit order
        want = [sum(_get_dim0_padded_size(torch.Size(by[n].shape), 2).numel() // 2 for n in u) for u in units]
        assert g.wire_numel() == want
    assert lay.groups[1].wire[1] == [(0, 16 * 16), (PAD, 16), (1, 16), (PAD, 1)]  # rows 17..32: one padded row
    assert lay.group_params("pp0-tp0-sh1")[0] == ParamSpec("0.weight", (16, 16))
    back = shards.ShardedLayout.from_dict(lay.to_dict())
    assert back.to_dict() == lay.to_dict() and back.digest() == lay.digest()
    # "avg": FSDP2 on GPUs reduce-scatters and all-reduces float32 gradients with ncclAvg
    from torch.distributed import ReduceOp
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    group = type("Group", (), {"size": lambda self: 2})()
    assert _get_gradient_divide_factors(group, group, torch.float32, "cuda") == (None, None, ReduceOp.AVG,
                                                                                 ReduceOp.AVG)
    with pytest.raises(ValueError, match="leaves FSDP shard 3 of 4 empty"):
        shard_rules.hsdp([ParamSpec("w", (3, 2))], 2, 4)
    with pytest.raises(ValueError, match="every parameter exactly once"):
        shard_rules.hsdp(MLP, 2, 2, units=[["0.weight"]])


def test_pure_fsdp_is_described_but_refused_with_the_setting():
    lay = shard_rules.hsdp(MLP, 1, 4)
    assert lay.dp == 1 and [g.ranks for g in lay.groups] == [[0], [1], [2], [3]]
    assert "reduce-scatters" in lay.refusal and "dp_replicate >= 2" in lay.refusal


def test_zero_partitions_the_padded_flat_group_and_all_partitions_share_the_ring():
    lay = shard_rules.zero(MLP, 3, reduce_bucket_size=600)
    total = sum(p.numel for p in MLP)  # 833, padded to 834 (a multiple of 2 x 3): 278 per partition
    assert (lay.scheme, lay.shards, lay.dp, lay.average) == ("zero", 3, 3, "prediv")
    assert [[(s.fqn, s.flat) for s in g.shards] for g in lay.groups] == [
        [("0.weight", (0, 278))],
        [("0.weight", (278, 528)), ("0.bias", (0, 28))],
        [("0.bias", (28, 33)), ("2.weight", (0, 264)), ("2.bias", (0, 8))]]
    assert sum(s.numel for g in lay.groups for s in g.shards) == total
    assert all(g.ranks == [0, 1, 2] for g in lay.groups)
    # the buckets, in ready order (reverse): 2.bias, 2.weight, 0.bias (8 + 264 + 33 <= 600), then 0.weight
    assert all(g.wire_numel() == [305, 528] for g in lay.groups)
    for b in range(2):  # every element of the ring's bucket belongs to exactly one partition
        owners = [sum(([i != PAD] * n for i, n in g.wire[b]), []) for g in lay.groups]
        assert [sum(x) for x in zip(*owners)] == [1] * lay.groups[0].wire_numel()[b]
    assert lay.groups[2].wire[0] == [(2, 8), (1, 264), (PAD, 28), (0, 5)]
    full = full_tensors()
    for p in MLP:  # the partitions' flat ranges, in partition order, are the parameter
        got = torch.cat([slice_of(s, full[p.name]) for g in lay.groups for s in g.shards if s.fqn == p.name])
        assert torch.equal(got, full[p.name].reshape(-1))


def test_zero_round_robin_order_param_groups_and_refusal():
    params = [ParamSpec(f"w{i}", (4,)) for i in range(5)]
    lay = shard_rules.zero(params, 2, round_robin=True)
    # round robin over 2 ranks: w0 w2 w4 | w1 w3 (20 elements, 10 per partition)
    assert [[(s.fqn, s.flat) for s in g.shards] for g in lay.groups] == [
        [("w0", (0, 4)), ("w2", (0, 4)), ("w4", (0, 2))], [("w4", (2, 4)), ("w1", (0, 4)), ("w3", (0, 4))]]
    two = shard_rules.zero(params, 2, param_groups=[["w0", "w1"], ["w2", "w3", "w4"]])
    # each param group padded and partitioned on its own: 8 -> 4 | 4, 12 -> 6 | 6
    assert [[(s.fqn, s.flat) for s in g.shards] for g in two.groups] == [
        [("w0", (0, 4)), ("w2", (0, 4)), ("w3", (0, 2))], [("w1", (0, 4)), ("w3", (2, 4)), ("w4", (0, 4))]]
    refused = shard_rules.zero(params, 2, multi_rank_bucket_allreduce=False)
    assert "use_multi_rank_bucket_allreduce=True" in refused.refusal
    assert shard_rules.zero(params, 2, reduce_scatter=False).average == "postmul"


def test_megatron_buffer_alignment_buckets_and_instance_rings():
    lay = shard_rules.megatron(MLP, 4, 2, bucket_size=300)
    assert (lay.scheme, lay.shards, lay.dp, lay.refusal) == ("megatron", 2, 2, None)
    # reverse order: 2.bias at 0, 2.weight at 64 (ends 328 >= 300: bucket end padded to lcm(2, 128) = 384);
    # 0.bias at 384, 0.weight at 448 (ends 976: padded to 1024). Shards of 192 and 320 elements.
    assert [g.ranks for g in lay.groups] == [[0, 2], [1, 3]]  # rank r of instance 0 (ranks 0, 1) and 1 (2, 3)
    sh0, sh1 = lay.groups
    assert sh0.wire == [[(0, 8), (PAD, 56), (1, 128)], [(2, 33), (PAD, 31), (3, 256)]]
    assert sh1.wire == [[(0, 136), (PAD, 56)], [(1, 272), (PAD, 48)]]
    assert [(s.fqn, s.flat) for s in sh1.shards] == [("2.weight", (128, 264)), ("0.weight", (256, 528))]
    wide = shard_rules.megatron(MLP, 8, 2)  # one bucket (Megatron's default size is far larger)
    assert [g.ranks for g in wide.groups] == [[r, 4 + r] for r in range(4)]
    assert len(wide.groups[0].wire) == 1 and sum(g.wire_numel()[0] for g in wide.groups) % 128 == 0
    assert shard_rules.megatron(MLP, 4, 2, average_in_collective=True).average == "avg"
    one = shard_rules.megatron(MLP, 4, 1)
    assert "num_distributed_optimizer_instances=1" in one.refusal
    assert "num_distributed_optimizer_instances >= 2" in one.refusal
    with pytest.raises(ValueError, match="not a multiple"):
        shard_rules.megatron(MLP, 4, 3)


def test_cover_check_sees_flat_overlaps_and_double_claims():
    d = shard_rules.megatron(MLP, 4, 2, bucket_size=300).to_dict()
    d["groups"][1]["shards"][0]["flat"] = [120, 264]  # overlaps shard 0's 2.weight range
    d["groups"][1]["wire"][0] = [[0, 144], [PAD, 48]]
    with pytest.raises(ValueError, match="do not cover it exactly once"):
        shards.ShardedLayout.from_dict(d)
    d = shard_rules.hsdp(MLP, 2, 2).to_dict()
    d["groups"][1]["shards"][3] = d["groups"][0]["shards"][3]  # both shard indices claim rows 0..3 of 2.bias
    with pytest.raises(ValueError, match="do not cover it exactly once"):
        shards.ShardedLayout.from_dict(d)
    d = shard_rules.hsdp(MLP, 2, 2).to_dict()
    d["groups"][0]["wire"][0] = [[0, 272]]  # 0.bias in no all-reduce
    with pytest.raises(ValueError, match="slices in no all-reduce"):
        shards.ShardedLayout.from_dict(d)
    tp = shards.build(MLP, {p.name: (None, 0) for p in MLP}, tp=1, pp=1, dp=2).to_dict()
    assert not {"shards", "scheme", "average", "refusal"} & set(tp)  # a TP/PP layout's dict is as before


@pytest.mark.parametrize("lay", [shard_rules.zero(MLP, 3, reduce_bucket_size=600),
                                 shard_rules.megatron(MLP, 4, 2, bucket_size=300), shard_rules.hsdp(MLP, 2, 2)],
                         ids=["zero", "megatron", "hsdp"])
def test_joint_chunks_of_every_group_rebuild_the_global_tensors(lay):
    full = full_tensors()
    got = {f"{kind}{p.name}": torch.full(p.shape, -1.0) for p in MLP for kind in ("model.", "optim.state.x.")}
    for g in lay.groups:
        flat = {}
        for s in g.shards:
            flat[f"model.{s.fqn}"] = slice_of(s, full[s.fqn]).clone()
            flat[f"optim.state.{s.fqn}.exp_avg"] = slice_of(s, full[s.fqn]).clone()
        flat[f"optim.state.{g.shards[0].fqn}.step"] = torch.tensor(3.0)
        chunks, objects = shard_chunks(lay, g.name, flat)
        assert not objects
        for c in chunks:
            if c.key.endswith(".step"):
                assert c.offset == () and c.global_shape == ()
                continue
            key = "model." + c.key.split(".", 1)[1] if c.key.startswith("model.") else \
                "optim.state.x." + c.key[len("optim.state."):-len(".exp_avg")]
            assert c.global_shape == tuple(got[key].shape)
            region = got[key][tuple(slice(o, o + n) for o, n in zip(c.offset, c.tensor.shape))]
            assert bool((region == -1).all()), f"{c.key} at {c.offset} written twice"
            region.copy_(c.tensor)
    for p in MLP:
        assert torch.equal(got[f"model.{p.name}"], full[p.name])
        assert torch.equal(got[f"optim.state.x.{p.name}"], full[p.name])
