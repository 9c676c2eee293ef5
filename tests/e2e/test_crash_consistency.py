"""SIGKILL a persisting process at random points, many times, on one checkpoint root.

A driver process imports torch once and forks one child per trial. The child does what a restarted
appliance does (take the root's lock, recover, resume the replica from `latest`), then trains and
submits a snapshot every iteration while the writer thread commits them; it is SIGKILLed after a
random delay of a few milliseconds. Every third step it also marks the checkpoint verified (a
manifest rewrite), as the control plane does when the trainer's fingerprints match. After every
kill `latest` must name a checkpoint that passes full verification, holds exactly the state of
that many deterministic iterations, and is never older than the one before; no directory with a
final name is ever torn; the newest verified checkpoint is never pruned; and restore (``select``,
what `mirrorckpt restore --verify` runs) finds no problem."""

from __future__ import annotations

import json
import random
import subprocess
import sys

from mirrorckpt.updater import ckptdir
from mirrorckpt.updater.manifest import MANIFEST_TMP, quick_check, read_manifest, tensor_sha256
from mirrorckpt.updater.persist import recover
from mirrorckpt.updater.restore import latest, select, verify

TRIALS = 100
KEEP = 3

SETUP = r'''
import numpy as np, torch
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec
from mirrorckpt.config.training import OptimizerSpec, TrainingSpec
from mirrorckpt.parser.iteration import ReducedIteration

# about 82 k parameters: ~1 MB of Adam state
BUCKETS = [BucketSpec((2, 1)), BucketSpec((0,))]
LAYOUT = JobLayout([ParamSpec("enc.weight", (256, 256)), ParamSpec("enc.bias", (256,)),
                    ParamSpec("dec.weight", (64, 256))], BUCKETS, first_buckets=BUCKETS)
TRAINING = TrainingSpec(optimizer=OptimizerSpec("adamw", lr=1e-3, weight_decay=0.01))

def initial():
    g = torch.Generator().manual_seed(0)
    return {p.name: torch.randn(p.shape, generator=g) for p in LAYOUT.params}

def iteration(i):
    rng = np.random.default_rng(1000 + i)
    return ReducedIteration(i, [rng.standard_normal(LAYOUT.bucket_count(b)).astype(np.float32)
                                for b in LAYOUT.bucket_list(i)])
'''

DRIVER = SETUP + r'''
import json, os, signal, sys, time
from mirrorckpt.config.training import PersistSpec
from mirrorckpt.updater.persist import Persister
from mirrorckpt.updater.replica import Replica
from mirrorckpt.updater.restore import latest
from mirrorckpt.updater.ckptdir import dcp_module

ROOT, KEEP = sys.argv[1], int(sys.argv[2])

# Warm up once here, single-threaded (no OpenMP pool to break across fork): DCP, torch.optim and
# torch.save import lazily on first use, and every forked child would pay that again.
import tempfile
from mirrorckpt.updater.persist import write_checkpoint
torch.set_num_threads(1)
dcp_module()
with tempfile.TemporaryDirectory() as scratch:
    warm = Replica(LAYOUT, TRAINING, initial())
    warm.apply(iteration(0))
    warm.resync(write_checkpoint(scratch, warm.state_dict_for_checkpoint()))
del warm

def child(w):
    # A prune's window (renamed .deleting-*, not yet removed) is far shorter than a commit's: held
    # open 3 ms so that enough random kills land inside it on a fast or a loaded machine alike.
    import shutil
    rmtree = shutil.rmtree
    def slow_prune(path, *a, **k):
        if os.path.basename(str(path)).startswith(".deleting-"):
            time.sleep(0.003)
        return rmtree(path, *a, **k)
    shutil.rmtree = slow_prune
    per = Persister(PersistSpec(ROOT, every_iterations=1, keep_last=KEEP, memory_budget_bytes=3 << 20))
    found = latest(ROOT)
    rep = Replica(LAYOUT, TRAINING, initial())
    if found is not None:
        rep.resync(found)
    os.write(w, b"ready\n")
    i = rep.iterations_done
    while True:
        rep.apply(iteration(i))
        per.submit(rep)
        i += 1
        if i % 3 == 0:
            per.mark_verified(i, rep.fingerprints(optimizer=True))
        if per.stats.failed:
            os.write(w, ("failed " + per.stats.last_error + "\n").encode())
            os._exit(3)
        time.sleep(0.001)

for line in sys.stdin:
    mode, delay = line.split()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            child(w)
        finally:
            os._exit(4)
    os.close(w)
    if mode == "after-ready":
        ready = os.read(r, 6)
    time.sleep(float(delay))
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    said = b""
    while True:
        b = os.read(r, 4096)
        if not b:
            break
        said += b
    os.close(r)
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    print(json.dumps({"killed": os.WIFSIGNALED(status), "exit": code, "said": said.decode(errors="replace")}),
          flush=True)
'''


