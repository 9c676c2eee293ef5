"""One appliance process following several DP rings: per ring its own job stream and its own sink
(an ``Appliance`` holding that ring's replica shard), driven in turn.

A sharded job's DP groups are independent rings; an appliance may follow any number of them.
``RingSet.run`` takes one item from each ring's stream in turn (so replay of captured rings keeps
them in step, and a ring that ends or goes quiet does not hold up the others) and hands it to
that ring's sink exactly as ``drive`` does. Live rings (the daemon) run one ``drive`` per ring
in its own thread instead; the sinks are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from mirrorckpt.updater.appliance import Appliance
from mirrorckpt.updater.drive import IterationSink, drive


class RingSet:
    def __init__(self):
        self.rings: dict[str, tuple[Iterable, IterationSink]] = {}

    def add(self, name: str, items: Iterable, sink: IterationSink) -> None:
        if name in self.rings:
            raise ValueError(f"ring {name!r} is followed twice")
        self.rings[name] = (items, sink)

    def run(self, on_pass: Callable[[RingSet], None] | None = None) -> None:
        """Until every stream ends: one item of each ring in turn, then ``on_pass(self)``."""
        live = {name: iter(items) for name, (items, _) in self.rings.items()}
        while live:
            for name in list(live):
                try:
                    item = next(live[name])
                except StopIteration:
                    del live[name]
                    continue
                drive((item,), self.rings[name][1])
            if on_pass is not None:
                on_pass(self)

    def appliances(self) -> dict[str, Appliance]:
        return {n: s for n, (_, s) in self.rings.items() if isinstance(s, Appliance)}

    def steps(self) -> dict[str, int]:
        """Iterations applied per ring's replica (0 before it has one)."""
        return {n: (a.replica.iterations_done if a.replica is not None else 0) for n, a in self.appliances().items()}
