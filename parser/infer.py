"""What the traffic says about the job when no configuration does.

From decoded NCCL sends (the first part of a capture) it finds the ring (addresses, ranks from
CTS tags, channels from the connections between a pair of ranks, the protocol) and the job's
collective sequence: DDP's start-up (parameter-count all-gather, shapes and initial-weight
broadcasts, bucket rebuild) when rank 0's egress shows it, else a series of all-reduces whose
element counts are solved from the message sizes. Every hypothesis is checked by placing every
send with the state machine; one that leaves a single size mismatch is rejected.

Limits (say so, rather than guess): LL/LL128 ring traffic; more than two ranks only when every
sender's rank is known from CTS tags and all channels share one ring order.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from mirrorckpt.config import ddp
from mirrorckpt.config.layout import JobLayout, RingSpec, address_text, dtype_size
from mirrorckpt.parser import nccl_versions as nv
from mirrorckpt.parser import schedule
from mirrorckpt.parser.collectives import JobModel
from mirrorckpt.parser.nccl import ConnKey, NcclDecoder, NcclSend
from mirrorckpt.parser.statemachine import RingStateMachine

ESIZE_DTYPES = {4: "float32", 2: "bfloat16", 8: "float64"}


class InferenceError(Exception):
    """The traffic does not determine the job; the message says what is missing."""


@dataclass
class Inferred:
    model: JobModel
    ranks: dict[bytes, int]  # address -> rank
    channels: dict[ConnKey, int]  # ring connection -> channel
    notes: list[str]


def ring_sends(sends: list[NcclSend]) -> dict[ConnKey, list[NcclSend]]:
    """Connections carrying LL/LL128 traffic (ring collectives) with their sends."""
    by = defaultdict(list)
    for s in sends:
        by[s.connection].append(s)
    return {k: v for k, v in by.items() if any(s.protocol in (nv.LL, nv.LL128) for s in v)}


def find_ranks(conns: dict[ConnKey, list[NcclSend]], decoders: list[NcclDecoder]) -> tuple[dict[bytes, int], list[str]]:
    notes = []
    addrs = sorted({a for k in conns for a in (k.sender, k.receiver)})
    if len(addrs) < 2:
        raise InferenceError("ring traffic between at least two addresses is needed to find the ranks")
    ranks: dict[bytes, int] = {}
    for dec in decoders:  # a CTS names the data sender's rank in its tag
        for key, c in dec.conns.items():
            tags = {e.tag for e in c.cts.values()}
            if len(tags) == 1 and key.sender in addrs:
                ranks[key.sender] = tags.pop()
    R = len(addrs)
    if len(set(ranks.values())) != len(ranks):
        raise InferenceError(f"CTS tags give one rank to several addresses: {ranks}")
    missing = [a for a in addrs if a not in ranks]
    free = [r for r in range(R) if r not in ranks.values()]
    if len(missing) == 1 and len(free) == 1:
        ranks[missing[0]] = free[0]
    elif missing:
        if R != 2:
            raise InferenceError(f"ranks of {', '.join(address_text(a) for a in missing)} are unknown (no CTS "
                                 f"seen from their receivers); give the ring addresses in the configuration")
        # Two ranks, no CTS: rank 0 is the sender of the start-up broadcasts, the one whose
        # connection carries more steps.
        steps = {a: max(((s.flag or 0) for k, v in conns.items() if k.sender == a for s in v), default=0)
                 for a in addrs}
        order = sorted(addrs, key=lambda a: -steps[a])
        ranks = {order[0]: 0, order[1]: 1}
        notes.append("no CTS seen: rank 0 taken to be the address that sent the start-up broadcasts")
    if sorted(ranks.values()) != list(range(R)):
        raise InferenceError(f"ranks from CTS tags {sorted(ranks.values())} are not 0..{R - 1}")
    return ranks, notes


def ring_order(conns, ranks: dict[bytes, int]) -> list[int]:
    nxt = {}
    for k in conns:
        a, b = ranks[k.sender], ranks[k.receiver]
        if nxt.setdefault(a, b) != b:
            raise InferenceError(f"rank {a} sends ring traffic to ranks {nxt[a]} and {b}: channels use "
                                 f"different ring orders; give them in the configuration")
    order, r = [0], 0
    while len(order) < len(ranks):
        r = nxt.get(r)
        if r is None or r in order:
            break
        order.append(r)
    if len(order) != len(ranks):
        if len(ranks) == 2:
            return [0, 1]
        raise InferenceError("the ring order is not fully visible in the mirrored traffic")
    return order


def channel_candidates(sm: RingStateMachine, conn: ConnKey, sends: list[NcclSend], ring: RingSpec,
                       ranks: dict[bytes, int]) -> list[int]:
    """Channels whose plan agrees with every identified send of the connection: an LL/LL128 flag
    gives the connection step, a CTS index the message number (Simple advances the step counter
    by two per message, so the two differ)."""
    a, b = ranks[conn.sender], ranks[conn.receiver]
    out = []
    for ch in range(ring.nchannels):
        if ring.next_rank(ch, a) != b:
            continue
        pos = ring.ring_index(ch, a)
        ok = True
        for s in sends:
            if not s.length_known:
                continue
            if s.flag is not None:
                hit = sm.expected(ch, pos, s.flag - 1)
                size = hit[1].wire_bytes if hit is not None else None
            elif s.seq is not None:
                hit = sm.by_message(ch, pos, s.seq - 1)
                size = hit[1].wire_bytes if hit is not None else None
            else:
                continue
            if size != s.wire_bytes:
                ok = False
                break
        if ok:
            out.append(ch)
    return out


def resolve_channels(model: JobModel, ranks: dict[bytes, int], conns: dict[ConnKey, list[NcclSend]],
                     notes: list[str]) -> dict[ConnKey, int] | None:
    """Ring connection -> channel: by the plan's sizes where they decide, else by the receive
    buffer addresses (NCCL allocates the connections of a pair in channel order)."""
    ring = model.ring
    sm = RingStateMachine(model, ranks, {})
    pairs = defaultdict(list)
    for k in conns:
        pairs[(ranks[k.sender], ranks[k.receiver])].append(k)
    out = {}
    for pair, keys in pairs.items():
        cands = {k: channel_candidates(sm, k, conns[k], ring, ranks) for k in keys}
        base = {k: _buffer_base(conns[k], model) for k in keys}
        best = None
        for perm in itertools.permutations(range(ring.nchannels), len(keys)):
            if all(ch in cands[k] for k, ch in zip(keys, perm)):
                # Prefer the assignment that orders the receive buffers like the channels.
                ordered = sorted(keys, key=lambda k: base[k])
                score = sum(1 for k, ch in zip(keys, perm) if ordered.index(k) == sorted(perm).index(ch))
                if best is None or score > best[0]:
                    best = (score, perm)
        if best is None:
            return None
        ambiguous = sum(len(cands[k]) > 1 for k in keys)
        if ambiguous and len(keys) > 1:
            notes.append(f"channels of ranks {pair[0]}->{pair[1]} ordered by receive buffer address")
        out.update(dict(zip(keys, best[1])))
    return out


def _buffer_base(sends: list[NcclSend], model: JobModel) -> int:
    for s in sends:
        if s.va and s.step is not None and s.protocol is not None:
            return s.va - schedule.recv_slot(s.step, s.protocol, "allreduce", model.ring.nccl_version).alloc_offset
    return 1 << 64


def check(model: JobModel, ranks, channels, sends: list[NcclSend]) -> tuple[int, int]:
    """(placed, mismatched) when every ring send is placed with this model."""
    sm = RingStateMachine(model, ranks, channels)
    for s in sorted(sends, key=lambda s: (s.flag is None, s.flag or 0)):
        if s.connection in channels:
            sm.place(s)
    return sm.counts["placed"], sm.counts["mismatch"] + sm.counts["unplaced_no_message_at_step"]


def _payload(conns, ranks, channels, model: JobModel, coll: int) -> np.ndarray | None:
    """The result bytes of collective ``coll`` read from rank 0's egress (broadcast data)."""
    sm = RingStateMachine(model, ranks, channels)
    c = model[coll]
    plan = model.plan(c)
    es = dtype_size(c.dtype)
    out = np.zeros(c.count * es, np.uint8)
    got = np.zeros(c.count, bool)
    for k, sends in conns.items():
        loc = sm.where(k)
        if loc is None:
            continue
        ch, pos = loc
        t0, n = sm.collective_steps(ch, pos, coll)
        if not n:
            continue
        by_t = {s.step: s for s in sends if s.step is not None and s.complete}
        for st in plan.messages(pos, ch):
            s = by_t.get(t0 + st.conn_step)
            if s is not None and st.nelem:
                out[st.offset * es:(st.offset + st.nelem) * es] = s.data[:st.nelem * es]
                got[st.offset:st.offset + st.nelem] = True
    return out if got.all() else None


