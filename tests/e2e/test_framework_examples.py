"""examples/lightning_example.py and examples/hf_example.py as a user runs them (torchrun, 2 gloo
ranks, the framework's default scheduler and clipping) against ``mirrorckpt serve --control-only``:
serve asks a fallback every 4 steps and commits it; the job is killed (SIGKILL) once a checkpoint
is committed, and a run with --restore resumes from the appliance bit-exactly: on every rank the
restored state and every step both runs took agree (parameters and optimizer state, lr, epoch,
data, RNG)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import common
import pytest
from mirrorckpt.tools.testbed.harness import free_port

SECRET = "framework-examples-secret-0123456789"
NEED = "the frameworks extra is not installed: pip install -e '.[frameworks]'"


@pytest.fixture
def serve(tmp_path):
    """``serve --control-only`` on a free port, committing to tmp_path/ckpt; yields (port, ckpt)."""
    port = free_port()
    (tmp_path / "secret").write_text(SECRET + "\n")
    job = tmp_path / "job.toml"
    job.write_text(f'[ring]\nnranks = 2\n[control]\nlisten = "127.0.0.1:{port}"\nsecret_file = "{tmp_path}/secret"\n'
                   f'[persist]\ndirectory = "{tmp_path}/ckpt"\n[protection]\nfallback_every = 4\n')
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", str(job),
                             "--control-only", "--log-format", "text"], stdout=log, stderr=subprocess.STDOUT)
    try:
        assert common.wait_for(lambda: "control plane listening" in (tmp_path / "serve.log").read_text(), 30), \
            (tmp_path / "serve.log").read_text()[-2000:]
        yield port, tmp_path / "ckpt"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def torchrun(tmp_path, script: str, port: int, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), str(common.REPO / "examples" / script),
                             "--appliance", f"127.0.0.1:{port}", "--secret-file", str(tmp_path / "secret"), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, cwd=tmp_path)


def rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def committed(ckpt) -> int:
    steps = [int(p.name.split("-")[1]) for p in ckpt.glob("step-*")] if ckpt.exists() else []
    return max(steps, default=0)


def kill_after_a_commit(proc, ckpt, digests) -> int:
    """SIGKILL the job two steps after serve committed a checkpoint; the committed step."""
    def ready():
        done = rows(digests)
        return committed(ckpt) and done and done[-1]["step"] >= committed(ckpt) + 2
    try:
        assert common.wait_for(lambda: ready() or proc.poll() is not None, 120)
        assert proc.poll() is None, "the job ended before it was killed: " + proc.stdout.read()[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    return committed(ckpt)


@pytest.mark.parametrize("script, module", [("lightning_example.py", "pytorch_lightning"),
                                            ("hf_example.py", "transformers")])
def test_a_framework_example_is_killed_and_resumed_from_serve_control_only(serve, tmp_path, script, module):
    pytest.importorskip(module, reason=NEED)
    port, ckpt = serve
    first = torchrun(tmp_path, script, port, "--steps", "16", "--step-delay", "0.2", "--digests",
                     str(tmp_path / "first"))
    step = kill_after_a_commit(first, ckpt, tmp_path / "first.0")
    assert step >= 4
    assert "checkpoint committed" in (tmp_path / "serve.log").read_text()
    again = torchrun(tmp_path, script, port, "--steps", "16", "--restore", "--digests", str(tmp_path / "again"))
    out, _ = again.communicate(timeout=150)
    assert again.returncode == 0, out[-3000:]
    assert "trained to step 16" in out, out[-3000:]
    for rank in (0, 1):
        before = {r["step"]: r for r in rows(tmp_path / f"first.{rank}")}
        after = rows(tmp_path / f"again.{rank}")
        restored = after[0]
        assert restored["step"] >= step and restored["step"] in before, (restored, sorted(before))
        assert f"restored step {restored['step']} from appliance 127.0.0.1:{port}" in out, out[-3000:]
        keys = ("state", "lr", "rng")  # the restored row is written before any batch or epoch counts
        assert {k: restored[k] for k in keys} == {k: before[restored["step"]][k] for k in keys}, rank
        overlap = [r for r in after[1:] if r["step"] in before]
        assert overlap, "no step taken by both runs: nothing compared"
        for r in overlap:
            assert r == before[r["step"]], (rank, r["step"])
