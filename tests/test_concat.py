"""parser.concat.Concatenator: when a collective is handed on. A complete one goes once every
running stream is ``settle_margin`` collectives past it (the replica steps soon after the wire);
an incomplete one waits for the whole ``collective_window`` (late data may still complete it).
The placements are the state machine's own, recorded from the bundled demo capture."""

from __future__ import annotations

from pathlib import Path

import pytest
from mirrorckpt.config.jobfile import load_job
from mirrorckpt.parser.concat import Concatenator
from mirrorckpt.parser.schedule import REDUCED
from mirrorckpt.tools import cmd_replay

DEMO = Path(__file__).parent / "pcaps" / "demo"


@pytest.fixture(scope="module")
def placements():
    """(model, every placement in wire order) of the demo job's replay."""
    job = load_job(DEMO / "job.toml")
    got = []
    orig = Concatenator.add

    def record(self, p):
        got.append(p)
        return orig(self, p)

    Concatenator.add = record
    try:
        js = cmd_replay.open_stream(sorted(str(p) for p in DEMO.glob("*.pcapng")), job)
        results = [r for r in js if type(r).__name__ == "CollectiveResult"]
    finally:
        Concatenator.add = orig
    assert results and all(r.complete for r in results)
    return js.model, got


def _feed(model, placements, window: int, drop=lambda p: False):
    """Feeds the placements one by one; returns {collective: highest collective any stream had
    reached when it was handed on}."""
    c = Concatenator(model, window)
    out = {}
    for p in placements:
        if drop(p):
            continue
        c.add(p)
        for r in c.poll():
            out[r.index] = (c.settled(), r.complete)
    for r in c.poll(final=True):
        out[r.index] = (None, r.complete)
    return out


def test_a_complete_collective_goes_two_collectives_later_not_a_window_later(placements):
    model, ps = placements
    window = 8
    out = _feed(model, ps, window)
    handed = {i: s for i, (s, ok) in out.items() if s is not None}
    assert handed and all(out[i][1] for i in out)
    # each went on the moment every stream was settle_margin past it, long before the window
    assert all(s == i + 2 for i, s in handed.items()), handed
    assert len(handed) >= len(out) - 2  # only the last two wait for the end of the wire


def test_an_incomplete_collective_still_waits_for_the_whole_window(placements):
    model, ps = placements
    window = 8
    victim = next(p.coll for p in ps if p.spec.kind == "allreduce" and p.coll >= 4)
    first = next(p for p in ps if p.coll == victim and p.step.nelem > 0 and p.step.phase == REDUCED)
    # every copy of one reduced chunk (it is forwarded along the ring)
    lost = {id(p) for p in ps if p.coll == victim and p.step.phase == REDUCED and p.channel == first.channel
            and p.step.offset == first.step.offset}
    out = _feed(model, ps, window, drop=lambda p: id(p) in lost)
    settled, complete = out[victim]
    assert not complete
    assert settled is None or settled >= victim + window
    # and nothing after it overtook it: results stay in order
    assert list(out) == sorted(out)
