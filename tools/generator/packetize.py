"""``NcclRing``: the trainer's Comm on a simulated NCCL ring over RoCEv2.

Every collective call gets NCCL's plan (``parser.schedule``: channels and threads chosen for its
size, chunks, message order, connection steps), the values each message carries, computed in
NCCL's reduction order with ``parser.ringreduce.add`` (chunk c is summed along the ring from
position c+1, the owner adding its own input last; each partial sum rounded in the element type,
as it travels), and is put on the wire by ``wire.Wire``. The all-reduce result it returns is the
one NCCL produces. All collectives share the ring connections, so flags, CTS indices, PSNs and
receive slots continue from one collective to the next.
"""

from __future__ import annotations

import numpy as np
from mirrorckpt.config.layout import RingSpec
from mirrorckpt.parser.roce import nccl_versions as nv
from mirrorckpt.parser.roce import ringreduce, schedule
from mirrorckpt.parser.roce.collectives import ring_threads
from mirrorckpt.tools.generator import tuning
from mirrorckpt.tools.generator.topology import P2P_CHUNK_BYTES, Topology
from mirrorckpt.tools.generator.wire import Layer, P2pMsg, Wire, Work


def dtype_name(a: np.ndarray) -> str:
    # uint16 on the wire is always bfloat16 (config.layout.numpy_dtype)
    return ringreduce.BF16 if a.dtype == np.uint16 else a.dtype.name


def payload_bytes(a: np.ndarray) -> np.ndarray:
    """A message's user bytes: ``a`` little-endian, flat."""
    return np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).view(np.uint8).reshape(-1)


class AllReduceValues:
    """What each all-reduce message carries, computed step by step as the slots advance: per
    channel and loop one accumulator per chunk, ``acc[c]`` holding the sum of the s+1 inputs from
    ring position c+1 on at ring step s; its final value (s >= R-1) is the result."""

    def __init__(self, plan: schedule.AllReducePlan, inputs: list[np.ndarray], orders: list[list[int]]):
        self.plan, self.R = plan, plan.nranks
        self.dtype = dtype_name(inputs[0])
        self.result = np.empty(plan.count, inputs[0].dtype)
        self.covered = np.zeros(plan.count, bool)
        self.xs = {ch: [inputs[orders[ch][p]].reshape(-1) for p in range(self.R)] for ch in plan.channels}
        self.lead = {ch: plan.messages(0, ch) for ch in plan.channels}  # slot -> (loop, step)
        self.at: dict[int, tuple[int, int]] = {}
        self.acc: dict[int, list[np.ndarray]] = {}

    def begin_slot(self, g: int) -> None:
        for ch, msgs in self.lead.items():
            if g < len(msgs) and self.at.get(ch) != (msgs[g].loop, msgs[g].step):
                self._advance(ch, msgs[g].loop, msgs[g].step)

    def _advance(self, ch: int, loop: int, step: int) -> None:
        chunks, xs, R = self.plan.loops(ch)[loop], self.xs[ch], self.R
        if step == 0:
            self.acc[ch] = [xs[(c + 1) % R][off:off + n].copy() for c, (off, n) in enumerate(chunks)]
        elif step <= R - 1:
            acc = self.acc[ch]
            for c, (off, n) in enumerate(chunks):
                acc[c] = ringreduce.add(acc[c], xs[(c + step + 1) % R][off:off + n], self.dtype)
        if step == R - 1:
            for c, (off, n) in enumerate(chunks):
                self.result[off:off + n] = self.acc[ch][c]
                self.covered[off:off + n] = True
        self.at[ch] = (loop, step)

    def payload(self, w: Work, msg: schedule.RingStep) -> np.ndarray:
        off = self.plan.loops(w.channel)[msg.loop][msg.chunk][0]
        rel = msg.offset - off
        return payload_bytes(self.acc[w.channel][msg.chunk][rel:rel + msg.nelem])


class CopyValues:
    """Broadcast and all-gather messages carry one rank's data unchanged."""

    def __init__(self, by_origin):
        self.by_origin = by_origin  # (channel, chunk) -> the array the message's range is taken from

    def begin_slot(self, g: int) -> None:
        pass

    def payload(self, w: Work, msg) -> np.ndarray:
        return payload_bytes(self.by_origin(w.channel, msg.chunk)[msg.offset:msg.offset + msg.nelem])


class SliceValues:
    """Point-to-point sends of ranges of one array."""

    def __init__(self, data: np.ndarray):
        self.data = data

    def begin_slot(self, g: int) -> None:
        pass

    def payload(self, w: Work, msg: P2pMsg) -> np.ndarray:
        return payload_bytes(self.data[msg.offset:msg.offset + msg.nelem])


