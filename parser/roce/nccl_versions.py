"""Every NCCL constant the appliance depends on, with the versions it holds for and its source.

One fact, one place: the schedule (``parser.schedule``), the payload codecs (``parser.protocols``),
the NCCL decoder and the traffic generator read NCCL's numbers only from here. Sources are
``tag:path:lines`` in NVIDIA/nccl as given by /work/shared/docs/nccl-ring-schedule.md (the "doc");
facts read from the NCCL source directly (not in the doc) say so. 2.31 and 2.32 (no tags in the
mirror: release commits v2.31.2-1 889806836097, v2.32.3-1 12df1a11afad, and branch ``dev`` at
2.31.0a7) are as /work/shared/docs/nccl-2.31-2.32.md (the "2.31 doc") reads them: the ring
schedule, the protocols' formats and the CTS entry are 2.30's; Simple keeps 512 threads on a
PCI-limited ring; several NICs of one merged device split a message by per-device weights.

Supported: NCCL 2.12 - 2.32. Versions are compared by (major, minor); a patch level is kept for
display only, since every rule here changes at a minor release.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache, total_ordering

import numpy as np
from mirrorckpt.parser.headers import CTS32, CTS64_V220, CTS64_V224, CTS64_V230, Header

# --- versions ---------------------------------------------------------------------------------

_VERSION_RE = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:-\d+)?$")


_PARSED: dict = {}  # version text -> NcclVersion (NcclVersion.parse)


@total_ordering
@dataclass(frozen=True)
class NcclVersion:
    major: int
    minor: int
    patch: int = 0

    @classmethod
    def parse(cls, text: str | NcclVersion) -> NcclVersion:
        """``"2.18"``, ``"2.18.6"``, ``"2.18.6-1"`` or ``"v2.18.6-1"`` (a git tag)."""
        if isinstance(text, NcclVersion):
            return text
        v = _PARSED.get(text) if isinstance(text, str) else None
        if v is not None:  # release tables compare against version strings once per message
            return v
        m = _VERSION_RE.match(str(text).strip())
        if not m:
            raise ValueError(f"NCCL version {text!r} is not of the form 2.18 or 2.18.6")
        v = cls(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
        if isinstance(text, str) and len(_PARSED) < 4096:
            _PARSED[text] = v
        return v

    @property
    def release(self) -> tuple[int, int]:
        return (self.major, self.minor)

    def __lt__(self, other) -> bool:
        return self.release < NcclVersion.parse(other).release

    def __eq__(self, other) -> bool:
        try:
            return self.release == NcclVersion.parse(other).release
        except ValueError:
            return NotImplemented

    def __hash__(self) -> int:
        return hash(self.release)

    def between(self, first: str, last: str) -> bool:
        """True if ``first <= self <= last`` by minor release (both ends included)."""
        return NcclVersion.parse(first) <= self <= NcclVersion.parse(last)

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}" if self.patch else f"{self.major}.{self.minor}"


OLDEST = NcclVersion(2, 12)
NEWEST = NcclVersion(2, 32)


def version(v: str | NcclVersion) -> NcclVersion:
    """Parse ``v`` and refuse releases whose wire behaviour is not described here."""
    v = NcclVersion.parse(v)
    if not (OLDEST <= v <= NEWEST):
        raise ValueError(f"NCCL {v} is outside the supported range {OLDEST}-{NEWEST}")
    return v


# --- protocols and collectives ----------------------------------------------------------------

LL, LL128, SIMPLE = "LL", "LL128", "Simple"
PROTOCOLS = (LL, LL128, SIMPLE)
# NCCL's default: the protocol is chosen per collective by its tuning model (doc nccl-defaults.md)
AUTO = "auto"
_PROTO_BY_LOWER = {p.lower(): p for p in PROTOCOLS}

ALLREDUCE, ALLGATHER, REDUCESCATTER, BROADCAST = "allreduce", "allgather", "reducescatter", "broadcast"
COLLECTIVES = (ALLREDUCE, ALLGATHER, REDUCESCATTER, BROADCAST)


def protocol(p: str) -> str:
    """Canonical protocol name (``"LL"``, ``"LL128"``, ``"Simple"``); case-insensitive."""
    try:
        return _PROTO_BY_LOWER[str(p).lower()]
    except KeyError:
        raise ValueError(f"NCCL protocol {p!r} is not one of {', '.join(PROTOCOLS)}") from None


def collective(kind: str) -> str:
    if kind not in COLLECTIVES:
        raise ValueError(f"collective {kind!r} is not one of {', '.join(COLLECTIVES)}")
    return kind


# --- 1. buffers, steps, chunks (doc 1.1, 1.2) -------------------------------------------------

# Slots per connection and protocol. v2.18.6-1:src/include/devcomm.h:34, v2.30.7-1:src/include/device.h:26
NCCL_STEPS = 8

# Default connection buffer per protocol, every version; Simple is 1 MiB on ARM CPUs up to 2.18.
# v2.18.6-1:src/init.cc:499-525 (ARM at 503/519), v2.19.4-1:src/init.cc:523-543,
# v2.30.7-1:src/init.cc:810-828
_BUFFER_BYTES = {LL: 8 * 512 * NCCL_STEPS * 16, LL128: 120 * 640 * 8 * NCCL_STEPS, SIMPLE: 4 << 20}
_SIMPLE_BUFFER_ARM_OLD = 1 << 20  # 2.12-2.18 on ARM


def buffer_bytes(proto: str, v: str | NcclVersion, arm: bool = False) -> int:
    """``comm->buffSizes[p]``: 524288 (LL), 4915200 (LL128), 4194304 (Simple)."""
    proto, v = protocol(proto), version(v)
    if proto == SIMPLE and arm and v <= "2.18":
        return _SIMPLE_BUFFER_ARM_OLD
    return _BUFFER_BYTES[proto]


def step_bytes(proto: str, v: str | NcclVersion, arm: bool = False) -> int:
    """Wire bytes of one slot: ``buffSizes[p] / NCCL_STEPS`` (65536, 614400, 524288)."""
    return buffer_bytes(proto, v, arm) // NCCL_STEPS


# LL: one 16-byte line carries 8 data bytes. v2.18.6-1:src/include/devcomm.h:36-49
LL_LINE_BYTES, LL_LINE_DATA = 16, 8
# LL128: 16 u64 per line, 15 of them data; 8 u64 per thread in shared memory.
# v2.18.6-1:src/collectives/device/primitives.h:60-70 (calcBytePerStep/Grain), doc 5.2
LL128_LINE_ELEMS, LL128_DATA_ELEMS, LL128_SHMEM_ELEMS_PER_THREAD = 16, 15, 8
LL128_GROUP_WIRE, LL128_GROUP_DATA = 2048, 1920


def step_data_bytes(proto: str, v: str | NcclVersion, arm: bool = False) -> int:
    """User bytes of one step (device ``calcBytePerStep``): 32768, 576000, 524288.

    v2.18.6-1:src/collectives/device/primitives.h:34-66."""
    s = step_bytes(proto, v, arm)
    proto = protocol(proto)
    if proto == LL:
        return s * LL_LINE_DATA // LL_LINE_BYTES
    if proto == LL128:
        return s // LL128_LINE_ELEMS * LL128_DATA_ELEMS
    return s


def bytes_per_grain(proto: str) -> int:
    """Device ``calcBytePerGrain``: 8 (LL: 8 data bytes per thread), 60 (LL128), 8 (Simple).

    v2.18.6-1:src/collectives/device/primitives.h:38,53,68-70."""
    proto = protocol(proto)
    if proto == LL128:
        return LL128_SHMEM_ELEMS_PER_THREAD * LL128_DATA_ELEMS * 8 // LL128_LINE_ELEMS
    return 8


# Steps per chunk and per slice of the Simple ring kernels (LL/LL128 use 1 and 1).
# v2.18.6-1:src/include/collectives.h:114-121, v2.30.7-1:src/include/collectives.h:19-20
_CHUNK_STEPS = {ALLREDUCE: NCCL_STEPS // 2, ALLGATHER: NCCL_STEPS // 2, REDUCESCATTER: NCCL_STEPS // 2,
                BROADCAST: 1}
_SLICE_STEPS = {ALLREDUCE: NCCL_STEPS // 4, ALLGATHER: NCCL_STEPS // 4, REDUCESCATTER: NCCL_STEPS // 4,
                BROADCAST: 1}


def chunk_steps(proto: str, kind: str) -> int:
    """Connection steps per chunk: 4 for Simple all-reduce/all-gather/reduce-scatter, else 1.

    v2.18.6-1:src/enqueue.cc:1307-1310."""
    return _CHUNK_STEPS[collective(kind)] if protocol(proto) == SIMPLE else 1


def slice_steps(proto: str, kind: str) -> int:
    """Connection steps per network message: 2 for Simple all-reduce/all-gather, else 1."""
    return _SLICE_STEPS[collective(kind)] if protocol(proto) == SIMPLE else 1


def chunk_bytes(proto: str, kind: str, v: str | NcclVersion, arm: bool = False) -> int:
    """Full chunk of one ring step of one channel (doc 1.2): LL 32768, LL128 576000,
    Simple 2 MiB (all-reduce, all-gather) or 512 KiB (broadcast)."""
    return step_data_bytes(proto, v, arm) * chunk_steps(proto, kind)


# LL flag cleanup: 8 steps every 2^31 send the whole slot. v2.18.6-1:src/collectives/device/prims_ll.h:72,88-95
LL_CLEAN_MASK = 0x7FFFFFF8

# --- 3.1 channels and threads per collective --------------------------------------------------

# maxThreads[RING][p]; Simple 256 when ringGraph.bwIntra*nChannels <= PCI_BW, up to 2.30; from 2.31
# Simple is 512 unless NCCL_NTHREADS says otherwise (2.31 doc section 1: v2.31.2-1
# src/tuning/tuning_general.cc:86-89; dev:src/tuning/tuning_general.cc:77).
# v2.18.6-1:src/graph/tuning.cc:121-133, v2.30.7-1:src/graph/tuning.cc:244-257
_MAX_THREADS = {LL: 512, LL128: 640, SIMPLE: 512}
SIMPLE_PCI_THREADS = 256
# threadThresholds: LL 8 (x nRanks for ring), LL128 8, Simple 64.
# v2.18.6-1:src/include/comm.h:32-34, v2.18.6-1:src/graph/tuning.cc:338-345, v2.30.7-1:src/graph/tuning.cc:587-593
_THREAD_THRESHOLD = {LL: 8, LL128: 8, SIMPLE: 64}
WARP_SIZE = 32


def max_threads(proto: str, pci_limited: bool = False) -> int:
    """Default ``maxThreads[RING][p]``: LL 512, LL128 640, Simple 512, or 256 on a PCI-limited ring
    where the release has that rule (``pci_thread_rule``)."""
    proto = protocol(proto)
    return SIMPLE_PCI_THREADS if (proto == SIMPLE and pci_limited) else _MAX_THREADS[proto]


def pci_thread_rule(v: str | NcclVersion) -> bool:
    """Whether a PCI-limited ring runs Simple on 256 threads: up to 2.30 (2.31 doc section 1)."""
    return version(v) <= "2.30"


def thread_threshold(proto: str, nranks: int) -> int:
    """Bytes per thread before another channel/thread is used; ring LL is scaled by nRanks."""
    proto = protocol(proto)
    return _THREAD_THRESHOLD[proto] * (nranks if proto == LL else 1)


def min_threads(v: str | NcclVersion) -> int:
    """Floor of the per-collective thread count: 3 warps from 2.13; 2.12 has none (0).

    Read from the source, not in the doc: v2.12.12-1:src/enqueue.cc:477-484 (no floor),
    v2.13.4-1:src/enqueue.cc:1130, v2.18.6-1:src/enqueue.cc:1219, v2.30.7-1:src/enqueue.cc:2070-2115."""
    return 0 if version(v) <= "2.12" else 3 * WARP_SIZE


# --- 3.2-3.4 chunk families -------------------------------------------------------------------

LOOP, CBD, CELLS = "loop", "cbd", "cells"


def chunk_family(v: str | NcclVersion) -> str:
    """How a collective is cut over channels and chunks.

    loop 2.12-2.19 (v2.18.6-1:src/collectives/device/all_reduce.h:20-93),
    cbd 2.20-2.21 (v2.21.5-1:src/enqueue.cc:431-505,743-870),
    cells 2.22-2.32 (v2.23.4-1:src/enqueue.cc:713-935, v2.30.7-1:src/enqueue.cc:576-857; 2.31 and 2.32
    byte-identical in src/enqueue/enqueue.cc, 2.31 doc section 1)."""
    v = version(v)
    if v <= "2.19":
        return LOOP
    if v <= "2.21":
        return CBD
    return CELLS


# CBD alignment. v2.21.5-1:src/include/enqueue.h:15-18, used at v2.21.5-1:src/enqueue.cc:214-223,834
CBD_LL_ALIGN_PER_THREAD = 8
CBD_LL128_ALIGN_PER_WARP = 480
CBD_SIMPLE_ALIGN = WARP_SIZE * 8 * 16  # 4096 bytes
CBD_BYTES_ALIGN = 16


def cbd_align_count(proto: str, esize: int, nthreads: int) -> int:
    """``computeCollAlignCount`` in elements (v2.21.5-1:src/enqueue.cc:214-223)."""
    proto = protocol(proto)
    if proto == SIMPLE:
        return CBD_SIMPLE_ALIGN // esize
    if proto == LL128:
        return CBD_LL128_ALIGN_PER_WARP // esize * (nthreads // WARP_SIZE)
    return CBD_LL_ALIGN_PER_THREAD // esize * nthreads


# Cells grain per protocol (ncclProtoGrainSize). v2.23.4-1:src/include/device.h:296-301
_CELLS_GRAIN = {LL: 16, LL128: WARP_SIZE * LL128_SHMEM_ELEMS_PER_THREAD // LL128_LINE_ELEMS * LL128_DATA_ELEMS * 8,
                SIMPLE: 512}
# Device last-loop chunk alignment in the cells family: 16 bytes. v2.23.4-1:src/device/all_reduce.h:20-81
CELLS_LAST_CHUNK_ALIGN = 16


def cells_grain(proto: str) -> int:
    """Bytes per grain of the cells scheduler: LL 16, LL128 1920, Simple 512."""
    return _CELLS_GRAIN[protocol(proto)]


@dataclass(frozen=True)
class CellsRules:
    """The knobs of the cells scheduler that changed between 2.22 and 2.30 (doc 3.4; none since)."""
    min_traffic: int  # MinTrafficPerChannel
    fixed_cell_size: int | None  # 2.22: 16 bytes; later derived from min_traffic
    floor_task_traffic: bool  # 2.23+: a task counts at least min_traffic in the plan's sum
    lo_rounds_up: bool  # 2.23+: cellsLo = divUp(...); 2.22: floor
    tpc_rounded: bool  # 2.29+: roundUp(traffic/nch, 16) instead of max(min_traffic, traffic/nch)
    ll_traffic_factor: int  # 2.26+: LL traffic counted 4x


def cells_rules(v: str | NcclVersion) -> CellsRules:
    """v2.22.3-1:src/enqueue.cc:604,614,657,668; v2.23.4-1:src/enqueue.cc:721-735,756,789-835;
    v2.26.2-1:src/enqueue.cc:388,568; v2.29.2-1:src/enqueue.cc:576,609; v2.30.7-1:src/enqueue.cc:583-760."""
    v = version(v)
    if chunk_family(v) != CELLS:
        raise ValueError(f"NCCL {v} does not use the cells scheduler (2.22+)")
    if v <= "2.22":
        return CellsRules(512, 16, False, False, False, 1)
    ll = 4 if v >= "2.26" else 1
    if v <= "2.28":
        return CellsRules(16 << 10, None, True, True, False, ll)
    return CellsRules(32 << 10, None, True, True, True, ll)


def traffic_per_byte(kind: str, nranks: int) -> int:
    """``ncclFuncTrafficPerByte``: all-reduce 2, all-gather/reduce-scatter nRanks, broadcast 1.

    v2.23.4-1:src/enqueue.cc:58-65."""
    kind = collective(kind)
    if kind == ALLREDUCE:
        return 2
    if kind in (ALLGATHER, REDUCESCATTER):
        return nranks
    return 1


# --- 4.3 receive buffers ----------------------------------------------------------------------


def recv_buffer_offset(proto: str, v: str | NcclVersion = NEWEST, arm: bool = False) -> int:
    """Offset of protocol p's buffer in the connection's one allocation: LL 0, LL128 524288,
    Simple 5439488 (buffers back to back in protocol order).

    v2.18.6-1:src/transport/net.cc:740-763, v2.23.4-1:src/transport/net.cc:868-886,
    v2.30.7-1:src/transport/net.cc:1098-1118."""
    proto = protocol(proto)
    off = 0
    for p in PROTOCOLS:
        if p == proto:
            return off
        off += buffer_bytes(p, v, arm)
    raise AssertionError("unreachable")


def cts_size(proto: str, kind: str, v: str | NcclVersion, arm: bool = False) -> int:
    """CTS ``size`` = stepBytes * sliceSteps: 65536 (LL), 614400 (LL128), 1048576 (Simple
    all-reduce/all-gather), 524288 (Simple broadcast). v2.18.6-1:src/transport/net.cc:1083-1116."""
    return step_bytes(proto, v, arm) * slice_steps(proto, kind)


def recv_post_depth(nsubs: int) -> int:
    """Receives (CTS) the proxy posts ahead of the data: ``min(NCCL_STEPS, 16 / nsubs)``, never past
    the collective's last step; changes CTS/data interleaving only
    (v2.18.6-1:src/transport/net.cc:418,924,1074,1085)."""
    if nsubs < 1:
        raise ValueError(f"proxy sub-operation count {nsubs} is below 1")
    return min(NCCL_STEPS, 16 // nsubs)


# --- 6.1 CTS FIFO -----------------------------------------------------------------------------

NET_IB_MAX_RECVS = 8  # entries per FIFO slot. v2.18.6-1:src/transport/net_ib.cc:318,340


def cts_header(v: str | NcclVersion) -> Header:
    """CTS entry layout: 32 B (2.12-2.19), 64 B with rkeys[2] (2.20-2.23), u64 size + rkeys[4]
    (2.24-2.29), rkeys[8] (2.30-2.32).

    v2.18.6-1:src/transport/net_ib.cc:432-439, v2.20.3-1:529-537, v2.24.3-1:910-918,
    v2.30.7-1:src/transport/net_ib/common.h:245-252, dev:src/transport/net_ib/common.h:245-252
    (2.31.0a7), 2.31 doc section 2 (v2.31.2-1 net_ib/common.h, v2.32.3-1 p2p.cc)."""
    v = version(v)
    if v <= "2.19":
        return CTS32
    if v <= "2.23":
        return CTS64_V220
    if v <= "2.29":
        return CTS64_V224
    return CTS64_V230


def cts_fifo_slots(v: str | NcclVersion) -> int:
    """``MAX_REQUESTS``: 64 up to 2.18, 256 from 2.19 (v2.18.6-1:src/include/nccl_net.h:20,
    v2.19.4-1:src/include/nccl_net.h:22)."""
    return 64 if version(v) <= "2.18" else 256


def cts_fifo_stride(v: str | NcclVersion) -> int:
    """Bytes between FIFO slots = 8 entries x entry size: 256 (<= 2.19), 512 (2.20+)."""
    return NET_IB_MAX_RECVS * cts_header(v).size


def cts_fifo_offset(idx, v: str | NcclVersion):
    """Offset from the sender FIFO base of CTS number ``idx`` (1-based; scalar or array)."""
    return ((np.asarray(idx, dtype=np.int64) - 1) % cts_fifo_slots(v)) * cts_fifo_stride(v)


# --- 6.3 split ("adaptive routing") WRITE form ------------------------------------------------

# NCCL_IB_AR_THRESHOLD default. v2.18.6-1:src/transport/net_ib.cc:82, v2.23.4-1:95
AR_THRESHOLD_DEFAULT = 8192


def uses_split_write(v: str | NcclVersion, size: int, link_layer: str = "RoCE",
                     adaptive_routing: bool | None = None, ooo_rq: bool = False, nreqs: int = 1,
                     ar_threshold: int = AR_THRESHOLD_DEFAULT) -> bool:
    """Whether a send goes as bulk WRITE + 0-byte WRITE_WITH_IMM (doc 6.3).

    2.12-2.15: every send above the threshold (v2.12.12-1:src/transport/net_ib.cc:930, v2.15.5-1:969).
    2.16+: only if ``ar`` = NCCL_IB_ADAPTIVE_ROUTING, default on for the IB link layer, off on RoCE
    (v2.16.2-1:src/transport/net_ib.cc:228-229,970; v2.23.4-1:586-587,1755).
    2.30: and not with out-of-order RQ on both sides (v2.30.7-1:src/transport/net_ib/p2p.cc:13-14,131-133)."""
    v = version(v)
    if nreqs > 1:
        return True
    if v <= "2.15":
        ar = True
    elif adaptive_routing is not None:
        ar = bool(adaptive_routing)
    else:
        if link_layer not in ("IB", "RoCE"):
            raise ValueError(f"link layer {link_layer!r} is not 'IB' or 'RoCE'")
        ar = link_layer == "IB"
    if v >= "2.30" and ooo_rq:
        return False
    return ar and size > ar_threshold


# --- 6.4 the immediate ------------------------------------------------------------------------


@lru_cache(maxsize=64)
def _imm_little(v: str | NcclVersion) -> bool:
    return version(v) <= "2.28"


def imm_byte_order(v: str | NcclVersion) -> str:
    """Byte order of the size in ImmDt: host order (little on x86) up to 2.28, big from 2.29.

    v2.28.9-1:src/transport/net_ib.cc:2115 vs v2.29.2-1:src/transport/net_ib/p2p.cc:93."""
    return "little" if _imm_little(v) else "big"


def decode_imm(raw_be_u32, v: str | NcclVersion):
    """Message size from ImmDt read big-endian (``RocePackets.imm_raw``); scalar or array."""
    if isinstance(raw_be_u32, int):  # one message's immediate, per send on the parser's path: no numpy
        raw = raw_be_u32 & 0xFFFFFFFF
        return int.from_bytes(raw.to_bytes(4, "big"), "little") if _imm_little(v) else raw
    raw = np.asarray(raw_be_u32, dtype=np.uint32)
    out = raw.byteswap() if imm_byte_order(v) == "little" else raw
    return int(out) if out.ndim == 0 else out


def imm_is_request_id(v: str | NcclVersion, receiver_side_matching: bool = False) -> bool:
    """2.29.7+: with NCCL_IB_RECEIVER_SIDE_MATCHING_SCHEME=1 (forced by NCCL_IB_OOO_RQ=1 or
    NCCL_IB_RESILIENCY_PORT_FAILOVER=1) the immediate is the 0-based send count, not the size
    (v2.30.7-1:src/transport/net_ib/p2p.cc:120-128, common.cc:66-75). Needs the patch level:
    "2.29" alone counts as 2.29.0."""
    v = version(v)
    return receiver_side_matching and (v.major, v.minor, v.patch) >= (2, 29, 7)


def encode_imm(size: int, v: str | NcclVersion) -> int:
    """ImmDt as a big-endian-read u32 for a message of ``size`` bytes (generator side)."""
    return decode_imm(size & 0xFFFFFFFF, v)  # the swap is its own inverse


# 2.31+: with NCCL_IB_EVENT_BASED_LB=1 (default 0) a receiver WRITEs its port speeds (32 B,
# headers.SPEED_UPDATE, no immediate, another VA and rkey than the CTS FIFO's) to the sender on QP 0
# after a port speed change: a reverse-direction WRITE that is no CTS post. 2.31 doc section 2
# (v2.31.2-1 net_ib/common.cc:26-27, v2.32.3-1 p2p.cc ncclIbPostSpeedUpdateToRemote).
SPEED_UPDATE_SINCE = "2.31"

# --- 6.5 QPs ------------------------------------------------------------------------------------

# NCCL_IB_QPS_PER_CONNECTION default, every version. v2.18.6-1:src/transport/net_ib.cc:495,
# v2.30.7-1:src/transport/net_ib/connect.cc:60
QPS_PER_CONNECTION_DEFAULT = 1


def split_data_on_qps_default(v: str | NcclVersion) -> bool:
    """With several QPs, cut each message over all of them (<= 2.19) or send whole messages
    round-robin (2.20+, NCCL_IB_SPLIT_DATA_ON_QPS=0). v2.18.6-1:src/transport/net_ib.cc:1021-1048,
    v2.21.5-1:1570-1614."""
    return version(v) <= "2.19"


# NCCL_IB_SPLIT_DATA_ON_QPS exists from 2.18 (v2.18.6-1:src/transport/net_ib.cc:1021); before it
# every message is cut over all QPs.
SPLIT_PARAM_SINCE = "2.18"
IB_WRITE_CHUNK_ALIGN = 128  # pieces are multiples of 128 B so LL/LL128 lines stay whole


def qp_piece_bytes(size: int, nqps: int) -> int:
    """Bytes of each QP's piece when a ``size``-byte message is cut over ``nqps`` QPs
    (roundUp(divUp(size, nqps), 128)); the last pieces may be shorter or empty."""
    per_qp = -(-size // nqps)
    return -(-per_qp // IB_WRITE_CHUNK_ALIGN) * IB_WRITE_CHUNK_ALIGN


def data_qp(v: str | NcclVersion, split: bool, nqps: int, msg: int, piece: int = 0) -> int:
    """QP index carrying piece ``piece`` of the connection's message ``msg`` (0-based send count,
    NCCL's fifoHead), one NIC. Split: every message starts on QP 0 (<= 2.28: ``qpIndex`` advances
    once per piece, nqps times per message, v2.18.6-1:src/transport/net_ib.cc:1042, v2.21.5-1:1613;
    2.30: ``(id·nqps + i) % nqps``, v2.30.7-1:src/transport/net_ib/common.h:394), except 2.29
    where it rotates, ``(id + i) % nqps`` (v2.29.7-1:src/transport/net_ib/common.h:326). Whole
    messages: one per QP in turn, ``msg % nqps`` in every version. 2.31 and 2.32 as 2.30 (2.31 doc
    section 2)."""
    if not split:
        return msg % nqps
    if version(v).minor == 29 and version(v).major == 2:
        return (msg + piece) % nqps
    return piece % nqps


# --- algorithms besides the ring -----------------------------------------------------------------

# PAT (all-gather and reduce-scatter to log-distance peers, one rank per node, Simple only) exists
# from 2.23: v2.23.4-1:src/include/nccl_common.h:61, src/graph/tuning.cc:108-110 (NCCL_PAT_ENABLE),
# :179 (Simple only). Read from the source, not in the doc.
PAT_SINCE = "2.23"
# NCCL_ALGO's names (ncclAlgoStr, src/enqueue.cc / src/graph/tuning.cc), matched case-insensitively;
# the variable takes a comma list, '^' to exclude, and from 2.24 "collective:list;..." per collective.
ALGO_NAMES = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")

# --- what the wire tells about the version ------------------------------------------------------

# CTS layouts in version order, with the releases that write them (cts_header).
CTS_LAYOUTS = ((CTS32, "2.12", "2.19"), (CTS64_V220, "2.20", "2.23"), (CTS64_V224, "2.24", "2.29"),
               (CTS64_V230, "2.30", "2.32"))

# One release per run of releases whose ring schedule is the same (chunk_family, cells_rules,
# min_threads, pci_thread_rule): 2.12 | 2.13-2.19 | 2.20-2.21 | 2.22 | 2.23-2.25 | 2.26-2.28 | 2.29 |
# 2.30 | 2.31-2.32.
SCHEDULE_RUNS = (("2.13", "2.19"), ("2.12", "2.12"), ("2.20", "2.21"), ("2.22", "2.22"), ("2.23", "2.25"),
                 ("2.26", "2.28"), ("2.29", "2.29"), ("2.30", "2.30"), ("2.31", "2.32"))


@dataclass(frozen=True)
class WireFamily:
    """What a capture shows about the NCCL release: the CTS layout (None: no CTS seen) and the
    byte order of the immediate (None: no message decided it)."""
    cts: Header | None = None
    imm_order: str | None = None

    def releases(self) -> tuple[NcclVersion, NcclVersion]:
        """The oldest and newest release that write this."""
        lo, hi = OLDEST, NEWEST
        for h, a, b in CTS_LAYOUTS:
            if self.cts is h:
                lo, hi = NcclVersion.parse(a), NcclVersion.parse(b)
        if self.imm_order == "big":
            lo = max(lo, NcclVersion(2, 29))
        elif self.imm_order == "little":
            hi = min(hi, NcclVersion(2, 28))
        return lo, hi

    def candidates(self) -> list[str]:
        """One release per schedule run that the wire allows (the newest of the run that fits),
        most common first; empty when the facts contradict each other."""
        lo, hi = self.releases()
        out = []
        for a, b in SCHEDULE_RUNS:
            a, b = NcclVersion.parse(a), NcclVersion.parse(b)
            if a <= hi and lo <= b:
                out.append(str(min(b, hi)))
        return out

    def contradicts(self, v: str | NcclVersion) -> str | None:
        """Why release ``v`` cannot have written this traffic, or None."""
        v = version(v)
        if self.cts is not None and self.cts is not cts_header(v):
            return (f"CTS entries are {self.cts.size} bytes in the {self.cts.name} layout, but NCCL {v} writes "
                    f"{cts_header(v).size}-byte {cts_header(v).name} entries")
        if self.imm_order is not None and self.imm_order != imm_byte_order(v):
            return f"the immediates are {self.imm_order}-endian, but NCCL {v} writes them {imm_byte_order(v)}-endian"
        return None

    def describe(self) -> str:
        lo, hi = self.releases()
        if lo > hi:
            return "contradictory (no NCCL release writes this CTS layout with this immediate byte order)"
        return f"NCCL {lo}" + (f"-{hi}" if hi != lo else "")


def imm_order_of(raw_be_u32: int, nbytes: int) -> str | None:
    """Byte order under which an immediate reads as ``nbytes`` (None: both or neither do)."""
    raw = raw_be_u32 & 0xFFFFFFFF
    le = int.from_bytes(raw.to_bytes(4, "big"), "little")
    if (raw == nbytes) == (le == nbytes):
        return None
    return "big" if raw == nbytes else "little"


def decode_imm_order(raw_be_u32: int, order: str) -> int:
    raw = raw_be_u32 & 0xFFFFFFFF
    return raw if order == "big" else int.from_bytes(raw.to_bytes(4, "big"), "little")
