"""What the traffic says about the job when no configuration does.

From decoded NCCL sends (the first part of a capture) it finds the NCCL release family (CTS
layout, immediate byte order: ``NcclDecoder.family``; the message sizes pick the schedule inside
it), the ring (``parser.ringfind``: ranks and order from CTS tags and links), the protocol of each
collective (``parser.protowalk``), and the job's collective sequence: DDP's start-up
(parameter-count all-gather, shapes and initial-weight broadcasts, bucket rebuild) when rank 0's
egress shows it, else a series of all-reduces whose element counts are solved from the message
sizes. Every hypothesis is checked by placing every send with the state machine; one that leaves
a single size mismatch is rejected.

The Simple thread count (maxThreads[RING][Simple]: 512, or 256 on a PCI-limited ring) changes
Simple chunk rounding up to 2.19 and the channel count of small collectives in every release. A job
that shows Simple traffic is tried with 512, then 256; the count found is claimed only when the
other one's plans contradict the wire (``Inferred.simple_threads``), else it is not determinable
and NCCL's default stays. A stated ``[ring] nthreads`` is the only count tried.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

import numpy as np
from mirrorckpt.config import ddp
from mirrorckpt.config.ddp import CollSpec
from mirrorckpt.config.layout import BucketSpec, JobLayout, RingSpec, address_text, dtype_size
from mirrorckpt.parser.errors import InferenceError, VersionMismatch
from mirrorckpt.parser.roce import nccl_versions as nv
from mirrorckpt.parser.roce import protocols, protowalk, schedule
from mirrorckpt.parser.roce.channels import ChannelResolver, channel_candidates, resolve_channels  # noqa: F401
from mirrorckpt.parser.roce.collectives import NcclJobModel, ring_threads, shape
from mirrorckpt.parser.roce.nccl import ConnKey, NcclDecoder, NcclSend
from mirrorckpt.parser.roce.ringfind import find_ring, ring_hypotheses, sequences
from mirrorckpt.parser.roce.statemachine import RingStateMachine

__all__ = ["ChannelResolver", "InferenceError", "Inferred", "infer", "infer_from_streams", "wire_family"]

ESIZE_DTYPES = {4: "float32", 2: "bfloat16", 8: "float64"}
DTYPES = ("float32", "bfloat16", "float16")  # gradient dtypes a DDP start-up is tried with, in order


@dataclass
class Inferred:
    model: NcclJobModel
    ranks: dict[bytes, int]  # address -> rank
    channels: dict[ConnKey, int]  # ring connection -> channel
    notes: list[str]
    # Simple thread count the wire proved (512 or 256), or None: not determinable (no Simple
    # collective, or the window's Simple collectives plan alike under both) or stated
    simple_threads: int | None = None
    threads_note: str = ""


SIMPLE_THREADS = (nv.max_threads(nv.SIMPLE), nv.max_threads(nv.SIMPLE, pci_limited=True))  # 512, 256


def wire_family(decoders) -> nv.WireFamily:
    """What all streams together show about the NCCL release (they must agree)."""
    cts = {d.seen_cts for d in decoders if d.seen_cts is not None}
    imm = {d.seen_imm for d in decoders if d.seen_imm is not None}
    if len(cts) > 1 or len(imm) > 1:
        raise VersionMismatch("the streams disagree on the NCCL release: CTS layouts "
                              f"{sorted(h.name for h in cts)}, immediate byte orders {sorted(imm)}")
    return nv.WireFamily(next(iter(cts), None), next(iter(imm), None))


def versions_to_try(decoders, stated: str | None) -> tuple[list[str], nv.WireFamily]:
    fam = wire_family(decoders)
    if stated:
        why = fam.contradicts(stated)
        if why:
            raise VersionMismatch(f"the stated NCCL {nv.version(stated)} contradicts the wire: {why}; state the "
                                  "right version, or none (it is read from the wire)")
        return [str(nv.version(stated))], fam
    cands = fam.candidates()
    if not cands:
        raise VersionMismatch(f"the wire is {fam.describe()}")
    return cands, fam


def check(model: NcclJobModel, ranks, channels, sends: list[NcclSend], why: list | None = None) -> tuple[int, int]:
    """(placed, mismatched) when every ring send is placed with this model, in arrival order;
    ``why`` gets the first size mismatch, if any."""
    sm = RingStateMachine(model, ranks, channels)
    try:
        for s in sends:
            if s.connection in channels:
                sm.place(s)
    except InferenceError:  # a collective whose protocol the traffic never showed
        return 0, 1
    if why is not None and sm.mismatches:
        why.append(sm.mismatches[0])
    # a send past the end of an endless sequence is on a channel no collective of it uses
    idle = sm.counts["unplaced_past_end"] if model.iterations is None else 0
    if why is not None and idle and not sm.mismatches:
        why.append(f"{idle} send(s) on connections taken as channels that no collective uses")
    return sm.counts["placed"], (sm.counts["mismatch"] + sm.counts["unplaced_no_message_at_step"]
                                 + sm.counts["protocol_mismatch"] + idle)


def _payload(seqs, ranks, channels, model: NcclJobModel, coll: int) -> np.ndarray | None:
    """The result bytes of broadcast ``coll`` as the ring connections carry them."""
    sm = RingStateMachine(model, ranks, channels)
    c = model[coll]
    plan = model.plan(c)
    es = dtype_size(c.dtype)
    out = np.zeros(c.count * es, np.uint8)
    got = np.zeros(c.count, bool)
    for k, seq in seqs.items():
        loc = sm.where(k)
        if loc is None:
            continue
        ch, pos = loc
        msgs = plan.messages(pos, ch)[:sm.collective_steps(ch, pos, coll)[1]]
        if not msgs:
            continue
        m0 = sm.message_number(ch, pos, coll, msgs[0])
        for i, st in enumerate(msgs):
            s = seq.get(m0 + i)
            # a message of another size is not this step's (a lost message shifts the numbers)
            if s is not None and s.complete and st.nelem and len(s.data) >= st.nelem * es:
                out[st.offset * es:(st.offset + st.nelem) * es] = s.data[:st.nelem * es]
                got[st.offset:st.offset + st.nelem] = True
    return out if got.all() else None


def _learn(model: NcclJobModel, seqs, ranks, upto=None) -> tuple[dict, int | None] | None:
    """Protocols per shape from the walk of a rank-0 connection taken as channel 0, and the time
    that connection's first message of collective ``upto`` was sent (None: not seen)."""
    for k, seq in seqs.items():
        if ranks[k.sender] != 0:
            continue
        got = protowalk.walk(model, seq, 0, 0, upto=upto)
        if got is not None:
            s = seq.get(got[1])
            return got[0], (s.ts_ns if s is not None and upto is not None else None)
    return None


