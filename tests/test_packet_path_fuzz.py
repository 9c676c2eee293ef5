"""Fuzzing the decoder stack on mutated real captures: decode, PSN reassembly, NCCL sends and the
inference/replay back half must never crash or hang, whatever the bytes. The ICRC check is off
so that mutated packets reach the deeper layers instead of being dropped at the door."""

from __future__ import annotations

from common import FLOWCHECK
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.capture.pcapfile import read_all
from mirrorckpt.parser.errors import InferenceError
from mirrorckpt.parser.roce.jobstream import JobStream
from mirrorckpt.parser.roce.packet_path import PacketPath

BASE = {n: read_all(FLOWCHECK / n) for n in ("iter_40000_p2p_iter10.pcapng", "rdma32.pcapng")}
FRAMES = {n: [b.frame(i) for i in range(len(b))] for n, b in BASE.items()}
# Header bytes are where mutations hurt most: Ethernet..BTH+RETH+ImmDt of an IPv6 RoCE frame.
HOT = list(range(12, 14)) + list(range(14 + 4, 14 + 8)) + list(range(54, 54 + 8 + 12 + 16 + 4))


@st.composite
def mutated(draw):
    name = draw(st.sampled_from(sorted(FRAMES)))
    frames = list(FRAMES[name])
    for _ in range(draw(st.integers(1, 40))):
        i = draw(st.integers(0, len(frames) - 1))
        f = bytearray(frames[i])
        kind = draw(st.sampled_from(["hot", "any", "cut", "dup", "swap", "drop", "grow"]))
        if kind in ("hot", "any") and f:
            pos = draw(st.sampled_from(HOT)) if kind == "hot" else draw(st.integers(0, len(f) - 1))
            if pos < len(f):
                f[pos] = draw(st.integers(0, 255))
            frames[i] = bytes(f)
        elif kind == "cut":
            frames[i] = bytes(f[: draw(st.integers(0, len(f)))])
        elif kind == "dup":
            frames.insert(i, frames[i])
        elif kind == "swap" and i + 1 < len(frames):
            frames[i], frames[i + 1] = frames[i + 1], frames[i]
        elif kind == "drop" and len(frames) > 1:
            del frames[i]
        elif kind == "grow":
            frames[i] = bytes(f) + bytes(draw(st.integers(1, 3000)))
    return frames


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_decoder_stack_survives(frames):
    batch = FrameBatch.from_frames(frames, "fuzz")
    pp = PacketPath(icrc=False)
    msgs, sends = pp.feed(batch)
    m2, s2 = pp.flush()
    for m in msgs + m2:
        assert len(m.data) <= 64 << 20
        assert all(0 <= a and n > 0 and a + n <= max(len(m.data), a + n) for a, n in m.holes)

    class One:  # a parser.streams.SendStream of one batch
        decoders = [pp.nccl]
        nstreams, ended, stats = 1, set(), []

        def __iter__(self):
            yield sends + s2

    try:
        for _ in JobStream(One(), dtype="float32"):
            pass
    except InferenceError:
        pass  # a clear verdict, not a crash


def test_huge_reth_length_is_not_allocated():
    frames = list(FRAMES["iter_40000_p2p_iter10.pcapng"])
    batch = BASE["iter_40000_p2p_iter10.pcapng"]
    from mirrorckpt.parser import roce
    from mirrorckpt.parser.roce import opcodes
    pk, _ = roce.decode(batch)
    i = int(pk.frame[pk.opcode == opcodes.RC_RDMA_WRITE_FIRST][0])
    f = bytearray(frames[i])
    f[54 + 8 + 12 + 12: 54 + 8 + 12 + 16] = (0xFFFFFFF0).to_bytes(4, "big")  # RETH DMA length
    frames[i] = bytes(f)
    pp = PacketPath(icrc=False)
    msgs, _ = pp.feed(FrameBatch.from_frames(frames))
    msgs += pp.flush()[0]
    assert max(len(m.data) for m in msgs) <= 64 << 20
    assert sum(q.stats.malformed for q in pp.reassembler.qps.values()) >= 1
