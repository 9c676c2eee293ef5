"""PyTorch Lightning: one callback.

    trainer = pl.Trainer(..., callbacks=[MirrorckptCallback(("10.0.0.9", 7070), secret)])

At ``on_train_start`` (the model wrapped by the strategy, the optimizer and scheduler built) the
callback attaches the strategy's model and the first optimizer with what Lightning configured:
its scheduler, the mixed-precision GradScaler, ``gradient_clip_val`` as ``max_grad_norm`` (the link
sees Lightning's own clip on the gradients) and the train dataloader when it keeps a position
(torchdata's StatefulDataLoader).

Refused at start, with the reason: several optimizers, manual optimization, clipping by value,
a scheduler stepped per epoch (the replica steps it per optimizer step), and whatever ``attach``
refuses (DDP options, data positions that are not JSON). A restore through the callback is
refused too: Lightning's loop counters and its dataloader iterator are made before any callback
runs, and a restore that set weights but not them would resume at the wrong step."""

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
    scheduler = None
    if configs:
        cfg = configs[0]
        if cfg.interval != "step" or cfg.frequency != 1:
            raise AttachError(f"Lightning scheduler interval={cfg.interval!r}, frequency={cfg.frequency}: the replica "
                              "steps the scheduler after every optimizer step; configure "
                              "{'interval': 'step', 'frequency': 1}")
        scheduler = cfg.scheduler
    clip = trainer.gradient_clip_val
    if clip and trainer.gradient_clip_algorithm not in (None, "norm"):
        raise AttachError(f"Lightning gradient_clip_algorithm={trainer.gradient_clip_algorithm!r}: clipping by value "
                          "is no single coefficient; use 'norm'")
    return trainer.optimizers[0], scheduler, (float(clip) if clip else None)


def _data(trainer, data):
    if data is not None:
        return data
    loader = trainer.train_dataloader
    return loader if callable(getattr(loader, "state_dict", None)) else None


def callback_class():
    pl = _lightning()

    class MirrorckptCallback(pl.Callback):
        """Attach the fit to an appliance at its start (see the module text)."""

        def __init__(self, appliance: tuple[str, int], secret, *, restore: bool = False, data=None, **attach_kw):
            if restore:
                raise AttachError("restore through the Lightning callback is not supported: Lightning builds its loop "
                                  "counters and dataloader iterator before any callback runs (resume with "
                                  "Trainer.fit(ckpt_path=) from a checkpoint instead)")
            self.appliance, self.secret = appliance, secret
            self.data, self.attach_kw = data, attach_kw
            self.link = None

        def on_train_start(self, trainer, pl_module) -> None:
            from mirrorckpt.control.trainer import attach

            optimizer, scheduler, clip = _checked(trainer, pl_module)
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            self.link = attach(trainer.strategy.model, optimizer, appliance=self.appliance, secret=self.secret,
                               scheduler=scheduler, scaler=scaler, data=_data(trainer, self.data),
                               max_grad_norm=clip, **self.attach_kw)
            log.info("Lightning fit attached to %s:%d (clip %s, scheduler %s)", *self.appliance, clip,
                     type(scheduler).__name__ if scheduler is not None else None)

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
