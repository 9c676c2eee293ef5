"""attach_sharded on sharded-optimizer layouts (config.shard_rules): what it refuses and in which
words, and the appliance's side of registering such a group (flat-range slices, FSDP2 shards).
The real FSDP2 HSDP job, and the refusal of pure FSDP read from a real model, are
tests/e2e/test_hsdp_job.py."""

from __future__ import annotations

import pytest
import torch
from mirrorckpt.config import shard_rules
from mirrorckpt.config.layout import ParamSpec
from mirrorckpt.config.training import OptimizerSpec, TrainingSpec
from mirrorckpt.control import messages as m
from mirrorckpt.control.sharded import NotFollowable, attach_sharded, check_followable
from mirrorckpt.control.sharded_appliance import ShardedAppliance
from mirrorckpt.control.wire import SchemaError
from mirrorckpt.tools.testbed.joint import register_message

SECRET = "unit-secret-0123456789abcdef-xyz"
TRAINING = TrainingSpec(optimizer=OptimizerSpec(name="adamw", lr=0.1))
MLP = [ParamSpec("0.weight", (33, 16)), ParamSpec("0.bias", (33,)), ParamSpec("2.weight", (8, 33)),
       ParamSpec("2.bias", (8,))]


def plain_job():
    model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 8))
    return model, torch.optim.AdamW(model.parameters())


def test_attach_refuses_one_instance_megatron_naming_the_setting():
    with pytest.raises(NotFollowable, match=r"one instance.*num_distributed_optimizer_instances >= 2.*rather than "
                                            r"leave it unprotected"):
        attach_sharded(*plain_job(), layout=shard_rules.megatron(MLP, 4, 1), appliances={}, secret=SECRET)
    with pytest.raises(NotFollowable, match="set use_multi_rank_bucket_allreduce=True"):
        attach_sharded(*plain_job(), layout=shard_rules.zero(MLP, 4, multi_rank_bucket_allreduce=False),
                       appliances={}, secret=SECRET)
    with pytest.raises(NotFollowable, match="dp_replicate >= 2"):
        check_followable(shard_rules.hsdp(MLP, 1, 2))
    # weight snapshots follow FSDP2's all-gathers: a pure FSDP job may ask for them, others are told why not
    with pytest.raises(NotFollowable, match="or attach it with weights_only=True"):
        check_followable(shard_rules.hsdp(MLP, 1, 2))
    check_followable(shard_rules.hsdp(MLP, 1, 2), weights_only=True)
    with pytest.raises(ValueError, match="follows FSDP2's parameter all-gathers; a megatron layout"):
        attach_sharded(*plain_job(), layout=shard_rules.megatron(MLP, 4, 1), weights_only=True, appliances={},
                       secret=SECRET)
    with pytest.raises(ValueError, match="this job's can: attach it without weights_only"):
        check_followable(shard_rules.hsdp(MLP, 2, 2), weights_only=True)
    # followable, but no integration reads Megatron's partitions yet: said, not attempted; a ZeRO
    # layout is DeepSpeed's engine's, which its own adapter attaches
    with pytest.raises(ValueError, match="needs that framework's integration"):
        attach_sharded(*plain_job(), layout=shard_rules.megatron(MLP, 4, 2), appliances={}, secret=SECRET)
    with pytest.raises(ValueError, match="attach the engine with mirrorckpt.control.integrations.deepspeed"):
        attach_sharded(*plain_job(), layout=shard_rules.zero(MLP, 2), appliances={}, secret=SECRET)
    check_followable(shard_rules.hsdp(MLP, 2, 2))  # HSDP passes


@pytest.mark.parametrize("lay", [shard_rules.megatron(MLP, 4, 2, bucket_size=300), shard_rules.hsdp(MLP, 2, 2)],
                         ids=["megatron", "hsdp"])
def test_appliance_takes_a_sharded_optimizer_groups_registration(lay):
    full = {p.name: torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(MLP)}
    names = [g.name for g in lay.groups]
    sa = ShardedAppliance(SECRET, "appliance-0", names)
    one = shard_rules.megatron(MLP, 4, 2, bucket_size=300, appliances=["appliance-0"]) if lay.scheme == "megatron" \
        else shard_rules.hsdp(MLP, 2, 2, appliances=["appliance-0"])
    for name in names:
        sa.planes[name]._on_register(register_message(one, name, full, TRAINING.to_dict()), None)
    assert sa.wait_registered(0) and sa.steps() == {n: 0 for n in names}
    for name in names:  # each replica holds its slices: 1-d flat ranges or dim-0 blocks, as laid out
        held = sa.planes[name].replica.named_tensors(optimizer=False)
        want = {f"model.{p.name}": tuple(p.shape) for p in one.group_params(name)}
        assert {k: tuple(v.shape) for k, v in held.items()} == want
    sa.stop()
    with pytest.raises(SchemaError, match="not the ring of DP group"):  # global shapes are not a group's ring
        m.make(m.REGISTER, job="j", step=0, layout=lay.global_layout().to_dict(), training=TRAINING.to_dict(),
               shards=lay.to_dict(), group=names[1])


