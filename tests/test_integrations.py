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


class HFNet(nn.Module):
    """The MLP as a transformers model: a dict with the loss; ``noise``: input noise from the global RNG."""

    def __init__(self, noise: bool = False):
        super().__init__()
        self.net, self.noise = mlp(), noise

    def forward(self, x, y):
        return {"loss": loss_of(self.net, x + 0.01 * torch.randn_like(x) if self.noise else x, y)}


class Rows(torch.utils.data.Dataset):
    """``dataset(n)`` as the rows a transformers Trainer collates."""

    def __init__(self, n: int = 256):
        self.data = dataset(n)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return {"x": x, "y": y}


def plane_for(module: str):
    return AppliancePlane(SECRET, parts=2, fingerprint_every=0, fallback_timeout=60,
                          lambda_modules=(module,)).start()


def ask_fallback(plane, link, rearms: int = 0) -> None:
    """Ask for a fallback and hold the training thread until the trainer's link has the request: on
    a loaded machine it could otherwise arrive after the job's last step, and never complete. A
    plane that saw an earlier run must have taken this run's registration first (``rearms``): a
    re-arm ends a fallback asked for before it."""
    assert wait_for(lambda: plane.stats.rearms == rearms), plane.stats
    assert plane.request_fallback("test")
    assert wait_for(lambda: link().fallback_pending)


def ask_fallback_then_compare(plane, params, optimizer, record, link):
    """A hook for the loop's step ends: ask for a fallback at step 3; record the trainer's state
    hash at each step so the rebuilt replica can be compared with the same step."""
    def at_step(step: int):
        ps, os_ = state_sha256(params(), optimizer())
        record[step] = (ps, os_, optimizer().param_groups[0]["lr"])
        if step == 3:
            ask_fallback(plane, link)
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
        cb = MirrorckptCallback(("127.0.0.1", plane.port), SECRET, connect_timeout=10, parts=2, fingerprint_every=0)
        at_step = ask_fallback_then_compare(plane, lambda: list(model.parameters()),
                                            lambda: model.trainer.optimizers[0], record, lambda: cb.link)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=14, gradient_clip_val=0.05, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[cb])
        trainer.fit(model, torch.utils.data.DataLoader(dataset(), batch_size=16))
        assert wait_for(lambda: plane.stats.fallbacks_done == 1), plane.stats
        step, state = replica_state(plane)
        assert plane.training.clip.max_norm == 0.05 and plane.training.lr_schedule.name == "LinearLR"
        assert state == record[step]
    finally:
        plane.stop()


def lightning_fit(pl, plane, steps: int, record: dict, restore: bool = False, fallback_at: int | None = None):
    """A Lightning fit with Lightning's defaults: a StepLR stepped per epoch (interval="epoch"),
    gradient_clip_val, a StatefulDataLoader of 6 batches an epoch (with its own generator), input
    noise from the global RNG; ``record[global_step]``: the state after each batch. Returns the callback."""
    from mirrorckpt.control.integrations.lightning import MirrorckptCallback
    from torchdata.stateful_dataloader import StatefulDataLoader

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, _i):
            x, y = batch
            return loss_of(self.net, x + 0.01 * torch.randn_like(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, foreach=False)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}

        def on_train_batch_end(self, _out, batch, batch_idx):
            t = self.trainer
            ps, os_ = state_sha256(list(self.parameters()), t.optimizers[0])
            record[t.global_step] = (ps, os_, t.optimizers[0].param_groups[0]["lr"], t.current_epoch, batch_idx,
                                     float(batch[0].sum()), hash(torch.get_rng_state().numpy().tobytes()))
            if t.global_step == fallback_at:
                ask_fallback(plane, lambda: cb.link, rearms=1)  # the uninterrupted run registered first

    torch.manual_seed(0)
    model = Net()
    cb = MirrorckptCallback(("127.0.0.1", plane.port), SECRET, restore=restore, connect_timeout=10, parts=2,
                            fingerprint_every=0, allow_behind=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, gradient_clip_val=0.05, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[cb])
    # its own generator: an iterator's base seed drawn from the global RNG would move it after a restore
    trainer.fit(model, StatefulDataLoader(dataset(96), batch_size=16, generator=torch.Generator().manual_seed(1)))
    return cb


