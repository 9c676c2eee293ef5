"""A real pipeline-parallel CPU job, PP=2 x DP=2 (gloo, DeviceMesh ("pp", "dp")), attached through
the control plane: each stage holds only its own layer of the model (the other stage's set to None,
so the parameters keep their global FQNs, torch's manual pipeline split) and its DP group is
followed by its own appliance (``tools.testbed.tp_dp_job.appliance_main``).

One micro-batch per step: stage 0 sends its activations to the stage-1 rank of its DP rank
(``dist.send``), stage 1 computes the loss and sends back the activations' gradient; each stage
then averages its gradients over its DP group and steps Adam. After every step the DP-rank-0 rank
of each stage saves its stage's state (``state_<step>_stage<s>.pt``).
"""

from __future__ import annotations

import traceback
from pathlib import Path

from mirrorckpt.tools.testbed.sharded_rig import end_rank, hold_for_fallback
from mirrorckpt.tools.testbed.tp_dp_job import SECRET, _write

DIMS = (16, 32, 8)
N = 8


class MLP:
    """Built lazily (torch is imported in the spawned process)."""

    @staticmethod
    def stage(s: int, seed: int = 5):
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(DIMS[0], DIMS[1])
                self.fc2 = nn.Linear(DIMS[1], DIMS[2])

        torch.manual_seed(seed)
        net = Net()
        if s == 0:
            net.fc2 = None
        else:
            net.fc1 = None
        return net


def batch(dp_rank: int, step: int):
    import torch

    g = torch.Generator().manual_seed(7_000 * step + dp_rank)
    return torch.randn(N, DIMS[0], generator=g), torch.randn(N, DIMS[-1], generator=g)


def stage_state(model, opt) -> dict:
    out = {}
    for n, p in model.named_parameters():
        out[f"model.{n}"] = p.detach().clone()
        for k, v in sorted(opt.state.get(p, {}).items()):
            out[f"optim.state.{n}.{k}"] = v.clone()
    return out


def trainer_main(rank: int, world: int, port: int, appliances: dict, out: str, steps: int, hold_step: int,
                 parts: int, restore: str, result: str):
    """One rank: stage = rank // 2, DP rank = rank % 2. ``restore="appliance"``: every rank pulls its
    stage's shard from its DP group's appliance and goes on unattached."""
    res: dict = {"rank": rank}
    try:
        import torch
        import torch.distributed as dist
        from mirrorckpt.control.sharded import attach_sharded, restore_sharded
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
        s, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
        peer = (1 - s) * (world // 2) + dp_rank  # the other stage's rank of this DP rank
        dp_group = mesh.get_group("dp")
        model = MLP.stage(s, seed=5 if not restore else 77)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False, fused=False)
        addrs = {g: (h, int(p)) for g, (h, p) in appliances.items()}
        # the stage comes from the mesh's "pp" dimension; the explicit stage must agree with it
        where = {"pp_stage": s, "pp": 2, "tp_dim": None} if dp_rank == 0 else {"tp_dim": None}
        link, start = None, 0
        if restore == "appliance":
            r = restore_sharded(model, opt, appliances=addrs, secret=SECRET, mesh=mesh, **where)
            start = r.iterations_done
            res["restored"] = {"source": r.source, "iterations_done": r.iterations_done}
        else:
            link = attach_sharded(model, opt, mesh, appliances=addrs, secret=SECRET, parts=parts, job="pp-dp-rig",
                                  connect_timeout=30, **where)
            link.defer_fallbacks = True  # both stages' fallbacks start after step hold_step
            res["leader"] = link.leader
            res["layout"] = link.shards.to_dict()
        outd = Path(out)
        if restore and dp_rank == 0:
            torch.save(stage_state(model, opt), outd / f"state_{start}_stage{s}.pt")
        for step in range(start, steps):
            x, y = batch(dp_rank, step)
            opt.zero_grad(set_to_none=True)
            if s == 0:
                h = torch.relu(model.fc1(x))
                dist.send(h.detach().contiguous(), dst=peer)
                gh = torch.empty_like(h)
                dist.recv(gh, src=peer)
                h.backward(gh)
            else:
                h = torch.empty(N, DIMS[1])
                dist.recv(h, src=peer)
                h.requires_grad_(True)
                nn.functional.mse_loss(model.fc2(h), y).backward()
                dist.send(h.grad.contiguous(), dst=peer)
            for p in model.parameters():  # DDP's mean over this stage's DP group
                p.grad.mul_(1.0 / mesh.size(1))
                dist.all_reduce(p.grad, group=dp_group)
            if link is not None and link.leader and step == hold_step:
                hold_for_fallback(link, res)
            opt.step()
            if dp_rank == 0:
                torch.save(stage_state(model, opt), outd / f"state_{step + 1}_stage{s}.pt")
        end_rank(link, res)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        res["fatal"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    _write(result, res)
