"""The job's collectives with NCCL's ring plan of each: what the ring state machine expects.

NCCL picks the protocol per collective (its tuning model, from the size); the model takes it from
the collective (``CollSpec.protocol``), else from the ring when a job pins one, else from
``protocols``: collective shape -> protocol, as the traffic showed it (``parser.roce.infer``).
Equal shapes get equal protocols: NCCL's choice depends only on the size, kind and communicator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mirrorckpt.config.ddp import ALLGATHER, ALLREDUCE, BROADCAST, REDUCESCATTER, CollSpec
from mirrorckpt.config.layout import RingSpec, dtype_size
from mirrorckpt.parser.collectives import JobModel
from mirrorckpt.parser.errors import InferenceError
from mirrorckpt.parser.roce import schedule
from mirrorckpt.parser.roce.nccl_versions import AUTO, SIMPLE, protocol


def ring_threads(ring: RingSpec, proto: str) -> int | None:
    """maxThreads[RING][proto] the ring states: ``[ring] nthreads`` is the Simple thread count
    (NCCL_NTHREADS or the PCI-limited 256); LL and LL128 keep NCCL's defaults (None)."""
    return ring.nthreads if protocol(proto) == SIMPLE else None


def shape(c: CollSpec) -> tuple:
    """What NCCL's protocol choice depends on, for one communicator."""
    return (c.kind, c.count, c.dtype)


@dataclass
class NcclJobModel(JobModel):
    protocols: dict[tuple, str] = field(default_factory=dict)  # shape -> protocol (ring protocol "auto")

    def __post_init__(self):
        super().__post_init__()
        self._plans: dict[tuple, schedule.RingPlan] = {}

    @classmethod
    def from_job(cls, job) -> NcclJobModel:
        m = super().from_job(job)
        m.protocols.update(job.protocols)
        return m

    def protocol(self, c: CollSpec) -> str:
        p = c.protocol or (self.ring.protocol if self.ring.protocol != AUTO else self.protocols.get(shape(c)))
        if p is None:
            raise InferenceError(f"the protocol of {c.kind} of {c.count} x {c.dtype} ({c.label}) is not known: "
                                 "the traffic did not show it; pin [ring] protocol")
        return p

    def pinned(self, c: CollSpec) -> str | None:
        """The protocol of ``c`` if known, else None."""
        try:
            return self.protocol(c)
        except InferenceError:
            return None

    def plan(self, c: CollSpec) -> schedule.RingPlan:
        """The NCCL ring plan of a collective (cached by its shape)."""
        return self.plan_as(c, self.protocol(c))

    def plan_as(self, c: CollSpec, proto: str) -> schedule.RingPlan:
        """The plan of ``c`` if it ran under ``proto``."""
        r = self.ring
        key = (c.kind, c.count, c.dtype, c.root, proto, ring_threads(r, proto))
        p = self._plans.get(key)
        if p is None:
            if r.nccl_version is None:
                raise InferenceError("the NCCL version is not known: the traffic did not show it; "
                                     "state it (--nccl-version, [ring] nccl_version)")
            args = (c.count, dtype_size(c.dtype), r.nranks, r.nchannels, proto, r.nccl_version)
            nt = ring_threads(r, proto)
            if c.kind == ALLREDUCE:
                p = schedule.allreduce_plan(*args, nthreads=nt)
            elif c.kind == BROADCAST:
                p = schedule.broadcast_plan(*args, root=r.ring_index(0, c.root), nthreads=nt)
            elif c.kind == ALLGATHER:
                p = schedule.allgather_plan(*args, nthreads=nt)
            elif c.kind == REDUCESCATTER:
                p = schedule.reducescatter_plan(*args, nthreads=nt)
            else:
                raise ValueError(f"unknown collective kind {c.kind!r}")
            self._plans[key] = p
        return p
