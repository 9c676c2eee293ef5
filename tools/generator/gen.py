"""One generator run: train on the simulated ring, write the mirror captures, truth.json, job.toml.

``generate(GenConfig(...), out_dir)`` is what ``mirrorckpt gen`` runs. The outputs:

* one capture per mirrored port and direction (``mirrors.file_name``);
* ``truth.json``: the trainer's record (``truth.truth_dict``: layout, collectives with result
  digests, iterations) plus ``wire``: the ring, the wire options, the topology (addresses, QP
  numbers, UDP ports, buffer addresses and rkeys), the captures, every fault, every collective's
  NCCL launch (channels, threads), and every send some capture carries (connection, CTS index,
  connection step, flag, sizes, sha256 of the user bytes as a decoder yields them);
* ``initial_params.bin`` (truth.write_truth);
* ``job.toml``: ``config.jobfile.dump_job`` of the ring, DDP layout, training and mirrors, so
  ``mirrorckpt replay --config job.toml CAPTURES`` runs with the job known.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mirrorckpt.config.jobfile import JobConfig, dump_job
from mirrorckpt.config.layout import MirrorSpec, RingSpec
from mirrorckpt.config.training import TrainingSpec
from mirrorckpt.parser.roce import nccl_versions as nv
from mirrorckpt.tools.generator import mirrors as mirrors_mod
from mirrorckpt.tools.generator import topology
from mirrorckpt.tools.generator.encap import EncapOptions
from mirrorckpt.tools.generator.faults import FaultOptions
from mirrorckpt.tools.generator.noise import NoiseOptions
from mirrorckpt.tools.generator.packetize import NcclRing
from mirrorckpt.tools.generator.train import run_training
from mirrorckpt.tools.generator.truth import TRUTH_FILE, write_truth
from mirrorckpt.tools.generator.wire import Wire, WireOptions

JOB_FILE = "job.toml"


@dataclass
class GenConfig:
    ranks: int = 2
    channels: int = 1
    protocol: str = "LL"
    nccl_version: str = "2.18"
    nthreads: int | None = None
    ring_orders: list[list[int]] | None = None
    model: str = "linear:5000"
    steps: int = 10
    seed: int = 0
    batch_size: int = 4
    bucket_cap_mb: float | None = None
    training: TrainingSpec = field(default_factory=TrainingSpec)
    threads: int = 1
    force_overflow_at: int | None = None
    mirrors: str = "0:egress,1:egress"
    fmt: str = "pcapng"
    wire: WireOptions = field(default_factory=WireOptions)
    noise: NoiseOptions = field(default_factory=NoiseOptions)
    faults: FaultOptions = field(default_factory=FaultOptions)
    p2p_fill: bool = False
    algorithm: str = "ring"  # tools.generator.algorithms: ring, tree, pat, nvls, collnet
    # after each gradient all-reduce, foreign point-to-point sends: a size (bytes, rank 0 to its next
    # rank) or a (sender, receiver, bytes) triple each
    p2p_noise: tuple = ()
    send_truth: bool = True  # every captured send in truth.json (large for big runs)
    encap: EncapOptions = field(default_factory=EncapOptions)  # a remote mirror's encapsulation (tools.generator.encap)

    def ring(self) -> RingSpec:
        if self.ring_orders is not None and len(self.ring_orders) != self.channels:
            raise ValueError(f"{len(self.ring_orders)} ring orders given for {self.channels} channels")
        proto = nv.AUTO if self.protocol == nv.AUTO else nv.protocol(self.protocol)
        return RingSpec(nranks=self.ranks, nchannels=self.channels, protocol=proto,
                        nccl_version=str(nv.version(self.nccl_version)), nthreads=self.nthreads,
                        ring_orders=self.ring_orders)


def _no_none(d):
    """TOML has no null: drop unset values (they are the defaults when read back)."""
    if isinstance(d, dict):
        return {k: _no_none(v) for k, v in d.items() if v is not None}
    return d


def _topology_facts(topo: topology.Topology, v6: bool) -> dict:
    def pair(key, p):
        return {"key": list(key) if isinstance(key, tuple) else key, "sender": p.sender, "receiver": p.receiver,
                "sport": p.sport, "send_qpn": p.send_qpn, "recv_qpn": p.recv_qpn, "recv_base": p.recv_base,
                "rkeys": p.rkeys, "fifo_va": p.fifo_va, "fifo_rkey": p.fifo_rkey}
    return {
        "nics": [{"rank": n.rank, "mac": n.mac.hex(":"), "ip": n.ip_text(v6), "ipv4": n.ip_text(False)}
                 for n in topo.nics],
        "ring": [dict(pair(k, p), channel=k[0], pos=k[1], **({"more_qps": [list(q) for q in p.more_qps]}
                                                              if p.more_qps else {}))
                 for k, p in sorted(topo.ring.items())],
        "p2p": [pair(k, p) for k, p in sorted(topo.p2p.items())],
        **({"peers": [dict(pair(k, p), channel=k[0]) for k, p in sorted(topo.peers.items())]} if topo.peers else {}),
        **({"switch": {"mac": topo.switch.mac.hex(":"), "ip": topo.switch.ip_text(v6),
                       "pairs": [pair(k, p) for k, p in sorted(topo.collnet.items())]}} if topo.switch else {}),
    }


def generate(cfg: GenConfig, out_dir, on_step=None) -> dict:
    """Run ``cfg`` into ``out_dir``; returns the truth record written to truth.json. ``on_step``:
    called with the iterations trained so far (their traffic is written as they go)."""
    out = Path(out_dir)
    ring = cfg.ring()
    mirrors = mirrors_mod.parse_mirrors(cfg.mirrors, cfg.ranks)
    topo = topology.build(cfg.ranks, ring.orders(), cfg.seed, ring.nccl_version, nqps=cfg.wire.qps_per_connection)
    ring.addresses = {n.rank: n.ip_text(cfg.wire.ipv6) for n in topo.nics}
    captures = mirrors_mod.CaptureSet(out, mirrors, topo, cfg.wire.ipv6, cfg.fmt, cfg.noise, cfg.faults,
                                      cfg.wire.switch_ns, encap=cfg.encap)
    wire = Wire(ring.nccl_version, cfg.wire, captures, cfg.seed, cfg.send_truth)
    comm = NcclRing(ring, topo, wire, p2p_fill=cfg.p2p_fill, p2p_noise=cfg.p2p_noise, seed=cfg.seed,
                    algorithm=cfg.algorithm)
    try:
        result = run_training(cfg.model, cfg.ranks, cfg.steps, cfg.seed, cfg.training, comm,
                              batch_size=cfg.batch_size, bucket_cap_mb=cfg.bucket_cap_mb,
                              force_overflow_at=cfg.force_overflow_at, threads=cfg.threads, on_step=on_step)
    finally:
        files = captures.close()
    path = write_truth(result, out)
    truth = json.loads(path.read_text())
    wire_extra = {"p2p_noise": list(cfg.p2p_noise)} if cfg.p2p_noise else {}  # absent: the sets make.sh made
    truth["wire"] = {
        "ring": ring.to_dict(),
        "options": {k: v for k, v in asdict(cfg.wire).items() if k != "speed_update" or v},  # the sets make.sh made
        "p2p_fill": cfg.p2p_fill,
        **({"algorithm": cfg.algorithm} if cfg.algorithm != "ring" else {}),
        **wire_extra,
        "noise": {"kinds": sorted(cfg.noise.kinds), "rate_hz": cfg.noise.rate_hz, "seed": cfg.noise.seed},
        **({"encapsulation": asdict(cfg.encap)} if cfg.encap.wraps else {}),
        "fault_rates": asdict(cfg.faults),
        "topology": _topology_facts(topo, cfg.wire.ipv6),
        "captures": files,
        "faults": captures.fault_records,
        "launches": comm.plans,
        "sends": wire.sends,
    }
    path.write_text(json.dumps(truth, sort_keys=True, indent=1) + "\n")
    job = JobConfig(ring=ring, kind="ddp", startup=True, layout=result.layout, grad_dtype=cfg.training.grad_dtype,
                    training=_no_none(cfg.training.to_dict()),
                    mirrors=[MirrorSpec(m.rank, m.direction, mirrors_mod.file_name(m, cfg.fmt)) for m in mirrors],
                    p2p_fill=cfg.p2p_fill,  # the workload it generates does send the missing values
                    capture=cfg.encap.capture_keys())
    (out / JOB_FILE).write_text(dump_job(job))
    return truth


__all__ = ["GenConfig", "generate", "JOB_FILE", "TRUTH_FILE"]
