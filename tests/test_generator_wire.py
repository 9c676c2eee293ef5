"""The generator's wire side: frames, NCCL verbs behaviour, mirrors, noise, faults, and the round
trip through the project's own decoder (inspect) and pipeline (replay --config job.toml).

Independent checks: scapy (BTH.compute_icrc, RETH/ImmDt layers defined here) and tshark dissect
the frames; parser.ringreduce recomputes every message value; the real captures give the UDP port
rule and the link-local addresses.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from collections import Counter, defaultdict

import numpy as np
import pytest
from click.testing import CliRunner
from common import FLOWCHECK, PCAPS, REPO
from mirrorckpt.capture.pcapfile import open_capture
from mirrorckpt.config.jobfile import load_job
from mirrorckpt.config.layout import MirrorSpec, RingSpec
from mirrorckpt.config.training import TrainingSpec
from mirrorckpt.parser import headers as H
from mirrorckpt.parser import roce
from mirrorckpt.parser.roce import nccl_versions as nv
from mirrorckpt.parser.roce import opcodes as oc
from mirrorckpt.parser.roce import protocols, ringreduce, schedule
from mirrorckpt.tools.cli import main
from mirrorckpt.tools.generator import frames, messages, mirrors, packetize, topology
from mirrorckpt.tools.generator.faults import FaultOptions
from mirrorckpt.tools.generator.gen import GenConfig, generate
from mirrorckpt.tools.generator.noise import NoiseOptions
from mirrorckpt.tools.generator.wire import Wire, WireOptions, credit_code

MLP = "mlp:64,128,10"  # 39 KB of fp32 gradients: big enough for NCCL to use 2 channels


# -- helpers -----------------------------------------------------------------------------------------


def run(tmp_path_factory, name, **kw):
    out = tmp_path_factory.mktemp(name)
    truth = generate(GenConfig(**kw), out)
    return out, truth


def frames_of(path):
    """(bytes, caplen, wirelen, ts) of every frame, and the decoded RoCE packets with ``frame`` the
    index in the file and ``pay_off`` relative to the frame."""
    out, pk_all = [], []
    with open_capture(path) as r:
        for b in r:
            base = len(out)
            out += [(b.frame(i), int(b.caplen[i]), int(b.wirelen[i]), int(b.ts_ns[i])) for i in range(len(b))]
            pk, _ = roce.decode(b)
            pk.pay_off = pk.pay_off - b.offset[pk.frame]
            pk.frame = pk.frame + base
            pk_all.append(pk)
    return out, roce.RocePackets.concat(pk_all)


def inspect_json(path, version):
    res = CliRunner().invoke(main, ["inspect", "--json", "--nccl-version", version, str(path)],
                             catch_exceptions=False)
    return json.loads(res.stdout)


def replay_json(out, truth, *extra):
    caps = [str(out / c["file"]) for c in truth["wire"]["captures"]]
    res = CliRunner().invoke(main, ["replay", "--json", "--config", str(out / "job.toml"), *extra, *caps],
                             catch_exceptions=False)
    return json.loads(res.stdout)


def visible_sends(truth, cap):
    """The truth sends a capture file carries, per connection string as inspect prints it."""
    ip = {n["rank"]: n["ip"] for n in truth["wire"]["topology"]["nics"]}
    out = defaultdict(list)
    eg, ing = cap["direction"] in ("egress", "both"), cap["direction"] in ("ingress", "both")
    for s in truth["wire"]["sends"]:
        if (eg and s["sender"] == cap["rank"]) or (ing and s["receiver"] == cap["rank"]):
            out[f"{ip[s['sender']]}->{ip[s['receiver']]}:{s['sport']}"].append(s)
    return out


class NullSink:
    """Captures nothing: the wire only counts (values and results are still computed)."""

    def __init__(self, everything=False):
        self.everything = everything
        self.log = messages.MessageLog()

    def wants(self, src, dst):
        return self.everything

    def after_slot(self):
        if not self.everything:
            self.log.clear()


def ring_comm(R, nch, proto, version="2.18", orders=None, sink=None):
    ring = RingSpec(nranks=R, nchannels=nch, protocol=proto, nccl_version=version, ring_orders=orders)
    topo = topology.build(R, ring.orders(), 7, version)
    wire = Wire(version, WireOptions(), sink or NullSink(), 7)
    return packetize.NcclRing(ring, topo, wire), wire


# -- generated runs shared by the tests ---------------------------------------------------------------

VARIANTS = {
    # name: (generator config, marks)
    "ll_r3_2ch": dict(ranks=3, channels=2, protocol="LL", model=MLP, steps=3, seed=5, mirrors="0:egress,1:both"),
    "ll128_bf16": dict(ranks=2, protocol="LL128", model=MLP, steps=3, seed=6, mirrors="0:egress,1:egress",
                       training=TrainingSpec(grad_dtype="bfloat16")),
    "v212_split_train": dict(ranks=2, nccl_version="2.12", model="linear:5000", steps=3, seed=7,
                             mirrors="0:egress,1:egress", wire=WireOptions(write_only_train=True)),
    "v229_wrap_ipv4_pcap": dict(ranks=3, channels=2, nccl_version="2.29", model=MLP, steps=3, seed=8,
                                mirrors="0:egress,1:egress", fmt="pcap",
                                wire=WireOptions(ipv6=False, initial_psn="wrap", pmtu=512)),
    "orders_r4_fp16": dict(ranks=4, channels=2, ring_orders=[[0, 1, 2, 3], [0, 3, 2, 1]], model=MLP, steps=3,
                           seed=9, mirrors="0:both,1:both", training=TrainingSpec(grad_dtype="float16")),
    "simple_r4": dict(ranks=4, protocol="Simple", model=MLP, steps=3, seed=10, mirrors="0:both,1:both"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {name: run(tmp_path_factory, name, **kw) for name, kw in VARIANTS.items()}


# -- units ----------------------------------------------------------------------------------------------


def test_udp_source_port_rule_matches_the_real_capture():
    """Both directions of a QP pair are visible in iter_40000_p2p_iter10_2: the port is the Linux
    RDMA core's function of the two QP numbers."""
    _, pk = frames_of(FLOWCHECK / "iter_40000_p2p_iter10_2.pcapng")
    qps = defaultdict(set)
    for sport, dqp, op in zip(pk.sport.tolist(), pk.dqp.tolist(), pk.opcode.tolist()):
        if op != oc.UD_SEND_ONLY:
            qps[sport].add(dqp)
    assert len(qps) == 3
    for sport, pair in qps.items():
        a, b = sorted(pair)
        assert topology.udp_sport(a, b) == topology.udp_sport(b, a) == sport


