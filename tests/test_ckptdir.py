"""Never lose a good checkpoint (issue 14): a root belongs to one job, the newest checkpoint proven
equal to the trainer survives pruning, drift quarantines what came after it, restore chooses
verified first and reports every problem, a full disk leaves the previous checkpoint intact."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from common import FLOWCHECK
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec
from mirrorckpt.config.training import OptimizerSpec, PersistSpec, TrainingSpec
from mirrorckpt.tools.cli import main
from mirrorckpt.tools.cmd_restore import restore as restore_cmd
from mirrorckpt.updater import ckptdir
from mirrorckpt.updater.ckptdir import ForeignRoot
from mirrorckpt.updater.persist import Persister, write_checkpoint
from mirrorckpt.updater.replica import Replica
from mirrorckpt.updater.restore import read_state, select, verify

TRAINING = TrainingSpec(optimizer=OptimizerSpec("adamw", lr=1e-3, weight_decay=0.01))


def layout_of(*shapes) -> JobLayout:
    params = [ParamSpec(f"p{i}", s) for i, s in enumerate(shapes)]
    b = [BucketSpec(tuple(range(len(params))))]
    return JobLayout(params, b, first_buckets=b)


def replica(layout: JobLayout, seed=0) -> Replica:
    import torch

    g = torch.Generator().manual_seed(seed)
    return Replica(layout, TRAINING, {p.name: torch.randn(p.shape, generator=g) for p in layout.params})


def step(rep: Replica, seed=0) -> None:
    from mirrorckpt.parser.iteration import ReducedIteration

    rng = np.random.default_rng(seed * 1000 + rep.iterations_done)
    lay = rep.layout
    rep.apply(ReducedIteration(rep.iterations_done, [rng.standard_normal(lay.bucket_count(b)).astype(np.float32)
                                                     for b in lay.bucket_list(rep.iterations_done)]))


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root with its sha256, and every directory: 'nothing touched' is equality."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            out[str(Path(dirpath, d).relative_to(root)) + "/"] = ""
        for f in files:
            p = Path(dirpath, f)
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


A, B = layout_of((32, 16), (32,)), layout_of((8, 8))


def job_a_root(root: Path, steps=5, keep=3) -> Replica:
    rep = replica(A)
    for _ in range(steps):
        step(rep)
        write_checkpoint(root, rep.state_dict_for_checkpoint(), keep_last=keep, job="job-a")
    return rep


# ---------------------------------------------------------------- one job per root

@pytest.mark.parametrize("legacy", [False, True])
def test_another_jobs_writer_is_refused_and_touches_nothing(tmp_path, legacy):
    root = tmp_path / "root"
    job_a_root(root, steps=5, keep=5)
    assert json.loads((root / "job.json").read_text())["job"] == "job-a"
    if legacy:  # a root written before job.json existed: the manifests tell the job
        (root / "job.json").unlink()
    before = snapshot(root)
    other = replica(B)
    for _ in range(8):  # more steps than job A has: on the old code they pruned all of A's
        step(other)
    with pytest.raises(ForeignRoot, match="checkpoint directory of another job: its model differs"):
        write_checkpoint(root, other.state_dict_for_checkpoint(), keep_last=1)
    # the appliance's persister, which learns the layout from the replica at its first snapshot
    per = Persister(PersistSpec(str(root), keep_last=1))
    assert not per.submit(other) and not per.submit(other, force=True)
    per.close()
    assert per.stats.committed == 0 and "another job" in per.stats.refused
    with pytest.raises(ForeignRoot):  # told at start: not even the lock file is made
        Persister(PersistSpec(str(root), keep_last=1), identity=ckptdir.identity(B.to_dict()))
    after = snapshot(root)
    after.pop(".lock", None)  # the lazily-claiming persister did take the root's lock
    assert after == before


def test_same_model_another_job_name_is_refused(tmp_path):
    root = tmp_path / "root"
    rep = job_a_root(root, steps=2)
    step(rep)
    with pytest.raises(ForeignRoot, match="belongs to job 'job-a', this is job 'job-b'"):
        write_checkpoint(root, rep.state_dict_for_checkpoint(), job="job-b")
    assert write_checkpoint(root, rep.state_dict_for_checkpoint(), job="job-a").name == "step-00000003"


def test_replay_of_another_job_into_the_demo_directory_fails_and_keeps_it(tmp_path, monkeypatch):
    """The issue's case: `cp -a mirrorckpt-demo x; mirrorckpt replay <real capture> --checkpoint-dir x`."""
    monkeypatch.chdir(tmp_path)
    run = CliRunner().invoke(main, ["replay", "--quiet"], catch_exceptions=False)
    assert run.exit_code == 0, run.output
    (tmp_path / "mirrorckpt-demo" / "job.json").unlink()  # as the landed code left it
    shutil.copytree(tmp_path / "mirrorckpt-demo", tmp_path / "x", symlinks=True)
    before = snapshot(tmp_path / "x")
    before.pop(".lock", None)
    # --p2p-fill: the capture's workload sends the values rank 0's egress lacks (its iterations complete);
    # without a job file the replica's optimizer is stated
    run = CliRunner().invoke(main, ["replay", "--quiet", "--p2p-fill", str(FLOWCHECK / "iter_40000_p2p_iter10.pcapng"),
                                    "--checkpoint-dir", "x", "--optimizer", "adam"], catch_exceptions=False)
    assert run.exit_code != 0
    assert "checkpoint directory of another job" in run.stderr and "nothing was written" in run.stderr
    after = snapshot(tmp_path / "x")
    after.pop(".lock", None)
    assert after == before


