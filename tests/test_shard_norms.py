"""The global gradient norm of a sharded job agreed across appliance processes
(``shard_clip.StoreNormExchange``): two appliances, each with its own client of the appliances'
TCPStore and its own rings' updater threads, take for every iteration the coefficient the
in-process ``NormExchange`` computes from the same shards (bit-identical); an iteration one ring
has no norm for, skips, or a ring that ended, leaves every ring without one; a store that is gone
is said, not waited on."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from mirrorckpt.tools.testbed.harness import free_port
from mirrorckpt.updater.shard_clip import NormExchange, StoreNormExchange, local_norm

RINGS = ["sh0", "sh1", "sh2"]  # shard order
ITERATIONS = 12
MINE = {"appliance-0": ["sh0", "sh2"], "appliance-1": ["sh1"]}


def stores(n: int):
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, n, is_master=True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)
    return [master] + [dist.TCPStore("127.0.0.1", port, n, is_master=False, timeout=timedelta(seconds=10))
                       for _ in range(n - 1)]


def grads(iteration: int) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(iteration)
    return {r: [torch.randn(257, generator=g), torch.randn(33, generator=g)] for r in RINGS}


def run_rings(exchanges: dict[str, object], plan: dict[str, list[tuple[int, torch.Tensor | None]]]) -> dict:
    """Each ring's thread gives its (iteration, norm)s in turn to its appliance's exchange."""
    out: dict = {}

    def ring(name):
        ex = next(e for a, e in exchanges.items() if name in MINE.get(a, RINGS))
        for it, norm in plan[name]:
            out[(name, it)] = ex.coefficient(name, it, norm, timeout=10)
        ex.ended(name)

    threads = [threading.Thread(target=ring, args=(r,)) for r in plan]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a ring waits forever"
    return out


def test_appliances_agree_on_the_in_process_coefficient():
    master, client = stores(2)
    across = {"appliance-0": StoreNormExchange(RINGS, MINE["appliance-0"], 0.5, 2.0, master),
              "appliance-1": StoreNormExchange(RINGS, MINE["appliance-1"], 0.5, 2.0, client)}
    plan = {r: [(it, local_norm(grads(it)[r], 2.0)) for it in range(ITERATIONS)] for r in RINGS}
    got = run_rings(across, plan)
    want = run_rings({"one": NormExchange(RINGS, 0.5, 2.0)}, plan)
    for it in range(ITERATIONS):
        coef = want[("sh0", it)]
        assert coef is not None and float(coef) < 1.0  # clipped: the global norm is above 0.5
        for r in RINGS:
            assert torch.equal(got[(r, it)], coef), (r, it)
    # the order is the trainer's (ring positions): summed in another, the norm differs in its last bits
    swapped = run_rings({"one": NormExchange(list(reversed(RINGS)), 0.5, 2.0)}, plan)
    assert any(not torch.equal(swapped[("sh0", it)], want[("sh0", it)]) for it in range(ITERATIONS))


@pytest.mark.parametrize("where", ["across appliances", "in one process"])
def test_a_missing_norm_leaves_every_ring_without_a_coefficient(where):
    if where == "in one process":
        across = {"one": NormExchange(RINGS, 0.5, 2.0)}
    else:
        master, client = stores(2)
        across = {"appliance-0": StoreNormExchange(RINGS, MINE["appliance-0"], 0.5, 2.0, master),
                  "appliance-1": StoreNormExchange(RINGS, MINE["appliance-1"], 0.5, 2.0, client)}
    norm = {(r, it): local_norm(grads(it)[r], 2.0) for r in RINGS for it in range(ITERATIONS)}
    plan = {
        "sh0": [(0, norm[("sh0", 0)]), (1, norm[("sh0", 1)]), (2, norm[("sh0", 2)]), (3, norm[("sh0", 3)])],
        "sh1": [(0, None), (2, norm[("sh1", 2)])],  # 0 incomplete, 1 skipped, ended before 3
        "sh2": [(0, norm[("sh2", 0)]), (1, norm[("sh2", 1)]), (2, norm[("sh2", 2)]), (3, norm[("sh2", 3)])],
    }
    started = time.monotonic()
    got = run_rings(across, plan)
    assert time.monotonic() - started < 5, "a ring waited out its 10 s timeout for a norm that never comes"
    for r in RINGS:
        assert got.get((r, 0)) is None and got.get((r, 1)) is None and got.get((r, 3)) is None, r
        assert got[(r, 2)] is not None
    assert all(torch.equal(got[(r, 2)], got[("sh0", 2)]) for r in ("sh1", "sh2"))


def test_a_store_that_is_gone_is_said():
    master, client = stores(2)
    ex = StoreNormExchange(RINGS, MINE["appliance-1"], 0.5, 2.0, client)
    del master  # the store's host (rank 0's appliance) stopped
    assert ex.coefficient("sh1", 0, torch.tensor(1.0), timeout=5) is None
    assert ex.error is not None


def test_a_peer_that_never_gives_its_norm_times_out():
    (master,) = stores(1)
    ex = StoreNormExchange(RINGS, MINE["appliance-0"], 0.5, 2.0, master)
    assert ex.coefficient("sh0", 0, torch.tensor(1.0), timeout=0.2) is None
    assert ex.error is None  # late, not broken
