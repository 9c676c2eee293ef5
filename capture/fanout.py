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
share), there through a table (``deal``, planned by parser.split) that deals the QP pairs of the
file's start out by their bytes, since a port's few pairs split by the port number alone often
land unevenly; AF_PACKET
computes port mod N in the kernel (a classic BPF fanout program, afpacket.py), where no pair's
bytes are known before its frames must go somewhere.
A connection spread over several QPs (NCCL_IB_QPS_PER_CONNECTION > 1) has a source port per QP:
its messages cut over the QPs then land in different workers and come out incomplete, never wrong.
"""

from __future__ import annotations

import numpy as np
from mirrorckpt.capture import _pack
from mirrorckpt.capture.batch import FrameBatch

ETH_VLAN = (0x8100, 0x88A8)
ETH_IPV4, ETH_IPV6 = 0x0800, 0x86DD
IPPROTO_UDP = 17


def udp_source_ports(b: FrameBatch) -> np.ndarray:
    """Each Ethernet frame's UDP source port (IPv4 or IPv6, up to two VLAN tags), -1 where none.
    Compiled: every worker of a capture file runs it on every frame of the file, and in numpy it
    cost each worker's capture thread about 75 ns a frame."""
    out = np.empty(len(b), np.int64)
    _pack.udp_source_ports(np.ascontiguousarray(b.data), np.ascontiguousarray(b.offset, np.int64),
                           np.ascontiguousarray(b.caplen, np.int64), out, *ETH_VLAN, ETH_IPV4, ETH_IPV6,
                           IPPROTO_UDP)
    return out


def add_port_bytes(weight: np.ndarray, b: FrameBatch) -> None:
    """Adds each frame's bytes to ``weight`` (65536 entries) at its UDP source port."""
    sport = udp_source_ports(b)
    ok = sport >= 0
    weight += np.bincount(sport[ok], weights=b.caplen[ok], minlength=1 << 16).astype(np.int64)


def deal(weight: np.ndarray, workers: int, together: list[list[int]] = ()) -> np.ndarray:
    """The worker of each UDP source port: units (a port, or the ports of one of ``together``)
    dealt out by their bytes in ``weight``, largest first, each to the worker with the fewest so
    far; ties go to the lower port and worker, so every worker computes the same table. Ports with
    no bytes keep ``port mod workers``. A port's few QP pairs split by the port number alone often
    land unevenly (two pairs in one worker half the time), which left a worker idle."""
    lut = np.arange(1 << 16, dtype=np.int64) % workers
    grouped = {p for g in together for p in g}
    units = [sorted(set(g)) for g in together]
    units += [[p] for p in np.flatnonzero(weight).tolist() if p not in grouped]
    units = [(int(weight[u].sum()), u[0], u) for u in units if weight[u].sum() > 0]
    load = [0] * workers
    for nbytes, _, u in sorted(units, key=lambda x: (-x[0], x[1])):
        w = min(range(workers), key=lambda k: (load[k], k))
        lut[u] = w
        load[w] += nbytes
    return lut


def worker_of(b: FrameBatch, workers: int, lut: np.ndarray | None = None) -> np.ndarray:
    """The worker (0 .. workers-1) of each frame: by its UDP source port, through ``lut`` (``deal``)
    or mod ``workers``; 0 for non-UDP."""
    sport = udp_source_ports(b)
    if lut is not None:
        return np.where(sport >= 0, lut[np.maximum(sport, 0)], 0)
    return np.where(sport >= 0, sport % workers, 0)


def share(b: FrameBatch, worker: int, workers: int, lut: np.ndarray | None = None) -> FrameBatch:
    """The frames of ``b`` that worker ``worker`` of ``workers`` decodes (sharing the buffer)."""
    return b.select(np.flatnonzero(worker_of(b, workers, lut) == worker))