def test_link_local_address_from_mac_like_the_real_capture():
    fr, _ = frames_of(FLOWCHECK / "iter_40000_p2p_iter10.pcapng")
    f = fr[0][0]
    eth, ip = H.ETH.unpack(f), H.IPV6.unpack(f, H.ETH.size)
    assert topology.link_local_ipv6(f[6:12]) == ip["src"]
    assert topology.link_local_ipv6(f[0:6]) == ip["dst"]
    assert eth["type"] == H.ETHERTYPE_IPV6


@pytest.mark.parametrize("hdr", [H.ETH, H.IPV4, H.IPV6, H.UDP, H.TCP, H.BTH, H.RETH, H.IMMDT, H.AETH, H.DETH,
                                 H.CTS32, H.CTS64_V220, H.CTS64_V224, H.CTS64_V230, H.LL_LINE])
def test_put_is_the_inverse_of_header_read(hdr):
    rng = np.random.default_rng(hdr.size)
    n = 50
    base = np.arange(n) * (hdr.size + 3) + 1
    buf = np.zeros(n * (hdr.size + 3) + 4, np.uint8)
    want = {}
    for name, f in hdr.fields.items():
        if f.size > 8:
            v = rng.integers(0, 256, (n, f.size), dtype=np.uint8)
        elif f.signed:
            v = rng.integers(-(1 << (8 * f.size - 1)), 1 << (8 * f.size - 1), n)
        else:
            v = rng.integers(0, 1 << min(63, 8 * f.size), n, dtype=np.uint64)
        frames.put(buf, base, hdr, name, v)
        want[name] = v
    for name, f in hdr.fields.items():
        got = hdr.read_bytes(buf, base, name) if f.size > 8 else hdr.read(buf, base, name)
        assert np.array_equal(got, want[name] if f.size > 8 else want[name].astype(got.dtype)), name
    ints = [name for name, f in hdr.fields.items() if f.size <= 8]
    for name, got in hdr.read_fields(buf, base, ints).items():  # gathered at once: the same values and types
        assert got.dtype == hdr.read(buf, base, name).dtype and np.array_equal(got, want[name].astype(got.dtype)), name
    one = hdr.pack(**{k: (v[0].tobytes() if hdr[k].size > 8 else int(v[0])) for k, v in want.items()})
    assert one == buf[base[0]:base[0] + hdr.size].tobytes()


def test_message_forms_expand_to_the_ibta_opcodes():
    log = messages.MessageLog()
    pm = 1024
    log.add(messages.NORMAL, 0, 1, 0xC001, 7, 100, 0, length=3 * pm + 100, pmtu=pm, va=0x1000, rkey=5, imm=9, dt=10)
    log.add(messages.NORMAL, 0, 1, 0xC001, 7, 104, 50, length=0, pmtu=pm, va=0x2000, rkey=5, imm=0)
    log.add(messages.SPLIT, 0, 1, 0xC001, 7, 105, 60, length=2 * pm, pmtu=pm, va=0x3000, rkey=5, imm=2 * pm)
    log.add(messages.TRAIN, 0, 1, 0xC001, 7, (1 << 24) - 2, 70, length=2 * pm + 4, pmtu=pm, va=0x4000, rkey=5,
            imm=77)
    log.add(messages.PLAIN, 1, 0, 0xC001, 8, 3, 80, length=32, pmtu=pm, va=0x5000, rkey=6)
    log.add(messages.ACK, 1, 0, 0xC001, 8, 99, 90, syndrome=credit_code(3), msn=4)
    pk, ts = log.packets()
    W = oc
    assert pk.opcode.tolist() == [
        W.RC_RDMA_WRITE_FIRST, W.RC_RDMA_WRITE_MIDDLE, W.RC_RDMA_WRITE_MIDDLE, W.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE,
        W.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE,
        W.RC_RDMA_WRITE_FIRST, W.RC_RDMA_WRITE_LAST, W.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE,
        W.RC_RDMA_WRITE_ONLY, W.RC_RDMA_WRITE_ONLY, W.RC_RDMA_WRITE_ONLY, W.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE,
        W.RC_RDMA_WRITE_ONLY, W.RC_ACKNOWLEDGE]
    assert pk.psn.tolist() == [100, 101, 102, 103, 104, 105, 106, 107, (1 << 24) - 2, (1 << 24) - 1, 0, 1, 3, 99]
    assert pk.pay_len.tolist() == [pm, pm, pm, 100, 0, pm, pm, 0, pm, pm, 4, 0, 32, 0]
    assert ts[:4].tolist() == [0, 10, 20, 30]
    # the train: one RETH per packet; both split forms close with a 0-byte WRITE WITH IMM at VA 0, rkey 0
    assert pk.va[8:11].tolist() == [0x4000, 0x4000 + pm, 0x4000 + 2 * pm] and pk.dlen[8:11].tolist() == [pm, pm, 4]
    for i in (7, 11):
        assert (int(pk.va[i]), int(pk.rkey[i]), int(pk.dlen[i])) == (0, 0, 0)
    assert pk.ackreq.tolist() == [0, 0, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 0]
    assert [credit_code(c) for c in (0, 1, 4, 5, 6, 7, 8, 100, 10**6)] == [0, 1, 4, 4, 5, 5, 6, 13, 30]