def leftovers(root):
    names = [p.name for p in root.iterdir()]
    return {
        "partial": any(n.startswith(ckptdir.PARTIAL) for n in names),
        "deleting": any(n.startswith(ckptdir.DELETING) for n in names),
        "pointer_tmp": any(n.startswith(ckptdir.POINTER_TMP) for n in names),
        "manifest_tmp": any((d / MANIFEST_TMP).exists() for _, d in ckptdir.step_dirs(root)),
    }


def newest_verified(root) -> int:
    return max((s for s, d in ckptdir.committed(root) if ckptdir.verification(d) is not None), default=-1)


def test_sigkill_during_persisting_never_leaves_latest_torn(tmp_path):
    root = tmp_path / "root"
    ns: dict = {}
    exec(SETUP, ns)  # the same layout, training and gradients as the child
    from mirrorckpt.updater.replica import Replica

    ref = Replica(ns["LAYOUT"], ns["TRAINING"], ns["initial"]())
    expected = {0: None}

    def model_shas(step):
        while ref.iterations_done < step:
            ref.apply(ns["iteration"](ref.iterations_done))
            expected[ref.iterations_done] = {f"model.{n}": tensor_sha256(p) for n, p in zip(ref.names, ref.params)}
        return expected[step]

    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(root), str(KEEP)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, bufsize=1)
    rnd = random.Random(12345)
    seen = {"partial": 0, "deleting": 0, "pointer_tmp": 0, "manifest_tmp": 0, "pointer_lag": 0}
    prev = prev_verified = -1
    try:
        for trial in range(TRIALS):
            if rnd.random() < 0.2:  # during start-up: lock, recover, resume
                mode, delay = "from-fork", rnd.uniform(0.0, 0.15)
            else:  # while training and writing
                mode, delay = "after-ready", rnd.uniform(0.0, 0.12)
            driver.stdin.write(f"{mode} {delay:.4f}\n")
            driver.stdin.flush()
            res = json.loads(driver.stdout.readline())
            where = f"trial {trial} ({mode} {delay * 1000:.1f} ms)"
            assert res["killed"], f"{where}: the child was not killed: {res}"
            assert "failed" not in res["said"], f"{where}: {res['said']}"

            for k, v in leftovers(root).items():
                seen[k] += v
            pointed = ckptdir.read_pointer(root)
            if pointed is not None:  # the pointer names a committed checkpoint, always
                assert quick_check(pointed) is None, f"{where}: latest -> {pointed.name}: {quick_check(pointed)}"
            for _, d in ckptdir.step_dirs(root):  # a final name is only ever given to a complete checkpoint
                assert quick_check(d) is None, f"{where}: {d.name}: {quick_check(d)}"
            assert len(ckptdir.step_dirs(root)) <= KEEP + 2  # + the newest verified one
            assert newest_verified(root) >= prev_verified, f"{where}: the newest verified checkpoint was pruned"
            prev_verified = newest_verified(root)
            found = latest(root)
            if found is None:
                assert prev == -1, f"{where}: checkpoints were committed before, none is found now"
                continue
            seen["pointer_lag"] += pointed != found
            step = ckptdir.parse_step(found.name)
            assert step >= prev, f"{where}: latest went back from {prev} to {step}"
            prev = step
            report = verify(found)
            assert report.ok, f"{where}: {report.first_problem}"
            sel = select(root, verify_data=trial % 10 == 0)
            assert not sel.problems and not sel.short and sel.path is not None, f"{where}: {sel.problems}"
            tensors = read_manifest(found)["tensors"]
            assert {k: tensors[k]["sha256"] for k in model_shas(step)} == model_shas(step), \
                f"{where}: {found.name} does not hold the state of {step} iterations"
    finally:
        driver.stdin.close()
        driver.wait(timeout=60)
    assert prev > 0 and prev_verified > 0
    # the kills did land inside writes and prunes; start-up recovery then clears what they left
    assert seen["partial"] >= 10 and seen["deleting"] >= 1, seen
    info = recover(root)
    assert not any(leftovers(root).values())
    assert info["latest"] == latest(root) and ckptdir.read_pointer(root) == latest(root)
    print("kills left:", seen, "latest step:", prev)
