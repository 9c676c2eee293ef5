"""The pipeline loop, job stream items to the updater (``drive``), without torch: a replay that
keeps no replica verifies the wire without importing it (a second of start-up)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from mirrorckpt.parser.iteration import InitialWeights, ReducedBucket, ReducedIteration


class IterationSink(Protocol):
    """What ``drive`` hands the job stream's items to (``Appliance``, the control plane's
    ``AppliancePlane``, the daemon's queue to its updater thread)."""

    def initial_weights(self, w: InitialWeights) -> None: ...

    def bucket(self, b: ReducedBucket) -> None:
        """A complete bucket ahead of its iteration (a sink may step it now, or wait)."""

    def apply(self, it: ReducedIteration) -> None: ...


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
        if on_item is not None:
            on_item(item)