@pytest.mark.parametrize("proto", ["LL", "LL128", "Simple"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_allreduce_result_is_nccls_per_channel_ring_order(proto, dtype):
    """NcclRing returns NCCL's result: per channel its own ring order's reduction order."""
    R, nch = 5, 2
    orders = [[0, 1, 2, 3, 4], [0, 3, 1, 4, 2]]
    comm, _ = ring_comm(R, nch, proto, orders=orders)
    rng = np.random.default_rng(3)
    count = 70001
    store = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
    xs = []
    for _ in range(R):
        v = rng.standard_normal(count).astype(np.float32) * 100
        xs.append(ringreduce.f32_to_bf16(v) if dtype == "bfloat16" else v.astype(store))
    got = comm.all_reduce(xs, "grad:iter=0:bucket=0")
    plan = schedule.allreduce_plan(count, xs[0].itemsize, R, nch, proto, "2.18")
    want = np.empty_like(xs[0])
    for ch in plan.channels:
        perm = [xs[r] for r in orders[ch]]
        full = ringreduce.allreduce_result(perm, plan, dtype)
        for _, off, n in plan.chunk_ranges(ch):
            want[off:off + n] = full[off:off + n]
    assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))
    # the check tells summation orders apart: rank order 0, 1, 2, ... gives other bits
    naive = xs[0]
    for x in xs[1:]:
        naive = ringreduce.add(naive, x, dtype)
    assert not np.array_equal(got.view(np.uint8), naive.view(np.uint8))


def test_every_message_value_is_the_ring_partial_sum(tmp_path):
    """Each send's bytes (truth digest) equal parser.ringreduce.step_values of its plan message."""
    R = 4
    comm, wire = ring_comm(R, 2, "LL", sink=NullSink(everything=True))
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal(30000).astype(np.float32) for _ in range(R)]
    comm.all_reduce(xs, "grad:iter=0:bucket=0")
    plan = schedule.allreduce_plan(30000, 4, R, 2, "LL", "2.18")
    assert len(wire.sends) == sum(len(plan.messages(p, ch)) for ch in plan.channels for p in range(R))
    phases = Counter()
    for s in wire.sends:
        msgs = plan.messages(s["sender"], s["channel"])  # identity ring order: rank = position
        (msg,) = [m for m in msgs if (m.loop, m.step, m.slice) == (s["loop"], s["ring_step"], s["slice"])]
        vals = ringreduce.step_values(xs, plan, msg, "float32").view(np.uint8)
        padded = np.zeros(protocols.data_bytes("LL", protocols.wire_bytes("LL", vals.size)), np.uint8)
        padded[:vals.size] = vals
        assert hashlib.sha256(padded.tobytes()).hexdigest() == s["sha256"]
        phases[msg.phase] += 1
    assert set(phases) == {"own", "partial", "reduced"}


def test_broadcast_and_allgather_return_copies():
    comm, wire = ring_comm(3, 2, "LL", sink=NullSink(everything=True))
    data = np.arange(1000, dtype=np.int64)
    out = comm.broadcast(data, 0, "shapes")
    assert np.array_equal(out, data) and out is not data
    parts = [np.array([r + 10], np.int64) for r in range(3)]
    got = comm.all_gather(parts, "param_count")
    assert [int(g[0]) for g in got] == [10, 11, 12]
    # broadcast: the position before the root sends nothing; all-gather: every position R-1 sends
    kinds = Counter((s["kind"], s["sender"]) for s in wire.sends)
    assert kinds[("broadcast", 2)] == 0 and kinds[("broadcast", 0)] > 0
    plan = schedule.allgather_plan(1, 8, 3, 2, "LL", "2.18")
    assert plan.nchannels == 1  # NCCL runs an 8-byte all-gather on one channel
    assert all(kinds[("allgather", r)] == len(plan.messages(r, 0)) == 2 for r in range(3))  # R-1 steps


def test_mirror_specs():
    assert mirrors.parse_mirrors("0:egress, 1:both", 3) == [MirrorSpec(0, "egress"), MirrorSpec(1, "both")]
    for bad in ("0:up", "3:egress", "0:egress,0:both", "", "x"):
        with pytest.raises(ValueError):
            mirrors.parse_mirrors(bad, 3)
    assert mirrors.file_name(MirrorSpec(2, "ingress"), "pcap") == "rank2_ingress.pcap"


# -- the NCCL verbs layer on a generated run ----------------------------------------------------------


