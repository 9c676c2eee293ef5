"""RoCEv2 traffic of an RDMA application that is not NCCL, as a capture file (tests, ``doctor``).

One RC QP pair between two hosts, as Soft-RoCE (rxe) or any verbs program sets it up: random
initial PSNs, a requester (host 0) posting work requests and a responder (host 1) answering them.
Each operation, in order:

* ``write N`` / ``write_imm N``: RDMA WRITE FIRST/MIDDLE/LAST or ONLY (RETH), the ...WITH
  IMMEDIATE forms carrying ``imm`` (an application's own value, not its length), then an ACK;
* ``read N``: an RDMA READ request (RETH, one PSN per response packet), answered by READ RESPONSE
  ONLY, or FIRST/MIDDLE*/LAST (AETH on the first and last);
* ``send N`` / ``send_imm N`` / ``send_inval N``: SEND FIRST/MIDDLE/LAST or ONLY (+ImmDt, +IETH),
  then an ACK;
* ``cmp_swap`` / ``fetch_add``: the atomic request (AtomicETH) and its ATOMIC ACKNOWLEDGE (AETH,
  AtomicAckETH).

The frame builder (``frames.build``) writes RETH, ImmDt, AETH and DETH; AtomicETH, AtomicAckETH and
IETH are written at the start of the payload, which puts the same bytes on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mirrorckpt.capture.writer import PcapngWriter
from mirrorckpt.parser.headers import ATOMIC_ACK_ETH, ATOMIC_ETH, IETH, PSN_MODULUS
from mirrorckpt.parser.roce import opcodes as oc
from mirrorckpt.tools.generator import frames, messages, topology

KINDS = ("write", "write_imm", "read", "send", "send_imm", "send_inval", "cmp_swap", "fetch_add")


@dataclass(frozen=True)
class Op:
    kind: str
    nbytes: int = 0
    imm: int = 0x1234ABCD  # an application's immediate: not its length

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"RDMA operation {self.kind!r} is not one of {', '.join(KINDS)}")


# First, middle, last, only opcodes per multi-packet operation (last/only with immediate or invalidate)
_SEQ = {
    "write": (oc.RC_RDMA_WRITE_FIRST, oc.RC_RDMA_WRITE_MIDDLE, oc.RC_RDMA_WRITE_LAST, oc.RC_RDMA_WRITE_ONLY),
    "write_imm": (oc.RC_RDMA_WRITE_FIRST, oc.RC_RDMA_WRITE_MIDDLE, oc.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE,
                  oc.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE),
    "send": (oc.RC_SEND_FIRST, oc.RC_SEND_MIDDLE, oc.RC_SEND_LAST, oc.RC_SEND_ONLY),
    "send_imm": (oc.RC_SEND_FIRST, oc.RC_SEND_MIDDLE, oc.RC_SEND_LAST_WITH_IMMEDIATE, oc.RC_SEND_ONLY_WITH_IMMEDIATE),
    "send_inval": (oc.RC_SEND_FIRST, oc.RC_SEND_MIDDLE, oc.RC_SEND_LAST_WITH_INVALIDATE,
                   oc.RC_SEND_ONLY_WITH_INVALIDATE),
    "read": (oc.RC_RDMA_READ_RESPONSE_FIRST, oc.RC_RDMA_READ_RESPONSE_MIDDLE, oc.RC_RDMA_READ_RESPONSE_LAST,
             oc.RC_RDMA_READ_RESPONSE_ONLY),
}


def _opcodes(kind: str, npk: int) -> list[int]:
    first, middle, last, only = _SEQ[kind]
    return [only] if npk == 1 else [first] + [middle] * (npk - 2) + [last]


class _Rows:
    """Packets as rows; payload bytes in a pool."""

    def __init__(self):
        self.rows: list[dict] = []
        self.pool: list[bytes] = []
        self.pool_bytes = 0

    def add(self, src: int, op: int, dqp: int, psn: int, ts: int, payload: bytes = b"", **fields) -> None:
        self.rows.append(dict(src=src, dst=1 - src, opcode=op, dqp=dqp, psn=psn % PSN_MODULUS, ts=ts,
                              pay_off=self.pool_bytes, pay_len=len(payload), **fields))
        self.pool.append(payload)
        self.pool_bytes += len(payload)

    def packets(self, sport: int) -> tuple[frames.Packets, np.ndarray, np.ndarray]:
        count = len(self.rows)

        def col(name, default=0, dtype=np.int64):
            return np.array([r.get(name, default) for r in self.rows], dtype=dtype)

        op = col("opcode")
        pk = frames.Packets(
            src=col("src"), dst=col("dst"), sport=np.full(count, sport), opcode=op, dqp=col("dqp"), psn=col("psn"),
            ackreq=oc.IS_LAST[op] | (op == oc.RC_RDMA_READ_REQUEST) | np.isin(op, (oc.RC_CMP_SWAP, oc.RC_FETCH_ADD)),
            pay_off=col("pay_off"), pay_len=col("pay_len"), va=col("va", 0, np.uint64), rkey=col("rkey"),
            dlen=col("dlen"), imm=col("imm"), syndrome=col("syndrome"), msn=col("msn"),
            qkey=np.zeros(count, np.int64), srcqp=np.zeros(count, np.int64), pkey=np.full(count, messages.RC_PKEY),
            migreq=np.ones(count, bool), tclass=np.full(count, messages.ROCE_TCLASS),
            hop=np.full(count, messages.ROCE_HOP), bad_icrc=np.zeros(count, bool))
        pool = np.frombuffer(b"".join(self.pool), np.uint8) if self.pool_bytes else np.zeros(1, np.uint8)
        return pk, pool, col("ts")


def conversation(ops: list[Op], seed: int = 0, pmtu: int = 1024, v6: bool = True):
    """(frames as bytes, timestamps in ns) of ``ops`` between host 0 (requester) and host 1."""
    rng = np.random.default_rng([seed, 0x7E85])
    nics = topology.build(2, [[0, 1]], seed, "2.18").nics
    qpn = [int(rng.integers(0x11, 0x400)) for _ in range(2)]  # rxe numbers its QPs from 0x11
    sport = topology.udp_sport(qpn[0], qpn[1])
    psn = [int(rng.integers(0, PSN_MODULUS)) for _ in range(2)]  # requester's send PSN, responder's ACK PSN
    va, rkey = int(rng.integers(1, 1 << 47)) & ~0xFFF, int(rng.integers(1, 1 << 32))
    out = _Rows()
    ts, msn, gap = 1_700_000_000 * 10**9, 0, 5_000
    for k, op in enumerate(ops):
        data = rng.integers(0, 256, op.nbytes, dtype=np.uint8).tobytes()
        npk = max(1, -(-op.nbytes // pmtu))
        req = psn[0]
        if op.kind in ("cmp_swap", "fetch_add"):
            code = oc.RC_CMP_SWAP if op.kind == "cmp_swap" else oc.RC_FETCH_ADD
            eth = ATOMIC_ETH.pack(va=va, rkey=rkey, swap_add=k + 1, compare=k)
            out.add(0, code, qpn[1], req, ts, eth)
            msn += 1
            out.add(1, oc.RC_ATOMIC_ACKNOWLEDGE, qpn[0], req, ts + gap, ATOMIC_ACK_ETH.pack(orig=k),
                    syndrome=0x1F, msn=msn)
            psn[0] += 1
        elif op.kind == "read":
            out.add(0, oc.RC_RDMA_READ_REQUEST, qpn[1], req, ts, va=va, rkey=rkey, dlen=op.nbytes)
            msn += 1
            for i, code in enumerate(_opcodes("read", npk)):
                aeth = oc.TABLE[code].aeth
                out.add(1, code, qpn[0], req + i, ts + gap + i * 100, data[i * pmtu:(i + 1) * pmtu],
                        syndrome=0x1F if aeth else 0, msn=msn if aeth else 0)
            psn[0] += npk
        else:
            for i, code in enumerate(_opcodes(op.kind, npk)):
                chunk = data[i * pmtu:(i + 1) * pmtu]
                if oc.TABLE[code].ieth:
                    chunk = IETH.pack(rkey=rkey) + chunk
                out.add(0, code, qpn[1], req + i, ts + i * 100, chunk, va=va, rkey=rkey, dlen=op.nbytes,
                        imm=op.imm)
            msn += 1
            out.add(1, oc.RC_ACKNOWLEDGE, qpn[0], req + npk - 1, ts + gap, syndrome=0x1F, msn=msn)
            psn[0] += npk
        ts += 10 * gap
    pk, pool, stamps = out.packets(sport)
    macs = np.array([list(n.mac) for n in nics], np.uint8)
    ips = np.array([list(n.ip(v6)) for n in nics], np.uint8)
    built = frames.build(pk, pool, macs, ips, v6)
    raw = [built.data[o:o + n].tobytes() for o, n in zip(built.offset.tolist(), built.length.tolist())]
    return raw, stamps.tolist()


def write_capture(path, ops: list[Op], seed: int = 0, pmtu: int = 1024, v6: bool = True) -> int:
    """``ops`` as a pcapng file at ``path``; returns the frames written."""
    raw, stamps = conversation(ops, seed, pmtu, v6)
    with PcapngWriter(path) as writer:
        for frame, ts in zip(raw, stamps):
            writer.write(frame, ts_ns=ts)
    return len(raw)


def parse_ops(text: str) -> list[Op]:
    """``"write:18,read:4096,cmp_swap"``: operations in order, each KIND or KIND:BYTES."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        kind, _, nbytes = item.partition(":")
        try:
            out.append(Op(kind, int(nbytes or 0)))
        except ValueError as e:
            raise ValueError(f"RDMA operation {item!r}: {e}") from None
    return out
