"""Issue 39: RoCE traffic that is not NCCL's gets a clean verdict, and NCCL's own is still read.

Real Soft-RoCE traffic (one RDMA WRITE of 18 bytes, one RDMA READ) made `doctor` die in
infer._solve_counts and `inspect` call the WRITE an NCCL Simple send and print READ opcodes in hex.
Captures here come from tools.generator.verbs (an RDMA application's WRITEs, READs, SENDs and
atomics on one RC QP pair, random initial PSNs as rxe sets them)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from mirrorckpt.capture.pcapfile import read_all
from mirrorckpt.capture.writer import PcapngWriter
from mirrorckpt.parser.roce import opcodes
from mirrorckpt.tools.cli import main
from mirrorckpt.tools.generator import verbs
from mirrorckpt.tools.generator.gen import GenConfig, generate

EVERY_OP = "write:5000,write_imm:18,read:3000,send:100,send_imm:2000,send_inval:10,cmp_swap,fetch_add,write:32,write:64"


def run(*args):
    res = CliRunner().invoke(main, [*map(str, args)])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res


@pytest.fixture
def soft_roce(tmp_path):
    path = tmp_path / "rxe.pcapng"
    verbs.write_capture(path, verbs.parse_ops("write:18,read:18"), seed=3)
    return path


def test_inspect_names_the_soft_roce_exchange_not_nccl(soft_roce):
    res = run("inspect", "--json", soft_roce)
    assert res.exit_code == 0
    r = json.loads(res.stdout)
    assert set(r["roce"]["by_opcode"]) == {"RC_RDMA_WRITE_ONLY", "RC_ACKNOWLEDGE", "RC_RDMA_READ_REQUEST",
                                           "RC_RDMA_READ_RESPONSE_ONLY"}
    assert r["sends"] == [] and not r["nccl"]["nccl"]
    assert r["nccl"]["not_nccl_writes"] == 1 and r["nccl"]["other_operations"] == {"RDMA READ": 2}
    text = run("inspect", soft_roce).stdout
    assert "verdict: not NCCL" in text and "1 WRITE message(s) that no NCCL connection claims" in text


def test_doctor_says_not_nccl_and_exits_non_zero(soft_roce):
    res = run("doctor", soft_roce)
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert res.stdout.splitlines()[0] == "verdict: not NCCL"
    r = json.loads(run("doctor", "--json", soft_roce).stdout)
    assert r["verdict"] == "not NCCL" and "RDMA READ 2 packets" in r["causes"][0]["cause"]


def test_every_opcode_is_named_and_no_psn_gap_reads_as_loss(tmp_path):
    path = tmp_path / "all.pcapng"
    verbs.write_capture(path, verbs.parse_ops(EVERY_OP), seed=5)
    r = json.loads(run("inspect", "--json", path).stdout)
    assert not any(k.startswith("0x") for k in r["roce"]["by_opcode"])
    assert {"RC_CMP_SWAP", "RC_FETCH_ADD", "RC_ATOMIC_ACKNOWLEDGE", "RC_SEND_ONLY_WITH_INVALIDATE",
            "RC_SEND_LAST_WITH_IMMEDIATE", "RC_RDMA_READ_RESPONSE_MIDDLE"} <= set(r["roce"]["by_opcode"])
    assert r["roce"]["icrc_failed"] == 0
    # WRITEs before the QP's first READ are reassembled; from it on the QP is left out, so the PSNs the
    # SENDs and READs take never read as lost WRITE packets
    assert all(q["lost_packets"] == 0 for q in r["qps"])
    assert r["sends"] == [] and not r["nccl"]["nccl"] and r["nccl"]["verbs_qps"]
    assert set(r["nccl"]["other_operations"]) == {"RDMA READ", "SEND", "atomic"}


@pytest.mark.parametrize("ops", ["write:32", "write:64", "write:32,write:64,write:128", "write_imm:18"])
def test_short_writes_without_cts_are_no_nccl_sends(tmp_path, ops):
    """CTS-sized WRITEs of an application's bytes are no CTS posts, and an immediate that is not the
    length is no NCCL data: nothing is claimed."""
    path = tmp_path / "w.pcapng"
    verbs.write_capture(path, verbs.parse_ops(ops), seed=len(ops))
    r = json.loads(run("inspect", "--json", path).stdout)
    assert r["cts_posts"] == 0 and r["sends"] == [] and not r["nccl"]["nccl"]
    assert r["nccl"]["not_nccl_writes"] == len(ops.split(","))


def test_opcode_table_follows_ibta():
    assert opcodes.name(0x0C) == "RC_RDMA_READ_REQUEST" and opcodes.name(0x10) == "RC_RDMA_READ_RESPONSE_ONLY"
    assert opcodes.name(0x12) == "RC_ATOMIC_ACKNOWLEDGE" and opcodes.name(0xAA) == "0xAA"
    assert opcodes.TABLE[0x0D].aeth and not opcodes.TABLE[0x0E].aeth and opcodes.TABLE[0x0C].reth
    assert [opcodes.name(c) for c in np.flatnonzero(opcodes.OTHER_REQUEST)] == [
        "RC_SEND_FIRST", "RC_SEND_MIDDLE", "RC_SEND_LAST", "RC_SEND_LAST_WITH_IMMEDIATE", "RC_SEND_ONLY",
        "RC_SEND_ONLY_WITH_IMMEDIATE", "RC_RDMA_READ_REQUEST", "RC_CMP_SWAP", "RC_FETCH_ADD",
        "RC_SEND_LAST_WITH_INVALIDATE", "RC_SEND_ONLY_WITH_INVALIDATE"]
    assert not opcodes.IS_WRITE[[0x00, 0x04, 0x0C, 0x10, 0x13]].any()


def test_nccl_beside_an_rdma_application_is_still_exact(tmp_path):
    """One capture file holding a generated NCCL job and an RDMA application's READs and SENDs
    between two other hosts: inspect says NCCL and leaves the application's QP out; replay with no
    configuration gives every all-reduce equal to truth."""
    truth = generate(GenConfig(model="linear:5000", steps=2, mirrors="0:egress,1:egress", send_truth=False),
                     tmp_path / "job")
    raw, stamps = verbs.conversation(verbs.parse_ops("write:18,read:4000,send:300,fetch_add"), seed=9)
    t0 = int(read_all(tmp_path / "job" / "rank0_egress.pcapng").ts_ns[0])
    frames = [(t0 + (ts - stamps[0]) + 1000, f) for ts, f in zip(stamps, raw)]
    b = read_all(tmp_path / "job" / "rank0_egress.pcapng")
    frames += [(int(b.ts_ns[i]), b.data[b.offset[i]:b.offset[i] + b.caplen[i]].tobytes()) for i in range(len(b))]
    mixed = tmp_path / "mixed.pcapng"
    with PcapngWriter(mixed) as w:
        for ts, f in sorted(frames, key=lambda x: x[0]):
            w.write(f, ts_ns=ts)
    r = json.loads(run("inspect", "--json", mixed).stdout)
    assert r["nccl"]["nccl"] and len(r["nccl"]["verbs_qps"]) == 1 and r["nccl"]["not_nccl_writes"] == 1
    rep = json.loads(run("replay", "--json", "--quiet", mixed, tmp_path / "job" / "rank1_egress.pcapng").stdout)
    assert [a["sha256"] for a in rep["allreduces"]] == [c["sha256"] for c in truth["collectives"]
                                                       if c["kind"] == "all_reduce"]


def test_a_connection_s_sends_before_its_proof_are_kept(tmp_path):
    """A send that proves nothing (its closing packet lost: no immediate, no length) first on a
    connection is held, not dropped: the connection's next send proves NCCL and both go on, in order."""
    from mirrorckpt.capture.batch import FrameBatch
    from mirrorckpt.parser.roce.packet_path import PacketPath

    generate(GenConfig(protocol="Simple", model="linear:5000", steps=1, mirrors="0:egress", send_truth=False),
             tmp_path)
    b = read_all(tmp_path / "rank0_egress.pcapng")
    op = PacketPath().decode(b).opcode
    start = int(np.flatnonzero(op == opcodes.RC_RDMA_WRITE_FIRST)[0])  # the capture starts at a long message
    close = start + int(np.flatnonzero(op[start:] == opcodes.RC_RDMA_WRITE_LAST_WITH_IMMEDIATE)[0])

    def frames(i):
        return FrameBatch(b.data, b.offset[i], b.caplen[i], b.wirelen[i], b.ts_ns[i], b.iface[i], b.source)

    whole, lost = PacketPath(), PacketPath()
    rows = np.arange(start, len(b))
    sends = whole.feed(frames(rows))[1] + whole.flush()[1]
    got = lost.feed(frames(rows[rows != close]))[1] + lost.flush()[1]
    assert len(got) == len(sends) and lost.nccl.not_nccl == 0
    assert got[0].size is None and got[0].connection == got[1].connection and got[1].size is not None


def test_replay_of_no_nccl_traffic_exits_non_zero(soft_roce):
    res = run("replay", "--quiet", soft_roce)
    assert res.exit_code == 1 and "no NCCL send in the captures" in res.stderr
