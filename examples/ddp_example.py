"""A plain PyTorch DDP training loop attached to a mirrorckpt appliance; CPU and gloo, so it runs
on a laptop:

    torchrun --nproc-per-node 2 examples/ddp_example.py --appliance 127.0.0.1:7070 --secret-file secret
    torchrun --nproc-per-node 2 examples/ddp_example.py --appliance 127.0.0.1:7070 --secret-file secret --restore

The loop is the usual one; what mirrorckpt adds is marked ``# mirrorckpt``. A gloo job puts no
RoCE on the wire, so an appliance protects it by fallback checkpoints (``serve --control-only``).
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
import torch.distributed as dist
from mirrorckpt.control.link.checks import appliance_address  # mirrorckpt: --appliance HOST:PORT
from mirrorckpt.control.trainer import attach  # mirrorckpt
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchdata.stateful_dataloader import StatefulDataLoader


class Position:
    """The data position: the loader's state and the epoch of its sampler (JSON)."""

    def __init__(self, loader, sampler):
        self.loader, self.sampler, self.epoch = loader, sampler, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "loader": self.loader.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        self.epoch = d["epoch"]
        self.sampler.set_epoch(self.epoch)
        self.loader.load_state_dict(d["loader"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--appliance", type=appliance_address, required=True,
                    help="the appliance's control plane, HOST:PORT")
    ap.add_argument("--secret-file", required=True, help="the shared control-plane secret")
    ap.add_argument("--restore", action="store_true", help="resume from the appliance's state")
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"rank{os.environ.get('RANK', 0)} %(name)s: %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)

    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(512, 16, generator=g)
    data = torch.utils.data.TensorDataset(inputs, inputs[:, :4].sin())
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=0)
    # a loader with its own generator: a resumed iterator then draws nothing from the global RNG
    loader = StatefulDataLoader(data, batch_size=16, sampler=sampler, generator=torch.Generator().manual_seed(0))
    position = Position(loader, sampler)

    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10_000)

    link = attach(model, opt, appliance=a.appliance, secret=open(a.secret_file).read().strip(),  # mirrorckpt
                  scheduler=sched, data=position, max_grad_norm=1.0, fingerprint_every=5,
                  restore="appliance" if a.restore else None, connect_timeout=30)
    step = link.iterations_done  # mirrorckpt: the restored step, or 0
    end = step + a.steps
    sampler.set_epoch(position.epoch)
    it = iter(loader)
    while step < end:
        try:
            x, y = next(it)
        except StopIteration:
            position.epoch += 1
            sampler.set_epoch(position.epoch)
            it = iter(loader)
            continue
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the link sees the clip on the gradients
        opt.step()
        sched.step()
        step += 1
    link.close()  # mirrorckpt: the last metadata and fingerprint go out
    logging.getLogger("example").info("trained to step %d", step)
    dist.barrier()  # every rank's last collective done before any tears gloo down (a rank could abort at exit)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
