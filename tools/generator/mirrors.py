"""Mirror ports: which frames each capture file gets, in time order, with noise and faults.

``--mirror 0:egress,1:both`` asks for one file per (rank, direction): a port's egress holds the
frames its NIC sends, its ingress the frames it receives (seen ``switch_ns`` after they left the
sender), "both" one file with the two. The wire simulation asks ``wants(src, dst)`` before it
builds anything, so unmirrored traffic costs only its counters; logged messages are expanded and
built in batches (``flush``) and handed to every file that sees them.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.capture.writer import PcapngWriter, PcapWriter
from mirrorckpt.config.layout import MirrorSpec
from mirrorckpt.parser.headers import BTH
from mirrorckpt.tools.generator import frames
from mirrorckpt.tools.generator.encap import EncapOptions, Encapsulator
from mirrorckpt.tools.generator.faults import FaultInjector, FaultOptions
from mirrorckpt.tools.generator.frames import FrameSet
from mirrorckpt.tools.generator.messages import MessageLog
from mirrorckpt.tools.generator.noise import NoiseOptions, NoiseSource
from mirrorckpt.tools.generator.topology import Topology

DIRECTIONS = ("egress", "ingress", "both")
FORMATS = ("pcapng", "pcap")
FLUSH_PACKETS = 1 << 15  # build and write once this many packets are logged
NOISE_LEAD_NS = 1_000_000  # noise also fills the millisecond before the first frame

_SPEC = re.compile(r"^\s*(\d+)\s*:\s*(egress|ingress|both)\s*$")


def parse_mirrors(text: str, nranks: int) -> list[MirrorSpec]:
    """``"0:egress,1:egress"`` -> MirrorSpecs; a rank and direction may appear once."""
    out, seen = [], set()
    for item in text.split(","):
        m = _SPEC.match(item)
        if not m:
            raise ValueError(f"mirror {item.strip()!r} is not RANK:egress, RANK:ingress or RANK:both")
        rank, d = int(m.group(1)), m.group(2)
        if rank >= nranks:
            raise ValueError(f"mirror {item.strip()!r}: rank {rank} is outside 0..{nranks - 1}")
        dirs = {"egress", "ingress"} if d == "both" else {d}
        if any((rank, x) in seen for x in dirs):
            raise ValueError(f"mirror {item.strip()!r}: rank {rank}'s {d} is mirrored twice")
        seen |= {(rank, x) for x in dirs}
        out.append(MirrorSpec(rank, d))
    if not out:
        raise ValueError("no mirror given")
    return out


def file_name(m: MirrorSpec, fmt: str) -> str:
    return f"rank{m.rank}_{m.direction}.{fmt}"


class MirrorFile:
    encap: Encapsulator | None = None  # a remote mirror's encapsulation around every frame

    def __init__(self, path: Path, mirror: MirrorSpec, fmt: str, topo: Topology, v6: bool, noise: NoiseOptions,
                 faults: FaultOptions, encap: Encapsulator | None = None):
        self.path, self.mirror = path, mirror
        self.encap = encap
        self.egress = mirror.direction in ("egress", "both")
        self.ingress = mirror.direction in ("ingress", "both")
        self.writer = PcapngWriter(path) if fmt == "pcapng" else PcapWriter(path)
        self.noise = NoiseSource(noise, topo, mirror.rank, self.egress, self.ingress, v6, path.name)
        self.faults = FaultInjector(faults, path.name)
        self.noise_t: int | None = None
        self.last_ts = -1
        self.frames = 0

    def select(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows of a batch this port sees and whether each is seen arriving (ingress)."""
        r = self.mirror.rank
        out_ = (src == r) & self.egress
        in_ = (dst == r) & self.ingress
        rows = np.flatnonzero(out_ | in_)
        return rows, in_[rows]

    def add(self, fs: FrameSet) -> None:
        if len(fs):
            t1 = int(fs.ts[-1]) + 1
            t0 = self.noise_t if self.noise_t is not None else int(fs.ts[0]) - NOISE_LEAD_NS
            fs = FrameSet.merge([fs, self.noise.frames(max(t0, 0), t1)])
            self.noise_t = t1
        if self.encap is not None and len(fs):  # before the faults: a lost frame leaves a sequence gap
            fs = self.encap.wrap_set(fs)
        fs = self.faults.apply(fs)
        if not len(fs):
            return
        if int(fs.ts[0]) < self.last_ts:
            raise AssertionError(f"{self.path.name}: frame at {int(fs.ts[0])} ns after one at {self.last_ts} ns")
        self.last_ts = int(fs.ts[-1])
        self.writer.write_batch(FrameBatch(data=fs.data, offset=fs.offset, caplen=fs.caplen, wirelen=fs.wirelen,
                                           ts_ns=fs.ts, iface=np.zeros(len(fs), np.int32), source=self.path.name))
        self.frames += len(fs)

    def close(self) -> None:
        self.writer.close()


