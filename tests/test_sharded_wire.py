"""Sharded-optimizer jobs from the wire: each framework's collective sequence (config.shard_steps)
against the generator's (tools.generator.sharded_wire), every followed ring replayed equal to truth
(the other communicators' traffic on its ports left unplaced and uncounted), reduce-scatter values
and plans, the shard sink (padding out, slices of the initial weights, the global clipping
coefficient), weight snapshots, and [[ring]] job files refused in words."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from mirrorckpt.config import shard_rules, shard_steps
from mirrorckpt.config.jobfile import ConfigError, load_job
from mirrorckpt.config.layout import ParamSpec
from mirrorckpt.config.shards import PAD
from mirrorckpt.config.training import OptimizerSpec, TrainingSpec
from mirrorckpt.parser.concat import CollectiveResult
from mirrorckpt.parser.iteration import GatheredWeights, InitialWeights, ReducedIteration
from mirrorckpt.parser.roce import ringreduce, schedule
from mirrorckpt.parser.roce.collectives import NcclJobModel
from mirrorckpt.parser.roce.jobstream import JobStream
from mirrorckpt.parser.roce.streams import MirrorStreams
from mirrorckpt.tools.cmd_replay import open_capture
from mirrorckpt.tools.generator.sharded_wire import ReduceScatterValues, ShardedWireConfig, generate_sharded_wire
from mirrorckpt.updater.manifest import tensor_sha256
from mirrorckpt.updater.shard_clip import NormExchange, clip_coefficient, global_norm, local_norm
from mirrorckpt.updater.shard_sink import ShardSink, kept_ranges
from mirrorckpt.updater.weights import WeightsFollower

TRAINING = TrainingSpec(optimizer=OptimizerSpec(name="adamw", lr=0.01, weight_decay=0.01))
# 33 rows: FSDP2 pads shard 1 of every dim-0 cut; ZeRO cuts a parameter between partitions
MODEL = "mlp:16,33,8"
JOBS = {"hsdp": ShardedWireConfig(scheme="hsdp", ranks=2, shard=2, model=MODEL, steps=2, protocol="LL",
                                  training=TRAINING),
        "zero": ShardedWireConfig(scheme="zero", ranks=2, model=MODEL, steps=2, protocol="Simple", training=TRAINING),
        "zero-LL": ShardedWireConfig(scheme="zero", ranks=2, model=MODEL, steps=2, protocol="LL", training=TRAINING),
        "fsdp": ShardedWireConfig(scheme="fsdp", shard=3, model=MODEL, steps=2, protocol="Simple",
                                  training=TRAINING)}


@pytest.fixture(scope="module", params=sorted(JOBS))
def job(request, tmp_path_factory):
    return generate_sharded_wire(JOBS[request.param], tmp_path_factory.mktemp(request.param))


def _steps(layout, rc):
    return (shard_steps.shard_group_ring(layout, rc.replica) if rc.weights_only
            else shard_steps.gradient_ring(layout, rc.group))


def _replay(jobfile, rc, steps):
    streams = MirrorStreams([(m.source, open_capture(m.source)) for m in rc.mirrors],
                            nccl_version=rc.ring.nccl_version)
    js = JobStream(streams, model=NcclJobModel.sharded(rc.ring, steps), ranks=rc.ring.ranks_by_address())
    return js, list(js)


def test_the_generator_issues_each_ring_as_shard_steps_says(job):
    """Every communicator's recorded collectives, kind, label and size, are config.shard_steps' sequence."""
    layout = job.layout
    for name, comm in job.comms.items():
        if name.startswith("shard"):
            steps = shard_steps.shard_group_ring(layout, int(name[5:]))
        else:
            steps = shard_steps.gradient_ring(layout, next(g.name for g in layout.groups if g.ranks == comm.members))
        assert steps.ranks == comm.members
        kinds = {"allreduce": "all_reduce", "allgather": "all_gather", "broadcast": "broadcast",
                 "reducescatter": "reduce_scatter"}
        want = [(kinds[c.kind], c.label.split(":")[0] + (":" if c.label.startswith("init") else ""), c.count)
                for c in steps.startup] + \
            [(kinds[c.kind], c.label, c.count) for _ in range(job.cfg.steps) for c in steps.per_iteration]
        got = [(r.kind, r.what.split(":")[0] + (":" if r.what.startswith("init") else ""), r.count)
               for r in comm.records]
        assert got == want, name


def test_every_followed_ring_replays_equal_to_truth(job):
    """Each [[ring]] of the generated job file: every collective of its communicator reassembled as the
    trainer's result (sha256), reduce-scatters kept out, nothing mismatched; on an HSDP replica ring the
    shard groups' traffic on the same ports is not placed."""
    jf = load_job(job.out / "job.toml")
    truth = json.loads((job.out / "truth.json").read_text())
    assert [rc.name for rc in jf.rings] == ([g.name for g in job.layout.groups] if job.cfg.scheme != "fsdp"
                                            else ["weights-0"])
    for rc in jf.rings:
        js, items = _replay(jf, rc, _steps(jf.shards, rc))
        comm = "shard0" if rc.weights_only else truth["groups"][rc.group]["comm"]
        want = truth["comms"][comm]["collectives"]
        results = [i for i in items if isinstance(i, CollectiveResult)]
        assert len(results) == len(want)
        for w, r in zip(want, results):
            if w["kind"] == "reduce_scatter":
                assert r.count == 0 and r.complete  # placed for the ring's steps, nothing assembled
            else:
                assert r.sha256() == w["sha256"], (rc.name, w["what"])
        report = js.report()
        assert report.mismatches == []
        placement = dict(report.placement)
        assert set(placement) <= {"placed", "not_ring"} and placement["placed"] > 0
        if job.cfg.scheme == "hsdp":
            assert placement["not_ring"] > 0  # the shard groups' all-gathers and reduce-scatters
        its = [i for i in items if isinstance(i, ReducedIteration)]
        assert all(it.complete for it in its) and len(its) == (0 if rc.weights_only else job.cfg.steps)


