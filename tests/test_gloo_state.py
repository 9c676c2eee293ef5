"""The gloo placer alone (parser.gloo_state): data ops built directly as ``GlooOp``s (what
``parser.gloo`` yields after TCP reassembly and framing) for a DDP job's collectives, turned into
``Placement``s and checked against each collective's true result.

``Job`` writes every collective of a ``JobModel.ddp`` the way gloo sends it: per (sender, receiver)
direction the send list of ``gloo_schedule``, one data op per send with its per-slot index, the
payload taken from the collective's result where the send carries final values (reduced segments,
broadcast and all-gather data) and random bytes where it carries partial sums. ``assemble`` puts
the placed bytes where their placement says, the way the concatenator does, so a placement that
names the wrong collective, offset or origin shows up as wrong bytes.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from mirrorckpt.config.ddp import ALLGATHER, ALLREDUCE, BROADCAST, CollSpec
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec, RingSpec, dtype_size, wire_address
from mirrorckpt.parser.collectives import JobModel
from mirrorckpt.parser.gloo import framing as gloo
from mirrorckpt.parser.gloo import schedule as gs
from mirrorckpt.parser.gloo.placer import GlooPlacer, GlooSend
from mirrorckpt.parser.gloo.tcp import StreamKey
from mirrorckpt.parser.placement import REDUCED, Placement

PREFIX = {ALLREDUCE: gs.PREFIX_ALLREDUCE, BROADCAST: gs.PREFIX_BROADCAST, ALLGATHER: gs.PREFIX_ALLGATHER}
SEGMENT = 2048  # small gloo segments: all-reduces of many ops


def addr(rank: int) -> bytes:
    return wire_address(f"10.9.0.{rank + 1}")


def stream(s: int, d: int) -> StreamKey:
    return StreamKey(addr(s), addr(d), 50000 + 10 * s + d, 40000 + d)


class Job:
    """The data ops of a DDP job's first ``iterations`` iterations, per collective and direction."""

    def __init__(self, P: int = 3, iterations: int = 3, seed: int = 0, tag_base: int = 0,
                 extra_after: dict[int, CollSpec | str] | None = None, v_rows: int = 7, model: JobModel | None = None):
        self.P, self.rng = P, np.random.default_rng(seed)
        params = [ParamSpec("w", (40, 30)), ParamSpec("b", (30,)), ParamSpec("v", (v_rows, 40)),
                  ParamSpec("c", (v_rows,))]
        layout = JobLayout(params, [BucketSpec((3, 2)), BucketSpec((1, 0))], [BucketSpec((0, 1, 2, 3))])
        self.model = model or JobModel.ddp(RingSpec(P), layout)
        self.ranks = {addr(r): r for r in range(P)}
        self.ncoll = self.model.first_of_iteration(iterations)
        self.truth: dict[int, np.ndarray] = {}
        self.ops: dict[int, dict[tuple[int, int], list[gloo.GlooOp]]] = {}  # coll -> direction -> ops
        self.extra: list[gloo.GlooOp] = []
        tag = tag_base
        for i in range(self.ncoll):
            spec = self.model[i]
            self.truth[i], self.ops[i] = self._collective(spec, tag)
            tag += 1
            x = (extra_after or {}).get(i)
            if x is not None:  # a collective outside the model, with its own tag
                self.extra += self._barrier(tag) if x == "barrier" else \
                    [o for ops in self._collective(x, tag)[1].values() for o in ops]
                tag += 1

    def _collective(self, spec: CollSpec, tag: int):
        es = dtype_size(spec.dtype)
        nbytes = spec.count * es
        total = nbytes * (self.P if spec.kind == ALLGATHER else 1)
        result = self.rng.integers(0, 256, total, dtype=np.uint8)
        slot = gs.make_slot(PREFIX[spec.kind], tag)
        out = {}
        for s in range(self.P):
            for d in range(self.P):
                if d == s:
                    continue
                ops = []
                for k, snd in enumerate(gs.sends(spec.kind, nbytes, es, self.P, s, d, spec.root, SEGMENT)):
                    if spec.kind == ALLREDUCE and snd.phase != REDUCED:
                        data = self.rng.integers(0, 256, snd.length, dtype=np.uint8)
                    else:
                        base = snd.origin * nbytes if spec.kind == ALLGATHER else 0
                        data = result[base + snd.offset: base + snd.offset + snd.length].copy()
                    ops.append(data_op(s, d, slot, k, data))
                if ops:
                    out[s, d] = ops
        return result, out

    def _barrier(self, tag: int) -> list[gloo.GlooOp]:
        slot = gs.make_slot(gs.PREFIX_BARRIER, tag)
        return [data_op(s, (s + 1) % self.P, slot, 0, np.zeros(0, np.uint8)) for s in range(self.P)]

    def all_ops(self, notifications: bool = True) -> list[gloo.GlooOp]:
        """Every op in a wire-like order: collectives in turn, directions interleaved op by op."""
        rng = random.Random(1)
        out = []
        for i in range(self.ncoll):
            queues = [list(q) for q in self.ops[i].values()]
            while any(queues):
                q = rng.choice([q for q in queues if q])
                op = q.pop(0)
                if notifications:
                    out.append(gloo.GlooOp(op.stream.reverse(), 0, 0, 0, 0, gloo.NOTIFY_RECV_READY, op.slot,
                                           op.length))
                out.append(op)
        return out


