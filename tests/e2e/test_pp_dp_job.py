"""A real pipeline-parallel CPU job, PP=2 x DP=2 (gloo, 4 processes, each stage holding only its
own layer under its global FQNs), attached through the control plane to two appliance processes,
one per stage's DP group: the sharded layout read from the stages, both groups' GoCkpt fallbacks,
one joint checkpoint equal to both stages' state, and a resume in which every rank pulls its
stage's shard from its group's appliance."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path

import pytest
import torch
from mirrorckpt.tools.testbed.harness import free_port
from mirrorckpt.tools.testbed.pp_dp_job import trainer_main
from mirrorckpt.tools.testbed.tp_dp_job import appliance_main
from mirrorckpt.updater import ckptdir, restore

CTX = mp.get_context("spawn")
GROUPS = ["pp0-tp0", "pp1-tp0"]
STEPS, HOLD, PARTS = 7, 1, 2  # fallbacks from iterations_done 2 to 4


def _wait_file(path: Path, timeout: float, procs) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            return json.loads(path.read_text())
        if any(not p.is_alive() and p.exitcode not in (None, 0) for p in procs):
            break
        time.sleep(0.05)
    pytest.fail(f"{path.name} did not appear in {timeout} s")


def _job(tmp: Path, tag: str, appliances: dict, restore_: str) -> list[dict]:
    out = tmp / tag
    out.mkdir()
    port = free_port()
    procs, results = [], []
    for rank in range(4):
        results.append(out / f"rank{rank}.json")
        procs.append(CTX.Process(target=trainer_main, args=(rank, 4, port, appliances, str(out), STEPS, HOLD, PARTS,
                                                            restore_, str(results[-1]))))
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
        if p.is_alive():
            for q in procs:
                q.kill()
            pytest.fail(f"job {tag}: a rank did not finish in 90 s")
    got = [json.loads(r.read_text()) if r.exists() else {"died": True} for r in results]
    for r in got:
        assert "fatal" not in r and "died" not in r, r
    return got


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ppdp")
    root, stop = tmp / "root", tmp / "stop"
    addr = f"127.0.0.1:{free_port()}"
    apps, results, ports = [], [], {}
    for r, g in enumerate(GROUPS):
        res, pf = tmp / f"appliance{r}.json", tmp / f"ports{r}.json"
        results.append(res)
        p = CTX.Process(target=appliance_main, args=(f"appliance-{r}", [g], r, 2, addr, str(root), str(pf), str(stop),
                                                     str(res)), kwargs={"parts": PARTS})
        p.start()
        apps.append(p)
    try:
        for p, r in zip(apps, range(2)):
            ports.update(_wait_file(tmp / f"ports{r}.json", 60, [p]))
        job = _job(tmp, "job", ports, "")
        joint = [_wait_file(res, 60, apps) for res in results]
        resumed = _job(tmp, "resumed", ports, "appliance")
    finally:
        stop.write_text("")
        for p in apps:
            p.join(30)
            if p.is_alive():
                p.kill()
    return {"tmp": tmp, "root": root, "job": job, "joint": joint, "resumed": resumed}


def _state(run, tag: str, step: int) -> dict:
    out = {}
    for s in (0, 1):
        out.update(torch.load(run["tmp"] / tag / f"state_{step}_stage{s}.pt"))
    return out


def test_stages_register_their_groups_and_fall_back(run):
    job = run["job"]
    assert [r["rank"] for r in job if r["leader"]] == [0, 2]  # DP rank 0 of each stage
    lay = job[0]["layout"]
    assert all(r["layout"] == lay for r in job)
    assert (lay["tp"], lay["pp"], lay["dp"]) == (1, 2, 2)
    assert [(g["name"], g["pp_stage"], g["ranks"], g["appliance"], [s["fqn"] for s in g["shards"]])
            for g in lay["groups"]] == [("pp0-tp0", 0, [0, 1], "appliance-0", ["fc1.weight", "fc1.bias"]),
                                        ("pp1-tp0", 1, [2, 3], "appliance-1", ["fc2.weight", "fc2.bias"])]
    assert [p["name"] for p in lay["params"]] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    for r in job:
        if r["leader"]:
            assert r["held_for_request"] is True
            assert [(f["start"], f["parts"]) for f in r["fallbacks"]] == [(HOLD + 1, PARTS)]
    for a, g in zip(run["joint"], GROUPS):
        assert "fatal" not in a, a.get("fatal")
        assert a["fallbacks"][g]["done"] == 1 and a["fallbacks"][g]["failed"] == 0
        assert a["steps"] == {g: HOLD + 1 + PARTS}


def test_joint_checkpoint_of_both_stages_equals_the_trainer(run):
    step = HOLD + 1 + PARTS
    root = run["root"]
    for a in run["joint"]:
        assert a["rounds"][-1] == str(root / ckptdir.step_dirname(step)), a["rounds"]
    sel = restore.select(root, verify_data=True)
    assert sel.path == root / ckptdir.step_dirname(step) and not sel.problems
    want = _state(run, "job", step)
    md = ckptdir.dcp_module().FileSystemReader(sel.path).read_metadata()
    got = restore._read_flat(sel.path, [k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")], md)
    got = {k: v for k, v in got.items() if k.startswith(("model.", "optim.state."))}
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v.reshape(got[k].shape)), k


def test_stages_pull_their_shards_and_resume_bit_exactly(run):
    step = HOLD + 1 + PARTS
    for r in run["resumed"]:
        assert r["restored"] == {"source": f"appliance:pp{r['rank'] // 2}-tp0", "iterations_done": step}
    for s in range(step, STEPS + 1):
        a, b = _state(run, "job", s), _state(run, "resumed", s)
        assert set(a) == set(b)
        for k in a:
            assert torch.equal(a[k], b[k]), (s, k)
