"""The ring state machine alone (parser.statemachine): NCCL sends built directly from a NcclJobModel and
NCCL's ring plan, placed by LL/LL128 flag, by CTS index, or as the message after the last one.

The expected placement of every message is walked here the way the generator's wire does it
(tools/generator/wire.py ``Wire.run``): per connection one step counter, a collective starts at
``conn_step_start`` of it and advances it past its last message by ``slice_steps``. A 3-rank,
2-channel DDP job (start-up all-gather and broadcasts, rebuild broadcasts, two buckets, a first
iteration with one bucket) with a non-trivial ring order on channel 1 covers collectives that use
one channel or both, multi-loop collectives, positions that only receive, and 0-byte steps.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from dataclasses import replace

import numpy as np
import pytest
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec, RingSpec, wire_address
from mirrorckpt.parser.placement import Placement
from mirrorckpt.parser.roce import nccl_versions as nv
from mirrorckpt.parser.roce import schedule
from mirrorckpt.parser.roce.collectives import NcclJobModel
from mirrorckpt.parser.roce.nccl import ConnKey, NcclSend
from mirrorckpt.parser.roce.reassembly import QpKey
from mirrorckpt.parser.roce.statemachine import MAX_AHEAD_STEPS, RingStateMachine

ADDRESSES = {0: "10.0.0.1", 1: "10.0.0.2", 2: "10.0.0.3"}
ORDERS = [[0, 1, 2], [0, 2, 1]]
ITERATIONS = 4
RECV_BASE = 0x7F00_0000_0000


def layout() -> JobLayout:
    params = [ParamSpec("w1", (256, 300)), ParamSpec("b1", (300,)), ParamSpec("w2", (10, 256)), ParamSpec("b2", (10,))]
    return JobLayout(params, [BucketSpec((3, 2)), BucketSpec((1, 0))], [BucketSpec((0, 1, 2, 3))])


def ring(proto: str, nranks: int = 3, orders=ORDERS) -> RingSpec:
    return RingSpec(nranks, len(orders), proto, "2.18", ring_orders=orders,
                    addresses={r: ADDRESSES[r] for r in range(nranks)})


def ddp_model(proto: str, **kw) -> NcclJobModel:
    return NcclJobModel.ddp(ring(proto), layout(), **kw)


def conn_of(r: RingSpec, ch: int, pos: int) -> ConnKey:
    a = r.orders()[ch][pos]
    b = r.next_rank(ch, a)
    return ConnKey(wire_address(r.addresses[a]), wire_address(r.addresses[b]), 0xC000 + 16 * ch + a)


def channel_map(r: RingSpec) -> dict[ConnKey, int]:
    return {conn_of(r, ch, pos): ch for ch in range(r.nchannels) for pos in range(r.nranks)}


def walk(model: NcclJobModel, ncoll: int) -> dict[tuple[int, int], list[tuple[int, schedule.RingStep, int]]]:
    """(channel, ring position) -> every message of the first ``ncoll`` collectives in wire order, as
    (collective, message, absolute connection step)."""
    r = model.ring
    counter: dict[tuple[int, int], int] = defaultdict(int)
    out = defaultdict(list)
    for i in range(ncoll):
        c = model[i]
        if c is None:
            break
        plan, proto = model.plan(c), model.protocol(c)
        for ch in range(r.nchannels):
            for pos in range(r.nranks):
                msgs = plan.messages(pos, ch) if ch in plan.channels else []
                if not msgs:
                    continue
                t0 = schedule.conn_step_start(counter[ch, pos], proto, c.kind)
                out[ch, pos] += [(i, st, t0 + st.conn_step) for st in msgs]
                counter[ch, pos] = t0 + msgs[-1].conn_step + nv.slice_steps(proto, c.kind)
    return out


PMTU = 1024
_psns: dict[int, tuple[NcclJobModel, dict]] = {}


def npkts(wire_bytes: int) -> int:
    return max(1, -(-wire_bytes // PMTU))


def psn_of(model: NcclJobModel, ch: int, pos: int, m: int) -> int:
    """First PSN of connection message ``m`` on its QP (NCCL starts at 0; one QP per connection)."""
    if id(model) not in _psns:
        _psns[id(model)] = (model, walk(model, model.first_of_iteration(ITERATIONS)))
    msgs = _psns[id(model)][1][ch, pos]
    return sum(npkts(st.wire_bytes) for _, st, _ in msgs[:m]) + max(0, m - len(msgs))


def make_send(model: NcclJobModel, ch: int, pos: int, st: schedule.RingStep, t: int, m: int, route: str,
              stream: int = 0, wire_bytes: int | None = None, psn: int | None = None) -> NcclSend:
    """The send a decoder yields for message ``st`` at step ``t`` (connection message ``m``, at PSN
    ``psn``: by default where it lies when every message before it went out).

    route "flag": LL/LL128 flag (an empty step has no line to carry one), "cts": the CTS index,
    "next": neither (sender's egress alone, Simple)."""
    r = model.ring
    conn = conn_of(r, ch, pos)
    proto = model.ring.protocol
    empty = st.wire_bytes == 0
    slot = schedule.recv_slot(t, proto, "allreduce", r.nccl_version)
    wb = st.wire_bytes if wire_bytes is None else wire_bytes
    return NcclSend(conn, QpKey(conn.sender, conn.receiver, 0x100 + conn.sport), proto,
                    np.zeros(st.nbytes, np.uint8), [], wb, wb, RECV_BASE + slot.alloc_offset,
                    "empty" if empty else "normal",
                    flag=schedule.flag(proto, t) if route == "flag" and not empty else None,
                    seq=m + 1 if route == "cts" else None, stream=stream,
                    psn=psn_of(model, ch, pos, m) if psn is None else psn, npkts=npkts(wb), pmtu=PMTU)


def all_sends(model: NcclJobModel, route: str, ncoll: int | None = None, stream: int = 0):
    """(send, expected placement fields) of every message, connection by connection."""
    ncoll = model.first_of_iteration(ITERATIONS) if ncoll is None else ncoll
    out = []
    for (ch, pos), msgs in sorted(walk(model, ncoll).items()):
        for m, (i, st, t) in enumerate(msgs):
            out.append((make_send(model, ch, pos, st, t, m, route, stream), (i, st, ch, pos, t)))
    return out


def check(p: Placement | None, model: NcclJobModel, send: NcclSend, want) -> None:
    i, st, ch, pos, t = want
    assert p is not None, f"channel {ch} position {pos} step {t} (collective {i}) not placed"
    assert (p.coll, p.step, p.channel, p.rank_pos, p.t) == (i, st, ch, pos, t)
    assert p.spec is model[i] and p.send is send


def by_time(sends):
    """Wire order across connections: by connection step, connections in turn."""
    return sorted(sends, key=lambda x: (x[1][4], x[1][2], x[1][3]))


ROUTES = [("LL", "flag"), ("LL128", "flag"), ("LL", "cts"), ("LL128", "cts"), ("Simple", "cts"),
          ("LL", "next"), ("LL128", "next"), ("Simple", "next")]


@pytest.mark.parametrize("proto,route", ROUTES)
def test_every_send_of_a_ddp_job_is_placed_at_its_message(proto, route):
    model = ddp_model(proto)
    sm = RingStateMachine(model, model.ring.ranks_by_address(), channel_map(model.ring))
    sends = by_time(all_sends(model, route))
    for s, want in sends:
        check(sm.place(s), model, s, want)
    assert sm.counts == Counter(placed=len(sends)) and not sm.mismatches
    # the job is what the docstring says: every kind, every iteration, both channels, empty steps
    placed = {w[0] for _, w in sends}
    assert placed == set(range(model.first_of_iteration(ITERATIONS)))
    assert {model[i].kind for i in placed} == {"allgather", "broadcast", "allreduce"}
    assert {w[2] for _, w in sends} == {0, 1}
    if proto != "LL":
        assert any(s.wire_bytes == 0 for s, _ in sends)


@pytest.mark.parametrize("proto,route", [("LL", "flag"), ("LL128", "flag"), ("Simple", "cts")])
def test_steps_and_message_numbers_place_in_any_order(proto, route):
    """Flags and CTS indexes are absolute: the tables grow on demand from whatever comes first."""
    model = ddp_model(proto)
    sm = RingStateMachine(model, model.ring.ranks_by_address(), channel_map(model.ring))
    sends = [x for x in all_sends(model, route) if x[0].flag is not None or x[0].seq is not None]
    random.Random(7).shuffle(sends)
    for s, want in sends:
        check(sm.place(s), model, s, want)
    assert sm.counts == Counter(placed=len(sends))


def test_the_next_message_counts_from_the_furthest_one_placed():
    """A flag from the past (a late copy) does not move the connection back: the flagless send
    after it is the message after the furthest one."""
    model = ddp_model("LL")
    sm = RingStateMachine(model, model.ring.ranks_by_address(), channel_map(model.ring))
    msgs = walk(model, model.first_of_iteration(ITERATIONS))[0, 0]
    k = 9
    for m in (k, 3):
        i, st, t = msgs[m]
        s = make_send(model, 0, 0, st, t, m, "flag")
        check(sm.place(s), model, s, (i, st, 0, 0, t))
    i, st, t = msgs[k + 1]
    s = make_send(model, 0, 0, st, t, k + 1, "next")
    check(sm.place(s), model, s, (i, st, 0, 0, t))


def test_the_next_message_is_counted_per_mirror_stream():
    """One link seen by two streams delivers each send twice; each copy follows its own stream."""
    model = ddp_model("Simple")
    sm = RingStateMachine(model, model.ring.ranks_by_address(), channel_map(model.ring))
    a, b = all_sends(model, "next", stream=0), all_sends(model, "next", stream=1)
    for (s0, w0), (s1, w1) in zip(a, b):
        check(sm.place(s0), model, s0, w0)
        check(sm.place(s1), model, s1, w1)
    assert sm.counts == Counter(placed=2 * len(a))


def test_ll_flags_unwrap_to_the_step_nearest_the_last():
    u = RingStateMachine._unwrap_flag
    assert u(5, 0) == 5 and u(5, 100) == 5
    assert u(3, (1 << 32) - 2) == (1 << 32) + 3  # the 32-bit flag wrapped forwards
    assert u((1 << 32) - 1, (1 << 32) + 2) == (1 << 32) - 1  # a late send from before the wrap
    assert u(7, 5 * (1 << 32) + 1) == 5 * (1 << 32) + 7


def test_a_size_the_plan_does_not_expect_is_a_mismatch_never_placed():
    model = ddp_model("LL")
    sm = RingStateMachine(model, model.ring.ranks_by_address(), channel_map(model.ring))
    sends = all_sends(model, "flag")
    s, (i, st, ch, pos, t) = next(x for x in sends if model[x[1][0]].label == "grad" and x[1][1].phase == "reduced")
    bad = make_send(model, ch, pos, st, t, 0, "flag", wire_bytes=st.wire_bytes + 16)
    assert sm.place(bad) is None
    assert sm.counts == Counter(mismatch=1)
    text = sm.mismatches[0]
    for part in (str(bad.connection), f"step {t}", f"{st.wire_bytes + 16} wire bytes", f"expects {st.wire_bytes}",
                 f"grad #{i}", "reduced"):
        assert part in text, (part, text)
    # the right size at the same step is placed; only 20 texts are kept, every mismatch is counted
    check(sm.place(s), model, s, (i, st, ch, pos, t))
    for _ in range(30):
        sm.place(bad)
    assert sm.counts["mismatch"] == 31 and len(sm.mismatches) == 20


def test_a_flagless_send_after_a_lost_message_is_placed_by_the_psns_in_between():
    """Without flag or CTS the next message is proven by its QP's PSNs: the gap after the last send
    placed must be exactly the planned messages in between."""
    model = ddp_model("Simple")
    sm = RingStateMachine(model, model.ring.ranks_by_address(), channel_map(model.ring))
    msgs = walk(model, model.first_of_iteration(ITERATIONS))[0, 0]
    # the first message whose size differs from the one before it
    k = next(m for m in range(1, len(msgs) - 1) if msgs[m][1].wire_bytes != msgs[m + 1][1].wire_bytes)
    for m in range(k):
        i, st, t = msgs[m]
        s = make_send(model, 0, 0, st, t, m, "next")
        check(sm.place(s), model, s, (i, st, 0, 0, t))
    i, st, t = msgs[k + 1]  # message k lost
    s = make_send(model, 0, 0, st, t, k + 1, "next")
    # a PSN one off: another message by the PSNs (refused by its slot), or none at all
    for off in (-1, 1):
        bad = make_send(model, 0, 0, st, t, k + 1, "next", psn=s.psn + off)
        assert sm.place(bad) is None
    assert sm.counts["placed"] == k and sm.counts["unplaced_slot"] + sm.counts["unplaced_psn_gap"] == 2
    bad = make_send(model, 0, 0, st, t, k + 1, "next", psn=s.psn + 10**6)
    assert sm.place(bad) is None and sm.counts["unplaced_psn_gap"] >= 1
    check(sm.place(s), model, s, (i, st, 0, 0, t))
    # a send claiming to follow the last one directly, with the lost one's size: its PSN proves it
    # is message k, and its slot (VA) is checked too
    i, st, t = msgs[k + 2]
    s = make_send(model, 0, 0, st, t, k + 2, "next")
    check(sm.place(s), model, s, (i, st, 0, 0, t))


def test_a_flagless_send_after_lost_messages_of_the_same_size_is_placed_at_its_own_message():
    """The silent corruption this guards against: a flagless send (Simple, sender's egress without
    the receiver's CTS) after whole lost messages was placed at the first lost one's place when
    their sizes agreed. Its PSN shows how many messages were lost, its VA names its slot."""
    model = ddp_model("Simple")
    sm = RingStateMachine(model, model.ring.ranks_by_address(), channel_map(model.ring))
    msgs = walk(model, model.first_of_iteration(ITERATIONS))[0, 0]

    def fits(k, j):  # message k+j would pass for message k: same size, other data, another slot
        (i0, a, t0), (i1, b, t1) = msgs[k], msgs[k + j]
        return a.wire_bytes == b.wire_bytes > 0 and (i0, a.offset) != (i1, b.offset) and \
            schedule.slot(t0) != schedule.slot(t1)

    k, j = next((k, j) for j in (1, 2, 3) for k in range(1, len(msgs) - j) if fits(k, j))
    for m in range(k):
        i, st, t = msgs[m]
        assert sm.place(make_send(model, 0, 0, st, t, m, "next")) is not None
    i, st, t = msgs[k + j]  # messages k .. k+j-1 lost
    s = make_send(model, 0, 0, st, t, k + j, "next")
    check(sm.place(s), model, s, (i, st, 0, 0, t))
    # the same bytes at message k's PSN (a sender that skipped nothing) but k+j's slot: the VA refuses
    sm = RingStateMachine(model, model.ring.ranks_by_address(), channel_map(model.ring))
    for m in range(k):
        i0, st0, t0 = msgs[m]
        sm.place(make_send(model, 0, 0, st0, t0, m, "next"))
    assert sm.place(make_send(model, 0, 0, st, t, k + j, "next", psn=psn_of(model, 0, 0, k))) is None
    assert sm.counts["unplaced_slot"] == 1


def test_a_send_in_another_protocol_is_never_data_of_the_collective():
    model = ddp_model("LL")
    sm = RingStateMachine(model, model.ring.ranks_by_address(), channel_map(model.ring))
    s, _ = next(x for x in all_sends(model, "cts") if x[0].wire_bytes)
    s.protocol = "Simple"
    assert sm.place(s) is None and sm.counts == Counter(protocol_mismatch=1)


def test_a_per_collective_protocol_is_taken_from_the_spec():
    """A collective pinned to its own protocol (CollSpec.protocol) is planned and checked with it."""
    r = ring("LL")
    base = NcclJobModel.allreduces(r, [5000, 300], "float32")
    per = [replace(c, protocol="Simple" if k else None) for k, c in enumerate(base.per_iteration)]
    model = NcclJobModel(r, None, per_iteration=per)
    sm = RingStateMachine(model, r.ranks_by_address(), channel_map(r))
    n = 0
    for (ch, pos), msgs in walk(model, 6).items():
        for m, (i, st, t) in enumerate(msgs):
            proto = model.protocol(model[i])
            s = make_send(model, ch, pos, st, t, m, "cts")
            s.protocol = proto if st.wire_bytes else None
            check(sm.place(s), model, s, (i, st, ch, pos, t))
            n += 1
    assert {model.protocol(model[i]) for i in range(6)} == {"LL", "Simple"} and sm.counts == Counter(placed=n)


def test_traffic_outside_the_ring_is_not_placed():
    model = ddp_model("LL")
    r = model.ring
    chans = channel_map(r)
    sm = RingStateMachine(model, r.ranks_by_address(), chans)
    s, _ = all_sends(model, "cts")[0]
    other = ConnKey(s.connection.sender, s.connection.receiver, 0xBEEF)  # a connection of no channel
    s.connection = other
    assert sm.place(s) is None
    stranger = ConnKey(wire_address("10.0.0.99"), wire_address(ADDRESSES[1]), 0xC000)
    chans[stranger] = 0  # mapped, but its sender is no rank of the job
    s.connection = stranger
    assert sm.place(s) is None
    assert sm.counts == Counter(not_ring=2) and sm.where(other) is None
    # ring positions follow the channel's order: rank 2 is position 1 on channel 1
    assert sm.where(conn_of(r, 1, 1)) == (1, 1) and r.orders()[1][1] == 2


def test_a_flagless_send_without_size_or_step_is_not_guessed():
    model = ddp_model("Simple")
    sm = RingStateMachine(model, model.ring.ranks_by_address(), channel_map(model.ring))
    s, _ = all_sends(model, "next")[0]
    s.length_known = False
    assert sm.place(s) is None and sm.counts == Counter(unplaced_unconfirmed=1)
    # attached mid-run: no first message to count from
    late = NcclJobModel.ddp(ring("Simple"), layout(), with_startup=False)
    sm = RingStateMachine(late, late.ring.ranks_by_address(), channel_map(late.ring))
    s, _ = all_sends(late, "next")[0]
    assert sm.place(s) is None and sm.counts == Counter(unplaced_no_step=1)


def test_steps_past_the_job_or_far_ahead_are_not_placed():
    r = ring("LL")
    model = NcclJobModel.allreduces(r, [5000], "float32", iterations=2)
    sm = RingStateMachine(model, r.ranks_by_address(), channel_map(r))
    msgs = walk(model, 2)[0, 0]
    i, st, t = msgs[-1]
    s = make_send(model, 0, 0, st, t, len(msgs) - 1, "flag")
    check(sm.place(s), model, s, (i, st, 0, 0, t))
    past_flag = make_send(model, 0, 0, st, t + 1, len(msgs), "flag")
    past_cts = make_send(model, 0, 0, st, t + 1, len(msgs), "cts")
    assert sm.place(past_flag) is None and sm.place(past_cts) is None
    far = make_send(model, 0, 0, st, t + MAX_AHEAD_STEPS + 1, 0, "flag")
    assert sm.place(far) is None
    assert sm.counts == Counter(placed=1, unplaced_no_message_at_step=1, unplaced_past_end=1,
                                unplaced_implausible_step=1)


def test_a_message_number_no_sequence_reaches_is_refused_at_once():
    """A CTS index far past anything tabulated (a damaged or fuzzed capture: the fuzz test found
    inference walking the unending sequence for it until memory ran out) is garbage: no message,
    and the table is not extended for it."""
    model = ddp_model("Simple")
    sm = RingStateMachine(model, model.ring.ranks_by_address(), channel_map(model.ring))
    assert sm.by_message(0, 0, MAX_AHEAD_STEPS + 10) is None
    assert len(sm.track(0, 0).t0) == 0
    assert sm.by_message(0, 0, 1 << 40) is None
    st = next(st for st in model.plan(model[0]).messages(0, 0) if st.wire_bytes)
    assert sm.place(make_send(model, 0, 0, st, 0, 1 << 40, "cts")) is None
    assert sm.counts == Counter(unplaced_past_end=1)


def test_a_channel_small_collectives_never_use_gives_up():
    """Every all-reduce fits one channel: a step on channel 1 is never reached, and the unending
    sequence is not walked for it."""
    r = ring("LL")
    model = NcclJobModel.allreduces(r, [300, 500], "float32")
    assert all(model.plan(model[i]).channels == [0] for i in range(2))
    sm = RingStateMachine(model, r.ranks_by_address(), channel_map(r))
    st = next(st for st in model.plan(model[0]).messages(0, 0) if st.wire_bytes)
    assert sm.place(make_send(model, 1, 0, st, 40, 0, "flag")) is None
    assert sm.place(make_send(model, 1, 0, st, 40, 40, "cts")) is None
    assert sm.counts == Counter(unplaced_no_message_at_step=1, unplaced_past_end=1)
    assert len(sm.track(1, 0).t0) < 20
    # channel 0 is unaffected
    msgs = walk(model, 50)[0, 0]
    i, st, t = msgs[-1]
    s = make_send(model, 0, 0, st, t, len(msgs) - 1, "flag")
    check(sm.place(s), model, s, (i, st, 0, 0, t))


def test_the_table_queries_agree_with_the_walk():
    """expected / by_message / collective_steps / message_number against the independent walk."""
    model = ddp_model("Simple")
    sm = RingStateMachine(model, model.ring.ranks_by_address(), channel_map(model.ring))
    ncoll = model.first_of_iteration(ITERATIONS)
    w = walk(model, ncoll)
    for (ch, pos), msgs in w.items():
        firsts: dict[int, tuple[int, int]] = {}
        for m, (i, st, t) in enumerate(msgs):
            assert sm.by_message(ch, pos, m) == (i, st, t)
            assert sm.expected(ch, pos, t) == (i, st)
            assert sm.message_number(ch, pos, i, st) == m
            firsts.setdefault(i, (t - st.conn_step, 0))
            firsts[i] = (firsts[i][0], firsts[i][1] + 1)
        for i, (t0, n) in firsts.items():
            assert sm.collective_steps(ch, pos, i) == (t0, n)
        # Simple's second slice step of every message carries nothing
        i, st, t = msgs[0]
        assert sm.expected(ch, pos, t + 1) is None


def test_tables_bounded_for_a_long_run(monkeypatch):
    """The per-connection tables keep the last TRACK_KEPT collectives (a daemon serves for weeks):
    queries on the kept ones agree with the walk, older ones find nothing, nothing is misplaced."""
    from mirrorckpt.parser.roce import statemachine

    monkeypatch.setattr(statemachine, "TRACK_KEPT", 8)
    model = ddp_model("Simple")
    sm = RingStateMachine(model, model.ring.ranks_by_address(), channel_map(model.ring))
    ncoll = model.first_of_iteration(ITERATIONS + 20)
    assert ncoll > 40
    w = walk(model, ncoll)
    for (ch, pos), msgs in w.items():
        for m, (i, st, t) in enumerate(msgs):  # in wire order, as a serve sees them
            assert sm.by_message(ch, pos, m) == (i, st, t)
            assert sm.expected(ch, pos, t) == (i, st)
        tr = sm.track(ch, pos)
        assert len(tr.t0) <= 8 and tr.base > 0
        i, st, t = msgs[0]  # dropped long ago
        assert sm.by_message(ch, pos, 0) is None and sm.expected(ch, pos, t) is None
        assert sm.message_number(ch, pos, i, st) is None and sm.collective_steps(ch, pos, i) == (0, 0)
        m = len(msgs) - 1
        i, st, t = msgs[m]
        assert sm.message_number(ch, pos, i, st) == m


def test_job_model_cache_bounded_and_same(monkeypatch):
    """The model's made collectives are bounded (a daemon runs for weeks) and remade the same."""
    from mirrorckpt.parser import collectives

    monkeypatch.setattr(collectives, "CACHED_COLLECTIVES", 64)
    ring = RingSpec(nranks=2, nchannels=2, protocol="LL", nccl_version="2.18")
    model = NcclJobModel.allreduces(ring, [1000, 2000, 3000], "float32")
    first = [model[i] for i in range(300)]
    assert len(model._cache) <= 64
    assert [model[i] for i in range(300)] == first and len(model._cache) <= 64