def test_joint_checkpoint_of_flat_slices_loads_into_the_unsharded_model(tmp_path):
    """One appliance process registers every ZeRO partition, then every Megatron shard (flat ranges
    cutting rows in two), and writes a joint checkpoint of each; dcp.load (restore.load_into) puts
    each range back at its place."""
    from mirrorckpt.tools.testbed.harness import free_port
    from mirrorckpt.tools.testbed.joint import registered_joint_main
    from mirrorckpt.tools.testbed.sharded_rig import CTX, wait_file
    from mirrorckpt.updater import restore
    from mirrorckpt.updater.manifest import read_manifest

    layouts = [shard_rules.zero(MLP, 3, reduce_bucket_size=600, appliances=["appliance-0"]),
               shard_rules.megatron(MLP, 4, 2, bucket_size=300, appliances=["appliance-0"])]
    roots = [tmp_path / "zero", tmp_path / "megatron"]
    model, _ = plain_job()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save(full, tmp_path / "weights.pt")
    proc = CTX.Process(target=registered_joint_main, args=([lay.to_dict() for lay in layouts],
                                                           str(tmp_path / "weights.pt"), f"127.0.0.1:{free_port()}",
                                                           [str(r) for r in roots], str(tmp_path / "result.json")))
    proc.start()
    out = wait_file(tmp_path / "result.json", 90, [proc])
    proc.join(30)
    assert "fatal" not in out, out.get("fatal")
    for root, committed in zip(roots, out["committed"], strict=True):
        sel = restore.select(root, verify_data=True)
        assert str(sel.path) == committed and not sel.problems
        tensors = read_manifest(sel.path)["tensors"]
        assert max(len(tensors[f"model.{p.name}"]["chunks"]) for p in MLP) > 2  # ranges cutting rows: several boxes
        fresh, opt = plain_job()
        restore.load_into(fresh, opt, root)
        for n, p in fresh.named_parameters():
            assert torch.equal(p, full[n]), (root.name, n)


def test_a_pure_fsdp_job_registers_weights_only_and_its_snapshots_are_checked():
    """Each rank of a pure FSDP job registers its own shard saying weights_only (without it the
    REGISTER is refused in words); the planes keep the trainer's parameter fingerprints, against which
    a weight snapshot is proven equal slice by slice, or named where it differs; full checkpoints are
    due once every trainer is the cadence's steps past the newest full state."""
    from mirrorckpt.control import gockpt
    from mirrorckpt.updater import numeric

    lay = shard_rules.hsdp(MLP, 1, 2, appliances=["appliance-0"])
    full = {p.name: torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(MLP)}
    names = [g.name for g in lay.groups]
    with pytest.raises(SchemaError, match="pure FSDP.*a registration of such a job says weights_only"):
        register_message(lay, names[0], full, TRAINING.to_dict())
    sa = ShardedAppliance(SECRET, "appliance-0", names)
    try:
        for name in names:
            sa.planes[name]._on_register(register_message(lay, name, full, TRAINING.to_dict(), weights_only=True),
                                         None)
        assert all(p.weights_only for p in sa.planes.values())
        for name in names:  # the trainer's fingerprints of step 3: its local shards
            g = lay.group(name)
            local = {f"model.{s.fqn}": full[s.fqn][s.offset[0]:s.offset[0] + s.shape[0]].clone() for s in g.shards}
            d = numeric.digest(local, 3)
            sa.planes[name]._on_fingerprint(m.make(m.FINGERPRINT, gockpt.digest_tensors(d), step=3,
                                                   fingerprints=d.words), None)
        assert sa.check_weights(3, full) == {n: None for n in names}
        bad = dict(full, **{"0.weight": full["0.weight"].clone()})
        bad["0.weight"][20, 3] += 1.0  # a row of shard 1 (rows 17..32)
        got = sa.check_weights(3, bad)
        assert got[names[0]] is None and "differs from the trainer's parameters in 0.weight" in got[names[1]]
        assert "no parameter fingerprints of step 4" in sa.check_weights(4, full)[names[0]]
        assert not sa.full_checkpoints_due(5)  # the trainer has not moved past step 0 yet
        for name in names:
            for step in range(1, 6):
                sa.planes[name]._on_step_meta(m.make(m.STEP_META, step=step, lr=0.1, loss_scale=None), None)
        assert sa.full_checkpoints_due(5) and not sa.full_checkpoints_due(6)
    finally:
        sa.stop()
