"""Issue 13: NCCL as it runs by default. Generated jobs replayed with no configuration and no
stated NCCL release must recover every all-reduce exactly: a protocol chosen per collective
(NCCL's tuning model), Simple-only jobs, more than two ranks from two adjacent ranks' egress,
2.20+ wire forms. A stated release the wire contradicts is an error."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from mirrorckpt.parser.errors import VersionMismatch
from mirrorckpt.parser.roce import nccl_versions as nv
from mirrorckpt.tools import cmd_replay
from mirrorckpt.tools.cli import main
from mirrorckpt.tools.generator import tuning
from mirrorckpt.tools.generator.gen import GenConfig, generate
from mirrorckpt.tools.generator.wire import WireOptions

pytestmark = pytest.mark.offline  # capture files in one process: runs beside the unit tests

EGRESS = ["rank0_egress.pcapng", "rank1_egress.pcapng"]

# (id, ranks, channels, protocol, release, model, DDP bucket cap in MB, QPs per connection)
JOBS = [
    ("simple-r4-ch2-v229", 4, 2, "Simple", "2.29", "mlp:64,128,10", 0.01, 1),
    ("auto-r2-ch1-v218", 2, 1, "auto", "2.18", "mlp:512,1024,200", 0.5, 1),
    ("auto-r3-ch2-v223", 3, 2, "auto", "2.23", "mlp:600,64,8", 0.002, 1),
    ("ll128-r4-ch1-v226", 4, 1, "LL128", "2.26", "mlp:40,64,8", 0.004, 1),
    ("auto-r3-ch1-v230", 3, 1, "auto", "2.30", "mlp:600,64,8", 0.002, 1),
    # several QPs: whole messages round robin (2.20+), messages cut over the QPs (<= 2.19)
    ("auto-r3-ch2-qp2-v223", 3, 2, "auto", "2.23", "mlp:600,64,8", 0.002, 2),
    ("auto-r4-ch4-qp2-v218", 4, 4, "auto", "2.18", "mlp:512,1024,200", 0.5, 2),
    ("simple-r3-ch1-qp2-v229", 3, 1, "Simple", "2.29", "mlp:64,128,10", 0.01, 2),
    ("simple-r2-ch1-qp4-v218", 2, 1, "Simple", "2.18", "mlp:64,128,10", 0.01, 4),
    # issue 39: 2.31 and 2.32, every protocol, 2 QPs per connection
    ("ll-r2-ch2-v231", 2, 2, "LL", "2.31", "mlp:64,128,10", 0.01, 1),
    ("ll128-r3-ch1-qp2-v232", 3, 1, "LL128", "2.32", "mlp:40,64,8", 0.004, 2),
    ("simple-r3-ch2-qp2-v231", 3, 2, "Simple", "2.31", "mlp:64,128,10", 0.01, 2),
    ("auto-r3-ch2-qp2-v232", 3, 2, "auto", "2.32", "mlp:600,64,8", 0.002, 2),
]


@pytest.fixture(scope="module", params=JOBS, ids=[j[0] for j in JOBS])
def job(request, tmp_path_factory):
    name, R, nch, proto, v, model, cap, qps = request.param
    out = tmp_path_factory.mktemp(name)
    truth = generate(GenConfig(ranks=R, channels=nch, protocol=proto, nccl_version=v, model=model, steps=3,
                               seed=R + nch, bucket_cap_mb=cap, mirrors="0:egress,1:egress", send_truth=False,
                               wire=WireOptions(qps_per_connection=qps)), out)
    return request.param, out, truth


def test_replays_exactly_without_configuration(job):
    (name, R, nch, proto, v, _, _, qps), out, truth = job
    js, results, iterations, _ = cmd_replay.run([str(out / f) for f in EGRESS], nccl_version=None)
    ars = [r for r in results if r.spec.kind == "allreduce"]
    want = [c for c in truth["collectives"] if c["kind"] == "all_reduce"]
    assert len(ars) == len(want) and want
    assert [r.sha256() for r in ars] == [c["sha256"] for c in want]
    assert len(iterations) == 3 and all(it.complete for it in iterations)
    assert not js.report().mismatches
    # the release family and the protocols were read from the wire (inside the family, runs whose
    # plans differ only for a protocol the job does not use cannot be told apart, and need not be)
    lo, hi = nv.WireFamily(nv.cts_header(v), nv.imm_byte_order(v)).releases()
    assert lo <= nv.version(js.model.ring.nccl_version) <= hi
    used = {la["protocol"] for la in truth["wire"]["launches"]}
    for la in truth["wire"]["launches"]:
        spec = js.model[la["collective"]]
        assert js.model.protocol(spec) == la["protocol"], la["what"]
    if proto == "auto":
        assert len(used) > 1, "the job should mix protocols"
    # several QPs: one connection each (joined by their rkeys), the pieces of cut messages joined
    decs = js.streams.decoders
    assert {len(g.qps) for d in decs for g in d._qp_group.values()} == {qps}
    assert (sum(d.cut_pieces for d in decs) > 0) == (qps > 1 and nv.version(v) <= "2.19")


def test_stated_release_contradicting_the_wire_is_an_error(job):
    (name, *_rest), out, truth = job
    v = truth["wire"]["ring"]["nccl_version"]
    wrong = "2.18" if nv.version(v) >= "2.20" else "2.23"
    with pytest.raises(VersionMismatch, match="contradicts the stated NCCL"):
        cmd_replay.run([str(out / f) for f in EGRESS], nccl_version=wrong)
    r = CliRunner().invoke(main, ["replay", "--nccl-version", wrong] + [str(out / f) for f in EGRESS])
    assert r.exit_code == 1 and "contradicts the stated NCCL" in r.output


def test_wire_family_candidates():
    assert nv.WireFamily(nv.CTS32).candidates() == ["2.19", "2.12"]
    assert nv.WireFamily(nv.CTS64_V220).candidates() == ["2.21", "2.22", "2.23"]
    assert nv.WireFamily(nv.CTS64_V224, "big").candidates() == ["2.29"]
    assert nv.WireFamily(nv.CTS64_V224, "little").candidates() == ["2.25", "2.28"]
    assert nv.WireFamily(nv.CTS64_V230).candidates() == ["2.30", "2.32"]  # 2.31-2.32 keep 2.30's layout
    assert nv.WireFamily(nv.CTS32, "big").candidates() == []  # no release writes both
    assert nv.WireFamily(nv.CTS32).contradicts("2.23") and not nv.WireFamily(nv.CTS32).contradicts("2.15")
    assert nv.imm_order_of(nv.encode_imm(65536, "2.29"), 65536) == "big"
    assert nv.imm_order_of(nv.encode_imm(65536, "2.18"), 65536) == "little"
    assert nv.imm_order_of(0, 0) is None


def test_tuning_model_orders_protocols_by_size():
    """Small collectives LL, mid-sized LL128, large Simple; without LL128 the middle goes to one
    of the other two."""
    got = [tuning.choose(nv.ALLREDUCE, n, 2, 2) for n in (8, 64 << 10, 1 << 20, 32 << 20)]
    assert got == ["LL", "LL", "LL128", "Simple"]
    assert tuning.choose(nv.ALLREDUCE, 1 << 20, 2, 2, tuning.Fabric(ll128=False)) in ("LL", "Simple")


def _subset(src, dst, keep) -> None:
    """Write the frames of ``src`` whose UDP source port is in ``keep`` to pcap ``dst``."""
    from mirrorckpt.capture.pcapfile import open_capture
    from mirrorckpt.capture.writer import PcapWriter

    with open_capture(str(src)) as reader, PcapWriter(str(dst)) as w:
        for b in reader:
            for i in range(len(b)):
                f = bytes(b.data[int(b.offset[i]):int(b.offset[i]) + int(b.caplen[i])])
                l3 = 14 + (40 if f[12:14] == b"\x86\xdd" else (f[14] & 0x0F) * 4)
                if int.from_bytes(f[l3:l3 + 2], "big") in keep:
                    w.write(f, int(b.ts_ns[i]))


def test_doctor_names_point_to_point_only_traffic(tmp_path):
    from common import FLOWCHECK

    cap = FLOWCHECK / "allreduce+p2p.pcapng"
    r = CliRunner().invoke(main, ["doctor", str(cap)])
    assert r.exit_code == 0 and "algorithm: ring" in r.output and "point-to-point" in r.output
    assert r.output.startswith("verdict: followable\n")
    assert "QPs per connection: 1 ([[mirror]] workers > 1 keeps every message in one worker)" in r.output
    p2p = {int(line.split(":")[-1].split(":")[0]) for line in r.output.splitlines()
           if line.startswith("connection ") and "point-to-point" in line
           for line in [line.split(": point")[0]]}
    assert p2p
    _subset(cap, tmp_path / "p2p.pcap", p2p)
    r = CliRunner().invoke(main, ["doctor", str(tmp_path / "p2p.pcap")])
    assert r.exit_code == 1, r.output
    assert "only point-to-point sends" in r.output and "fix:" in r.output
    assert r.output.startswith("verdict: not followable\n")


def test_doctor_names_collective_traffic_to_several_peers(tmp_path):
    """A rank whose collective connections go to two peers, one way each, is not one ring: channels
    of different ring orders, or Tree (tests/e2e/test_doctor_algorithms.py has Tree's own shape);
    the cause, the job file's ring orders and NCCL_ALGO=Ring are named."""
    generate(GenConfig(ranks=3, channels=2, ring_orders=[[0, 1, 2], [0, 2, 1]], model="mlp:2000,64,8", steps=1,
                       mirrors="0:egress", send_truth=False), tmp_path)
    r = CliRunner().invoke(main, ["doctor", str(tmp_path / "rank0_egress.pcapng")])
    assert r.exit_code == 1 and "sends collective traffic to 2 peers" in r.output and "NCCL_ALGO=Ring" in r.output
    assert r.output.startswith("verdict: not followable\n") and "[ring] orders" in r.output


@pytest.mark.parametrize("release", ["2.18", "2.23"])
def test_doctor_counts_qps_per_connection(tmp_path, release):
    """Several QPs per connection (cut messages up to 2.19, whole ones round robin from 2.20) are
    joined by rkey and counted per connection."""
    generate(GenConfig(ranks=3, channels=2, model="mlp:600,64,8", steps=2, nccl_version=release,
                       mirrors="0:egress,1:egress", send_truth=False,
                       wire=WireOptions(qps_per_connection=2)), tmp_path)
    r = CliRunner().invoke(main, ["doctor", "--json"] + [str(tmp_path / f) for f in EGRESS])
    assert r.exit_code == 0, r.output
    import json

    rep = json.loads(r.output)
    ring = [c for c in rep["connections"] if c["kind"] == "collective"]
    assert len(ring) == 4 and all(c["qps"] == 2 for c in ring), rep["connections"]
    assert rep["qps_per_connection"] == [2]
    r1 = CliRunner().invoke(main, ["doctor"] + [str(tmp_path / f) for f in EGRESS])
    assert "QPs per connection: 2" in r1.output and "2 QP(s)" in r1.output
    assert "a live port's kernel split would part them" in r1.output  # [[mirror]] workers on a live port


def test_2_31_port_speed_updates_are_no_cts_posts(tmp_path):
    """2.31+ with NCCL_IB_EVENT_BASED_LB=1: a receiver WRITEs its port speeds (32 bytes, no immediate)
    to the sender on the CTS's QP. It is no CTS post (the 2.30 layout is 64 bytes, and read as a
    32-byte entry it is implausible), no send, and the job replays exactly with no configuration."""
    import json

    cfg = dict(ranks=3, channels=2, nccl_version="2.31", model="mlp:600,64,8", steps=2, seed=3,
               mirrors="0:egress,1:egress", send_truth=False)
    plain = generate(GenConfig(**cfg), tmp_path / "plain")
    truth = generate(GenConfig(**cfg, wire=WireOptions(speed_update=True)), tmp_path / "speed")
    js, results, iterations, _ = cmd_replay.run([str(tmp_path / "speed" / f) for f in EGRESS], nccl_version=None)
    assert [r.sha256() for r in results if r.spec.kind == "allreduce"] == \
        [c["sha256"] for c in truth["collectives"] if c["kind"] == "all_reduce"]
    assert all(it.complete for it in iterations) and not js.report().mismatches
    seen = [json.loads(CliRunner().invoke(main, ["inspect", "--json", str(cap)]).output)
            for cap in (tmp_path / "plain" / "rank0_egress.pcapng", tmp_path / "speed" / "rank0_egress.pcapng")]
    assert seen[0]["cts_posts"] == seen[1]["cts_posts"] and len(seen[0]["sends"]) == len(seen[1]["sends"])
    assert seen[0]["nccl"]["not_nccl_writes"] == 0 < seen[1]["nccl"]["not_nccl_writes"]
    assert plain["collectives"] == truth["collectives"]
    with pytest.raises(ValueError, match="no port speed updates"):
        generate(GenConfig(**dict(cfg, nccl_version="2.30"), wire=WireOptions(speed_update=True)), tmp_path / "old")
