"""Issue 4 acceptance: the loss sweep. With 1, 2 and 3 mirror streams the fraction of iterations the
parser recovers matches FlowCheck's Eq. 2 (parser/lossmodel), and no incomplete iteration is ever
reported complete (0 silent corruptions over more than 10^4 faulted iterations).

One clean job is generated once: 4 ranks, one channel, LL, NCCL 2.18, PMTU 1024, ``linear:8192``
(one fp32 bucket of 8192 elements: 4 ring chunks of 2048 elements, 16 packets each), 40 iterations,
mirrored at the egress of ranks 0, 1 and 2. The streams of a trial are the egress of ranks 0..M-1.
Each trial drops every frame of every stream independently with probability p (in memory: the
FrameBatch keeps the surviving rows) and replays the streams in-process through the parser
(parser.roce.streams.MirrorStreams over the in-memory batches, parser.roce.jobstream.JobStream with the
job.toml model), exactly what `mirrorckpt replay --config job.toml` runs.

What a lost frame costs is derived from the decoded clean traffic, not assumed: every frame is
traced to its NCCL send and ring placement (roce -> reassembly -> nccl -> statemachine), and each
packet of a fully reduced gradient message is a *unit*: (collective, user-byte range). A unit is
lost only when every copy of it (the same range forwarded by another rank, on another stream) is
lost; frames without reduced data (ACKs, CTS posts, own and partial phases) do not matter. K is the
number of units per iteration (64 here), and ``lossmodel.copies`` must equal the copies of every
unit found in the traffic; every chunk has K/N units, so Eq. 2 is exact for this job:

    P(fail) = lossmodel.fail_probability(p, lossmodel.copies(4, streams), K)

M = 1 (rank 0's egress, chunk 1 never mirrored): P = 1 at any p, p = 0.02, 50 trials;
M = 2 (ranks 0, 1), copies [2, 1, 1, 2]: p = 0.02, P = 0.48, 105 trials;
M = 3 (ranks 0, 1, 2), copies [3, 2, 2, 2]: p = 0.12, P = 0.52, 105 trials.
40 iterations a trial: 10400 faulted iterations, 8400 of them with M >= 2. The observed failure
fraction must be within 4 sigma of P (sigma = sqrt(P (1-P) / n)). The same trials also give an
exact per-iteration oracle (recoverable <=> every unit keeps a copy), against which the parser's
verdict is compared iteration by iteration.

Replays keep the generator's nanosecond clock and MirrorStreams' default merge granularity (4 ms);
``test_the_coarse_clock_changes_no_verdict`` checks on faulted trials that every verdict and every
hole is the same with a strict frame-by-frame merge, a 1 ms merge and timestamps floored to 1 ms.

The one known parser shortfall is a strict xfail with its cause, so it flips when fixed.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import pytest
from common import collect
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.capture.pcapfile import read_all
from mirrorckpt.config.jobfile import load_job
from mirrorckpt.parser import lossmodel, roce
from mirrorckpt.parser.placement import OWN, REDUCED
from mirrorckpt.parser.roce import opcodes
from mirrorckpt.parser.roce.collectives import NcclJobModel
from mirrorckpt.parser.roce.jobstream import JobStream
from mirrorckpt.parser.roce.nccl import NcclDecoder
from mirrorckpt.parser.roce.placer import RingPlacer
from mirrorckpt.parser.roce.reassembly import Reassembler
from mirrorckpt.parser.roce.streams import MirrorStreams
from mirrorckpt.tools.generator.gen import GenConfig, generate

pytestmark = pytest.mark.offline  # capture files in one process: runs beside the unit tests

R, STEPS, COUNT, ESIZE = 4, 40, 8192, 4
CONFIG = {"ranks": R, "channels": 1, "protocol": "LL", "nccl_version": "2.18", "model": f"linear:{COUNT}",
          "steps": STEPS, "seed": 11, "mirrors": "0:egress,1:egress,2:egress", "send_truth": False}
P_LOSS = {1: 0.02, 2: 0.02, 3: 0.12}
TRIALS = {1: 50, 2: 105, 3: 105}
SEED = 2024
CLOCK_NS = 1_000_000
SIGMAS = 4.0

MERGED_PIECES = (
    "parser: three streams at p=0.12 leave 15 of 4200 recoverable iterations reported incomplete. When the "
    "boundary packets of adjacent WRITE messages of one QP are lost (a message's FIRST and LAST and the next "
    "one's FIRST), reassembly returns them as one message. Its last send is recovered from the closing "
    "immediate (NcclDecoder._merged_tail), but the part before it has no proven start (a whole lost message may "
    "precede it) and is dropped, with any copy of a reduced chunk that survived in it. Nothing is placed by "
    "guess: every such iteration is reported incomplete, and the zero-silent-corruption check holds")


# -- the job and what its traffic says -------------------------------------------------------------------


@dataclass
class FrameMap:
    """Per stream and frame: the ring placement of the frame's packet (-1: none), and the reduced unit it
    carries (-1: no fully reduced gradient data); per unit its iteration and chunk."""

    coll: list[np.ndarray]
    step: list[np.ndarray]
    pkt: list[np.ndarray]
    unit: list[np.ndarray]
    unit_iteration: np.ndarray
    unit_chunk: np.ndarray
    phase: dict  # (stream, coll, step) -> phase


@dataclass
class Job:
    out: object
    truth: dict
    config: object
    batches: list[FrameBatch]  # per stream (egress of rank k), the clean capture
    fmap: FrameMap

    def replay(self, batches, clock_ns: int | None = None, merge_ns: int | None = None):
        """The parser on in-memory streams (``merge_ns`` None: MirrorStreams' default); returns
        (JobStream, iterations)."""
        if clock_ns:
            batches = [coarse(b, clock_ns) for b in batches]
        kw = {} if merge_ns is None else {"merge_ns": merge_ns}
        ms = MirrorStreams([(f"rank{k}_egress", [b]) for k, b in enumerate(batches)],
                           nccl_version=self.config.ring.nccl_version, **kw)
        js = JobStream(ms, model=NcclJobModel.from_job(self.config), ranks=self.config.ring.ranks_by_address(),
                       channels=None, nccl_version=self.config.ring.nccl_version)
        _, iterations, _ = collect(js)
        return js, iterations

    def want(self, i: int) -> list[str]:
        return self.truth["iterations"][i]["buckets_sha256"]

    def message(self, k: int, coll: int, step: int) -> np.ndarray:
        """Frames of stream k's message at ring step ``step`` of collective ``coll``, in packet order."""
        f = np.flatnonzero((self.fmap.coll[k] == coll) & (self.fmap.step[k] == step))
        return f[np.argsort(self.fmap.pkt[k][f])]


def keep_rows(b: FrameBatch, keep: np.ndarray) -> FrameBatch:
    i = np.flatnonzero(keep)
    return FrameBatch(b.data, b.offset[i], b.caplen[i], b.wirelen[i], b.ts_ns[i], b.iface[i], b.source)


def coarse(b: FrameBatch, clock_ns: int) -> FrameBatch:
    return FrameBatch(b.data, b.offset, b.caplen, b.wirelen, b.ts_ns // clock_ns * clock_ns, b.iface, b.source)


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def frame_map(config, batches: list[FrameBatch]) -> FrameMap:
    """Traces every frame of the clean streams through the parser's stages to its ring placement."""
    n = [len(b) for b in batches]
    coll = [np.full(x, -1) for x in n]
    step = [np.full(x, -1) for x in n]
    pkt = [np.full(x, -1) for x in n]
    unit = [np.full(x, -1) for x in n]
    sends = []
    for k, b in enumerate(batches):
        pk, _ = roce.decode(b)
        rs = Reassembler()
        dec = NcclDecoder(config.ring.nccl_version, stream=k)
        for m in rs.feed(pk, b.data) + rs.flush():
            assert m.complete
            for s in dec.feed([m]):  # one message at a time: each data message is one send
                sends.append((s.ts_ns, k, s, m, pk))
    sends.sort(key=lambda x: (x[0], x[1]))
    by_id = {id(s): (k, m, pk) for _, k, s, m, pk in sends}
    ra = RingPlacer(NcclJobModel.from_job(config), config.ring.ranks_by_address())
    units: dict[tuple, int] = {}
    info = []
    phase = {}
    for _, _, s0, _, _ in sends:
        for s in ra.resolver.offer(s0) if ra.resolver.is_ring(s0.connection) else [s0]:
            p = ra.sm.place(s)
            if p is None:
                continue
            k, m, pk = by_id[id(s)]
            rows = np.flatnonzero((pk.dqp == m.qp.dqp) & opcodes.IS_WRITE[pk.opcode]
                                  & ((pk.psn - m.psn) % (1 << 24) < m.npkts))
            assert len(rows) == m.npkts
            j = (pk.psn[rows] - m.psn) % (1 << 24)
            f = pk.frame[rows]
            coll[k][f], step[k][f], pkt[k][f] = p.coll, p.step.step, j
            phase[(k, p.coll, p.step.step)] = p.step.phase
            if p.spec.label != "grad" or p.step.phase != REDUCED or not p.step.nelem:
                continue
            assert s.protocol == "LL"
            half = len(m.data) // m.npkts // 2  # user bytes per full LL packet
            for jj, ff in zip(j.tolist(), f.tolist()):
                lo, hi = jj * half, min((jj + 1) * half, p.step.nelem * ESIZE)
                if hi <= lo:
                    continue
                key = (p.coll, p.step.offset * ESIZE + lo, p.step.offset * ESIZE + hi)
                if key not in units:
                    units[key] = len(units)
                    info.append((p.spec.iteration, p.step.chunk))
                unit[k][ff] = units[key]
    it, ch = (np.array(x) for x in zip(*info))
    return FrameMap(coll, step, pkt, unit, it, ch, phase)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Job:
    out = tmp_path_factory.mktemp("loss_sweep")
    truth = generate(GenConfig(**CONFIG), out)
    config = load_job(out / "job.toml")
    batches = [read_all(out / c["file"]).copy() for c in truth["wire"]["captures"]]
    assert [c["file"] for c in truth["wire"]["captures"]] == [f"rank{k}_egress.pcapng" for k in range(3)]
    return Job(out, truth, config, batches, frame_map(config, batches))


def streams_of(M: int) -> list[tuple[int, str]]:
    return [(r, "egress") for r in range(M)]


def units_per_iteration(job: Job) -> int:
    per = np.bincount(job.fmap.unit_iteration, minlength=STEPS)
    assert (per == per[0]).all(), per
    return int(per[0])


# -- the sweep -----------------------------------------------------------------------------------------


@dataclass
class Outcome:
    M: int
    p: float
    complete: np.ndarray  # trials x iterations: reported complete
    exact: np.ndarray  # reported complete and every bucket equal to truth
    oracle: np.ndarray  # every unit kept a copy
    reported: list  # per trial, the iteration indexes reported


def oracle(job: Job, masks: list[np.ndarray]) -> np.ndarray:
    """Per iteration: does every reduced unit keep at least one copy?"""
    fm = job.fmap
    alive = np.zeros(len(fm.unit_iteration), np.int64)
    for k, keep in enumerate(masks):
        u = fm.unit[k][keep]
        np.add.at(alive, u[u >= 0], 1)
    lost = np.zeros(STEPS, bool)
    np.logical_or.at(lost, fm.unit_iteration[alive == 0], True)
    return ~lost


def masks_of(M: int, trial: int, job: Job) -> list[np.ndarray]:
    rng = np.random.default_rng([SEED, M, trial])
    return [rng.random(len(b)) >= P_LOSS[M] for b in job.batches[:M]]


@pytest.fixture(scope="module")
def sweep(job) -> dict[int, Outcome]:
    out = {}
    for M in (1, 2, 3):
        n = TRIALS[M]
        o = Outcome(M, P_LOSS[M], np.zeros((n, STEPS), bool), np.zeros((n, STEPS), bool),
                    np.zeros((n, STEPS), bool), [])
        for t in range(n):
            masks = masks_of(M, t, job)
            o.oracle[t] = oracle(job, masks)
            _, its = job.replay([keep_rows(b, m) for b, m in zip(job.batches, masks)])
            o.reported.append([it.index for it in its])
            for it in its:
                if 0 <= it.index < STEPS and it.complete:
                    o.complete[t, it.index] = True
                    o.exact[t, it.index] = [sha(b) for b in it.buckets] == job.want(it.index)
        out[M] = o
    return out


# -- the job -------------------------------------------------------------------------------------------


def test_the_clean_job_is_bit_exact(job):
    for M in (2, 3):
        js, its = job.replay(job.batches[:M])
        assert js.report().placement.get("mismatch", 0) == 0
        assert [it.index for it in its] == list(range(STEPS))
        assert all(it.complete and [sha(b) for b in it.buckets] == job.want(it.index) for it in its)
    js, its = job.replay(job.batches[:1])
    assert [it.index for it in its] == list(range(STEPS)) and not any(it.complete for it in its)


def test_K_and_the_copies_come_from_the_traffic(job):
    """K counted from the decoded packets equals the plan's, every chunk has K/N units, and each unit's
    copies in the streams of M ranks are lossmodel.copies' count for its chunk."""
    fm = job.fmap
    K = units_per_iteration(job)
    # the plan: every chunk's fully reduced message, one unit per LL packet (PMTU 1024: 512 user bytes)
    model = NcclJobModel.from_job(job.config)
    plan = model.plan(model[model.first_of_iteration(2)])
    chunks = plan.chunk_ranges(0)
    assert K == sum(math.ceil(n * ESIZE / 512) for _, _, n in chunks) == 64
    per_chunk = np.bincount(fm.unit_chunk[fm.unit_iteration == 5], minlength=R)
    assert per_chunk.tolist() == [K // R] * R
    for M in (1, 2, 3):
        want = lossmodel.copies(R, streams_of(M))
        got = np.zeros(len(fm.unit_iteration), np.int64)
        for k in range(M):
            u = fm.unit[k]
            np.add.at(got, u[u >= 0], 1)
        assert (got == np.asarray(want)[fm.unit_chunk]).all(), M
    # frames that carry no reduced data exist on every stream (ACKs, CTS, own and partial phases)
    for k in range(3):
        assert (fm.unit[k] < 0).sum() > STEPS * 3 * 16


def test_the_coarse_clock_changes_no_verdict(job):
    for M in (2, 3):
        masks = masks_of(M, 0, job)
        batches = [keep_rows(b, m) for b, m in zip(job.batches, masks)]
        _, strict = job.replay(batches, clock_ns=None, merge_ns=0)  # frame by frame in time order
        _, fine = job.replay(batches, clock_ns=None)  # MirrorStreams' default merge granularity
        _, one_ms = job.replay(batches, clock_ns=None, merge_ns=1_000_000)
        _, coarse_ = job.replay(batches, clock_ns=CLOCK_NS)
        verdicts = [[(it.index, it.complete, it.holes) for it in its] for its in (strict, fine, one_ms, coarse_)]
        assert verdicts[0] == verdicts[1] == verdicts[2] == verdicts[3]
        assert 0 < sum(it.complete for it in fine) < STEPS


# -- the acceptance ------------------------------------------------------------------------------------


def test_no_incomplete_iteration_is_ever_reported_complete(sweep):
    total = sum(o.complete.size for o in sweep.values())
    assert total >= 10_000
    for o in sweep.values():
        assert (o.exact == o.complete).all(), (
            f"{o.M} streams: {int((o.complete & ~o.exact).sum())} iterations reported complete with a bucket "
            f"that differs from truth (silent corruption)")
    assert not sweep[1].complete.any()
    assert sum(int(o.complete.sum()) for o in sweep.values()) > 3000  # the check is not vacuous


def eq2_prediction(job: Job, o: Outcome) -> float:
    K = units_per_iteration(job)
    want = lossmodel.fail_probability(o.p, lossmodel.copies(R, streams_of(o.M)), K)
    # M egress streams of consecutive ranks hold the copy counts of Eq. 2's M monitored ranks
    assert want == pytest.approx(lossmodel.eq2(o.p, o.M, R, K), rel=1e-12)
    return want


@pytest.mark.parametrize("M", [1, 2, 3])
def test_the_oracle_matches_eq2(job, sweep, M):
    """The model, not the parser: the trials' per-iteration oracle fails as often as Eq. 2 predicts."""
    o = sweep[M]
    want, n = eq2_prediction(job, o), o.oracle.size
    sigma = math.sqrt(want * (1 - want) / n)
    assert abs((1 - o.oracle.mean()) - want) <= SIGMAS * sigma
    if M > 1:
        assert 0.3 < want < 0.7  # mid-range: the comparison has power


@pytest.mark.parametrize("M", [1, 2, 3])
def test_recoverable_fraction_matches_eq2(job, sweep, M):
    o = sweep[M]
    want = eq2_prediction(job, o)
    n = o.complete.size
    got = 1.0 - o.complete.mean()
    sigma = math.sqrt(want * (1 - want) / n)
    assert abs(got - want) <= SIGMAS * sigma, (
        f"{M} streams, p={o.p}: P(fail) {got:.4f} observed over {n} iterations, Eq. 2 predicts {want:.4f} "
        f"(sigma {sigma:.4f}); the per-iteration oracle fails {1 - o.oracle.mean():.4f}")


@pytest.mark.parametrize("M", [1, 2, 3])
def test_every_verdict_is_the_oracle(sweep, M, request):
    """Iteration by iteration: complete exactly when every reduced unit kept a copy somewhere."""
    if M == 3:
        request.applymarker(pytest.mark.xfail(strict=True, reason=MERGED_PIECES))
    o = sweep[M]
    assert all(r == list(range(STEPS)) for r in o.reported)
    bad = np.argwhere(o.complete != o.oracle)
    assert len(bad) == 0, f"{len(bad)} of {o.complete.size} verdicts differ from the oracle, first (trial, " \
                          f"iteration): {bad[:5].tolist()}; recoverable but incomplete: " \
                          f"{int((o.oracle & ~o.complete).sum())}"


# -- the failures, one at a time -------------------------------------------------------------------------


def first_coll(job: Job, i: int) -> int:
    return NcclJobModel.from_job(job.config).first_of_iteration(i)


def test_frames_without_reduced_data_cost_nothing_at_the_end(job):
    """One own-phase packet of rank 1 ten iterations before the end, one of rank 0 in the last iteration:
    no reduced packet is lost, so every iteration is complete."""
    keep = [np.ones(len(b), bool) for b in job.batches[:2]]
    for k, i in ((1, STEPS - 10), (0, STEPS - 1)):
        f = job.message(k, first_coll(job, i), 0)
        assert job.fmap.phase[(k, first_coll(job, i), 0)] == OWN and len(f) == 16
        keep[k][f[3]] = False
    assert oracle(job, keep).all()
    _, its = job.replay([keep_rows(b, m) for b, m in zip(job.batches, keep)])
    assert [it.index for it in its] == list(range(STEPS))
    incomplete = [it.index for it in its if not it.complete]
    assert incomplete == [], f"iterations {incomplete} reported incomplete"


def merged(job: Job, i: int):
    """Rank 0 (stream 0) loses the FIRST and LAST packets of its ring-step 3 (reduced chunk 0) and step 4
    (reduced chunk 3) messages of iteration i: two messages whose boundary is gone."""
    c = first_coll(job, i)
    keep = [np.ones(len(b), bool) for b in job.batches[:2]]
    for s in (3, 4):
        f = job.message(0, c, s)
        assert job.fmap.phase[(0, c, s)] == REDUCED and len(f) == 16
        keep[0][[f[0], f[-1]]] = False
    return c, keep


def test_a_lost_message_boundary_spoils_no_good_copy(job):
    """Chunks 0 and 3 are complete on rank 1's egress: the iteration is recoverable."""
    i = 20
    _, keep = merged(job, i)
    assert oracle(job, keep)[i]
    _, its = job.replay([keep_rows(b, m) for b, m in zip(job.batches, keep)])
    it = next(x for x in its if x.index == i)
    assert it.complete and [sha(b) for b in it.buckets] == job.want(i), it.holes


def test_a_lost_message_boundary_is_never_silent(job):
    """Rank 0 (stream 0) loses the LAST packet of its ring-step 5 message of iteration i (reduced chunk 2, which
    rank 1's egress lacks) and the FIRST and LAST packets of its next message (iteration i+1, own phase):
    chunk 2's last packet has no copy, the iteration cannot be recovered and must be reported incomplete."""
    i = 20
    c = first_coll(job, i)
    a, b = job.message(0, c, 5), job.message(0, c + 1, 0)
    assert job.fmap.phase[(0, c, 5)] == REDUCED and job.fmap.phase[(0, c + 1, 0)] == OWN
    assert lossmodel.copies(R, streams_of(2))[2] == 1 and len(a) == len(b) == 16
    keep = [np.ones(len(x), bool) for x in job.batches[:2]]
    keep[0][[a[-1], b[0], b[-1]]] = False
    assert oracle(job, keep).tolist() == [x != i for x in range(STEPS)]
    _, its = job.replay([keep_rows(x, m) for x, m in zip(job.batches, keep)])
    it = next(x for x in its if x.index == i)
    assert not it.complete, "reported complete: bucket sha256 " + (
        "equals" if [sha(x) for x in it.buckets] == job.want(i) else "differs from") + " truth"


def test_the_last_send_of_a_merged_message_is_recovered(job):
    """Rank 0 (stream 0) loses the FIRST and LAST packets of its ring-step 3 message of iteration i (reduced
    chunk 0) and the FIRST of its step-4 message (chunk 3); rank 1's egress, which also carries both chunks,
    loses the packet with one unit of chunk 3 from the middle of step 4. Reassembly returns stream 0's two
    messages as one, closed by step 4's LAST: the immediate gives step 4's size and its lines step 4's flag,
    so step 4 is taken from the message's end, and its middle unit makes the iteration complete."""
    i = 20
    c = first_coll(job, i)
    a, b = job.message(0, c, 3), job.message(0, c, 4)
    assert job.fmap.phase[(0, c, 3)] == REDUCED and job.fmap.phase[(0, c, 4)] == REDUCED
    assert len(a) == len(b) == 16
    keep = [np.ones(len(x), bool) for x in job.batches[:2]]
    keep[0][[a[0], a[-1], b[0]]] = False
    unit = job.fmap.unit[0][b[5]]
    (other,) = np.flatnonzero(job.fmap.unit[1] == unit)  # the same unit on rank 1's egress
    keep[1][other] = False
    assert oracle(job, keep)[i]
    js, its = job.replay([keep_rows(x, m) for x, m in zip(job.batches, keep)])
    assert js.streams.decoders[0].merged_tails >= 1
    it = next(x for x in its if x.index == i)
    assert it.complete and [sha(x) for x in it.buckets] == job.want(i), it.holes


# -- issue 13: protocol mix, 2.20+ releases, several QPs -------------------------------------------------

# (id, ranks, release, model, QPs per connection, frame loss rate, trials): protocol "auto", two channels,
# 6 iterations, the egress of ranks 0, 1 and 2. mlp:4096,256,256,8 at R=3 all-reduces LL, LL128 and Simple
# buckets; mlp:2048,64,8 at R=4 LL and LL128 (tools/generator/tuning).
MIX = [("auto-r3-v223", 3, "2.23", "mlp:4096,256,256,8", 1, 2e-4, 6),
       ("auto-r4-qp2-v229", 4, "2.29", "mlp:2048,64,8", 2, 2e-3, 6),
       # 4 QPs, messages cut over them (issue 13: a piece whose message its PSNs do not prove is never joined;
       # 2 streams, trial 4 had iterations 1, 3 and 4 complete with a wrong LL128 chunk)
       ("auto-r4-qp4-v218", 4, "2.18", "mlp:2048,64,8", 4, 2e-3, 6)]
MIX_STEPS = 6


@pytest.fixture(scope="module", params=MIX, ids=[m[0] for m in MIX])
def mix_job(request, tmp_path_factory):
    from mirrorckpt.tools import cmd_replay
    from mirrorckpt.tools.generator.wire import WireOptions

    name, R_, v, model, qps, _, _ = request.param
    out = tmp_path_factory.mktemp(name)
    truth = generate(GenConfig(ranks=R_, channels=2, protocol="auto", nccl_version=v, model=model, steps=MIX_STEPS,
                               seed=qps, bucket_cap_mb=500 * 4 / (1 << 20), mirrors="0:egress,1:egress,2:egress",
                               send_truth=False, wire=WireOptions(qps_per_connection=qps)), out)
    files = [str(out / c["file"]) for c in truth["wire"]["captures"]]
    # what `replay --config job.toml` does first: each collective shape's protocol from the clean wire
    config, _ = cmd_replay._complete_from_wire(load_job(out / "job.toml"), files, v, None, True)
    return request.param, truth, config, [read_all(f).copy() for f in files]


def test_mix_under_loss_no_silent_corruption(mix_job):
    """Every iteration reported complete under random frame loss, with 2 and 3 streams, equals truth."""
    (name, R_, v, _, qps, p, trials), truth, config, batches = mix_job
    assert len({la["protocol"] for la in truth["wire"]["launches"] if la["kind"] == "allreduce"}) >= 2
    job = Job(None, truth, config, batches, None)
    for M in (2, 3):
        _, its = job.replay(batches[:M])  # clean: every iteration exact
        assert [it.index for it in its] == list(range(MIX_STEPS))
        assert all(it.complete and [sha(b) for b in it.buckets] == job.want(it.index) for it in its)
    complete = incomplete = 0
    for M in (2, 3):
        for t in range(trials):
            rng = np.random.default_rng([SEED, M, t, qps])
            _, its = job.replay([keep_rows(b, rng.random(len(b)) >= p) for b in batches[:M]])
            for it in its:
                if it.complete:
                    complete += 1
                    assert [sha(b) for b in it.buckets] == job.want(it.index), \
                        f"{name}: {M} streams, trial {t}: iteration {it.index} complete with a wrong bucket"
                else:
                    incomplete += 1
                    assert it.buckets == []
    assert complete > 0 and incomplete > 0, (complete, incomplete)  # the loss rate has power both ways


# Issue 13: messages cut over the QPs of a Simple job, whose lines carry no flag to check a join by: every
# piece's message must be proven by its QP's PSNs. 2.18 cuts every message by default; 2.29 only with
# NCCL_IB_SPLIT_DATA_ON_QPS=1, and then rotates piece i of message k to QP (k + i) mod nqps.
# (id, release, QPs per connection, [(frame loss rate, trials)])
CUT = [("v218-qp2", "2.18", 2, [(1e-2, 8)]), ("v218-qp4", "2.18", 4, [(2e-3, 8), (1e-2, 8)]),
       ("v229-qp4-split", "2.29", 4, [(2e-3, 6), (1e-2, 6)])]


@pytest.fixture(scope="module", params=CUT, ids=[c[0] for c in CUT])
def cut_job(request, tmp_path_factory):
    from mirrorckpt.tools.generator.wire import WireOptions

    name, v, qps, _ = request.param
    out = tmp_path_factory.mktemp(name)
    truth = generate(GenConfig(ranks=4, channels=2, protocol="Simple", nccl_version=v, model="linear:300000",
                               steps=MIX_STEPS, seed=qps, mirrors="0:egress,1:egress,2:egress", send_truth=False,
                               wire=WireOptions(qps_per_connection=qps, split_data_on_qps=True)), out)
    config = load_job(out / "job.toml")
    return request.param, truth, config, [read_all(out / c["file"]).copy() for c in truth["wire"]["captures"]]


def test_cut_messages_under_loss_no_silent_corruption(cut_job):
    (name, _, qps, runs), truth, config, batches = cut_job
    job = Job(None, truth, config, batches, None)
    _, its = job.replay(batches[:2])  # clean: every iteration exact
    assert all(it.complete and [sha(b) for b in it.buckets] == job.want(it.index) for it in its)
    complete = incomplete = 0
    decs = []
    for p, trials in runs:
        for M in (2, 3):
            for t in range(trials):
                rng = np.random.default_rng([SEED, M, t, qps, int(p * 1e4)])
                js, its = job.replay([keep_rows(b, rng.random(len(b)) >= p) for b in batches[:M]])
                decs += js.streams.decoders
                assert [it.index for it in its] == list(range(MIX_STEPS))
                for it in its:
                    if it.complete:
                        complete += 1
                        assert [sha(b) for b in it.buckets] == job.want(it.index), \
                            f"{name}, p={p}, {M} streams, trial {t}: iteration {it.index} complete and wrong"
                    else:
                        incomplete += 1
    assert sum(d.cut_pieces for d in decs) > 0
    if qps == 2:
        # the loss leaves pieces whose message is not proven, sent on alone. With 4 QPs it no longer
        # does: since the reassembler hands a lost message on once its QP has opened 4 more (not after
        # 1024 PSNs), the PSN gaps prove every piece at these rates, with the same verdicts as before
        # (test_nccl_cut keeps pieces whose message is unproven: sent on alone, or dropped under 2.29's
        # rotation)
        assert sum(d.lone_pieces + d.lost_pieces for d in decs) > 0
    assert complete > 0 and incomplete > 0, (complete, incomplete)
