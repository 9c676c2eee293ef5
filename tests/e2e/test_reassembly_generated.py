"""Issue 4 acceptance on generated captures: every iteration's reduced buckets, bit-exact against
the generator's truth.json, from two mirror streams of one job.

Mirror configurations (each generated job writes rank0_egress, rank1_egress and rank1_ingress, and
is replayed twice, in-process, through the parser the `replay` command runs):

* (a) ``egress``:  the egress of two adjacent ranks, rank 0 and rank 1;
* (b) ``ingress``: the egress of rank 1 plus the ingress of rank 1, i.e. the link from its ring
  predecessor (rank 0) seen at rank 1's port. Read literally, "the egress of rank r plus the ingress
  of rank r+1" mirrors one link twice: rank r+1's ingress is rank r's egress, so chunk r+1's final
  value is on neither stream (parser/lossmodel.copies). That reading can never be complete;
  ``test_one_link_mirrored_twice_is_reported_incomplete`` checks that the parser says so;
* (c) ``three``: all three files, rank 0's link twice (rank 1's ingress repeats rank 0's egress):
  the issue's "two or three mirror streams, any mix of ingress/egress of different ranks".

Covering design (the full product 5 R x 3 channels x 3 protocols x 2 dtypes x 2 mirrors is 180
jobs): 15 generated jobs, one per protocol x R pair; within a protocol the communicator channels
run through {1, 2, 4} and the gradient dtype alternates, arranged so that every R also meets every
channel count (a Latin design on protocol x R -> channels) and both dtypes::

              R=2      R=3      R=4      R=8      R=16
    LL        1 fp32   2 bf16   4 fp32   1 bf16   2 fp32
    LL128     2 bf16   4 fp32   1 bf16   2 fp32   4 bf16
    Simple    4 fp32   1 bf16   2 bf16   4 fp32   1 bf16

So every protocol x R, protocol x channels, protocol x dtype, R x channels pair appears, and every
job is replayed with every mirror configuration (every protocol x mirror, R x mirror pair).

The model is ``mlp:IN,64,8`` with a small DDP bucket cap: iteration 0 all-reduces one bucket of
every parameter; the rebuilt layout (iterations 1, 2) has a small bucket (520 elements: at R=16 most
of its ring chunks are empty) and a large one, sized so NCCL runs it on every channel of the
communicator with data on each (checked against the generator's launch records), and with every
ring chunk of every channel non-empty where that takes at most 320 KB (all but LL128 R=16). NCCL
2.18, PMTU 1024, no noise, no faults.

Per job and mirror configuration: no placement mismatch and no unplaced ring send, no conflict,
every all-reduce complete with the truth sha256, every iteration complete with every bucket's
sha256 equal to truth.json, and every fully reduced message placed exactly once per stream; for
R >= 3 the two streams carry common chunks (a reduced chunk forwarded along the ring), so the
concatenator must have compared overlapping copies: more pieces than distinct reduced messages
and elements covered twice. A corrupted overlapping copy must then surface as a conflict.

Issue 13 extends the matrix (``EXTRA``): protocol "auto" (NCCL's per-collective choice, LL + LL128 +
Simple in one job) at 2.18, 2.23, 2.29, 2.31 and 2.32, with 1, 2 and 4 QPs per connection, messages cut over the
QPs or sent whole round robin; the same checks with every mirror configuration, each collective's
protocol read from the wire.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from mirrorckpt.config.jobfile import load_job
from mirrorckpt.config.layout import dtype_size
from mirrorckpt.config.training import TrainingSpec
from mirrorckpt.parser.concat import Concatenator
from mirrorckpt.parser.placement import REDUCED
from mirrorckpt.parser.roce import nccl_versions as nv
from mirrorckpt.parser.roce import schedule
from mirrorckpt.tools import cmd_replay
from mirrorckpt.tools.generator.gen import GenConfig, generate
from mirrorckpt.tools.generator.wire import WireOptions

pytestmark = pytest.mark.offline  # capture files in one process: runs beside the unit tests

# (protocol, ranks, channels, gradient dtype): the covering design of the module docstring.
DESIGN = [
    ("LL", 2, 1, "float32"), ("LL", 3, 2, "bfloat16"), ("LL", 4, 4, "float32"),
    ("LL", 8, 1, "bfloat16"), ("LL", 16, 2, "float32"),
    ("LL128", 2, 2, "bfloat16"), ("LL128", 3, 4, "float32"), ("LL128", 4, 1, "bfloat16"),
    ("LL128", 8, 2, "float32"), ("LL128", 16, 4, "bfloat16"),
    ("Simple", 2, 4, "float32"), ("Simple", 3, 1, "bfloat16"), ("Simple", 4, 2, "bfloat16"),
    ("Simple", 8, 4, "float32"), ("Simple", 16, 1, "bfloat16"),
]
MIRRORS = "0:egress,1:egress,1:ingress"
STREAMS = {  # mirror configuration -> (capture files, ranks whose egress traffic they hold)
    "egress": (["rank0_egress.pcapng", "rank1_egress.pcapng"], [0, 1]),
    "ingress": (["rank1_egress.pcapng", "rank1_ingress.pcapng"], [1, 0]),
    "three": (["rank0_egress.pcapng", "rank1_egress.pcapng", "rank1_ingress.pcapng"], [0, 1, 0]),
}
HIDDEN, OUT = 64, 8
SPREAD_CAP = 320 << 10
VERSION = "2.18"


def config_id(cfg) -> str:
    proto, R, nch, dt = cfg
    return f"{proto}-R{R}-ch{nch}-{'bf16' if dt == 'bfloat16' else 'fp32'}"


def spread(proto: str, R: int, nch: int, dtype: str, count: int) -> tuple[int, int, int]:
    """(channels NCCL launches, channels that carry data, non-empty ring chunks) of an all-reduce."""
    plan = schedule.allreduce_plan(count, dtype_size(dtype), R, nch, proto, VERSION)
    chunks = [ch for ch in plan.channels for _, _, n in plan.chunk_ranges(ch) if n]
    return plan.nchannels, len(set(chunks)), len(chunks)


def model_for(proto: str, R: int, nch: int, dtype: str) -> tuple[str, float]:
    """``mlp:IN,64,8`` whose big bucket (IN x 64 weight and 64 bias) NCCL runs on all ``nch`` channels
    with data on every one of them, and with every ring chunk of every channel non-empty unless that
    needs more than SPREAD_CAP bytes; DDP bucket cap 500 elements (the small bucket: w2 and b2)."""
    es = dtype_size(dtype)
    need = nch * nv.max_threads(proto) * nv.thread_threshold(proto, R)  # select_launch's bound
    n_in = max(16, math.ceil(1.3 * need / es / HIDDEN))

    def big(n):
        return spread(proto, R, nch, dtype, n * HIDDEN + HIDDEN)

    while big(n_in)[:2] != (nch, nch):
        n_in = int(n_in * 1.1) + 8
    n = n_in
    while big(n)[2] < R * nch and (n * HIDDEN + HIDDEN) * es <= SPREAD_CAP:
        n = int(n * 1.1) + 8
    if big(n)[2] == R * nch:
        n_in = n
    return f"mlp:{n_in},{HIDDEN},{OUT}", 500 * es / (1 << 20)


@pytest.fixture(scope="module", params=DESIGN, ids=config_id)
def job(request, tmp_path_factory):
    proto, R, nch, dtype = request.param
    model, cap = model_for(proto, R, nch, dtype)
    out = tmp_path_factory.mktemp(config_id(request.param))
    truth = generate(GenConfig(ranks=R, channels=nch, protocol=proto, nccl_version=VERSION, model=model, steps=3,
                               seed=R * 10 + nch, bucket_cap_mb=cap, mirrors=MIRRORS, send_truth=False,
                               training=TrainingSpec(grad_dtype=dtype)), out)
    return request.param, out, truth


def replay(out, files):
    """What `mirrorckpt replay --config job.toml FILES` runs (a job file with protocol "auto" gets
    each collective shape's protocol from the wire first)."""
    job = load_job(out / "job.toml")
    caps = [str(out / f) for f in files]
    v = job.ring.nccl_version
    if job.ring.protocol == nv.AUTO:
        job, v = cmd_replay._complete_from_wire(job, caps, v, None, True)
    js, results, iterations, _ = cmd_replay.run(caps, job, nccl_version=v)
    return js, [r for r in results if r.spec.kind == "allreduce"], iterations


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def reduced_messages(plan, ring, senders):
    """Per stream (the rank whose egress traffic it holds), the (channel, loop, chunk, slice) and
    element range of every non-empty fully reduced message it carries."""
    out = []
    for s in senders:
        msgs = []
        for ch in plan.channels:
            for m in plan.messages(ring.ring_index(ch, s), ch):
                if m.phase == REDUCED and m.nelem:
                    msgs.append(((ch, m.loop, m.chunk, m.slice), m.offset, m.nelem))
        out.append(msgs)
    return out


def test_the_design_covers_every_pair():
    protos, Rs, chans, dts = {c[0] for c in DESIGN}, {c[1] for c in DESIGN}, {c[2] for c in DESIGN}, \
        {c[3] for c in DESIGN}
    assert (protos, Rs, chans, dts) == ({"LL", "LL128", "Simple"}, {2, 3, 4, 8, 16}, {1, 2, 4},
                                        {"float32", "bfloat16"})

    def pairs(i, j):
        return {(c[i], c[j]) for c in DESIGN}

    assert pairs(0, 1) == {(p, r) for p in protos for r in Rs}
    assert pairs(0, 2) == {(p, c) for p in protos for c in chans}
    assert pairs(0, 3) == {(p, d) for p in protos for d in dts}
    assert pairs(1, 2) == {(r, c) for r in Rs for c in chans}
    assert len(DESIGN) == len(set(DESIGN)) == 15


def test_the_job_uses_what_the_design_says(job):
    (proto, R, nch, dtype), _, truth = job
    ring = truth["wire"]["ring"]
    assert (ring["protocol"], ring["nranks"], ring["nchannels"]) == (proto, R, nch)
    ars = [la for la in truth["wire"]["launches"] if la["kind"] == "allreduce"]
    assert {la["dtype"] for la in ars} == {dtype}
    # the large bucket runs on every channel of the communicator, with data on every channel
    assert max(la["channels"] for la in ars) == nch
    assert max(len(la["used_channels"]) for la in ars) == nch
    biggest = max(la["count"] for la in ars)
    assert spread(proto, R, nch, dtype, biggest)[:2] == (nch, nch)
    assert len(truth["layout"]["buckets"]) == 2 and len(truth["iterations"]) == 3
    assert [c["file"] for c in truth["wire"]["captures"]] == [f"rank{m.replace(':', '_')}.pcapng"
                                                              for m in MIRRORS.split(",")]


@pytest.mark.parametrize("mirror", list(STREAMS))
def test_every_send_placed_without_mismatch(job, mirror):
    cfg, out, _ = job
    js, _, _ = replay(out, STREAMS[mirror][0])
    rep = js.report()
    assert rep.placement.get("mismatch", 0) == 0, rep.mismatches
    assert rep.placement["placed"] > 0 and set(rep.placement) == {"placed"}, rep.placement


@pytest.mark.parametrize("mirror", list(STREAMS))
def test_every_iteration_bit_exact(job, mirror):
    cfg, out, truth = job
    files, senders = STREAMS[mirror]
    js, ars, iterations = replay(out, files)
    check_bit_exact(js, ars, iterations, truth, cfg[1], files, senders)


def check_bit_exact(js, ars, iterations, truth, R, files, senders):
    want = [c for c in truth["collectives"] if c["kind"] == "all_reduce"]
    assert [(a.count, a.spec.dtype) for a in ars] == [(w["count"], w["dtype"]) for w in want]
    for a, w in zip(ars, want):
        what = f"all-reduce {a.index} (iteration {a.spec.iteration}, bucket {a.spec.bucket})"
        assert a.conflicts == [] and not a.conflict.any(), what
        assert a.holes == [] and a.complete and a.coverage == 1.0, what
        assert a.filled_by_p2p == [], what
        assert a.sha256() == w["sha256"], what

    assert [it.index for it in iterations] == [it["index"] for it in truth["iterations"]]
    for it, t in zip(iterations, truth["iterations"]):
        assert it.complete and it.holes == {}
        assert [sha(b) for b in it.buckets] == t["buckets_sha256"], f"iteration {it.index}"

    # every fully reduced message of every stream went into its buffer: copies were compared
    ring = js.model.ring
    for a in ars:
        per = reduced_messages(js.model.plan(a.spec), ring, senders)
        placed = sum(len(v) for v in per)
        distinct = {k for v in per for k, _, _ in v}
        assert a.pieces == placed, f"all-reduce {a.index}: {a.pieces} pieces placed, {placed} reduced messages"
        mult = np.zeros(a.count, np.int64)
        for v in per:
            for _, off, n in v:
                mult[off:off + n] += 1
        assert mult.min() >= 1  # the streams hold every chunk
        if R >= 3 or len(files) == 3:
            assert a.pieces > len(distinct) and (mult >= 2).any()
        else:  # two ranks: each egress holds the chunk the other lacks, nothing twice
            assert a.pieces == len(distinct) and mult.max() == 1


def test_a_disagreeing_overlapping_copy_is_a_conflict(job, monkeypatch):
    """The comparison of overlapping copies is real: one flipped byte in the second copy of an
    element makes that element conflicting and its all-reduce and iteration incomplete. With two
    ranks no chunk is on both egress streams, so the three-stream mirror (rank 0's egress twice) is used."""
    cfg, out, _ = job
    files, _ = STREAMS["egress" if cfg[1] >= 3 else "three"]
    hit = {}
    orig = Concatenator._put

    def put(self, r, start, n, data, byte_holes, origin):
        # the first gradient all-reduce element seen a second time gets one bit flipped
        if not hit and r.spec.label == "grad" and r.covered[start:start + n].any():
            k = int(np.flatnonzero(r.covered[start:start + n])[0])
            es = dtype_size(r.spec.dtype)
            data = data.copy()
            data[k * es] ^= 1
            hit.update(coll=r.index, elem=start + k)
        return orig(self, r, start, n, data, byte_holes, origin)

    monkeypatch.setattr(Concatenator, "_put", put)
    _, ars, iterations = replay(out, files)
    assert hit
    (bad,) = [a for a in ars if a.index == hit["coll"]]
    assert not bad.complete and bad.sha256() is None and bad.conflicts
    assert any(a <= hit["elem"] < a + n for a, n in bad.holes)
    it = next(i for i in iterations if i.index == bad.spec.iteration)
    assert not it.complete and it.buckets == [] and bad.spec.bucket in it.holes
    assert all(a.complete for a in ars if a.index != hit["coll"])


@pytest.mark.parametrize("R", [3, 4])
def test_one_link_mirrored_twice_is_reported_incomplete(tmp_path, R):
    """Rank 0's egress plus rank 1's ingress is one link twice: chunk 1's final value is on neither
    stream. Every iteration is incomplete, and its holes are exactly the chunk-1 ranges."""
    truth = generate(GenConfig(ranks=R, channels=2, protocol="LL", nccl_version=VERSION, model="mlp:64,64,8",
                               steps=2, seed=R, mirrors="0:egress,1:ingress", send_truth=False), tmp_path)
    js, ars, iterations = replay(tmp_path, ["rank0_egress.pcapng", "rank1_ingress.pcapng"])
    assert len(iterations) == 2 and not any(it.complete or it.buckets for it in iterations)
    ring = js.model.ring
    for a in ars:
        plan = js.model.plan(a.spec)
        missing = sorted((off, n) for ch in plan.channels
                         for off, n in plan.missing_chunk_ranges(ring.ring_index(ch, 0), ch))
        assert missing and a.sha256() is None and not a.conflicts
        merged = []
        for off, n in missing:  # adjacent ranges (channels interleave chunks) read as one hole
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((off, n))
        assert a.holes == merged
    assert len(truth["iterations"]) == 2


# -- issue 13: NCCL's per-collective protocol choice, 2.20+ releases, several QPs per connection ----------

# (id, ranks, channels, release, model, QPs per connection, NCCL_IB_SPLIT_DATA_ON_QPS or None for the
# release's default), all with protocol "auto" and a 500-element DDP bucket cap. mlp:4096,256,256,8 at R=3
# all-reduces a 2056-element bucket with LL, a 65792-element one with LL128 and a 1.05 M-element one with
# Simple (tools/generator/tuning); the smaller models mix LL and LL128.
EXTRA = [
    ("auto-r3-ch2-v223", 3, 2, "2.23", "mlp:4096,256,256,8", 1, None),
    ("auto-r3-ch2-qp2-v229", 3, 2, "2.29", "mlp:4096,256,256,8", 2, None),  # whole messages round robin
    ("auto-r3-ch2-qp2-split-v223", 3, 2, "2.23", "mlp:600,64,8", 2, True),  # cut over the QPs
    ("auto-r4-ch2-qp4-v218", 4, 2, "2.18", "mlp:2048,64,8", 4, None),  # cut over the QPs (default)
    ("auto-r4-ch1-qp4-v229", 4, 1, "2.29", "mlp:2048,64,8", 4, None),
    ("auto-r3-ch2-qp2-v231", 3, 2, "2.31", "mlp:4096,256,256,8", 2, None),  # issue 39: 2.31 and 2.32
    ("auto-r3-ch1-v232", 3, 1, "2.32", "mlp:4096,256,256,8", 1, None),
]


@pytest.fixture(scope="module", params=EXTRA, ids=[e[0] for e in EXTRA])
def extra_job(request, tmp_path_factory):
    name, R, nch, v, model, qps, split = request.param
    out = tmp_path_factory.mktemp(name)
    truth = generate(GenConfig(ranks=R, channels=nch, protocol="auto", nccl_version=v, model=model, steps=3,
                               seed=R * 10 + qps, bucket_cap_mb=500 * 4 / (1 << 20), mirrors=MIRRORS,
                               send_truth=False, wire=WireOptions(qps_per_connection=qps, split_data_on_qps=split)),
                      out)
    return request.param, out, truth


def test_the_extra_job_mixes_protocols(extra_job):
    (name, R, nch, v, model, qps, _), _, truth = extra_job
    ars = [la for la in truth["wire"]["launches"] if la["kind"] == "allreduce"]
    used = {la["protocol"] for la in ars}
    assert used == ({"LL", "LL128", "Simple"} if model.count(",") == 3 else {"LL", "LL128"})
    assert truth["wire"]["ring"]["nccl_version"] == v and truth["wire"]["options"]["qps_per_connection"] == qps
    assert len(truth["iterations"]) == 3


@pytest.mark.parametrize("mirror", list(STREAMS))
def test_the_extra_job_is_bit_exact(extra_job, mirror):
    (name, R, nch, v, _, qps, split), out, truth = extra_job
    files, senders = STREAMS[mirror]
    js, ars, iterations = replay(out, files)
    rep = js.report()
    assert rep.placement.get("mismatch", 0) == 0 and set(rep.placement) == {"placed"}, rep.mismatches
    check_bit_exact(js, ars, iterations, truth, R, files, senders)
    for la in truth["wire"]["launches"]:  # every collective's protocol, read from the wire
        assert js.model.protocol(js.model[la["collective"]]) == la["protocol"], la["what"]
    decs = js.streams.decoders  # the QPs of each connection joined; cut messages' pieces joined
    assert {len(g.qps) for d in decs for g in d._qp_group.values()} == {qps}
    cut = nv.split_data_on_qps_default(v) if split is None else split
    assert (sum(d.cut_pieces for d in decs) > 0) == (qps > 1 and cut)



HELD_FILES = ["rank0_egress.pcapng", "rank1_egress.pcapng", "rank2_egress.pcapng"]


@pytest.fixture(scope="module")
def held_job(tmp_path_factory):
    """3 ranks, 4 channels, Simple: two channels of each rank pair fit every send's size, so the
    resolver holds a connection's sends until it has many (64), which here spans more iterations
    than the collective window."""
    out = tmp_path_factory.mktemp("held")
    return out, generate(GenConfig(ranks=3, channels=4, protocol="Simple", nccl_version=VERSION,
                                   model="linear:50000", steps=24, seed=1, mirrors="0:egress,1:egress,2:egress",
                                   send_truth=False), out)


def _exact_iterations(out, truth):
    js, _, iterations = replay(out, HELD_FILES)
    assert any("receive buffer address" in n for n in js.notes)  # the ambiguous case, decided late
    assert [it.index for it in iterations] == list(range(len(truth["iterations"])))
    for it, want in zip(iterations, truth["iterations"]):
        assert it.complete, (it.index, it.holes)
        assert [sha(b) for b in it.buckets] == want["buckets_sha256"]


def test_sends_held_for_their_channel_lose_no_iteration(held_job):
    """No collective closes incomplete behind sends still held: every iteration of the capture is
    exact (iteration 0 lost a channel's quarter before)."""
    _exact_iterations(*held_job)


def test_sends_held_a_window_long_are_decided_then(held_job, monkeypatch):
    """A connection still undecided once its stream moved a whole collective window past the
    first held send is decided on what it has (as at the end of a capture), so the collectives
    behind it can close: here with a window of 2 and no count that decides, still exact."""
    from mirrorckpt.parser import concat, pipeline
    from mirrorckpt.parser.roce import channels

    monkeypatch.setattr(pipeline, "default_collective_window", lambda model: 2)
    init = channels.ChannelResolver.__init__
    monkeypatch.setattr(channels.ChannelResolver, "__init__",
                        lambda self, *a, **k: init(self, *a, **dict(k, hold=10 ** 9)))
    due = []
    hold = concat.Concatenator.hold
    monkeypatch.setattr(concat.Concatenator, "hold", lambda self, streams: due.append(hold(self, streams)) or due[-1])
    _exact_iterations(*held_job)
    assert any(due)


def test_streams_delivered_far_apart_take_no_channel_by_guess(held_job):
    """Serve's workers split a port by QP pair and deliver their streams apart in time: one
    stream's connection can be held to the count that decides before the other connections of
    its rank pair were ever seen. Ordering it by receive-buffer address among fewer connections
    than its candidate channels is a guess (it swapped channels 1 and 2 of a pair in `serve`
    with two workers, so copies landed in each other's place); the resolver waits for them.
    Each port split in two streams by UDP source port, as two workers split it, every stream fed
    whole, one after the other: every connection takes its true channel, every iteration exact."""
    from mirrorckpt.capture.pcapfile import open_capture
    from mirrorckpt.parser.iteration import ReducedIteration
    from mirrorckpt.parser.pipeline import CollectiveAssembler
    from mirrorckpt.parser.roce.collectives import NcclJobModel
    from mirrorckpt.parser.roce.placer import RingPlacer
    from mirrorckpt.parser.roce.streams import MirrorStreams

    out, truth = held_job
    job = load_job(out / "job.toml")
    caps = [str(out / f) for f in HELD_FILES]
    by_stream: dict[int, list] = {}
    for sends in MirrorStreams([(c, open_capture(c)) for c in caps], nccl_version=job.ring.nccl_version):
        for s in sends:
            s.stream = 2 * s.stream + s.connection.sport % 2  # worker = source port mod 2
            by_stream.setdefault(s.stream, []).append(s)
    model = NcclJobModel.from_job(job)
    placer = RingPlacer(model, job.ring.ranks_by_address())
    asm = CollectiveAssembler(model, placer, nstreams=2 * len(caps))
    items = []
    for k in sorted(by_stream, key=lambda k: (-(k % 2), k)):  # every port's odd worker first
        for i in range(0, len(by_stream[k]), 256):
            items += asm.add(by_stream[k][i:i + 256])[1]
    items += asm.flush()[1]
    want = {p["sport"]: p["channel"] for p in truth["wire"]["topology"]["ring"]}
    assert {c.sport: ch for c, ch in placer.resolver.mapped.items()} == want
    iterations = [x for x in items if isinstance(x, ReducedIteration)]
    assert [it.index for it in iterations] == list(range(len(truth["iterations"])))
    for it, w in zip(iterations, truth["iterations"]):
        assert it.complete, (it.index, it.holes)
        assert [sha(b) for b in it.buckets] == w["buckets_sha256"]
