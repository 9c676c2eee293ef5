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
  connection step ``t = conn_step_start(...) + msg.conn_step``; with several QPs per connection
  (doc 6.5) either cut into ``qp_piece_bytes`` pieces, one per QP at ``addr + i·piece``, each
  closed by its own immediate carrying the full size, or whole on QP ``data_qp(...)`` in turn;
  the CTS stays on QP 0;
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
from mirrorckpt.parser.headers import BTH, ETH, ICRC_BYTES, IMMDT, IPV6, PSN_MODULUS, RETH, SPEED_UPDATE, UDP
from mirrorckpt.parser.placement import RingStep
from mirrorckpt.parser.roce import nccl_versions as nv
from mirrorckpt.parser.roce import protocols, schedule
from mirrorckpt.tools.generator.messages import ACK, NORMAL, PLAIN, SEND, SPLIT, TRAIN, packet_count, rdma_messages
from mirrorckpt.tools.generator.topology import P2P_CHUNK_BYTES, QpPair

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
    qps_per_connection: int = 1  # NCCL_IB_QPS_PER_CONNECTION
    split_data_on_qps: bool | None = None  # NCCL_IB_SPLIT_DATA_ON_QPS; None: the version's default
    line_rate_gbps: float = 100.0
    speed_update: bool = False  # 2.31+, NCCL_IB_EVENT_BASED_LB=1: a port speed update after the first CTS
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
        if not 1 <= self.qps_per_connection <= 16:
            raise ValueError(f"{self.qps_per_connection} QPs per connection: NCCL takes 1 to 16")

    def check_release(self, v) -> None:
        if self.speed_update and nv.version(v) < nv.SPEED_UPDATE_SINCE:
            raise ValueError(f"NCCL {nv.version(v)} writes no port speed updates (they came with "
                             f"{nv.SPEED_UPDATE_SINCE})")

    def split_on_qps(self, v) -> bool:
        """Whether messages are cut over the QPs for release ``v`` (checked: before 2.18 they
        always are)."""
        if self.split_data_on_qps is None:
            return nv.split_data_on_qps_default(v)
        if not self.split_data_on_qps and nv.version(v) < nv.SPLIT_PARAM_SINCE:
            raise ValueError(f"NCCL {nv.version(v)} always cuts messages over the QPs "
                             f"(NCCL_IB_SPLIT_DATA_ON_QPS exists from {nv.SPLIT_PARAM_SINCE})")
        return self.split_data_on_qps

    def pkt_ns(self) -> int:
        """Line time of one full-MTU data frame."""
        return max(1, int(round((self.pmtu + _FRAME_OVERHEAD + _ETH_GAP) * 8 / self.line_rate_gbps)))