# ---------------------------------------------------------------- verified, pruned, quarantined

def test_drift_keeps_the_last_verified_and_quarantines_what_came_after(tmp_path):
    """keep_last = 3, fingerprint every 10: the checkpoint proven at step 20 outlives pruning; drift
    found at step 30 moves 21..29 aside (kept), and a restore from disk gives step 20."""
    root = tmp_path / "root"
    rep = replica(A)
    per = Persister(PersistSpec(str(root), keep_last=3))
    proven = {}
    for i in range(1, 30):
        step(rep)
        assert per.submit(rep)
        if i % 10 == 0:  # the trainer's fingerprints at this step matched the replica's
            proven[i] = rep.fingerprints(optimizer=True)
            per.mark_verified(i, proven[i])
    assert per.flush(30)
    names = [p.name for _, p in ckptdir.committed(root)]
    assert names == ["step-00000020", "step-00000027", "step-00000028", "step-00000029"]
    assert ckptdir.verification(root / "step-00000020")["fingerprints"] == proven[20]
    per.quarantine_after(reason="drift at step 30")  # after the last verified step, 20
    assert per.flush(30)
    assert [p.name for _, p in ckptdir.committed(root)] == ["step-00000020"]
    assert ckptdir.latest(root) == root / "step-00000020"
    assert [s for s, _ in ckptdir.quarantined(root)] == [27, 28, 29] and per.stats.quarantined == 3
    assert verify(root / "quarantine" / "step-00000029").ok  # kept intact, only out of the way
    assert read_state(root).iterations_done == 20  # what RESTORE from disk serves
    # after a resync the persister commits again, and the proven checkpoint still outlives pruning
    for _ in range(5):
        step(rep)
        assert per.submit(rep, force=True)
    per.close()
    assert [s for s, _ in ckptdir.committed(root)] == [20, 32, 33, 34]
    assert verify(root / "step-00000020").ok


def test_restore_prefers_verified_and_says_why(tmp_path):
    root = tmp_path / "root"
    rep = replica(A)
    with Persister(PersistSpec(str(root), keep_last=5)) as per:
        for i in range(1, 5):
            step(rep)
            per.submit(rep)
            if i == 2:
                per.mark_verified(2, rep.fingerprints(optimizer=True))
    sel = select(root, verify_data=True)
    assert sel.step == 2 and not sel.problems and not sel.short
    assert "proven equal to the trainer" in sel.reason
    assert any("step-00000004 is newer but not verified" in n for n in sel.notes)
    res = CliRunner().invoke(restore_cmd, [str(root), "--verify"])
    assert res.exit_code == 0 and "step-00000002" in res.output and "proven equal" in res.output
    res = CliRunner().invoke(restore_cmd, [str(root), "--verify", "--newest"])
    assert res.exit_code == 0 and "step-00000004" in res.output
    # a verified checkpoint whose data no longer has the fingerprints it was proven by
    m = json.loads((root / "step-00000002" / "manifest.json").read_text())
    from mirrorckpt.updater.manifest import set_verified

    v = m["verified"]
    v["fingerprints"]["model.p0"] += 1
    set_verified(root / "step-00000002", v)
    assert "fingerprint differs" in verify(root / "step-00000002").first_problem


# ---------------------------------------------------------------- restore reports every problem

def test_restore_reports_dangling_latest_and_a_corrupt_newest(tmp_path):
    root = tmp_path / "root"
    job_a_root(root, steps=4, keep=4)
    (root / "latest").write_text("step-00000009\n")  # names a checkpoint that is not there
    d = root / "step-00000004" / "__0_0.distcp"
    b = bytearray(d.read_bytes())
    b[100] ^= 1
    d.write_bytes(bytes(b))  # same size: only hashing sees it
    res = CliRunner().invoke(restore_cmd, [str(root), "--verify"])
    assert res.exit_code == 1
    assert "latest names step-00000009, which does not exist (dangling pointer)" in res.stderr
    assert "step-00000004/__0_0.distcp: sha256 does not match the manifest" in res.stderr
    assert "checkpoint  " + str(root / "step-00000003") in res.output
    assert "NOT NEWEST  step 9 is named in this root but cannot be given; step 3" in res.output
    out = json.loads(CliRunner().invoke(restore_cmd, [str(root), "--verify", "--json"]).stdout)
    assert not out["ok"] and out["step"] == 3 and out["newest"] == 9 and len(out["problems"]) == 2


