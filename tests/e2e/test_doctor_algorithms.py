"""Issue 39: `doctor` names the algorithms that replace the ring, from generated captures of each.

A 4-rank, 2-channel DDP job mirrored at the egress of ranks 0 and 1 (adjacent), three iterations,
under each algorithm the generator models (tools/generator/algorithms.py): Tree all-reduces, PAT
all-gathers (2.23+), NVLS (all-reduces off the network) and CollNet (all-reduces through an
aggregation node). doctor leads with "verdict: not followable", names the algorithm, and gives the
setting that brings the ring back with its cost; the same job on the ring is followable. Its JSON
report carries the same.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from mirrorckpt.parser.roce import algofind
from mirrorckpt.tools.cli import main
from mirrorckpt.tools.generator import algorithms as algo
from mirrorckpt.tools.generator.gen import GenConfig, generate

pytestmark = pytest.mark.offline  # capture files in one process: runs beside the unit tests

EGRESS = ["rank0_egress.pcapng", "rank1_egress.pcapng"]
# algorithm -> (what doctor names, the setting in its fix)
CASES = {
    "tree": ("Tree", "NCCL_ALGO=Ring"),
    "pat": ("PAT", "NCCL_PAT_ENABLE=0"),
    "nvls": ("NVLS", "NCCL_NVLS_ENABLE=0"),
    "collnet": ("CollNet", "NCCL_COLLNET_ENABLE=0"),
}


def doctor(out):
    r = CliRunner().invoke(main, ["doctor", *(str(out / f) for f in EGRESS)])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    return r


@pytest.fixture(scope="module", params=["ring", *CASES])
def job(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    truth = generate(GenConfig(ranks=4, channels=2, protocol="LL", nccl_version="2.23", model="linear:20000",
                               steps=3, seed=4, mirrors="0:egress,1:egress", algorithm=request.param,
                               send_truth=False), out)
    return request.param, out, truth


def test_doctor_names_the_algorithm_and_its_fix(job):
    name, out, truth = job
    r = doctor(out)
    lines = r.output.splitlines()
    if name == "ring":
        assert r.exit_code == 0 and lines[0] == "verdict: followable" and "algorithm: ring" in lines
        return
    algorithm, setting = CASES[name]
    assert r.exit_code == 1 and lines[0] == "verdict: not followable", r.output
    assert f"algorithm: {algorithm}" in lines
    fix = next(i for i, line in enumerate(lines) if line.startswith("  fix:"))
    assert setting in lines[fix] and lines[fix + 1].startswith("  cost: ")
    rep = json.loads(CliRunner().invoke(main, ["doctor", "--json", *(str(out / f) for f in EGRESS)]).output)
    assert rep["verdict"] == "not followable"
    assert [c["algorithm"] for c in rep["causes"]] == [algorithm]
    assert rep["causes"][0]["cost"] == algofind.FIXES[algorithm][1]


def test_the_generated_traffic_has_each_algorithm_s_shape(job):
    """What doctor reads is on the wire: Tree's connections to a parent and children, PAT's to the
    rank two ahead, no all-reduce on the ring for NVLS and CollNet, CollNet's SENDs to a node."""
    name, out, truth = job
    launches = [la for la in truth["wire"]["launches"] if la["kind"] == "allreduce"]
    topo = truth["wire"]["topology"]
    if name == "tree":
        assert all(la["algorithm"] == "tree" for la in launches)
        assert {(p["sender"], p["receiver"]) for p in topo["peers"]} >= {(2, 0), (0, 2), (1, 3)}
    elif name == "pat":
        ag = [la for la in truth["wire"]["launches"] if la["kind"] == "allgather"]
        assert ag and all(la["algorithm"] == "pat" for la in ag)
        assert {(p["sender"], p["receiver"]) for p in topo["peers"]} == {(r, (r + 2) % 4) for r in range(4)}
    elif name in ("nvls", "collnet"):
        assert all(la["algorithm"] == name and la["used_channels"] == [] for la in launches)
        assert ("switch" in topo) == (name == "collnet")
    else:
        assert "peers" not in topo and "algorithm" not in truth["wire"]


def test_the_double_binary_tree_is_ncclgetdtree_s():
    """Tree 0 for 4 ranks: 0 -> 2 -> {1, 3}; tree 1 mirrors it: 3 -> 1 -> {2, 0}; for 5 ranks tree
    1 is tree 0 shifted by one."""
    assert [algo.dtree(4, r, 0) for r in range(4)] == [(-1, [2]), (2, []), (0, [1, 3]), (2, [])]
    assert [algo.dtree(4, r, 1) for r in range(4)] == [(1, []), (3, [2, 0]), (1, []), (-1, [1])]
    assert [algo.dtree(5, r, 0) for r in range(5)] == [(-1, [4]), (2, []), (4, [1, 3]), (2, []), (0, [2])]
    assert algo.dtree(5, 1, 1) == (-1, [0]) and algo.dtree(5, 0, 1) == (1, [3]) and algo.dtree(5, 3, 1) == (0, [2, 4])
    assert algo.pat_rounds(4) == [1, 2] and algo.pat_rounds(5) == [1, 2, 4]


def test_pat_needs_2_23(tmp_path):
    with pytest.raises(ValueError, match="has no PAT"):
        generate(GenConfig(ranks=4, nccl_version="2.22", algorithm="pat", steps=1, send_truth=False), tmp_path)
