"""The packet path as one object: frame batches in, RDMA messages and NCCL sends out."""

from __future__ import annotations

from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.parser import roce
from mirrorckpt.parser.nccl import NcclDecoder, NcclSend
from mirrorckpt.parser.reassembly import MessageRun, RdmaMessage, Reassembler


class PacketPath:
    def __init__(self, icrc: bool = True, nccl_version: str | None = None, protocol: str | None = None,
                 psn_window: int = 1024, stream: int = 0, messages: bool = True):
        """``messages``: ``feed`` returns the RDMA messages too (inspection, tests); without, runs
        of intact messages go to the NCCL decoder as columns (its common case, nccl_runs) and
        ``feed`` returns no messages."""
        self.icrc = icrc
        self.counters = roce.Counters()
        self.reassembler = Reassembler(psn_window=psn_window, runs=not messages)
        self.nccl = NcclDecoder(version=nccl_version, protocol=protocol, stream=stream)
        self._unfilled: list[MessageRun] = []

    def feed(self, batch: FrameBatch) -> tuple[list[RdmaMessage], list[NcclSend]]:
        pk, _ = roce.decode(batch, icrc=self.icrc, into=self.counters)
        msgs = self.reassembler.feed(pk, batch.data)
        sends = self.nccl.feed(msgs)
        self._keep_unfilled(msgs)
        return (msgs if not self.reassembler.runs else []), sends

    def flush(self) -> tuple[list[RdmaMessage], list[NcclSend]]:
        msgs = self.reassembler.flush()
        sends = self.nccl.feed(msgs) + self.nccl.flush()
        self._keep_unfilled(msgs)
        return (msgs if not self.reassembler.runs else []), sends

    def defer_copies(self) -> None:
        """From now on the plain copy of Simple payloads from a batch into its runs is left to the
        reader of the sends (``take_unfilled``): the batches must stay valid after the next one."""
        self.reassembler.defer = True

    def _keep_unfilled(self, msgs: list) -> None:
        if self.reassembler.defer:
            self._unfilled += [m for m in msgs if type(m) is MessageRun and m.pending is not None]

    def take_unfilled(self) -> list[MessageRun]:
        """Runs fed since the last call whose payload is still in the batch: the reader calls
        ``fill`` on each before it reads a send made from them."""
        out, self._unfilled = self._unfilled, []
        return out
