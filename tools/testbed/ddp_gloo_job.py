"""A real PyTorch DDP job over gloo/TCP: the trainer the gloo tests run, one process per rank.

Each rank builds an MLP from its own seed (so only DDP's start-up broadcast makes the ranks
agree), trains with Adam on its own synthetic batches and records what the appliance must
reproduce: the parameters after DDP's construction (``init.pt``), every iteration's reduced
gradients (``grads_<i>.pt``, rank 0), the final parameters and Adam state (``final.pt``) and the
job description (``meta.json``: names, shapes, DDP's rebuilt buckets).

Run: ``python -m mirrorckpt.tools.testbed.ddp_gloo_job --rank R --world W --master ADDR --port P --out DIR``
with ``GLOO_SOCKET_IFNAME`` set to the rank's interface.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

# About 1.5 M parameters: 512*1024+1024 + 1024*768+768 + 768*256+256.
DEFAULT_DIMS = (512, 1024, 768, 256)


def build_model(dims: tuple[int, ...], seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for k in range(len(dims) - 1):
        layers.append(nn.Linear(dims[k], dims[k + 1]))
        if k < len(dims) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def batch(dims: tuple[int, ...], seed: int, rank: int, step: int, n: int = 16):
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 1009 + step)
    return torch.randn(n, dims[0], generator=g), torch.randn(n, dims[-1], generator=g)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--port", type=int, default=29500)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--dims", default=",".join(map(str, DEFAULT_DIMS)))
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep after each step")
    ap.add_argument("--wait-file", default="", help="rank 0: before step --wait-step, wait for this file "
                                                    "(the other ranks go on into that step's all-reduces)")
    ap.add_argument("--wait-step", type=int, default=-1)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    dims = tuple(int(x) for x in a.dims.split(","))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.monotonic()
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}:{a.port}", rank=a.rank,
                            world_size=a.world)
    model = build_model(dims, a.seed + a.rank)  # different per rank: the broadcast must fix it
    t1 = time.monotonic()
    ddp = DDP(model)
    print(f"rank {a.rank}: init_process_group {t1 - t0:.2f} s, DDP {time.monotonic() - t1:.2f} s", flush=True)
    names = [n for n, _ in model.named_parameters()]
    if a.rank == 0:
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out / "init.pt")
    opt = torch.optim.Adam(model.parameters(), lr=a.lr, foreach=False, fused=False)
    for step in range(a.steps):
        if step == a.wait_step and a.wait_file and a.rank == 0:
            deadline = time.monotonic() + 60
            while not os.path.exists(a.wait_file) and time.monotonic() < deadline:
                time.sleep(0.02)
        x, y = batch(dims, a.seed, a.rank, step)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        if a.rank == 0:
            torch.save({n: p.grad.detach().clone() for n, p in model.named_parameters()},
                       out / f"grads_{step}.pt")
        opt.step()
        if a.rank == 0:
            (out / f"step_{step}.done").write_text(f"{loss.item():.6f}\n")
        if a.step_delay:
            time.sleep(a.step_delay)
    if a.rank == 0:
        torch.save({"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "optimizer": opt.state_dict()}, out / "final.pt")
        log = ddp._get_ddp_logging_data()
        meta = {
            "world": a.world, "steps": a.steps, "dims": list(dims), "seed": a.seed, "lr": a.lr,
            "names": names, "shapes": [list(p.shape) for p in model.parameters()],
            "ddp_logging": {k: v for k, v in log.items() if isinstance(v, (int, str, float))},
        }
        (out / "meta.json").write_text(json.dumps(meta, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
