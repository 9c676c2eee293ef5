"""The generator against reality: the configuration of the real capture iter_40000_p2p_iter10
(2 ranks, LL, 1 channel, NCCL 2.18, nn.Linear(5000, 1, bias=False) seeded 2024, 20 iterations,
PMTU 1024, IPv6, rank 0's egress only, with the capture's extra point-to-point Simple sends emulated
by ``p2p_fill``) compared with the capture itself, read from ../shared and never copied.

Equal, and checked below: per QP role (LL data, CTS posts, P2P data) the sequence of WRITE opcodes
and PSNs, RETH lengths and immediates; every ACK's PSN, syndrome (receive credits) and MSN; per
opcode the packet counts; the NCCL sends' sizes, LL flags 1..45 and receive slots; every CTS field
(size, nreqs, tag, idx 1..41) and the FIFO stride; the UDP source port pairing (data with the ACKs of
its CTS, CTS with the ACKs of their data); BTH P_Key, MigReq, TVer, IPv6 traffic class and hop
limit; the start-up collectives byte for byte, the initial weights equal to the seeded model's;
the replay of the capture: every all-reduce complete, its last chunk filled by the P2P send.

Remaining differences (not compared, by design or because the real value is not determined):
* addresses, MACs, QP numbers, UDP port values, rkeys, buffer and FIFO addresses: drawn per run;
  only their structure is compared (slots 64 KiB apart, FIFO entries 256 B apart, ports paired);
* timestamps: a simulated clock (line rate, fixed latencies, fixed compute gaps);
* the gradients and hence every all-reduce payload: the real job's data shards are unknown;
* AckReq: the real NIC also requests an ACK at packet 11 of a 24-packet WRITE in 3 of 20 cases
  and not in the other 17; the generator always does (the test pins the difference to exactly
  those packets);
* the 266 UD congestion-control probes of the capture: emulated only with ``--noise probes``
  (payload layout copied, values not), so left out of the comparison.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from common import FLOWCHECK
from mirrorckpt.capture.pcapfile import open_capture
from mirrorckpt.parser import roce
from mirrorckpt.parser.headers import BTH, CTS32, IPV6
from mirrorckpt.parser.roce import nccl_versions as nv
from mirrorckpt.parser.roce import opcodes as oc
from mirrorckpt.parser.roce.packet_path import PacketPath
from mirrorckpt.tools.cli import main
from mirrorckpt.tools.generator.gen import GenConfig, generate

REAL = FLOWCHECK / "iter_40000_p2p_iter10.pcapng"
STEPS = 20


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("fidelity")
    truth = generate(GenConfig(ranks=2, channels=1, protocol="LL", nccl_version="2.18", model="linear:5000",
                               seed=2024, steps=STEPS, mirrors="0:egress", p2p_fill=True), out)
    return out / truth["wire"]["captures"][0]["file"], truth


class Capture:
    """Packets by QP role, NCCL sends, CTS entries, and a few header bytes of one capture."""

    def __init__(self, path):
        self.rows = defaultdict(list)  # (sport, dqp) -> packet dicts, in capture order
        self.hdr = []
        pp = PacketPath()
        self.sends = []
        with open_capture(path) as reader:
            for b in reader:
                pk, _ = roce.decode(b)
                for i in np.flatnonzero(pk.opcode != oc.UD_SEND_ONLY).tolist():
                    f = b.frame(int(pk.frame[i]))
                    bth = int(pk.pay_off[i]) - int(b.offset[pk.frame[i]])  # payload offset in the frame
                    self.rows[(int(pk.sport[i]), int(pk.dqp[i]))].append(dict(
                        op=int(pk.opcode[i]), psn=int(pk.psn[i]), a=bool(pk.ackreq[i]), dlen=int(pk.dlen[i]),
                        va=int(pk.va[i]), imm=int(pk.imm_raw[i]), syn=int(pk.syndrome[i]), msn=int(pk.msn[i]),
                        pay=f[bth:bth + int(pk.pay_len[i])]))
                    ip = IPV6.unpack(f, 14)
                    at = 14 + IPV6.size + 8
                    self.hdr.append((ip["ver_tc_fl"] >> 20 & 0xFF, ip["hop"], BTH.unpack(f, at)["pkey"],
                                     BTH.unpack(f, at)["flags"]))
                self.sends += pp.feed(b)[1]
        self.sends += pp.flush()[1]
        self.counts = dict(pp.counters.by_opcode())
        self.role = {}
        for key, rows in self.rows.items():
            writes = [r for r in rows if r["op"] != oc.RC_ACKNOWLEDGE]
            if all(r["op"] == oc.RC_RDMA_WRITE_ONLY and r["dlen"] == CTS32.size for r in writes):
                self.role["cts"] = key
            elif any(s.protocol == nv.LL and s.connection.sport == key[0] for s in self.sends):
                self.role["ll"] = key
            else:
                self.role["p2p"] = key

    def writes(self, role):
        return [r for r in self.rows[self.role[role]] if r["op"] != oc.RC_ACKNOWLEDGE]

    def acks(self, role):
        return [r for r in self.rows[self.role[role]] if r["op"] == oc.RC_ACKNOWLEDGE]

    def ll_sends(self):
        return [s for s in self.sends if s.connection.sport == self.role["ll"][0]]

    def p2p_sends(self):
        return [s for s in self.sends if s.connection.sport == self.role["p2p"][0]]

    def cts(self):
        return [CTS32.unpack(r["pay"]) for r in self.writes("cts")]


@pytest.fixture(scope="module")
def both(generated):
    return Capture(REAL), Capture(generated[0])


def test_same_qp_roles_and_packet_counts(both):
    real, gen = both
    assert sorted(real.role) == sorted(gen.role) == ["cts", "ll", "p2p"]
    real_counts = {k: v for k, v in real.counts.items() if k != "UD_SEND_ONLY"}
    assert gen.counts == real_counts
    for role in real.role:
        assert len(real.rows[real.role[role]]) == len(gen.rows[gen.role[role]])


@pytest.mark.parametrize("role", ["ll", "cts", "p2p"])
def test_write_sequences_equal(both, role):
    real, gen = both
    rw, gw = real.writes(role), gen.writes(role)
    for field in ("op", "psn", "dlen", "imm"):
        assert [r[field] for r in rw] == [g[field] for g in gw], field


@pytest.mark.parametrize("role", ["ll", "cts", "p2p"])
def test_ack_sequences_equal(both, role):
    """ACKs rank 0 sends: of its upstream's data (credits = receives still posted) on the CTS
    pair, of its downstream's CTS on the data pair, of the P2P receiver's CTS on the P2P pair."""
    real, gen = both
    ra, ga = real.acks(role), gen.acks(role)
    assert [(r["psn"], r["syn"], r["msn"]) for r in ra] == [(g["psn"], g["syn"], g["msn"]) for g in ga]


def test_ackreq_differs_only_at_packet_11_of_some_24_packet_writes(both):
    real, gen = both
    rw, gw = real.writes("ll"), gen.writes("ll")
    first = 0
    diffs = []
    for k, (r, g) in enumerate(zip(rw, gw)):
        if r["op"] in (oc.RC_RDMA_WRITE_FIRST, oc.RC_RDMA_WRITE_ONLY_WITH_IMMEDIATE):
            first = k
        if r["a"] != g["a"]:
            diffs.append((k - first, r["op"], rw[first]["dlen"], r["a"], g["a"]))
    assert diffs, "the real NIC's AckReq pattern is known to differ on some packets"
    assert set(diffs) == {(11, oc.RC_RDMA_WRITE_MIDDLE, 24576, False, True)}
    assert len(diffs) == 17


def test_sends_sizes_flags_and_slots(both):
    real, gen = both
    rs, gs = real.ll_sends(), gen.ll_sends()
    assert [s.flag for s in rs] == [s.flag for s in gs] == list(range(1, 4 + 2 * STEPS + 2))
    assert [(s.size, s.wire_bytes, s.form) for s in rs] == [(s.size, s.wire_bytes, s.form) for s in gs]
    step = nv.step_bytes(nv.LL, "2.18")
    for sends in (rs, gs):
        base = sends[0].va
        assert [s.va - base for s in sends] == [(s.flag - 1) % nv.NCCL_STEPS * step for s in sends]
    assert [len(s.data) for s in real.p2p_sends()] == [len(s.data) for s in gen.p2p_sends()] == [1928 * 4] * STEPS


def test_cts_fields_and_fifo_stride(both):
    real, gen = both
    rc, gc = real.cts(), gen.cts()
    for key in ("size", "nreqs", "tag", "idx"):
        assert [e[key] for e in rc] == [e[key] for e in gc], key
    assert [e["idx"] for e in gc] == list(range(1, len(gc) + 1))
    # the receive slot each CTS announces, relative to the first
    assert [e["addr"] - rc[0]["addr"] for e in rc] == [e["addr"] - gc[0]["addr"] for e in gc]
    for cap in (real, gen):
        vas = [r["va"] for r in cap.writes("cts")]
        assert set(np.diff(vas).tolist()) == {nv.cts_fifo_stride("2.18")}


def test_udp_ports_pair_the_directions_and_headers_agree(both):
    real, gen = both
    for cap in (real, gen):
        # three QP pairs: data, CTS (reverse connection), P2P; each pair one port
        assert len({cap.role[r][0] for r in cap.role}) == 3
        assert Counter(cap.hdr) == Counter({(0x02, 64, 0xFFFF, 0x40): len(cap.hdr)})


def test_startup_collectives_and_initial_weights(both):
    real, gen = both
    torch.manual_seed(2024)
    weights = torch.nn.Linear(5000, 1, bias=False).weight.detach().numpy().astype("<f4").tobytes()
    rs, gs = real.ll_sends(), gen.ll_sends()
    # all-gather of the parameter count, shapes broadcast, weights broadcast; the rebuild broadcasts
    for flag in (1, 2, 3, 6, 7):
        r = next(s for s in rs if s.flag == flag)
        g = next(s for s in gs if s.flag == flag)
        assert r.data.tobytes() == g.data.tobytes(), flag
    assert next(s for s in gs if s.flag == 3).data.tobytes() == weights
    # the gradients (all-reduce messages) differ: the real job's data is not known
    assert next(s for s in rs if s.flag == 4).data.tobytes() != next(s for s in gs if s.flag == 4).data.tobytes()


def test_replay_of_the_generated_capture_like_the_real_one(generated):
    import json

    path, truth = generated
    for cap in (REAL, path):
        res = CliRunner().invoke(main, ["replay", "--json", "--p2p-fill", str(cap)], catch_exceptions=False)
        r = json.loads(res.stdout)
        assert len(r["allreduces"]) == STEPS
        assert all(a["complete"] and a["filled_by_p2p"] == [[3072, 1928]] for a in r["allreduces"])
    want = [c["sha256"] for c in truth["collectives"] if c["kind"] == "all_reduce"]
    assert [a["sha256"] for a in r["allreduces"]] == want
