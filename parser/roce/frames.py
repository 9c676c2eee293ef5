"""Vectorised RoCEv2 decode: a FrameBatch in, one row per RoCE packet out.

The compiled walk (``_fast.decode_frames``) reads each frame once, through a mirror encapsulation
(ERSPAN, GRE, VXLAN: ``parser.encap``) to the RoCEv2 packet; a frame too short for the next header
drops out (counted as malformed) and nothing reads past a frame's captured bytes. Non-RoCE frames
are only classified and counted (ARP, LLDP, STP, PTP, TCP, other UDP...).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.config.encap import EncapSpec
from mirrorckpt.parser import encap, memory
from mirrorckpt.parser.roce import _fast, opcodes
from mirrorckpt.parser.roce.protocols import LL_INTACT_ARGS

# The RoCEv2 decode's copy of the compiled walk: the header tables' offsets, and which extended
# headers follow the BTH of each opcode.
_fast.configure(encap.WALK_OFFSETS, opcodes.HAS_RETH.astype(np.uint8), opcodes.HAS_IMMDT.astype(np.uint8),
                opcodes.HAS_AETH.astype(np.uint8), opcodes.HAS_DETH.astype(np.uint8))


@dataclass
class Counters:
    """What a decode saw; adds up across batches."""

    frames: int = 0
    truncated_frames: int = 0
    bytes: int = 0
    classes: Counter = field(default_factory=Counter)  # "arp", "tcp", "roce:RC_ACKNOWLEDGE", ...
    icrc: Counter = field(default_factory=Counter)  # "RC_RDMA_WRITE_FIRST:ok", "0xaa:BAD"
    malformed: Counter = field(default_factory=Counter)  # reason -> frames
    # encapsulations taken off, mirror sessions' loss, frames the switch cut (kept across batches)
    mirror: encap.MirrorHealth = field(default_factory=encap.MirrorHealth)

    def add(self, other: Counters) -> None:
        self.frames += other.frames
        self.truncated_frames += other.truncated_frames
        self.bytes += other.bytes
        self.classes.update(other.classes)
        self.icrc.update(other.icrc)
        self.malformed.update(other.malformed)
        self.mirror.merge(other.mirror)

    @property
    def icrc_failed(self) -> int:
        return sum(n for k, n in self.icrc.items() if k.endswith(":BAD"))

    def by_opcode(self) -> dict[str, int]:
        return {k[5:]: n for k, n in sorted(self.classes.items()) if k.startswith("roce:")}


@dataclass
class RocePackets:
    """One row per RoCEv2 packet of a batch (struct of arrays)."""

    frame: np.ndarray  # index of the frame in the batch
    ts_ns: np.ndarray
    src: np.ndarray  # (N, 16) uint8, IPv4 as mapped IPv6
    dst: np.ndarray
    sport: np.ndarray  # UDP source port: pairs both directions of a QP pair
    opcode: np.ndarray
    pad: np.ndarray  # BTH PadCnt
    dqp: np.ndarray
    psn: np.ndarray
    ackreq: np.ndarray
    va: np.ndarray  # RETH, 0 when absent
    rkey: np.ndarray
    dlen: np.ndarray
    has_reth: np.ndarray
    has_imm: np.ndarray
    imm_raw: np.ndarray  # ImmDt read big-endian (IBTA); NCCL's meaning: nccl_versions.decode_imm
    syndrome: np.ndarray  # AETH, 0 when absent
    msn: np.ndarray
    pay_off: np.ndarray  # absolute offset of the payload in batch.data
    pay_len: np.ndarray
    icrc_ok: np.ndarray
    # decode(ll=True): each WRITE payload's LL flag (0: not intact LL) and, for the whole batch,
    # the LL data words of those payloads at llu[pay_off // 2] (see _fast.decode_frames)
    llf: np.ndarray | None = None
    llu: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.frame.shape[0])

    def take(self, idx: np.ndarray) -> RocePackets:
        return RocePackets(**{k: v[idx] if k != "llu" and v is not None else v for k, v in self.__dict__.items()})

    @staticmethod
    def concat(parts: list[RocePackets]) -> RocePackets:
        keys = [k for k in RocePackets.__dataclass_fields__ if k not in ("llf", "llu")]
        # the parts' LL readings index their own batches: not carried over
        return RocePackets(**{k: np.concatenate([getattr(p, k) for p in parts]) for k in keys})


# The CRC-32 the compiled ICRC check was built with: "isa-l", or "zlib" when setup.py did not find
# ISA-L (libisal-dev); zlib's costs most of the packet path's time on long payloads (BENCHMARKS.md).
ICRC_BACKEND: str = _fast.ICRC_BACKEND
SLOW_ICRC: str | None = None if ICRC_BACKEND == "isa-l" else (
    f"the ICRC check runs on {ICRC_BACKEND}'s crc32, several times slower than ISA-L's: install libisal-dev "
    "(tools/install-system-deps.sh libisal-dev) and run `make build`, which rebuilds on it")


def decode(batch: FrameBatch, icrc: bool = True, into: Counters | None = None,
           ll: bool = False, encapsulation: EncapSpec | None = None) -> tuple[RocePackets, Counters]:
    """Decodes the RoCEv2 packets of ``batch``; returns them with the batch's counters (added to
    ``into`` and returned as it, when given: a stream's running counts, without a merge per batch,
    and the sequence numbers of its mirror sessions followed from batch to batch).
    ``ll``: each WRITE payload is also read as LL while the ICRC has it in cache (``llf``, ``llu``).
    ``encapsulation``: the mirror encapsulations taken off (None: whichever a frame carries)."""
    n = len(batch)
    c = into if into is not None else Counters()
    c.frames += n
    c.bytes += batch.nbytes
    i64 = lambda: np.empty(n, np.int64)  # noqa: E731
    u8 = lambda: np.empty(n, np.uint8)  # noqa: E731
    cols = dict(frame=i64(), src=np.empty((n, 16), np.uint8), dst=np.empty((n, 16), np.uint8),
                sport=i64(), opcode=i64(), pad=i64(), dqp=i64(), psn=i64(), ackreq=u8(),
                va=np.empty(n, np.uint64), rkey=i64(), dlen=i64(), has_reth=u8(), has_imm=u8(),
                imm_raw=i64(), syndrome=i64(), msn=i64(), pay_off=i64(), pay_len=i64(), icrc_ok=u8())
    classes = np.zeros(len(_fast.CLASSES), np.int64)
    other = np.empty(n, np.int64)
    data = batch.data if batch.data.flags.c_contiguous else np.ascontiguousarray(batch.data)
    llf = np.empty(n if ll else 0, np.uint32)
    llu = _LL_WORDS.empty(len(data) // 2) if ll else np.empty(0, np.uint8)
    r, no = _fast.decode_frames(
        data, np.ascontiguousarray(batch.offset, np.int64), np.ascontiguousarray(batch.caplen, np.int64),
        np.ascontiguousarray(batch.wirelen, np.int64), batch.ethernet_mask().view(np.uint8), icrc,
        *cols.values(), classes, other, _IS_WRITE, llu, llf, *LL_INTACT_ARGS,
        encap.table(encapsulation), *c.mirror.state())
    c.mirror.cut += int(classes[_MIRROR_CUT])
    for name, k in zip(_fast.CLASSES, classes.tolist()):
        if not k or name in ("roce", "ethertype_other"):
            continue
        if name.startswith("malformed:"):
            c.malformed[name[10:]] += k
        else:
            c.classes[name] += k
    c.truncated_frames += int(classes[_fast.CLASSES.index("truncated")])
    if no:
        vals, counts = np.unique(other[:no], return_counts=True)
        for v, k in zip(vals.tolist(), counts.tolist()):
            c.classes[f"ethertype_0x{v:04x}"] += k
    for k in ("ackreq", "has_reth", "has_imm", "icrc_ok"):
        cols[k] = cols[k].view(bool)
    pk = RocePackets(ts_ns=batch.ts_ns[cols["frame"][:r]], **{k: v[:r] for k, v in cols.items()},
                     llf=llf[:r] if ll else None, llu=llu if ll else None)
    _count_roce(c, pk.opcode, pk.icrc_ok, icrc)
    return pk, c


def _count_roce(c: Counters, op: np.ndarray, icrc_ok: np.ndarray, checked: bool) -> None:
    counts = np.bincount(op * 2 + icrc_ok, minlength=512)  # opcode x ICRC verdict, no sort
    for v in np.flatnonzero(counts).tolist():
        k = int(counts[v])
        c.classes[_ROCE_CLASS[v]] += k
        if checked:
            c.icrc[_ICRC_CLASS[v]] += k


# Counter keys per opcode x ICRC verdict (the index _count_roce counts), made once
_IS_WRITE = opcodes.IS_WRITE.view(np.uint8)  # whose payloads decode(ll=True) reads as LL
_MIRROR_CUT = _fast.CLASSES.index("mirror_truncated")
# decode(ll=True)'s words: a pool of their own. Taken from the one of run and result buffers, they
# held its free mappings (untouched where the traffic is not LL), and those buffers were mapped
# and faulted in anew (a Simple replay's system time and RSS grew).
_LL_WORDS = memory.Buffers()
_ROCE_CLASS = [f"roce:{opcodes.name(v // 2)}" for v in range(512)]
_ICRC_CLASS = [f"{opcodes.name(v // 2)}:{'ok' if v % 2 else 'BAD'}" for v in range(512)]