def infer_from_streams(streams, dtype: str | None = None, nccl_version: str | None = None,
                       hint: NcclJobModel | None = None, window: int = 20000,
                       known: RingSpec | None = None) -> Inferred:
    """``infer`` over the first ``window`` sends of ``streams`` (parser.roce.streams.MirrorStreams)."""
    sends: list[NcclSend] = []
    for batch in streams:
        sends += batch
        if len(sends) >= window:
            break
    return infer(sends, streams.decoders, dtype, nccl_version, hint, known)


def _with_version(hint: NcclJobModel, ring: RingSpec) -> NcclJobModel:
    m = NcclJobModel(ring, hint.layout, list(hint.startup), list(hint.before_iteration_1), hint.per_iteration,
                 hint.iterations, hint.from_start)
    m.protocols.update(hint.protocols)
    return m


def _fit_hint(hint: NcclJobModel, conns, ranks, ring, ring_list, notes, why=None):
    """The configured collective sequence, with what the configuration left open from the wire."""
    model = _with_version(hint, ring)
    got = _learn(model, conns, ranks)
    if got is None:
        return None
    model.protocols.update(got[0])
    _fill_unseen(model)
    channels = resolve_channels(model, ranks, conns_lists(conns), notes)
    if channels is None:
        return None
    placed, bad = check(model, ranks, channels, ring_list, why)
    if bad and why is not None and not why:
        why.append(f"{bad} of {placed + bad} sends fit no step of it")
    return (model, channels) if bad == 0 and placed else None


