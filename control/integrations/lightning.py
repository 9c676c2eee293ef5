"""PyTorch Lightning: one callback.

    trainer = pl.Trainer(..., callbacks=[MirrorckptCallback(("10.0.0.9", 7070), secret)])

At ``on_fit_start`` (the model wrapped by the strategy, the optimizer and scheduler built, no data
iterated yet) the callback attaches the strategy's model and the first optimizer with what
Lightning configured: its scheduler (one stepped per epoch or every N steps, Lightning's default
``interval="epoch"``, is followed from the trainer's reports: attach(report_schedule=True)), the
mixed-precision GradScaler and ``gradient_clip_val`` as ``max_grad_norm`` (the link sees
Lightning's own clip on the gradients).

The data position the link keeps is Lightning's own: the fit loop's ``state_dict()`` (epoch,
batch and optimizer-step progress, and the state of a stateful train dataloader such as
torchdata's StatefulDataLoader), in the shape Lightning saves at ``on_train_batch_end``.
``restore=True`` pulls the appliance's state at ``on_fit_start`` into the model, optimizer,
scheduler, scaler and RNG and hands the loop state to ``fit_loop.load_state_dict``: Lightning then
resumes as from its own mid-epoch checkpoint (global step, epoch, batch index, the loader's
position). ``callback.restored`` says what was restored.

Refused at start, with the reason: several optimizers, manual optimization, clipping by value,
and whatever ``attach`` refuses (DDP options, data positions that are not JSON)."""

from __future__ import annotations

import logging

from mirrorckpt.control.link.checks import AttachError

log = logging.getLogger("mirrorckpt.control.integrations")


def _lightning():
    try:
        import pytorch_lightning as pl
    except ImportError:  # the unified package ships the same classes
        import lightning.pytorch as pl
    return pl


def _checked(trainer, module) -> tuple:
    """(optimizer, scheduler, max_grad_norm) of a Lightning fit the appliance can follow."""
    if not module.automatic_optimization:
        raise AttachError("Lightning manual optimization: the loop's steps are the module's own; attach the "
                          "optimizer in the module with control.trainer.attach instead")
    if len(trainer.optimizers) != 1:
        raise AttachError(f"Lightning with {len(trainer.optimizers)} optimizers: the appliance follows one")
    configs = trainer.lr_scheduler_configs
    if len(configs) > 1:
        raise AttachError(f"Lightning with {len(configs)} schedulers: the appliance follows one")
    scheduler = configs[0].scheduler if configs else None
    clip = trainer.gradient_clip_val
    if clip and trainer.gradient_clip_algorithm not in (None, "norm"):
        raise AttachError(f"Lightning gradient_clip_algorithm={trainer.gradient_clip_algorithm!r}: clipping by value "
                          "is no single coefficient; use 'norm'")
    return trainer.optimizers[0], scheduler, (float(clip) if clip else None)


def _stepped_per_step(trainer) -> bool:
    """The scheduler steps once after every optimizer step (else its steps are reported)."""
    configs = trainer.lr_scheduler_configs
    return not configs or (configs[0].interval == "step" and configs[0].frequency == 1)


class LoopPosition:
    """A Lightning fit's position as its own loops keep it: ``fit_loop.state_dict()`` (progress
    counters and the stateful train loader's state), read inside ``optimizer.step`` and written
    as Lightning's checkpoint at ``on_train_batch_end`` holds it (the batch processed, its
    optimizer step completed), so that ``fit_loop.load_state_dict`` resumes after that batch."""

    def __init__(self, trainer):
        self.trainer = trainer

    def state_dict(self) -> dict:
        state = self.trainer.fit_loop.state_dict()
        batches = state.get("epoch_loop.batch_progress")
        if batches is not None:
            for part in ("total", "current"):
                batches[part]["processed"] = batches[part]["started"]
        steps = state.get("epoch_loop.automatic_optimization.optim_progress", {}).get("optimizer", {}).get("step")
        if steps is not None:
            for part in ("total", "current"):
                steps[part]["completed"] = steps[part]["ready"]
        return state

    def load_state_dict(self, state: dict) -> None:
        self.trainer.fit_loop.load_state_dict(state)


def _iterate_again(trainer, position: dict) -> None:
    """Lightning makes the train iterator (``setup_data``) before it sets the samplers' epoch
    (``on_advance_start``): resumed mid-epoch, a DistributedSampler's iterator would replay epoch
    0's order. Set the resumed epoch, load the loaders' states again and make the iterator anew."""
    from lightning_fabric.utilities.data import _set_sampler_epoch

    loop = trainer.fit_loop
    if loop._combined_loader is None or loop._data_fetcher is None:
        return
    for loader in loop._combined_loader.flattened:
        _set_sampler_epoch(loader, loop.epoch_progress.current.processed)
    states = (position.get("state_dict") or {}).get("combined_loader")
    if states:
        loop._combined_loader._load_state_dicts(states)
    iter(loop._data_fetcher)


def callback_class():
    pl = _lightning()

    class MirrorckptCallback(pl.Callback):
        """Attach the fit to an appliance at its start (see the module text)."""

        def __init__(self, appliance: tuple[str, int], secret, *, restore: bool = False, **attach_kw):
            self.appliance, self.secret = appliance, secret
            self.restore, self.attach_kw = restore, attach_kw
            self.link = None
            self.restored = None  # control.link.restore.Restored, after a restore

        def on_fit_start(self, trainer, pl_module) -> None:
            from mirrorckpt.control.trainer import attach

            optimizer, scheduler, clip = _checked(trainer, pl_module)
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            self.link = attach(trainer.strategy.model, optimizer, appliance=self.appliance, secret=self.secret,
                               scheduler=scheduler, scaler=scaler, data=LoopPosition(trainer),
                               max_grad_norm=clip, report_schedule=not _stepped_per_step(trainer),
                               restore="appliance" if self.restore else None, **self.attach_kw)
            self.restored = self.link.restored
            if self.restored is not None:
                log.warning("Lightning fit resumes at global step %d, epoch %d, from %s", trainer.global_step,
                            trainer.current_epoch, self.restored.source)
            log.info("Lightning fit attached to %s:%d (clip %s, scheduler %s, %s)", *self.appliance, clip,
                     type(scheduler).__name__ if scheduler is not None else None,
                     self.link.training.lr_schedule.name)

        def on_train_start(self, trainer, pl_module) -> None:
            if self.restored is not None and isinstance(self.restored.data_position, dict):
                _iterate_again(trainer, self.restored.data_position)

        def on_train_end(self, trainer, pl_module) -> None:
            if self.link is not None:
                self.link.close()
                self.link = None

        def on_exception(self, trainer, pl_module, exception) -> None:
            self.on_train_end(trainer, pl_module)

    return MirrorckptCallback


def MirrorckptCallback(appliance: tuple[str, int], secret, **kw):  # noqa: N802 - reads as the class it makes
    """A Lightning callback attaching the fit to the appliance at ``appliance`` (see the module text)."""
    return callback_class()(appliance, secret, **kw)
