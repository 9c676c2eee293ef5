"""Packet sources: each yields `FrameBatch`es (pcap/pcapng replay, AF_PACKET ring, DPDK)."""
from mirrorckpt.capture.batch import CaptureError, FrameBatch

__all__ = ["CaptureError", "FrameBatch"]
