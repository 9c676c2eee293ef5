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
from mirrorckpt.tools.generator import algorithms as algo
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
                 p2p_noise: tuple = (), seed: int = 0, algorithm: str = algo.RING):
        if not 2 <= ring.nranks <= 16:
            raise ValueError(f"the generator simulates 2..16 ranks, not {ring.nranks}")
        if algorithm not in algo.ALGORITHMS:
            raise ValueError(f"algorithm {algorithm!r} is not one of {', '.join(algo.ALGORITHMS)}")
        if algorithm == algo.PAT and nv.version(ring.nccl_version) < nv.PAT_SINCE:
            raise ValueError(f"NCCL {ring.nccl_version} has no PAT (it came with {nv.PAT_SINCE})")
        self.algorithm = algorithm  # the gradient all-reduces' (tree, nvls, collnet) or all-gathers' (pat)
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
        if self.algorithm == algo.PAT:
            self._pat(per_rank, what)
            return [np.array(x, copy=True) for x in per_rank]
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
        if self.algorithm in (algo.TREE, algo.NVLS, algo.COLLNET):
            return self._off_ring(per_rank, what).reshape(a.shape)
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
        label = self._record(kind, what, a, any_plan.nchannels, any_plan.nthreads, any_plan.channels,
                             any_plan.protocol)
        self.wire.run(works, Layer(any_plan.protocol, kind), source, label, self._gap(what))
        self.index += 1

    def _record(self, kind: str, what: str, a: np.ndarray, nchannels: int, nthreads, used: list, proto: str,
                algorithm: str = algo.RING) -> dict:
        rec = {"collective": self.index, "what": what, "kind": kind, "dtype": dtype_name(a), "count": int(a.size),
               "channels": nchannels, "nthreads": nthreads, "used_channels": used, "protocol": proto}
        if algorithm != algo.RING:
            rec["algorithm"] = algorithm
        self.plans.append(rec)
        return {"collective": self.index, "what": what, "kind": kind}

    def _off_ring(self, per_rank: list[np.ndarray], what: str) -> np.ndarray:
        """A gradient all-reduce by Tree, NVLS or CollNet (tools.generator.algorithms)."""
        inputs = [np.ascontiguousarray(x).reshape(-1) for x in per_rank]
        dtype = dtype_name(inputs[0])
        gap = self._gap(what)
        if self.algorithm == algo.TREE:
            result = self._tree(inputs, what, self.proto(nv.ALLREDUCE, inputs[0].nbytes), dtype, gap)
        else:
            result = inputs[0]
            for x in inputs[1:]:
                result = ringreduce.add(result, x, dtype)
            label = self._record(nv.ALLREDUCE, what, inputs[0], 0, None, [], nv.SIMPLE, self.algorithm)
            if self.algorithm == algo.COLLNET:
                self.wire.aggregate(self.topo, inputs, result, label, gap)
            else:
                self.wire.clock += gap  # inside the node: nothing on the network
        self.index += 1
        return result

    def _tree(self, inputs, what, proto, dtype, gap) -> np.ndarray:
        nranks, nch, esize = self.ring.nranks, self.ring.nchannels, inputs[0].itemsize
        arrays, result = {}, np.empty_like(inputs[0])
        for which in sorted({algo.tree_channel(c, nch) for c in range(nch)}):
            sums, root = algo.subtree_sums(inputs, which, dtype)
            arrays.update({(which, r): v for r, v in sums.items()})
            arrays[(which, "result")] = sums[root]
        per = algo.chunk_elems(proto, esize, self.version)
        works, used = [], []
        for ch, (lo, hi) in enumerate(algo.channel_ranges(inputs[0].size, nch, esize)):
            which = algo.tree_channel(ch, nch)
            result[lo:hi] = arrays[(which, "result")][lo:hi]
            used.append(ch)
            height, depth = algo.heights(nranks, which)
            top = max(height.values()) + 1
            parts = algo.chunks(lo, hi, per)
            for r in range(nranks):
                up, kids = algo.dtree(nranks, r, which)
                for peer, values, delay in ([(up, (which, r), height[r])] if up >= 0 else []) + \
                        [(k, (which, "result"), top + depth[r]) for k in kids]:
                    key, pair = self.topo.peer_pair(ch, r, peer, self.version)
                    msgs = [algo.PeerMsg(n * esize, k, off, n, values) for k, (off, n) in enumerate(parts)]
                    works.append(Work(self.wire.conn(key, pair), msgs, delay=delay, channel=ch))
        label = self._record(nv.ALLREDUCE, what, inputs[0], nch, None, used, proto, algo.TREE)
        self.wire.run(works, Layer(proto, nv.BROADCAST), algo.PieceValues(arrays), label, gap)
        return result

    def _pat(self, per_rank: list[np.ndarray], what: str) -> None:
        """An all-gather by PAT on channel 0: in round k every rank sends the chunks it holds that
        its peer at distance 2^k lacks, one Simple message each."""
        nranks, mine = self.ring.nranks, per_rank[0]
        arrays = {r: np.ascontiguousarray(x).reshape(-1) for r, x in enumerate(per_rank)}
        held = {r: [r] for r in range(nranks)}
        works, delay = [], 0
        for mask in algo.pat_rounds(nranks):
            grown = {r: list(h) for r, h in held.items()}
            longest = 0
            for r in range(nranks):
                dst = (r + mask) % nranks
                send = [x for x in held[r] if x not in held[dst]]
                grown[dst] += send
                key, pair = self.topo.peer_pair(0, r, dst, self.version)
                msgs = [algo.PeerMsg(mine.nbytes, k, 0, mine.size, x) for k, x in enumerate(send)]
                works.append(Work(self.wire.conn(key, pair), msgs, delay=delay, channel=0))
                longest = max(longest, len(msgs))
            held, delay = grown, delay + longest
        label = self._record(nv.ALLGATHER, what, mine, 1, None, [0], nv.SIMPLE, algo.PAT)
        self.wire.run(works, Layer(nv.SIMPLE, nv.BROADCAST), algo.PieceValues(arrays), label, self._gap(what))
        self.index += 1

    def _noise(self, result: np.ndarray, what: str) -> None:
        """Point-to-point sends of values that are not the all-reduce's (a pipeline activation, a
        tensor-parallel exchange), one message of each ``p2p_noise`` size: a plain size goes from rank
        0 to its next rank on the connection ``_fill`` uses, a (sender, receiver, size) triple on the
        pair's own point-to-point connection; foreign sends as large as pieces of the result."""
        es = result.itemsize
        by_pair: dict[tuple[int, int], list[int]] = {}
        for item in self.p2p_noise:
            src, dst, nbytes = item if isinstance(item, tuple) else (0, self.orders[0][1], item)
            if nbytes % es or not 0 < nbytes <= P2P_CHUNK_BYTES:
                raise ValueError(f"--p2p-send: a message of {nbytes} bytes: not a positive multiple of {es} "
                                 f"up to {P2P_CHUNK_BYTES}")
            if src == dst or not (0 <= src < self.ring.nranks and 0 <= dst < self.ring.nranks):
                raise ValueError(f"--p2p-send from rank {src} to rank {dst}: not two ranks of "
                                 f"0..{self.ring.nranks - 1}")
            by_pair.setdefault((src, dst), []).append(nbytes)
        for (src, dst), sizes in by_pair.items():
            conn = self.wire.conn(("p2p", src, dst), self.topo.p2p_pair(src, dst, self.version))
            vals = self._noise_rng.standard_normal(sum(sizes) // es).astype(result.dtype)
            msgs, lo = [], 0
            for k, nbytes in enumerate(sizes):
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
