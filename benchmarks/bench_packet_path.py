"""Packet path throughput: decode + ICRC + PSN placement, against scapy and against memcpy.

Two workloads, each made large by concatenating copies of a capture with every QP's PSNs shifted
forward and the ICRCs recomputed (the copies are new packets, not duplicates):

* ``ll``: the real capture iter_40000_p2p_iter10 (NCCL LL, 16-64 KB messages, PMTU 1024) — the
  per-message cost dominates;
* ``simple``: a generated 2-rank Simple-protocol job (messages up to 1 MB, PMTU 4096) — the cost
  per byte dominates.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.capture.pcapfile import read_all
from mirrorckpt.parser import roce
from mirrorckpt.parser.headers import BTH, ETH, IPV6, UDP
from mirrorckpt.parser.roce import _fast
from mirrorckpt.parser.roce.reassembly import Reassembler

SHARED = Path(__file__).resolve().parents[2] / "shared" / "captures" / "flowcheck"
BASE = SHARED / "iter_40000_p2p_iter10.pcapng"


def large_capture(target_bytes: int = 1 << 30, base: Path = BASE) -> FrameBatch:
    """Copies of ``base``'s RoCE frames, each copy's PSNs moved past the previous copy's."""
    b = read_all(base)
    pk, _ = roce.decode(b)
    frames = pk.frame
    lens = b.caplen[frames]
    per_copy = int(lens.sum())
    copies = max(1, target_bytes // per_copy)
    n = len(frames) * copies
    total = per_copy * copies
    data = np.empty(total, np.uint8)
    offset = np.empty(n, np.int64)
    src_off = b.offset[frames]
    # one copy laid out contiguously, then tiled
    one = np.concatenate([b.data[o:o + ln] for o, ln in zip(src_off.tolist(), lens.tolist())])
    data[:] = np.tile(one, copies)
    starts = np.zeros(len(frames), np.int64)
    starts[1:] = np.cumsum(lens[:-1])
    offset[:] = (starts[None, :] + per_copy * np.arange(copies)[:, None]).reshape(-1)
    # PSN shift per copy and QP: just past the largest PSN that QP uses in one copy, so the
    # copies continue each QP's PSN sequence without gaps
    # (ACKs on a QP count the other direction's PSNs: they get their own span)
    from mirrorckpt.parser.roce import opcodes
    kind = pk.dqp * 2 + opcodes.IS_WRITE[pk.opcode]
    qps, inv = np.unique(kind, return_inverse=True)
    top = np.zeros(len(qps), np.int64)
    np.maximum.at(top, inv, pk.psn)
    span = np.tile((top + 1)[inv], copies)
    l3 = offset + ETH.size
    bth = l3 + IPV6.size + UDP.size
    psn_at = bth + BTH["psn"].offset
    k = np.repeat(np.arange(copies), len(frames))
    psn = (np.tile(pk.psn, copies) + k * span) % (1 << 24)
    for j in range(3):
        data[psn_at + j] = (psn >> (8 * (2 - j))) & 0xFF
    ulen = np.tile(pk.pay_off + pk.pad + pk.pay_len + 4 - (b.offset[frames] + ETH.size + IPV6.size), copies)
    icrc_at = l3 + IPV6.size + ulen - 4
    crc = np.zeros(n, np.uint32)
    _fast.icrc(data, l3, np.full(n, IPV6.size, np.int64), np.ones(n, np.uint8), icrc_at, crc)
    for j in range(4):
        data[icrc_at + j] = (crc >> (8 * j)) & 0xFF
    lens_all = np.tile(lens, copies)
    return FrameBatch(data=data, offset=offset, caplen=lens_all, wirelen=lens_all.copy(),
                      ts_ns=np.arange(n, dtype=np.int64), iface=np.zeros(n, np.int32), source="bench")


def _batches(big: FrameBatch, per: int = 65536):
    for a in range(0, len(big), per):
        sl = slice(a, a + per)
        yield FrameBatch(big.data, big.offset[sl], big.caplen[sl], big.wirelen[sl], big.ts_ns[sl],
                         big.iface[sl], "bench")


def ours(big: FrameBatch, icrc: bool) -> float:
    r = Reassembler()
    t = time.perf_counter()
    placed = 0
    for b in _batches(big):
        pk, c = roce.decode(b, icrc=icrc)
        placed += sum(len(m.data) for m in r.feed(pk, b.data))
    placed += sum(len(m.data) for m in r.flush())
    dt = time.perf_counter() - t
    assert placed > 0.9 * big.nbytes * 0.9, "the benchmark must place the payloads it decodes"
    return dt


def straightforward(big: FrameBatch, icrc: bool, sample: int = 300_000) -> tuple[float, int, int]:
    """The fair baseline: what a plain numpy + zlib decoder does without a compiled frame walk.
    numpy reads every header field of a batch at fixed offsets (the workloads' one form: Ethernet,
    IPv6, UDP, BTH, extended headers by opcode), zlib.crc32 checks each packet's ICRC over its
    masked headers (masks built for the whole batch at once) and its payload, and each RDMA WRITE
    payload is appended to its QP's message, a new message at FIRST/ONLY (in-order traffic only: no
    PSN checks, holes or reordering, which the project's path handles). Returns (seconds, frames,
    bytes) over the first ``sample`` frames."""
    import zlib

    from mirrorckpt.parser.roce import opcodes

    n = min(sample, len(big))
    data = big.data
    t = time.perf_counter()
    msgs: dict[int, list] = {}
    placed = bad = 0
    ext = (opcodes.HAS_RETH * 16 + opcodes.HAS_IMMDT * 4 + opcodes.HAS_AETH * 4 + opcodes.HAS_DETH * 8).astype(np.int64)
    for a in range(0, n, 65536):
        off = big.offset[a:min(n, a + 65536)]
        udp = off + ETH.size + IPV6.size
        bth = udp + UDP.size
        keep = (UDP.read(data, udp, "dport") == 4791) & (ETH.read(data, off, "type") == 0x86DD)
        off, udp, bth = off[keep], udp[keep], bth[keep]
        op = data[bth].astype(np.int64)
        pad = (data[bth + 1] >> 4) & 3
        dqp = BTH.read(data, bth, "dqp").astype(np.int64)
        pay = bth + BTH.size + ext[op]
        icrc_at = udp + UDP.read(data, udp, "len").astype(np.int64) - 4
        plen = icrc_at - pay - pad
        if icrc:
            hdr = data[(off + ETH.size)[:, None] + np.arange(IPV6.size + UDP.size + BTH.size)]
            hdr[:, 0] |= 0x0F
            hdr[:, 1:4] = 0xFF  # traffic class, flow label
            hdr[:, 7] = 0xFF  # hop limit
            hdr[:, IPV6.size + 6:IPV6.size + 8] = 0xFF  # UDP checksum
            hdr[:, IPV6.size + UDP.size + 4] = 0xFF  # BTH resv8a
            want = data[icrc_at[:, None] + np.arange(4)].copy().view("<u4").ravel()
            ff = zlib.crc32(b"\xff" * 8)
            got = [zlib.crc32(data[b + BTH.size:e], zlib.crc32(row, ff))
                   for row, b, e in zip(hdr, bth.tolist(), icrc_at.tolist())]
            bad += int((np.array(got, np.uint32) != want).sum())
        write = opcodes.IS_WRITE[op]
        first = opcodes.IS_FIRST[op]
        for q, w, f, p0, ln in zip(dqp.tolist(), write.tolist(), first.tolist(), pay.tolist(), plen.tolist()):
            if not w:
                continue
            if f or q not in msgs:
                msgs[q] = []
            msgs[q].append(data[p0:p0 + ln].tobytes())
            placed += ln
    dt = time.perf_counter() - t
    assert bad == 0 and placed > 0, (bad, placed)
    return dt, n, int(big.offset[n - 1] + big.caplen[n - 1] - big.offset[0])


def scapy_rate(big: FrameBatch, sample: int = 3000) -> float:
    """Packets per second of a scapy decode: Ether(raw) down to BTH fields and the payload."""
    from scapy.contrib.roce import BTH as SBTH
    from scapy.layers.l2 import Ether
    from scapy.packet import Raw

    frames = [big.frame(i) for i in range(min(sample, len(big)))]
    t = time.perf_counter()
    for f in frames:
        p = Ether(f)
        b = p[SBTH]
        _ = (b.opcode, b.dqpn, b.psn, bytes(b.payload) if b.payload else b"", p.getlayer(Raw))
    return len(frames) / (time.perf_counter() - t)


def memcpy_seconds(big: FrameBatch) -> float:
    dst = np.empty_like(big.data)
    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(dst, big.data)
        best = min(best, time.perf_counter() - t)
    return best


def simple_base(out: Path) -> Path:
    """A generated Simple-protocol capture (one rank's egress) to tile."""
    from mirrorckpt.tools.generator.gen import GenConfig, generate
    from mirrorckpt.tools.generator.wire import WireOptions

    generate(GenConfig(ranks=2, protocol="Simple", model="linear:1000000", steps=2, mirrors="0:egress",
                       wire=WireOptions(pmtu=4096), send_truth=False), out)
    return out / "rank0_egress.pcapng"


def run(target_bytes: int = 1 << 30) -> dict:
    import tempfile

    out = {"ll": run_one(target_bytes, BASE)}
    with tempfile.TemporaryDirectory() as d:
        out["simple"] = run_one(target_bytes, simple_base(Path(d)))
    return out


def run_one(target_bytes: int, base: Path) -> dict:
    big = large_capture(target_bytes, base)
    n, nbytes = len(big), big.nbytes
    t_on = min(ours(big, True) for _ in range(2))
    t_off = min(ours(big, False) for _ in range(2))
    t_cp = memcpy_seconds(big)
    sc = scapy_rate(big)
    plain_on, plain_n, plain_bytes = straightforward(big, True)
    plain_off = straightforward(big, False)[0]
    return {
        "frames": n, "bytes": nbytes, "icrc_backend": roce.ICRC_BACKEND,
        "ours_icrc_GBps": nbytes / t_on / 1e9, "ours_icrc_Mpps": n / t_on / 1e6,
        "ours_noicrc_GBps": nbytes / t_off / 1e9, "ours_noicrc_Mpps": n / t_off / 1e6,
        "memcpy_GBps": nbytes / t_cp / 1e9,
        "scapy_Mpps": sc / 1e6, "scapy_GBps": sc * nbytes / n / 1e9,
        "ratio_vs_scapy_icrc": (n / t_on) / sc,
        "plain_frames": plain_n, "plain_icrc_GBps": plain_bytes / plain_on / 1e9,
        "plain_icrc_Mpps": plain_n / plain_on / 1e6, "plain_noicrc_GBps": plain_bytes / plain_off / 1e9,
        "plain_noicrc_Mpps": plain_n / plain_off / 1e6,
        "ratio_vs_plain_icrc": (n / t_on) / (plain_n / plain_on),
        "ratio_vs_plain_noicrc": (n / t_off) / (plain_n / plain_off),
        "ratio_vs_memcpy_noicrc": t_cp / t_off,
    }


if __name__ == "__main__":
    import json
    print(json.dumps(run(), indent=1))
