"""One port's frames split over several workers, by QP pair.

A worker must see every frame of the QPs it decodes, both directions: a QP's data, its ACKs and
the CTS its receiver posts back on the same QP pair (NCCL's default is one QP per connection).
The RoCEv2 UDP source port is what keeps a pair together: the Linux RDMA core (and mlx5) derives
it from the flow label of the two QP numbers' product, the same both ways (the real captures in
../shared show data and ACKs of a pair on one port). So worker = UDP source port mod N, and
every frame that is not UDP over IPv4/IPv6 goes to worker 0. The kernel's own flow hash
(PACKET_FANOUT_HASH) is not used: whether it orders addresses and ports together or apart
depends on the kernel version, and together it splits a pair's two directions.

``worker_of`` is the split for capture files (every worker reads the whole file and keeps its
share); AF_PACKET computes the same key in the kernel (a classic BPF fanout program, afpacket.py).
A connection spread over several QPs (NCCL_IB_QPS_PER_CONNECTION > 1) has a source port per QP:
its messages cut over the QPs then land in different workers and come out incomplete, never wrong.
"""

from __future__ import annotations

import numpy as np
from mirrorckpt.capture.batch import FrameBatch

ETH_VLAN = (0x8100, 0x88A8)
ETH_IPV4, ETH_IPV6 = 0x0800, 0x86DD
IPPROTO_UDP = 17


def _u16(data: np.ndarray, at: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """Big-endian u16 at byte ``at`` of each frame where ``ok`` (0 elsewhere)."""
    out = np.zeros(at.shape, np.int64)
    i = at[ok]
    out[ok] = data[i].astype(np.int64) << 8 | data[i + 1]
    return out


def udp_source_ports(b: FrameBatch) -> np.ndarray:
    """Each Ethernet frame's UDP source port (IPv4 or IPv6, up to two VLAN tags), -1 where none."""
    data, off, cap = b.data, b.offset.astype(np.int64), b.caplen.astype(np.int64)
    n = len(b)
    pos = off + 12
    ok = cap >= 14
    etype = _u16(data, pos, ok)
    for _ in range(2):  # 802.1Q / 802.1ad tags
        tagged = ok & np.isin(etype, ETH_VLAN)
        pos = np.where(tagged, pos + 4, pos)
        ok &= ~tagged | (pos + 2 <= off + cap)
        etype = np.where(tagged, _u16(data, pos, ok & tagged), etype)
    ip = pos + 2
    end = off + cap
    v4 = ok & (etype == ETH_IPV4) & (ip + 20 <= end)
    v6 = ok & (etype == ETH_IPV6) & (ip + 40 <= end)
    udp = np.full(n, -1, np.int64)
    if v4.any():
        ihl = np.zeros(n, np.int64)
        ihl[v4] = (data[ip[v4]] & 0x0F).astype(np.int64) * 4
        proto = np.zeros(n, np.int64)
        proto[v4] = data[ip[v4] + 9]
        v4 &= (proto == IPPROTO_UDP) & (ihl >= 20) & (ip + ihl + 2 <= end)
        udp = np.where(v4, ip + ihl, udp)
    if v6.any():
        nxt = np.zeros(n, np.int64)
        nxt[v6] = data[ip[v6] + 6]
        v6 &= (nxt == IPPROTO_UDP) & (ip + 42 <= end)
        udp = np.where(v6, ip + 40, udp)
    has = udp >= 0
    return np.where(has, _u16(data, np.where(has, udp, 0), has), -1)


def worker_of(b: FrameBatch, workers: int) -> np.ndarray:
    """The worker (0 .. workers-1) of each frame: UDP source port mod ``workers``, 0 for non-UDP."""
    sport = udp_source_ports(b)
    return np.where(sport >= 0, sport % workers, 0)


def share(b: FrameBatch, worker: int, workers: int) -> FrameBatch:
    """The frames of ``b`` that worker ``worker`` of ``workers`` decodes (sharing the buffer)."""
    return b.select(np.flatnonzero(worker_of(b, workers) == worker))
