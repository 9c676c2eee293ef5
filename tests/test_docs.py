"""The docs' commands run as written: every ```sh test block of docs/*.md (```sh test-netns: in a network
namespace of its own that has eth0 (192.0.2.1/24), eth1 and eth9, as the commands name them), the systemd unit
(checked by systemd-analyze, then its ExecStart started, asked for its status, and stopped with
its KillSignal) and the container recipe's entry point and health check against that appliance."""

from __future__ import annotations

import configparser
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from common import REPO
from mirrorckpt.tools.testbed.harness import free_port

DOCS = REPO / "docs"
BIN = Path(sys.executable).parent
BLOCK = re.compile(r"^```sh (test|test-netns)\n(.*?)^```", re.S | re.M)


def blocks() -> list[tuple[str, int, str, bool]]:
    """(page, line, script, in a namespace of its own) of every tested block."""
    out = []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        for m in BLOCK.finditer(text):
            out.append((page.name, text[:m.start()].count("\n") + 1, m.group(2), m.group(1) == "test-netns"))
    return out


def test_the_docs_have_tested_blocks():
    assert {page for page, *_ in blocks()} >= {"deploy.md", "replay.md", "mirrors.md"}


@pytest.mark.parametrize("page, line, script, netns", blocks(), ids=lambda x: str(x)[:40])
def test_a_docs_block_runs(tmp_path, page, line, script, netns):
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}")
    argv = ["bash", "-euo", "pipefail", "-c", script]
    name = f"docs{os.getpid()}"
    if netns:
        if os.geteuid() != 0:
            pytest.fail("needs root (a network namespace); CI runs it as root")
        subprocess.run(["ip", "netns", "add", name], check=True)
        setup = ["ip link add eth0 type veth peer name eth0p", "ip link add eth1 type veth peer name eth1p",
                 "ip link add eth9 type veth peer name eth9p", "ip addr add 192.0.2.1/24 dev eth0",
                 *(f"ip link set {i} up" for i in ("lo", "eth0", "eth0p", "eth1", "eth1p", "eth9", "eth9p"))]
        for cmd in setup:
            subprocess.run(["ip", "netns", "exec", name, *cmd.split()], check=True)
        argv = ["ip", "netns", "exec", name, *argv]
    try:
        r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    finally:
        if netns:
            subprocess.run(["ip", "netns", "del", name], check=False)
    assert r.returncode == 0, f"docs/{page}:{line}:\n{script}\n{r.stdout[-2000:]}{r.stderr[-2000:]}"


def unit() -> configparser.ConfigParser:
    c = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    c.optionxform = str
    c.read(DOCS / "deploy" / "mirrorckpt@.service")
    return c


def job_file(tmp: Path, control: int, metrics: int) -> Path:
    (tmp / "secret").write_text("docs-test-secret-0123456789abcdef")
    path = tmp / "docs.toml"
    path.write_text(f"""
[ring]
nranks = 2
addresses = ["10.0.0.1", "10.0.0.2"]

[job]
kind = "ddp"

[[mirror]]
rank = 0
source = "afpacket:lo"

[control]
listen = "127.0.0.1:{control}"
secret_file = "{tmp / 'secret'}"

[metrics]
listen = "127.0.0.1:{metrics}"
""")
    return path


def test_the_systemd_unit_and_the_container_recipe_start_the_appliance(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("needs root (AF_PACKET on lo); CI runs it as root")
    u = unit()
    svc = u["Service"]
    assert svc["Restart"] == "on-failure" and svc["KillSignal"] == "SIGTERM" and svc["Type"] == "exec"
    job = job_file(tmp_path, free_port(), free_port())
    # the unit as installed: its binary is this test's, its instance this job
    exec_start = svc["ExecStart"].replace("/opt/mirrorckpt/bin/", f"{BIN}/").replace(
        "/etc/mirrorckpt/%i.toml", str(job))
    text = (DOCS / "deploy" / "mirrorckpt@.service").read_text().replace(svc["ExecStart"], exec_start)
    (tmp_path / "mirrorckpt@docs.service").write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "mirrorckpt@docs.service")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "mirrorckpt@docs.service" not in r.stderr, r.stderr
    serve = subprocess.Popen(shlex.split(exec_start), stderr=subprocess.PIPE, text=True)
    status = [str(BIN / "mirrorckpt"), "status", "--config", str(job)]
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            st = subprocess.run(status, capture_output=True, text=True, timeout=60)
            if st.returncode != 1:
                break
            assert serve.poll() is None, serve.stderr.read()
            time.sleep(0.5)
        # up, and not protected (no trainer): said first, exit 3
        assert st.returncode == 3 and st.stdout.startswith("NOT PROTECTED: no trainer has registered"), st
        health = container_health(job)
        r = subprocess.run(["sh", "-c", health], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}"))
        assert r.returncode == 0, (health, r.stdout, r.stderr)
        serve.send_signal(getattr(signal, svc["KillSignal"]))
        rc = serve.wait(timeout=int(svc["TimeoutStopSec"]))
        assert rc == 0, (rc, serve.stderr.read()[-4000:])  # no restart after a stop
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    # a job file that cannot be served exits non-zero: Restart=on-failure brings the daemon back
    bad = subprocess.run(shlex.split(exec_start.replace(str(job), str(tmp_path / "missing.toml"))),
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "error:" in bad.stderr.lower()


def container_health(job: Path) -> str:
    """The Containerfile's health check for this job file; its entry point is the installed CLI."""
    text = (DOCS / "deploy" / "Containerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["mirrorckpt"\]$', text, re.M)
    assert re.search(r'^CMD \["serve", "--config", "/etc/mirrorckpt/job.toml"\]$', text, re.M)
    assert re.search(r"^COPY \. /src/mirrorckpt$", text, re.M) and (REPO / "pyproject.toml").is_file()
    health = re.search(r"^HEALTHCHECK .*? CMD (.+)$", text, re.M).group(1)
    return health.replace("/etc/mirrorckpt/job.toml", str(job))
