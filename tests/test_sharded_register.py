"""The sharded registration, in process: the layout read from the ranks' reports
(control.sharded.layout_of), the sharded REGISTER's schema (control.messages), and the appliance's
checks of it (AppliancePlane with a DP group, ShardedAppliance). The real 4-process job is
tests/e2e/test_tp_dp_job.py."""

from __future__ import annotations

import pytest
import torch
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec
from mirrorckpt.config.training import OptimizerSpec, TrainingSpec
from mirrorckpt.control import messages as m
from mirrorckpt.control.appliance_side import AppliancePlane, Refused
from mirrorckpt.control.sharded import layout_of
from mirrorckpt.control.sharded_appliance import ShardedAppliance
from mirrorckpt.control.wire import SchemaError

SECRET = "unit-secret-0123456789abcdef-xyz"
TRAINING = TrainingSpec(optimizer=OptimizerSpec(name="adam", lr=0.1))


def entries(tp_rank: int, tp: int = 2) -> list[dict]:
    """What a rank of a Colwise(16->32) / Rowwise(32->8) MLP reports (DTensor's offsets)."""
    h = 32 // tp
    return [
        {"fqn": "0.weight", "global_shape": [32, 16], "tp_dim": 0, "offset": [tp_rank * h, 0], "shape": [h, 16]},
        {"fqn": "0.bias", "global_shape": [32], "tp_dim": 0, "offset": [tp_rank * h], "shape": [h]},
        {"fqn": "2.weight", "global_shape": [8, 32], "tp_dim": 1, "offset": [0, tp_rank * h], "shape": [8, h]},
        {"fqn": "2.bias", "global_shape": [8], "tp_dim": None, "offset": [0], "shape": [8]},
    ]


def reports(tp: int = 2, dp: int = 2) -> list[dict]:
    """DeviceMesh(("dp", "tp")): rank = dp_rank * tp + tp_rank."""
    out = []
    for rank in range(tp * dp):
        d, t = divmod(rank, tp)
        out.append({"rank": rank, "stage": 0, "dp_rank": d, "dp": dp, "tp_rank": t, "tp": tp,
                    "dp_ranks": [x * tp + t for x in range(dp)], "entries": entries(t, tp)})
    return out


def test_layout_of_a_tp2_dp2_job():
    lay = layout_of(reports(), pp=1)
    assert (lay.tp, lay.pp, lay.dp) == (2, 1, 2)
    assert [(g.name, g.ranks, g.appliance) for g in lay.groups] == [("pp0-tp0", [0, 2], "appliance-0"),
                                                                     ("pp0-tp1", [1, 3], "appliance-1")]
    assert [(p.name, p.shape) for p in lay.params] == [("0.weight", (32, 16)), ("0.bias", (32,)),
                                                       ("2.weight", (8, 32)), ("2.bias", (8,))]
    s = lay.group("pp0-tp1").shard("2.weight")
    assert (s.tp_dim, s.offset, s.shape) == (1, (0, 16), (8, 16))
    assert lay.group_params("pp0-tp0")[0] == ParamSpec("0.weight", (16, 16))
    one = layout_of(reports(), pp=1, appliances={"pp0-tp0": "a", "pp0-tp1": "a"})
    assert one.appliances == ["a"] and [g.name for g in one.groups_of("a")] == ["pp0-tp0", "pp0-tp1"]


def test_layout_of_pipeline_stages():
    """PP=2 x TP=2 x DP=1: stage 0 holds layer 0, stage 1 layer 2 (global FQNs)."""
    rs = []
    for rank in range(4):
        s, t = divmod(rank, 2)
        mine = [e for e in entries(t) if e["fqn"].startswith("0." if s == 0 else "2.")]
        rs.append({"rank": rank, "stage": s, "dp_rank": 0, "dp": 1, "tp_rank": t, "tp": 2, "dp_ranks": [rank],
                   "entries": mine})
    lay = layout_of(rs, pp=2)
    assert [(g.name, g.pp_stage, g.ranks, [x.fqn for x in g.shards]) for g in lay.groups] == [
        ("pp0-tp0", 0, [0], ["0.weight", "0.bias"]), ("pp0-tp1", 0, [1], ["0.weight", "0.bias"]),
        ("pp1-tp0", 1, [2], ["2.weight", "2.bias"]), ("pp1-tp1", 1, [3], ["2.weight", "2.bias"])]
    assert [p.name for p in lay.params] == ["0.weight", "0.bias", "2.weight", "2.bias"]


@pytest.mark.parametrize("break_it, error", [
    (lambda rs: rs[2]["entries"][0].update(offset=[16, 0]), "different parameters"),
    (lambda rs: rs[0].update(dp_ranks=[0, 3]), "mesh's DP group"),
    (lambda rs: rs.pop(), "3 ranks for TP=2 x DP=2"),
    (lambda rs: [r.update(stage=1) for r in rs[2:]], "do not cover"),
    (lambda rs: [r["entries"].__setitem__(3, dict(r["entries"][3], tp_dim=0, shape=[4],
                                                  offset=[0])) for r in rs], "cover it exactly once"),
])
def test_layout_of_refuses_inconsistent_ranks(break_it, error):
    rs = reports()
    break_it(rs)
    with pytest.raises(ValueError, match=error):
        layout_of(rs, pp=1)


