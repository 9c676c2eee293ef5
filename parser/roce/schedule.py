"""NCCL's ring schedule (2.12-2.32): which bytes each ring position sends, in which message. 2.31 and
2.32 plan as 2.30 (their one change, Simple's thread count on PCI-limited rings, is an input:
nccl_versions.pci_thread_rule).

For one collective per kernel launch on the built-in IB/RoCE transport, a plan lists per
(ring position, channel) the network messages in wire order (``RingStep``), with the element
range, the phase of the data, and the connection step of each message relative to the
collective's first step. Everything follows /work/shared/docs/nccl-ring-schedule.md (the "doc")
sections 2-4; constants come from ``parser.nccl_versions``.

Ring broadcast and ring all-gather are not spelt out in the doc; they were derived from NCCL:
  device loops   v2.18.6-1:src/collectives/device/broadcast.h:13-59, all_gather.h:13-76 (2.12-2.19
                 identical, v2.12.12-1 differs only in names); v2.21.5-1:src/device/broadcast.h:13-48,
                 all_gather.h:13-64 (2.20-2.21); v2.23.4-1:src/device/broadcast.h:13-49,
                 all_gather.h:13-62 and v2.30.7-1:src/device/broadcast.h:14-55, all_gather.h:14-75
                 (2.22-2.30, parts from ncclCollCbdPart, no last-loop shrink);
  bytes, not elements: both run on int8 (count *= esize), all-gather's nBytes is nRanks x the
                 per-rank size: v2.18.6-1:src/include/info.h:63-70, v2.21.5-1:src/include/info.h:78-84,
                 v2.23.4-1:src/enqueue.cc:1912,2279-2284;
  LL last chunk  (2.12-2.19) host lastChunkSize = alignUp(divUp(nBytes mod loop, nc*nchunksPerLoop),
                 nt*8): v2.18.6-1:src/enqueue.cc:1355-1360, pattern sizes at 1264-1267;
  steps          v2.18.6-1:src/enqueue.cc:1371-1377, v2.21.5-1:src/enqueue.cc:187-212,
                 v2.23.4-1:src/enqueue.cc:2076-2079, v2.30.7-1:src/enqueue.cc:2343-2364;
  chunk sizes    v2.21.5-1:src/enqueue.cc:1722-1776 (CBD: no shrink for these collectives, 225-245);
  cells          the all-reduce scheduler with trafficPerByte 1 (broadcast) or nRanks (all-gather),
                 v2.23.4-1:src/enqueue.cc:58-65.
In all versions the position before the root only receives (broadcast), and an all-gather position
sends R-1 chunks per loop: its own, then those of the ranks 1..R-2 hops upstream.

Ring reduce-scatter (v2.18.6-1:src/collectives/device/reduce_scatter.h:13-61) runs the all-gather's
loop on the reduction type: the same chunk and loop sizes (the host counts both as nRanks chunks
per loop of nBytes = count x nRanks x size, v2.18.6-1:src/include/info.h:63-70), and position r
sends at step s the partial sum of chunk (r-s-1) mod R, never a finished one (the owner adds its
own term locally, ../shared/docs/sharded-optimizers.md). Its CBD and cells parts are taken in
bytes as the all-gather's (2.20+ align them in elements of the type: equal for 8-byte-aligned
sizes).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass

from mirrorckpt.parser.placement import FORWARD, OWN, PARTIAL, REDUCED, RingStep
from mirrorckpt.parser.roce import nccl_versions as nv
from mirrorckpt.parser.roce.nccl_versions import (
    ALLGATHER,
    ALLREDUCE,
    BROADCAST,
    CBD,
    CELLS,
    LL,
    LL128,
    LOOP,
    REDUCESCATTER,
    SIMPLE,
    WARP_SIZE,
)
from mirrorckpt.parser.roce.protocols import wire_bytes


def div_up(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return div_up(a, b) * b


# --- messages ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    nchannels: int
    nthreads: int


def select_launch(nbytes: int, nranks: int, comm_channels: int, proto: str, version,
                  max_threads: int | None = None) -> Launch:
    """Channels and threads NCCL gives one ring collective of ``nbytes`` (doc 3.1).

    ``nbytes`` is count*esize (all-gather: x nRanks); ``max_threads`` is maxThreads[RING][proto]
    (default per protocol; NCCL_NTHREADS or a PCI-limited ring lower it)."""
    proto = nv.protocol(proto)
    if comm_channels < 1:
        raise ValueError(f"communicator channel count {comm_channels} is below 1")
    nc = comm_channels
    nt = max_threads if max_threads is not None else nv.max_threads(proto)
    th = nv.thread_threshold(proto, nranks)
    while nbytes < nc * nt * th and nc >= 2:
        nc -= 1
    while nbytes < nc * nt * th and nt % 128 == 0:
        nt //= 2
    if proto == SIMPLE:
        nt += WARP_SIZE  # sync warp of the ring kernel
    nt = max(nt, nv.min_threads(version))
    return Launch(nc, nt)


def conn_step_start(t: int, proto: str, kind: str) -> int:
    """First step of the next collective on a connection whose counter is ``t`` (doc 4.2):
    Simple all-reduce/all-gather/reduce-scatter round up to a multiple of 4, else no rounding."""
    return round_up(t, nv.chunk_steps(proto, kind))


def slot(t: int) -> int:
    return t % nv.NCCL_STEPS


def flag(proto: str, t: int) -> int | None:
    """LL flag ``(t+1) mod 2^32``, LL128 flag ``t+1`` (u64); Simple has none."""
    proto = nv.protocol(proto)
    if proto == LL:
        return (t + 1) & 0xFFFFFFFF
    if proto == LL128:
        return (t + 1) & 0xFFFFFFFFFFFFFFFF
    return None


def message_wire_bytes(proto: str, nbytes: int, t: int, version, arm: bool = False) -> int:
    """Wire size of the message at absolute step ``t``: LL sends the whole slot on the 8 cleanup
    steps of every 2^31 (doc 4.1, v2.18.6-1:src/collectives/device/prims_ll.h:72)."""
    if nv.protocol(proto) == LL and (t & nv.LL_CLEAN_MASK) == nv.LL_CLEAN_MASK:
        return nv.step_bytes(LL, version, arm)
    return wire_bytes(proto, nbytes)


@dataclass(frozen=True)
class RecvSlot:
    slot: int
    offset: int  # of the slot inside the protocol's receive buffer (CTS addr - buffer base)
    alloc_offset: int  # same, inside the connection's one allocation (LL | LL128 | Simple)
    cts_size: int
    flag: int | None


def recv_slot(t: int, proto: str, kind: str, version, arm: bool = False) -> RecvSlot:
    """Where the message at absolute connection step ``t`` lands and what its CTS says (doc 4.3)."""
    step, base, cts = _slot_geometry(proto, kind, version, arm)
    off = slot(t) * step
    return RecvSlot(slot(t), off, base + off, cts, flag(proto, t))


@functools.lru_cache(maxsize=256)
def _slot_geometry(proto: str, kind: str, version, arm: bool) -> tuple[int, int, int]:
    """(slot bytes, protocol buffer offset, CTS size): the state machine asks twice per Simple send,
    and each answer parses and range-checks the release again."""
    return (nv.step_bytes(proto, version, arm), nv.recv_buffer_offset(proto, version, arm),
            nv.cts_size(proto, kind, version, arm))


# --- partitions -------------------------------------------------------------------------------


def cbd_parts(count: int, esize: int, usable: int, align: int) -> list[tuple[int, int, int]]:
    """2.20-2.21: consecutive parts (channel, offset, count) of at most maxBytesPerChannel each
    (v2.21.5-1:src/enqueue.cc:453-489, maxBytesPerChannel at 834)."""
    total = count * esize
    max_bytes = round_up(div_up(total, usable), nv.CBD_BYTES_ALIGN)
    parts, off, left = [], 0, count
    for ch in range(usable):
        if left == 0:
            break
        enq = min(max_bytes, left * esize)
        n = min(round_up(div_up(enq, esize), align), left)
        parts.append((ch, off, n))
        off, left = off + n, left - n
    return parts


def cells_parts(count: int, esize: int, kind: str, nranks: int, task_channels: int, comm_channels: int,
                proto: str, version) -> list[tuple[int, int, int]]:
    """2.22-2.30: the "cells" scheduler for a collective that starts its launch (channelId 0, no
    traffic before it): parts (channel, offset, count), [lo][mid...][hi] (doc 3.4;
    v2.23.4-1:src/enqueue.cc:789-835, v2.30.7-1:src/enqueue.cc:657-699)."""
    if count == 0:
        return []
    r = nv.cells_rules(version)
    tpb = nv.traffic_per_byte(kind, nranks) * (r.ll_traffic_factor if nv.protocol(proto) == LL else 1)
    traffic = count * esize * tpb
    if r.floor_task_traffic:
        traffic = max(r.min_traffic, traffic)
    nch = min(task_channels, comm_channels)
    tpc = round_up(traffic // nch, 16) if r.tpc_rounded else max(r.min_traffic, traffic // nch)
    cell = r.fixed_cell_size or round_up(div_up(r.min_traffic, tpb), 16)
    epc = cell // esize
    cells = div_up(count * esize, cell)
    tpcell = cell * tpb
    cpc = min(cells, div_up(tpc, tpcell))
    if comm_channels == 1:
        lo = cells
    else:
        lo = min(cells, div_up(tpc, tpcell) if r.lo_rounds_up else tpc // tpcell)
    mid, hi = (cells - lo) // cpc, (cells - lo) % cpc
    if comm_channels < (lo != 0) + mid + (hi != 0):  # overflowed the communicator's channels
        mid = comm_channels - 2
        cpc = (cells - lo) // (mid + 1)
        hi = cpc + (cells - lo) % (mid + 1)
    if hi == 0 and mid != 0:
        hi, mid = cpc, mid - 1
    first = 0
    if lo == 0:  # 2.22 floor can leave channel 0 empty: the next channel becomes "lo"
        first = 1
        if mid == 0:
            lo, hi = hi, 0
        else:
            lo, mid = cpc, mid - 1
    count_lo, count_mid, count_hi = lo * epc, (cpc * epc if mid else 0), hi * epc
    excess = cells * epc - count
    if count_hi:
        count_hi -= excess
    else:
        count_lo -= excess
    parts = [(first, 0, count_lo)] if count_lo else []
    for i in range(mid):
        parts.append((first + 1 + i, count_lo + i * count_mid, count_mid))
    if hi:
        parts.append((first + 1 + mid, count_lo + mid * count_mid, count_hi))
    return parts


# --- plans ------------------------------------------------------------------------------------


class RingPlan(ABC):
    """Messages of one ring collective, per (ring position, channel). Built by the *_plan functions."""

    kind: str

    def __init__(self, count: int, esize: int, nranks: int, comm_channels: int, proto: str, version,
                 launch: Launch, work: dict[int, list], parts: dict[int, int], arm: bool):
        self.count, self.esize, self.nranks = count, esize, nranks
        self.comm_channels = comm_channels
        self.protocol = nv.protocol(proto)
        self.version = nv.version(version)
        self.launch = launch
        self.arm = arm
        self._work = work  # channel -> per loop: the loop's chunk(s) as (offset, nelem)
        self._parts = parts  # channel -> its part's size (CBD, cells; NCCL's unit) for proxy_steps
        self._cache: dict[tuple[int, int], list[RingStep]] = {}
        self._at: dict[tuple[int, int], dict[int, tuple[int, RingStep]]] = {}

    @property
    def nchannels(self) -> int:
        """Channels NCCL selected for this collective (doc 3.1)."""
        return self.launch.nchannels

    @property
    def nthreads(self) -> int:
        return self.launch.nthreads

    @property
    def channels(self) -> list[int]:
        """Channels that carry messages (possibly only 0-byte ones)."""
        return sorted(ch for ch, loops in self._work.items() if loops)

    def loops(self, channel: int) -> list:
        return self._work.get(channel, [])

    def _check(self, rank_pos: int) -> None:
        if not 0 <= rank_pos < self.nranks:
            raise ValueError(f"ring position {rank_pos} is outside 0..{self.nranks - 1}")

    def messages(self, rank_pos: int, channel: int) -> list[RingStep]:
        """Network messages ring position ``rank_pos`` sends on ``channel``, in wire order
        (cached: do not modify the list)."""
        self._check(rank_pos)
        key = (rank_pos, channel)
        if key not in self._cache:
            self._cache[key] = self._build(rank_pos, channel)
        return self._cache[key]

    def message_index(self, rank_pos: int, channel: int, conn_step: int) -> int | None:
        """Index in ``messages(rank_pos, channel)`` of the message at ``conn_step``, None if no
        message starts there. Each message has its own step (op * chunkSteps + slice * sliceSteps)."""
        hit = self.message_at(rank_pos, channel, conn_step)
        return None if hit is None else hit[0]

    def message_at(self, rank_pos: int, channel: int, conn_step: int) -> tuple[int, RingStep] | None:
        """(``message_index``, the message) from one lookup: the state machine asks once per send."""
        return self.steps_at(rank_pos, channel).get(conn_step)

    def steps_at(self, rank_pos: int, channel: int) -> dict[int, tuple[int, RingStep]]:
        """``message_at``'s table: connection step -> (index, message) (cached: do not modify)."""
        at = self._at.get((rank_pos, channel))
        if at is None:
            at = self._at[(rank_pos, channel)] = {st.conn_step: (k, st)
                                                  for k, st in enumerate(self.messages(rank_pos, channel))}
        return at

    def conn_steps(self, channel: int, rank_pos: int = 0) -> int:
        """How far the collective advances the step counter of connection rank_pos -> rank_pos+1."""
        msgs = self.messages(rank_pos, channel)
        return msgs[-1].conn_step + nv.slice_steps(self.protocol, self.kind) if msgs else 0

    def _slices(self, n: int) -> list[int]:
        """Pieces of a chunk of ``n`` kernel units (elements; bytes for broadcast/all-gather), one
        network message each; Simple: ``max(divUp(n, 16*slicesPerChunk)*16, stepSize*stepsPerSlice/32)``
        per slice (doc 4.1, v2.18.6-1:src/collectives/device/prims_simple.h:185-187)."""
        if self.protocol != SIMPLE:
            return [n]
        per_slice = nv.slice_steps(SIMPLE, self.kind)
        per_chunk = nv.chunk_steps(SIMPLE, self.kind) // per_slice
        step_elems = nv.step_bytes(SIMPLE, self.version, self.arm) // self._unit
        size = max(div_up(n, 16 * per_chunk) * 16, step_elems * per_slice // 32)
        out, done = [], 0
        for _ in range(per_chunk):
            out.append(min(size, n - done))
            done += out[-1]
        return out

    # Element size the kernel runs with: the user's for reductions, 1 for byte-moving collectives.
    @property
    def _unit(self) -> int:
        return self.esize

    def _emit(self, out: list, step: int, loop: int, chunk: int, offset: int, nelem: int, phase: str,
              op: int) -> None:
        """Append the message(s) of chunk operation number ``op`` of this (position, channel)."""
        cs, ss = nv.chunk_steps(self.protocol, self.kind), nv.slice_steps(self.protocol, self.kind)
        unit = self._unit
        for j, n in enumerate(self._slices(nelem * self.esize // unit)):
            nb = n * unit
            out.append(RingStep(step, loop, chunk, offset, nb // self.esize, phase, j, op * cs + j * ss, nb,
                                wire_bytes(self.protocol, nb)))
            offset += nb // self.esize

    @abstractmethod
    def _build(self, rank_pos: int, channel: int) -> list[RingStep]:
        """The collective's step sequence for one (position, channel)."""

    @abstractmethod
    def proxy_steps(self, channel: int, rank_pos: int = 0) -> int:
        """NCCL's host formula for the proxy's step count of connection rank_pos -> rank_pos+1."""


class AllReducePlan(RingPlan):
    kind = ALLREDUCE

    def _build(self, r: int, channel: int) -> list[RingStep]:
        R, out, op = self.nranks, [], 0
        for li, chunks in enumerate(self.loops(channel)):
            for s in range(2 * R - 2):  # doc 2.1
                c = (r - s - 1) % R
                phase = OWN if s == 0 else PARTIAL if s <= R - 2 else REDUCED
                off, n = chunks[c]
                self._emit(out, s, li, c, off, n, phase, op)
                op += 1
        return out

    def proxy_steps(self, channel: int, rank_pos: int = 0) -> int:
        """NCCL's proxy step count for this channel, from the host formulas (doc 3.2-3.4)."""
        R, cs, esize = self.nranks, nv.chunk_steps(self.protocol, ALLREDUCE), self.esize
        C = nv.chunk_bytes(self.protocol, ALLREDUCE, self.version, self.arm)
        fam = nv.chunk_family(self.version)
        if fam == LOOP:
            if channel not in self._work:
                return 0
            return 2 * (R - 1) * div_up(self.count * esize, self.nchannels * R * C) * cs
        part = self._parts.get(channel)
        if part is None:
            return 0
        if fam == CELLS:
            grain = nv.cells_grain(self.protocol)
            C = C // grain * grain
        return 2 * (R - 1) * div_up(part * esize, R * C) * cs

    def missing_chunk_ranges(self, rank_pos: int, channel: int) -> list[tuple[int, int]]:
        """Element ranges [(offset, nelem)] whose final value ``rank_pos``'s egress on ``channel``
        does not carry: chunk (r+1) mod R of every loop (doc 2.1)."""
        self._check(rank_pos)
        c = (rank_pos + 1) % self.nranks
        return [chunks[c] for chunks in self.loops(channel) if chunks[c][1] > 0]

    def chunk_ranges(self, channel: int) -> list[tuple[int, int, int]]:
        """(chunk index, offset, nelem) of every non-empty chunk of ``channel``, loop by loop."""
        return [(c, off, n) for chunks in self.loops(channel) for c, (off, n) in enumerate(chunks) if n > 0]


class _BytePlan(RingPlan):
    """Broadcast and all-gather move bytes: NCCL runs them on int8 (count *= esize)."""

    @property
    def _unit(self) -> int:
        return 1

    def proxy_steps(self, channel: int, rank_pos: int = 0) -> int:
        self._check(rank_pos)
        if not self._sends(rank_pos):
            return 0
        R, cs = self.nranks, nv.chunk_steps(self.protocol, self.kind)
        C = nv.chunk_bytes(self.protocol, self.kind, self.version, self.arm)
        per_loop = R - 1 if self.kind in (ALLGATHER, REDUCESCATTER) else 1
        if nv.chunk_family(self.version) == LOOP:
            if channel not in self._work:
                return 0
            return per_loop * div_up(self.count * self.esize, self.nchannels * C) * cs
        part = self._parts.get(channel)
        if part is None:
            return 0
        if nv.chunk_family(self.version) == CELLS:
            grain = nv.cells_grain(self.protocol)
            C = C // grain * grain
        return per_loop * div_up(part, C) * cs

    def _sends(self, rank_pos: int) -> bool:
        return True


class BroadcastPlan(_BytePlan):
    kind = BROADCAST

    def __init__(self, *args, root: int = 0, **kw):
        super().__init__(*args, **kw)
        self.root = root

    def _sends(self, r: int) -> bool:
        return (r - self.root) % self.nranks != self.nranks - 1  # the root's upstream neighbour only receives

    def _build(self, r: int, channel: int) -> list[RingStep]:
        if not self._sends(r):
            return []
        phase = OWN if r == self.root else FORWARD
        out = []
        for li, (off, n) in enumerate(self.loops(channel)):
            self._emit(out, 0, li, self.root, off, n, phase, li)
        return out


class AllGatherPlan(_BytePlan):
    kind = ALLGATHER

    def _build(self, r: int, channel: int) -> list[RingStep]:
        R, out, op = self.nranks, [], 0
        for li, (off, n) in enumerate(self.loops(channel)):
            for s in range(R - 1):  # own data first, then that of the rank s hops upstream
                self._emit(out, s, li, (r - s) % R, off, n, OWN if s == 0 else FORWARD, op)
                op += 1
        return out


class ReduceScatterPlan(_BytePlan):
    """The all-gather's chunking (in bytes) on the reduction type: a message's ``chunk`` is the
    ring position whose output it adds to, its ``offset`` inside that position's part."""

    kind = REDUCESCATTER

    @property
    def _unit(self) -> int:
        return self.esize

    def _build(self, r: int, channel: int) -> list[RingStep]:
        R, out, op = self.nranks, [], 0
        for li, (off, n) in enumerate(self.loops(channel)):
            for s in range(R - 1):  # own input first, then partial sums of s+1 inputs
                self._emit(out, s, li, (r - s - 1) % R, off, n, OWN if s == 0 else PARTIAL, op)
                op += 1
        return out


# --- chunking, per family ---------------------------------------------------------------------


def _clamp(off: int, real: int, end: int) -> tuple[int, int]:
    return off, max(0, min(real, end - off))


def _allreduce_work(count, esize, R, launch, comm_channels, proto, v, arm):
    """channel -> loops -> R chunks (offset, nelem); and channel -> part size (CBD/cells)."""
    nc, nt = launch.nchannels, launch.nthreads
    C = nv.chunk_bytes(proto, ALLREDUCE, v, arm) // esize
    fam = nv.chunk_family(v)
    work, parts = {}, {}
    if fam == LOOP:  # doc 3.2
        if proto == LL:
            min_chunk = nt * (nv.bytes_per_grain(LL) // esize)
        elif proto == LL128:
            min_chunk = nt * (nv.bytes_per_grain(LL128) // esize) // 2
        loop_size = nc * R * C
        for bid in range(nc):
            work[bid] = []
        for grid in range(0, count, loop_size):
            if proto == SIMPLE:
                real = round_up(min(C, div_up(count - grid, nc * R)), (nt - WARP_SIZE) * 8 // esize)
            else:
                real = min(C, div_up(count - grid, nc * R * min_chunk) * min_chunk)
            for bid in range(nc):
                if proto == SIMPLE:  # each channel one contiguous block
                    offs = [grid + bid * R * real + c * real for c in range(R)]
                else:  # channels interleave chunk by chunk
                    offs = [grid + (c * nc + bid) * real for c in range(R)]
                work[bid].append([_clamp(o, real, count) for o in offs])
        return work, parts
    if fam == CBD:  # doc 3.3: the host's lastChunkCount, aligned like the part
        align = nv.cbd_align_count(proto, esize, nt)
        plist = cbd_parts(count, esize, nc, align)
    else:  # doc 3.4: the device shrinks the last loop to 16-byte multiples
        align = max(1, nv.CELLS_LAST_CHUNK_ALIGN // esize)
        plist = cells_parts(count, esize, ALLREDUCE, R, nc, comm_channels, proto, v)
        grain = nv.cells_grain(proto)
        C = nv.chunk_bytes(proto, ALLREDUCE, v, arm) // grain * (grain // esize)
    for ch, poff, pcount in plist:
        parts[ch] = pcount
        loops = work.setdefault(ch, [])
        for elem in range(0, pcount, R * C):
            rem = pcount - elem
            if rem >= R * C:
                chunk = C
            else:  # CBD: rem == pcount % (R*C) here, as the host computes it
                chunk = round_up(div_up(rem, R), align)
            loops.append([_clamp(poff + elem + c * chunk, chunk, poff + pcount) for c in range(R)])
    return work, parts


def _byte_work(size, kind, R, launch, comm_channels, proto, v, arm):
    """Broadcast/all-gather in bytes: channel -> loops -> (offset, nbytes); channel -> part bytes."""
    nc, nt = launch.nchannels, launch.nthreads
    C = nv.chunk_bytes(proto, kind, v, arm)
    per_rank = kind in (ALLGATHER, REDUCESCATTER)
    nchunks = R if per_rank else 1  # chunks per loop in NCCL's host accounting
    fam = nv.chunk_family(v)
    work, parts = {}, {}
    if fam == LOOP:
        loop_size = nc * C
        if proto == LL:  # host lastChunkSize
            host_loop = nc * nchunks * C
            last = round_up(div_up(size * nchunks % host_loop, nc * nchunks), nt * 8)
        elif proto == LL128:
            min_chunk = nt * nv.bytes_per_grain(LL128) // (2 if per_rank else 1)
        for bid in range(nc):
            work[bid] = []
        for grid in range(0, size, loop_size):
            if proto == SIMPLE:
                real = round_up(min(C, div_up(size - grid, nc)), (nt - WARP_SIZE) * 8)
            elif proto == LL:
                real = last if size - grid < loop_size else C
            else:
                real = min(C, div_up(size - grid, nc * min_chunk) * min_chunk)
            for bid in range(nc):
                work[bid].append(_clamp(grid + bid * real, real, size))
        return work, parts
    if fam == CBD:
        plist = cbd_parts(size, 1, nc, nv.cbd_align_count(proto, 1, nt))
    else:
        plist = cells_parts(size, 1, kind, R, nc, comm_channels, proto, v)
        grain = nv.cells_grain(proto)
        C = C // grain * grain
    for ch, poff, pcount in plist:
        parts[ch] = pcount
        work[ch] = [(poff + e, min(C, pcount - e)) for e in range(0, pcount, C)]
    return work, parts


def _to_elements(work: dict, esize: int) -> dict:
    """Byte ranges -> element ranges (NCCL's byte chunks are multiples of 8 bytes)."""
    out = {}
    for ch, loops in work.items():
        for off, n in loops:
            if off % esize or n % esize:
                raise AssertionError(f"byte chunk ({off}, {n}) of channel {ch} splits a {esize}-byte element")
        out[ch] = [(off // esize, n // esize) for off, n in loops]
    return out


def _check_args(count, esize, nranks, nchannels):
    if count < 0:
        raise ValueError(f"element count {count} is negative")
    if esize not in (1, 2, 4, 8):
        raise ValueError(f"element size {esize} is not 1, 2, 4 or 8 bytes")
    if nranks < 2:
        raise ValueError(f"a ring needs at least 2 ranks, not {nranks}")
    if nchannels < 1:
        raise ValueError(f"communicator channel count {nchannels} is below 1")


def allreduce_plan(count: int, esize: int, nranks: int, nchannels: int, protocol: str, version,
                   nthreads: int | None = None, *, arm: bool = False) -> AllReducePlan:
    """Ring all-reduce of ``count`` elements of ``esize`` bytes on a communicator of ``nchannels``
    channels. ``nthreads`` = maxThreads[RING][protocol] if not the default (doc 3.1)."""
    _check_args(count, esize, nranks, nchannels)
    proto, v = nv.protocol(protocol), nv.version(version)
    launch = select_launch(count * esize, nranks, nchannels, proto, v, nthreads)
    work, parts = _allreduce_work(count, esize, nranks, launch, nchannels, proto, v, arm)
    return AllReducePlan(count, esize, nranks, nchannels, proto, v, launch, work, parts, arm)


def broadcast_plan(count: int, esize: int, nranks: int, nchannels: int, protocol: str, version,
                   root: int = 0, nthreads: int | None = None, *, arm: bool = False) -> BroadcastPlan:
    """Ring broadcast from ring position ``root`` (global rank 0 is position 0, doc 2.4)."""
    _check_args(count, esize, nranks, nchannels)
    if not 0 <= root < nranks:
        raise ValueError(f"broadcast root position {root} is outside 0..{nranks - 1}")
    proto, v = nv.protocol(protocol), nv.version(version)
    size = count * esize
    launch = select_launch(size, nranks, nchannels, proto, v, nthreads)
    work, parts = _byte_work(size, BROADCAST, nranks, launch, nchannels, proto, v, arm)
    return BroadcastPlan(count, esize, nranks, nchannels, proto, v, launch, _to_elements(work, esize), parts,
                         arm, root=root)


def allgather_plan(count_per_rank: int, esize: int, nranks: int, nchannels: int, protocol: str, version,
                   nthreads: int | None = None, *, arm: bool = False) -> AllGatherPlan:
    """Ring all-gather of ``count_per_rank`` elements from every rank. Message offsets are inside
    the origin's contribution; its place in the output is ``rank_of(chunk) * count_per_rank``."""
    return _per_rank_plan(AllGatherPlan, count_per_rank, esize, nranks, nchannels, protocol, version, nthreads, arm)


def _per_rank_plan(cls, count_per_rank, esize, nranks, nchannels, protocol, version, nthreads, arm):
    """An all-gather or reduce-scatter plan: ``count_per_rank`` elements per rank, chunked in bytes."""
    _check_args(count_per_rank, esize, nranks, nchannels)
    proto, v = nv.protocol(protocol), nv.version(version)
    size = count_per_rank * esize
    launch = select_launch(size * nranks, nranks, nchannels, proto, v, nthreads)
    work, parts = _byte_work(size, cls.kind, nranks, launch, nchannels, proto, v, arm)
    return cls(count_per_rank, esize, nranks, nchannels, proto, v, launch, _to_elements(work, esize), parts, arm)


def reducescatter_plan(count_per_rank: int, esize: int, nranks: int, nchannels: int, protocol: str, version,
                       nthreads: int | None = None, *, arm: bool = False) -> ReduceScatterPlan:
    """Ring reduce-scatter of ``count_per_rank`` output elements per rank (see the module text)."""
    return _per_rank_plan(ReduceScatterPlan, count_per_rank, esize, nranks, nchannels, protocol, version, nthreads,
                          arm)
