"""What the parser hands the updater, as typed items of the job stream: the initial weights DDP
broadcast at start-up (once), one training iteration's reduced gradient buckets, and (a sharded
optimizer's ring) each all-gather of parameters."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from mirrorckpt.config.layout import JobLayout


@dataclass
class ReducedIteration:
    index: int  # 0-based iteration number in wire order
    buckets: list[np.ndarray]  # flat reduced gradient per bucket (config.layout.numpy_dtype; bf16 as uint16 bits)
    complete: bool = True
    # bucket -> missing element ranges [(start, length)], when incomplete
    holes: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    # what the wire does not carry, when the trainer sent it (lr, loss scale, rng states, data position)
    meta: dict = field(default_factory=dict)
    # which run of the job's communicator it came from (the daemon counts restarts; 0: the first)
    run: int = 0
    # iterations since DDP (re)started: decides the bucket layout (the first one may differ); None
    # when ``index`` counts from the job's start (a restarted job counts ``index`` on from its step)
    wire_index: int | None = None
    # capture time (ns, the capture's clock) of the newest send that went into it: a live capture's
    # kernel timestamp, so the daemon can tell how long after its last packet the step landed
    last_ts: int = 0

    @property
    def layout_index(self) -> int:
        """The iteration number ``JobLayout.bucket_list`` takes."""
        return self.index if self.wire_index is None else self.wire_index



@dataclass
class ReducedBucket:
    """One bucket of an iteration, final and complete: handed on at once so the updater can step
    its parameters before the rest of the iteration is on the wire. The iteration's
    ``ReducedIteration`` follows and decides (an incomplete one undoes what its buckets did)."""

    iteration: int
    bucket: int
    values: np.ndarray  # as ReducedIteration.buckets[bucket]; the same array


@dataclass
class InitialWeights:
    """DDP's start-up broadcast of rank 0's parameters, reassembled whole: the replica's step 0."""

    layout: JobLayout
    values: np.ndarray  # flat, every parameter in layout order (float32)


@dataclass
class GatheredWeights:
    """One all-gather of parameters of a sharded optimizer's ring (config.shard_steps "params"):
    collective ``index`` of that label in iteration ``iteration``, every rank's part in rank order
    (``config.shard_steps.RingSteps.gathers`` says where each parameter sits); ``values`` None and
    ``holes`` (element ranges) when it could not be reassembled whole."""

    iteration: int
    index: int
    values: np.ndarray | None
    holes: list[tuple[int, int]] = field(default_factory=list)
    last_ts: int = 0

    @property
    def complete(self) -> bool:
        return self.values is not None
