"""The job's collectives in issue order, on its ring: what a placer expects to see.

A ``JobModel`` is a start-up prefix, an optional set of collectives issued once before
iteration 1 (DDP's bucket rebuild), and per iteration the gradient all-reduces. Collective ``i``
is computed on demand, so the sequence has no end. How each collective crosses the wire is the
transport's: NCCL's plan of each is ``parser.roce.collectives.NcclJobModel``'s.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from mirrorckpt.config import ddp
from mirrorckpt.config.ddp import ALLREDUCE, CollSpec
from mirrorckpt.config.layout import JobLayout, RingSpec

CACHED_COLLECTIVES = 1 << 16  # JobModel's collectives kept made (each is remade on demand)
CACHED_ITERATIONS = 64  # and its iterations' lists (0-2 always)


@dataclass
class JobModel:
    ring: RingSpec
    layout: JobLayout | None = None  # None: gradient all-reduces are given by `per_iteration`
    startup: list[CollSpec] = field(default_factory=list)
    before_iteration_1: list[CollSpec] = field(default_factory=list)
    per_iteration: list[CollSpec] | None = None  # used when there is no layout
    iterations: int | None = None  # how many iterations the sequence holds (None: no end)
    from_start: bool = True  # the capture begins with the job (False: attached mid-run)
    # the parameters the start-up broadcasts "init_params:K" carry, in K order, when not ``layout``'s
    # (a sharded optimizer's ring: the whole model, config.shard_steps)
    weights: JobLayout | None = None

    @property
    def weights_layout(self) -> JobLayout | None:
        """The layout of the initial weights the start-up broadcasts carry (DDP: ``layout``)."""
        return self.weights if self.weights is not None else self.layout

    @classmethod
    def ddp(cls, ring: RingSpec, layout: JobLayout, with_startup: bool = True, iterations: int | None = None):
        """A DDP job: start-up collectives, the rebuild broadcasts, one all-reduce per bucket."""
        rebuilt = with_startup and not layout.used_map  # find_unused_parameters never rebuilds
        return cls(ring, layout, ddp.startup(layout) if with_startup else [],
                        ddp.rebuild(layout) if rebuilt else [], iterations=iterations,
                        from_start=with_startup)

    @classmethod
    def from_job(cls, job) -> JobModel:
        """The model a job file (``config.jobfile.JobConfig``) describes."""
        if job.kind == "ddp" and job.layout is None:
            raise ValueError(f"{job.path or 'the job file'}: no [[job.params]] layout (a trainer registers it "
                             "with `serve`; a replay without --config infers it from the traffic)")
        if job.kind == "ddp":
            return cls.ddp(job.ring, job.layout, with_startup=job.startup)
        return cls.allreduces(job.ring, job.counts, job.grad_dtype)

    @classmethod
    def sharded(cls, ring: RingSpec, steps):
        """One ring of a sharded-optimizer job (``config.shard_steps.RingSteps``): its start-up
        collectives, then per iteration the framework's sequence."""
        if ring.nranks != len(steps.ranks):
            raise ValueError(f"the ring has {ring.nranks} ranks, its communicator {len(steps.ranks)}")
        return cls(ring, None, list(steps.startup), per_iteration=list(steps.per_iteration), weights=steps.weights)

    @classmethod
    def allreduces(cls, ring: RingSpec, counts: list[int], dtype: str, iterations: int | None = None):
        """Plain all-reduces (no DDP): each iteration all-reduces ``counts`` in order."""
        per = [CollSpec(ALLREDUCE, n, dtype, "grad", bucket=k) for k, n in enumerate(counts)]
        return cls(ring, None, per_iteration=per, iterations=iterations)

    def __post_init__(self):
        self._cache: dict[int, CollSpec | None] = {}
        self._iterations: dict[int, tuple[CollSpec, ...]] = {}

    def _iteration(self, i: int) -> tuple[CollSpec, ...]:
        # kept: every new collective a state machine tabulates locates itself through iterations 0-2
        got = self._iterations.get(i)
        if got is None:
            if self.layout is not None:
                grads = ddp.iteration(self.layout, i)
            else:
                grads = [CollSpec(c.kind, c.count, c.dtype, c.label, c.root, i, c.bucket, c.protocol)
                         for c in self.per_iteration]
            if len(self._iterations) >= CACHED_ITERATIONS:
                for k in [k for k in self._iterations if k > 2]:
                    del self._iterations[k]
            got = self._iterations[i] = tuple((self.before_iteration_1 if i == 1 else []) + grads)
        return got

    def grads(self, i: int) -> list[CollSpec]:
        """Iteration ``i``'s gradient all-reduces, bucket by bucket."""
        return [c for c in self._iteration(i) if c.label == "grad"]

    def _locate(self, k: int) -> tuple[int, int]:
        """(iteration, position in it) of the k-th collective after the start-up. Iterations 0
        and 1 may differ in length; from 2 on every iteration has the same collectives."""
        for i in (0, 1):
            n = len(self._iteration(i))
            if k < n:
                return i, k
            k -= n
        n = len(self._iteration(2))
        if not n:  # iterations of no collective: the sequence ends with its start-up
            return 2, k
        return 2 + k // n, k % n

    def __getitem__(self, index: int) -> CollSpec | None:
        """Collective ``index`` (0-based, issue order), or None past the end of the sequence."""
        if index < 0:
            raise IndexError(index)
        if index < len(self.startup):
            return self.startup[index]
        c = self._cache.get(index)
        if c is None:
            i, j = self._locate(index - len(self.startup))
            its = self._iteration(i)
            if (self.iterations is not None and i >= self.iterations) or j >= len(its):
                return None
            c = self._cache[index] = its[j]
            if len(self._cache) > CACHED_COLLECTIVES:  # a daemon runs for weeks: the oldest go (recomputed if asked)
                for k in list(itertools.islice(self._cache, CACHED_COLLECTIVES // 2)):
                    del self._cache[k]
        return c

    def first_of_iteration(self, i: int) -> int:
        """Index of iteration ``i``'s first collective."""
        n = [len(self._iteration(j)) for j in range(min(i, 3))]
        if i <= 2:
            return len(self.startup) + sum(n)
        return len(self.startup) + n[0] + n[1] + (i - 2) * n[2]
