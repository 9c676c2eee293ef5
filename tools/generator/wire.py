"""The verbs layer of every NCCL connection, simulated: CTS posts, data WRITEs, ACKs, PSNs, time.

A collective is given as ``Work`` per connection (the plan's messages of one ring position on one
channel, in wire order). ``Wire.run`` walks it slot by slot: slot ``g`` holds message ``g - delay``
of every connection (all ring positions run their step in lock-step; a broadcast forwards one slot
after its upstream neighbour). Per connection and message, following doc sections 4.2, 4.3, 6 and 7
(/work/shared/docs/nccl-ring-schedule.md):

* the receiver posts a receive and writes CTS ``idx`` (1, 2, 3, ... per connection) into the
  sender's FIFO (``nccl_versions.cts_header``/``cts_fifo_offset``): addr = its buffer base +
  ``schedule.recv_slot(t).alloc_offset``, the protocol buffer's rkey, size, nreqs 1, tag = sender
  rank; receives run ahead of the data by the proxy's depth (``recv_post_depth``), never past the
  collective's last message; the sender ACKs every CTS;
* the sender WRITEs the message to that address, normal or split form
  (``nccl_versions.uses_split_write``), immediate = size (``encode_imm``), LL/LL128 flag from the
  connection step ``t = conn_step_start(...) + msg.conn_step``;
* the receiver ACKs the message (PSN of its last packet, MSN = RDMA messages completed, syndrome =
  receive credits left: the receives posted and not yet consumed by a WRITE WITH IMM).

Time: each NIC sends its packets of a slot back to back at line rate (its channels interleaved);
the peer sees a frame ``switch_ns`` later; a slot starts once every frame of the previous one has
been seen, so every mirror stream is in time order batch by batch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from mirrorckpt.parser import nccl_versions as nv
from mirrorckpt.parser import protocols, schedule
from mirrorckpt.parser.headers import BTH, ETH, ICRC_BYTES, IMMDT, IPV6, PSN_MODULUS, RETH, UDP
from mirrorckpt.parser.schedule import RingStep

from .messages import ACK, NORMAL, PLAIN, SPLIT, TRAIN, packet_count, rdma_messages
from .topology import P2P_CHUNK_BYTES, QpPair

# AETH credit count encoding (IBTA vol. 1, AETH syndrome: 5-bit credit code -> receive credits).
_CREDITS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048,
            3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768)
_FRAME_OVERHEAD = ETH.size + IPV6.size + UDP.size + BTH.size + RETH.size + IMMDT.size + ICRC_BYTES
_ETH_GAP = 20  # preamble, start delimiter and inter-frame gap, in bytes of line time


def credit_code(credits: int) -> int:
    """AETH syndrome of an ACK with ``credits`` receive WQEs available (largest code not above)."""
    return int(np.searchsorted(_CREDITS, max(0, credits), side="right")) - 1


@dataclass
class WireOptions:
    pmtu: int = 1024
    ipv6: bool = True
    adaptive_routing: bool | None = None  # None: NCCL's default on RoCE for the version
    ar_threshold: int = nv.AR_THRESHOLD_DEFAULT
    write_only_train: bool = False  # split form: one WRITE ONLY per packet (NIC behaviour)
    initial_psn: str = "zero"  # zero (NCCL), random, wrap (just below 2^24)
    line_rate_gbps: float = 100.0
    switch_ns: int = 600  # mirror port to mirror port: a frame's ingress time after its egress time
    step_ns: int = 1500  # between the end of a slot and the start of the next
    ack_ns: int = 900  # responder: last packet in -> ACK out
    cts_ns: int = 1800  # receiver: message in -> next receive posted
    collective_gap_ns: int = 20_000
    iteration_gap_ns: int = 2_000_000
    start_ns: int = 1_700_000_000 * 10**9

    def __post_init__(self):
        if self.pmtu not in (256, 512, 1024, 2048, 4096):
            raise ValueError(f"PMTU {self.pmtu} is not one of 256, 512, 1024, 2048, 4096")
        if self.initial_psn not in ("zero", "random", "wrap"):
            raise ValueError(f"initial PSN {self.initial_psn!r} is not zero, random or wrap")
        if self.line_rate_gbps <= 0:
            raise ValueError("line rate must be positive")

    def pkt_ns(self) -> int:
        """Line time of one full-MTU data frame."""
        return max(1, int(round((self.pmtu + _FRAME_OVERHEAD + _ETH_GAP) * 8 / self.line_rate_gbps)))


@dataclass
class ConnState:
    """One connection's counters (both directions of its QP pair)."""
    qp: QpPair
    data_psn: int  # next PSN sender -> receiver
    cts_psn: int  # next PSN receiver -> sender
    data_msn: int = 0  # RDMA messages the receiver completed
    cts_msn: int = 0  # CTS WRITEs the sender completed
    step: int = 0  # NCCL connection step counter
    posted: int = 0  # receives posted = last CTS idx
    received: int = 0  # sends received (receives consumed)