def infer(sends: list[NcclSend], decoders: list[NcclDecoder] = (), dtype: str | None = None,
          nccl_version: str | None = None, hint: NcclJobModel | None = None,
          known: RingSpec | None = None) -> Inferred:
    """The job from its first sends. ``hint``: a configured collective sequence (its ring's protocol
    may be "auto" and its release None: those are read from the wire). ``known``: a configured ring
    whose addresses and orders count as CTS posts (the daemon's workers keep theirs)."""
    versions, fam = versions_to_try(list(decoders), nccl_version)
    seqs = sequences(sends)
    ranks, order, ring_conns, notes = find_ring(seqs, list(decoders), *_known(known))
    stated = (hint.ring.nthreads if hint is not None else None) or (known.nthreads if known is not None else None)
    misfit: dict[str, dict[int, str]] = {}  # release -> thread count -> first size mismatch (all connections)
    tried_counts = [None]
    for conns, left in ring_hypotheses(ring_conns):
        ring_list = [s for s in sends if s.connection in conns]
        shows_simple = any(s.protocol == nv.SIMPLE for s in ring_list)
        # Thread count outermost: a 512-thread job is found exactly as before (never under 256 with
        # another release), a 256-thread one only once no release fits it with 512.
        counts = [stated] if stated else ([None, SIMPLE_THREADS[1]] if shows_simple else [None])
        if not left:
            tried_counts = counts
        nch = max(Counter((k.sender, k.receiver) for k in conns).values())
        for nt in counts:
            for v in versions:
                if nt == SIMPLE_THREADS[1] and not stated and not nv.pci_thread_rule(v):
                    continue  # 2.31+ keeps 512 Simple threads on a PCI-limited ring
                why: list[str] = []
                got = _try(conns, ranks, order, nch, v, nt, hint, dtype, ring_list, why)
                if got is not None:
                    model, channels, vnotes = got
                    _settle_protocol(model)
                    if left:
                        vnotes.append(f"{len(left)} Simple connection(s) that nothing proves ring taken as "
                                      f"point-to-point: {', '.join(map(str, left))} (with them the sends fit no "
                                      "plan)")
                    where = "stated" if nccl_version else f"wire: {fam.describe()}"
                    notes += vnotes + [f"NCCL {v} schedule ({where}); protocols {_protocols_note(model)}"]
                    threads, tnote = _thread_verdict(model, ranks, channels, ring_list, stated, shows_simple)
                    notes.append(tnote)
                    return Inferred(model, ranks, channels, notes, threads, tnote)
                if why and not left:
                    misfit.setdefault(v, {})[nt or SIMPLE_THREADS[0]] = why[0]
    tried = ", ".join(versions)
    for v, by in misfit.items():
        a, b = SIMPLE_THREADS
        if len(by) == 2 and by[a] != by[b]:
            # the same collective sequence parts from the wire at another place under each count:
            # the thread count is what does not fit; say so, never guess
            raise InferenceError(
                f"the Simple collectives fit neither Simple thread count under NCCL {v}: with {a} threads "
                f"{by[a]}; with {b} threads {by[b]} (NCCL_NTHREADS set to another value? state it: "
                "[ring] nthreads)")
    threads = ' with 512 or 256 Simple threads' if len(tried_counts) > 1 else ''
    if hint is not None:
        # what a configuration leaves open is read from the first sends, which must all fit
        first = next((by[k] for by in misfit.values() for k in sorted(by)), None)
        raise InferenceError(f"the configured collectives fit the wire under none of NCCL {tried}{threads}"
                             + (f" ({first})" if first else "") + ": the configuration does not describe this "
                             "job (its layout, ring or release), or the first sends, from which what it leaves to "
                             "NCCL is read, are damaged beyond what loss explains")
    raise InferenceError(f"the message sizes fit neither DDP's start-up nor a series of all-reduces under NCCL "
                         f"{tried}{threads} (give the job configuration)")


def _try(conns, ranks, order, nch, release, threads, hint, dtype, ring_list, why):
    """(model, channels, notes) of one hypothesis (ring connections, channels, release, Simple
    threads), or None; ``why`` gets the first size mismatch."""
    notes: list[str] = []
    if hint is not None:
        ring = dataclasses.replace(hint.ring, nccl_version=release, nthreads=threads)
        got = _fit_hint(hint, conns, ranks, ring, ring_list, notes, why)
    else:
        ring = RingSpec(nranks=len(ranks), nchannels=nch, protocol=nv.AUTO, nccl_version=release, nthreads=threads,
                        ring_orders=[order] * nch, addresses={r: address_text(a) for a, r in ranks.items()})
        got = _infer_ddp(conns, ranks, order, ring, dtype, ring_list, notes, why)
        if got is None:
            got = _infer_allreduces(conns, ranks, ring, dtype, ring_list, notes, why)
    return None if got is None else (*got, notes)


