"""NCCL's protocol choice for a ring collective (``--protocol auto``): the protocol its tuning
model gives the least time, time = latency + bytes / algorithm bandwidth.

The model as /work/shared/docs/nccl-defaults.md quotes NCCL's source (``topoGetAlgoInfo``,
v2.23.4-1:src/enqueue.cc; the model in v2.18.6-1:src/graph/tuning.cc:73-75,186-188):
* bus bandwidth per protocol: LL ``min(llMaxBw, 0.5·busBw)``, LL128 ``min(0.92·busBw,
  nCh·perChMaxRingLL128Bw)``, Simple ``busBw``; the ring's algorithm bandwidth is the bus
  bandwidth times ``nRanks / nSteps``;
* latency: a base per protocol (ring: LL 6.6, LL128 14.0, Simple 8.4 µs) plus, per ring step
  over the network, LL 2.7, LL128 4.0, Simple 14 µs.
``busBw`` is the NIC's (one NIC per rank, every rank on its own node); LL128 is enabled as on an
HGX A100/H100 with a switch-local NIC. The ring base latencies are NCCL's ``baseLat`` table
(src/graph/tuning.cc, 2.18-era tags), not in the doc; ``llMaxBw`` (per architecture and node
count in NCCL) is a value of the right order, not read from the source: with one 100 Gbit/s NIC
the LL bound is 0.5·busBw either way.
"""

from __future__ import annotations

from dataclasses import dataclass

from mirrorckpt.parser.roce import nccl_versions as nv

BASE_LAT_US = {nv.LL: 6.6, nv.LL128: 14.0, nv.SIMPLE: 8.4}
NET_LAT_US = {nv.LL: 2.7, nv.LL128: 4.0, nv.SIMPLE: 14.0}
LL128_PER_CHANNEL_GBS = {"hopper": 36.7, "ampere": 20.0}
LL_MAX_GBS = {"hopper": 141.0, "ampere": 87.7}


@dataclass(frozen=True)
class Fabric:
    nic_gbs: float = 12.0  # bus bandwidth of the ring: one 100 Gbit/s NIC per rank
    arch: str = "hopper"
    ll128: bool = True


def ring_steps(kind: str, nranks: int) -> int:
    return 2 * (nranks - 1) if kind == nv.ALLREDUCE else nranks - 1


def model_time_us(proto: str, kind: str, nbytes: int, nranks: int, nchannels: int, fabric: Fabric) -> float:
    bus = fabric.nic_gbs
    if proto == nv.LL:
        bw = min(LL_MAX_GBS[fabric.arch], 0.5 * bus)
    elif proto == nv.LL128:
        bw = min(0.92 * bus, nchannels * LL128_PER_CHANNEL_GBS[fabric.arch])
    else:
        bw = bus
    steps = ring_steps(kind, nranks)
    algo_bw = bw * nranks / steps
    return BASE_LAT_US[proto] + steps * NET_LAT_US[proto] + nbytes / (1000.0 * algo_bw)


def choose(kind: str, nbytes: int, nranks: int, nchannels: int, fabric: Fabric = Fabric()) -> str:
    """The protocol NCCL runs a ring collective of ``nbytes`` (all-gather: the gathered size) with."""
    protos = [p for p in nv.PROTOCOLS if fabric.ll128 or p != nv.LL128]
    return min(protos, key=lambda p: model_time_us(p, kind, nbytes, nranks, nchannels, fabric))