def test_lightning_with_its_default_epoch_scheduler_is_killed_and_resumed_from_the_appliance():
    """Lightning's defaults attached by the callback alone; a fallback verifies; a new fit with
    restore=True resumes at the appliance's step and goes on as the uninterrupted fit did: weights,
    optimizer, the per-epoch schedule, global step, epoch, batch index, data and RNG."""
    pl = pytest.importorskip("pytorch_lightning", reason=NEED)
    plane = plane_for(__name__)
    try:
        whole, first, resumed = {}, {}, {}
        lightning_fit(pl, plane, 14, whole)
        lightning_fit(pl, plane, 8, first, fallback_at=2)  # the job "killed" after step 8
        assert wait_for(lambda: plane.stats.fallbacks_done == 1), plane.stats
        step = plane.replica.iterations_done
        assert plane.training.lr_schedule.reported and 2 < step <= 8
        cb = lightning_fit(pl, plane, 14, resumed, restore=True)
        assert cb.restored is not None and cb.restored.iterations_done == step
        assert min(resumed) == step + 1 and max(resumed) == 14
        assert {s: resumed[s] for s in resumed} == {s: whole[s] for s in resumed}
        assert len({v[3] for v in resumed.values()}) > 1  # an epoch boundary (and its scheduler step) was crossed
    finally:
        plane.stop()