def test_shard_sink_and_weights_give_the_trainers_state(job):
    """Through the ring's sink: each replica shard equals the trainer's shard after every step (the
    padding never stepped); a weights-only ring's snapshots equal the parameters before each step."""
    from mirrorckpt.updater.appliance import Appliance
    from mirrorckpt.updater.shard_sink import seed_weights

    jf = load_job(job.out / "job.toml")
    truth = json.loads((job.out / "truth.json").read_text())
    for rc in jf.rings:
        steps = _steps(jf.shards, rc)
        if rc.weights_only:
            snaps: dict = {}
            follower = WeightsFollower(jf.shards, steps, snaps.__setitem__)
            _, items = _replay(jf, rc, steps)
            for it in items:
                if isinstance(it, GatheredWeights):
                    follower.weights(it)
            assert sorted(snaps) == list(range(job.cfg.steps))
            for s, p in snaps.items():
                assert {k: tensor_sha256(v) for k, v in p.items()} == truth["params"][s]
            continue
        app = Appliance(None, TRAINING)
        sink = ShardSink(jf.shards, rc.group, app)
        if jf.initial:
            sink.initial_weights(seed_weights(jf.initial, jf.shards, rc.group))
        _, items = _replay(jf, rc, steps)
        from mirrorckpt.updater.drive import drive

        drive(items, sink)
        want = truth["groups"][rc.group]["iterations"][-1]
        assert app.summary.iterations_applied == job.cfg.steps
        assert app.replica.state_sha256() == (want["params_sha256"], want["optim_sha256"])


