"""gloo's TCP framing: a reassembled byte stream in, Ops out (gloo/transport/tcp/pair.{h,cc}).

A connection's initiator first writes an 8-byte ``sequence_number_t`` (device.cc
``connectAsInitiator``); after that each direction is a series of Ops: a 48-byte preamble of six
native size_t (``headers.GLOO_OP``: nbytes, opcode, slot, offset, length, roffset), followed for
data ops by ``length`` payload bytes. Ops never interleave at byte level (a partial write queues
later ops behind it, ``sendAsyncMode``). The collectives only use unbound buffers: opcode 1
(SEND_UNBOUND_BUFFER) with nbytes = 48 + length, and the notifications 2 (NOTIFY_SEND_READY) and
3 (NOTIFY_RECV_READY) with nbytes = 48; offset and roffset are always 0 on the wire.

A stream is framed from its first byte when its SYN was seen. After a lost preamble (or when the
capture joined mid-connection) framing is recovered by searching for a preamble that passes the
field checks and is followed by two more that do (a three-op chain); every recovery starts a new
``epoch``, and ``SlotTracker`` decides which slots can still be counted from there.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from mirrorckpt.config.encap import EncapSpec
from mirrorckpt.parser import encap
from mirrorckpt.parser.gloo import tcp
from mirrorckpt.parser.gloo.schedule import slot_parts
from mirrorckpt.parser.gloo.tcp import StreamKey, TcpStream
from mirrorckpt.parser.headers import GLOO_OP

SEND_BUFFER, SEND_UNBOUND_BUFFER, NOTIFY_SEND_READY, NOTIFY_RECV_READY = 0, 1, 2, 3
OPCODE_NAMES = {0: "SEND_BUFFER", 1: "SEND_UNBOUND_BUFFER", 2: "NOTIFY_SEND_READY", 3: "NOTIFY_RECV_READY"}
SEQ_NUMBER_BYTES = 8  # gloo/transport/tcp/address.h: sequence_number_t is ssize_t
PREAMBLE = GLOO_OP.size
MAX_LENGTH = 1 << 40  # a length beyond this is not a gloo op
CHAIN = 3  # preambles that must chain before framing is believed after a loss


@dataclass
class GlooOp:
    stream: StreamKey  # sender -> receiver direction
    source: int  # capture source index
    generation: int  # TCP connection generation of the stream (a new SYN starts a new one)
    epoch: int  # framing epoch: 0 framed from the SYN, +1 after every recovery
    pos: int  # sequence number of the preamble
    opcode: int
    slot: int
    length: int
    data: np.ndarray | None = None  # payload (data ops), zeros in holes
    holes: list[tuple[int, int]] = field(default_factory=list)  # payload byte ranges missing
    ts_ns: int = 0
    index: int | None = None  # data ops: k-th data op of (stream, slot) counted from its first
    trusted: bool = False  # data ops: ``index`` counts from the slot's first op on this stream

    @property
    def prefix(self) -> int:
        return self.slot >> 56

    @property
    def tag(self) -> int:
        return slot_parts(self.slot)[1]

    @property
    def is_data(self) -> bool:
        return self.opcode == SEND_UNBOUND_BUFFER

    @property
    def complete(self) -> bool:
        return not self.holes


def preamble_ok(nbytes, opcode, slot, offset, length, roffset):
    """Field checks of preambles (numpy arrays or ints): what a real op always satisfies."""
    prefix = slot >> 56
    notify = (opcode == NOTIFY_SEND_READY) | (opcode == NOTIFY_RECV_READY)
    data = (opcode == SEND_UNBOUND_BUFFER) | (opcode == SEND_BUFFER)
    size_ok = (notify & (nbytes == PREAMBLE)) | (data & (nbytes == length + PREAMBLE))
    return (size_ok & (offset == 0) & (roffset == 0) & (length < MAX_LENGTH)
            & (prefix >= 1) & (prefix <= 8) & (((slot >> 8) & 0xFFFF) == 0))


def _read(buf: np.ndarray, pos: np.ndarray) -> list[np.ndarray]:
    return [GLOO_OP.read(buf, pos, f) for f in ("nbytes", "opcode", "slot", "offset", "length", "roffset")]


def candidates(buf: np.ndarray) -> np.ndarray:
    """Positions in ``buf`` where a whole preamble passes the field checks (vectorised: cheap
    byte tests narrow the positions first, the field checks run on the few left)."""
    n = len(buf) - PREAMBLE + 1
    if n <= 0:
        return np.zeros(0, np.int64)
    op = GLOO_OP["opcode"].offset
    pos = np.nonzero(buf[op: op + n] <= 3)[0]
    zero_at = [op + k for k in range(1, 8)] + \
        [GLOO_OP[f].offset + k for f in ("offset", "roffset") for k in range(8)]
    for at in zero_at:  # opcode's high bytes, offset and roffset are zero
        if not len(pos):
            break
        pos = pos[buf[pos + at] == 0]
    pos = pos.astype(np.int64)
    if not len(pos):
        return pos
    return pos[preamble_ok(*_read(buf, pos))]


SCAN_WINDOW = 1 << 20  # bytes searched per step when recovering framing


class GlooFramer:
    """Ops of one TCP direction, read below the stream's settled line."""

    def __init__(self, stream: TcpStream, source: int = 0):
        self.stream = stream
        self.source = source
        self.counts = Counter()
        self._reset()

    def _reset(self) -> None:
        st = self.stream
        self.generation = st.generation
        self.cursor = st.start
        self.epoch = 0 if st.from_syn else 1
        self.synced = st.from_syn
        self.need_seq = st.from_syn and st.initiator
        self.seq_number: int | None = None
        self.scan_from = st.start  # resync: positions below are rejected

    def pull(self) -> list[GlooOp]:
        st = self.stream
        if st.start is None:
            return []
        if st.generation != self.generation or self.cursor is None:
            self._reset()
        out: list[GlooOp] = []
        while True:
            if not self.synced and not self._resync():
                break
            if self.need_seq:
                if not self._read_seq():
                    break
                continue
            op = self._next()
            if op is None:
                break
            out.append(op)
        st.release(self.cursor if self.synced else self.scan_from)
        return out

    def _read_seq(self) -> bool:
        st = self.stream
        a = self.cursor
        if a + SEQ_NUMBER_BYTES > st.settled:
            return False
        self.need_seq = False
        if st.holes(a, a + SEQ_NUMBER_BYTES):
            self._lost(a, "sequence number lost")
            return True
        self.seq_number = int(st.view(a, a + SEQ_NUMBER_BYTES).view("<i8")[0])
        self.cursor = a + SEQ_NUMBER_BYTES
        return True

    def _lost(self, at: int, why: str) -> None:
        self.counts[f"framing_lost:{why}"] += 1
        self.synced = False
        self.epoch += 1
        self.scan_from = at + 1

    def _next(self) -> GlooOp | None:
        st = self.stream
        a = self.cursor
        if a + PREAMBLE > st.settled:
            return None
        if st.holes(a, a + PREAMBLE):
            self._lost(a, "preamble missing")
            return None
        f = [int(v[0]) for v in _read(st.buf, np.array([a - st.buf_lo]))]
        nbytes, opcode, slot, offset, length, roffset = f
        if not preamble_ok(nbytes, opcode, slot, offset, length, roffset):
            self._lost(a, "bad preamble")
            return None
        if a + nbytes > st.settled:
            return None  # payload not settled yet
        op = GlooOp(st.key, self.source, self.generation, self.epoch, a, opcode, slot, length,
                    ts_ns=st.last_ts)
        if nbytes > PREAMBLE:
            op.data = st.view(a + PREAMBLE, a + nbytes)
            op.holes = st.holes(a + PREAMBLE, a + nbytes)
        self.counts[OPCODE_NAMES[opcode]] += 1
        self.cursor = a + nbytes
        return op

    def _resync(self) -> bool:
        """Finds the next three-op chain at or after ``scan_from``; False to wait for bytes."""
        st = self.stream
        for s, e in st.runs(self.scan_from, st.settled):
            while e - s >= PREAMBLE:
                w = min(e, s + SCAN_WINDOW + PREAMBLE - 1)
                for p in (candidates(st.view(s, w)) + s).tolist():
                    verdict = self._chain(p)
                    if verdict is None:
                        self.scan_from = p
                        return False  # the chain runs past the settled bytes: wait
                    if verdict:
                        self.cursor = p
                        self.synced = True
                        self.scan_from = p
                        self.counts["resync"] += 1
                        return True
                s = w - PREAMBLE + 1  # first position not examined
                self.scan_from = max(self.scan_from, s)
        if st.settled > self.scan_from:
            self.scan_from = max(self.scan_from, st.settled - PREAMBLE + 1)
        return False

    def _chain(self, p: int) -> bool | None:
        """Whether CHAIN preambles chain from p (None: not decidable yet)."""
        st = self.stream
        for _ in range(CHAIN):
            if p + PREAMBLE > st.settled:
                return None
            if st.holes(p, p + PREAMBLE):
                return False
            f = [int(v[0]) for v in _read(st.buf, np.array([p - st.buf_lo]))]
            if not preamble_ok(*f):
                return False
            p += f[0]
        return True


