"""The packet path as one object: frame batches in, RDMA messages and NCCL sends out."""

from __future__ import annotations

import numpy as np
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.config.encap import EncapSpec
from mirrorckpt.parser import roce
from mirrorckpt.parser.roce import opcodes
from mirrorckpt.parser.roce.nccl import NcclDecoder, NcclSend
from mirrorckpt.parser.roce.reassembly import RdmaMessage, Reassembler


class PacketPath:
    def __init__(self, icrc: bool = True, nccl_version: str | None = None, protocol: str | None = None,
                 psn_window: int = 1024, stream: int = 0, messages: bool = True,
                 encapsulation: EncapSpec | None = None, blocks: bool = False):
        """``messages``: ``feed`` returns the RDMA messages too (inspection, tests); without, runs
        of intact messages go to the NCCL decoder as columns (its common case, nccl_runs) and
        ``feed`` returns no messages. ``encapsulation``: the mirror encapsulations taken off
        (None: whichever a frame carries). ``blocks``: sends whose bytes stay in their batch
        (``defer_copies``) come as ``SendBlock``s of columns, for a reader that places them with
        ``RingPlacer`` (``sends.flat`` makes them objects)."""
        self.icrc = icrc
        self.encapsulation = encapsulation
        self.counters = roce.Counters()
        self.reassembler = Reassembler(psn_window=psn_window, runs=not messages)
        self.nccl = NcclDecoder(version=nccl_version, protocol=protocol, stream=stream, blocks=blocks)
        # QPs (destination address, QP number) that carry SEND, READ or atomic requests: an RDMA
        # application's, never NCCL's; their packets from then on stay out of reassembly (their PSNs
        # interleave with the WRITEs', which would read as loss). Value: packets left out.
        self.verbs_qps: dict[tuple[bytes, int], int] = {}
        self.verbs_senders: dict[tuple[bytes, int], bytes] = {}  # of those QPs: who sent the first request

    def decode(self, batch: FrameBatch) -> roce.RocePackets:
        """The frame decode and ICRC check alone: compiled, so it may run ahead on another thread
        (``streams.MirrorStreams``), which then hands its packets to ``feed``."""
        # With deferred copies an intact LL message is read from what the decode read of its
        # packets (RocePackets.llu), not copied from the batch first
        return roce.decode(batch, icrc=self.icrc, into=self.counters, ll=self.reassembler.defer,
                           encapsulation=self.encapsulation)[0]

    def feed(self, batch: FrameBatch, pk: roce.RocePackets | None = None) -> tuple[list[RdmaMessage], list[NcclSend]]:
        if pk is None:
            pk = self.decode(batch)
        pk = self._leave_out_verbs(pk)
        msgs = self.reassembler.feed(pk, batch.data)
        sends = self.nccl.feed(msgs)
        return (msgs if not self.reassembler.runs else []), sends

    def _leave_out_verbs(self, pk: roce.RocePackets) -> roce.RocePackets:
        """``pk`` less the packets of QPs that carry SEND, READ or atomic requests, from each one's
        first such request on."""
        req = opcodes.OTHER_REQUEST[pk.opcode]
        start: dict[tuple[bytes, int], int] = {}  # QP -> first row left out in this batch
        if req.any():
            for i in np.flatnonzero(req).tolist():
                key = (pk.dst[i].tobytes(), int(pk.dqp[i]))
                start.setdefault(key, i)
                self.verbs_senders.setdefault(key, pk.src[i].tobytes())
        if not self.verbs_qps and not start:
            return pk
        cand = np.flatnonzero(np.isin(pk.dqp, [q for _, q in self.verbs_qps] + [q for _, q in start]))
        out = []
        for i in cand.tolist():
            key = (pk.dst[i].tobytes(), int(pk.dqp[i]))
            if key in self.verbs_qps or i >= start.get(key, len(pk)):
                out.append(i)
        for key in start:
            self.verbs_qps.setdefault(key, 0)
        for i in out:
            self.verbs_qps[(pk.dst[i].tobytes(), int(pk.dqp[i]))] += 1
        keep = np.ones(len(pk), bool)
        keep[out] = False
        return pk.take(np.flatnonzero(keep))

    def flush(self) -> tuple[list[RdmaMessage], list[NcclSend]]:
        msgs = self.reassembler.flush()
        sends = self.nccl.feed(msgs) + self.nccl.flush()
        return (msgs if not self.reassembler.runs else []), sends

    @property
    def holds_from(self) -> int | None:
        """With deferred copies: the address of the first byte before the last batch fed that its
        sends may still read (packets held from an earlier batch); None when there is none."""
        return self.reassembler.holds_from

    def defer_copies(self) -> None:
        """From now on a Simple send's payload is copied from its batch into its run's buffer only
        when its bytes are read (``nccl.LazySend``): the batches must stay valid after the next."""
        self.reassembler.defer = True
