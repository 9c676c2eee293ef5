"""A Hugging Face Trainer attached to a mirrorckpt appliance by one call; CPU and gloo, so it runs
on a laptop:

    torchrun --nproc-per-node 2 examples/hf_example.py --appliance 127.0.0.1:7070 --secret-file secret
    torchrun --nproc-per-node 2 examples/hf_example.py --appliance 127.0.0.1:7070 --secret-file secret --restore

The Trainer runs its defaults (linear warmup schedule, ``max_grad_norm`` clipping, a seeded
shuffling sampler, DDP with ``find_unused_parameters``); what mirrorckpt adds is marked ``#
mirrorckpt``. ``--steps`` is the Trainer's ``max_steps``: the schedule spans it, so a resumed run
passes the same value. A gloo job puts no RoCE on the wire, so an appliance protects it by fallback
checkpoints (``serve --control-only``). """

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time

import torch
import transformers
from mirrorckpt.control.integrations.hf import attach_trainer  # mirrorckpt
from mirrorckpt.control.link.checks import appliance_address  # mirrorckpt: --appliance HOST:PORT
from torch import nn


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x, y):
        return {"loss": nn.functional.mse_loss(self.net(x + 0.01 * torch.randn_like(x)), y)}


class Rows(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(256, 16, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.x[i, :4].sin()}


class Record(transformers.TrainerCallback):
    """Each rank appends its state's hash (parameters, optimizer state), lr, epoch and RNG after each
    step (``--digests``); ``--stop-at`` ends training there, as if the job were killed."""

    def __init__(self, trainer, path: str | None, stop_at: int | None, delay: float):
        self.trainer, self.path, self.stop_at, self.delay = trainer, path, stop_at, delay

    def write(self, step: int, epoch: float) -> None:
        opt = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)
        h = hashlib.sha256()
        for p in self.trainer.model.parameters():
            h.update(p.detach().numpy().tobytes())
            for _key, v in sorted(opt.state[p].items()):
                h.update(v.numpy().tobytes())
        with open(f"{self.path}.{self.trainer.args.process_index}", "a") as f:
            f.write(json.dumps({"step": step, "state": h.hexdigest(), "lr": opt.param_groups[0]["lr"],
                                "epoch": round(epoch, 6),
                                "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()}) + "\n")

    def on_step_end(self, args, state, control, **kw):
        if self.path:
            self.write(state.global_step, state.epoch)
        if self.stop_at is not None and state.global_step >= self.stop_at:
            control.should_training_stop = True
        time.sleep(self.delay)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--appliance", type=appliance_address, required=True,
                    help="the appliance's control plane, HOST:PORT")
    ap.add_argument("--secret-file", required=True, help="the shared control-plane secret")
    ap.add_argument("--restore", action="store_true", help="resume from the appliance's state")
    ap.add_argument("--steps", type=int, default=40, help="the Trainer's max_steps")
    ap.add_argument("--stop-at", type=int, default=None, help="stop training at this global step")
    ap.add_argument("--step-delay", type=float, default=0.0, help="seconds to wait after each step")
    ap.add_argument("--digests", default=None, help="each rank appends each step's state hash to this file "
                                                     "(suffixed .<rank>)")
    ap.add_argument("--output-dir", default="hf-example-out")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format=f"rank{os.environ.get('RANK', 0)} %(name)s: %(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(0)

    args = transformers.TrainingArguments(a.output_dir, max_steps=a.steps, per_device_train_batch_size=16,
                                          learning_rate=1e-2, warmup_steps=4, use_cpu=True, ddp_backend="gloo",
                                          logging_strategy="no", save_strategy="no", report_to=[],
                                          disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = transformers.Trainer(model=Regressor(), args=args, train_dataset=Rows())
    callback = attach_trainer(trainer, a.appliance, open(a.secret_file).read().strip(),  # mirrorckpt
                              restore=a.restore, fingerprint_every=5, connect_timeout=30)
    record = Record(trainer, a.digests, a.stop_at, a.step_delay)
    trainer.add_callback(record)
    if a.restore and a.digests:  # the state as restored, before any step
        record.write(callback.restored.iterations_done, 0.0)
    trainer.train(resume_from_checkpoint=callback.resume_from)  # mirrorckpt: None unless restored
    log = logging.getLogger("example")
    if callback.restored is not None:
        log.info("restored step %d from %s", callback.restored.iterations_done, callback.restored.source)
    log.info("trained to step %d", trainer.state.global_step)
    if torch.distributed.is_initialized():  # the Trainer leaves gloo's group up: torn down before exit, where
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()  # its threads could abort a rank (SIGABRT) after training


if __name__ == "__main__":
    main()
