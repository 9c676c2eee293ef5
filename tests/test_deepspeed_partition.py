"""The link's view of a ZeRO partition (control.integrations.deepspeed.Partition) on a ZeRO-shaped
optimizer: a torch AdamW over two flat fp32 partitions, as DeepSpeed 0.19 makes them for DP rank 1
of tests/test_deepspeed_layout.py's engine. The slices are the partitions' storage, their state is
the flat state's, and a restore puts both back. The real engine: tests/e2e/test_deepspeed_job.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from mirrorckpt.control.integrations.deepspeed import Partition, zero_layout
from test_deepspeed_layout import engine


def zero_optimizer(seed: int):
    g = torch.Generator().manual_seed(seed)
    flats = [torch.randn(96, generator=g).requires_grad_(), torch.randn(10, generator=g).requires_grad_()]
    base = torch.optim.AdamW([{"params": [flats[0]], "weight_decay": 0.1}, {"params": [flats[1]], "weight_decay": 0.0}],
                             lr=1e-2, foreach=False)
    return SimpleNamespace(optimizer=base, single_partition_of_fp32_groups=flats)


def partition(seed: int) -> Partition:
    layout = zero_layout(engine())
    return Partition(zero_optimizer(seed), layout.groups[1], layout.steps["param_groups"])


def stepped(view: Partition, steps: int = 2) -> None:
    for i in range(steps):
        for flat in view.flats:
            flat.grad = torch.full_like(flat, 0.5 + i)
        view.base.step()


def test_the_slices_are_the_partitions_storage_and_their_state_the_flat_state():
    view = partition(0)
    assert [(n, tuple(p.shape)) for n, p in view.module.named_parameters()] == [
        ("0.weight", (32,)), ("2.weight", (64,)), ("0.bias", (6,)), ("2.bias", (4,))]
    assert [[id(p) for p in g["params"]] for g in view.param_groups] == [[id(p) for p in m] for m in view.members]
    assert [g["weight_decay"] for g in view.param_groups] == [0.1, 0.0]
    assert not view.state.get(view.params[0])  # never stepped: no state
    stepped(view)
    flat0, flat1 = view.flats
    assert torch.equal(view.params[1], flat0[32:96]) and torch.equal(view.params[2], flat1[0:6])
    st = view.state[view.params[1]]
    assert torch.equal(st["exp_avg"], view.base.state[flat0]["exp_avg"][32:96])
    assert st["step"] is view.base.state[flat0]["step"] and len(view.state) == 4
    grads = {0: torch.arange(96.0), 1: torch.arange(10.0)}
    view.set_grads(grads)
    assert torch.equal(view.params[3].grad, torch.arange(6.0, 10.0))
    view.clear_grads()
    assert all(p.grad is None for p in view.params)


def test_a_restore_puts_the_slices_and_their_state_back_into_fresh_partitions():
    src = partition(0)
    stepped(src)
    src.base.param_groups[0]["lr"] = 5e-3  # as a scheduler leaves it
    names = [n for n, _ in src.module.named_parameters()]
    params = {n: p.detach().clone() for n, p in zip(names, src.params)}
    ostate = {n: {k: v.clone() for k, v in src.state[p].items()} for n, p in zip(names, src.params)}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in src.param_groups]
    fresh = partition(1)
    fresh.load(params, ostate, groups)
    for a, b in zip(src.flats, fresh.flats):
        assert torch.equal(a, b)
        for k, v in src.base.state[a].items():
            assert torch.equal(fresh.base.state[b][k], v), k
    assert fresh.base.param_groups[0]["lr"] == 5e-3
    stepped(src, 1)
    stepped(fresh, 1)
    assert all(torch.equal(a, b) for a, b in zip(src.flats, fresh.flats))  # and they step alike
    ostate["2.weight"]["step"] = ostate["2.weight"]["step"] + 1
    with pytest.raises(ValueError, match="'step' differs between the slices of param group 0"):
        partition(2).load(params, ostate, groups)