class SlotTracker:
    """Counts each slot's data ops on one direction and says which counts can be trusted.

    From a SYN every count is exact. After a framing loss at some point of the stream, the slots
    with ops on both sides of it cannot be counted (their ops inside the loss are unknown). The
    sender runs at most ``max_in_flight`` collectives at once (ProcessGroupGloo's 2 worker
    threads) and starts them in tag order, so the collectives active at the loss are the ones
    with the smallest tags seen after it: a slot is trusted only once ``max_in_flight`` smaller
    tags have been seen since the loss, and a slot seen before the loss never again."""

    def __init__(self, max_in_flight: int = 2):
        self.max_in_flight = max_in_flight
        self.key: tuple | None = None  # (generation, epoch)
        self.clean = False
        self.seen: set[int] = set()  # tags seen in this epoch
        self.slots: dict[int, list] = {}  # slot -> [next index, trusted]

    def annotate(self, op: GlooOp) -> None:
        key = (op.generation, op.epoch)
        if key != self.key:
            if self.key is not None and key[0] != self.key[0]:
                self.slots = {}  # a new connection: nothing carries over
            for s in self.slots.values():
                s[1] = False  # had ops before the loss
            self.key, self.seen = key, set()
            self.clean = op.epoch == 0
        tag = op.tag
        s = self.slots.get(op.slot)
        if s is None:
            smaller = sum(1 for t in self.seen if t < tag)
            s = self.slots[op.slot] = [0, self.clean or smaller >= self.max_in_flight]
        self.seen.add(tag)
        if op.is_data:
            op.index, op.trusted = s[0], s[1]
            s[0] += 1


