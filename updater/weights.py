"""Weights-only protection: per-step weight snapshots of a job whose optimizer state cannot be
followed from the wire (pure FSDP, ZeRO-3: a reduce-scatter never carries a finished gradient).

The parameter all-gathers of the job's communicator carry every parameter in the parameter dtype
(``config.shard_steps``: FSDP2 all-gathers each unit before its forward, ZeRO after its step);
``WeightsFollower`` assembles an iteration's gathers (``GatheredWeights``, each rank's part laid out
as ``RingSteps.gathers`` says) into the whole model's parameters: the weights after ``step`` optimizer
steps, the step the trainer's own counter then shows. An iteration with a gather not reassembled
whole gives no snapshot (counted and logged), never a partial one. ``WeightsPersister`` commits a
snapshot as a checkpoint of ``model.<fqn>`` tensors whose manifest says ``weights_only``: never a
full training state (no moments, no fp32 masters of a low-precision job); ``updater.restore``
refuses it as one unless asked for weights. The full checkpoints of such a job come from the
trainer (GoCkpt fallbacks, ``control``), at their own cadence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from mirrorckpt.config.shard_steps import RingSteps
from mirrorckpt.config.shards import PAD, ShardedLayout
from mirrorckpt.config.training import PersistSpec
from mirrorckpt.parser.iteration import GatheredWeights, InitialWeights, ReducedBucket, ReducedIteration
from mirrorckpt.updater.dcp_keys import FORMAT, dumps
from mirrorckpt.updater.persist import CheckpointExists, write_checkpoint

log = logging.getLogger("mirrorckpt.weights")


@dataclass
class WeightsSummary:
    snapshots: int = 0  # complete steps assembled
    incomplete: int = 0  # steps with a gather not reassembled whole
    committed: list[str] = field(default_factory=list)
    last_step: int | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class WeightsFollower:
    """A weights-only ring's sink. ``after_step``: the gathers of iteration i carry the weights
    after its step (ZeRO) rather than before it (FSDP2). ``on_snapshot(step, params)``: FQN -> tensor."""

    def __init__(self, layout: ShardedLayout, steps: RingSteps, on_snapshot, after_step: bool = False):
        if not steps.gathers:
            raise ValueError("the ring carries no parameter all-gathers: nothing to follow for weights")
        self.params = list(layout.params)
        self.gathers = steps.gathers
        self.counts = [sum(n for _, _, n in parts[0]) for parts in steps.gathers]
        self.after_step = after_step
        self.on_snapshot = on_snapshot
        self.summary = WeightsSummary()
        self._iteration: int | None = None
        self._got: dict[int, np.ndarray] = {}
        self._bad = False

    def initial_weights(self, w: InitialWeights) -> None:
        """Start-up broadcasts carry step 0's weights (DeepSpeed); FSDP2's first gathers do too."""

    def bucket(self, b: ReducedBucket) -> None:
        """No gradient is followed."""

    def apply(self, it: ReducedIteration) -> None:
        """No gradient is followed."""

    def weights(self, g: GatheredWeights) -> None:
        if g.iteration != self._iteration:
            self._close()
            self._iteration, self._got, self._bad = g.iteration, {}, False
        if not g.complete:
            self._bad = True
            log.warning("iteration %d: parameter all-gather %d incomplete (%d hole(s)): no weight snapshot of "
                        "step %d", g.iteration, g.index, len(g.holes), self._step(g.iteration))
            return
        self._got[g.index] = g.values
        if len(self._got) == len(self.gathers):
            self._emit()

    def _step(self, iteration: int) -> int:
        return iteration + 1 if self.after_step else iteration

    def _close(self) -> None:
        """An iteration left behind with gathers missing."""
        if self._iteration is not None and (self._bad or len(self._got) < len(self.gathers)):
            self.summary.incomplete += 1
            if not self._bad:
                log.warning("iteration %d: %d of %d parameter all-gathers seen: no weight snapshot of step %d",
                            self._iteration, len(self._got), len(self.gathers), self._step(self._iteration))
        self._iteration = None

    def _emit(self) -> None:
        flat = [np.empty(p.numel, np.float32) for p in self.params]
        filled = [0] * len(self.params)
        for k, parts in enumerate(self.gathers):
            values, count = np.asarray(self._got[k]), self.counts[k]
            for j, segments in enumerate(parts):
                pos = j * count
                for i, start, n in segments:
                    if i != PAD:
                        flat[i][start:start + n] = values[pos:pos + n]
                        filled[i] += n
                    pos += n
        short = [p.name for p, n in zip(self.params, filled) if n != p.numel]
        if short:
            raise ValueError(f"the ring's all-gathers do not cover every parameter once: {short[:3]}")
        step = self._step(self._iteration)
        self._got, self._iteration = {}, None
        self.summary.snapshots += 1
        self.summary.last_step = step
        self.on_snapshot(step, {p.name: torch.from_numpy(a).reshape(p.shape) for p, a in zip(self.params, flat)})

    def ended(self) -> None:
        """The ring's stream ended."""
        self._close()

    def close(self) -> WeightsSummary:
        self._close()
        return self.summary


class WeightsPersister:
    """Commits weight snapshots (every ``spec.every_iterations`` steps) under ``spec.directory``,
    synchronously (a snapshot is the model's parameters only, written as it is assembled)."""

    def __init__(self, spec: PersistSpec, layout: ShardedLayout, training: dict, summary: WeightsSummary):
        self.spec, self.layout, self.training, self.summary = spec, layout, training, summary

    def __call__(self, step: int, params: dict[str, torch.Tensor]) -> None:
        every = self.spec.every_iterations or 1
        if step % every:
            return
        extra = {"format": FORMAT, "iterations_done": step, "step": step,
                 "layout": dumps(self.layout.global_layout().to_dict(), "layout"),
                 "training": dumps(self.training, "training"), "shards": dumps(self.layout.to_dict(), "shards")}
        try:
            path = write_checkpoint(self.spec.directory, {"model": params, "extra": extra}, self.spec.keep_last,
                                    self.spec.job_name, threads=self.spec.writer_threads, weights_only=True)
        except CheckpointExists as e:
            log.warning("weight snapshot of step %d not written: %s", step, e)
            return
        self.summary.committed.append(str(path))
        log.info("weight snapshot committed (weights only)", extra={"path": str(path), "step": step})