def data_op(s: int, d: int, slot: int, index: int, data: np.ndarray, **kw) -> gloo.GlooOp:
    return gloo.GlooOp(stream(s, d), 0, 0, 0, 0, gloo.SEND_UNBOUND_BUFFER, slot, len(data), data, [],
                       index=index, trusted=True, **kw)


def assemble(job: Job, placements: list[Placement]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per collective: the bytes of its final values as placed, and which bytes were placed."""
    out = {}
    for p in placements:
        c, st = p.spec, p.step
        if c.kind == ALLREDUCE and st.phase != REDUCED:
            continue
        es = dtype_size(c.dtype)
        start = (st.offset + (st.chunk * c.count if c.kind == ALLGATHER else 0)) * es
        n = st.nelem * es
        buf, seen = out.setdefault(p.coll, (np.zeros_like(job.truth[p.coll]), np.zeros(len(job.truth[p.coll]), bool)))
        data = np.asarray(p.send.data[:n])
        assert len(data) == n
        assert not seen[start:start + n].any() or np.array_equal(buf[start:start + n], data), \
            f"collective {p.coll}: two copies of bytes {start}.. differ"
        buf[start:start + n] = data
        seen[start:start + n] = True
    return out


def check_exact(job: Job, placements: list[Placement], colls) -> None:
    got = assemble(job, placements)
    for i in colls:
        assert i in got, f"collective {i} ({job.model[i].label}) has no placement"
        buf, seen = got[i]
        assert seen.all(), f"collective {i} ({job.model[i].label}): {np.count_nonzero(~seen)} bytes never placed"
        assert np.array_equal(buf, job.truth[i]), f"collective {i} ({job.model[i].label}) is WRONG"


def feed_all(placer: GlooPlacer, ops) -> list[Placement]:
    out = []
    for op in ops:
        out += placer.feed([op])
    return out + placer.release()


def feed_before(placer: GlooPlacer, job, coll: int) -> None:
    """Every op of the collectives before ``coll``, placed."""
    for i in range(coll):
        feed_all(placer, [o for ops in job.ops[i].values() for o in ops])


@pytest.mark.parametrize("P", [2, 3, 4])
def test_every_collective_of_a_ddp_job_is_placed_exactly(P):
    job = Job(P)
    placer = GlooPlacer(job.model, job.ranks, max_segment=SEGMENT)
    ops = job.all_ops()
    out = feed_all(placer, ops)
    ndata = sum(op.is_data for op in ops)
    assert placer.counts == Counter(placed=ndata, notifications=len(ops) - ndata) and not placer.mismatches
    check_exact(job, out, range(job.ncoll))
    assert {job.model[i].kind for i in range(job.ncoll)} == {ALLGATHER, BROADCAST, ALLREDUCE}
    by_op = {id(op): op for op in ops}
    for p in out:
        op = p.send.op
        assert isinstance(p.send, GlooSend) and by_op[id(op)] is op
        assert p.spec is job.model[p.coll] and p.channel == 0 and p.rank_pos == job.ranks[op.stream.src]
        assert p.t == p.step.conn_step == op.index
        if p.step.nbytes == op.length:  # (an element split in halves is placed from two ops)
            assert p.step.wire_bytes == op.length + 48
        assert p.send.ts_ns == op.ts_ns and str(op.stream) in p.send.connection


def test_a_direction_is_handed_on_only_once_its_whole_send_list_agreed():
    job = Job(3)
    placer = GlooPlacer(job.model, job.ranks, max_segment=SEGMENT)
    coll = job.model.first_of_iteration(2)
    feed_before(placer, job, coll)
    (s, d), ops = next(iter(job.ops[coll].items()))
    assert len(ops) > 2
    for op in ops[:-1]:
        assert placer.feed([op]) == []
    got = placer.feed([ops[-1]])
    assert [p.send.op for p in got] == ops and all(p.coll == coll for p in got)
    assert placer.release() == []


def test_untrusted_ops_are_never_placed():
    """After a framing loss (a new epoch) the slots in flight cannot be counted (gloo.SlotTracker):
    what the slot held from before the loss is handed on as it is, nothing after it is placed."""
    job = Job(3)
    placer = GlooPlacer(job.model, job.ranks, max_segment=SEGMENT)
    coll = job.model.first_of_iteration(2)
    items = list(job.ops[coll].items())
    (s, d), ops = items[0]
    k = 2
    for op in ops[k:]:
        op.epoch, op.trusted = 1, False
    (_, _), whole = items[1]
    for op in whole:  # a slot first seen after a loss, with too few smaller tags since
        op.epoch, op.trusted = 1, False
    out = []
    for i in range(coll):
        out += feed_all(placer, [o for ops in job.ops[i].values() for o in ops])
    assert [placer.feed([op]) for op in ops[:k]] == [[]] * k
    got = placer.feed([ops[k]])
    assert [p.send.op for p in got] == ops[:k]
    for op in ops[k + 1:] + whole:
        assert placer.feed([op]) == []
    assert placer.release() == []
    c = placer.counts
    assert c["untrusted"] == len(ops) - k + len(whole) and c["released_partial"] == k and c["mismatch"] == 0


def test_a_framing_break_releases_what_its_stream_held():
    job = Job(3)
    placer = GlooPlacer(job.model, job.ranks, max_segment=SEGMENT)
    coll = job.model.first_of_iteration(1)
    feed_before(placer, job, coll)
    (s, d), ops = next(iter(job.ops[coll].items()))
    for op in ops[:-1]:
        assert placer.feed([op]) == []
    # the next op on the same (source, stream) comes from a new framing epoch
    resync = gloo.GlooOp(stream(s, d), 0, 0, 1, 0, gloo.NOTIFY_SEND_READY, ops[0].slot, 0)
    got = placer.feed([resync])
    assert [p.send.op for p in got] == ops[:-1]
    assert placer.counts["released_partial"] == len(ops) - 1
    # another direction's held ops stay held
    (s2, d2), ops2 = list(job.ops[coll].items())[1]
    placer.feed(ops2[:1])
    other = gloo.GlooOp(stream(s, d), 0, 0, 2, 0, gloo.NOTIFY_SEND_READY, ops[0].slot, 0)
    assert placer.feed([other]) == []


def test_a_length_the_schedule_does_not_have_breaks_the_direction():
    job = Job(3)
    placer = GlooPlacer(job.model, job.ranks, max_segment=SEGMENT)
    coll = job.model.first_of_iteration(2)
    feed_before(placer, job, coll)
    items = list(job.ops[coll].items())
    (s, d), ops = items[0]
    j = 3
    bad = data_op(s, d, ops[j].slot, j, np.zeros(ops[j].length + 4, np.uint8))
    out = []
    for op in ops[:j] + [bad] + ops[j + 1:]:
        out += placer.feed([op])
    assert out == []
    c = placer.counts
    assert c["mismatch"] == 1 and c["dropped_after_mismatch"] == j and c["after_mismatch"] == len(ops) - j - 1
    text = placer.mismatches[0]
    for part in (str(stream(s, d)), f"tag {coll}", f"op {j} has {ops[j].length + 4} B",
                 f"the schedule {ops[j].length}"):
        assert part in text, (part, text)
    # the other directions of the collective are placed as before
    for (_, _), other in items[1:]:
        got = []
        for op in other:
            got += placer.feed([op])
        assert [p.send.op for p in got] == other
    assert placer.release() == []


def test_an_op_past_the_send_list_is_a_mismatch():
    job = Job(3)
    placer = GlooPlacer(job.model, job.ranks, max_segment=SEGMENT)
    (s, d), ops = next(iter(job.ops[0].items()))
    feed_all(placer, ops)
    extra = data_op(s, d, ops[0].slot, len(ops), ops[0].data)
    assert placer.feed([extra]) == []
    assert placer.counts["mismatch"] == 1 and "no op" in placer.mismatches[0]


def test_an_op_from_a_host_of_no_rank_is_not_placed():
    job = Job(3)
    placer = GlooPlacer(job.model, job.ranks, max_segment=SEGMENT)
    op = job.ops[0][0, 1][0]
    op.stream = StreamKey(wire_address("10.9.0.99"), op.stream.dst, op.stream.sport, op.stream.dport)
    assert placer.feed([op]) == [] and placer.release() == []
    assert placer.counts == Counter(unknown_rank=1)


def test_a_barrier_outside_the_model_shifts_the_tags_after_it():
    job = Job(3, extra_after={4: "barrier"})  # a user barrier after the first rebuild broadcast
    placer = GlooPlacer(job.model, job.ranks, max_segment=SEGMENT)
    ops = job.all_ops(notifications=False)
    k = next(n for n, op in enumerate(ops) if op.tag > 5)
    out = feed_all(placer, ops[:k] + job.extra + ops[k:])
    assert placer.counts["not_in_model:barrier"] == len(job.extra) == 3
    assert placer.counts["mismatch"] == 0 and placer.tags.extra == {5} and placer.tags.coll[6] == 5
    check_exact(job, out, range(job.ncoll))


def test_a_barrier_between_buckets_of_one_size_is_counted_out_of_the_tags():
    """Buckets of equal size: the bucket after the barrier fits the collective after it too, so
    only counting the barrier's tag keeps the buckets in their places."""
    job = Job(3, v_rows=30, extra_after={8: "barrier"})  # after bucket 0 of iteration 2
    assert job.model[8].count == job.model[9].count and job.model[8].label == "grad"
    placer = GlooPlacer(job.model, job.ranks, max_segment=SEGMENT)
    ops = job.all_ops(notifications=False)
    k = next(n for n, op in enumerate(ops) if op.tag > 9)
    out = feed_all(placer, ops[:k] + job.extra + ops[k:])
    assert placer.counts["mismatch"] == 0 and placer.tags.coll[10] == 9
    check_exact(job, out, range(job.ncoll))


def test_all_gathers_and_broadcasts_from_another_root():
    """Whole and split elements in one all-gather half (20 bytes per rank: halves of 10), the data
    of each origin where it belongs, a broadcast tree rooted at rank 2."""
    r = RingSpec(4)
    start = [CollSpec(ALLGATHER, 5, "float32", "a"), CollSpec(ALLGATHER, 6, "float32", "b"),
             CollSpec(BROADCAST, 33, "float32", "c", root=2), CollSpec(ALLGATHER, 3, "bfloat16", "d")]
    model = JobModel(r, None, startup=start, per_iteration=[CollSpec(ALLREDUCE, 77, "float32", "grad")])
    job = Job(4, model=model)
    placer = GlooPlacer(job.model, job.ranks, max_segment=SEGMENT)
    out = feed_all(placer, job.all_ops())
    assert placer.counts["mismatch"] == 0 and placer.counts["released_partial"] == 0
    check_exact(job, out, range(job.ncoll))
    whole = [(p.step.offset, p.step.nelem) for p in out if p.coll == 0 and p.step.chunk == 1]
    assert sorted(whole) == [(0, 2)] * 3 + [(2, 1)] * 3 + [(3, 2)] * 3  # ranks 1, 2, 3 send origin 1 on


def test_a_collective_the_model_lacks_is_refused_and_the_next_one_found():
    """A user all-reduce of a size no model collective has: its tag fits nothing, and the model's
    next collective (tag + 1) is found by kind and lengths past the predicted one."""
    user = CollSpec(ALLREDUCE, 999, "float32", "user")
    job = Job(3, extra_after={7: user})
    placer = GlooPlacer(job.model, job.ranks, max_segment=SEGMENT)
    ops = job.all_ops(notifications=False)
    k = next(n for n, op in enumerate(ops) if op.tag > 8)
    out = feed_all(placer, ops[:k] + job.extra + ops[k:])
    ndir = len({op.stream for op in job.extra})  # each direction breaks at its first op
    c = placer.counts
    assert c["no_collective"] == c["mismatch"] == ndir and c["after_mismatch"] == len(job.extra) - ndir
    assert all(f"tag 8 (allreduce) op 0 of {job.extra[0].length} B fits no collective" in m for m in placer.mismatches)
    assert placer.tags.coll[9] == 8 and 8 not in placer.tags.coll
    assert not any(p.send.op in job.extra for p in out)
    check_exact(job, out, range(job.ncoll))


def test_tags_count_from_the_configured_base():
    job = Job(2, tag_base=100)
    out = feed_all(GlooPlacer(job.model, job.ranks, tag_base=100, max_segment=SEGMENT), job.all_ops())
    check_exact(job, out, range(job.ncoll))
    # a wrong base: tag 100 is taken for collective 100; the start-up ops fit nothing there
    placer = GlooPlacer(job.model, job.ranks, tag_base=0, max_segment=SEGMENT)
    out = feed_all(placer, job.all_ops())
    assert placer.counts["mismatch"] > 0 and all(p.coll >= 100 for p in out)


def test_an_int64_split_in_two_halves_is_placed_once_both_arrived():
    """DDP's parameter-count all-gather: one int64 per rank, sent as two 4-byte halves."""
    job = Job(3)
    assert job.model[0].label == "param_count" and job.model[0].count == 1
    placer = GlooPlacer(job.model, job.ranks, max_segment=SEGMENT)
    ops = job.ops[0][0, 1]
    assert [o.length for o in ops] == [4, 4, 4, 4]
    got = []
    for op in ops:
        got += placer.feed([op])
    assert [(p.step.chunk, p.step.offset, p.step.nelem) for p in got] == [(0, 0, 1), (2, 0, 1)]
    for p in got:
        assert bytes(p.send.data) == job.truth[0][p.step.chunk * 8:(p.step.chunk + 1) * 8].tobytes()
        assert p.send.holes == []
    # a hole in one half makes the whole element a hole
    placer = GlooPlacer(job.model, job.ranks, max_segment=SEGMENT)
    ops = [gloo.GlooOp(o.stream, o.source, o.generation, o.epoch, o.pos, o.opcode, o.slot, o.length, o.data,
                       [(1, 2)] if k == 1 else [], index=o.index, trusted=True) for k, o in enumerate(ops)]
    got = []
    for op in ops:
        got += placer.feed([op])
    assert [p.send.holes for p in got] == [[(0, 8)], []]
