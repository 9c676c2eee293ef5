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
bytes are known before its frames must go somewhere. The source port is the mirrored flow's:
through a mirror encapsulation (ERSPAN, GRE, VXLAN) the inner UDP header's, as the packet
decoder walks it (``parser.split.flow_ports``, the same compiled walk); the outer one would put
every frame of a GRE mirror in one worker, and split a VXLAN mirror's pairs.
A connection spread over several QPs (NCCL_IB_QPS_PER_CONNECTION > 1) has a source port per QP:
its messages cut over the QPs then land in different workers and come out incomplete, never wrong.
"""

from __future__ import annotations

import numpy as np


def add_port_bytes(weight: np.ndarray, sport: np.ndarray, nbytes: np.ndarray) -> None:
    """Adds each frame's bytes ``nbytes`` to ``weight`` (65536 entries) at its UDP source port
    ``sport`` (-1: none, not counted)."""
    ok = sport >= 0
    weight += np.bincount(sport[ok], weights=nbytes[ok], minlength=1 << 16).astype(np.int64)


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


def worker_of(sport: np.ndarray, workers: int, lut: np.ndarray | None = None) -> np.ndarray:
    """The worker (0 .. workers-1) of each frame by its UDP source port ``sport``: through ``lut``
    (``deal``) or mod ``workers``; 0 for a frame without one (-1)."""
    if lut is not None:
        return np.where(sport >= 0, lut[np.maximum(sport, 0)], 0)
    return np.where(sport >= 0, sport % workers, 0)
