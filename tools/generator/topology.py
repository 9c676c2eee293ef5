"""Who talks to whom on the simulated fabric: NICs, QP pairs, UDP source ports, buffer addresses.

Everything here is drawn once per run from the seed, so equal options give equal captures:

* one NIC per rank: a Mellanox-style MAC, the IPv6 link-local address derived from it (EUI-64,
  as the real captures use) and an IPv4 address;
* one RC QP pair per NCCL connection (channel, ring position r -> r+1), or ``nqps`` of them
  (NCCL_IB_QPS_PER_CONNECTION), QP numbers allocated per NIC in NCCL's setup order (per channel:
  the receive connection's QPs one after the other, then the send connection's);
* the UDP source port of a pair from its two QP numbers, as the Linux RDMA core computes it, so
  both directions of a pair (and their ACKs) share it;
* per receiving connection one allocation holding the LL, LL128 and Simple buffers (each with its
  own rkey; parser.nccl_versions.recv_buffer_offset), allocations of a rank at increasing
  addresses in channel order, as NCCL allocates them; per sending connection a CTS FIFO.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

import numpy as np
from mirrorckpt.parser.roce import nccl_versions as nv

# OUIs of NVIDIA/Mellanox ConnectX NICs (the real captures show 0c:42:a1 and 08:c0:eb).
MELLANOX_OUIS = ((0x0C, 0x42, 0xA1), (0x08, 0xC0, 0xEB), (0xB8, 0xCE, 0xF6), (0x98, 0x03, 0x9B),
                 (0x1C, 0x34, 0xDA), (0x04, 0x3F, 0x72), (0xE8, 0xEB, 0xD3), (0x50, 0x6B, 0x4B))

# Linux include/rdma/ib_verbs.h: rdma_calc_flow_label / rdma_flow_label_to_udp_sport.
_FLOW_LABEL_MASK = 0xFFFFF
_UDP_SPORT_MIN = 0xC000

# GPU memory (GPUDirect RDMA) as the captures show it: receive buffers near 0x6_0000_0000, with
# the driver's 2 MiB allocation granularity.
_GPU_VA_BASE = 0x6_0000_0000
_GPU_ALIGN = 2 << 20
# Host memory (CTS FIFOs, the P2P shared buffer): user-space heap addresses.
_HOST_VA_BASE = 0x7F00_0000_0000

# NCCL_P2P_NET_CHUNKSIZE default (doc 4.1): a point-to-point receive announces one 128 KiB chunk.
P2P_CHUNK_BYTES = 128 << 10


def udp_sport(lqpn: int, rqpn: int) -> int:
    """UDP source port of a RoCEv2 QP pair: symmetric in the two QP numbers (Linux RDMA core)."""
    v = (lqpn * rqpn) & 0xFFFFFFFFFFFFFFFF
    v ^= v >> 20
    v ^= v >> 40
    fl = v & _FLOW_LABEL_MASK
    low, high = fl & 0x3FFF, fl & 0xFC000
    return (low ^ (high >> 14)) | _UDP_SPORT_MIN


def link_local_ipv6(mac: bytes) -> bytes:
    """fe80::/64 with the modified EUI-64 interface id of ``mac`` (RFC 4291 appendix A)."""
    eui = bytes([mac[0] ^ 0x02]) + mac[1:3] + b"\xff\xfe" + mac[3:6]
    return b"\xfe\x80" + b"\x00" * 6 + eui


@dataclass(frozen=True)
class Nic:
    rank: int
    mac: bytes  # 6 bytes
    ipv4: bytes  # 4 bytes
    ipv6: bytes  # 16 bytes, link-local

    def ip(self, v6: bool) -> bytes:
        return self.ipv6 if v6 else self.ipv4

    def ip_text(self, v6: bool) -> str:
        return str(ipaddress.ip_address(self.ip(v6)))


@dataclass(frozen=True)
class QpPair:
    """One RC connection: data and ACKs of CTS go sender -> receiver (to ``recv_qpn``), CTS posts
    and ACKs of data go receiver -> sender (to ``send_qpn``); all on ``sport``."""
    sender: int
    receiver: int
    send_qpn: int
    recv_qpn: int
    sport: int
    recv_base: int  # receiver: VA of the connection's buffer allocation (ring) or shared buffer (P2P)
    rkeys: dict  # receiver: protocol -> rkey of that protocol's buffer ("p2p" for the shared buffer)
    fifo_va: int  # sender: VA of its CTS FIFO
    fifo_rkey: int
    more_qps: tuple = ()  # QPs 1.. of the connection: (send_qpn, recv_qpn, sport) each

    @property
    def nqps(self) -> int:
        return 1 + len(self.more_qps)

    def data_qp(self, q: int) -> tuple[int, int, int]:
        """(send_qpn, recv_qpn, sport) of QP ``q`` (0: the one the CTS also uses)."""
        return (self.send_qpn, self.recv_qpn, self.sport) if q == 0 else self.more_qps[q - 1]


@dataclass
class Topology:
    nics: list[Nic]
    orders: list[list[int]]  # ring order per channel, from rank 0
    ring: dict[tuple[int, int], QpPair]  # (channel, ring position of the sender) -> pair
    p2p: dict[tuple[int, int], QpPair] = field(default_factory=dict)  # (sender, receiver) -> pair
    # (channel, sender, receiver) -> pair: collective connections off the ring (Tree's, PAT's)
    peers: dict[tuple[int, int, int], QpPair] = field(default_factory=dict)
    switch: Nic | None = None  # an in-network aggregation node (CollNet/SHARP), index nranks
    collnet: dict[int, QpPair] = field(default_factory=dict)  # rank -> its pair with the switch
    rng: np.random.Generator | None = None
    _next_qpn: list[int] = field(default_factory=list)
    _next_gpu_va: list[int] = field(default_factory=list)
    _next_host_va: list[int] = field(default_factory=list)
    _rkeys: set = field(default_factory=set)

    @property
    def nranks(self) -> int:
        return len(self.nics)

    def pair(self, channel: int, pos: int) -> QpPair:
        return self.ring[(channel, pos)]

    @property
    def all_nics(self) -> list[Nic]:
        """The ranks' NICs, then the aggregation node's if there is one (frames index them so)."""
        return self.nics + ([self.switch] if self.switch is not None else [])

    def add_switch(self) -> Nic:
        """The SHARP aggregation node CollNet sends to, made on first use: a NIC that is no rank."""
        if self.switch is None:
            mac = bytes([0x02, 0x5A, 0x4E]) + bytes(self.rng.integers(0, 256, 3, dtype=np.uint8).tolist())
            self.switch = Nic(self.nranks, mac, bytes([10, 88, 0, 250]), link_local_ipv6(mac))
            self._next_qpn.append(int(self.rng.integers(0x100, 0x2000)))
            self._next_gpu_va.append(_GPU_VA_BASE)
            self._next_host_va.append(_HOST_VA_BASE)
        return self.switch

    def collnet_pair(self, rank: int, version) -> QpPair:
        """The QP pair between ``rank`` and the aggregation node (CollNet's own connection, no NCCL
        buffers: the node receives into its own memory)."""
        if rank not in self.collnet:
            node = self.add_switch().rank
            recv_qpn, send_qpn = self._qpn(node), self._qpn(rank)
            self.collnet[rank] = self._make_pair(rank, node, recv_qpn, send_qpn, 0, {}, version)
        return self.collnet[rank]

    def peer_pair(self, channel: int, sender: int, receiver: int, version) -> tuple[object, QpPair]:
        """(connection key, pair) of channel ``channel``'s connection sender -> receiver: the ring's own
        where the receiver is the sender's ring successor on that channel (NCCL connects a channel's
        peer once, connIndex 0, whatever algorithm asks), else one made on first use like a ring
        connection (its own QPs and receive buffers), as Tree's and PAT's are."""
        order = self.orders[channel]
        pos = order.index(sender)
        if order[(pos + 1) % len(order)] == receiver:
            return (channel, pos), self.ring[(channel, pos)]
        key = (channel, sender, receiver)
        if key not in self.peers:
            recv_qpn, send_qpn = self._qpn(receiver), self._qpn(sender)
            alloc = sum(nv.buffer_bytes(p, version) for p in nv.PROTOCOLS)
            base = self._gpu_alloc(receiver, alloc)
            self.peers[key] = self._make_pair(sender, receiver, recv_qpn, send_qpn, base,
                                              {p: self._rkey() for p in nv.PROTOCOLS}, version)
        return ("peer", *key), self.peers[key]

    # -- allocation ------------------------------------------------------------------------------

    def _qpn(self, rank: int) -> int:
        q = self._next_qpn[rank]
        self._next_qpn[rank] += 1
        return q

    def _rkey(self) -> int:
        while True:
            k = int(self.rng.integers(0x100000, 0x1000000))
            if k not in self._rkeys:
                self._rkeys.add(k)
                return k

    def _gpu_alloc(self, rank: int, size: int) -> int:
        va = self._next_gpu_va[rank]
        # the next allocation lands above this one, after a gap of other allocations
        gap = int(self.rng.integers(0, 8)) * _GPU_ALIGN
        self._next_gpu_va[rank] = va + -(-size // _GPU_ALIGN) * _GPU_ALIGN + gap
        return va

    def _host_alloc(self, rank: int, size: int, align: int = 32) -> int:
        start = -(-self._next_host_va[rank] // align) * align
        if align < 4096:  # a heap object: somewhere inside its page
            start += int(self.rng.integers(0, 4096 // align)) * align
        self._next_host_va[rank] = start + -(-size // 4096) * 4096 + int(self.rng.integers(1, 64)) * 4096
        return start

    def _make_pair(self, sender: int, receiver: int, recv_qpn: int, send_qpn: int, recv_base: int,
                   rkeys: dict, version, more: tuple = ()) -> QpPair:
        fifo_bytes = nv.cts_fifo_slots(version) * nv.cts_fifo_stride(version)
        more = tuple((s, r, udp_sport(s, r)) for s, r in more)
        return QpPair(sender, receiver, send_qpn, recv_qpn, udp_sport(send_qpn, recv_qpn), recv_base, rkeys,
                      self._host_alloc(sender, fifo_bytes), self._rkey(), more)

    def p2p_pair(self, sender: int, receiver: int, version) -> QpPair:
        """The point-to-point connection sender -> receiver (NCCL's connIndex 1: its own QPs),
        created on first use; the receiver's buffer is its shared host buffer."""
        key = (sender, receiver)
        if key not in self.p2p:
            recv_qpn, send_qpn = self._qpn(receiver), self._qpn(sender)
            base = self._host_alloc(receiver, 1 << 22, align=1 << 21)
            self.p2p[key] = self._make_pair(sender, receiver, recv_qpn, send_qpn, base, {"p2p": self._rkey()},
                                            version)
        return self.p2p[key]


def build(nranks: int, orders: list[list[int]], seed: int, version, arm: bool = False, nqps: int = 1) -> Topology:
    """NICs and the ring's QP pairs for ``orders`` (one ring order per channel, from rank 0),
    ``nqps`` QPs per connection."""
    topo = fabric(nranks, seed)
    topo.orders = [list(o) for o in orders]
    topo.ring = ring_pairs(topo, list(range(nranks)), orders, version, arm, nqps)
    return topo


def fabric(nranks: int, seed: int) -> Topology:
    """The NICs of ``nranks`` ranks and their allocators, no connection yet (``ring_pairs`` adds a
    communicator's)."""
    rng = np.random.default_rng([seed, 0x70B0])
    nics = []
    for r in range(nranks):
        oui = MELLANOX_OUIS[r % len(MELLANOX_OUIS)]
        mac = bytes(oui) + bytes(rng.integers(0, 256, 3, dtype=np.uint8).tolist())
        ipv4 = bytes([10, 88, 0, 10 + r])
        nics.append(Nic(r, mac, ipv4, link_local_ipv6(mac)))
    topo = Topology(nics, [], {}, rng=rng)
    topo._next_qpn = [int(rng.integers(0x100, 0x2000)) for _ in range(nranks)]
    topo._next_gpu_va = [_GPU_VA_BASE + int(rng.integers(0, 64)) * _GPU_ALIGN for _ in range(nranks)]
    topo._next_host_va = [_HOST_VA_BASE + (int(rng.integers(0x10, 0xFF)) << 32) for _ in range(nranks)]
    return topo


def ring_pairs(topo: Topology, members: list[int], orders: list[list[int]], version, arm: bool = False,
               nqps: int = 1) -> dict[tuple[int, int], QpPair]:
    """The QP pairs of one communicator over ``members`` (its local rank i is NIC ``members[i]``;
    ``orders`` in local ranks), allocated from ``topo``'s NICs: (channel, ring position) -> pair."""
    alloc = sum(nv.buffer_bytes(p, version, arm) for p in nv.PROTOCOLS)
    n = len(members)
    out = {}
    for ch, order in enumerate(orders):
        # NCCL connects channel by channel: every rank sets up its receive side, then its send
        # side; the receiver's QP exists before the sender's.
        recv_side = {}
        for pos in range(n):
            receiver = members[order[(pos + 1) % n]]
            qpns = [topo._qpn(receiver) for _ in range(nqps)]
            base = topo._gpu_alloc(receiver, alloc)
            recv_side[pos] = (qpns, base, {p: topo._rkey() for p in nv.PROTOCOLS})
        for pos in range(n):
            sender, receiver = members[order[pos]], members[order[(pos + 1) % n]]
            qpns, base, rkeys = recv_side[pos]
            sends = [topo._qpn(sender) for _ in range(nqps)]
            out[(ch, pos)] = topo._make_pair(sender, receiver, qpns[0], sends[0], base, rkeys, version,
                                             tuple(zip(sends[1:], qpns[1:])))
    return out
