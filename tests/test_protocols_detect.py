"""Telling LL, LL128 and Simple apart from the payload alone, including the hard cases: constant
or zero data (dead ReLU gradients) and lines lost to holes."""

from __future__ import annotations

import numpy as np
import pytest
from mirrorckpt.parser.roce import protocols
from mirrorckpt.parser.roce.nccl import decode, detect

RNG = np.random.default_rng(5)


@pytest.mark.parametrize("data", [
    np.zeros(16384, np.uint8),
    np.full(16384, 0x3F, np.uint8),
    RNG.integers(0, 256, 16384, dtype=np.uint8),
    RNG.integers(0, 256, 1928 * 4, dtype=np.uint8),
], ids=["zeros", "constant", "random", "odd-size"])
@pytest.mark.parametrize("proto", ["LL", "LL128"])
def test_detects_its_own_encoding(proto, data):
    wire = protocols.encode(proto, data, flag=41)
    assert detect(wire, []) == proto
    user, holes, flag = decode(proto, wire, [])
    assert flag == 41 and holes == [] and np.array_equal(user[: len(data)], data)


def test_simple_payloads_stay_simple():
    for data in (RNG.integers(0, 256, 8192, dtype=np.uint8), np.zeros(8192, np.uint8),
                 np.arange(4096, dtype=np.float32).view(np.uint8)):
        assert detect(data, []) == "Simple"


def test_holes_do_not_confuse_detection_and_become_data_holes():
    data = RNG.integers(0, 256, 16384, dtype=np.uint8)
    wire = protocols.encode("LL", data, flag=9)
    wire[1024:2048] = 0  # a lost packet: zeros in the reassembled buffer
    assert detect(wire, [(1024, 1024)]) == "LL"
    user, holes, flag = decode("LL", wire, [(1024, 1024)])
    assert flag == 9 and holes == [(512, 512)]
    assert np.array_equal(user[:512], data[:512]) and np.array_equal(user[1024:], data[1024:])
