"""How likely an iteration is lost to mirror packet loss (FlowCheck, section 6.2, Eq. 2).

In ring all-reduce the fully reduced chunks travel in the all-gather phase: rank r's egress
carries every chunk but (r+1) mod N, its ingress (rank r-1's egress) every chunk but r. With
several mirror streams a chunk may be carried several times; a reduced packet is lost only when
every copy of it is lost, and copies on different mirror links are lost independently. With
packet loss rate p and K packets of reduced data per iteration (K/N per chunk):

    P(fail) = 1 - prod_c (1 - p**copies(c)) ** (K/N)

FlowCheck's Eq. 2 is the case of M monitored ranks' inbound (or outbound) streams: M chunks have
M-1 copies and N-M have M copies:

    P(fail)_M = 1 - (1 - p**(M-1))**(M K / N) * (1 - p**M)**((N - M) K / N)
"""

from __future__ import annotations

import math

import numpy as np


def eq2(p: float, M: int, N: int, K: float) -> float:
    """FlowCheck Eq. 2: probability that an iteration cannot be reassembled."""
    if not 1 <= M <= N:
        raise ValueError(f"M = {M} mirrored ranks must be in 1..N = {N}")
    return fail_probability(p, [M - 1] * M + [M] * (N - M), K)


def fail_probability(p: float, copies: list[int], K: float) -> float:
    """1 - prod_c (1 - p**copies[c])**(K / N); computed in log space so tiny values survive."""
    N = len(copies)
    log_ok = 0.0
    for c in copies:
        q = p ** c if c > 0 else 1.0
        if q >= 1.0:
            return 1.0
        log_ok += (K / N) * math.log1p(-q)
    return -math.expm1(log_ok)


def copies(nranks: int, streams: list[tuple[int, str]]) -> list[int]:
    """How many of ``streams`` ((rank, "egress"|"ingress"|"both")) carry each chunk's final value.
    "both" counts as two streams, as two mirror directions of one port are."""
    out = [0] * nranks
    for rank, direction in streams:
        dirs = ("egress", "ingress") if direction == "both" else (direction,)
        for d in dirs:
            missing = (rank + 1) % nranks if d == "egress" else rank % nranks
            for c in range(nranks):
                if c != missing:
                    out[c] += 1
    return out


def simulate(p: float, copies_per_chunk: list[int], packets_per_chunk: int, trials: int,
             rng: np.random.Generator) -> float:
    """Monte Carlo of the model itself: fraction of iterations in which some reduced packet
    loses every copy (checks the algebra, not the pipeline)."""
    fails = 0
    for _ in range(trials):
        lost_all = False
        for c in copies_per_chunk:
            if c == 0:
                lost_all = True
                break
            if (rng.random((packets_per_chunk, c)) < p).all(axis=1).any():
                lost_all = True
                break
        fails += lost_all
    return fails / trials