def _thread_verdict(model: NcclJobModel, ranks, channels, ring_list, stated, shows_simple) -> tuple[int | None, str]:
    """(Simple thread count the wire proves, note). The model fits the wire with its count; the
    count is proved when the other candidate's plans leave a size mismatch."""
    if stated:
        return None, f"Simple threads: {stated} (stated, [ring] nthreads)"
    if not shows_simple:
        return None, "Simple threads: not determinable: no Simple collective seen"
    mine = model.ring.nthreads or SIMPLE_THREADS[0]
    other = SIMPLE_THREADS[1] if mine == SIMPLE_THREADS[0] else SIMPLE_THREADS[0]
    alt = _with_version(model, dataclasses.replace(model.ring, nthreads=other))
    why: list[str] = []
    placed, bad = check(alt, ranks, channels, ring_list, why)
    if bad == 0 and placed:
        model.ring.nthreads = None  # nothing claimed: NCCL's default stays
        return None, (f"Simple threads: not determinable: plans equal (the Simple collectives seen plan alike "
                      f"with {SIMPLE_THREADS[0]} and {SIMPLE_THREADS[1]} threads; NCCL's default "
                      f"{SIMPLE_THREADS[0]} assumed)")
    model.ring.nthreads = None if mine == SIMPLE_THREADS[0] else mine
    return mine, (f"Simple threads: {mine} (with {other}: {why[0] if why else 'the sends do not place'})")


def _known(ring: RingSpec | None) -> tuple[dict[bytes, int], list[tuple[bytes, bytes]]]:
    """A configured ring's address -> rank and its links (sender, receiver) on every channel."""
    if ring is None or not ring.addresses:
        return {}, []
    ranks = ring.ranks_by_address()
    addr = {r: a for a, r in ranks.items()}
    links = [(addr[r], addr[ring.next_rank(c, r)]) for c in range(ring.nchannels) for r in range(ring.nranks)
             if r in addr and ring.next_rank(c, r) in addr]
    return ranks, links


def _settle_protocol(model: NcclJobModel) -> None:
    """A job whose collectives all ran one protocol is that protocol's job (its later shapes too)."""
    used = set(model.protocols.values())
    if len(used) == 1:
        model.ring.protocol = used.pop()


def _protocols_note(model: NcclJobModel) -> str:
    if model.ring.protocol != nv.AUTO:
        return f"{model.ring.protocol} for every collective"
    by = {}
    for (kind, count, dt), p in sorted(model.protocols.items(), key=lambda kv: kv[0][1]):
        by.setdefault(p, []).append(f"{kind} {count}x{dt}")
    return "; ".join(f"{p}: {', '.join(v[:4])}{' ...' if len(v) > 4 else ''}" for p, v in by.items())