class CaptureSet:
    """The sink of the wire simulation: every mirrored port's capture file."""

    def __init__(self, out_dir: Path, mirrors: list[MirrorSpec], topo: Topology, v6: bool, fmt: str = "pcapng",
                 noise: NoiseOptions | None = None, faults: FaultOptions | None = None, switch_ns: int = 600,
                 flush_packets: int = FLUSH_PACKETS, encap: EncapOptions | None = None):
        if fmt not in FORMATS:
            raise ValueError(f"capture format {fmt!r} is not one of {', '.join(FORMATS)}")
        out_dir.mkdir(parents=True, exist_ok=True)
        self.topo, self.v6, self.fmt, self.switch_ns = topo, v6, fmt, switch_ns
        # each mirrored port is a mirror session of its own (session id, GRE key, VNI)
        self.files = [MirrorFile(out_dir / file_name(m, fmt), m, fmt, topo, v6, noise or NoiseOptions(),
                                 faults or FaultOptions(),
                                 Encapsulator(replace(encap, session=encap.session + k))
                                 if encap is not None and encap.wraps else None)
                      for k, m in enumerate(mirrors)]
        self.egress = {m.rank for m in mirrors if m.direction in ("egress", "both")}
        self.ingress = {m.rank for m in mirrors if m.direction in ("ingress", "both")}
        self.log = MessageLog()
        self.flush_packets = flush_packets

    def wants(self, src: int, dst: int) -> bool:
        return src in self.egress or dst in self.ingress

    def after_slot(self) -> None:
        if self.log.npackets >= self.flush_packets:
            self.flush()

    def flush(self) -> None:
        if not len(self.log):
            return
        pk, ts = self.log.packets()
        nics = self.topo.all_nics  # an aggregation node may have joined since the last flush
        macs = np.array([list(n.mac) for n in nics], np.uint8)
        ips = np.array([list(n.ip(self.v6)) for n in nics], np.uint8)
        b = frames.build(pk, self.log.pool_array(), macs, ips, self.v6)
        self.log.clear()
        # a corrupted byte goes into the payload, or the AETH of a payload-less ACK
        body_lo = np.where(b.pay < b.icrc, b.pay, b.bth + BTH.size)
        for f in self.files:
            rows, arriving = f.select(pk.src, pk.dst)
            t = ts[rows] + np.where(arriving, self.switch_ns, 0)
            order = np.argsort(t, kind="stable")
            rows, t = rows[order], t[order]
            f.add(FrameSet(b.data, b.offset[rows], b.length[rows], b.length[rows].copy(), t,
                           np.ones(rows.size, bool), pk.opcode[rows], pk.dqp[rows], pk.psn[rows], body_lo[rows],
                           b.icrc[rows]))

    def close(self) -> list[dict]:
        """Flush, close every file; the capture facts for truth.json."""
        self.flush()
        out = []
        for f in self.files:
            f.close()
            out.append({"file": f.path.name, "rank": f.mirror.rank, "direction": f.mirror.direction,
                        "format": self.fmt, "frames": f.frames, "noise": dict(f.noise.counts)})
        return out

    @property
    def fault_records(self) -> list[dict]:
        return [r for f in self.files for r in f.faults.records]
