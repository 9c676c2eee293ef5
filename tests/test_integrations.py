"""The framework adapters (control/integrations) on their frameworks' own loops, in one process
on the CPU against an in-process appliance plane: Lightning's fit and the HF Trainer with their
default scheduler wiring and clipping, attached by the adapter alone; a fallback the plane asks
for rebuilds the trainer's state bit for bit."""

from __future__ import annotations

import functools

import common
import pytest
import torch
from mirrorckpt.control.appliance_side import AppliancePlane
from mirrorckpt.control.link.checks import AttachError
from mirrorckpt.updater.fingerprint import state_sha256
from torch import nn

SECRET = "integrations-secret-0123456789abcdef"
wait_for = functools.partial(common.wait_for, timeout=30.0)
NEED = "the frameworks extra is not installed: pip install -e '.[frameworks]'"


def dataset(n: int = 256):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.TensorDataset(x, 3 * x[:, :4] + 0.1 * torch.randn(n, 4, generator=g))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def loss_of(net, x, y):
    return 10 * nn.functional.mse_loss(net(x), y)


def plane_for(module: str):
    return AppliancePlane(SECRET, parts=2, fingerprint_every=0, fallback_timeout=60,
                          lambda_modules=(module,)).start()


def ask_fallback_then_compare(plane, params, optimizer, record):
    """A hook for the loop's step ends: ask for a fallback at step 3; record the trainer's state
    hash at each step so the rebuilt replica can be compared with the same step."""
    def at_step(step: int):
        ps, os_ = state_sha256(params(), optimizer())
        record[step] = (ps, os_, optimizer().param_groups[0]["lr"])
        if step == 3:
            assert plane.request_fallback("test")
    return at_step


def replica_state(plane):
    r = plane.replica
    ps, os_ = state_sha256(r.params, r.optimizer)
    return r.iterations_done, (ps, os_, r.optimizer.param_groups[0]["lr"])


def test_lightning_fit_with_its_clip_and_a_step_scheduler_is_followed():
    pl = pytest.importorskip("pytorch_lightning", reason=NEED)
    from mirrorckpt.control.integrations.lightning import MirrorckptCallback

    record = {}

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, _i):
            return loss_of(self.net, *batch)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, foreach=False)
            sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=30)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def on_train_batch_end(self, *_a):
            at_step(self.trainer.global_step)

    plane = plane_for(__name__)
    try:
        torch.manual_seed(0)
        model = Net()
        at_step = ask_fallback_then_compare(plane, lambda: list(model.parameters()),
                                            lambda: model.trainer.optimizers[0], record)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=14, gradient_clip_val=0.05, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[MirrorckptCallback(("127.0.0.1", plane.port), SECRET, connect_timeout=10,
                                                           parts=2, fingerprint_every=0)])
        trainer.fit(model, torch.utils.data.DataLoader(dataset(), batch_size=16))
        assert wait_for(lambda: plane.stats.fallbacks_done == 1), plane.stats
        step, state = replica_state(plane)
        assert plane.training.clip.max_norm == 0.05 and plane.training.lr_schedule.name == "LinearLR"
        assert state == record[step]
    finally:
        plane.stop()


def test_lightning_refuses_what_the_replica_cannot_follow():
    pytest.importorskip("pytorch_lightning", reason=NEED)
    from mirrorckpt.control.integrations.lightning import MirrorckptCallback

    with pytest.raises(AttachError, match="restore through the Lightning callback"):
        MirrorckptCallback(("127.0.0.1", 1), SECRET, restore=True)


def test_hf_trainer_with_its_default_warmup_schedule_and_clip_is_followed(tmp_path):
    transformers = pytest.importorskip("transformers", reason=NEED)
    from mirrorckpt.control.integrations.hf import attach_trainer

    record = {}

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x, y):
            return {"loss": loss_of(self.net, x, y)}

    class Rows(torch.utils.data.Dataset):
        def __init__(self):
            self.data = dataset()

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            x, y = self.data[i]
            return {"x": x, "y": y}

    class AtStep(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            at_step(state.global_step)

    plane = plane_for("transformers.optimization")
    try:
        torch.manual_seed(0)
        model = Net()
        args = transformers.TrainingArguments(str(tmp_path), max_steps=14, per_device_train_batch_size=16,
                                              learning_rate=1e-2, warmup_steps=4, max_grad_norm=0.05,
                                              logging_strategy="no", save_strategy="no", report_to=[],
                                              use_cpu=True, dataloader_num_workers=0, seed=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows())
        at_step = ask_fallback_then_compare(plane, lambda: list(model.parameters()),
                                            lambda: getattr(trainer.optimizer, "optimizer", trainer.optimizer),
                                            record)
        cb = attach_trainer(trainer, ("127.0.0.1", plane.port), SECRET, connect_timeout=10, parts=2,
                            fingerprint_every=0)
        trainer.add_callback(AtStep())
        trainer.train()
        assert cb.link is None  # closed at the end of training
        assert wait_for(lambda: plane.stats.fallbacks_done == 1), plane.stats
        step, state = replica_state(plane)
        assert plane.training.lr_schedule.callable_paths()[0].startswith("transformers.optimization:")
        assert state == record[step]
    finally:
        plane.stop()


def test_torchtitans_default_schedule_is_refused_at_attach_with_the_reason():
    """torchtitan 0.3 builds its LambdaLR from a partial over a function nested in
    LRSchedulersContainer.Config.build: no appliance can import it (docs/trainer.md says so)."""
    lr_scheduler = pytest.importorskip("torchtitan.components.optimizer.lr_scheduler", reason=NEED)
    from mirrorckpt.control.trainer import attach

    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    container = lr_scheduler.LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=[opt], training_steps=10)
    with pytest.raises(ValueError, match=r"linear_warmup_stable_decay.*not a module-level function"):
        attach(model, opt, appliance=None, secret=SECRET, scheduler=container.schedulers[0])