def _shapes_payload(seq, ring, nparams) -> list | None:
    """DDP's sizes-and-strides broadcast, read from the messages after the parameter-count
    all-gather on rank 0's channel-0 connection (the broadcast is small: one channel)."""
    s0 = seq.get(0)
    plan = schedule.allgather_plan(1, 8, ring.nranks, ring.nchannels, s0.protocol, ring.nccl_version,
                                   nthreads=ring_threads(ring, s0.protocol))
    start = len(plan.messages(0, 0))
    payload = np.zeros(0, np.uint8)
    longest = 2 * ddp.MAX_TENSOR_DIMS * nparams  # sizes and strides of every dimension of every parameter
    tried = 0
    for t in range(start, start + 128):
        s = seq.get(t)
        if s is None or not s.complete or tried >= longest:
            return None
        if not len(s.data):
            continue
        payload = np.concatenate([payload, s.data])
        vals = payload[: len(payload) // 8 * 8].view("<i8")
        # LL/LL128 pad a message's last line or group: the payload is the shortest prefix that parses
        # (prefixes tried after an earlier message are not tried again)
        for n in range(tried + 2, min(len(vals), longest) + 1, 2):
            tried = n
            try:
                cand = ddp.parse_shapes(vals[:n], nparams)
            except ValueError:
                continue
            if len(cand) == nparams:
                return cand
    return None


def _infer_ddp(conns, ranks, order, ring, dtype, ring_list, notes, why=None):
    """DDP start-up on rank 0's egress: all-gather of the parameter count, shapes, weights."""
    for shapes in _startup_shapes(conns, ranks, ring):
        for dt in ([dtype] if dtype else DTYPES):
            got = _ddp_model(conns, ranks, order, ring, shapes, len(shapes), dt, ring_list, notes, why)
            if got is not None:
                if not dtype and dt != "float32":
                    notes.append(f"gradient dtype taken as {dt} (2-byte elements); give --dtype to be sure")
                return got
    return None


def _ddp_model(conns, ranks, order, ring, shapes, nparams, dt, ring_list, notes, why=None):
    layout = ddp.layout_from_wire(shapes, dt)
    model = NcclJobModel.ddp(ring, layout)
    it1 = model.first_of_iteration(1)
    # Up to the rebuild broadcasts the sequence does not depend on the rebuilt buckets.
    got = _learn(model, conns, ranks, upto=it1 + 2)
    if got is None:
        if why is not None:
            why += _misfit(model, conns, ranks, upto=it1 + 2)
        return None
    model.protocols.update(got[0])
    _fill_unseen(model)
    # Channels from the sends before the rebuilt buckets' first all-reduce (its sizes are not known yet).
    early = {k: [s for s in v.values() if got[1] is None or s.ts_ns < got[1]] for k, v in conns.items()}
    channels = resolve_channels(model, ranks, early, notes)
    if channels is None:
        return None
    idx = _payload(conns, ranks, channels, model, it1)
    sizes = None
    nb = int(idx.view("<i4")[-1]) if idx is not None else 0
    if 1 <= nb <= nparams:  # the indices end with the bucket count: the sizes broadcast's length
        parts = [(i,) for i in range(nb - 1)] + [tuple(range(nb - 1, nparams))]
        sized = NcclJobModel.ddp(ring, JobLayout(layout.params, [BucketSpec(b) for b in parts], layout.first_buckets,
                                                 dt))
        sized.protocols.update(model.protocols)
        _fill_unseen(sized)
        sizes = _payload(conns, ranks, channels, sized, it1 + 1)
    if idx is not None and sizes is not None:
        try:
            buckets = ddp.parse_rebuild(idx.view("<i4"), sizes.view("<i4"), nparams)
        except ValueError as e:
            notes.append(f"rebuild broadcasts unreadable: {e}")
            return None
        layout = JobLayout(layout.params, buckets, layout.first_buckets, dt)
        model = NcclJobModel.ddp(ring, layout)
        got = _learn(model, conns, ranks)
        if got is None:
            return None
        model.protocols.update(got[0])
        _fill_unseen(model)
        channels = resolve_channels(model, ranks, conns_lists(conns), notes) or channels
    else:
        notes.append("rebuild broadcasts not seen: the first iteration's single bucket is kept")
    placed, bad = check(model, ranks, channels, ring_list, why)
    if bad == 0 and placed:
        notes.append(f"DDP job: {nparams} parameters, {len(layout.buckets)} buckets after the rebuild")
        return model, channels
    return None


def startup_without_allreduces(sends: list[NcclSend], decoders=(), nccl_version: str | None = None) -> str | None:
    """A sentence when every ring send is DDP's start-up and its bucket rebuild, with no gradient
    all-reduce between them or after: the job reduces its gradients off the mirrored links (NVLS
    inside the node, CollNet in the network). The rebuild broadcasts come after iteration 0's
    all-reduce, so a capture cut short before it cannot look like this. None otherwise."""
    try:
        versions, _ = versions_to_try(list(decoders), nccl_version)
        ranks, order, ring_conns, _ = find_ring(sequences(sends), list(decoders))
    except InferenceError:
        return None
    for conns, _left in ring_hypotheses(ring_conns):
        ring_list = [s for s in sends if s.connection in conns and s.length_known]
        nch = max(Counter((k.sender, k.receiver) for k in conns).values())
        for v in versions:
            ring = RingSpec(nranks=len(ranks), nchannels=nch, protocol=nv.AUTO, nccl_version=v,
                            ring_orders=[order] * nch, addresses={r: address_text(a) for a, r in ranks.items()})
            for shapes in _startup_shapes(conns, ranks, ring):
                for dt in DTYPES:
                    layout = ddp.layout_from_wire(shapes, dt)
                    head = ddp.startup(layout) + ddp.rebuild(layout)[:1]
                    got = _fit_startup(head, ring, conns, ranks, ring_list)
                    if got is None:
                        continue
                    idx = _payload(conns, ranks, got[1], got[0], len(head) - 1)
                    nbuckets = int(idx.view("<i4")[-1]) if idx is not None else 0
                    if not 1 <= nbuckets <= len(shapes):
                        continue
                    whole = head + [CollSpec(nv.BROADCAST, nbuckets, "int32", "rebuild_sizes")]
                    if _fit_startup(whole, ring, conns, ranks, ring_list, every=True) is not None:
                        return (f"the ring carries DDP's start-up ({len(shapes)} parameters, {dt}) and its bucket "
                                f"rebuild ({nbuckets} buckets), and no gradient all-reduce before or after the "
                                "rebuild")
    return None


def _startup_shapes(conns, ranks, ring):
    """Parameter shapes read off rank 0's start-up broadcasts (the first message its connection
    sends is the parameter-count all-gather's)."""
    for k, seq in conns.items():
        if ranks[k.sender] != 0:
            continue
        s0 = seq.get(0)
        if s0 is None or not s0.complete or s0.protocol is None \
                or s0.wire_bytes != protocols.wire_bytes(s0.protocol, 8):
            continue
        nparams = int(s0.data[:8].view("<i8")[0])
        shapes = _shapes_payload(seq, ring, nparams) if 1 <= nparams <= 1 << 20 else None
        if shapes is not None:
            yield shapes


def _fit_startup(colls: list, ring: RingSpec, conns, ranks, ring_list, every: bool = False):
    """(model, channels) of a sequence of ``colls`` alone that every ring send before its end fits
    (``every``: that places every ring send), else None."""
    model = NcclJobModel(ring, None, startup=list(colls), per_iteration=[], iterations=0)
    got = _learn(model, conns, ranks, upto=len(colls))
    if got is None:
        return None
    model.protocols.update(got[0])
    # channels from the sends of these collectives (rank 0's next message, if any, is later)
    early = {k: [s for s in v.values() if got[1] is None or s.ts_ns < got[1]] for k, v in conns.items()}
    channels = resolve_channels(model, ranks, early, [])
    if channels is None:
        return None
    placed, bad = check(model, ranks, channels, [s for s in ring_list if every or got[1] is None or s.ts_ns < got[1]])
    if bad or not placed or (every and placed < len(ring_list)):
        return None
    return model, channels


def _misfit(model: NcclJobModel, conns, ranks, upto: int) -> list[str]:
    """Where the model's plans first part from rank 0's sends (each of its connections taken as
    channel 0, the furthest one kept): the collective, what it expects, what the wire has."""
    best = (-1, "")
    for k, seq in conns.items():
        if ranks[k.sender] != 0:
            continue
        t = m = 0
        for i in range(upto):
            c = model[i]
            if c is None:
                break
            p = model.pinned(c) or next(iter(protowalk._guesses(seq, m)))
            plan = model.plan_as(c, p)
            msgs = plan.messages(0, 0) if 0 in plan.channels else []
            start = schedule.conn_step_start(t, p, c.kind)
            bad = [(j, st, s) for j, st in enumerate(msgs)
                   if not protowalk._fits(s := seq.get(m + j), st, start + st.conn_step, p)]
            if bad:
                j, st, s = bad[0]
                if i > best[0]:
                    has = (f"the wire has {s.wire_bytes}" if s.wire_bytes != st.wire_bytes
                           else "the wire's protocol or flag differs")
                    best = (i, f"{c.label} #{i} ({c.kind} of {c.count} x {c.dtype}, {p}) expects {st.wire_bytes} "
                               f"wire bytes in its message {j} on {k}, {has}")
                break
            t, m = start + plan.conn_steps(0, 0), m + len(msgs)
    return [best[1]] if best[1] else []


def _fill_unseen(model: NcclJobModel) -> None:
    """Shapes of the sequence the window did not reach (later buckets) take the protocol of the
    nearest size of the same kind that it showed: NCCL's choice grows with the size."""
    for i in range(model.first_of_iteration(3)):
        c = model[i]
        if c is None or model.pinned(c):
            continue
        nb = c.count * dtype_size(c.dtype)
        near = sorted((kind != c.kind, abs(cnt * dtype_size(dt) - nb), p)
                      for (kind, cnt, dt), p in model.protocols.items())
        if near:
            model.protocols[shape(c)] = near[0][2]


def conns_lists(conns) -> dict[ConnKey, list[NcclSend]]:
    return {k: list(v.values()) for k, v in conns.items()}


def _infer_allreduces(conns, ranks, ring, dtype, ring_list, notes, why=None):
    """No DDP start-up: a series of all-reduces; solve each one's element count from the sizes."""
    for dt in ([dtype] if dtype else ["float32"]):
        es = dtype_size(dt)
        counts, protos = _solve_counts(conns, ranks, ring, es)
        if not counts:
            continue
        period = _period(list(zip(counts, protos)))
        model = NcclJobModel.allreduces(ring, [n for n, _ in period], dt)
        model.protocols.update({(nv.ALLREDUCE, n, dt): p for n, p in period})
        channels = resolve_channels(model, ranks, conns_lists(conns), notes)
        if channels is None:
            continue
        placed, bad = check(model, ranks, channels, ring_list, why)
        if bad == 0 and placed:
            notes.append(f"no DDP start-up seen: all-reduces of {[n for n, _ in period]} {dt} elements")
            return model, channels
    return None


def _period(items: list) -> list:
    for p in range(1, len(items) + 1):
        if all(items[i] == items[i % p] for i in range(len(items))):
            return items[:p]
    return items


def _solve_counts(conns, ranks, ring, es, limit: int = 64) -> tuple[list[int], list[str]]:
    """Element counts (and protocols) of consecutive all-reduces, read off ring position 0's
    connections message by message: each all-reduce's protocol is that of its data sends."""
    R = ring.nranks
    keys = [k for k in conns if ranks[k.sender] == 0]
    if not keys:  # rank 0 sends on no ring connection: nothing to read the counts off
        return [], []
    seqs = {k: conns[k] for k in keys}
    counts, protos = [], []
    m = {k: 0 for k in keys}
    for _ in range(limit):
        guess = None
        for k in keys:
            g = protowalk._guesses(seqs[k], m[k])
            if len(g) == 1 or guess is None:
                guess = g
            if any(seqs[k].get(j) is not None and len(seqs[k][j].data) for j in range(m[k], m[k] + 16)):
                guess = g
                break
        found = None
        for proto in guess[:1]:
            per_loop = (2 * R - 2) * (2 if proto == nv.SIMPLE else 1)
            for loops in range(1, 9):
                nmsg = loops * per_loop
                data = sum(len(s.data) for k in keys for j in range(nmsg) if (s := seqs[k].get(m[k] + j)) is not None)
                if not data:
                    break
                hi = data * R // (2 * R - 2) // es
                for n in range(hi, max(0, hi - nmsg * len(keys) * 8 // es) - 1, -1):
                    if n <= 0:
                        break
                    if _fits(n, es, ring, proto, keys, seqs, m):
                        found = n
                        break
                if found:
                    break
            if found:
                break
        if not found:
            break
        counts.append(found)
        protos.append(proto)
        plan = schedule.allreduce_plan(found, es, R, ring.nchannels, proto, ring.nccl_version,
                                       nthreads=ring_threads(ring, proto))
        used = set()
        for k in keys:
            ch = _channel_for(plan, seqs[k], m[k], used)
            if ch is not None:
                used.add(ch)
                m[k] += len(plan.messages(0, ch))
    return counts, protos


def _agrees(seq: dict, m: int, msgs) -> bool:
    """Every planned message has a send of that size at its place (an unseen one may be empty)."""
    for i, st in enumerate(msgs):
        s = seq.get(m + i)
        if (s.wire_bytes if s is not None else 0) != st.wire_bytes:
            return False
    return True


def _channel_for(plan, seq, m, used):
    for ch in plan.channels:
        if ch not in used and _agrees(seq, m, plan.messages(0, ch)):
            return ch
    return None


def _fits(n, es, ring, proto, keys, seqs, m) -> bool:
    plan = schedule.allreduce_plan(n, es, ring.nranks, ring.nchannels, proto, ring.nccl_version,
                                   nthreads=ring_threads(ring, proto))
    used = set()
    for k in keys:
        ch = _channel_for(plan, seqs[k], m[k], used)
        if ch is None:
            return False
        used.add(ch)
    return True
