"""`mirrorckpt inspect`: JSON contents on the real captures, and clear verdicts on bad input."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from common import FLOWCHECK, PCAPS, flowcheck_captures
from mirrorckpt.capture.writer import PcapWriter
from mirrorckpt.tools.cli import main


def run(*args):
    res = CliRunner().invoke(main, ["inspect", *map(str, args)])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    return res


@pytest.mark.parametrize("name", flowcheck_captures())
def test_json_matches_truth(truth, name):
    res = run("--json", FLOWCHECK / name)
    assert res.exit_code == 0
    r = json.loads(res.stdout)
    t = truth[name]
    assert r["frames"] == sum(t["packet_counts"].values())
    assert r["truncated_frames"] == 0
    want = {k[5:].lower(): v for k, v in t["packet_counts"].items() if k.startswith("roce:")}
    assert {k.lower(): v for k, v in r["roce"]["by_opcode"].items()} == want
    assert r["roce"]["icrc_failed"] == sum(v for k, v in t["icrc"].items() if k.endswith(":BAD"))
    assert len(r["messages"]) == t["messages"]
    assert sorted(m["missing_bytes"] for m in r["messages"] if not m["complete"]) == \
        sorted(t["incomplete_message_missing_bytes"])
    for s in r["sends"]:
        assert set(s) >= {"connection", "protocol", "ll_flag", "bytes", "complete", "sha256"}
        assert (s["sha256"] is None) == (not s["complete"])


def test_unknown_opcode_named_in_hex():
    r = json.loads(run("--json", FLOWCHECK / "rdma32.pcapng").stdout)
    assert r["roce"]["by_opcode"]["0xAA"] == 7
    assert r["roce"]["icrc"]["0xAA:BAD"] == 7


def test_summary_is_readable():
    out = run(FLOWCHECK / "iter_80000.pcapng").stdout
    assert "RDMA messages: 18 (2 incomplete)" in out
    assert "12288 of" in out and "16512 of" in out


def test_truncated_file_reports_what_came_before(tmp_path):
    src = (FLOWCHECK / "iter_40000_p2p_iter10.pcapng").read_bytes()
    cut = tmp_path / "cut.pcapng"
    cut.write_bytes(src[: len(src) // 2 + 37])
    res = run("--json", cut)
    assert res.exit_code == 3
    r = json.loads(res.stdout)
    assert 0 < r["frames"] < 1417 and "byte" in r["damage"]
    assert "error:" in res.stderr


def test_not_a_capture(tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("this is not a capture\n" * 10)
    res = run(f)
    assert res.exit_code == 2 and "not a pcap or pcapng file" in res.stderr


def test_missing_and_empty_files(tmp_path):
    assert run(tmp_path / "nope.pcap").exit_code == 2
    (tmp_path / "empty.pcap").write_bytes(b"")
    assert run(tmp_path / "empty.pcap").exit_code == 2


def test_capture_without_roce(tmp_path):
    f = tmp_path / "arp.pcap"
    arp = bytes.fromhex("ffffffffffff0242ac110002080600010800060400010242ac110002ac1100020000000000"
                        "00ac110003") + bytes(18)
    with PcapWriter(f) as w:
        for i in range(5):
            w.write(arp, ts_ns=i * 1000)
    res = run(f)
    assert res.exit_code == 1 and "no RoCEv2 traffic" in res.stderr
    assert "arp 5" in res.stdout


BUNDLED = sorted(str(p.relative_to(PCAPS)) for p in PCAPS.glob("*/*.pcap*"))


@pytest.mark.parametrize("name", BUNDLED)
def test_every_bundled_capture_inspects_with_no_option(name):
    """The release is read from the wire, as replay and doctor read it (a default of 2.18 ended
    ll128_bf16_v229 in a traceback)."""
    res = run(PCAPS / name)
    assert res.exit_code == 0, res.output
    assert "verdict: NCCL traffic: NCCL 2." in res.stdout


def test_release_read_from_the_wire_and_a_contradicting_one_refused():
    cap = PCAPS / "ll128_bf16_v229" / "rank0_egress.pcapng"
    r = json.loads(run("--json", cap).stdout)
    assert r["nccl"]["release"] == "NCCL 2.29" and r["nccl"]["cts_layout"] == "cts64_v2.24"
    assert r["sends"] and all(s["protocol"] == "LL128" for s in r["sends"] if s["bytes"])
    res = run("--nccl-version", "2.18", cap)
    assert res.exit_code == 4 and "contradicts the stated NCCL 2.18" in res.stderr