@dataclass
class ConnState:
    """One connection's counters (both directions of its QP pairs)."""
    qp: QpPair
    data_psn: list  # per QP: next PSN sender -> receiver
    cts_psn: int  # next PSN receiver -> sender (QP 0)
    data_msn: list = None  # per QP: RDMA messages the receiver completed
    cts_msn: int = 0  # CTS WRITEs the sender completed
    step: int = 0  # NCCL connection step counter
    posted: int = 0  # receives posted = last CTS idx
    received: int = 0  # sends received (receives consumed)

    def __post_init__(self):
        if self.data_msn is None:
            self.data_msn = [0] * len(self.data_psn)


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
        self.split_qps = opts.split_on_qps(self.version)
        opts.check_release(self.version)

    def conn(self, key, qp: QpPair) -> ConnState:
        c = self.conns.get(key)
        if c is None:
            psn0 = self._psn0()
            cts = self._psn0()
            c = self.conns[key] = ConnState(qp, [psn0] + [self._psn0() for _ in qp.more_qps], cts)
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
        if self.opts.speed_update and c.posted == 1 and not layer.p2p:
            ack_ts = max(ack_ts, self._speed_update(c, ts + self.opts.pkt_ns() // 4))
        return ack_ts

    def _speed_update(self, c: ConnState, ts: int) -> int:
        """The receiver's 32-byte port-speed WRITE to the sender (QP 0, after its first CTS post);
        returns when the sender has ACKed it."""
        qp, log = c.qp, self.sink.log
        psn = c.cts_psn
        c.cts_psn = (c.cts_psn + 1) % PSN_MODULUS
        c.cts_msn += 1
        ack_ts = ts + self.opts.switch_ns + self.opts.ack_ns
        if self.sink.wants(qp.receiver, qp.sender):
            body = SPEED_UPDATE.pack(counter=1, speeds=np.array([400] + [0] * 7, "<u2").tobytes())
            log.add(PLAIN, qp.receiver, qp.sender, qp.sport, qp.send_qpn, psn, ts, length=len(body),
                    pmtu=self.opts.pmtu, va=qp.fifo_va - 4096, rkey=qp.fifo_rkey ^ 0x5A5A,
                    pay_off=log.payload(np.frombuffer(body, np.uint8)))
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
        seq = w.first_idx + k + 1  # the CTS idx this send answers
        va, _, rkey = self._recv_slot(w, layer, t)
        c.received += 1
        captured = self.sink.wants(qp.sender, qp.receiver)
        wire = None
        if captured:
            flag = None if layer.p2p else schedule.flag(proto, t)
            user = source.payload(w, msg)
            cap = wire_len if (layer.p2p or proto == nv.SIMPLE) else protocols.data_bytes(proto, wire_len)
            padded = np.zeros(cap, np.uint8)
            padded[:user.size] = user
            wire = protocols.encode(proto, padded, flag or 0)
            if self.send_truth:
                self._truth(w, msg, layer, label, t, seq, flag, form, wire_len, padded, user.size)
        # the pieces: (QP, offset, bytes); one whole piece with one QP
        n = qp.nqps
        if n == 1:
            pieces = [(0, 0, wire_len)]
        elif self.split_qps:
            chunk = nv.qp_piece_bytes(wire_len, n)
            pieces = [(nv.data_qp(self.version, True, n, seq - 1, i), i * chunk,
                       max(0, min(chunk, wire_len - i * chunk))) for i in range(n)]
        else:
            pieces = [(nv.data_qp(self.version, False, n, seq - 1), 0, wire_len)]
        imm = nv.encode_imm(wire_len, self.version)
        ts, end = ts0, ts0
        for q, off, nb in pieces:
            send_qpn, recv_qpn, sport = qp.data_qp(q)
            npk = packet_count(form, nb, opts.pmtu)
            psn = c.data_psn[q]
            c.data_psn[q] = (psn + npk) % PSN_MODULUS
            c.data_msn[q] += rdma_messages(form, nb, opts.pmtu)
            last_ts = ts + (npk - 1) * dt
            if captured:
                log.add(form, qp.sender, qp.receiver, sport, recv_qpn, psn, ts, length=nb,
                        pmtu=opts.pmtu, va=va + off, rkey=rkey, imm=imm, pay_off=log.payload(wire[off:off + nb]),
                        dt=dt)
            arrive = last_ts + opts.switch_ns
            ack_ts = arrive + opts.ack_ns
            if self.sink.wants(qp.receiver, qp.sender):
                log.add(ACK, qp.receiver, qp.sender, sport, send_qpn, (psn + npk - 1) % PSN_MODULUS, ack_ts,
                        syndrome=credit_code(c.posted - c.received), msn=c.data_msn[q] % PSN_MODULUS)
            end = max(end, ack_ts, last_ts)
            ts = last_ts + dt
        if c.posted - w.first_idx < len(w.msgs):  # one in, one more posted: the proxy stays `depth` ahead
            end = max(end, self._post_cts(w, layer, arrive + opts.cts_ns))
        return end

    # -- an in-network aggregation (CollNet) ----------------------------------------------------------

    def aggregate(self, topo, inputs: list[np.ndarray], result: np.ndarray, label: dict, gap_ns: int) -> None:
        """Every rank SENDs its buffer to the aggregation node on a QP pair of its own, then the node
        SENDs the sum back on the same pair (RC SENDs, each ACKed): no CTS, no RDMA WRITE."""
        opts, log = self.opts, self.sink.log
        self.clock += gap_ns
        node = topo.add_switch().rank
        pkt = opts.pkt_ns()
        end = self.clock
        for up in (True, False):
            t0 = end
            for r, x in enumerate(inputs):
                conn = self.conn(("collnet", r), topo.collnet_pair(r, self.version))
                qp, data = conn.qp, (x if up else result)
                wire = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
                src, dst = (r, node) if up else (node, r)
                dqp, back = (qp.recv_qpn, qp.send_qpn) if up else (qp.send_qpn, qp.recv_qpn)
                ts = t0 + r * pkt
                for off in range(0, max(1, wire.size), P2P_CHUNK_BYTES):
                    piece = wire[off:off + P2P_CHUNK_BYTES]
                    npk = packet_count(SEND, piece.size, opts.pmtu)
                    psn = conn.data_psn[0] if up else conn.cts_psn
                    if up:
                        conn.data_psn[0] = (psn + npk) % PSN_MODULUS
                    else:
                        conn.cts_psn = (psn + npk) % PSN_MODULUS
                    if self.sink.wants(src, dst):
                        log.add(SEND, src, dst, qp.sport, dqp, psn, ts, length=piece.size, pmtu=opts.pmtu,
                                pay_off=log.payload(piece), dt=pkt * len(inputs))
                    last = ts + (npk - 1) * pkt * len(inputs)
                    if self.sink.wants(dst, src):
                        log.add(ACK, dst, src, qp.sport, back, (psn + npk - 1) % PSN_MODULUS,
                                last + opts.switch_ns + opts.ack_ns, syndrome=credit_code(16), msn=0)
                    ts = last + pkt * len(inputs)
                    end = max(end, ts + opts.switch_ns + opts.ack_ns)
            end += opts.step_ns
            self.sink.after_slot()
        self.clock = end

    def _truth(self, w, msg, layer, label, t, seq, flag, form, wire_len, padded, nbytes) -> None:
        qp = w.conn.qp
        rec = dict(label, sender=qp.sender, receiver=qp.receiver, channel=w.channel, sport=qp.sport, seq=seq,
                   step=t, flag=flag, protocol=layer.protocol, form=("normal", "split", "split")[form],
                   nbytes=nbytes, wire_bytes=wire_len,
                   offset=msg.offset, nelem=msg.nelem)
        if qp.nqps > 1:
            rec["qps"] = qp.nqps
        if isinstance(msg, RingStep):
            rec.update(phase=msg.phase, chunk=msg.chunk, loop=msg.loop, ring_step=msg.step, slice=msg.slice)
        # what a decoder yields: LL/LL128 whole lines/groups, the tail zero as written
        rec["sha256"] = hashlib.sha256(padded.tobytes()).hexdigest()
        self.sends.append(rec)