def group_layout(lay, group: str) -> JobLayout:
    params = lay.group_params(group)
    return JobLayout(params, [BucketSpec(tuple(range(len(params))))])


def state(lay, group: str) -> dict:
    return {f"p:{p.name}": torch.full(p.shape, 0.5) for p in lay.group_params(group)}


def sharded_register(lay, group: str, with_state: bool = True, layout: JobLayout | None = None) -> m.Message:
    return m.make(m.REGISTER, state(lay, group) if with_state else {}, job="j", step=0, run="r1",
                  layout=(layout or group_layout(lay, group)).to_dict(), ring=None, training=TRAINING.to_dict(),
                  shards=lay.to_dict(), group=group)


def test_sharded_register_schema():
    lay = layout_of(reports(), pp=1)
    msg = sharded_register(lay, "pp0-tp1")
    assert m.parse(m.to_bytes(msg)).body["group"] == "pp0-tp1"
    with pytest.raises(SchemaError, match="both shards"):
        m.make(m.REGISTER, job="j", step=0, layout=group_layout(lay, "pp0-tp0").to_dict(),
               training=TRAINING.to_dict(), group="pp0-tp0")
    with pytest.raises(SchemaError, match="no DP group 'pp1-tp0'"):
        m.make(m.REGISTER, job="j", step=0, layout=group_layout(lay, "pp0-tp0").to_dict(),
               training=TRAINING.to_dict(), shards=lay.to_dict(), group="pp1-tp0")
    with pytest.raises(SchemaError, match=r"not the ring of DP group 'pp0-tp1'.*\('0.weight', \(32, 16\)\)"):
        m.make(m.REGISTER, job="j", step=0, layout=lay.global_layout().to_dict(),  # the unsharded model
               training=TRAINING.to_dict(), shards=lay.to_dict(), group="pp0-tp1")
    bad = lay.to_dict()
    bad["groups"][1]["shards"][0]["offset"] = [0, 0]  # both TP ranks claim the same rows
    with pytest.raises(SchemaError, match="shards is not a valid ShardedLayout"):
        m.make(m.REGISTER, job="j", step=0, layout=group_layout(lay, "pp0-tp0").to_dict(),
               training=TRAINING.to_dict(), shards=bad, group="pp0-tp0")
    # the unsharded REGISTER is unchanged
    plain = JobLayout([ParamSpec("w", (4, 3))], [BucketSpec((0,))])
    assert m.make(m.REGISTER, job="j", step=0, layout=plain.to_dict(), training=TRAINING.to_dict()).body["job"] == "j"


def test_plane_of_a_dp_group_takes_only_its_groups_registration():
    lay = layout_of(reports(), pp=1)
    p = AppliancePlane(SECRET, group="pp0-tp0")
    with pytest.raises(Refused, match="follows DP group 'pp0-tp0', the trainer registered group 'pp0-tp1'"):
        p._on_register(sharded_register(lay, "pp0-tp1"), None)
    plain = JobLayout([ParamSpec("w", (4, 3))], [BucketSpec((0,))])
    with pytest.raises(Refused, match="carries no sharded layout"):
        p._on_register(m.make(m.REGISTER, {"p:w": torch.zeros(4, 3)}, job="j", step=0, layout=plain.to_dict(),
                              training=TRAINING.to_dict()), None)
    assert p.app is None and p.shards is None  # nothing taken
    assert p._on_register(sharded_register(lay, "pp0-tp0"), None).body["info"] == {"step": 0}
    assert p.shards.digest() == lay.digest() and p.replica.iterations_done == 0
    assert [n for n in p.replica.named_tensors()][:1] == ["model.0.weight"]
    other = layout_of(reports(), pp=1, appliances={"pp0-tp0": "x", "pp0-tp1": "x"})
    with pytest.raises(Refused, match="sharded layout does not match"):
        p._on_register(sharded_register(other, "pp0-tp0", with_state=False), None)
    p.stop()


def test_sharded_appliance_checks_who_follows_which_group():
    lay = layout_of(reports(), pp=1)  # pp0-tp0 -> appliance-0, pp0-tp1 -> appliance-1
    sa = ShardedAppliance(SECRET, "appliance-1", ["pp0-tp0"])
    with pytest.raises(Refused, match="pp0-tp0 followed by appliance 'appliance-0'; this is 'appliance-1'"):
        sa.planes["pp0-tp0"]._on_register(sharded_register(lay, "pp0-tp0"), None)
    both = layout_of(reports(), pp=1, appliances={"pp0-tp0": "appliance-1", "pp0-tp1": "appliance-1"})
    with pytest.raises(Refused, match=r"no control plane for \['pp0-tp1'\]"):
        sa.planes["pp0-tp0"]._on_register(sharded_register(both, "pp0-tp0"), None)
    sa.stop()
    sa = ShardedAppliance(SECRET, "appliance-1", ["pp0-tp0", "pp0-tp1"])
    for g in ("pp0-tp0", "pp0-tp1"):
        sa.planes[g]._on_register(sharded_register(both, g), None)
    assert sa.wait_registered(0) and sa.steps() == {"pp0-tp0": 0, "pp0-tp1": 0}
    sa.stop()
