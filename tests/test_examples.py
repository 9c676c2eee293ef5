"""The examples/ scripts, as a user runs them (torchrun, 2 gloo ranks), against an in-process
appliance plane that asks for a fallback: the checkpoint verifies against the job's fingerprints,
and a second run with --restore resumes from the appliance at the step it holds."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading

import common
from mirrorckpt.control.appliance_side import AppliancePlane
from mirrorckpt.tools.testbed.harness import free_port

SECRET = "examples-secret-0123456789abcdef"
wait_for = functools.partial(common.wait_for, timeout=60.0)


def torchrun(script: str, secret_file, port: int, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), str(common.REPO / "examples" / script),
                             "--appliance", f"127.0.0.1:{port}", "--secret-file", str(secret_file), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(proc: subprocess.Popen, timeout: float = 150):
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_the_ddp_example_is_protected_by_a_fallback_and_resumes_from_the_appliance(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    plane = AppliancePlane(SECRET, parts=2, fingerprint_every=5, fallback_timeout=60).start()
    asked = threading.Thread(target=lambda: wait_for(lambda: plane.replica is not None)
                             and plane.request_fallback("example test"), daemon=True)
    asked.start()
    try:
        first = torchrun("ddp_example.py", secret, plane.port, "--steps", "30")
        out, _ = finished(first)
        assert first.returncode == 0, out[-3000:]
        assert plane.stats.fallbacks_done == 1 and plane.stats.fallbacks_failed == 0, (plane.stats, out[-2000:])
        held = plane.replica.iterations_done
        assert 0 < held <= 30
        again = torchrun("ddp_example.py", secret, plane.port, "--steps", "3", "--restore")
        out, _ = finished(again)
        assert again.returncode == 0, out[-3000:]
        assert f"restored step {held} from appliance 127.0.0.1:{plane.port}" in out, out[-3000:]
        assert f"trained to step {held + 3}" in out
    finally:
        plane.stop()
