"""Issue 13: the Simple thread count (maxThreads[RING][Simple], 512 by default, 256 on a
PCI-limited ring). ``[ring] nthreads`` applies to Simple collectives only; replay infers it from
the message sizes where the 256- and 512-thread plans differ."""

from __future__ import annotations

from mirrorckpt.config.ddp import ALLREDUCE, CollSpec
from mirrorckpt.config.layout import RingSpec
from mirrorckpt.parser.roce.collectives import NcclJobModel


def _model(nthreads, nchannels=1, version="2.18"):
    ring = RingSpec(nranks=2, nchannels=nchannels, protocol="auto", nccl_version=version, nthreads=nthreads)
    m = NcclJobModel.allreduces(ring, [9010, 100], "float32")
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


# --- inference from generated jobs (small DDP model: one 9010-float bucket) -------------------

import json  # noqa: E402

import pytest  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from mirrorckpt.parser.errors import InferenceError  # noqa: E402
from mirrorckpt.tools import cmd_replay  # noqa: E402
from mirrorckpt.tools.cli import main  # noqa: E402
from mirrorckpt.tools.generator.gen import GenConfig, generate  # noqa: E402

EGRESS = ["rank0_egress.pcapng", "rank1_egress.pcapng"]
MODEL = "mlp:64,120,10"  # 9010 parameters: 4505 (1 channel) or 2253 (2) elements per chunk


def _gen(tmp_path_factory, v, nch, nthreads):
    out = tmp_path_factory.mktemp(f"simple-v{v}-ch{nch}-nt{nthreads}")
    truth = generate(GenConfig(ranks=2, channels=nch, protocol="Simple", nccl_version=v, nthreads=nthreads,
                               model=MODEL, steps=3, seed=1, mirrors="0:egress,1:egress", send_truth=False), out)
    return out, truth


def _replay(out):
    return cmd_replay.run([str(out / f) for f in EGRESS], nccl_version=None)


# (release, channels, generated thread count, what inference must claim: 512/256, or None where
# the plans of everything the wire shows are equal under both)
CASES = [
    ("2.18", 1, 256, 256),  # Simple chunks rounded to 512 elements, not 1024
    ("2.18", 1, None, 512),
    ("2.18", 2, 256, 256),
    ("2.12", 2, None, 512),
    ("2.23", 2, 256, 256),  # 36040 bytes: two channels with 256 threads, one with 512
    ("2.29", 2, 256, 256),
    # 2.20+ on one channel: the thread count changes no Simple plan, nothing is claimed
    ("2.23", 1, 256, None),
    # a 512-thread 2.20+ job whose collectives all run on one channel shows one connection per
    # pair: the wire cannot show the second channel the 256-thread plan would use
    ("2.23", 2, None, None),
]


@pytest.mark.parametrize("v,nch,nthreads,claim", CASES, ids=[f"v{c[0]}-ch{c[1]}-nt{c[2]}" for c in CASES])
def test_replay_without_configuration_infers_the_simple_thread_count(tmp_path_factory, v, nch, nthreads, claim):
    out, truth = _gen(tmp_path_factory, v, nch, nthreads)
    launched = {la["nthreads"] for la in truth["wire"]["launches"] if la["count"] == 9010}
    assert launched == {(nthreads or 512) + 32}
    js, results, iterations, _ = _replay(out)
    ars = [r for r in results if r.spec.kind == "allreduce"]
    want = [c for c in truth["collectives"] if c["kind"] == "all_reduce"]
    assert want and [r.sha256() for r in ars] == [c["sha256"] for c in want]
    assert len(iterations) == 3 and all(it.complete for it in iterations)
    assert not js.report().mismatches
    # the model plans Simple collectives with what the wire proved (None: NCCL's default 512)
    assert (js.model.ring.nthreads or 512) == (claim or 512)
    notes = [n for n in js.report().notes if n.startswith("Simple threads:")]
    if claim:
        assert notes == [notes[0]] and notes[0].startswith(f"Simple threads: {claim} (with {768 - claim}:")
    else:
        assert notes == ["Simple threads: not determinable: plans equal (the Simple collectives seen plan alike "
                         "with 512 and 256 threads; NCCL's default 512 assumed)"]
    r = CliRunner().invoke(main, ["doctor", "--json"] + [str(out / f) for f in EGRESS])
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)["inferred"]["simple_threads"]
    assert got == claim if claim else got.startswith("not determinable: plans equal")


def test_stated_thread_count_is_the_only_one_tried(tmp_path_factory):
    """A job file's `[ring] nthreads` is an override: a wrong one is a mismatch, not re-inferred."""
    out, truth = _gen(tmp_path_factory, "2.18", 1, 256)
    from mirrorckpt.config.jobfile import load_job
    job = load_job(out / "job.toml")
    assert job.ring.nthreads == 256
    js, results, _, _ = cmd_replay.run([str(out / f) for f in EGRESS], job=job, nccl_version=None)
    assert [r.sha256() for r in results if r.spec.kind == "allreduce"] == \
        [c["sha256"] for c in truth["collectives"] if c["kind"] == "all_reduce"]


def test_a_thread_count_neither_plan_fits_is_named_not_guessed(tmp_path_factory):
    """NCCL_NTHREADS=128 on two channels: 2253-element chunks round to 2304, neither 2560 (256
    threads) nor 3072 (512): the error names the collective and both expectations."""
    out, _ = _gen(tmp_path_factory, "2.18", 2, 128)
    with pytest.raises(InferenceError) as e:
        _replay(out)
    msg = str(e.value)
    assert "fit neither Simple thread count" in msg
    assert "with 512 threads" in msg and "with 256 threads" in msg
    assert "(broadcast of 9010 x float32, Simple) expects" in msg
    assert "(allreduce of 9010 x float32, Simple) expects" in msg
    r = CliRunner().invoke(main, ["doctor"] + [str(out / f) for f in EGRESS])
    assert r.exit_code == 1 and "fit neither Simple thread count" in r.output


def test_protocol_mix_applies_the_inferred_count_to_simple_collectives_only(tmp_path_factory):
    """NCCL's tuning model picks LL, LL128 and Simple per bucket: only the Simple ones run 256
    (+32) threads; LL128 keeps its 640. Replayed with no configuration: exact, 256 inferred."""
    out = tmp_path_factory.mktemp("mix-v2.18-nt256")
    truth = generate(GenConfig(ranks=2, channels=1, protocol="auto", nccl_version="2.18", nthreads=256,
                               model="mlp:512,1024,200", steps=3, seed=1, bucket_cap_mb=0.5,
                               mirrors="0:egress,1:egress", send_truth=False), out)
    by_proto = {}
    for la in truth["wire"]["launches"]:
        if la["count"] > 1000:
            by_proto.setdefault(la["protocol"], set()).add(la["nthreads"])
    assert by_proto == {"LL128": {640}, "Simple": {288}}
    js, results, iterations, _ = _replay(out)
    ars = [r for r in results if r.spec.kind == "allreduce"]
    want = [c for c in truth["collectives"] if c["kind"] == "all_reduce"]
    assert want and [r.sha256() for r in ars] == [c["sha256"] for c in want]
    assert all(it.complete for it in iterations) and not js.report().mismatches
    assert js.model.ring.nthreads == 256 and js.model.ring.protocol == "auto"
    ll128 = [c for c in (js.model[i] for i in range(12)) if c is not None and js.model.protocol(c) == "LL128"]
    assert ll128 and js.model.plan(ll128[0]).nthreads == 640
