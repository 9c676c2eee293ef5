"""parser.concat.Concatenator: when a collective is handed on. A complete one goes once every
running stream is ``settle_margin`` collectives past it (the replica steps soon after the wire);
an incomplete one waits for the whole ``collective_window`` (late data may still complete it).
The placements are the state machine's own, recorded from the bundled demo capture."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from mirrorckpt.config.jobfile import load_job
from mirrorckpt.parser.concat import Concatenator
from mirrorckpt.parser.placement import REDUCED
from mirrorckpt.parser.roce.placer import RingPlacer
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
    RingPlacer.compiled = False  # every send the per-send way, through Concatenator.add (test_placerun: alike)
    try:
        js = cmd_replay.open_stream(sorted(str(p) for p in DEMO.glob("*.pcapng")), job)
        results = [r for r in js if type(r).__name__ == "CollectiveResult"]
    finally:
        Concatenator.add = orig
        RingPlacer.compiled = True
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


def _one_hole(model, ps, p2p_fill: bool, extra):
    """The demo job with every copy of one reduced chunk of one all-reduce lost, and ``extra(hole)``
    point-to-point sends offered after that all-reduce's last send; returns the victim's result."""
    victim = next(p.coll for p in ps if p.spec.kind == "allreduce" and p.coll >= 4)
    first = next(p for p in ps if p.coll == victim and p.step.nelem > 0 and p.step.phase == REDUCED)
    lost = {id(p) for p in ps if p.coll == victim and p.step.phase == REDUCED and p.channel == first.channel
            and p.step.offset == first.step.offset}
    c = Concatenator(model, 8, p2p_fill=p2p_fill)
    out, offered = {}, False
    for p in ps:
        if not offered and p.coll > victim:  # the victim's last send went by
            for s in extra(first, max(q.send.ts_ns for q in ps if q.coll == victim) + 1):
                c.add_p2p(s)
            offered = True
        if id(p) not in lost:
            c.add(p)
        out.update((r.index, r) for r in c.poll())
    out.update((r.index, r) for r in c.poll(final=True))
    return first, out[victim]


def _foreign(first, ts_ns):
    """A point-to-point send of exactly the hole's size whose values are not the result's (a
    pipeline activation between the same hosts), after the collective's last send."""
    nbytes = first.step.nelem * (len(first.send.data) // first.step.nelem)
    junk = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)
    return [dataclasses.replace(first.send, data=junk, holes=[], ts_ns=ts_ns)]


def test_a_foreign_send_of_the_holes_size_fills_nothing_by_default(placements):
    """The old rule (any point-to-point send of the one hole's size, after the collective) made
    this collective complete with the foreign send's bytes; undeclared, the hole stays."""
    model, ps = placements
    first, r = _one_hole(model, ps, False, _foreign)
    assert not r.complete and r.filled_by_p2p == [] and r.sha256() is None
    assert r.holes == [(first.step.offset, first.step.nelem)]


def test_declared_the_fill_takes_the_send_it_is_promised(placements):
    """``p2p_fill`` is the workload's promise that such a send carries the hole's values: it is
    taken (and would be wrong for a foreign one, which is why it is off by default)."""
    model, ps = placements
    first, r = _one_hole(model, ps, True, _foreign)
    assert r.complete and r.filled_by_p2p == [(first.step.offset, first.step.nelem)]
    es = len(first.send.data) // first.step.nelem
    a, n = first.step.offset, first.step.nelem
    assert not np.array_equal(r.data[a * es:(a + n) * es], first.send.data[:n * es])  # the foreign bytes


def test_open_results_count_what_their_flags_hold(placements):
    """``complete`` on an open result reads counts kept while placing (no pass over its flags):
    after every placement they equal the flags, with sends carrying holes and a copy that
    disagrees; a disagreeing result is never complete."""
    model, ps = placements
    rng = np.random.default_rng(3)
    c = Concatenator(model, 8)
    bad = None
    for k, p in enumerate(ps):
        s = p.send
        if k % 7 == 3 and len(s.data) > 16:  # bytes lost on the wire: holes in the send
            a = int(rng.integers(0, len(s.data) - 8))
            p = dataclasses.replace(p, send=dataclasses.replace(s, holes=[(a, 8)]))
        elif bad is None and p.spec.kind == "allreduce" and p.step.phase == REDUCED and p.step.nelem and \
                p.coll in c.open and c.open[p.coll].covered[p.step.offset]:
            data = s.data.copy()  # a later copy of values already placed, one byte changed
            data[0] ^= 1
            p = bad = dataclasses.replace(p, send=dataclasses.replace(s, data=data))
        c.add(p)
        for r in c.open.values():
            assert r.ncovered == int(r.covered.sum()) and r.nconflict == int(r.conflict.sum())
            assert r.complete == (bool(r.covered.all()) and not r.conflict.any())
        c.poll()
    assert bad is not None


def test_a_complete_result_handed_on_gives_its_flags_back(placements):
    """A complete result lives on as long as its bucket (iteration, replica step, report hash):
    its per-element flags, half as many bytes again as float32 data, go back when it is handed
    on; what its readers ask of them reads the same. An incomplete one keeps them (its holes)."""
    model, ps = placements
    out = {}
    c = Concatenator(model, 8)
    victim = next(p.coll for p in ps if p.spec.kind == "allreduce" and p.coll >= 4)
    for p in ps:
        if p.coll == victim and p.step.phase == REDUCED and p.step.nelem:
            continue  # every final value of one all-reduce lost
        c.add(p)
        out.update((r.index, r) for r in c.poll())
    out.update((r.index, r) for r in c.poll(final=True))
    done = [r for r in out.values() if r.complete]
    assert len(done) == len(out) - 1 and not out[victim].complete
    for r in done:
        assert r.covered.strides == (0,) and r.conflict.strides == (0,) and not r.covered.flags.writeable
        assert r.count == r.spec.count * (model.ring.nranks if r.spec.kind == "allgather" else 1)
        assert r.coverage == 1.0 and r.holes == [] and r.sha256() is not None
    v = out[victim]
    assert v.covered.strides == (1,) and v.holes == [(0, v.count)] and v.coverage == 0.0