def test_reduce_scatter_messages_carry_partial_sums_never_a_finished_shard():
    """Ring reduce-scatter of 3 ranks: position r sends at step s chunk (r-s-1) holding the sum of s+1
    inputs from position c+1 on; the owner's finished part (its own term added) is never a payload."""
    R, count = 3, 1000
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(R * count).astype(np.float32) for _ in range(R)]
    plan = schedule.reducescatter_plan(count, 4, R, 1, "Simple", "2.18")
    orders = [list(range(R))]
    vals = ReduceScatterValues(plan, inputs, orders)

    class W:
        channel = 0

    finished = [ringreduce.ring_sum(inputs, c + 1, R, c * count, (c + 1) * count, "float32") for c in range(R)]
    for g in range(len(plan.messages(0, 0))):
        vals.begin_slot(g)
        for r in range(R):
            m = plan.messages(r, 0)[g]
            assert m.chunk == (r - m.step - 1) % R and m.phase in ("own", "partial")
            got = vals.payload(W, m).view(np.float32)
            lo = m.chunk * count + m.offset
            want = ringreduce.ring_sum(inputs, m.chunk + 1, m.step + 1, lo, lo + m.nelem, "float32")
            assert np.array_equal(got, want)
            if m.nelem:
                assert not np.array_equal(got, finished[m.chunk][m.offset:m.offset + m.nelem])
    for c in range(R):
        assert np.array_equal(vals.result[c], finished[c])


LAYER_PARAMS = [ParamSpec("0.weight", (33, 16)), ParamSpec("0.bias", (33,)), ParamSpec("2.weight", (8, 33)),
                ParamSpec("2.bias", (8,))]


def test_shard_sink_takes_the_slices_out_of_padded_buffers_and_clips_by_the_global_norm():
    layout = shard_rules.hsdp(LAYER_PARAMS, 2, 2, units=[["2.weight", "2.bias"], ["0.weight", "0.bias"]])
    g = layout.group("pp0-tp0-sh1")
    assert kept_ranges(g.wire[1]) == [(0, 16 * 16), (17 * 16, 17 * 16 + 16)]  # 16 rows of 17, then the bias
    got = []

    class Inner:
        def initial_weights(self, w):
            got.append(w)

        def apply(self, it):
            got.append(it)

        def bucket(self, b):
            got.append(b)

    full = {p.name: np.arange(p.numel, dtype=np.float32).reshape(p.shape) + 1000 * i
            for i, p in enumerate(LAYER_PARAMS)}
    sink = ShardSink(layout, g.name, Inner())
    sink.initial_weights(InitialWeights(layout.global_layout(), np.concatenate([full[p.name].reshape(-1)
                                                                               for p in LAYER_PARAMS])))
    want = np.concatenate([full["0.weight"][17:].reshape(-1), full["0.bias"][17:], full["2.weight"][4:].reshape(-1),
                           full["2.bias"][4:]])
    assert got[0].layout == g.job_layout() and np.array_equal(got[0].values, want)
    bufs = [np.arange(n, dtype=np.float32) for n in g.wire_numel()]
    sink.apply(ReducedIteration(0, bufs))
    for b, (segments, out) in enumerate(zip(g.wire, got[1].buckets)):
        pos, parts = 0, []
        for i, n in segments:
            if i != PAD:
                parts.append(bufs[b][pos:pos + n])
            pos += n
        assert np.array_equal(out, np.concatenate(parts))
    sink.apply(ReducedIteration(1, [], complete=False, holes={0: [(0, 3)]}))
    assert not got[2].complete and got[2].buckets == []


def test_norm_exchange_gives_every_ring_the_trainers_coefficient():
    """Two rings' updater threads meet per iteration: one coefficient, the global norm's; a ring
    that has no norm (an incomplete iteration) or ended leaves the others without one."""
    ex = NormExchange(["a", "b"], max_norm=0.5, norm_type=2.0)
    grads = {"a": [torch.tensor([3.0, 4.0])], "b": [torch.tensor([12.0]), torch.tensor([0.0, 5.0])]}
    out = {}

    def run(name, it, norm):
        out[(name, it)] = ex.coefficient(name, it, norm, timeout=10)

    ts = [threading.Thread(target=run, args=(n, 0, local_norm(grads[n], 2.0))) for n in ("a", "b")]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    total = global_norm([local_norm(grads["a"], 2.0), local_norm(grads["b"], 2.0)], 2.0)
    assert float(total) == pytest.approx(float(np.sqrt(25 + 169)))
    assert out[("a", 0)] == out[("b", 0)] == clip_coefficient(total, 0.5)
    t = threading.Thread(target=run, args=("a", 1, local_norm(grads["a"], 2.0)))
    t.start()
    run("b", 1, None)
    t.join()
    assert out[("a", 1)] is None and out[("b", 1)] is None
    ex.ended("b")
    assert ex.coefficient("a", 2, local_norm(grads["a"], 2.0), timeout=10) is None