@dataclass
class Work:
    """One collective's messages on one connection."""
    conn: ConnState
    msgs: list  # RingStep (ring) or P2pMsg
    delay: int = 0  # slots before the first message
    channel: int = 0
    pos: int = 0
    t0: int = 0  # connection step of the collective's start
    first_idx: int = 0  # CTS idx before the collective's first message

    @property
    def sender(self) -> int:
        return self.conn.qp.sender

    @property
    def receiver(self) -> int:
        return self.conn.qp.receiver


@dataclass(frozen=True)
class P2pMsg:
    """One point-to-point send (Simple, one step each): ``nbytes`` user bytes."""
    nbytes: int
    conn_step: int
    offset: int = 0  # first element in the sender's buffer (truth only)
    nelem: int = 0


@dataclass
class Layer:
    """What a collective runs with: protocol, kind for the CTS size, whether it is P2P."""
    protocol: str
    kind: str
    p2p: bool = False


class Wire:
    def __init__(self, version: str, opts: WireOptions, sink, seed: int, send_truth: bool = True):
        self.version = nv.version(version)
        self.opts = opts
        self.sink = sink  # capture.CaptureSet: wants(src, dst), log, after_slot()
        self.cts_hdr = nv.cts_header(self.version)
        self.rng = np.random.default_rng([seed, 0x3173])
        self.conns: dict[object, ConnState] = {}
        self.clock = opts.start_ns
        self.send_truth = send_truth
        self.sends: list[dict] = []  # truth: every captured send
        self._slots: dict[tuple, schedule.RecvSlot] = {}  # (protocol, kind, t mod 8) -> receive slot
        self._split: dict[int, bool] = {}  # wire bytes -> split WRITE form

    def conn(self, key, qp: QpPair) -> ConnState:
        c = self.conns.get(key)
        if c is None:
            c = self.conns[key] = ConnState(qp, self._psn0(), self._psn0())
        return c

    def _psn0(self) -> int:
        if self.opts.initial_psn == "random":
            return int(self.rng.integers(0, PSN_MODULUS))
        if self.opts.initial_psn == "wrap":
            return PSN_MODULUS - int(self.rng.integers(1, 48))
        return 0  # NCCL: ibv_modify_qp with rq_psn = sq_psn = 0

    # -- the receiver's side ---------------------------------------------------------------------

    def _recv_slot(self, w: Work, layer: Layer, t: int) -> tuple[int, int, int]:
        """(VA, CTS size, rkey) of the buffer the message at connection step ``t`` lands in."""
        qp = w.conn.qp
        if layer.p2p:
            return qp.recv_base, P2P_CHUNK_BYTES, qp.rkeys["p2p"]
        key = (layer.protocol, layer.kind, schedule.slot(t))
        s = self._slots.get(key)
        if s is None:  # a slot's address and CTS size depend on t only through t mod NCCL_STEPS
            s = self._slots[key] = schedule.recv_slot(t, layer.protocol, layer.kind, self.version)
        return qp.recv_base + s.alloc_offset, s.cts_size, qp.rkeys[layer.protocol]

    def _post_cts(self, w: Work, layer: Layer, ts: int) -> int:
        """The receiver posts the next receive of ``w``; returns when the sender has ACKed it."""
        c, log = w.conn, self.sink.log
        k = c.posted - w.first_idx  # 0-based message of the collective this receive is for
        t = w.t0 + w.msgs[k].conn_step
        c.posted += 1
        va, size, rkey = self._recv_slot(w, layer, t)
        psn = c.cts_psn
        c.cts_psn = (c.cts_psn + 1) % PSN_MODULUS
        c.cts_msn += 1
        qp = c.qp
        ack_ts = ts + self.opts.switch_ns + self.opts.ack_ns
        if self.sink.wants(qp.receiver, qp.sender):
            entry = self.cts_hdr.pack(addr=va, size=size, rkey=rkey, nreqs=1, tag=qp.sender, idx=c.posted)
            log.add(PLAIN, qp.receiver, qp.sender, qp.sport, qp.send_qpn, psn, ts, length=len(entry),
                    pmtu=self.opts.pmtu, va=qp.fifo_va + int(nv.cts_fifo_offset(c.posted, self.version)),
                    rkey=qp.fifo_rkey, pay_off=log.payload(np.frombuffer(entry, np.uint8)))
        if self.sink.wants(qp.sender, qp.receiver):
            log.add(ACK, qp.sender, qp.receiver, qp.sport, qp.recv_qpn, psn, ack_ts, syndrome=credit_code(0),
                    msn=c.cts_msn % PSN_MODULUS)
        return ack_ts

    # -- a collective --------------------------------------------------------------------------------

    def run(self, works: list[Work], layer: Layer, source, label: dict, gap_ns: int) -> None:
        """Emit the collective; ``source.begin_slot(g)`` then ``source.payload(w, msg)`` (user bytes,
        uint8) for the messages some mirror captures; ``label`` goes into the send truth."""
        opts = self.opts
        works = [w for w in works if w.msgs]
        self.clock += gap_ns
        depth = nv.recv_post_depth(max(1, len({w.channel for w in works})))
        depth = max(1, depth // nv.slice_steps(layer.protocol, layer.kind)) if not layer.p2p else 1
        for w in works:
            c = w.conn
            w.t0 = schedule.conn_step_start(c.step, layer.protocol, layer.kind) if not layer.p2p else c.step
            last = w.msgs[-1]
            c.step = w.t0 + last.conn_step + (nv.slice_steps(layer.protocol, layer.kind) if not layer.p2p else 1)
            w.first_idx = c.posted
        # receives posted ahead at the start, each receiver NIC one after the other
        end = self.clock
        per_nic: dict[int, int] = {}
        for w in works:
            for _ in range(min(depth, len(w.msgs))):
                ts = self.clock + per_nic.get(w.receiver, 0)
                per_nic[w.receiver] = per_nic.get(w.receiver, 0) + opts.pkt_ns() // 4 + 40
                end = max(end, self._post_cts(w, layer, ts))
        slot_start = end + opts.switch_ns + opts.step_ns
        nslots = max(w.delay + len(w.msgs) for w in works) if works else 0
        pkt = opts.pkt_ns()
        for g in range(nslots):
            source.begin_slot(g)
            active = [w for w in works if w.delay <= g < w.delay + len(w.msgs)]
            by_nic: dict[int, list[Work]] = {}
            for w in active:
                by_nic.setdefault(w.sender, []).append(w)
            end = slot_start
            for ws in by_nic.values():
                for j, w in enumerate(ws):
                    ts0 = slot_start + j * pkt
                    end = max(end, self._send(w, g - w.delay, layer, source, label, ts0, len(ws) * pkt))
            slot_start = end + opts.switch_ns + opts.step_ns
            self.sink.after_slot()
        self.clock = slot_start

    def _send(self, w: Work, k: int, layer: Layer, source, label: dict, ts0: int, dt: int) -> int:
        """Message ``k`` of ``w``: data WRITE, the receiver's ACK and its next receive post."""
        opts, c, qp, log = self.opts, w.conn, w.conn.qp, self.sink.log
        msg = w.msgs[k]
        t = w.t0 + msg.conn_step
        proto = layer.protocol
        wire_len = msg.nbytes if layer.p2p else schedule.message_wire_bytes(proto, msg.nbytes, t, self.version)
        split = self._split.get(wire_len)
        if split is None:
            split = self._split[wire_len] = nv.uses_split_write(
                self.version, wire_len, adaptive_routing=opts.adaptive_routing, ar_threshold=opts.ar_threshold)
        form = (TRAIN if opts.write_only_train else SPLIT) if split else NORMAL
        npk = packet_count(form, wire_len, opts.pmtu)
        psn = c.data_psn
        c.data_psn = (c.data_psn + npk) % PSN_MODULUS
        c.data_msn += rdma_messages(form, wire_len, opts.pmtu)
        c.received += 1
        seq = w.first_idx + k + 1  # the CTS idx this send answers
        last_ts = ts0 + (npk - 1) * dt
        va, _, rkey = self._recv_slot(w, layer, t)
        captured = self.sink.wants(qp.sender, qp.receiver)
        if captured:
            flag = None if layer.p2p else schedule.flag(proto, t)
            user = source.payload(w, msg)
            cap = wire_len if (layer.p2p or proto == nv.SIMPLE) else protocols.data_bytes(proto, wire_len)
            padded = np.zeros(cap, np.uint8)
            padded[:user.size] = user
            wire = protocols.encode(proto, padded, flag or 0)
            log.add(form, qp.sender, qp.receiver, qp.sport, qp.recv_qpn, psn, ts0, length=wire_len,
                    pmtu=opts.pmtu, va=va, rkey=rkey, imm=nv.encode_imm(wire_len, self.version),
                    pay_off=log.payload(wire), dt=dt)
            if self.send_truth:
                self._truth(w, msg, layer, label, t, seq, flag, form, wire_len, padded, user.size)
        arrive = last_ts + opts.switch_ns
        ack_ts = arrive + opts.ack_ns
        if self.sink.wants(qp.receiver, qp.sender):
            log.add(ACK, qp.receiver, qp.sender, qp.sport, qp.send_qpn, (psn + npk - 1) % PSN_MODULUS, ack_ts,
                    syndrome=credit_code(c.posted - c.received), msn=c.data_msn % PSN_MODULUS)
        end = max(ack_ts, last_ts)
        if c.posted - w.first_idx < len(w.msgs):  # one in, one more posted: the proxy stays `depth` ahead
            end = max(end, self._post_cts(w, layer, arrive + opts.cts_ns))
        return end

    def _truth(self, w, msg, layer, label, t, seq, flag, form, wire_len, padded, nbytes) -> None:
        qp = w.conn.qp
        rec = dict(label, sender=qp.sender, receiver=qp.receiver, channel=w.channel, sport=qp.sport, seq=seq,
                   step=t, flag=flag, protocol=layer.protocol, form=("normal", "split", "split")[form],
                   nbytes=nbytes, wire_bytes=wire_len,
                   offset=msg.offset, nelem=msg.nelem)
        if isinstance(msg, RingStep):
            rec.update(phase=msg.phase, chunk=msg.chunk, loop=msg.loop, ring_step=msg.step, slice=msg.slice)
        # what a decoder yields: LL/LL128 whole lines/groups, the tail zero as written
        rec["sha256"] = hashlib.sha256(padded.tobytes()).hexdigest()
        self.sends.append(rec)
