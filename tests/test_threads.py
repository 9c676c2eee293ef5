"""Issue 13: the Simple thread count (maxThreads[RING][Simple], 512 by default, 256 on a
PCI-limited ring). ``[ring] nthreads`` applies to Simple collectives only; replay infers it from
the message sizes where the 256- and 512-thread plans differ."""

from __future__ import annotations

from mirrorckpt.config.ddp import ALLREDUCE, CollSpec
from mirrorckpt.config.layout import RingSpec
from mirrorckpt.parser.collectives import JobModel


def _model(nthreads, nchannels=1, version="2.18"):
    ring = RingSpec(nranks=2, nchannels=nchannels, protocol="auto", nccl_version=version, nthreads=nthreads)
    m = JobModel.allreduces(ring, [9010, 100], "float32")
    m.protocols[(ALLREDUCE, 9010, "float32")] = "Simple"
    m.protocols[(ALLREDUCE, 100, "float32")] = "LL"
    return m


def test_ring_nthreads_applies_to_simple_collectives_only():
    simple, ll = CollSpec(ALLREDUCE, 9010, "float32", "grad"), CollSpec(ALLREDUCE, 100, "float32", "grad")
    pci, default = _model(256), _model(None)
    assert pci.plan(simple).nthreads == 256 + 32 and default.plan(simple).nthreads == 512 + 32
    # 4505 elements per rank: rounded to 256 threads' 512 elements (4608), to 512 threads' 1024 (5120)
    assert pci.plan(simple).messages(0, 0)[0].nelem != default.plan(simple).messages(0, 0)[0].nelem
    # the LL all-reduce keeps LL's own default, whatever the Simple thread count
    assert pci.plan(ll).nthreads == default.plan(ll).nthreads
    assert pci.plan(ll).messages(0, 0) == default.plan(ll).messages(0, 0)
    # LL128 likewise
    assert pci.plan_as(ll, "LL128").nthreads == default.plan_as(ll, "LL128").nthreads
