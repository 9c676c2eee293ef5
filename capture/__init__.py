"""Packet sources: each yields `FrameBatch`es (pcap/pcapng replay, AF_PACKET ring, DPDK)."""
from mirrorckpt.capture.batch import CaptureError, FrameBatch
from mirrorckpt.capture.source import open_source

__all__ = ["CaptureError", "FrameBatch", "open_source"]