def test_an_incomplete_gather_gives_no_weight_snapshot():
    layout = shard_rules.hsdp(LAYER_PARAMS, 1, 2, units=[["2.weight", "2.bias"], ["0.weight", "0.bias"]])
    steps = shard_steps.shard_group_ring(layout)
    snaps: dict = {}
    f = WeightsFollower(layout, steps, snaps.__setitem__)
    counts = [c.count * 2 for c in steps.per_iteration if c.label == "params"]
    f.weights(GatheredWeights(0, 0, np.zeros(counts[0], np.float32)))
    f.weights(GatheredWeights(0, 1, None, [(0, 4)]))
    for k, n in enumerate(counts):
        f.weights(GatheredWeights(1, k, np.ones(n, np.float32)))
    summary = f.close()
    assert list(snaps) == [1] and summary.incomplete == 1 and summary.snapshots == 1
    assert all(torch.equal(v, torch.ones_like(v)) for v in snaps[1].values())


# ---- [[ring]] job files ------------------------------------------------------------------------------


@pytest.fixture
def ring_file(tmp_path):
    layout = shard_rules.hsdp(LAYER_PARAMS, 2, 2, units=[["2.weight", "2.bias"], ["0.weight", "0.bias"]])
    (tmp_path / "shards.json").write_text(json.dumps(layout.to_dict()))

    def write(rings: str, job: str = 'shards = "shards.json"\ninitial = "seed"', top: str = "") -> Path:
        p = tmp_path / "job.toml"
        p.write_text(f"[job]\n{job}\n{top}\n{rings}")
        return p

    return write


RING = '''
[[ring]]
group = "{group}"
nranks = {n}
protocol = "LL"
nccl_version = "2.18"
[[ring.mirror]]
rank = {rank}
direction = "egress"
source = "a.pcapng"
'''


def test_a_job_of_rings_reads_back(ring_file):
    p = ring_file(RING.format(group="pp0-tp0-sh0", n=2, rank=0) + RING.format(group="pp0-tp0-sh1", n=2, rank=1))
    job = load_job(p)
    assert job.kind == "sharded" and [rc.group for rc in job.rings] == ["pp0-tp0-sh0", "pp0-tp0-sh1"]
    assert job.rings[1].mirrors[0].rank == 1 and job.rings[1].mirrors[0].source == str(p.parent / "a.pcapng")
    assert job.initial == str(p.parent / "seed") and job.shards.scheme == "fsdp2"
    from mirrorckpt.config.jobfile import dump_job

    p.write_text(dump_job(job))
    again = load_job(p)
    assert [(rc.group, rc.ring, rc.mirrors) for rc in again.rings] == [(rc.group, rc.ring, rc.mirrors)
                                                                       for rc in job.rings]


