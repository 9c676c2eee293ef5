"""The pipeline loop, job stream items to the updater (``drive``), without torch: a replay that
keeps no replica verifies the wire without importing it (a second of start-up)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from mirrorckpt.parser.iteration import GatheredWeights, InitialWeights, ReducedBucket, ReducedIteration


class IterationSink(Protocol):
    """What ``drive`` hands the job stream's items to (``Appliance``, the control plane's
    ``AppliancePlane``, the daemon's queue to its updater thread, a sharded ring's
    ``updater.shard_sink`` adapters)."""

    def initial_weights(self, w: InitialWeights) -> None: ...

    def bucket(self, b: ReducedBucket) -> None:
        """A complete bucket ahead of its iteration (a sink may step it now, or wait)."""

    def apply(self, it: ReducedIteration) -> None: ...


class WeightsSink(IterationSink, Protocol):
    """A sink of a ring whose all-gathers carry parameters (only such job streams yield them)."""

    def weights(self, g: GatheredWeights) -> None: ...


def drive(items: Iterable, sink: IterationSink | None = None, on_item: Callable | None = None) -> None:
    """The pipeline loop: the initial weights and the iterations of a job stream to ``sink``, then
    every item to ``on_item`` (reports, metrics)."""
    for item in items:
        if sink is not None:
            if isinstance(item, ReducedBucket):
                sink.bucket(item)
            elif isinstance(item, ReducedIteration):
                sink.apply(item)
            elif isinstance(item, InitialWeights):
                sink.initial_weights(item)
            elif isinstance(item, GatheredWeights):
                sink.weights(item)
        if on_item is not None:
            on_item(item)