def test_cts_posts_announce_each_send_slot(runs):
    """On rank 1's port (both directions) every send 1 -> 2 has its CTS: idx = the send's number,
    addr = the receiver's allocation + slot (t mod 8) x 64 KiB, the LL buffer's rkey, size 65536,
    nreqs 1, tag = the sender; FIFO entries 256 B apart; the data WRITE lands at that address."""
    out, truth = runs["ll_r3_2ch"]
    pairs = {p["sport"]: p for p in truth["wire"]["topology"]["ring"]}
    fr, pk = frames_of(out / "rank1_both.pcapng")
    sends = [s for s in truth["wire"]["sends"] if s["sender"] == 1]
    assert {s["channel"] for s in sends} == {0, 1}
    for sport in {s["sport"] for s in sends}:
        p = pairs[sport]
        cts = np.flatnonzero((pk.dqp == p["send_qpn"]) & (pk.opcode == oc.RC_RDMA_WRITE_ONLY))
        data = np.flatnonzero((pk.dqp == p["recv_qpn"]) & np.isin(pk.opcode, [
            oc.RC_RDMA_WRITE_FIRST, oc.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE]))
        entries = [H.CTS32.unpack(fr[int(pk.frame[i])][0], int(pk.pay_off[i])) for i in cts.tolist()]
        mine = [s for s in sends if s["sport"] == sport]
        assert [e["idx"] for e in entries] == [s["seq"] for s in mine] == list(range(1, len(mine) + 1))
        for s, e, i in zip(mine, entries, cts.tolist()):
            slot = schedule.recv_slot(s["step"], "LL", "allreduce", "2.18")
            assert e == dict(addr=p["recv_base"] + slot.alloc_offset, size=65536, rkey=p["rkeys"]["LL"], nreqs=1,
                             tag=1, idx=s["seq"])
            assert (int(pk.va[i]), int(pk.rkey[i])) == (p["fifo_va"] + (s["seq"] - 1) * 256, p["fifo_rkey"])
        # each WRITE goes where its CTS said, with that buffer's rkey
        assert pk.va[data].tolist() == [e["addr"] for e in entries]
        assert set(pk.rkey[data].tolist()) == {p["rkeys"]["LL"]}
    # flags continue across collectives: one step per LL send on every connection
    by_conn = defaultdict(list)
    for s in truth["wire"]["sends"]:
        by_conn[s["sport"]].append(s)
    for ss in by_conn.values():
        assert [s["step"] for s in ss] == list(range(len(ss)))
        assert [s["flag"] for s in ss] == [s["step"] + 1 for s in ss]
        assert [s["seq"] for s in ss] == list(range(1, len(ss) + 1))
    # receive buffers of a rank: channel 0's below channel 1's
    base = defaultdict(dict)
    for p in truth["wire"]["topology"]["ring"]:
        base[p["receiver"]][p["channel"]] = p["recv_base"]
    assert all(b[0] < b[1] for b in base.values())


def test_psns_count_packets_per_qp_direction_across_the_wrap(runs):
    out, truth = runs["v229_wrap_ipv4_pcap"]
    _, pk = frames_of(out / "rank0_egress.pcap")
    writes = np.isin(pk.opcode, list(oc.TABLE)) & oc.IS_WRITE[pk.opcode]
    wrapped = 0
    for qp in np.unique(pk.dqp[writes]).tolist():
        psn = pk.psn[writes & (pk.dqp == qp)]
        assert np.all((np.diff(psn) % (1 << 24)) == 1)  # consecutive, modulo 2^24
        wrapped += int(np.any(np.diff(psn) < 0))
        assert psn[0] > (1 << 24) - 64  # started just below the wrap
    assert wrapped >= 2


def test_versions_change_the_wire_as_nccl_does(runs):
    # 2.12-2.15: sends above 8192 B use the split form; here as per-packet WRITE ONLY trains
    out, truth = runs["v212_split_train"]
    _, pk = frames_of(out / "rank0_egress.pcapng")
    close = (pk.opcode == oc.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE) & (pk.va == 0)
    assert close.sum() > 0 and np.all(pk.rkey[close] == 0) and np.all(pk.dlen[close] == 0)
    sizes = nv.decode_imm(pk.imm_raw[close].astype(np.uint32), "2.12")
    assert np.all(sizes > nv.AR_THRESHOLD_DEFAULT)
    train = (pk.opcode == oc.RC_RDMA_WRITE_ONLY) & (pk.dlen == 1024)
    assert train.sum() > 10
    forms = {s["form"] for s in truth["wire"]["sends"] if s["wire_bytes"] > 8192}
    assert forms == {"split"}
    r = inspect_json(out / "rank0_egress.pcapng", "2.12")
    assert {s["form"] for s in r["sends"] if s["size"] and s["size"] > 8192} == {"split"}
    # 2.29: immediate big-endian, 64-byte CTS entries 512 B apart
    out, truth = runs["v229_wrap_ipv4_pcap"]
    fr, pk = frames_of(out / "rank1_egress.pcap")
    imm = pk.has_imm.astype(bool) & (pk.dlen > 0)
    assert np.array_equal(pk.imm_raw[imm], pk.dlen[imm])  # read big-endian = the size
    cts = (pk.opcode == oc.RC_RDMA_WRITE_ONLY) & (pk.dlen == 64)
    assert cts.sum() > 2
    for sport in np.unique(pk.sport[cts]).tolist():
        assert set(np.diff(pk.va[cts & (pk.sport == sport)].astype(np.int64)).tolist()) == {512}
        e = H.CTS64_V224.unpack(fr[int(pk.frame[np.flatnonzero(cts & (pk.sport == sport))[0]])][0],
                                int(pk.pay_off[np.flatnonzero(cts & (pk.sport == sport))[0]]))
        assert e["nreqs"] == 1 and e["size"] == 65536 and e["idx"] == 1


