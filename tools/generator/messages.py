"""RDMA messages as table rows, expanded to packets in one vectorised step.

The wire simulation logs one row per RDMA operation (an NCCL data send in one of its WRITE forms,
a CTS post, an ACK) with its first PSN, length, addresses and the time of its first packet; the
payload bytes go to a pool. ``MessageLog.packets`` turns the rows into ``frames.Packets`` with
numpy (repeat + arange), so the per-packet work never runs in a Python loop.

Forms (IBTA opcodes, parser.opcodes):
  NORMAL  WRITE ONLY WITH IMM, or FIRST / MIDDLE* / LAST WITH IMM (RETH on the first packet);
  SPLIT   the bulk as a WRITE without immediate (ONLY, or FIRST / MIDDLE* / LAST), then a 0-byte
          WRITE ONLY WITH IMM with VA 0 and rkey 0 (doc 6.3);
  TRAIN   the bulk as one WRITE ONLY per packet, each with its own RETH (VA += PMTU), then the
          same 0-byte closing WRITE (the NIC behaviour seen in the rdma32 capture);
  PLAIN   a WRITE without immediate (CTS posts);
  ACK     one RC ACKNOWLEDGE with AETH (syndrome, MSN);
  UD      one UD SEND ONLY to QP 1 with DETH (congestion-control probes);
  SEND    an RC SEND: ONLY, or FIRST / MIDDLE* / LAST (no RETH; CollNet's aggregation traffic).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from mirrorckpt.parser.headers import PSN_MODULUS
from mirrorckpt.parser.roce import opcodes as oc
from mirrorckpt.tools.generator.frames import Packets

NORMAL, SPLIT, TRAIN, PLAIN, ACK, UD, SEND = range(7)

# Packets (0-based, inside a multi-packet WRITE) on which the requester sets AckReq besides the
# last one: ConnectX behaviour measured on iter_40000_p2p_iter10 (offsets 3 and 11).
ACKREQ_OFFSETS = (3, 11)
RC_PKEY = 0xFFFF  # default partition
ROCE_TCLASS = 0x02  # ECN-capable (ECT(0)), as every RC frame of the real captures
ROCE_HOP = 64

_COLS = ("form", "src", "dst", "sport", "dqp", "psn", "length", "pmtu", "va", "rkey", "imm", "pay_off",
         "ts", "dt", "syndrome", "msn", "qkey", "srcqp", "pkey", "tclass", "hop", "bad_icrc")


def packet_count(form: int, length: int, pmtu: int) -> int:
    """PSNs one row uses."""
    bulk = max(1, -(-length // pmtu))
    if form in (SPLIT, TRAIN):
        return bulk + 1
    if form in (ACK, UD):
        return 1
    return bulk


def rdma_messages(form: int, length: int, pmtu: int) -> int:
    """RDMA messages one row completes at the responder (what the MSN counts)."""
    if form == SPLIT:
        return 2
    if form == TRAIN:
        return max(1, -(-length // pmtu)) + 1
    return 1


class MessageLog:
    def __init__(self):
        self.cols: dict[str, list] = defaultdict(list)
        self.pool: list[np.ndarray] = []
        self.pool_bytes = 0
        self.npackets = 0

    def __len__(self) -> int:
        return len(self.cols["form"])

    def payload(self, data: np.ndarray) -> int:
        """Adds bytes to the pool; returns their offset."""
        off = self.pool_bytes
        if data.size:
            self.pool.append(np.ascontiguousarray(data, np.uint8).reshape(-1))
            self.pool_bytes += data.size
        return off

    def add(self, form: int, src: int, dst: int, sport: int, dqp: int, psn: int, ts: int, *, length: int = 0,
            pmtu: int = 1024, va: int = 0, rkey: int = 0, imm: int = 0, pay_off: int = 0, dt: int = 0,
            syndrome: int = 0, msn: int = 0, qkey: int = 0, srcqp: int = 0, pkey: int = RC_PKEY,
            tclass: int = ROCE_TCLASS, hop: int = ROCE_HOP, bad_icrc: bool = False) -> None:
        row = dict(form=form, src=src, dst=dst, sport=sport, dqp=dqp, psn=psn, length=length, pmtu=pmtu, va=va,
                   rkey=rkey, imm=imm, pay_off=pay_off, ts=ts, dt=dt, syndrome=syndrome, msn=msn, qkey=qkey,
                   srcqp=srcqp, pkey=pkey, tclass=tclass, hop=hop, bad_icrc=bad_icrc)
        for k in _COLS:
            self.cols[k].append(row[k])
        self.npackets += packet_count(form, length, pmtu)

    def clear(self) -> None:
        self.cols.clear()
        self.pool.clear()
        self.pool_bytes = 0
        self.npackets = 0

    def pool_array(self) -> np.ndarray:
        return np.concatenate(self.pool) if self.pool else np.zeros(0, np.uint8)

    def packets(self) -> tuple[Packets, np.ndarray]:
        """All rows as packets, and each packet's timestamp."""
        c = {k: np.asarray(self.cols[k], dtype=np.uint64 if k == "va" else np.int64) for k in _COLS}
        form, length, pmtu = c["form"], c["length"], c["pmtu"]
        bulk = np.maximum(1, -(-length // pmtu))
        closed = (form == SPLIT) | (form == TRAIN)
        n = np.where((form == ACK) | (form == UD), 1, bulk + closed)
        row = np.repeat(np.arange(form.size), n)
        starts = np.zeros(form.size, np.int64)
        if form.size > 1:
            np.cumsum(n[:-1], out=starts[1:])
        i = np.arange(row.size) - starts[row]  # packet index inside its row
        f, L, m, nb = form[row], length[row], pmtu[row], bulk[row]
        in_bulk = i < nb
        close = closed[row] & ~in_bulk  # the 0-byte WRITE WITH IMM of SPLIT/TRAIN
        first, last = in_bulk & (i == 0), in_bulk & (i == nb - 1)

        op = np.full(row.size, oc.RC_RDMA_WRITE_MIDDLE, np.int64)
        imm_form = f == NORMAL
        op[first] = oc.RC_RDMA_WRITE_FIRST
        op[last & imm_form] = oc.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE
        op[last & ~imm_form] = oc.RC_RDMA_WRITE_LAST
        single = first & last
        op[single & imm_form] = oc.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE
        op[single & ~imm_form] = oc.RC_RDMA_WRITE_ONLY
        op[(f == TRAIN) & in_bulk] = oc.RC_RDMA_WRITE_ONLY
        op[close] = oc.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE
        op[f == ACK] = oc.RC_ACKNOWLEDGE
        op[f == UD] = oc.UD_SEND_ONLY
        send = f == SEND
        op[send] = oc.RC_SEND_MIDDLE
        op[send & first] = oc.RC_SEND_FIRST
        op[send & last] = oc.RC_SEND_LAST
        op[send & single] = oc.RC_SEND_ONLY

        pay_len = np.where(in_bulk, np.clip(L - i * m, 0, m), 0)
        pay_len[(f == ACK) | (f == UD)] = L[(f == ACK) | (f == UD)]
        pay_off = c["pay_off"][row] + np.where(in_bulk, i * m, 0)
        train = (f == TRAIN) & in_bulk
        va = c["va"][row] + np.where(train, i * m, 0).astype(np.uint64)
        va[close] = 0
        rkey = np.where(close, 0, c["rkey"][row])
        dlen = np.where(train, pay_len, np.where(close, 0, L))
        # AckReq: on the last packet of every RDMA message, and at fixed offsets of long ones
        msg_end = last | close | train | (f == ACK)
        ackreq = (msg_end | (in_bulk & np.isin(i, ACKREQ_OFFSETS))) & (f != ACK) & (f != UD)
        psn = np.where(f == ACK, c["psn"][row], (c["psn"][row] + i) % PSN_MODULUS)
        pk = Packets(
            src=c["src"][row], dst=c["dst"][row], sport=c["sport"][row], opcode=op, dqp=c["dqp"][row], psn=psn,
            ackreq=ackreq, pay_off=pay_off, pay_len=pay_len, va=va, rkey=rkey, dlen=dlen, imm=c["imm"][row],
            syndrome=c["syndrome"][row], msn=c["msn"][row], qkey=c["qkey"][row], srcqp=c["srcqp"][row],
            pkey=c["pkey"][row], migreq=f != UD, tclass=c["tclass"][row], hop=c["hop"][row],
            bad_icrc=c["bad_icrc"][row].astype(bool),
        )
        return pk, c["ts"][row] + i * c["dt"][row]
