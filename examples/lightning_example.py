"""A PyTorch Lightning fit attached to a mirrorckpt appliance by one callback; CPU and gloo, so it
runs on a laptop:

    torchrun --nproc-per-node 2 examples/lightning_example.py --appliance 127.0.0.1:7070 --secret-file secret
    torchrun --nproc-per-node 2 examples/lightning_example.py --appliance 127.0.0.1:7070 --secret-file secret \
        --restore --steps 60

The module, its optimizer and its scheduler are Lightning's defaults (a StepLR stepped per epoch,
``gradient_clip_val``); what mirrorckpt adds is marked ``# mirrorckpt``. ``--steps`` is the global
step the fit ends at (Lightning's ``max_steps``). A gloo job puts no RoCE on the wire, so an
appliance protects it by fallback checkpoints (``serve --control-only``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time

import pytorch_lightning as pl
import torch
from mirrorckpt.control.integrations.lightning import MirrorckptCallback  # mirrorckpt
from mirrorckpt.control.link.checks import appliance_address  # mirrorckpt: --appliance HOST:PORT
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader


class Regressor(pl.LightningModule):
    def __init__(self, step_delay: float = 0.0, digests: str | None = None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        self.step_delay, self.digests = step_delay, digests

    def training_step(self, batch, _index):
        x, y = batch
        return nn.functional.mse_loss(self.net(x + 0.01 * torch.randn_like(x)), y)

    def record(self, step: int, batch: float | None) -> None:
        """Each rank appends its state's hash (parameters, optimizer state), lr, epoch, batch, RNG."""
        opt = self.trainer.optimizers[0]
        h = hashlib.sha256()
        for p in self.parameters():
            h.update(p.detach().numpy().tobytes())
            for _key, v in sorted(opt.state[p].items()):  # a restored state may hold them in another order
                h.update(v.numpy().tobytes())
        with open(f"{self.digests}.{self.global_rank}", "a") as f:
            f.write(json.dumps({"step": step, "state": h.hexdigest(), "lr": opt.param_groups[0]["lr"],
                                "epoch": self.trainer.current_epoch, "batch": batch,
                                "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()}) + "\n")

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.7)}

    def on_train_start(self):
        if self.digests and self.trainer.global_step:  # the state as restored, before any step
            self.record(self.trainer.global_step, None)

    def on_train_batch_end(self, _out, batch, _index):
        if self.digests:
            self.record(self.trainer.global_step, float(batch[0].sum()))
        time.sleep(self.step_delay)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--appliance", type=appliance_address, required=True,
                    help="the appliance's control plane, HOST:PORT")
    ap.add_argument("--secret-file", required=True, help="the shared control-plane secret")
    ap.add_argument("--restore", action="store_true", help="resume from the appliance's state")
    ap.add_argument("--steps", type=int, default=40, help="the global step the fit ends at")
    ap.add_argument("--step-delay", type=float, default=0.0, help="seconds to wait after each step")
    ap.add_argument("--digests", default=None, help="each rank appends each step's state hash to this file "
                                                     "(suffixed .<rank>)")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"rank{os.environ.get('RANK', 0)} %(name)s: %(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(0)

    g = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 16, generator=g)
    data = torch.utils.data.TensorDataset(inputs, inputs[:, :4].sin())
    # a loader with its own generator: a resumed iterator then draws nothing from the global RNG
    loader = StatefulDataLoader(data, batch_size=16, generator=torch.Generator().manual_seed(0))
    callback = MirrorckptCallback(a.appliance, open(a.secret_file).read().strip(),  # mirrorckpt
                                  restore=a.restore, fingerprint_every=5, connect_timeout=30)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=a.steps, gradient_clip_val=1.0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[callback])
    trainer.fit(Regressor(a.step_delay, a.digests), loader)
    log = logging.getLogger("example")
    if callback.restored is not None:
        log.info("restored step %d from %s", callback.restored.iterations_done, callback.restored.source)
    log.info("trained to step %d", trainer.global_step)
    if torch.distributed.is_initialized():  # Lightning leaves gloo's group up: torn down before exit, where
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()  # its threads could abort a rank (SIGABRT) after training


if __name__ == "__main__":
    main()
