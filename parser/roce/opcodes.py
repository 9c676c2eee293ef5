"""The RoCE (InfiniBand BTH) opcode table: names and which extended headers follow the BTH.

IBTA vol. 1, table 38 ("OpCode field"). Only the opcodes NCCL's RC RDMA WRITE path and the
NICs' congestion-control probes use are listed; any other opcode is counted under its hex code
(``0xAA``) and never decoded as data.
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


RC_RDMA_WRITE_FIRST = 0x06
RC_RDMA_WRITE_MIDDLE = 0x07
RC_RDMA_WRITE_LAST = 0x08
RC_RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x09
RC_RDMA_WRITE_ONLY = 0x0A
RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x0B
RC_ACKNOWLEDGE = 0x11
UD_SEND_ONLY = 0x64
UD_SEND_ONLY_WITH_IMMEDIATE = 0x65
CNP = 0x81

TABLE: dict[int, Opcode] = {o.code: o for o in [
    Opcode(RC_RDMA_WRITE_FIRST, "RC_RDMA_WRITE_FIRST", reth=True, write=True, first=True),
    Opcode(RC_RDMA_WRITE_MIDDLE, "RC_RDMA_WRITE_MIDDLE", write=True),
    Opcode(RC_RDMA_WRITE_LAST, "RC_RDMA_WRITE_LAST", write=True, last=True),
    Opcode(RC_RDMA_WRITE_LAST_WITH_IMMEDIATE, "RC_RDMA_WRITE_LAST_WITH_IMMEDIATE", immdt=True, write=True, last=True),
    Opcode(RC_RDMA_WRITE_ONLY, "RC_RDMA_WRITE_ONLY", reth=True, write=True, first=True, last=True),
    Opcode(RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE, "RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE", reth=True, immdt=True,
           write=True, first=True, last=True),
    Opcode(RC_ACKNOWLEDGE, "RC_ACKNOWLEDGE", aeth=True),
    Opcode(UD_SEND_ONLY, "UD_SEND_ONLY", deth=True),
    Opcode(UD_SEND_ONLY_WITH_IMMEDIATE, "UD_SEND_ONLY_WITH_IMMEDIATE", deth=True, immdt=True),
    Opcode(CNP, "CNP"),
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
