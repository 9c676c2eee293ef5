"""Issue 39: a collective plus point-to-point sends on other connections between the same ranks.

The real shape that broke inference: a 2-rank, 1-channel LL job (NCCL 2.12-2.19, PMTU 1024), rank
0's egress only, one all-reduce of 5,000 (another 10,000) float32 on the ring connection, and one
Simple point-to-point send on a second connection of the same pair. Seen without its CTS (the
receiver posts it on the other direction), that one send looks like a Simple ring connection;
counted as a second channel no plan fits the sizes ("cannot reassemble: the message sizes fit
neither DDP's start-up nor a series of all-reduces"). Generated here over releases, protocols,
element counts, the workload's own fill send and foreign sends, on one or more p2p connections;
each replayed with no configuration.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from mirrorckpt.tools import cmd_replay
from mirrorckpt.tools.cli import main
from mirrorckpt.tools.generator.gen import GenConfig, generate

pytestmark = pytest.mark.offline  # capture files in one process: runs beside the unit tests

# (release, protocol, elements): the fill send is one message (the chunk rank 0's egress lacks)
FILLED = [("2.12", "LL", 5000), ("2.15", "LL", 10000), ("2.19", "LL", 777), ("2.18", "LL", 16000),
          ("2.19", "Simple", 5000), ("2.18", "LL128", 10000), ("2.23", "LL", 5000), ("2.29", "Simple", 3000)]


def make(tmp_path, v, proto, n, **kw):
    cfg = dict(ranks=2, channels=1, protocol=proto, nccl_version=v, model=f"linear:{n}", steps=1, seed=n % 97,
               mirrors="0:egress", send_truth=False)
    cfg.update(kw)
    truth = generate(GenConfig(**cfg), tmp_path)
    return truth, [str(tmp_path / c["file"]) for c in truth["wire"]["captures"]]


def allreduce_truth(truth) -> list[str]:
    return [c["sha256"] for c in truth["collectives"] if c["kind"] == "all_reduce"]


@pytest.mark.parametrize("v,proto,n", FILLED, ids=[f"{p}-{n}-v{v}" for v, p, n in FILLED])
def test_one_allreduce_and_its_fill_send_replay_exactly(tmp_path, v, proto, n):
    truth, caps = make(tmp_path, v, proto, n, p2p_fill=True)
    js, results, its, _ = cmd_replay.run(caps, nccl_version=None, p2p_fill=True)
    ars = [r for r in results if r.spec.kind == "allreduce"]
    assert [r.sha256() for r in ars] == allreduce_truth(truth)
    assert ars[0].filled_by_p2p and its[0].complete
    assert js.model.ring.nchannels == 1
    rep = js.report()
    assert not rep.mismatches and rep.placement.get("not_ring") == 1
    # doctor follows it and names the second connection point-to-point
    r = CliRunner().invoke(main, ["doctor", "--json", *caps])
    assert r.exit_code == 0, r.output
    kinds = sorted(c["kind"] for c in json.loads(r.output)["connections"])
    assert kinds == ["collective", "point-to-point"]


@pytest.mark.parametrize("n", [5000, 10000])
def test_a_foreign_send_leaves_the_hole_and_names_it(tmp_path, n):
    """One foreign send (not the all-reduce's values) instead of the fill: the job still infers,
    the all-reduce is incomplete with exactly the chunk rank 0's egress lacks, nothing is wrong."""
    truth, caps = make(tmp_path, "2.18", "LL", n, p2p_noise=(4096,))
    js, results, its, _ = cmd_replay.run(caps, nccl_version=None, p2p_fill=True)
    (ar,) = [r for r in results if r.spec.kind == "allreduce"]
    plan = js.model.plan(ar.spec)
    assert ar.holes == plan.missing_chunk_ranges(0, 0) and not ar.filled_by_p2p
    assert not its[0].complete and not js.report().mismatches


def test_sends_on_several_p2p_connections_both_ways(tmp_path):
    """Point-to-point sends on three connections (0->1, 1->0 twice over one pair's connection),
    LL and Simple mixed, both egresses mirrored: every all-reduce equal to truth."""
    truth, caps = make(tmp_path, "2.19", "LL", 12000, steps=3, mirrors="0:egress,1:egress",
                       p2p_noise=((0, 1, 8192), (1, 0, 512), (1, 0, 20000)))
    js, results, its, _ = cmd_replay.run(caps, nccl_version=None)
    assert [r.sha256() for r in results if r.spec.kind == "allreduce"] == allreduce_truth(truth)
    assert len(its) == 3 and all(it.complete for it in its)
    assert js.model.ring.nchannels == 1


def test_gen_cli_writes_p2p_sends(tmp_path):
    r = CliRunner().invoke(main, ["gen", "--out", str(tmp_path), "--model", "linear:5000", "--steps", "1",
                                  "--mirror", "0:egress", "--p2p-send", "0>1:4096", "--no-send-truth"])
    assert r.exit_code == 0, r.output
    truth = json.loads((tmp_path / "truth.json").read_text())
    assert truth["wire"]["p2p_noise"] == [[0, 1, 4096]]
    bad = CliRunner().invoke(main, ["gen", "--out", str(tmp_path / "b"), "--p2p-send", "0-1:4096"])
    assert bad.exit_code == 2 and "SRC>DST:BYTES" in bad.output