def test_hf_trainer_with_its_default_warmup_schedule_and_clip_is_followed(tmp_path):
    transformers = pytest.importorskip("transformers", reason=NEED)
    from mirrorckpt.control.integrations.hf import attach_trainer

    record = {}

    class AtStep(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            at_step(state.global_step)

    plane = plane_for("transformers.optimization")
    try:
        torch.manual_seed(0)
        model = HFNet()
        args = transformers.TrainingArguments(str(tmp_path), max_steps=14, per_device_train_batch_size=16,
                                              learning_rate=1e-2, warmup_steps=4, max_grad_norm=0.05,
                                              logging_strategy="no", save_strategy="no", report_to=[],
                                              use_cpu=True, dataloader_num_workers=0, seed=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows())
        at_step = ask_fallback_then_compare(plane, lambda: list(model.parameters()),
                                            lambda: getattr(trainer.optimizer, "optimizer", trainer.optimizer),
                                            record, lambda: cb.link)
        cb = attach_trainer(trainer, ("127.0.0.1", plane.port), SECRET, connect_timeout=10, parts=2,
                            fingerprint_every=0, report_schedule=False)  # rebuilt: the plane imports transformers
        trainer.add_callback(AtStep())
        trainer.train()
        assert cb.link is None  # closed at the end of training
        assert wait_for(lambda: plane.stats.fallbacks_done == 1), plane.stats
        step, state = replica_state(plane)
        assert plane.training.lr_schedule.callable_paths()[0].startswith("transformers.optimization:")
        assert state == record[step]
    finally:
        plane.stop()


def hf_train(transformers, plane, tmp_path, record: dict, stop_at: int = 14, restore: bool = False,
             fallback_at: int | None = None):
    """A Trainer with its defaults (linear warmup schedule, clip, a seeded shuffling sampler over
    6 batches an epoch) and input noise from the global RNG; ``record[global_step]``: the state
    after each step; training stops at ``stop_at`` (the job killed). Returns the callback."""
    from mirrorckpt.control.integrations.hf import attach_trainer

    class AtStep(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
            ps, os_ = state_sha256(list(model.parameters()), opt)
            record[state.global_step] = (ps, os_, opt.param_groups[0]["lr"], round(state.epoch, 6),
                                         hash(torch.get_rng_state().numpy().tobytes()))
            if state.global_step == fallback_at:
                ask_fallback(plane, lambda: cb.link, rearms=1)  # the uninterrupted run registered first
            control.should_training_stop = state.global_step >= stop_at

    torch.manual_seed(0)
    model = HFNet(noise=True)
    args = transformers.TrainingArguments(str(tmp_path), max_steps=14, per_device_train_batch_size=16,
                                          learning_rate=1e-2, warmup_steps=4, max_grad_norm=0.05,
                                          logging_strategy="no", save_strategy="no", report_to=[],
                                          use_cpu=True, dataloader_num_workers=0, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(96))
    cb = attach_trainer(trainer, ("127.0.0.1", plane.port), SECRET, connect_timeout=10, parts=2,
                        fingerprint_every=0, restore=restore, allow_behind=True)
    trainer.add_callback(AtStep())
    trainer.train(resume_from_checkpoint=cb.resume_from)
    return cb


def test_hf_trainer_with_its_defaults_is_killed_and_resumed_from_the_appliance(tmp_path):
    """The Trainer's defaults attached by attach_trainer alone; a fallback verifies; a new Trainer
    restored from the appliance resumes through its own resume_from_checkpoint and goes on as the
    uninterrupted run did: weights, optimizer, schedule, global step, epoch, data order, RNG."""
    transformers = pytest.importorskip("transformers", reason=NEED)
    plane = plane_for("transformers.optimization")
    try:
        whole, first, resumed = {}, {}, {}
        hf_train(transformers, plane, tmp_path / "whole", whole)
        hf_train(transformers, plane, tmp_path / "first", first, stop_at=8, fallback_at=2)
        assert wait_for(lambda: plane.stats.fallbacks_done == 1), plane.stats
        step = plane.replica.iterations_done
        assert 2 < step <= 8
        cb = hf_train(transformers, plane, tmp_path / "resumed", resumed, restore=True)
        assert cb.restored is not None and cb.restored.iterations_done == step
        assert min(resumed) == step + 1 and max(resumed) == 14
        assert {s: resumed[s] for s in resumed} == {s: whole[s] for s in resumed}
        assert int(resumed[14][3]) > int(resumed[step + 1][3])  # an epoch boundary was crossed
    finally:
        plane.stop()


def test_torchtitans_default_schedule_is_followed_from_the_trainers_reports():
    """torchtitan 0.3 builds its LambdaLR from a partial over a function nested in
    LRSchedulersContainer.Config.build: no appliance can import it, so its steps are reported."""
    lr_scheduler = pytest.importorskip("torchtitan.components.optimizer.lr_scheduler", reason=NEED)
    from mirrorckpt.control.trainer import attach

    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    container = lr_scheduler.LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=[opt], training_steps=10)
    link = attach(model, opt, appliance=None, secret=SECRET, scheduler=container.schedulers[0])
    link.close()
    assert link.training.lr_schedule.reported
    assert link.training.lr_schedule.kwargs["scheduler"] == "torch.optim.lr_scheduler:LambdaLR"


def titan_loop(plane, record: dict, *, stop_at: int, restore: bool = False, fallback_at: int | None = None):
    """torchtitan's loop pieces: OptimizersContainer(default_adamw), its LRSchedulersContainer
    (warmup, then linear decay), its clip_grad_norm_, a StatefulDataLoader with its own generator,
    input noise from the global RNG; ``record[step]``: the state after each step. Returns the link."""
    from mirrorckpt.control.integrations.torchtitan import attach_torchtitan
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, default_adamw
    from torchtitan.distributed.utils import clip_grad_norm_

    torch.manual_seed(0)
    model = mlp()
    config = default_adamw(lr=1e-2)
    config.implementation = "for-loop"
    optimizers = OptimizersContainer(config, model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(optimizers=optimizers, training_steps=14)
    loader = StatefulDataLoader(dataset(96), batch_size=16, generator=torch.Generator().manual_seed(1))
    link = attach_torchtitan([model], optimizers, schedulers, ("127.0.0.1", plane.port), SECRET, max_norm=0.05,
                             data=loader, restore=restore, connect_timeout=10, parts=2, fingerprint_every=0,
                             allow_behind=True)
    step = link.iterations_done
    while step < stop_at:
        for x, y in loader:
            optimizers.zero_grad()
            loss_of(model, x + 0.01 * torch.randn_like(x), y).backward()
            clip_grad_norm_(list(model.parameters()), 0.05)
            optimizers.step()
            schedulers.step()
            step += 1
            opt = optimizers.optimizers[0]
            ps, os_ = state_sha256(list(model.parameters()), opt)
            record[step] = (ps, os_, opt.param_groups[0]["lr"], float(x.sum()),
                            hash(torch.get_rng_state().numpy().tobytes()))
            if step == fallback_at:  # once the plane took this run's registration (a re-arm ends a fallback)
                ask_fallback(plane, lambda: link, rearms=1)
            if step == stop_at:
                break
    link.close()
    return link


def test_torchtitans_loop_pieces_are_killed_and_resumed_from_the_appliance():
    """torchtitan's default schedule (reported) and clipping, attached by attach_torchtitan alone;
    a fallback verifies; a new loop restored from the appliance goes on as the uninterrupted one."""
    pytest.importorskip("torchtitan", reason=NEED)
    plane = plane_for(__name__)
    try:
        whole, first, resumed = {}, {}, {}
        titan_loop(plane, whole, stop_at=14)
        titan_loop(plane, first, stop_at=8, fallback_at=2)
        assert wait_for(lambda: plane.stats.fallbacks_done == 1), plane.stats
        step = plane.replica.iterations_done
        assert plane.training.lr_schedule.reported and 2 < step <= 8
        link = titan_loop(plane, resumed, stop_at=14, restore=True)
        assert link.restored is not None and link.restored.iterations_done == step
        assert min(resumed) == step + 1 and max(resumed) == 14
        assert {s: resumed[s] for s in resumed} == {s: whole[s] for s in resumed}
    finally:
        plane.stop()