@pytest.mark.parametrize("rings,job,top,words", [
    (RING.format(group="pp0-tp0-sh7", n=2, rank=0), None, "",
     "[[ring]] #1 group: 'pp0-tp0-sh7' is not a group of shards.json (groups: pp0-tp0-sh0, pp0-tp0-sh1)"),
    (RING.format(group="pp0-tp0-sh0", n=2, rank=0).replace('group = "pp0-tp0-sh0"\n', ""), None, "",
     "[[ring]] #1: missing key 'group'"),
    (RING.format(group="pp0-tp0-sh0", n=3, rank=0), None, "",
     "[[ring]] #1 nranks: 3, but the ring of pp0-tp0-sh0 in shards.json has 2 ranks"),
    (RING.format(group="pp0-tp0-sh0", n=2, rank=2), None, "",
     "[[ring]] #1 [[ring.mirror]] #1 rank: 2 is outside the ring (ranks 0..1)"),
    (RING.format(group="pp0-tp0-sh0", n=2, rank=0) * 2, None, "",
     "[[ring]] #2 group: 'pp0-tp0-sh0' is followed by [[ring]] #1 already"),
    (RING.format(group="pp0-tp0-sh0", n=2, rank=0), "", "", "[job] shards: missing"),
    (RING.format(group="pp0-tp0-sh0", n=2, rank=0), None, '[[mirror]]\nrank = 0\n',
     "[[mirror]]: a job of [[ring]] tables lists each ring's mirrors as its [[ring.mirror]] entries"),
    (RING.format(group="pp0-tp0-sh0", n=2, rank=0).replace("nranks = 2", "nranks = 2\nweights_only = true"),
     None, "", "[[ring]] #1 group: a weights_only ring keeps every parameter"),
    (RING.format(group="pp0-tp0-sh0", n=2, rank=0).replace("nranks", "ranks"), None, "",
     "[[ring]] #1: unknown key 'ranks'"),
    (RING.format(group="pp0-tp0-sh0", n=2, rank=0).replace("nranks", 'listen = "127.0.0.1:7071"\nnranks'), None, "",
     "[[ring]] #1 listen: a ring's control plane needs [control] (secret_file)"),
    (RING.format(group="pp0-tp0-sh0", n=2, rank=0), None, '[control]\nsecret_file = "s"\n',
     "[[ring]] #1: missing key 'listen' (with [control] each ring's group has its control plane"),
    (RING.format(group="pp0-tp0-sh0", n=2, rank=0), None, '[control]\nlisten = "127.0.0.1:7070"\n',
     "[control] listen: a sharded job's control planes listen one per ring ([[ring]] listen)"),
])
def test_a_malformed_ring_is_refused_in_words(ring_file, rings, job, top, words):
    args = (rings,) if job is None else (rings, job)
    with pytest.raises(ConfigError) as e:
        load_job(ring_file(*args, top=top))
    assert words in str(e.value)


def test_the_endpoint_serves_the_jobs_metrics_and_every_rings_under_a_ring_label():
    from mirrorckpt.tools.metrics import Metrics, with_rings
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    job, rings = Metrics(), {"pp0-tp0-sh0": Metrics(), "pp0-tp0-sh1": Metrics()}
    job.protection.labels("not protected").set(1)
    rings["pp0-tp0-sh0"].replica_step.set(7)
    rings["pp0-tp0-sh1"].replica_step.set(5)
    text = generate_latest(with_rings(job, rings)).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    steps = {s.labels.get("ring"): s.value for s in fams["mirrorckpt_replica_step"].samples}
    assert steps == {None: 0.0, "pp0-tp0-sh0": 7.0, "pp0-tp0-sh1": 5.0}  # the job's own first, one family
    first = next(s for s in fams["mirrorckpt_protection"].samples if s.labels.get("verdict") == "not protected")
    assert "ring" not in first.labels and first.value == 1.0
    assert text.count("# HELP mirrorckpt_replica_step ") == 1


def test_gen_sharded_refuses_what_it_does_not_generate(tmp_path):
    from click.testing import CliRunner
    from mirrorckpt.tools.cmd_gen import gen

    res = CliRunner().invoke(gen, ["--out", str(tmp_path / "g"), "--sharded", "zero", "--noise", "all"])
    assert res.exit_code == 2 and "--sharded does not generate --noise" in res.output
    res = CliRunner().invoke(gen, ["--out", str(tmp_path / "g"), "--sharded", "hsdp", "--protocol", "auto"])
    assert res.exit_code == 2 and "protocol 'auto': pin one of" in res.output
