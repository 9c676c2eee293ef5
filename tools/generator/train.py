"""The generator's trainer: a real data-parallel training job, R ranks simulated in one process.

Every collective goes through a ``Comm``. The packetiser implements it and emits the frames NCCL
would send; ``LocalComm`` computes the results only, for tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from mirrorckpt.config.layout import JobLayout
from mirrorckpt.config.training import LossScaleSpec, LRScheduleSpec, OptimizerSpec, TrainingSpec
from mirrorckpt.updater.fingerprint import state_sha256

from . import models
from .ddp import DDP
from .truth import CollectiveRecord, IterationRecord, RecordingComm, sha256_arrays


class Comm(Protocol):
    """Collectives over R ranks, each rank's buffer a flat numpy array (config.layout.numpy_dtype:
    bfloat16 travels as its uint16 bits). ``what`` names the collective: "param_count", "shapes",
    "init_params:K", "rebuild_indices", "rebuild_sizes", "grad:iter=I:bucket=B" (0-based I, B)."""

    def all_gather(self, per_rank: list[np.ndarray], what: str) -> list[np.ndarray]: ...

    def broadcast(self, data: np.ndarray, root: int, what: str) -> np.ndarray: ...

    def all_reduce(self, per_rank: list[np.ndarray], what: str) -> np.ndarray: ...


def _as_torch(a: np.ndarray) -> torch.Tensor:
    # uint16 on the wire is always bfloat16 (config.layout.numpy_dtype)
    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def sum_in_rank_order(per_rank: Sequence[np.ndarray]) -> np.ndarray:
    """((x0 + x1) + x2) + ..., each addition rounded to the element type (torch CPU arithmetic,
    as NCCL and gloo add two 16-bit floats). Equal to NCCL's ring result for 2 ranks."""
    acc = _as_torch(per_rank[0])
    for a in per_rank[1:]:
        acc = acc + _as_torch(a)
    return _as_numpy(acc)


class LocalComm:
    """Comm without a wire: results only. ``reduce_fn(per_rank) -> reduced`` decides the
    summation order (for R > 2 pass the NCCL ring order's reduction)."""

    def __init__(self, reduce_fn: Callable[[Sequence[np.ndarray]], np.ndarray] = sum_in_rank_order):
        self.reduce_fn = reduce_fn

    def all_gather(self, per_rank: list[np.ndarray], what: str) -> list[np.ndarray]:
        return [np.array(a, copy=True) for a in per_rank]

    def broadcast(self, data: np.ndarray, root: int, what: str) -> np.ndarray:
        return np.array(data, copy=True)

    def all_reduce(self, per_rank: list[np.ndarray], what: str) -> np.ndarray:
        if len({(a.dtype, a.shape) for a in per_rank}) != 1:
            raise ValueError(f"{what}: ranks disagree on dtype or size")
        return np.asarray(self.reduce_fn(per_rank))


# ---------------------------------------------------------------------------------------------
# the training job

TORCH_GRAD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TrainResult:
    config: dict
    layout: JobLayout
    collectives: list[CollectiveRecord]
    iterations: list[IterationRecord]
    initial_params: list[torch.Tensor]  # as broadcast by DDP, in the model's dtype, layout order
    model: nn.Module
    masters: list[torch.Tensor]  # fp32 parameters the optimizer owns (the model's own for fp32)
    optimizer: torch.optim.Optimizer
    scheduler: object | None
    reduced: list[list[np.ndarray]] | None = None  # per iteration, per bucket (keep_reduced=True)


def build_optimizer(params: list[torch.Tensor], spec: OptimizerSpec) -> torch.optim.Optimizer:
    common = dict(lr=spec.lr, weight_decay=spec.weight_decay, maximize=spec.maximize,
                  foreach=spec.foreach, fused=spec.fused)
    if spec.name == "sgd":
        return torch.optim.SGD(params, momentum=spec.momentum, dampening=spec.dampening,
                               nesterov=spec.nesterov, **common)
    cls = torch.optim.Adam if spec.name == "adam" else torch.optim.AdamW
    return cls(params, betas=spec.betas, eps=spec.eps, amsgrad=spec.amsgrad, **common)


def build_scheduler(optimizer: torch.optim.Optimizer, spec: LRScheduleSpec):
    if not spec.enabled:
        return None
    return getattr(torch.optim.lr_scheduler, spec.name)(optimizer, **spec.kwargs)


@contextmanager
def intra_op_threads(n: int):
    # Float sums inside matmuls depend on how many threads split them: fix it so a run is
    # reproducible on any machine.
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class LossScaler:
    """fp16 dynamic loss scaling as ARCHITECTURE.md states it (GradScaler's arithmetic: the scale
    is a float32 value, unscaling multiplies by its float32 reciprocal)."""

    def __init__(self, spec: LossScaleSpec):
        self.spec = spec
        self.scale = float(np.float32(spec.init_scale))
        self.good_steps = 0

    def unscale(self, grads: list[torch.Tensor]) -> bool:
        """Multiply ``grads`` by 1/scale in place; True when any of them holds inf or nan."""
        found_inf = not all(bool(torch.isfinite(g).all()) for g in grads)
        inv = torch.tensor(self.scale, dtype=torch.float64).reciprocal().float()
        for g in grads:
            g.mul_(inv)
        return found_inf

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = float(np.float32(self.scale * self.spec.backoff_factor))
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.spec.growth_interval:
            self.scale = float(np.float32(self.scale * self.spec.growth_factor))
            self.good_steps = 0


