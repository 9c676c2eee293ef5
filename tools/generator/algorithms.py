"""Collective algorithms other than the ring, as NCCL puts them on the network: what `doctor` must
recognise and the appliance cannot follow.

* ``tree``: all-reduce by NCCL's double binary tree over the ranks (one GPU per node: node = rank).
  Tree 0 is ``btree`` (parent and up to two children by the bit rules of NCCL's ncclGetBtree,
  v2.30.7-1:src/graph/trees.cc:32-66), tree 1 its mirror (even rank counts) or its shift by one
  (odd), ncclGetDtree (trees.cc:86-112); the first half of the channels run tree 0, the second
  tree 1 (connectTrees, v2.30.7-1:src/graph/connect.cc:148-170). Per channel range and chunk, every
  rank but the root sends its subtree's partial sum up, then every rank with children sends the
  result down (runTreeUpDown/runTreeSplit, src/device/all_reduce.h). A connection to a channel's
  ring successor is the ring's (NCCL connects a peer once per channel, connIndex 0).
* ``pat``: all-gather by PAT (2.23+, one rank per node): connections to the ranks at distance
  1, 2, 4, ... (ncclTransportPatConnect, v2.30.7-1:src/transport/generic.cc:69-92: all-gather sends to
  rank + 2^k, reduce-scatter to rank - 2^k), Simple only. Modelled as its peer pattern and message
  unit (one rank's chunk per message, recursive doubling), not PatAGAlgorithm's aggregation order.
* ``nvls``: all-reduce inside the node (NVLink SHARP): nothing on the mirrored network links.
* ``collnet``: all-reduce through an in-network aggregation node (SHARP): every rank SENDs its
  buffer to the node, which SENDs the sum back; the ring carries none of it.
Broadcasts stay on the ring in every case, as NCCL runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mirrorckpt.parser.roce import nccl_versions as nv
from mirrorckpt.parser.roce import ringreduce

RING, TREE, PAT, NVLS, COLLNET = "ring", "tree", "pat", "nvls", "collnet"
ALGORITHMS = (RING, TREE, PAT, NVLS, COLLNET)


def btree(nranks: int, rank: int) -> tuple[int, list[int]]:
    """(parent or -1, children) of ``rank`` in NCCL's binary tree rooted at 0."""
    bit = 1
    while bit < nranks and not bit & rank:
        bit <<= 1
    if rank == 0:
        return -1, ([bit >> 1] if nranks > 1 else [])
    up = (rank ^ bit) | (bit << 1)
    if up >= nranks:
        up = rank ^ bit
    low = bit >> 1
    if low == 0:
        return up, []
    down1 = rank + low
    while down1 >= nranks and low:
        low >>= 1
        down1 = rank + low
    kids = [rank - (bit >> 1)] + ([down1] if low and down1 != rank else [])
    return up, kids


def dtree(nranks: int, rank: int, which: int) -> tuple[int, list[int]]:
    """(parent or -1, children) of ``rank`` in tree ``which`` (0 or 1) of the double binary tree."""
    if which == 0:
        return btree(nranks, rank)
    if nranks % 2:
        up, kids = btree(nranks, (rank - 1) % nranks)
        return (-1 if up < 0 else (up + 1) % nranks), [(k + 1) % nranks for k in kids]
    up, kids = btree(nranks, nranks - 1 - rank)
    return (-1 if up < 0 else nranks - 1 - up), [nranks - 1 - k for k in kids]


@dataclass(frozen=True)
class PeerMsg:
    """One message of a non-ring algorithm: ``nbytes`` user bytes of elements [offset, offset+nelem)
    of the array ``values`` names in the source (wire.Wire only reads nbytes and conn_step)."""
    nbytes: int
    conn_step: int
    offset: int
    nelem: int
    values: object  # key of the array the payload is cut from


class PieceValues:
    """Payloads cut from named arrays (partial sums, results, one rank's contribution)."""

    def __init__(self, arrays: dict):
        self.arrays = arrays

    def begin_slot(self, g: int) -> None:
        pass

    def payload(self, w, msg: PeerMsg) -> np.ndarray:
        a = self.arrays[msg.values]
        return np.ascontiguousarray(a[msg.offset:msg.offset + msg.nelem]).astype(
            a.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(-1)


def tree_channel(channel: int, nchannels: int) -> int:
    """Which tree a channel runs: the first half tree 0, the second tree 1 (one channel: tree 0)."""
    return 0 if channel < max(1, nchannels // 2) else 1


def subtree_sums(inputs: list[np.ndarray], which: int, dtype: str) -> tuple[dict[int, np.ndarray], int]:
    """Per rank the sum over its subtree in tree ``which`` (own input, then each child's subtree,
    rounded in the element type at each addition as the tree reduces), and the root."""
    nranks = len(inputs)
    sums: dict[int, np.ndarray] = {}
    root = next(r for r in range(nranks) if dtree(nranks, r, which)[0] < 0)

    def walk(r: int) -> np.ndarray:
        acc = inputs[r]
        for k in dtree(nranks, r, which)[1]:
            acc = ringreduce.add(acc, walk(k), dtype)
        sums[r] = acc
        return acc

    walk(root)
    return sums, root


def heights(nranks: int, which: int) -> tuple[dict[int, int], dict[int, int]]:
    """(height: longest path down to a leaf, depth: distance from the root) per rank."""
    height: dict[int, int] = {}
    depth: dict[int, int] = {}
    root = next(r for r in range(nranks) if dtree(nranks, r, which)[0] < 0)

    def walk(r: int, below_root: int) -> int:
        depth[r] = below_root
        kids = dtree(nranks, r, which)[1]
        height[r] = 1 + max((walk(k, below_root + 1) for k in kids), default=-1)
        return height[r]

    walk(root, 0)
    return height, depth


def chunks(lo: int, hi: int, per: int) -> list[tuple[int, int]]:
    return [(a, min(per, hi - a)) for a in range(lo, hi, per)]


def channel_ranges(count: int, nchannels: int, esize: int) -> list[tuple[int, int]]:
    """An even split of ``count`` elements over the channels, 16-byte aligned (empty tails dropped)."""
    align = max(1, 16 // esize)
    per = -(-count // nchannels)
    per = -(-per // align) * align
    return [(lo, min(count, lo + per)) for lo in range(0, count, per)]


def chunk_elems(proto: str, esize: int, version) -> int:
    """Elements per tree message: one step's data (LL 32 KB, LL128 562.5 KB, Simple 512 KB)."""
    return max(1, nv.step_data_bytes(proto, version) // esize)


def pat_rounds(nranks: int) -> list[int]:
    """The distances PAT connects, 1, 2, 4, ... below the rank count."""
    out, mask = [], 1
    while mask < nranks:
        out.append(mask)
        mask <<= 1
    return out
