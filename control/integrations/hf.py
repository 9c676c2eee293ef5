"""Hugging Face ``transformers.Trainer``: one call before ``train()``.

    trainer = Trainer(model=model, args=TrainingArguments(..., ddp_find_unused_parameters=False), ...)
    mirrorckpt.control.integrations.hf.attach_trainer(trainer, ("10.0.0.9", 7070), secret)
    trainer.train()

A ``TrainerCallback`` attaches at ``on_train_begin``, when the Trainer has wrapped the model (DDP)
and built the optimizer and scheduler: the wrapped model, the torch optimizer inside accelerate's
wrapper, the scheduler (transformers' get_*_schedule_with_warmup: a LambdaLR of a
functools.partial, recorded as such), accelerate's GradScaler, and ``args.max_grad_norm`` as
``max_grad_norm`` (the link sees the Trainer's own clip on the gradients).

Checked at attach, with the reason: ``ddp_find_unused_parameters`` (transformers turns it on for
a model without gradient checkpointing: an extra all-reduce per step the appliance does not
follow; set it False), several optimizers (none in the Trainer), DeepSpeed or FSDP under the
Trainer, and whatever ``attach`` refuses. The data position is not kept (accelerate's dataloader
wrapper holds none); a restore through the Trainer is refused (its step counter and dataloader
skipping are its own checkpoint's)."""

from __future__ import annotations

import logging

from mirrorckpt.control.link.checks import AttachError

log = logging.getLogger("mirrorckpt.control.integrations")


def _checked(trainer) -> None:
    args = trainer.args
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        raise AttachError("Trainer with DeepSpeed or FSDP: use control.integrations.deepspeed, or plain DDP")
    if args.world_size > 1 and args.ddp_find_unused_parameters is not False:
        raise AttachError("TrainingArguments.ddp_find_unused_parameters is not False: transformers then builds DDP "
                          "with find_unused_parameters=True (for any model without gradient checkpointing), which "
                          "adds an all-reduce per step the appliance does not follow; set "
                          "ddp_find_unused_parameters=False")


def callback_class():
    from transformers import TrainerCallback

    class MirrorckptHFCallback(TrainerCallback):
        """Attaches the Trainer it was made for at the start of training (see the module text)."""

        def __init__(self, trainer, appliance: tuple[str, int], secret, **attach_kw):
            self.trainer, self.appliance, self.secret, self.attach_kw = trainer, appliance, secret, attach_kw
            self.link = None

        def on_train_begin(self, args, state, control, **kwargs):
            from mirrorckpt.control.trainer import attach

            tr = self.trainer
            optimizer = getattr(tr.optimizer, "optimizer", tr.optimizer)  # accelerate's wrapper holds torch's
            scaler = getattr(tr.accelerator, "scaler", None)
            clip = float(args.max_grad_norm) if args.max_grad_norm else None
            self.link = attach(tr.model_wrapped, optimizer, appliance=self.appliance, secret=self.secret,
                               scheduler=tr.lr_scheduler, scaler=scaler, max_grad_norm=clip, **self.attach_kw)
            log.info("HF Trainer attached to %s:%d (clip %s, scheduler %s)", *self.appliance, clip,
                     type(tr.lr_scheduler).__name__)

        def on_train_end(self, args, state, control, **kwargs):
            if self.link is not None:
                self.link.close()
                self.link = None

    return MirrorckptHFCallback


def attach_trainer(trainer, appliance: tuple[str, int], secret, *, restore: bool = False, **attach_kw):
    """Add the callback that attaches ``trainer`` to the appliance when training starts; returns it
    (``callback.link`` is the TrainerLink once training runs)."""
    if restore:
        raise AttachError("restore through the HF Trainer is not supported: its global step and dataloader skipping "
                          "come from its own checkpoint (resume with trainer.train(resume_from_checkpoint=))")
    _checked(trainer)
    cb = callback_class()(trainer, appliance, secret, **attach_kw)
    trainer.add_callback(cb)
    return cb
