"""config.shards (the sharded job's layout), updater.joint's pure parts (slices, merged values) and
the TP plan of the sharded generator."""

from __future__ import annotations

import pytest
import torch
from mirrorckpt.config import shards
from mirrorckpt.config.layout import ParamSpec
from mirrorckpt.tools.generator.models import build_model
from mirrorckpt.tools.generator.sharded import tp_plan
from mirrorckpt.updater.dcp_keys import dumps
from mirrorckpt.updater.joint import JointSaveError, merge_objects, shard_chunks

PARAMS = [ParamSpec("0.weight", (10, 4)), ParamSpec("0.bias", (10,)), ParamSpec("2.weight", (3, 10)),
          ParamSpec("2.bias", (3,))]
PLAN = {"0.weight": (0, 0), "0.bias": (0, 0), "2.weight": (1, 1), "2.bias": (None, 1)}


@pytest.mark.parametrize("size,tp", [(10, 2), (10, 3), (7, 4), (64, 8), (5, 5)])
def test_tp_range_is_torch_chunk(size, tp):
    pieces = torch.arange(size).chunk(tp)
    for r in range(tp):
        off, n = shards.tp_range(size, tp, r)
        want = pieces[r] if r < len(pieces) else torch.arange(0)
        assert n == len(want) and (n == 0 or off == int(want[0]))


def test_build_places_groups_ranks_and_slices():
    lay = shards.build(PARAMS, PLAN, tp=3, pp=2, dp=2, appliances=["a", "b"])
    assert [g.name for g in lay.groups] == ["pp0-tp0", "pp0-tp1", "pp0-tp2", "pp1-tp0", "pp1-tp1", "pp1-tp2"]
    g = lay.group("pp1-tp2")
    assert g.ranks == [shards.global_rank(1, d, 2, 2, 3) for d in range(2)] == [8, 11]
    assert [g.appliance for g in lay.groups] == ["a", "b", "a", "b", "a", "b"]
    w = g.shard("2.weight")
    assert (w.offset, w.shape, w.global_shape) == ((0, 8), (3, 2), (3, 10))
    assert g.shard("2.bias").whole
    assert [p.shape for p in lay.group_params("pp0-tp1")] == [(4, 4), (4,)]
    back = shards.ShardedLayout.from_dict(lay.to_dict())
    assert back.to_dict() == lay.to_dict() and back.digest() == lay.digest()
    assert len(lay.groups_of("a")) == 3
    assert lay.global_layout().total_numel == sum(p.numel for p in PARAMS)


def test_layout_refuses_slices_that_do_not_cover():
    d = shards.build(PARAMS, PLAN, tp=2, pp=2, dp=2).to_dict()
    d["groups"][1]["shards"][0]["offset"] = [0, 0]  # two groups claim the same rows of 0.weight
    with pytest.raises(ValueError, match="do not cover it exactly once"):
        shards.ShardedLayout.from_dict(d)
    d = shards.build(PARAMS, PLAN, tp=2, pp=2, dp=2).to_dict()
    d["groups"][0]["shards"][0]["global_shape"] = [11, 4]
    with pytest.raises(ValueError, match="global shape"):
        shards.ShardedLayout.from_dict(d)
    with pytest.raises(ValueError, match="leaves TP rank 3 empty"):
        shards.build([ParamSpec("w", (3, 4))], {"w": (0, 0)}, tp=4, pp=1, dp=2)
    with pytest.raises(ValueError, match="no TP/PP placement"):
        shards.build(PARAMS, {"0.weight": (0, 0)}, tp=2, pp=1, dp=2)
    with pytest.raises(ValueError, match="lists 3 ranks"):
        bad = shards.build(PARAMS, PLAN, tp=2, pp=2, dp=2).to_dict()
        bad["groups"][0]["ranks"] = [0, 1, 2]
        shards.ShardedLayout.from_dict(bad)


def test_shard_chunks_place_slices_and_keep_scalars_whole():
    lay = shards.build(PARAMS, PLAN, tp=2, pp=2, dp=2)
    g = lay.group("pp1-tp1")
    flat = {"model.2.weight": torch.ones(3, 5), "model.2.bias": torch.ones(3),
            "optim.state.2.weight.exp_avg": torch.ones(3, 5), "optim.state.2.weight.step": torch.tensor(4.0),
            "optim.param_groups.0.params": ["2.weight", "2.bias"], "extra.step": 4}
    chunks, objects = shard_chunks(lay, g.name, flat)
    where = {c.key: (c.offset, c.global_shape) for c in chunks}
    assert where["model.2.weight"] == ((0, 5), (3, 10))
    assert where["optim.state.2.weight.exp_avg"] == ((0, 5), (3, 10))
    assert where["model.2.bias"] == ((0,), (3,))
    assert where["optim.state.2.weight.step"] == ((), ())
    assert set(objects) == {"optim.param_groups.0.params", "extra.step"}
    flat["optim.state.2.weight.exp_avg"] = torch.ones(3, 4)  # not the slice's shape
    with pytest.raises(ValueError, match="its slice"):
        shard_chunks(lay, g.name, flat)


def test_merge_lists_every_fqn_and_refuses_disagreement():
    lay = shards.build(PARAMS, PLAN, tp=1, pp=2, dp=2)
    a = {"optim.param_groups.0.params": ["2.weight", "2.bias"], "optim.param_groups.0.lr": 0.1, "extra.step": 3,
         "extra.layout": "stage 1"}
    b = {"optim.param_groups.0.params": ["0.weight", "0.bias"], "optim.param_groups.0.lr": 0.1, "extra.step": 3,
         "extra.layout": "stage 0"}
    m = merge_objects(lay, [a, b])
    assert m["optim.param_groups.0.params"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert m["extra.layout"] == dumps(lay.global_layout().to_dict(), "layout")
    assert m["extra.step"] == 3 and "extra.shards" in m
    with pytest.raises(JointSaveError, match="disagree on extra.step"):
        merge_objects(lay, [a, dict(b, **{"extra.step": 4})])


def test_tp_plan_pairs_column_and_row_parallel_linears():
    model = build_model("mlp:8,16,12,4", 0)
    plan = tp_plan(model, tp=2, pp=1)
    assert plan == {"0.weight": (0, 0), "0.bias": (0, 0), "2.weight": (1, 0), "2.bias": (None, 0),
                    "4.weight": (0, 0), "4.bias": (0, 0)}
    assert {s for _, s in tp_plan(model, tp=2, pp=3).values()} == {0, 1, 2}
    with pytest.raises(ValueError, match="cannot fill 4 pipeline stages"):
        tp_plan(model, tp=1, pp=4)
