"""DDP's wire facts as the parser uses them, checked against torch's own implementation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mirrorckpt.config import ddp


@pytest.mark.parametrize("seed", range(20))
def test_size_groups_equal_torch(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 5000, size=rng.integers(1, 30)).tolist()
    limit = int(rng.integers(100, 40000))
    metas = [torch.empty(n, dtype=torch.uint8, device="meta") for n in sizes]
    want, _ = dist._compute_bucket_assignment_by_size(metas, [limit], [], [])
    assert ddp.size_groups(sizes, limit) == [list(g) for g in want]


def test_parse_shapes_round_trip():
    shapes = [(1, 5000), (64,), (3, 4, 5), (7, 1)]
    meta = []
    for s in shapes:
        t = torch.empty(s)
        meta += list(t.shape) + list(t.stride())
    got = ddp.parse_shapes(np.array(meta), len(shapes))
    assert [int(np.prod(s)) for s in got] == [int(np.prod(s)) for s in shapes]
    assert got[:3] == shapes[:3]
    with pytest.raises(ValueError):
        ddp.parse_shapes(np.array([3, 4, 5]))
    with pytest.raises(ValueError):
        ddp.parse_shapes(np.array(meta), len(shapes) + 5)


def test_parse_rebuild_checks_consistency():
    b = ddp.parse_rebuild(np.array([2, 1, 0, 2]), np.array([1, 2]), 3)
    assert [x.params for x in b] == [(2,), (1, 0)]
    for idx, sizes in (([2, 1, 0, 3], [1, 2]), ([2, 1, 1, 2], [1, 2]), ([2, 1, 0, 2], [2, 2])):
        with pytest.raises(ValueError):
            ddp.parse_rebuild(np.array(idx), np.array(sizes), 3)


def test_parse_shapes_gives_up_on_garbage_at_once():
    """Another collective's bytes read as the shapes broadcast (a PAT all-gather in its place) were
    backtracked exponentially: doctor spent minutes in it. Dead ends are remembered, a parameter
    takes two values at least, a tensor 64 dimensions at most, and the tries are budgeted."""
    import time

    start = time.monotonic()
    for n, count in ((400, 10**6), (4000, 10**6), (127, 40), (2001, 300), (1000, None)):
        with pytest.raises(ValueError):
            ddp.parse_shapes(np.ones(n, np.int64) + (n == 1000), count)
    assert time.monotonic() - start < 30  # minutes before; about 2 s on a loaded 2-core machine
