"""The packet path as one object: frame batches in, RDMA messages and NCCL sends out."""

from __future__ import annotations

from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.parser import roce
from mirrorckpt.parser.nccl import NcclDecoder, NcclSend
from mirrorckpt.parser.reassembly import RdmaMessage, Reassembler


class PacketPath:
    def __init__(self, icrc: bool = True, nccl_version: str | None = None, protocol: str | None = None,
                 psn_window: int = 1024, stream: int = 0):
        self.icrc = icrc
        self.counters = roce.Counters()
        self.reassembler = Reassembler(psn_window=psn_window)
        self.nccl = NcclDecoder(version=nccl_version, protocol=protocol, stream=stream)

    def feed(self, batch: FrameBatch) -> tuple[list[RdmaMessage], list[NcclSend]]:
        pk, c = roce.decode(batch, icrc=self.icrc)
        self.counters.add(c)
        msgs = self.reassembler.feed(pk, batch.data)
        return msgs, self.nccl.feed(msgs)

    def flush(self) -> tuple[list[RdmaMessage], list[NcclSend]]:
        msgs = self.reassembler.flush()
        sends = self.nccl.feed(msgs)
        return msgs, sends + self.nccl.flush()