def run_training(model_spec: str, ranks: int, steps: int, seed: int, training: TrainingSpec | None = None,
                 comm: Comm | None = None, *, batch_size: int = 4, bucket_cap_mb: float | None = None,
                 force_overflow_at: int | None = None, threads: int = 1,
                 keep_reduced: bool = False) -> TrainResult:
    """Train ``model_spec`` for ``steps`` iterations on ``ranks`` simulated DDP ranks.

    Each rank runs forward and backward on its own data shard with the one shared model; DDP's
    collectives go through ``comm`` (default LocalComm); then the optimizer step of ARCHITECTURE.md
    "Trainer semantics". ``force_overflow_at`` (fp16 only) puts an inf into rank 0's gradient at
    that 0-based iteration, so the step is skipped.
    """
    training = training or TrainingSpec()
    spec = models.parse_spec(model_spec)
    if steps < 1:
        raise ValueError(f"steps must be >= 1 (the first backward fixes the bucket layout), got {steps}")
    if force_overflow_at is not None and training.grad_dtype != "float16":
        raise ValueError("force_overflow_at needs grad_dtype float16 (only fp16 skips steps)")
    recorder = RecordingComm(comm if comm is not None else LocalComm())
    dtype = TORCH_GRAD_DTYPES[training.grad_dtype]
    low = dtype != torch.float32
    config = {
        "model": spec.text, "ranks": ranks, "steps": steps, "seed": seed, "batch_size": batch_size,
        "bucket_cap_mb": bucket_cap_mb, "training": training.to_dict(), "force_overflow_at": force_overflow_at,
        "threads": threads, "torch": torch.__version__,
    }
    with intra_op_threads(threads):
        model = models.build_model(spec, seed).to(dtype)
        ddp = DDP(model, ranks, recorder, bucket_cap_mb=bucket_cap_mb)
        initial = [p.detach().clone() for p in ddp.params]
        # bf16/fp16: the optimizer owns fp32 copies of the (broadcast) model parameters
        masters = [p.detach().float().clone() for p in ddp.params] if low else ddp.params
        optimizer = build_optimizer(masters, training.optimizer)
        scheduler = build_scheduler(optimizer, training.lr_schedule)
        scaler = LossScaler(training.loss_scale) if training.grad_dtype == "float16" else None
        iterations, reduced_all, step_count = [], [], 0
        for it in range(steps):
            ddp.begin_iteration(it)
            scale = scaler.scale if scaler else None
            grads, losses = [], []
            for rank in range(ranks):
                x, y = models.make_batch(spec, seed, rank, it, batch_size, dtype)
                model.zero_grad(set_to_none=True)
                out = model(x)
                if low:  # the loss in fp32, as mixed-precision trainers compute it
                    out, y = out.float(), (y.float() if y.is_floating_point() else y)
                loss = models.compute_loss(spec, out, y)
                scaled = loss * scale if scaler else loss
                with ddp.record_ready_order() if rank == 0 else nullcontext():
                    scaled.backward()
                grads.append([p.grad for p in ddp.params])
                losses.append(float(loss.detach()))
            model.zero_grad(set_to_none=True)
            if it == force_overflow_at:
                grads[0][0].view(-1)[0] = float("inf")
            reduced = ddp.reduce(it, grads)
            if keep_reduced:
                reduced_all.append(reduced)
            lr = float(optimizer.param_groups[0]["lr"])
            if low:
                for m, p in zip(masters, ddp.params):
                    m.grad = p.grad.float()
            found_inf = scaler.unscale([m.grad for m in masters]) if scaler else False
            grad_norm = None
            if not found_inf:
                if training.clip is not None:
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(
                        masters, training.clip.max_norm, norm_type=training.clip.norm_type))
                optimizer.step()
                step_count += 1
            if scaler:
                scaler.update(found_inf)
            if scheduler is not None and (not found_inf or training.loss_scale.scheduler_step_on_skip):
                scheduler.step()
            if low:
                with torch.no_grad():
                    for m, p in zip(masters, ddp.params):
                        p.copy_(m)
            psha, osha = state_sha256(masters, optimizer)
            iterations.append(IterationRecord(
                index=it, step=step_count, lr=lr, loss_scale=scale, skipped=found_inf, losses=losses,
                buckets_sha256=[sha256_arrays([b]) for b in reduced], params_sha256=psha,
                optim_sha256=osha, grad_norm=grad_norm))
        layout = ddp.layout()
    return TrainResult(config=config, layout=layout, collectives=recorder.records, iterations=iterations,
                       initial_params=initial, model=model, masters=masters, optimizer=optimizer,
                       scheduler=scheduler, reduced=reduced_all if keep_reduced else None)
