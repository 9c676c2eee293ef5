"""Hugging Face ``transformers.Trainer``: one call before ``train()``.

    trainer = Trainer(model=model, args=TrainingArguments(...), ...)
    cb = mirrorckpt.control.integrations.hf.attach_trainer(trainer, ("10.0.0.9", 7070), secret)
    trainer.train()                      # restore=True: trainer.train(resume_from_checkpoint=cb.resume_from)

A ``TrainerCallback`` attaches at ``on_train_begin``, when the Trainer has wrapped the model (DDP)
and built the optimizer and scheduler: the wrapped model, the torch optimizer inside accelerate's
wrapper, the scheduler (transformers' get_*_schedule_with_warmup: a LambdaLR of a functools.partial,
reported step by step unless ``report_schedule=False`` asks an appliance whose ``lambda_modules``
include ``transformers.optimization`` to rebuild it), accelerate's GradScaler, and
``args.max_grad_norm`` as ``max_grad_norm`` (the link sees the Trainer's own clip on the gradients).
The data position kept is the Trainer's own: its global step (and epoch), from which it skips the
batches already seen.

``restore=True`` pulls the appliance's state into the model and the Trainer's optimizer (built
early with ``create_optimizer``, which the Trainer then keeps) and writes it as a Trainer
checkpoint folder (weights, optimizer.pt, scheduler.pt, rng_state[_<rank>].pth with the torch RNG
state the appliance holds, trainer_state.json with its global step and epoch): the Trainer's own
``resume_from_checkpoint`` then restores the counters, skips the data and sets the RNG as it does
for its own checkpoints. ``cb.restored`` says what was restored, ``cb.resume_from`` is the folder.

Checked at attach, with the reason: DeepSpeed or FSDP under the Trainer, and whatever ``attach``
refuses. ``ddp_find_unused_parameters`` (transformers turns it on for a model without gradient
checkpointing) is followed: the extra all-reduce is in the job's sequence (config.ddp)."""

from __future__ import annotations

import logging

from mirrorckpt.control.link.checks import AttachError

log = logging.getLogger("mirrorckpt.control.integrations")


def _checked(trainer) -> None:
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False):
        raise AttachError("Trainer with DeepSpeed or FSDP: the appliance follows the Trainer's plain DDP only")


class StepPosition:
    """The Trainer's data position: its global step (the step being taken, read inside
    ``optimizer.step``) and epoch; the Trainer skips the batches of a resumed epoch itself."""

    def __init__(self, trainer):
        self.trainer = trainer

    def state_dict(self) -> dict:
        st = self.trainer.state
        return {"global_step": int(st.global_step) + 1, "epoch": float(st.epoch or 0.0)}

    def load_state_dict(self, state: dict) -> None:
        pass  # the Trainer reads it back from trainer_state.json (restore_trainer writes it)


def callback_class():
    from transformers import TrainerCallback

    class MirrorckptHFCallback(TrainerCallback):
        """Attaches the Trainer it was made for at the start of training (see the module text)."""

        def __init__(self, trainer, appliance: tuple[str, int], secret, **attach_kw):
            self.trainer, self.appliance, self.secret, self.attach_kw = trainer, appliance, secret, attach_kw
            self.link = None
            self.restored = None  # control.link.restore.Restored, with restore=True
            self.resume_from: str | None = None  # the checkpoint folder for train(resume_from_checkpoint=)

        def on_train_begin(self, args, state, control, **kwargs):
            from mirrorckpt.control.trainer import attach

            tr = self.trainer
            optimizer = getattr(tr.optimizer, "optimizer", tr.optimizer)  # accelerate's wrapper holds torch's
            scaler = getattr(tr.accelerator, "scaler", None)
            clip = float(args.max_grad_norm) if args.max_grad_norm else None
            self.link = attach(tr.model_wrapped, optimizer, appliance=self.appliance, secret=self.secret,
                               scheduler=tr.lr_scheduler, scaler=scaler, max_grad_norm=clip,
                               data=StepPosition(tr), **self.attach_kw)
            if state.global_step:  # resumed: the link counts on from the Trainer's step
                self.link.iterations_done = int(state.global_step)
                self.link.restored = self.restored
            log.info("HF Trainer attached to %s:%d at step %d (clip %s, scheduler %s)", *self.appliance,
                     state.global_step, clip, type(tr.lr_scheduler).__name__)

        def on_train_end(self, args, state, control, **kwargs):
            if self.link is not None:
                self.link.close()
                self.link = None

    return MirrorckptHFCallback


