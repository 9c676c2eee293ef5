"""The compiled placement pass (parser/roce/_placerun) gives exactly what the per-send path gives
(the state machine's counts, mismatches, step tables and QP cursors; the concatenator's buffers,
coverage, conflicts and bookkeeping), takes the common case itself, and hands every unusual send
to the per-send path in its turn: a DDP job's sends by flag, by CTS index and by PSN (the QP's
next message), in wire order, shuffled, two mirror copies, and with lost, resized, damaged and
disagreeing sends."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from mirrorckpt.parser.concat import CollectiveResult, Concatenator
from mirrorckpt.parser.roce import _placerun
from mirrorckpt.parser.roce.placer import RingPlacer
from test_statemachine import ITERATIONS, all_sends, by_time, channel_map, ddp_model


def valued(sends, model):
    """Each send's bytes made its elements' own (all-reduce: the reduced values, every copy alike),
    its time its step's."""
    out = []
    for s, want in sends:
        i, st = want[0], want[1]
        es = 4
        first = st.offset + 100_000 * i
        data = np.arange(first, first + st.nbytes // es, dtype=np.float32).view(np.uint8) if st.nbytes % es == 0 \
            else np.full(st.nbytes, i % 251, np.uint8)
        ts = 1000 * want[4] + 10 * want[2] + want[3] + 1  # by step, channel and position
        out.append((replace(s, data=data.copy(), ts_ns=ts), want))
    return out


def place(model, sends, compiled: bool, batch: int):
    placer = RingPlacer(model, model.ring.ranks_by_address(), channel_map(model.ring))
    placer.compiled = compiled
    concat = Concatenator(model)
    per_send = []
    one = placer._one

    def counting(s, c):
        per_send.append(s)
        one(s, c)

    placer._one = counting
    items = [s for s, _ in sends]
    states = []
    for k in range(0, len(items), batch):
        placer.add(items[k:k + batch], concat)
        states.append(state(placer, concat, list(concat.open.values())))
    done = concat.poll(final=True)
    states.append(state(placer, concat, done))
    return states, done, per_send


def covered(r) -> tuple[bytes, bytes]:
    """A result's coverage flags and its covered bytes (the rest is never read)."""
    flags = np.ascontiguousarray(r.covered, bool)
    return flags.tobytes(), r.data[np.repeat(flags, r.data.size // max(1, r.count))].tobytes()


def state(placer, concat, results):
    sm = placer.sm
    results = [(r.index, r.complete, r.ncovered, r.nconflict, r.pieces, r.last_ts, list(r.conflicts), covered(r))
               for r in results]
    cursors = {k: [(c.m, c.t, c.end, c.va, c.proto) for c in v] for k, v in sm.cursors.items()}
    tracks = {k: (list(t.t0), list(t.m0), list(t.n), t.t_end, t.m_end, t.base) for k, t in sm.tracks.items()}
    return (sorted(sm.counts.items()), list(sm.mismatches), dict(sm.last), cursors, set(sm.split_qps), tracks,
            results, concat.frontier, dict(concat.streams), concat.next_out,
            {k: list(v) for k, v in concat.span.items()})


def same(model, sends, batch: int = 37) -> list:
    """The two paths' state after every batch is the same; the sends the compiled pass left."""
    a = place(model, sends, False, batch)
    b = place(model, sends, True, batch)
    assert a[0] == b[0]
    assert len(a[2]) == len(sends)  # off: every send the per-send way
    return b[2]


@pytest.mark.parametrize("proto,route", [("LL", "flag"), ("LL128", "flag"), ("Simple", "cts"), ("LL", "cts"),
                                         ("Simple", "next")])
def test_a_whole_job_in_wire_order(proto, route):
    model = ddp_model(proto)
    sends = valued(by_time(all_sends(model, route)), model)
    per_send = same(model, sends)
    done = place(model, sends, True, 37)[1]
    assert done and all(r.complete for r in done)
    # The compiled pass takes all but empty steps and a connection's first send (which maps it and
    # anchors its QP), a collective's first one too (it tabulates the collective as the per-send
    # path would); PSN-proven sends too (route "next"): each begins where its QP's last one ended.
    firsts = {}
    for s, _ in sends:
        firsts.setdefault((s.stream, s.connection), s)
    allowed = {id(s) for s in firsts.values()} | {id(s) for s, _ in sends if s.form == "empty"}
    assert {id(s) for s in per_send} <= allowed


@pytest.mark.parametrize("proto,route", [("LL", "flag"), ("Simple", "cts")])
def test_shuffled_and_two_mirror_copies(proto, route):
    model = ddp_model(proto)
    sends = valued(by_time(all_sends(model, route)), model)
    copies = valued(by_time(all_sends(model, route, stream=1)), model)
    mixed = [x for pair in zip(sends, copies) for x in pair]
    same(model, mixed)
    random.Random(3).shuffle(mixed)
    same(model, mixed, batch=11)
    # without PSNs (no QP order to keep) out-of-order sends are the compiled pass's too
    unnumbered = [(replace(s, psn=None), want) for s, want in mixed]
    assert len(same(model, unnumbered, batch=11)) < len(mixed) // 2


@pytest.mark.parametrize("proto,route", [("LL", "flag"), ("LL128", "flag"), ("Simple", "cts"), ("Simple", "next")])
def test_damage_goes_the_per_send_way_with_the_same_outcome(proto, route):
    """Lost sends, a size the plan does not expect, lost bytes, a copy that disagrees, a late copy
    of an old step, a send out of its QP's order: the verdicts are the per-send path's (PSN-proven
    sends after a lost one: a gap in the QP's PSNs, counted by the per-send path)."""
    model = ddp_model(proto)
    sends = valued(by_time(all_sends(model, route)), model)
    copies = valued(by_time(all_sends(model, route, stream=1)), model)
    rng = random.Random(11)
    out = []
    for k, (s, want) in enumerate(sends):
        r = rng.random()
        if r < 0.05:
            continue  # lost
        if r < 0.08:
            s = replace(s, wire_bytes=s.wire_bytes + 16)
        elif r < 0.11 and s.nbytes:
            s = replace(s, holes=[(0, min(8, s.nbytes))])
        elif r < 0.14 and s.nbytes:
            data = s.data.copy()
            data[-1] ^= 0x40
            s = replace(s, data=data)
        elif r < 0.16 and out:
            out.append(out[rng.randrange(len(out))])  # a late copy
        out.append((s, want))
        if k % 3 == 0:
            out.append(copies[k])
    if len(out) > 40:
        out[20], out[21] = out[21], out[20]
    per_send = same(model, out, batch=23)
    assert len(per_send) < len(out)  # the compiled pass took the rest
    done = place(model, out, True, 23)[1]
    assert any(r.conflicts for r in done) and not all(r.complete for r in done)


def test_the_state_machine_tables_grow_between_batches():
    """A step past what the connection has tabulated goes the per-send way (which tabulates), and
    later sends of that collective are the compiled pass's again."""
    model = ddp_model("LL")
    sends = valued(by_time(all_sends(model, "flag")), model)
    for batch in (2, 1000):
        same(model, sends, batch)
    assert model.first_of_iteration(ITERATIONS) > 5


@pytest.mark.parametrize("proto,mirrors,faults", [
    ("LL", "0:egress,1:egress", None), ("LL128", "0:egress,1:egress", None), ("Simple", "0:both", None),
    ("LL", "0:egress,1:egress", dict(loss=0.0005, reorder=0.0005, duplicate=0.0005, seed=5)),
    ("Simple", "0:both", dict(loss=0.0001, reorder=0.0001, seed=7))])
def test_a_generated_capture_replays_alike(tmp_path, monkeypatch, proto, mirrors, faults):
    """From capture files (sends whose bytes still lie in the batch): per send, compiled, and
    compiled from the run lane's columns (``SendBlock``), the same results, intact and with
    packets lost, reordered and duplicated."""
    from mirrorckpt.capture.pcapfile import open_capture
    from mirrorckpt.config.jobfile import load_job
    from mirrorckpt.parser.roce.collectives import NcclJobModel
    from mirrorckpt.parser.roce.jobstream import JobStream
    from mirrorckpt.parser.roce.sends import SendBlock
    from mirrorckpt.parser.roce.streams import MirrorStreams
    from mirrorckpt.tools.generator.faults import FaultOptions
    from mirrorckpt.tools.generator.gen import GenConfig, generate

    generate(GenConfig(ranks=2, channels=2, protocol=proto, model="linear:" + ("2000000" if faults else "200000"),
                       steps=3, seed=3,
                       mirrors=mirrors, send_truth=False, faults=FaultOptions(**(faults or {}))), tmp_path)
    job = load_job(tmp_path / "job.toml")
    got, rows = {}, []
    batch = _placerun.place_batch

    def counting(placer, units, *a):  # the rows that come as columns
        rows.extend(len(u) for u in units if type(u) is SendBlock)
        return batch(placer, units, *a)

    monkeypatch.setattr(_placerun, "place_batch", counting)
    for compiled, blocks in ((False, False), (True, False), (True, True)):
        RingPlacer.compiled = compiled
        try:
            # read ahead, as replay does: sends' bytes stay in the capture until placed (LazySend)
            streams = MirrorStreams([(p.name, open_capture(p)) for p in sorted(tmp_path.glob("*.pcap*"))],
                                    nccl_version=job.ring.nccl_version, ahead=1, blocks=blocks)
            js = JobStream(streams, model=NcclJobModel.from_job(job), ranks=job.ring.ranks_by_address())
            results = [(r.index, r.complete, r.pieces, r.sha256(), tuple(r.holes)) for r in js
                       if isinstance(r, CollectiveResult)]
        finally:
            RingPlacer.compiled = True
        got[(compiled, blocks)] = results, js.report().placement
    assert got[(False, False)] == got[(True, False)] == got[(True, True)]
    assert got[(True, True)][0]
    if proto != "LL128" and (faults is None or proto == "LL"):
        # LL words and Simple bytes left in the batch come as columns (the Simple capture with
        # faults has one in each of its few batches: the batches go the per-message way)
        assert sum(rows) > 0, rows
    if faults is None:
        assert all(r[1] for r in got[(True, True)][0]) and set(got[(True, True)][1]) == {"placed"}
