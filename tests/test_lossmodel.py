"""FlowCheck Eq. 2 and the per-chunk model it comes from."""

from __future__ import annotations

import math

import numpy as np
import pytest
from mirrorckpt.parser import lossmodel


def test_paper_numbers():
    # Section 6.2: p = 1e-9, 16 M packets, DP group of 8: two monitors below 4e-3, three ~6e-12.
    two = lossmodel.eq2(1e-9, 2, 8, 16e6)
    three = lossmodel.eq2(1e-9, 3, 8, 16e6)
    assert two < 4e-3 and 3e-3 < two
    assert 1e-12 < three < 1e-11


def test_one_stream_always_misses_a_chunk():
    assert lossmodel.eq2(0.0, 1, 4, 100) == 1.0
    assert lossmodel.fail_probability(1e-3, lossmodel.copies(4, [(0, "egress")]), 100) == 1.0


def test_copies_follow_the_ring():
    # egress of r lacks chunk r+1; ingress of r lacks chunk r
    assert lossmodel.copies(4, [(0, "egress")]) == [1, 0, 1, 1]
    assert lossmodel.copies(4, [(0, "ingress")]) == [0, 1, 1, 1]
    assert lossmodel.copies(4, [(0, "egress"), (1, "egress")]) == [2, 1, 1, 2]
    # one port mirrored both ways holds every chunk
    assert min(lossmodel.copies(5, [(2, "both")])) == 1
    # M ranks' inbound streams: Eq. 2's copy counts
    for N in (3, 4, 8):
        for M in range(1, N + 1):
            c = lossmodel.copies(N, [(r, "ingress") for r in range(M)])
            assert sorted(c) == sorted([M - 1] * M + [M] * (N - M))


def test_eq2_equals_general_form_and_small_p_limit():
    p, N, K = 1e-4, 8, 8000
    for M in (2, 3):
        general = lossmodel.fail_probability(p, [M - 1] * M + [M] * (N - M), K)
        assert lossmodel.eq2(p, M, N, K) == pytest.approx(general)
    # two monitors, small total: about (M K / N) p
    assert lossmodel.eq2(1e-7, 2, N, K) == pytest.approx(2 * K / N * 1e-7, rel=1e-3)


@pytest.mark.parametrize("M", [2, 3])
def test_monte_carlo_agrees(M):
    N, per_chunk, p = 4, 40, 0.05 if M == 3 else 0.01
    rng = np.random.default_rng(7)
    trials = 4000
    cps = [M - 1] * M + [M] * (N - M)
    want = lossmodel.fail_probability(p, cps, per_chunk * N)
    got = lossmodel.simulate(p, cps, per_chunk, trials, rng)
    sigma = math.sqrt(want * (1 - want) / trials)
    assert abs(got - want) < 4 * sigma + 1e-9
