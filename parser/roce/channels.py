"""Which channel each ring connection is: from the plan's message sizes at the sends' steps, and
where several channels fit, from the receive-buffer addresses (NCCL allocates a pair's
connections in channel order)."""

from __future__ import annotations

import itertools
from collections import defaultdict

from mirrorckpt.config.layout import RingSpec
from mirrorckpt.parser.roce import schedule
from mirrorckpt.parser.roce.collectives import NcclJobModel
from mirrorckpt.parser.roce.nccl import ConnKey, NcclSend
from mirrorckpt.parser.roce.nccl_versions import AUTO, SIMPLE
from mirrorckpt.parser.roce.statemachine import RingStateMachine


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


def resolve_channels(model: NcclJobModel, ranks: dict[bytes, int], conns: dict[ConnKey, list[NcclSend]],
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


def _buffer_base(sends: list[NcclSend], model: NcclJobModel) -> int:
    for s in sends:  # the flag gives the connection step, hence the slot (a CTS index does not)
        if s.va and s.flag is not None and s.protocol is not None:
            return s.va - schedule.recv_slot(s.flag - 1, s.protocol, "allreduce", model.ring.nccl_version).alloc_offset
    return 1 << 64


class ChannelResolver:
    """Maps ring connections to channels as their sends arrive (a connection may first appear
    long after the start: small collectives run on fewer channels). A new connection's sends are
    held, per mirror stream (two streams may carry the same link), until they identify its
    channel: by the plan's message sizes at their steps (or, for flagless traffic seen without its
    CTS in a capture that starts with the job, in their order). When several channels fit every
    send (symmetric chunks), the receive-buffer addresses decide: NCCL allocates a pair's
    connections in channel order. When those are unknown too, nothing is guessed: the connection
    is not placed, and its collectives come out incomplete rather than wrong. While sends are held,
    the concatenator closes no collective incomplete behind them; once every stream is a whole
    collective window past a stream's first held send, its connections are decided on what they
    have (``flush``)."""

    def __init__(self, model: NcclJobModel, ranks: dict[bytes, int], mapped: dict[ConnKey, int] | None = None,
                 hold: int = 64):
        self.model, self.ranks, self.hold = model, ranks, hold
        self.sm = RingStateMachine(model, ranks, {})
        self.mapped: dict[ConnKey, int] = dict(mapped or {})
        self.held: dict[tuple[int, ConnKey], list[NcclSend]] = {}  # (stream, conn) -> sends in order
        self.rejected: set[ConnKey] = set()
        # of them, ring links that fit no channel: their sends are ring traffic of unknown place, never
        # point-to-point candidates for a collective's hole
        self.unplaced: set[ConnKey] = set()
        self.base: dict[ConnKey, int] = {}  # receive-buffer base of mapped connections
        self.notes: list[str] = []
        self._hops: dict[tuple[int, int], bool] = {}  # (sender rank, receiver rank) -> a ring hop
        # Per held (stream, connection): the channels its identified sends fit so far, the channels
        # its numbered sends fit in order, and how many are numbered. Narrowed by each send as it
        # comes: asked anew of the whole held list for every send (up to `hold` of them), a
        # 4-channel LL replay spent 48 ms in `offer`, now 17.
        self._fit: dict[tuple[int, ConnKey], list[int]] = {}
        self._order_fit: dict[tuple[int, ConnKey], list[int]] = {}
        self._messages: dict[tuple[int, ConnKey], int] = {}
        self._stepped: set[tuple[int, ConnKey]] = set()  # held ones with a send whose step is known
        # Held ones with a send of known length. A connection seen only through lost messages (a
        # PSN gap: no size, no address, no step; a lost CTS post makes one on the reverse QP) has
        # nothing to decide its channel by and nothing to place: it neither holds the collectives
        # back nor stands among its pair's connections ordered by receive buffer (an unknown base
        # there left every connection of the pair unplaced), and it is mapped only once it has one.
        self._sized: set[tuple[int, ConnKey]] = set()

    def holding(self, key: tuple[int, ConnKey]) -> bool:
        """Whether (stream, connection) has sends held that could complete a collective."""
        return key in self._sized

    def holding_streams(self) -> set[int]:
        return {k[0] for k in self._sized}

    def is_ring(self, conn: ConnKey) -> bool:
        a, b = self.ranks.get(conn.sender), self.ranks.get(conn.receiver)
        if a is None or b is None or conn in self.rejected:
            return False
        hop = self._hops.get((a, b))
        if hop is None:  # ring orders are fixed: each rank pair is looked up once
            ring = self.model.ring
            hop = self._hops[(a, b)] = any(ring.next_rank(ch, a) == b for ch in range(ring.nchannels))
        return hop

    def offer(self, s: NcclSend) -> list[NcclSend]:
        """The sends now placeable, in arrival order: ``s`` itself once its connection is mapped."""
        conn = s.connection
        if conn in self.mapped:
            return [s]
        if s.protocol == SIMPLE and self.model.ring.protocol not in (SIMPLE, AUTO) and s.nbytes:
            # Point-to-point traffic between ring ranks: its own connection, never a ring one.
            self.rejected.add(conn)
            return self._release(conn) + [s]
        key = (s.stream, conn)
        self.held.setdefault(key, []).append(s.keep())  # held for many batches
        self._narrow(key, s)
        return self._decide(key, final=False)

    def _narrow(self, key: tuple[int, ConnKey], s: NcclSend) -> None:
        conn = key[1]
        fit = channel_candidates(self.sm, conn, [s], self.model.ring, self.ranks)
        prev = self._fit.get(key)
        self._fit[key] = fit if prev is None else [c for c in prev if c in fit]
        if s.length_known:
            self._sized.add(key)
        if s.step is not None and s.length_known:
            self._stepped.add(key)
        if s.lone_piece or s.form == "malformed":
            return  # not a message of its own (see _numbered)
        m = self._messages.get(key, 0)
        self._messages[key] = m + 1
        fit = self._fits_in_order(conn, m, s)
        prev = self._order_fit.get(key)
        self._order_fit[key] = fit if prev is None else [c for c in prev if c in fit]

    def flush(self, streams: set[int] | None = None) -> list[NcclSend]:
        """Decides every held connection (of ``streams`` only, if given) on what it has; one with
        no send of known length is left held, and at the end (``streams`` None) handed on unmapped."""
        out = []
        for key in list(self.held):
            if key in self.held and (streams is None or key[0] in streams):
                if key in self._sized:
                    out += self._decide(key, final=True)
                elif streams is None:
                    out += self._release(key[1])
        return out

    def _release(self, conn: ConnKey) -> list[NcclSend]:
        out = []
        for key in [k for k in self.held if k[1] == conn]:
            out += self.held.pop(key)
            for d in (self._fit, self._order_fit, self._messages):
                d.pop(key, None)
            self._stepped.discard(key)
            self._sized.discard(key)
        return out

    def _fits_in_order(self, conn: ConnKey, m: int, s: NcclSend) -> list[int]:
        """Channels whose message ``m`` (0-based, on the connection) has the size of ``s``."""
        a, b = self.ranks[conn.sender], self.ranks[conn.receiver]
        out = []
        for ch in range(self.model.ring.nchannels):
            if self.model.ring.next_rank(ch, a) != b:
                continue
            hit = self.sm.by_message(ch, self.model.ring.ring_index(ch, a), m)
            if hit is not None and (not s.length_known or hit[1].wire_bytes == s.wire_bytes):
                out.append(ch)
        return out

    def _pair(self, conn: ConnKey) -> list[ConnKey]:
        keys = list(self.mapped) + [k[1] for k in self.held if k in self._sized]
        return list(dict.fromkeys(k for k in keys if (k.sender, k.receiver) == (conn.sender, conn.receiver)))

    def _base(self, conn: ConnKey, cands: list[int]) -> int | None:
        """Receive-buffer base of a connection from any stream's held sends, or None."""
        if conn in self.base:
            return self.base[conn]
        a = self.ranks[conn.sender]
        for (_, k), sends in self.held.items():
            if k != conn:
                continue
            for i, s in enumerate(_numbered(sends)):
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
        if key not in self._sized:
            return []  # lost messages only (see _sized)
        stepped = key in self._stepped
        by_order = not stepped and self.model.from_start and len(held) >= min(self.hold, 8)
        if not (stepped or by_order or final):
            return []  # nothing identifying yet (empty steps, or flagless sends still few)
        taken = {self.mapped[k] for k in self._pair(conn) if k in self.mapped}
        a, b = self.ranks[conn.sender], self.ranks[conn.receiver]
        if {ch for ch in range(self.model.ring.nchannels) if self.model.ring.next_rank(ch, a) == b} <= taken:
            # a hop has one connection per channel: another one between the ranks is point-to-point
            self.rejected.add(conn)
            self.notes.append(f"connection {conn}: every channel of ranks {a}->{b} has its connection: "
                              "point-to-point")
            return self._release(conn)
        if stepped:
            cands = self._fit[key]
        else:  # channels whose first messages have the sizes of the connection's first sends
            cands = self._order_fit.get(key)
            if cands is None:  # none numbered yet: every channel of the pair
                cands = [ch for ch in range(self.model.ring.nchannels) if self.model.ring.next_rank(ch, a) == b]
        cands = [c for c in cands if c not in taken]
        if not cands:
            self.rejected.add(conn)
            self.unplaced.add(conn)
            self.notes.append(f"connection {conn} fits no free channel of the configured ring: not placed")
            return self._release(conn)  # handed back as traffic outside the ring
        if len(cands) > 1 and not (final or len(held) >= self.hold):
            return []
        ch = cands[0]
        if len(cands) > 1:
            pair = self._pair(conn)
            if len([k for k in pair if k not in self.mapped]) < len(cands):
                # The connections of the other candidate channels are not seen yet (a serve
                # worker's streams run apart from another's): ordering this one among fewer
                # would be a guess. Wait for them; at the end nothing is guessed.
                if not final:
                    return []
                self.rejected.add(conn)
                self.unplaced.add(conn)
                self.notes.append(f"connection {conn}: channels {cands} fit its sizes and the connections of the "
                                  "others were never seen: not placed (its collectives stay incomplete)")
                return self._release(conn)
            bases = {k: self._base(k, cands) for k in pair}
            if any(v is None for v in bases.values()):
                self.rejected.add(conn)
                self.unplaced.add(conn)
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


def _numbered(sends: list[NcclSend]) -> list[NcclSend]:
    """The sends that count one message each in a connection's order: a piece of a cut message sent on
    alone, or a malformed one, is not a message of its own."""
    return [s for s in sends if not s.lone_piece and s.form != "malformed"]