def test_cts_fifo_wraps_after_64_posts_up_to_2_18(tmp_path):
    out = tmp_path / "w"
    generate(GenConfig(ranks=2, model="linear:64", steps=34, seed=1, mirrors="0:egress"), out)
    _, pk = frames_of(out / "rank0_egress.pcapng")
    cts = (pk.opcode == oc.RC_RDMA_WRITE_ONLY) & (pk.dlen == 32)
    va = pk.va[cts].astype(np.int64)
    assert va.size == 1 + 2 * 34 > 64
    assert np.array_equal(va[64:], va[:va.size - 64]) and len(set(va[:64].tolist())) == 64


# -- mirrors, noise, faults ------------------------------------------------------------------------------


def test_both_is_egress_plus_ingress_and_time_ordered(tmp_path):
    kw = dict(ranks=3, model=MLP, steps=2, seed=3)
    a = generate(GenConfig(mirrors="1:both,0:egress", **kw), tmp_path / "a")
    generate(GenConfig(mirrors="1:egress,1:ingress,0:egress", **kw), tmp_path / "b")
    both, _ = frames_of(tmp_path / "a" / "rank1_both.pcapng")
    eg, _ = frames_of(tmp_path / "b" / "rank1_egress.pcapng")
    ing, _ = frames_of(tmp_path / "b" / "rank1_ingress.pcapng")
    assert Counter(f for f, *_ in both) == Counter(f for f, *_ in eg + ing)
    assert sorted(t for *_, t in both) == sorted(t for *_, t in eg + ing)
    for fr in (both, eg, ing):
        ts = [t for *_, t in fr]
        assert ts == sorted(ts)
    # a frame rank 0 sends to rank 1 appears on rank 1's ingress one switch latency later
    e0 = {f: t for f, *_, t in frames_of(tmp_path / "b" / "rank0_egress.pcapng")[0]}
    lat = WireOptions().switch_ns
    common = [(e0[f], t) for f, *_, t in ing if f in e0]
    assert common and all(t - t0 == lat for t0, t in common)
    assert a["wire"]["captures"][0]["frames"] == len(both)


def test_noise_is_built_and_classified(tmp_path):
    truth = generate(GenConfig(ranks=2, model=MLP, steps=3, seed=2, mirrors="0:egress,1:both",
                               noise=NoiseOptions(frozenset({"arp", "ptp", "tcp", "probes", "vendor"}), 5000, 2)),
                     tmp_path)
    counts = {c["file"]: c["noise"] for c in truth["wire"]["captures"]}
    assert all(n > 0 for n in counts["rank1_both.pcapng"].values())
    r = inspect_json(tmp_path / "rank1_both.pcapng", "2.18")
    other, ro = r["other"], r["roce"]
    assert other["arp"] and other["tcp"] and other["udp_ptp_event"] and other["udp_ptp_general"]
    assert ro["by_opcode"]["UD_SEND_ONLY"] and ro["icrc"]["0xAA:BAD"] == ro["icrc_failed"] > 0
    assert all(s["complete"] for s in r["sends"])
    rep = replay_json(tmp_path, truth)
    want = [c["sha256"] for c in truth["collectives"] if c["kind"] == "all_reduce"]
    assert [a["sha256"] for a in rep["allreduces"]] == want


def _identity(f):
    """(dqp, psn, opcode) of a RoCE frame's BTH (IPv6)."""
    b = H.BTH.unpack(f, H.ETH.size + H.IPV6.size + H.UDP.size)
    return b["dqp"], b["psn"], b["opcode"]


def test_faults_land_where_truth_says(tmp_path):
    kw = dict(ranks=2, model=MLP, steps=4, seed=4, mirrors="0:egress")
    generate(GenConfig(**kw), tmp_path / "clean")
    rates = FaultOptions(loss=0.02, duplicate=0.02, reorder=0.02, corrupt=0.02, truncate=0.02, seed=11)
    truth = generate(GenConfig(faults=rates, **kw), tmp_path / "bad")
    clean, _ = frames_of(tmp_path / "clean" / "rank0_egress.pcapng")
    bad, pk = frames_of(tmp_path / "bad" / "rank0_egress.pcapng")
    recs = truth["wire"]["faults"]
    assert {r["kind"] for r in recs} == {"loss", "duplicate", "reorder", "corrupt", "truncate"}
    # the clean stream with the recorded faults applied is the faulty stream
    by_id = {(r["qp"], r["psn"], _op(r)): r for r in recs}
    expect = []
    ids = [_identity(f) for f, *_ in clean]
    i = 0
    while i < len(ids):
        r = by_id.get(ids[i])
        kind = r["kind"] if r else None
        if kind == "loss":
            i += 1
            continue
        if kind == "reorder":
            expect += [ids[i + 1], ids[i]]
            i += 2
            continue
        expect += [ids[i]] * (2 if kind == "duplicate" else 1)
        i += 1
    need = H.ETH.size + H.IPV6.size + H.UDP.size + H.BTH.size
    got = [_identity(f) if cap >= need else None for f, cap, wire, _ in bad]
    assert len(got) == len(expect)
    assert all(g is None or g == e for g, e in zip(got, expect))
    icrc_ok = dict(zip(pk.frame.tolist(), pk.icrc_ok.tolist()))
    for r in recs:
        if r["kind"] == "loss" and r["frame"] == len(bad):
            continue  # the file's last frame was lost
        f, cap, wire, ts = bad[r["frame"]]
        assert r["kind"] == "loss" or ts == r["ts_ns"]
        if r["kind"] == "truncate":
            assert cap == r["caplen"] < wire
        elif r["kind"] == "corrupt":
            assert _identity(f) == (r["qp"], r["psn"], _op(r)) and icrc_ok[r["frame"]] is False
            orig = next(c for c, *_ in clean if _identity(c) == _identity(f))
            assert sum(x != y for x, y in zip(f, orig)) == 1 and f[r["byte"]] != orig[r["byte"]]
        elif r["kind"] == "duplicate":
            assert bad[r["frame"] + 1][0] == f
        elif r["kind"] == "reorder":
            assert _identity(f)[1] == r["psn"] and _identity(bad[r["frame"] - 1][0])[1] == r["swapped_with_psn"]
        elif r["kind"] == "loss":
            assert _identity(f) != (r["qp"], r["psn"], _op(r))
    rep = inspect_json(tmp_path / "bad" / "rank0_egress.pcapng", "2.18")
    n = Counter(r["kind"] for r in recs)
    assert rep["truncated_frames"] == n["truncate"] and rep["roce"]["icrc_failed"] == n["corrupt"]