class NcclRing:
    """Comm for ``ring.nranks`` ranks; emits through ``wire`` (its sink writes the mirrors)."""

    def __init__(self, ring: RingSpec, topo: Topology, wire: Wire, p2p_fill: bool = False,
                 p2p_noise: tuple[int, ...] = (), seed: int = 0):
        if not 2 <= ring.nranks <= 16:
            raise ValueError(f"the generator simulates 2..16 ranks, not {ring.nranks}")
        self.ring, self.topo, self.wire = ring, topo, wire
        self.orders = ring.orders()
        self.protocol = ring.protocol if ring.protocol == nv.AUTO else nv.protocol(ring.protocol)
        self.fabric = tuning.Fabric()
        self.version = nv.version(ring.nccl_version)
        self.p2p_fill = p2p_fill
        self.p2p_noise = tuple(p2p_noise)
        self._noise_rng = np.random.default_rng([seed, 0x9292])
        self.index = 0  # collectives issued (the trainer's record numbers them the same way)
        self.plans: list[dict] = []
        self._iteration = None

    # -- Comm ------------------------------------------------------------------------------------

    def proto(self, kind: str, nbytes: int) -> str:
        """The collective's protocol: the pinned one, or NCCL's tuning-model choice ("auto")."""
        if self.protocol != nv.AUTO:
            return self.protocol
        return tuning.choose(kind, nbytes, self.ring.nranks, self.ring.nchannels, self.fabric)

    def all_gather(self, per_rank: list[np.ndarray], what: str) -> list[np.ndarray]:
        self._check(per_rank, what)
        a = per_rank[0]
        proto = self.proto(nv.ALLGATHER, a.nbytes * self.ring.nranks)
        plan = schedule.allgather_plan(a.size, a.itemsize, self.ring.nranks, self.ring.nchannels, proto,
                                       self.version, nthreads=ring_threads(self.ring, proto))
        src = CopyValues(lambda ch, chunk: per_rank[self.orders[ch][chunk]].reshape(-1))
        self._run(nv.ALLGATHER, what, a, {None: plan}, src)
        return [np.array(x, copy=True) for x in per_rank]

    def broadcast(self, data: np.ndarray, root: int, what: str) -> np.ndarray:
        if not 0 <= root < self.ring.nranks:
            raise ValueError(f"{what}: broadcast root {root} is outside 0..{self.ring.nranks - 1}")
        flat = np.ascontiguousarray(data).reshape(-1)
        proto = self.proto(nv.BROADCAST, flat.nbytes)
        plans = {}
        for ch in range(self.ring.nchannels):
            pos = self.ring.ring_index(ch, root)
            if pos not in plans:
                plans[pos] = schedule.broadcast_plan(flat.size, flat.itemsize, self.ring.nranks,
                                                     self.ring.nchannels, proto, self.version, root=pos,
                                                     nthreads=ring_threads(self.ring, proto))
        self._run(nv.BROADCAST, what, flat, plans, CopyValues(lambda ch, chunk: flat), root=root)
        return np.array(data, copy=True)

    def all_reduce(self, per_rank: list[np.ndarray], what: str) -> np.ndarray:
        self._check(per_rank, what)
        a = per_rank[0]
        proto = self.proto(nv.ALLREDUCE, a.nbytes)
        plan = schedule.allreduce_plan(a.size, a.itemsize, self.ring.nranks, self.ring.nchannels, proto,
                                       self.version, nthreads=ring_threads(self.ring, proto))
        vals = AllReduceValues(plan, [np.ascontiguousarray(x).reshape(-1) for x in per_rank], self.orders)
        self._run(nv.ALLREDUCE, what, a, {None: plan}, vals)
        if not vals.covered.all():
            raise AssertionError(f"{what}: the plan left element {int(np.argmin(vals.covered))} unreduced")
        if self.p2p_fill and what.startswith("grad:"):
            self._fill(plan, vals.result, what)
        if self.p2p_noise and what.startswith("grad:"):
            self._noise(vals.result, what)
        return vals.result.reshape(a.shape)

    def emit(self, kind: str, what: str, a: np.ndarray, plan, source) -> None:
        """Put one collective this class does not compute itself on the wire (a sharded optimizer's
        reduce-scatter, tools.generator.sharded_wire): ``plan``'s messages carrying ``source``'s values."""
        self._run(kind, what, a, {None: plan}, source)

    # -- internals -------------------------------------------------------------------------------

    def _check(self, per_rank: list[np.ndarray], what: str) -> None:
        if len(per_rank) != self.ring.nranks:
            raise ValueError(f"{what}: {len(per_rank)} buffers for {self.ring.nranks} ranks")
        if len({(a.dtype, a.size) for a in per_rank}) != 1:
            raise ValueError(f"{what}: ranks disagree on dtype or size")

    def _gap(self, what: str) -> int:
        """Compute time before a collective: a whole iteration's forward and backward before its
        first gradient bucket, a short pause otherwise."""
        o = self.wire.opts
        if what.startswith("grad:"):
            it = what.split(":")[1]
            if it != self._iteration:
                self._iteration = it
                return o.iteration_gap_ns
        return o.collective_gap_ns

    def _run(self, kind: str, what: str, a: np.ndarray, plans: dict, source, root: int = 0) -> None:
        works = []
        any_plan = next(iter(plans.values()))
        for ch in any_plan.channels:
            if kind == nv.BROADCAST:
                rpos = self.ring.ring_index(ch, root)
                plan = plans[rpos]
            else:
                rpos, plan = 0, any_plan
            for pos in range(self.ring.nranks):
                conn = self.wire.conn((ch, pos), self.topo.pair(ch, pos))
                delay = (pos - rpos) % self.ring.nranks if kind == nv.BROADCAST else 0
                works.append(Work(conn, plan.messages(pos, ch), delay=delay, channel=ch, pos=pos))
        label = {"collective": self.index, "what": what, "kind": kind}
        self.plans.append({"collective": self.index, "what": what, "kind": kind, "dtype": dtype_name(a),
                           "count": int(a.size), "channels": any_plan.nchannels, "nthreads": any_plan.nthreads,
                           "used_channels": any_plan.channels, "protocol": any_plan.protocol})
        self.wire.run(works, Layer(any_plan.protocol, kind), source, label, self._gap(what))
        self.index += 1

    def _noise(self, result: np.ndarray, what: str) -> None:
        """Rank 0 sends its next rank, point to point on the connection ``_fill`` uses, one message of
        each ``p2p_noise`` size (bytes) of values that are not the all-reduce's (a pipeline activation,
        a tensor-parallel exchange): foreign sends as large as pieces of the result."""
        dst = self.orders[0][1]
        pair = self.topo.p2p_pair(0, dst, self.version)
        conn = self.wire.conn(("p2p", 0, dst), pair)
        es = result.itemsize
        vals = self._noise_rng.standard_normal(sum(self.p2p_noise) // es).astype(result.dtype)
        msgs, lo = [], 0
        for k, nbytes in enumerate(self.p2p_noise):
            if nbytes % es or not 0 < nbytes <= P2P_CHUNK_BYTES:
                raise ValueError(f"p2p noise message of {nbytes} bytes: not a positive multiple of {es} "
                                 f"up to {P2P_CHUNK_BYTES}")
            msgs.append(P2pMsg(nbytes, k, lo, nbytes // es))
            lo += nbytes // es
        label = {"collective": None, "what": f"p2p_noise:{what}", "kind": "p2p"}
        self.wire.run([Work(conn, msgs, channel=-1)], Layer(nv.SIMPLE, nv.BROADCAST, p2p=True),
                      SliceValues(vals), label, self.wire.opts.collective_gap_ns)

    def _fill(self, plan: schedule.AllReducePlan, result: np.ndarray, what: str) -> None:
        """Rank 0 sends its next rank, point to point, the final values its egress lacks (the extra
        Simple sends of the iter_40000_p2p_iter10 capture; off unless asked for)."""
        dst = self.orders[0][1]
        pair = self.topo.p2p_pair(0, dst, self.version)
        conn = self.wire.conn(("p2p", 0, dst), pair)
        msgs, k = [], 0
        per = P2P_CHUNK_BYTES // result.itemsize
        for ch in plan.channels:
            for off, n in plan.missing_chunk_ranges(self.ring.ring_index(ch, 0), ch):
                for lo in range(off, off + n, per):
                    m = min(per, off + n - lo)
                    msgs.append(P2pMsg(m * result.itemsize, k, lo, m))
                    k += 1
        label = {"collective": None, "what": f"p2p_fill:{what}", "kind": "p2p"}
        self.wire.run([Work(conn, msgs, channel=-1)], Layer(nv.SIMPLE, nv.BROADCAST, p2p=True),
                      SliceValues(result.reshape(-1)), label, self.wire.opts.collective_gap_ns)
