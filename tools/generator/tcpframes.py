"""Ethernet/IP/TCP frames for synthetic TCP traffic (the gloo tests, NCCL's socket transport):
one frame per call, built from ``parser.headers``' tables. Test tooling: per-frame Python."""

from __future__ import annotations

import ipaddress

from mirrorckpt.parser.gloo.tcp import ACK
from mirrorckpt.parser.headers import ETH, IPV4, IPV6, TCP, VLAN

MAC = bytes([2, 0, 0, 0, 0, 1])


def tcp_frame(src: str, dst: str, sport: int, dport: int, seq: int, payload: bytes = b"",
              flags: int = ACK, vlan: int | None = None) -> bytes:
    """One TCP segment from ``src`` to ``dst`` (IPv4 or IPv6 text addresses), padded to 60 bytes."""
    s, d = ipaddress.ip_address(src), ipaddress.ip_address(dst)
    th = TCP.pack(sport=sport, dport=dport, seq=seq % (1 << 32), ack=1, off_flags=(5 << 12) | flags,
                  window=65535)
    if s.version == 4:
        ip = IPV4.pack(ver_ihl=0x45, total_len=20 + len(th) + len(payload), ttl=64, proto=6,
                       src=s.packed, dst=d.packed)
        et = 0x0800
    else:
        ip = IPV6.pack(ver_tc_fl=6 << 28, payload_len=len(th) + len(payload), next=6, hop=64,
                       src=s.packed, dst=d.packed)
        et = 0x86DD
    if vlan is None:
        eth = ETH.pack(dst=MAC, src=MAC, type=et)
    else:
        eth = ETH.pack(dst=MAC, src=MAC, type=0x8100) + VLAN.pack(tci=vlan, type=et)
    frame = eth + ip + th + payload
    return frame + b"\0" * max(0, 60 - len(frame))  # Ethernet padding beyond the IP length