def _op(rec):
    return next(code for code, o in oc.TABLE.items() if o.name == rec["opcode"])


# -- tshark and scapy ------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("tshark") is None, reason="tshark not installed (make system-deps)")
@pytest.mark.parametrize("name", list(VARIANTS))
def test_tshark_dissects_every_frame_as_rroce(runs, name):
    out, truth = runs[name]
    for cap in truth["wire"]["captures"]:
        path = out / cap["file"]
        proto = subprocess.run(["tshark", "-r", str(path), "-T", "fields", "-e", "frame.protocols", "-e",
                                "infiniband.bth.opcode", "-e", "udp.dstport"], capture_output=True, text=True,
                               check=True).stdout.splitlines()
        assert len(proto) == cap["frames"]
        assert all(line.split("\t")[0].split(":")[:5] in (["eth", "ethertype", "ipv6", "udp", "infiniband"],
                                                          ["eth", "ethertype", "ip", "udp", "infiniband"])
                   for line in proto)
        _, pk = frames_of(path)
        assert [int(line.split("\t")[1]) for line in proto] == pk.opcode.tolist()
        expert = subprocess.run(["tshark", "-r", str(path), "-q", "-z", "expert"], capture_output=True, text=True,
                                check=True).stdout
        assert "Malformed" not in expert and "Warns" not in expert
        errors = [ln for ln in expert.splitlines() if ln.strip() and ln.strip()[0].isdigit()]
        if truth["wire"]["options"]["ipv6"]:
            # RoCEv2 NICs send no UDP checksum, as in the real captures; IPv6 calls that illegal
            assert all(ln.split()[1:] == ["Checksum", "UDP", "Illegal", "checksum", "value", "(0)"] for ln in errors)
        else:
            assert errors == []


def test_icrc_verifies_with_the_parser_and_with_scapy(runs):
    scapy_all = pytest.importorskip("scapy.all")
    roce_mod = pytest.importorskip("scapy.contrib.roce")
    from scapy.fields import IntField, XIntField, XLongField
    from scapy.packet import Packet

    class RETH(Packet):
        fields_desc = [XLongField("va", 0), XIntField("rkey", 0), IntField("dlen", 0)]

    class ImmDt(Packet):
        fields_desc = [XIntField("imm", 0)]

    checked = Counter()
    for name in ("ll_r3_2ch", "v229_wrap_ipv4_pcap", "v212_split_train"):
        out, truth = runs[name]
        for cap in truth["wire"]["captures"]:
            fr, pk = frames_of(out / cap["file"])
            assert pk.icrc_ok.all() and len(pk) == len(fr)
            idx = np.random.default_rng(0).choice(len(fr), size=min(60, len(fr)), replace=False)
            for i in idx.tolist():
                raw = fr[i][0]
                p = scapy_all.Ether(raw)
                bth = p[roce_mod.BTH]
                assert bth.compute_icrc(None) == raw[-4:]
                assert (bth.opcode, bth.dqpn, bth.psn, bth.ackreq, bth.pkey, bth.migreq) == (
                    int(pk.opcode[i]), int(pk.dqp[i]), int(pk.psn[i]), int(pk.ackreq[i]), 0xFFFF, 1)
                rest = bytes(bth.payload)
                if oc.HAS_RETH[bth.opcode]:
                    reth = RETH(rest[:16])
                    assert (reth.va, reth.rkey, reth.dlen) == (int(pk.va[i]), int(pk.rkey[i]), int(pk.dlen[i]))
                    rest = rest[16:]
                if oc.HAS_IMMDT[bth.opcode]:
                    assert ImmDt(rest[:4]).imm == int(pk.imm_raw[i])
                checked[bth.opcode] += 1
    assert {oc.RC_RDMA_WRITE_FIRST, oc.RC_RDMA_WRITE_MIDDLE, oc.RC_RDMA_WRITE_ONLY, oc.RC_ACKNOWLEDGE} <= set(checked)


# -- decoder round trip ------------------------------------------------------------------------------------


