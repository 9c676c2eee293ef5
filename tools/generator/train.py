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
from mirrorckpt.config.layout import JobLayout
from mirrorckpt.config.training import LossScaleSpec, LRScheduleSpec, OptimizerSpec, TrainingSpec
from mirrorckpt.tools.generator import models
from mirrorckpt.tools.generator.ddp import DDP
from mirrorckpt.tools.generator.truth import CollectiveRecord, IterationRecord, RecordingComm, sha256_arrays
from mirrorckpt.updater.fingerprint import state_sha256
from torch import nn


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


class Job:
    """The training job of one run: the shared model, its DDP, the masters and their optimizer."""

    def __init__(self, spec: models.ModelSpec, ranks: int, seed: int, training: TrainingSpec, comm,
                 batch_size: int, bucket_cap_mb: float | None):
        self.spec, self.ranks, self.seed, self.training, self.batch_size = spec, ranks, seed, training, batch_size
        self.dtype = TORCH_GRAD_DTYPES[training.grad_dtype]
        self.low = self.dtype != torch.float32
        self.model = models.build_model(spec, seed).to(self.dtype)
        self.ddp = DDP(self.model, ranks, comm, bucket_cap_mb=bucket_cap_mb)
        self.initial = [p.detach().clone() for p in self.ddp.params]
        # bf16/fp16: the optimizer owns fp32 copies of the (broadcast) model parameters
        self.masters = [p.detach().float().clone() for p in self.ddp.params] if self.low else self.ddp.params
        self.optimizer = build_optimizer(self.masters, training.optimizer)
        self.scheduler = build_scheduler(self.optimizer, training.lr_schedule)
        self.scaler = LossScaler(training.loss_scale) if training.grad_dtype == "float16" else None
        self.steps_taken = 0

    def rank_gradients(self, it: int, rank: int) -> tuple[list[torch.Tensor], float]:
        """Forward and backward of ``rank`` on its shard: its local gradients and (unscaled) loss."""
        x, y = models.make_batch(self.spec, self.seed, rank, it, self.batch_size, self.dtype)
        self.model.zero_grad(set_to_none=True)
        out = self.model(x)
        if self.low:  # the loss in fp32, as mixed-precision trainers compute it
            out, y = out.float(), (y.float() if y.is_floating_point() else y)
        loss = models.compute_loss(self.spec, out, y)
        scaled = loss * self.scaler.scale if self.scaler else loss
        with self.ddp.record_ready_order() if rank == 0 else nullcontext():
            scaled.backward()
        grads = [p.grad for p in self.ddp.params]
        self.model.zero_grad(set_to_none=True)
        return grads, float(loss.detach())

    def step(self) -> tuple[bool, float | None]:
        """The optimizer step on the reduced gradients DDP left in .grad; (skipped, clip norm)."""
        if self.low:
            for m, p in zip(self.masters, self.ddp.params):
                m.grad = p.grad.float()
        found_inf = self.scaler.unscale([m.grad for m in self.masters]) if self.scaler else False
        norm = None
        if not found_inf:
            if self.training.clip is not None:
                norm = float(torch.nn.utils.clip_grad_norm_(self.masters, self.training.clip.max_norm,
                                                             norm_type=self.training.clip.norm_type))
            self.optimizer.step()
            self.steps_taken += 1
        if self.scaler:
            self.scaler.update(found_inf)
        if self.scheduler is not None and (not found_inf or self.training.loss_scale.scheduler_step_on_skip):
            self.scheduler.step()
        if self.low:
            with torch.no_grad():
                for m, p in zip(self.masters, self.ddp.params):
                    p.copy_(m)
        return found_inf, norm


def run_training(model_spec: str, ranks: int, steps: int, seed: int, training: TrainingSpec | None = None,
                 comm: Comm | None = None, *, batch_size: int = 4, bucket_cap_mb: float | None = None,
                 force_overflow_at: int | None = None, threads: int = 1,
                 keep_reduced: bool = False, on_step=None) -> TrainResult:
    """Train ``model_spec`` for ``steps`` iterations on ``ranks`` simulated DDP ranks.

    Each rank runs forward and backward on its own data shard with the one shared model; DDP's
    collectives go through ``comm`` (default LocalComm); then the optimizer step of ARCHITECTURE.md
    "Trainer semantics". ``force_overflow_at`` (fp16 only) puts an inf into rank 0's gradient at
    that 0-based iteration, so the step is skipped. ``threads``: torch intra-op threads while
    training (the results depend on it). ``on_step(iterations done)`` follows the run.
    """
    training = training or TrainingSpec()
    spec = models.parse_spec(model_spec)
    if steps < 1:
        raise ValueError(f"steps must be >= 1 (the first backward fixes the bucket layout), got {steps}")
    if force_overflow_at is not None and training.grad_dtype != "float16":
        raise ValueError("force_overflow_at needs grad_dtype float16 (only fp16 skips steps)")
    recorder = RecordingComm(comm if comm is not None else LocalComm())
    config = {
        "model": spec.text, "ranks": ranks, "steps": steps, "seed": seed, "batch_size": batch_size,
        "bucket_cap_mb": bucket_cap_mb, "training": training.to_dict(), "force_overflow_at": force_overflow_at,
        "threads": threads, "torch": torch.__version__,
    }
    iterations, reduced_all = [], []
    with intra_op_threads(threads):
        job = Job(spec, ranks, seed, training, recorder, batch_size, bucket_cap_mb)
        for it in range(steps):
            job.ddp.begin_iteration(it)
            scale = job.scaler.scale if job.scaler else None
            grads, losses = zip(*(job.rank_gradients(it, rank) for rank in range(ranks)))
            if it == force_overflow_at:
                grads[0][0].view(-1)[0] = float("inf")
            reduced = job.ddp.reduce(it, grads)
            if keep_reduced:
                reduced_all.append(reduced)
            lr = float(job.optimizer.param_groups[0]["lr"])
            skipped, norm = job.step()
            psha, osha = state_sha256(job.masters, job.optimizer)
            iterations.append(IterationRecord(
                index=it, step=job.steps_taken, lr=lr, loss_scale=scale, skipped=skipped, losses=list(losses),
                buckets_sha256=[sha256_arrays([b]) for b in reduced], params_sha256=psha,
                optim_sha256=osha, grad_norm=norm))
            if on_step is not None:
                on_step(it + 1)
        layout = job.ddp.layout()
    return TrainResult(config=config, layout=layout, collectives=recorder.records, iterations=iterations,
                       initial_params=job.initial, model=job.model, masters=job.masters,
                       optimizer=job.optimizer, scheduler=job.scheduler,
                       reduced=reduced_all if keep_reduced else None)
