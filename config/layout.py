"""The job layout: which parameters exist, how DDP packs their gradients into buckets, and the ring.

The layout is what turns "all-reduce #k of the wire" into "gradient of parameter p". It comes from
the job configuration, from the trainer's registration over the control plane, or is inferred
from the traffic (DDP's start-up broadcasts and bucket rebuild); every source produces these
dataclasses, and they round-trip through plain dicts (JSON, TOML, control-plane headers).
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import asdict, dataclass, field

import numpy as np

DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "float64": 8, "int64": 8, "uint8": 1}


def dtype_size(dtype: str) -> int:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})") from None


def numpy_dtype(dtype: str) -> np.dtype:
    """numpy dtype used to hold wire values; bfloat16 is held as its raw uint16 bits."""
    dtype_size(dtype)
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"  # dtype of the trainer's (master) parameter

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BucketSpec:
    """One DDP bucket: parameter indices in the order their gradients sit in the flat buffer."""

    params: tuple[int, ...]


@dataclass
class JobLayout:
    params: list[ParamSpec]
    buckets: list[BucketSpec]  # after DDP's bucket rebuild; all-reduced in this order
    first_buckets: list[BucketSpec] | None = None  # first iteration, when it differs
    grad_dtype: str = "float32"  # gradient dtype on the wire
    # DDP find_unused_parameters (config.ddp): every iteration ends with the int32 all-reduce of
    # the used-parameter map, and the buckets are never rebuilt
    used_map: bool = False

    def __post_init__(self):
        for bl in [self.buckets] + ([self.first_buckets] if self.first_buckets is not None else []):
            seen = sorted(i for b in bl for i in b.params)
            if seen != list(range(len(self.params))):
                raise ValueError("every parameter must sit in exactly one bucket")
        dtype_size(self.grad_dtype)

    def bucket_list(self, iteration: int) -> list[BucketSpec]:
        """Buckets of 0-based ``iteration`` (the first one may be laid out differently)."""
        if iteration == 0 and self.first_buckets is not None:
            return self.first_buckets
        return self.buckets

    def bucket_count(self, bucket: BucketSpec) -> int:
        """Elements in a bucket's flat buffer."""
        return sum(self.params[i].numel for i in bucket.params)

    def bucket_slices(self, bucket: BucketSpec) -> list[tuple[int, int, int]]:
        """(param index, start, stop) element ranges of the bucket's flat buffer."""
        out, pos = [], 0
        for i in bucket.params:
            n = self.params[i].numel
            out.append((i, pos, pos + n))
            pos += n
        return out

    @property
    def total_numel(self) -> int:
        return sum(p.numel for p in self.params)

    def to_dict(self) -> dict:
        d = {
            "params": [{"name": p.name, "shape": list(p.shape), "dtype": p.dtype} for p in self.params],
            "buckets": [list(b.params) for b in self.buckets],
            "grad_dtype": self.grad_dtype,
        }
        if self.first_buckets is not None:
            d["first_buckets"] = [list(b.params) for b in self.first_buckets]
        if self.used_map:
            d["used_map"] = True
        return d

    @staticmethod
    def from_dict(d: dict) -> JobLayout:
        params = [ParamSpec(p["name"], tuple(int(s) for s in p["shape"]), p.get("dtype", "float32"))
                  for p in d["params"]]
        fb = d.get("first_buckets")
        return JobLayout(
            params=params,
            buckets=[BucketSpec(tuple(int(i) for i in b)) for b in d["buckets"]],
            first_buckets=[BucketSpec(tuple(int(i) for i in b)) for b in fb] if fb is not None else None,
            grad_dtype=d.get("grad_dtype", "float32"),
            used_map=bool(d.get("used_map", False)),
        )


PROTOCOLS = ("LL", "LL128", "Simple")
AUTO = "auto"  # NCCL's default: a protocol per collective, as its tuning model picks it


def wire_address(addr: str) -> bytes:
    """An address as the parser keys it: 16 bytes, IPv4 as IPv4-mapped IPv6 (one key for both families)."""
    ip = ipaddress.ip_address(addr)
    return (ip if ip.version == 6 else ipaddress.IPv6Address(f"::ffff:{ip}")).packed