def assert_inspect_matches_truth(out, truth):
    version = truth["wire"]["ring"]["nccl_version"]
    for cap in truth["wire"]["captures"]:
        r = inspect_json(out / cap["file"], version)
        got = defaultdict(list)
        for s in r["sends"]:
            got[s["connection"]].append(s)
        want = visible_sends(truth, cap)
        assert sorted(got) == sorted(want)
        for conn, ss in want.items():
            assert all(s["complete"] for s in got[conn])
            assert [s["sha256"] for s in got[conn]] == [s["sha256"] for s in ss], conn
            assert [s["size"] for s in got[conn]] == [s["wire_bytes"] for s in ss]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_inspect_decodes_every_send_to_its_truth_digest(runs, name):
    assert_inspect_matches_truth(*runs[name])


def test_ll_sends_of_zero_gradient_rows_are_not_taken_for_ll128(tmp_path):
    """Token-embedding rows of tokens not in the batch have zero gradients: in some LL sends every 8th line's
    high data word is 0, so LL128's flag word reads (t+1) << 32 on every line. (The parser took them for
    LL128 until it tried LL first.)"""
    truth = generate(GenConfig(ranks=2, model="gpt:layers=1,d=32,heads=2,vocab=64,ctx=8", steps=3, seed=0,
                               bucket_cap_mb=0.01, mirrors="0:egress,1:egress"), tmp_path)
    assert {s["protocol"] for s in truth["wire"]["sends"]} == {"LL"}
    assert_inspect_matches_truth(tmp_path, truth)
    r = replay_json(tmp_path, truth)
    assert [a["sha256"] for a in r["allreduces"]] == [c["sha256"] for c in truth["collectives"]
                                                      if c["kind"] == "all_reduce"]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_replay_with_job_toml_is_bit_exact(runs, name):
    out, truth = runs[name]
    job = load_job(out / "job.toml")
    assert job.ring.nranks == truth["wire"]["ring"]["nranks"]
    # sources are the capture files next to job.toml
    assert [(m.rank, m.direction, m.source) for m in job.mirrors] == [
        (c["rank"], c["direction"], str((out / c["file"]).resolve())) for c in truth["wire"]["captures"]]
    r = replay_json(out, truth)
    want = [c["sha256"] for c in truth["collectives"] if c["kind"] == "all_reduce"]
    assert r["placement"].get("mismatch", 0) == 0
    assert [a["sha256"] for a in r["allreduces"]] == want
    assert all(it["complete"] for it in r["iterations"]) and len(r["iterations"]) == len(truth["iterations"])


