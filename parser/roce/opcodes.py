"""The RoCE (InfiniBand BTH) opcode table: names and which extended headers follow the BTH.

IBTA vol. 1, table 38 ("OpCode field"): every RC opcode (SEND, RDMA WRITE, RDMA READ, ACK, the
atomics), the UD SENDs NICs use for congestion-control probes, and the CNP. NCCL's data path is the
RC RDMA WRITE rows; any opcode not listed is counted under its hex code (``0xAA``) and never decoded
as data. The frame walk skips RETH, ImmDt, AETH and DETH to find the payload; AtomicETH,
AtomicAckETH and IETH (``parser.headers``) are left in the payload of opcodes that carry no data
the decoder reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Opcode:
    code: int
    name: str
    reth: bool = False
    immdt: bool = False
    aeth: bool = False
    deth: bool = False
    write: bool = False  # carries RDMA WRITE payload
    first: bool = False  # opens a multi-packet message
    last: bool = False  # closes a message (LAST or ONLY)
    atomic_eth: bool = False  # AtomicETH (CmpSwap, FetchAdd)
    atomic_ack: bool = False  # AtomicAckETH after the AETH
    ieth: bool = False  # IETH (SEND with invalidate)
    kind: str = ""  # what the operation is: "send", "write", "read", "ack", "atomic", "ud", "cnp"


RC_SEND_FIRST = 0x00
RC_SEND_MIDDLE = 0x01
RC_SEND_LAST = 0x02
RC_SEND_LAST_WITH_IMMEDIATE = 0x03
RC_SEND_ONLY = 0x04
RC_SEND_ONLY_WITH_IMMEDIATE = 0x05
RC_RDMA_WRITE_FIRST = 0x06
RC_RDMA_WRITE_MIDDLE = 0x07
RC_RDMA_WRITE_LAST = 0x08
RC_RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x09
RC_RDMA_WRITE_ONLY = 0x0A
RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x0B
RC_RDMA_READ_REQUEST = 0x0C
RC_RDMA_READ_RESPONSE_FIRST = 0x0D
RC_RDMA_READ_RESPONSE_MIDDLE = 0x0E
RC_RDMA_READ_RESPONSE_LAST = 0x0F
RC_RDMA_READ_RESPONSE_ONLY = 0x10
RC_ACKNOWLEDGE = 0x11
RC_ATOMIC_ACKNOWLEDGE = 0x12
RC_CMP_SWAP = 0x13
RC_FETCH_ADD = 0x14
RC_SEND_LAST_WITH_INVALIDATE = 0x16
RC_SEND_ONLY_WITH_INVALIDATE = 0x17
UD_SEND_ONLY = 0x64
UD_SEND_ONLY_WITH_IMMEDIATE = 0x65
CNP = 0x81

TABLE: dict[int, Opcode] = {o.code: o for o in [
    Opcode(RC_SEND_FIRST, "RC_SEND_FIRST", first=True, kind="send"),
    Opcode(RC_SEND_MIDDLE, "RC_SEND_MIDDLE", kind="send"),
    Opcode(RC_SEND_LAST, "RC_SEND_LAST", last=True, kind="send"),
    Opcode(RC_SEND_LAST_WITH_IMMEDIATE, "RC_SEND_LAST_WITH_IMMEDIATE", immdt=True, last=True, kind="send"),
    Opcode(RC_SEND_ONLY, "RC_SEND_ONLY", first=True, last=True, kind="send"),
    Opcode(RC_SEND_ONLY_WITH_IMMEDIATE, "RC_SEND_ONLY_WITH_IMMEDIATE", immdt=True, first=True, last=True,
           kind="send"),
    Opcode(RC_RDMA_WRITE_FIRST, "RC_RDMA_WRITE_FIRST", reth=True, write=True, first=True, kind="write"),
    Opcode(RC_RDMA_WRITE_MIDDLE, "RC_RDMA_WRITE_MIDDLE", write=True, kind="write"),
    Opcode(RC_RDMA_WRITE_LAST, "RC_RDMA_WRITE_LAST", write=True, last=True, kind="write"),
    Opcode(RC_RDMA_WRITE_LAST_WITH_IMMEDIATE, "RC_RDMA_WRITE_LAST_WITH_IMMEDIATE", immdt=True, write=True, last=True,
           kind="write"),
    Opcode(RC_RDMA_WRITE_ONLY, "RC_RDMA_WRITE_ONLY", reth=True, write=True, first=True, last=True, kind="write"),
    Opcode(RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE, "RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE", reth=True, immdt=True,
           write=True, first=True, last=True, kind="write"),
    Opcode(RC_RDMA_READ_REQUEST, "RC_RDMA_READ_REQUEST", reth=True, kind="read"),
    Opcode(RC_RDMA_READ_RESPONSE_FIRST, "RC_RDMA_READ_RESPONSE_FIRST", aeth=True, first=True, kind="read"),
    Opcode(RC_RDMA_READ_RESPONSE_MIDDLE, "RC_RDMA_READ_RESPONSE_MIDDLE", kind="read"),
    Opcode(RC_RDMA_READ_RESPONSE_LAST, "RC_RDMA_READ_RESPONSE_LAST", aeth=True, last=True, kind="read"),
    Opcode(RC_RDMA_READ_RESPONSE_ONLY, "RC_RDMA_READ_RESPONSE_ONLY", aeth=True, first=True, last=True, kind="read"),
    Opcode(RC_ACKNOWLEDGE, "RC_ACKNOWLEDGE", aeth=True, kind="ack"),
    Opcode(RC_ATOMIC_ACKNOWLEDGE, "RC_ATOMIC_ACKNOWLEDGE", aeth=True, atomic_ack=True, kind="atomic"),
    Opcode(RC_CMP_SWAP, "RC_CMP_SWAP", atomic_eth=True, kind="atomic"),
    Opcode(RC_FETCH_ADD, "RC_FETCH_ADD", atomic_eth=True, kind="atomic"),
    Opcode(RC_SEND_LAST_WITH_INVALIDATE, "RC_SEND_LAST_WITH_INVALIDATE", ieth=True, last=True, kind="send"),
    Opcode(RC_SEND_ONLY_WITH_INVALIDATE, "RC_SEND_ONLY_WITH_INVALIDATE", ieth=True, first=True, last=True,
           kind="send"),
    Opcode(UD_SEND_ONLY, "UD_SEND_ONLY", deth=True, kind="ud"),
    Opcode(UD_SEND_ONLY_WITH_IMMEDIATE, "UD_SEND_ONLY_WITH_IMMEDIATE", deth=True, immdt=True, kind="ud"),
    Opcode(CNP, "CNP", kind="cnp"),
]}


def name(code: int) -> str:
    """IBTA name of an opcode, or its hex code (``0xAA``) when it is not in the table."""
    op = TABLE.get(int(code))
    return op.name if op else f"0x{int(code):02X}"


def _lut(attr: str) -> np.ndarray:
    lut = np.zeros(256, dtype=bool)
    for op in TABLE.values():
        lut[op.code] = getattr(op, attr)
    return lut


# Lookup tables indexed by opcode, for vectorised decoding.
KNOWN = np.zeros(256, dtype=bool)
KNOWN[list(TABLE)] = True
HAS_RETH = _lut("reth")
HAS_IMMDT = _lut("immdt")
HAS_AETH = _lut("aeth")
HAS_DETH = _lut("deth")
IS_WRITE = _lut("write")
IS_FIRST = _lut("first")
IS_LAST = _lut("last")
# Requests that are not RDMA WRITEs (SEND, READ request, CmpSwap, FetchAdd): they take PSNs of the
# request line a QP's WRITEs are on, and NCCL's data QPs never carry them.
OTHER_REQUEST = np.zeros(256, dtype=bool)
OTHER_REQUEST[[o.code for o in TABLE.values() if o.code < 0x20 and o.kind in ("send", "atomic")
               and not o.aeth] + [RC_RDMA_READ_REQUEST]] = True


BY_NAME = {o.name: o for o in TABLE.values()}


def kind(code: int) -> str:
    """What an opcode's operation is ("write", "read", "send", "atomic", "ack", "ud", "cnp"), or
    "unknown"."""
    op = TABLE.get(int(code))
    return op.kind if op else "unknown"