def address_text(a: bytes) -> str:
    """The inverse of ``wire_address``: IPv4 text for a mapped address."""
    ip = ipaddress.IPv6Address(a)
    return str(ip.ipv4_mapped) if ip.ipv4_mapped else str(ip)


@dataclass
class RingSpec:
    """The NCCL communicator as the wire sees it."""

    nranks: int
    nchannels: int = 1
    protocol: str = "LL"  # or "auto": per collective, read from the traffic
    nccl_version: str | None = "2.18"  # None: read from the traffic
    # Simple thread count, maxThreads[RING][Simple] (NCCL_NTHREADS, or 256 on a PCI-limited ring):
    # it applies to Simple collectives only (LL and LL128 keep their defaults, 512 and 640; an
    # NCCL_NTHREADS below 512 also lowers LL's in NCCL, which is not modelled).
    # None: NCCL's default 512, or what replay infers from the message sizes.
    nthreads: int | None = None
    # Ring order per channel, listed from rank 0 (as NCCL_DEBUG=INFO prints "Channel 00 : 0 1 2").
    ring_orders: list[list[int]] | None = None
    # Address (IPv6 or IPv4 text) of each rank's NIC: rank -> address.
    addresses: dict[int, str] = field(default_factory=dict)

    def __post_init__(self):
        if self.nranks < 2:
            raise ValueError(f"a ring needs at least 2 ranks, got {self.nranks}")
        if self.protocol not in PROTOCOLS + (AUTO,):
            raise ValueError(f"protocol {self.protocol!r} is not one of {', '.join(PROTOCOLS + (AUTO,))}")
        if self.nchannels < 1:
            raise ValueError(f"nchannels must be >= 1, got {self.nchannels}")
        for ch, order in enumerate(self.orders()):
            if sorted(order) != list(range(self.nranks)) or order[0] != 0:
                raise ValueError(f"ring order of channel {ch} must list ranks 0..{self.nranks - 1} "
                                 f"starting at 0, got {order}")

    def orders(self) -> list[list[int]]:
        if self.ring_orders:
            return [list(o) for o in self.ring_orders]
        return [list(range(self.nranks)) for _ in range(self.nchannels)]

    def ring_index(self, channel: int, rank: int) -> int:
        """Ring position of ``rank`` on ``channel`` (global rank 0 is always position 0)."""
        return self.orders()[channel].index(rank)

    def next_rank(self, channel: int, rank: int) -> int:
        o = self.orders()[channel]
        return o[(o.index(rank) + 1) % self.nranks]

    def ranks_by_address(self) -> dict[bytes, int]:
        """Wire address (``wire_address``) -> rank."""
        return {wire_address(a): r for r, a in self.addresses.items()}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["addresses"] = {str(k): v for k, v in self.addresses.items()}
        return d

    @staticmethod
    def from_dict(d: dict) -> RingSpec:
        d = dict(d)
        d["addresses"] = {int(k): v for k, v in (d.get("addresses") or {}).items()}
        return RingSpec(**d)


LIVE_PREFIXES = ("afpacket:", "dpdk:")  # a source spec naming a live port, not a capture file


def live_source(spec: str) -> bool:
    """Whether a mirror source is a live port (AF_PACKET, DPDK) rather than a capture file."""
    return str(spec).startswith(LIVE_PREFIXES)


@dataclass(frozen=True)
class MirrorSpec:
    """One mirrored port: which rank's NIC, and which directions the mirror copies."""

    rank: int
    direction: str = "both"  # "egress" (frames the rank sends), "ingress" (frames it receives), "both"
    source: str = ""  # capture file or interface
    workers: int = 1  # capture processes sharing the port, split by QP pair (capture.fanout)

    def __post_init__(self):
        if self.direction not in ("egress", "ingress", "both"):
            raise ValueError(f"mirror direction must be egress, ingress or both, got {self.direction!r}")
        if self.workers < 1:
            raise ValueError(f"mirror workers must be at least 1, got {self.workers}")

    @property
    def live(self) -> bool:
        return live_source(self.source)
