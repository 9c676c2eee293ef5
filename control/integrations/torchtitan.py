"""torchtitan: its training-loop pieces attached with one call.

    optimizers = OptimizersContainer(default_adamw(lr=3e-4), model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=200).build(optimizers=optimizers,
                                                                        training_steps=steps)
    link = attach_torchtitan([ddp_model], optimizers, lr_schedulers, ("10.0.0.9", 7070), secret,
                             max_norm=1.0, data=dataloader)            # restore=True to resume
    ... torchtitan's loop: optimizers.step(), lr_schedulers.step(), its clip_grad_norm_ ...

The containers are unwrapped to the torch optimizer and LambdaLR they hold (the container's step
calls the optimizer's, where the link's hooks are). torchtitan's schedule, a LambdaLR of a partial
over a function nested in ``LRSchedulersContainer.Config.build``, cannot be imported by an
appliance: it is reported step by step (config.training.REPORTED). ``max_norm`` is the job's
``max_norm`` (torchtitan.distributed.utils.clip_grad_norm_ clips with torch's reduction on one
pipeline stage: the link sees the coefficient on the gradients). ``data``: the dataloader
(torchtitan's ParallelAwareDataloader is a StatefulDataLoader). ``restore=True`` pulls the
appliance's state into the model, optimizer, scheduler, RNG and ``data`` before the first step;
``link.restored`` says what was restored and ``link.iterations_done`` is the step to go on from.

Refused, with the reason: several model parts (pipeline parallelism), several optimizers in the
container (mixed optimizer types), and whatever ``attach`` refuses (DTensor parameters: FSDP/TP
jobs attach with control.sharded.attach_sharded).
"""

from __future__ import annotations

from mirrorckpt.control.link.checks import AttachError


def attach_torchtitan(model_parts: list, optimizers, lr_schedulers, appliance: tuple[str, int], secret, *,
                      max_norm: float | None = None, data=None, restore: bool = False, **attach_kw):
    """Attach torchtitan's model part, OptimizersContainer and LRSchedulersContainer (see the
    module text); returns the TrainerLink."""
    from mirrorckpt.control.trainer import attach

    if len(model_parts) != 1:
        raise AttachError(f"torchtitan with {len(model_parts)} model parts (pipeline parallelism): the appliance "
                          "follows one data-parallel ring per job")
    inner = list(getattr(optimizers, "optimizers", [optimizers]))
    if len(inner) != 1:
        raise AttachError(f"torchtitan's OptimizersContainer holds {len(inner)} optimizers (mixed optimizer types "
                          "or model parts): the appliance follows one")
    schedulers = list(getattr(lr_schedulers, "schedulers", [lr_schedulers])) if lr_schedulers is not None else []
    if len(schedulers) > 1:
        raise AttachError(f"torchtitan's LRSchedulersContainer holds {len(schedulers)} schedulers: the appliance "
                          "follows one")
    return attach(model_parts[0], inner[0], appliance=appliance, secret=secret,
                  scheduler=schedulers[0] if schedulers else None, data=data, max_grad_norm=max_norm,
                  restore="appliance" if restore else None, **attach_kw)
