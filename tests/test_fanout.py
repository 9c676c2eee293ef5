"""capture.fanout: one port's frames split over workers by QP pair."""

from __future__ import annotations

import glob
import json

import numpy as np
import pytest
from common import SHARED
from mirrorckpt.capture import fanout
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.capture.pcapfile import read_all
from mirrorckpt.parser import roce
from mirrorckpt.tools.generator.gen import GenConfig, generate
from mirrorckpt.tools.generator.noise import NoiseOptions


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    d = tmp_path_factory.mktemp("fanout")
    generate(GenConfig(ranks=3, channels=2, model="linear:3000", steps=2, seed=5, mirrors="0:both,1:both",
                       noise=NoiseOptions(frozenset({"probes", "tcp"}))), d)
    return d


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_every_frame_of_a_qp_pair_both_ways_goes_to_one_worker(generated, workers):
    """Data, ACKs and the CTS posted back on a QP pair (truth: the generator's ring QP pairs) all
    land in one worker; every frame in exactly one share; the pairs spread over the workers."""
    t = json.loads((generated / "truth.json").read_text())
    pairs = t["wire"]["topology"]["ring"]
    used = set()
    for f in sorted(generated.glob("*.pcap*")):
        b = read_all(f)
        w = fanout.worker_of(b, workers)
        parts = [fanout.share(b, k, workers) for k in range(workers)]
        assert sum(len(p) for p in parts) == len(b)
        assert np.array_equal(np.sort(np.concatenate([p.offset for p in parts])), np.sort(b.offset))
        pk, _ = roce.decode(b, icrc=False)
        for p in pairs:
            rows = pk.frame[np.isin(pk.dqp, [p["send_qpn"], p["recv_qpn"]]) & (pk.sport == p["sport"])]
            if len(rows):
                assert len(set(w[rows].tolist())) == 1, p
                used.add(int(w[rows][0]))
    assert len(used) > 1


def test_source_ports_agree_with_the_packet_decoder_on_every_real_capture():
    for f in sorted(glob.glob(str(SHARED / "captures" / "flowcheck" / "*.pcap*"))):
        b = read_all(f)
        pk, _ = roce.decode(b, icrc=False)
        sp = fanout.udp_source_ports(b)
        assert np.array_equal(sp[pk.frame], pk.sport), f
        assert fanout.worker_of(b, 3).max() <= 2


def frame(eth: bytes) -> FrameBatch:
    data = np.frombuffer(eth, np.uint8)
    return FrameBatch(data, np.array([0]), np.array([len(eth)]), np.array([len(eth)]), np.array([0]),
                      np.array([0], np.int32))


def test_header_forms_and_foreign_frames():
    mac = b"\x02" * 12
    udp = (0xC123).to_bytes(2, "big") + (4791).to_bytes(2, "big") + b"\x00" * 4
    v4 = b"\x45" + b"\x00" * 8 + b"\x11" + b"\x00" * 10
    v4_opts = b"\x46" + b"\x00" * 8 + b"\x11" + b"\x00" * 14  # IHL 6: one option word
    v6 = b"\x60" + b"\x00" * 5 + b"\x11" + b"\x00" * 33
    tag = (0x8100).to_bytes(2, "big") + b"\x00\x05"
    cases = {
        mac + b"\x08\x00" + v4 + udp: 0xC123,
        mac + b"\x08\x00" + v4_opts + udp: 0xC123,
        mac + b"\x86\xdd" + v6 + udp: 0xC123,
        mac + tag + b"\x86\xdd" + v6 + udp: 0xC123,
        mac + tag + tag + b"\x08\x00" + v4 + udp: 0xC123,
        mac + b"\x08\x00" + v4.replace(b"\x11", b"\x06", 1) + udp: -1,  # TCP
        mac + b"\x08\x06" + b"\x00" * 28: -1,  # ARP
        mac + b"\x08\x00" + v4: -1,  # cut before the UDP header
        mac[:10]: -1,
    }
    for eth, want in cases.items():
        assert fanout.udp_source_ports(frame(eth)).tolist() == [want], eth.hex()
        assert fanout.worker_of(frame(eth), 5).tolist() == [want % 5 if want >= 0 else 0]
