"""MirrorStreams reading ahead on its own thread hands on exactly what it hands on without it: the
same lists of sends in the same order, and each stream counted ended no earlier than its last
sends; an error of the thread comes out in the caller, and a caller that stops early stops it."""

from __future__ import annotations

import threading

import pytest
from common import PCAPS
from mirrorckpt.capture.pcapfile import open_capture
from mirrorckpt.parser.streams import MirrorStreams


def _sources(name: str, batch_frames: int):
    return [(str(p), open_capture(p, batch_frames=batch_frames)) for p in sorted((PCAPS / name).glob("*.pcap*"))]


def _walk(name: str, ahead: int, batch_frames: int = 8) -> tuple[list, MirrorStreams]:
    ms = MirrorStreams(_sources(name, batch_frames), ahead=ahead)
    seen = []
    for sends in ms:
        seen.append(([(s.stream, s.connection, s.seq, s.flag, s.ts_ns, s.psn, s.form, s.data.tobytes(), s.holes)
                      for s in sends], set(ms.ended)))
    return seen, ms


@pytest.mark.parametrize("name", ["demo", "simple_r3_both", "ll_r2_noise_faults"])
def test_reading_ahead_hands_on_the_same_sends_and_ends(name):
    want, plain = _walk(name, ahead=0)
    got, ahead = _walk(name, ahead=2)
    assert len(want) >= 3  # small batches: several lists, so the thread runs ahead of the caller
    assert got == want
    assert ahead.ended == plain.ended == set(range(plain.nstreams))
    assert [(s.frames, s.bytes) for s in ahead.stats] == [(s.frames, s.bytes) for s in plain.stats]
    assert ahead.counters.classes == plain.counters.classes


def test_an_error_of_the_reading_thread_comes_out_in_the_caller():
    def broken():
        yield from list(open_capture(PCAPS / "demo" / "rank0_egress.pcapng", batch_frames=64))[:3]
        raise RuntimeError("disk gone")

    ms = MirrorStreams([("x", broken())], ahead=2)
    with pytest.raises(RuntimeError, match="disk gone"):
        for _ in ms:
            pass


def test_a_caller_that_stops_early_stops_the_thread():
    ms = MirrorStreams(_sources("demo", 16), ahead=1)
    it = iter(ms)
    next(it)
    it.close()
    assert not [t for t in threading.enumerate() if t.name == "mirror-read"]


@pytest.mark.parametrize("name", ["ll_r2_noise_faults", "demo", "ll128_bf16_v229"])
def test_ll_read_while_reassembling_gives_the_sends_of_reading_it_after(name, monkeypatch):
    """Reassembly reads each whole message as LL while its packets are in cache (RdmaMessage.ll);
    the NCCL sends are those of decoding every message afterwards, on LL and on other protocols."""
    import numpy as np
    from mirrorckpt.capture._pack import copy_ranges
    from mirrorckpt.parser import _place, reassembly

    want, _ = _walk(name, ahead=0)
    used = []
    real = _place.gather_ll

    def spy(*a):
        real(*a)
        used.append(int((a[8] != 0).sum()))

    monkeypatch.setattr(reassembly._place, "gather_ll", spy)
    got, _ = _walk(name, ahead=0)
    assert got == want
    assert sum(used) > 0 if name != "ll128_bf16_v229" else sum(used) == 0  # LL messages read so, no others

    def copy_only(src, src_off, length, msg_rows, msg_bytes, buf, out_off, out, flags, *a):
        copy_ranges(src, src_off, buf, np.concatenate([[0], np.cumsum(length[:-1])]), length)
        flags[:] = 0

    monkeypatch.setattr(reassembly._place, "gather_ll", copy_only)
    assert _walk(name, ahead=0)[0] == want