class GlooDecoder:
    """One capture source: frame batches -> TCP streams -> ops with slot counts."""

    def __init__(self, source: int = 0, window_bytes: int | None = None, max_in_flight: int = 2,
                 encapsulation: EncapSpec | None = None):
        self.source = source
        self.tcp = tcp.TcpReassembler(window_bytes) if window_bytes else tcp.TcpReassembler()
        self.counters = tcp.TcpCounters()
        self.encapsulation = encapsulation  # the mirror encapsulations taken off (None: any)
        self.mirror = encap.MirrorHealth()
        self.framers: dict[StreamKey, GlooFramer] = {}
        self.trackers: dict[StreamKey, SlotTracker] = {}
        self.max_in_flight = max_in_flight

    def feed(self, batch) -> list[GlooOp]:
        segs, c = tcp.decode(batch, self.encapsulation, self.mirror)
        self.counters.add(c)
        now = int(batch.ts_ns.max()) if len(batch) else None
        return self._pull(self.tcp.feed(segs, batch.data, now))

    def flush(self) -> list[GlooOp]:
        return self._pull(self.tcp.flush())

    def _pull(self, streams) -> list[GlooOp]:
        out = []
        for st in streams:
            fr = self.framers.get(st.key)
            if fr is None:
                fr = self.framers[st.key] = GlooFramer(st, self.source)
                self.trackers[st.key] = SlotTracker(self.max_in_flight)
            ops = fr.pull()
            tr = self.trackers[st.key]
            for op in ops:
                tr.annotate(op)
            out += ops
        out.sort(key=lambda o: o.ts_ns)
        return out

    @property
    def counts(self) -> Counter:
        c = Counter()
        for f in self.framers.values():
            c.update(f.counts)
        return c
