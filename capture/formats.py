"""pcap and pcapng constants and fixed header layouts, shared by the readers and writers.

pcap: draft-ietf-opsawg-pcap; pcapng: draft-ietf-opsawg-pcapng. The Cython walk
(`_walk.pyx`) repeats the record and block offsets in C; they are the ones declared here.
"""

from __future__ import annotations

import numpy as np

# pcap magic numbers as read little-endian from the first 4 bytes of the file.
PCAP_MAGIC_US = 0xA1B2C3D4
PCAP_MAGIC_NS = 0xA1B23C4D
PCAP_MAGIC_US_SWAPPED = 0xD4C3B2A1
PCAP_MAGIC_NS_SWAPPED = 0x4D3CB2A1
# Kuznetzov's modified pcap (24-byte records); recognised only to say it is unsupported.
PCAP_MAGIC_MODIFIED = 0xA1B2CD34
PCAP_MAGIC_MODIFIED_SWAPPED = 0x34CDB2A1

PCAP_HEADER_SIZE = 24
PCAP_RECORD_SIZE = 16

# pcapng block types.
BT_SHB = 0x0A0D0D0A  # same in both byte orders
BT_IDB = 1
BT_PB = 2  # obsolete Packet Block
BT_SPB = 3
BT_NRB = 4
BT_ISB = 5
BT_EPB = 6
BYTE_ORDER_MAGIC = 0x1A2B3C4D

BLOCK_NAMES = {BT_SHB: "section header", BT_IDB: "interface description", BT_PB: "packet",
               BT_SPB: "simple packet", BT_NRB: "name resolution", BT_ISB: "interface statistics",
               BT_EPB: "enhanced packet", 0x0000000A: "decryption secrets",
               0x00000BAD: "custom", 0x40000BAD: "custom"}

# Smallest legal total length of each block (header 8 + fixed body + trailing length 4).
MIN_BLOCK = 12
MIN_SHB = 28
MIN_IDB = 20
MIN_EPB = 32
MIN_PB = 32
MIN_SPB = 16

# Interface Description Block options.
OPT_ENDOFOPT = 0
OPT_IF_NAME = 2
OPT_IF_TSRESOL = 9
OPT_IF_TSOFFSET = 14

# A captured length beyond this is damage, not a packet (Wireshark's largest standard snaplen).
MAX_CAPLEN = 262144


def block_name(block_type: int) -> str:
    return BLOCK_NAMES.get(block_type, f"type 0x{block_type:08x}")


def pcap_header_dtype(order: str) -> np.dtype:
    """Global header; order is '<' or '>'."""
    return np.dtype([("magic", order + "u4"), ("version_major", order + "u2"),
                     ("version_minor", order + "u2"), ("thiszone", order + "i4"),
                     ("sigfigs", order + "u4"), ("snaplen", order + "u4"),
                     ("linktype", order + "u4")])


def pcap_record_dtype(order: str = "<") -> np.dtype:
    return np.dtype([("ts_sec", order + "u4"), ("ts_frac", order + "u4"),
                     ("caplen", order + "u4"), ("wirelen", order + "u4")])


def epb_header_dtype(order: str = "<") -> np.dtype:
    """Enhanced Packet Block up to the packet data (the 4-byte trailing length follows the data)."""
    return np.dtype([("type", order + "u4"), ("length", order + "u4"), ("iface", order + "u4"),
                     ("ts_hi", order + "u4"), ("ts_lo", order + "u4"),
                     ("caplen", order + "u4"), ("wirelen", order + "u4")])


def pad4(n: int) -> int:
    return (n + 3) & ~3