def test_gen_cli_writes_captures_truth_and_job(tmp_path):
    res = CliRunner().invoke(main, [
        "gen", "--out", str(tmp_path), "--ranks", "3", "--model", MLP, "--steps", "2", "--optimizer", "adam",
        "--lr", "0.01", "--mirror", "0:egress,2:ingress", "--format", "pcap", "--ipv4", "--noise", "probes,ptp",
        "--loss", "0.01", "--mtu", "512", "--bucket-cap-mb", "0.001"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    truth = json.loads((tmp_path / "truth.json").read_text())
    assert [c["file"] for c in truth["wire"]["captures"]] == ["rank0_egress.pcap", "rank2_ingress.pcap"]
    assert truth["config"]["training"]["optimizer"]["name"] == "adam"
    assert len(truth["layout"]["buckets"]) > 1  # the small cap splits the model into buckets
    job = load_job(tmp_path / "job.toml")
    assert job.ring.addresses[2] == truth["wire"]["topology"]["nics"][2]["ip"] == "10.88.0.12"
    assert job.layout.to_dict() == truth["layout"]
    assert (tmp_path / "initial_params.bin").stat().st_size > 0
    bad = CliRunner().invoke(main, ["gen", "--out", str(tmp_path / "x"), "--mirror", "5:egress"])
    assert bad.exit_code == 2 and "rank 5" in bad.stderr


# -- the bundled capture sets (tests/pcaps, made by make.sh) ------------------------------------------------

BUNDLED = ["demo", "ll_r2_noise_faults", "simple_r3_both", "ll128_bf16_v229", "split_v212_ipv4_wrap"]


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_sets_replay_to_their_truth(name):
    out = PCAPS / name
    truth = json.loads((out / "truth.json").read_text())
    r = replay_json(out, truth)
    want = [c["sha256"] for c in truth["collectives"] if c["kind"] == "all_reduce"]
    got = r["allreduces"]
    assert len(got) == len(want) and not any(a["conflicts"] for a in got)
    if truth["wire"]["faults"]:  # damaged captures: what is complete is exact, the rest has holes
        assert all(a["sha256"] == w for a, w in zip(got, want) if a["complete"])
        assert any(a["holes"] for a in got if not a["complete"])
    else:
        assert [a["sha256"] for a in got] == want


def _same_but_arithmetic(mine, bundled, where: str = "") -> None:
    """truth.json's values, the same but for what the training's float arithmetic gives: digests
    of values (gradients, parameters, optimizer state) and losses to 1e-4."""
    if isinstance(mine, dict):
        assert sorted(mine) == sorted(bundled), where
        for k in mine:
            _same_but_arithmetic(mine[k], bundled[k], f"{where}.{k}")
    elif isinstance(mine, list):
        assert len(mine) == len(bundled), where
        for i, (x, y) in enumerate(zip(mine, bundled)):
            _same_but_arithmetic(x, y, f"{where}[{i}]")
    elif isinstance(mine, str) and len(mine) == 64 and all(c in "0123456789abcdef" for c in mine):
        assert isinstance(bundled, str) and len(bundled) == 64, where
    elif isinstance(mine, float):
        assert bundled == pytest.approx(mine, rel=1e-4), where
    else:
        assert mine == bundled, where


def _frames_same_but_payload(mine, bundled) -> None:
    """Two captures with the same frames, timestamps, lengths and headers; only RoCEv2 payloads
    (and so their ICRC) may differ, where the parser (roce.decode) finds them in ``bundled``."""
    a, b = list(open_capture(mine)), list(open_capture(bundled))
    for c in ("caplen", "wirelen", "ts_ns", "iface"):
        assert np.array_equal(np.concatenate([getattr(x, c) for x in a]), np.concatenate([getattr(x, c) for x in b])), c
    differ = 0
    for x, y in zip(a, b):  # the same batches: the same frame counts
        pk, _ = roce.decode(y, icrc=False)
        payload = dict(zip(pk.frame.tolist(), (pk.pay_off - y.offset[pk.frame]).tolist()))
        for i, (ox, oy, n) in enumerate(zip(x.offset.tolist(), y.offset.tolist(), y.caplen.tolist())):
            fx, fy = x.data[ox:ox + n], y.data[oy:oy + n]
            if not np.array_equal(fx, fy):
                at = payload.get(i)
                assert at is not None and np.array_equal(fx[:at], fy[:at]), \
                    f"frame {i} differs outside a RoCEv2 payload"
                differ += 1
    assert differ, "the truth's values differ, so some payload must"


def test_bundled_sets_are_what_make_sh_makes(tmp_path):
    """Byte for byte where this machine's float arithmetic is the one the sets were made with.
    The gradients come from torch's CPU kernels, which differ between CPUs (AVX-512 or not: the
    bundled sets, made on an AMD EPYC, are not bit-identical on an Intel Xeon): there everything
    but the values is still the same (frames, headers, lengths, times, layout, the truth's keys)."""
    sets = ["ll_r2_noise_faults"]  # the set whose noise and faults draw the most random numbers
    bin_ = shutil.which("mirrorckpt", path=str(REPO / ".venv" / "bin")) or shutil.which("mirrorckpt")
    subprocess.run([str(PCAPS / "make.sh"), bin_, str(tmp_path), *sets], check=True, capture_output=True)
    for s in sets:
        mine = sorted(p.name for p in (tmp_path / s).iterdir())
        assert mine == sorted(p.name for p in (PCAPS / s).iterdir())
        truth = json.loads((tmp_path / s / "truth.json").read_text())
        bundled = json.loads((PCAPS / s / "truth.json").read_text())
        if truth == bundled:
            for f in mine:
                assert (tmp_path / s / f).read_bytes() == (PCAPS / s / f).read_bytes(), f"{s}/{f}"
            continue
        _same_but_arithmetic(truth, bundled)
        for f in mine:
            if f.endswith((".pcap", ".pcapng")):
                _frames_same_but_payload(tmp_path / s / f, PCAPS / s / f)
            elif f != "truth.json":
                assert (tmp_path / s / f).read_bytes() == (PCAPS / s / f).read_bytes(), f"{s}/{f}"
        # and the set made here is exact to its own truth, as the bundled one is to its
        r = replay_json(tmp_path / s, truth)
        want = [c["sha256"] for c in truth["collectives"] if c["kind"] == "all_reduce"]
        assert len(r["allreduces"]) == len(want) and any(a["complete"] for a in r["allreduces"])
        assert all(a["sha256"] == w for a, w in zip(r["allreduces"], want) if a["complete"])


def test_the_readme_command_replays_the_demo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the demo's checkpoints go to ./mirrorckpt-demo
    res = CliRunner().invoke(main, ["replay", "--json", "--quiet"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout)
    truth = json.loads((PCAPS / "demo" / "truth.json").read_text())
    assert [a["sha256"] for a in r["allreduces"]] == [c["sha256"] for c in truth["collectives"]
                                                      if c["kind"] == "all_reduce"]
    assert len(r["iterations"]) == len(truth["iterations"]) == 10 and all(it["complete"] for it in r["iterations"])
    assert len(r["replica"]["checkpoints"]) == 10
    latest = tmp_path / "mirrorckpt-demo" / "step-00000010"
    before = sorted((p.name, p.stat().st_mtime_ns) for p in latest.iterdir())
    # run again into the same directory: nothing committed is overwritten, and the summary says so
    again = CliRunner().invoke(main, ["replay", "--quiet"], catch_exceptions=False)
    assert again.exit_code == 0, again.output
    assert "checkpoints: 0 committed: mirrorckpt-demo/step-00000010 was already there" in again.stdout
    assert sorted((p.name, p.stat().st_mtime_ns) for p in latest.iterdir()) == before


def test_replay_when_the_second_channel_is_never_used(tmp_path):
    """A 2-channel communicator whose collectives are all small enough for NCCL to run on channel 0 (the
    parser's state machine used to look for channel 1's steps without end: a hang, hence the timeout)."""
    truth = generate(GenConfig(ranks=2, channels=2, model="mlp:16,16,4", steps=2, seed=3, mirrors="0:egress,1:egress"),
                     tmp_path)
    assert {c for launch in truth["wire"]["launches"] for c in launch["used_channels"]} == {0}
    caps = [str(tmp_path / c["file"]) for c in truth["wire"]["captures"]]
    bin_ = shutil.which("mirrorckpt", path=str(REPO / ".venv" / "bin")) or shutil.which("mirrorckpt")
    res = subprocess.run([bin_, "replay", "--json", "--config", str(tmp_path / "job.toml"), *caps],
                         capture_output=True, text=True, timeout=12)
    r = json.loads(res.stdout)
    assert [a["sha256"] for a in r["allreduces"]] == [c["sha256"] for c in truth["collectives"]
                                                      if c["kind"] == "all_reduce"]