@pytest.mark.parametrize("damage", ["torn latest", "missing manifest", "truncated distcp"])
def test_each_kind_of_damage_is_detected(tmp_path, damage):
    root = tmp_path / "root"
    job_a_root(root, steps=3, keep=3)
    newest = root / "step-00000003"
    if damage == "torn latest":
        (root / "latest").write_bytes(b"step-000")
        want = "latest: torn or not a pointer"
    elif damage == "missing manifest":
        (newest / "manifest.json").unlink()
        want = "step-00000003: not an intact checkpoint:"
    else:
        f = newest / "__0_0.distcp"
        os.truncate(f, f.stat().st_size - 7)
        want = "__0_0.distcp: " + str(f.stat().st_size)
    res = CliRunner().invoke(restore_cmd, [str(root)])  # even without --verify
    assert res.exit_code == 1 and want in res.stderr, res.output
    given = 3 if damage == "torn latest" else 2
    assert f"step-0000000{given}" in res.output.splitlines()[0]
    assert read_state(root).iterations_done == given  # and a loader takes the intact one


# ---------------------------------------------------------------- full disk

def test_full_disk_during_commit_keeps_the_previous_checkpoint(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    rep = replica(layout_of((256, 256), (256,)))  # ~0.8 MB per checkpoint
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(mnt)], check=True)
    try:
        root = mnt / "root"
        with Persister(PersistSpec(str(root), keep_last=1)) as per:
            step(rep)
            assert per.submit(rep) and per.flush(30)
            assert per.stats.committed == 1
            step(rep)
            assert per.submit(rep) and per.flush(30)  # the second does not fit beside the first
        assert per.stats.failed == 1 and "bytes free on the filesystem: full?" in per.stats.last_error
        assert ckptdir.latest(root) == root / "step-00000001" and verify(root / "step-00000001").ok
        assert not [p for p in root.iterdir() if p.name.startswith(".partial")]
        res = CliRunner().invoke(restore_cmd, [str(root), "--verify"])
        assert res.exit_code == 0, res.output
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)  # lazy: even if a test failure left a file open


def test_a_quarantine_cut_short_is_hidden_at_once_and_finished_on_start(tmp_path, monkeypatch):
    from mirrorckpt.updater.persist import recover

    root = tmp_path / "root"
    job_a_root(root, steps=5, keep=5)
    real, moved = os.rename, []

    def killed_after_one(a, b):
        if moved:
            raise OSError("killed")
        moved.append(a)
        real(a, b)

    monkeypatch.setattr(ckptdir.os, "rename", killed_after_one)
    with pytest.raises(OSError, match="killed"):
        ckptdir.quarantine(root, 2, "drift at step 6")
    monkeypatch.undo()
    assert (root / "latest").read_text() == "step-00000005\n" and (root / "step-00000004").is_dir()
    assert [s for s, _ in ckptdir.committed(root)] == [1, 2]  # the journal hides what it lists
    assert ckptdir.latest(root) == root / "step-00000002" and read_state(root).iterations_done == 2
    recover(root)  # a restarted appliance finishes it
    assert [s for s, _ in ckptdir.quarantined(root)] == [3, 4, 5] and not (root / "quarantine.pending").exists()
    assert (root / "latest").read_text() == "step-00000002\n"
    log = [json.loads(x) for x in (root / "quarantine" / "log.jsonl").read_text().splitlines()]
    assert log == [{"after": 2, "steps": ["step-00000003", "step-00000004", "step-00000005"],
                    "reason": "drift at step 6"}]


def test_persistence_outcomes_are_exported_and_shown_by_status(tmp_path):
    from mirrorckpt.tools.cmd_status import render
    from mirrorckpt.tools.metrics import Metrics
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    def shown(metrics):
        out: dict = {}
        for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
            for s in fam.samples:
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return render(out)

    job_a_root(tmp_path / "other")
    per = Persister(PersistSpec(str(tmp_path / "other"), memory_budget_bytes=1000))
    metrics = Metrics()
    metrics.follow_persister(lambda: per)
    other = replica(B)
    step(other)
    per.submit(other)  # refused: another job's root
    text = shown(metrics)
    assert "persistence: REFUSED" in text and "checkpoint directory of another job" in text
    per.close()
    per = Persister(PersistSpec(str(tmp_path / "mine"), memory_budget_bytes=100))
    per.submit(other)  # larger than the budget: written while the replica waited
    per.close()
    text = shown(metrics)
    assert "persistence: 1 committed, 0 failed, 1 written unstaged (over memory_budget_bytes" in text
