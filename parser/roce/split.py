"""Which QP pairs of a capture file's port must stay in one worker when `serve` splits it.

A connection with several QPs (NCCL_IB_QPS_PER_CONNECTION > 1) has a UDP source port per QP, and
its messages need all of them in one decoder: cut over the QPs (<= 2.19), or whole in turn, where
only the QP that carries the CTS posts numbers them (2.20+). Its QPs write the same receive
buffers, so the same rkeys (a registration belongs to one receiver's buffer): the ports whose
WRITEs name one (sender, receiver, rkey) are one unit. A capture file can be read ahead for this;
a live port's kernel split (capture.fanout, AF_PACKET) cannot, and splits by port alone.
"""

from __future__ import annotations

import numpy as np
from mirrorckpt.capture import fanout
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.config.encap import EncapSpec
from mirrorckpt.parser import _inner, encap, roce

# The start of a capture file whose bytes per QP pair set its split: every ring connection carries
# each all-reduce from the first one on, so the shares seen there hold.
PLAN_BYTES = 64 << 20


def flow_ports(b: FrameBatch, encapsulation: EncapSpec | None = None) -> np.ndarray:
    """Each frame's UDP source port as the packet decoder walks it (IPv4 or IPv6, up to two VLAN
    tags; through a mirror encapsulation, the mirrored flow's), -1 where it has none. Compiled:
    every worker of a capture file runs it on every frame of the file (in numpy it cost each
    worker's capture thread about 75 ns a frame)."""
    out = np.empty(len(b), np.int64)
    _inner.flow_ports(np.ascontiguousarray(b.data), np.ascontiguousarray(b.offset, np.int64),
                     np.ascontiguousarray(b.caplen, np.int64), encap.table(encapsulation), out)
    return out


def worker_of(b: FrameBatch, workers: int, lut: np.ndarray | None = None,
              encapsulation: EncapSpec | None = None) -> np.ndarray:
    """The worker of each frame of ``b`` (``fanout.worker_of`` of its flow ports)."""
    return fanout.worker_of(flow_ports(b, encapsulation), workers, lut)


def share(b: FrameBatch, worker: int, workers: int, lut: np.ndarray | None = None,
          encapsulation: EncapSpec | None = None) -> FrameBatch:
    """The frames of ``b`` that worker ``worker`` of ``workers`` decodes (sharing the buffer)."""
    return b.select(np.flatnonzero(worker_of(b, workers, lut, encapsulation) == worker))


def connection_ports(batches, limit: int = PLAN_BYTES,
                     encapsulation: EncapSpec | None = None) -> tuple[np.ndarray, list[list[int]]]:
    """Bytes per UDP source port of the batches up to ``limit`` bytes, and the groups of ports
    whose RDMA WRITEs target one receive buffer (more than one port each)."""
    weight = np.zeros(1 << 16, np.int64)
    parent: dict[int, int] = {}
    first: dict[tuple, int] = {}  # (sender, receiver, rkey) -> a port that wrote it
    linked: set[int] = set()  # ports that wrote any

    def root(p: int) -> int:
        while parent.get(p, p) != p:
            p = parent[p]
        return p

    seen = 0
    for b in batches:
        fanout.add_port_bytes(weight, flow_ports(b, encapsulation), b.caplen)
        pk, _ = roce.decode(b, icrc=False, encapsulation=encapsulation)
        rows = np.flatnonzero(pk.has_reth & (pk.rkey != 0))
        if len(rows):
            src, dst = pk.src[rows], pk.dst[rows]
            cols = [src.view(np.uint64), dst.view(np.uint64), pk.rkey[rows].astype(np.uint64)[:, None],
                    pk.sport[rows].astype(np.uint64)[:, None]]
            keys = np.unique(np.column_stack(cols), axis=0)  # one row per (sender, receiver, rkey, port)
            for *k, p in keys.tolist():
                linked.add(p)
                q = first.setdefault(tuple(k), p)
                a, c = root(p), root(q)
                if a != c:
                    parent[max(a, c)] = min(a, c)
        seen += b.nbytes
        if seen >= limit:
            break
    groups: dict[int, list[int]] = {}
    for p in linked:
        groups.setdefault(root(p), []).append(p)
    return weight, [sorted(g) for g in groups.values() if len(g) > 1]


def plan(batches, workers: int, limit: int = PLAN_BYTES, by_port: bool = False,
         encapsulation: EncapSpec | None = None) -> tuple[np.ndarray, dict]:
    """The worker of each UDP source port of a capture file (``fanout.deal``): a connection's QP
    pairs together, units dealt out by their bytes in the file's first ``limit`` bytes (``by_port``:
    port mod N, as a live port's kernel splits); and what it found, for the log (pairs, connections
    of several QPs, each worker's share of those bytes)."""
    weight, together = connection_ports(batches, limit, encapsulation)
    lut = np.arange(1 << 16) % workers if by_port else fanout.deal(weight, workers, together)
    ports = np.flatnonzero(weight)
    share = np.bincount(lut[ports], weights=weight[ports], minlength=workers)
    return lut, {"qp_pairs": len(ports), "connections_of_several_qps": len(together),
                 "share_of_bytes": [round(float(x), 3) for x in share / max(1, share.sum())]}