class _KeptState:
    """Takes a restored scheduler state as it is (the Trainer builds its scheduler later)."""

    state: dict | None = None

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def restore_trainer(trainer, appliance: tuple[str, int], secret, *, allow_behind: bool = False,
                    client_options: dict | None = None, directory=None):
    """The appliance's state into ``trainer``'s model and optimizer, written as a Trainer checkpoint
    folder (see the module text); (Restored, folder). Every rank calls it (each writes its RNG file)."""
    import random
    from pathlib import Path

    import numpy as np
    import torch
    import torch.distributed as dist
    from mirrorckpt.control.link.restore import restore_from_appliance
    from transformers import TrainerState

    optimizer = trainer.create_optimizer()  # the Trainer keeps an optimizer it already has
    optimizer = getattr(optimizer, "optimizer", optimizer)
    sched = _KeptState()
    restored = restore_from_appliance(trainer.model, optimizer, appliance=appliance, secret=secret, scheduler=sched,
                                      allow_behind=allow_behind, client_options=client_options)
    if sched.state is None:
        raise AttachError("the appliance's state has no scheduler state: the Trainer always builds a scheduler")
    position = restored.data_position or {}
    if position.get("global_step", restored.iterations_done) != restored.iterations_done:
        raise AttachError(f"the appliance's state is at step {restored.iterations_done} but its data position says "
                          f"global step {position.get('global_step')}")
    args = trainer.args
    out = Path(directory or Path(args.output_dir) / f"mirrorckpt-restore-{restored.iterations_done}")
    rank = args.process_index
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(trainer.model.state_dict(), out / "pytorch_model.bin")
        torch.save(optimizer.state_dict(), out / "optimizer.pt")
        torch.save(sched.state, out / "scheduler.pt")
        TrainerState(global_step=restored.iterations_done, epoch=position.get("epoch", 0.0),
                     train_batch_size=trainer._train_batch_size).save_to_json(str(out / "trainer_state.json"))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    # the appliance keeps torch's RNG states; Python's and numpy's are this process's own
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    torch.save(rng, out / (f"rng_state_{rank}.pth" if args.world_size > 1 else "rng_state.pth"))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    log.warning("HF Trainer restored step %d from %s into %s (train(resume_from_checkpoint=) resumes from it)",
                restored.iterations_done, restored.source, out)
    return restored, str(out)


def attach_trainer(trainer, appliance: tuple[str, int], secret, *, restore: bool = False, allow_behind: bool = False,
                   **attach_kw):
    """Add the callback that attaches ``trainer`` to the appliance when training starts; returns it
    (``callback.link`` is the TrainerLink once training runs). ``restore``: pull the appliance's
    state first; then call ``trainer.train(resume_from_checkpoint=callback.resume_from)``."""
    _checked(trainer)
    # serve imports no scheduler functions (no lambda_modules): transformers' partial is reported
    attach_kw.setdefault("report_schedule", True)
    cb = callback_class()(trainer, appliance, secret, **attach_kw)
    if restore:
        cb.restored, cb.resume_from = restore_trainer(trainer, appliance, secret, allow_behind=allow_behind,
                                                      client_options=attach_kw.get("client_options"))
    trainer.add_callback(cb)
    return cb