def infer(sends: list[NcclSend], decoders: list[NcclDecoder] = (), dtype: str | None = None,
          nccl_version: str = "2.18") -> Inferred:
    conns = ring_sends(sends)
    if not conns:
        raise InferenceError("no LL/LL128 ring traffic among the sends: nothing to infer the ring from")
    ranks, notes = find_ranks(conns, list(decoders))
    order = ring_order(conns, ranks)
    pairs = defaultdict(int)
    for k in conns:
        pairs[(k.sender, k.receiver)] += 1
    nch = max(pairs.values())
    protos = [s.protocol for v in conns.values() for s in v if s.protocol in (nv.LL, nv.LL128)]
    proto = max(set(protos), key=protos.count)
    ring = RingSpec(nranks=len(ranks), nchannels=nch, protocol=proto, nccl_version=nccl_version,
                    ring_orders=[order] * nch,
                    addresses={r: address_text(a) for a, r in ranks.items()})
    ring_list = [s for v in conns.values() for s in v]

    got = _infer_ddp(conns, ranks, ring, dtype, ring_list, notes)
    if got is None:
        got = _infer_allreduces(conns, ranks, ring, dtype, ring_list, notes)
    model, channels = got
    return Inferred(model, ranks, channels, notes)


def _infer_ddp(conns, ranks, ring, dtype, ring_list, notes):
    """DDP start-up on rank 0's egress: all-gather of the parameter count, shapes, weights."""
    r0 = [k for k in conns if ranks[k.sender] == 0]
    first = {k: {s.step: s for s in conns[k] if s.step is not None} for k in r0}
    for k in r0:
        s0, s1 = first[k].get(0), first[k].get(1)
        if s0 is None or s1 is None or not (s0.complete and s1.complete) or len(s0.data) != 8:
            continue
        nparams = int(s0.data.view("<i8")[0])
        if not 1 <= nparams <= 1 << 20:
            continue
        # The shapes broadcast may span several messages: grow it until it parses.
        payload = np.zeros(0, np.uint8)
        shapes = None
        for t in range(1, 64):
            s = first[k].get(t)
            if s is None or not s.complete:
                break
            payload = np.concatenate([payload, s.data])
            try:
                cand = ddp.parse_shapes(payload[: len(payload) // 8 * 8].view("<i8"), nparams)
            except ValueError:
                continue
            if len(cand) == nparams:
                shapes = cand
                break
        if shapes is None:
            continue
        for dt in ([dtype] if dtype else ["float32", "bfloat16", "float16"]):
            layout = ddp.layout_from_wire(shapes, dt)
            model = JobModel.ddp(ring, layout)
            channels = resolve_channels(model, ranks, conns, notes)
            if channels is None:
                continue
            # The rebuilt buckets come from the two rebuild broadcasts.
            it1 = model.first_of_iteration(1)
            idx = _payload(conns, ranks, channels, model, it1)
            sizes = _payload(conns, ranks, channels, model, it1 + 1)
            if idx is not None and sizes is not None:
                try:
                    buckets = ddp.parse_rebuild(idx.view("<i4"), sizes.view("<i4"), nparams)
                except ValueError as e:
                    notes.append(f"rebuild broadcasts unreadable: {e}")
                    continue
                layout = JobLayout(layout.params, buckets, layout.first_buckets, dt)
                model = JobModel.ddp(ring, layout)
            else:
                notes.append("rebuild broadcasts not seen: the first iteration's single bucket is kept")
            placed, bad = check(model, ranks, channels, ring_list)
            if bad == 0 and placed:
                if not dtype and dt != "float32":
                    notes.append(f"gradient dtype taken as {dt} (2-byte elements); give --dtype to be sure")
                notes.append(f"DDP job: {nparams} parameters, {len(layout.buckets)} buckets after the rebuild")
                return model, channels
    return None


def _infer_allreduces(conns, ranks, ring, dtype, ring_list, notes):
    """No DDP start-up: a series of all-reduces; solve each one's element count from the sizes."""
    dts = [dtype] if dtype else ["float32"]
    for dt in dts:
        es = dtype_size(dt)
        counts = _solve_counts(conns, ranks, ring, dt, es)
        if not counts:
            continue
        # One all-reduce per "iteration", repeating the counts found.
        period = _period(counts)
        model = JobModel.allreduces(ring, period, dt)
        channels = resolve_channels(model, ranks, conns, notes)
        if channels is None:
            continue
        placed, bad = check(model, ranks, channels, ring_list)
        if bad == 0 and placed:
            notes.append(f"no DDP start-up seen: all-reduces of {period} {dt} elements")
            return model, channels
    raise InferenceError("the message sizes fit neither DDP's start-up nor a series of all-reduces "
                         "(give the job configuration)")


def _period(counts: list[int]) -> list[int]:
    for p in range(1, len(counts) + 1):
        if all(counts[i] == counts[i % p] for i in range(len(counts))):
            return counts[:p]
    return counts


def _solve_counts(conns, ranks, ring, dt, es, limit: int = 64) -> list[int]:
    """Element counts of consecutive all-reduces, read off one connection of ring position 0."""
    R = ring.nranks
    keys = [k for k in conns if ranks[k.sender] == 0]
    if not keys:
        return []
    # In LL/LL128-only traffic a send's step is its flag - 1, or its CTS index - 1 (empty steps).
    seqs = {k: {s.step: s for s in conns[k] if s.step is not None and s.length_known} for k in keys}
    counts: list[int] = []
    t = {k: 0 for k in keys}
    for _ in range(limit):
        found = None
        for loops in range(1, 9):
            nmsg = loops * (2 * R - 2)
            data = 0
            for k in keys:
                for j in range(nmsg):
                    s = seqs[k].get(t[k] + j)
                    data += len(s.data) if s is not None else 0
            if not data:
                break
            hi = data * R // (2 * R - 2) // es
            for n in range(hi, max(0, hi - nmsg * len(keys) * 8 // es) - 1, -1):
                if n <= 0:
                    break
                if _fits(n, es, ring, keys, seqs, t):
                    found = n
                    break
            if found:
                break
        if not found:
            break
        counts.append(found)
        plan = schedule.allreduce_plan(found, es, R, ring.nchannels, ring.protocol, ring.nccl_version)
        for k in keys:
            ch = _channel_for(plan, seqs[k], t[k])
            t[k] += plan.conn_steps(ch, 0) if ch is not None else 0
    return counts


def _agrees(seq: dict, t: int, msgs) -> bool:
    """Every planned message has a send of that size at its step (an unseen one may be empty)."""
    for m in msgs:
        s = seq.get(t + m.conn_step)
        if (s.wire_bytes if s is not None else 0) != m.wire_bytes:
            return False
    return True


def _channel_for(plan, seq, t):
    for ch in plan.channels:
        if _agrees(seq, t, plan.messages(0, ch)):
            return ch
    return None


def _fits(n, es, ring, keys, seqs, t) -> bool:
    plan = schedule.allreduce_plan(n, es, ring.nranks, ring.nchannels, ring.protocol, ring.nccl_version)
    used = set()
    for k in keys:
        ch = None
        for c in plan.channels:
            if c in used:
                continue
            if _agrees(seqs[k], t[k], plan.messages(0, c)):
                ch = c
                break
        if ch is None:
            return False
        used.add(ch)
    return True


class ChannelResolver:
    """Maps ring connections to channels as their sends arrive (a connection may first appear
    long after the start: small collectives run on fewer channels). A new connection's sends are
    held, per mirror stream (two streams may carry the same link), until they identify its
    channel: by the plan's message sizes at their steps (or, for flagless traffic seen without its
    CTS in a capture that starts with the job, in their order). When several channels fit every
    send (symmetric chunks), the receive-buffer addresses decide: NCCL allocates a pair's
    connections in channel order. When those are unknown too, nothing is guessed: the connection
    is not placed, and its collectives come out incomplete rather than wrong."""

    def __init__(self, model: JobModel, ranks: dict[bytes, int], mapped: dict[ConnKey, int] | None = None,
                 hold: int = 64):
        self.model, self.ranks, self.hold = model, ranks, hold
        self.sm = RingStateMachine(model, ranks, {})
        self.mapped: dict[ConnKey, int] = dict(mapped or {})
        self.held: dict[tuple[int, ConnKey], list[NcclSend]] = {}  # (stream, conn) -> sends in order
        self.rejected: set[ConnKey] = set()
        self.base: dict[ConnKey, int] = {}  # receive-buffer base of mapped connections
        self.notes: list[str] = []

    def is_ring(self, conn: ConnKey) -> bool:
        a, b = self.ranks.get(conn.sender), self.ranks.get(conn.receiver)
        if a is None or b is None or conn in self.rejected:
            return False
        return any(self.model.ring.next_rank(ch, a) == b for ch in range(self.model.ring.nchannels))

    def offer(self, s: NcclSend) -> list[NcclSend]:
        """The sends now placeable, in arrival order: ``s`` itself once its connection is mapped."""
        conn = s.connection
        if conn in self.mapped:
            return [s]
        if s.protocol == "Simple" and self.model.ring.protocol != "Simple" and len(s.data):
            # Point-to-point traffic between ring ranks: its own connection, never a ring one.
            self.rejected.add(conn)
            return self._release(conn) + [s]
        self.held.setdefault((s.stream, conn), []).append(s)
        return self._decide((s.stream, conn), final=False)

    def flush(self) -> list[NcclSend]:
        out = []
        for key in list(self.held):
            if key in self.held:
                out += self._decide(key, final=True)
        return out

    def _release(self, conn: ConnKey) -> list[NcclSend]:
        out = []
        for key in [k for k in self.held if k[1] == conn]:
            out += self.held.pop(key)
        return out

    def _by_order(self, conn: ConnKey, held: list[NcclSend]) -> list[int]:
        """Channels whose first messages have the sizes of the connection's first sends."""
        a, b = self.ranks[conn.sender], self.ranks[conn.receiver]
        out = []
        for ch in range(self.model.ring.nchannels):
            if self.model.ring.next_rank(ch, a) != b:
                continue
            pos = self.model.ring.ring_index(ch, a)
            ok = True
            for m, s in enumerate(held):
                hit = self.sm.by_message(ch, pos, m)
                if hit is None or (s.length_known and hit[1].wire_bytes != s.wire_bytes):
                    ok = False
                    break
            if ok:
                out.append(ch)
        return out

    def _pair(self, conn: ConnKey) -> list[ConnKey]:
        keys = list(self.mapped) + [k[1] for k in self.held]
        return list(dict.fromkeys(k for k in keys if (k.sender, k.receiver) == (conn.sender, conn.receiver)))

    def _base(self, conn: ConnKey, cands: list[int]) -> int | None:
        """Receive-buffer base of a connection from any stream's held sends, or None."""
        if conn in self.base:
            return self.base[conn]
        a = self.ranks[conn.sender]
        for (_, k), sends in self.held.items():
            if k != conn:
                continue
            for i, s in enumerate(sends):
                if s.va is None or s.protocol is None:
                    continue
                t = s.step if s.flag is not None else None
                if t is None and self.model.from_start and cands:
                    # Flagless: the message number is its place in this stream's order; the
                    # candidate channels have the same plan here, so any gives the step.
                    ch = cands[0]
                    hit = self.sm.by_message(ch, self.model.ring.ring_index(ch, a), i)
                    t = hit[2] if hit is not None else None
                if t is not None:
                    slot = schedule.recv_slot(t, s.protocol, "allreduce", self.model.ring.nccl_version)
                    return s.va - slot.alloc_offset
        return None

    def _decide(self, key: tuple[int, ConnKey], final: bool) -> list[NcclSend]:
        conn = key[1]
        held = self.held[key]
        stepped = any(s.step is not None and s.length_known for s in held)
        by_order = not stepped and self.model.from_start and len(held) >= min(self.hold, 8)
        if not (stepped or by_order or final):
            return []  # nothing identifying yet (empty steps, or flagless sends still few)
        taken = {self.mapped[k] for k in self._pair(conn) if k in self.mapped}
        if stepped:
            cands = channel_candidates(self.sm, conn, held, self.model.ring, self.ranks)
        else:
            cands = self._by_order(conn, held)
        cands = [c for c in cands if c not in taken]
        if not cands:
            self.rejected.add(conn)
            self.notes.append(f"connection {conn} fits no free channel of the configured ring: not placed")
            return self._release(conn)  # handed back as traffic outside the ring
        if len(cands) > 1 and not (final or len(held) >= self.hold):
            return []
        ch = cands[0]
        if len(cands) > 1:
            pair = self._pair(conn)
            bases = {k: self._base(k, cands) for k in pair}
            if any(v is None for v in bases.values()):
                self.rejected.add(conn)
                self.notes.append(f"connection {conn}: channels {cands} fit its sizes and its receive buffer "
                                  "address is unknown: not placed (its collectives stay incomplete)")
                return self._release(conn)
            order = sorted(pair, key=lambda k: bases[k])
            free = sorted(set(cands) | taken)
            pos = order.index(conn)
            ch = free[pos] if pos < len(free) and free[pos] in cands else cands[0]
            self.notes.append(f"connection {conn}: channel {ch} taken from its receive buffer address "
                              f"(channels {cands} fit its sizes)")
        self.mapped[conn] = ch
        b = self._base(conn, [ch])
        if b is not None:
            self.base[conn] = b
        return self._release(conn)
