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
    # the hook for weight snapshots of such jobs says plainly that it is not there yet
    with pytest.raises(NotImplementedError, match="weights-only protection .* not available"):
        attach_sharded(*plain_job(), layout=shard_rules.megatron(MLP, 4, 1), weights_only=True, appliances={},
                       secret=SECRET)
    # followable, but no integration reads Megatron's or DeepSpeed's partitions yet: said, not attempted
    for lay in (shard_rules.megatron(MLP, 4, 2), shard_rules.zero(MLP, 2)):
        with pytest.raises(ValueError, match="needs that framework's integration"):
            attach_sharded(*plain_job(), layout=lay, appliances={}, secret=SECRET)
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
