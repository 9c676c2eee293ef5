"""`mirrorckpt serve` before it starts and around it (issue 14): an afpacket:IFACE@NETNS source is
looked up in its namespace, another job's checkpoint root and half a TLS configuration stop it
with exit 2 and nothing touched, serving without [persist] says it commits nothing, and the
control plane of a serve with [control] tls_* speaks mutual TLS only."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import common
import pytest
from click.testing import CliRunner
from mirrorckpt.config.jobfile import load_job
from mirrorckpt.control import messages as m
from mirrorckpt.control import tls
from mirrorckpt.control.endpoint import ControlClient
from mirrorckpt.tools.cli import main
from mirrorckpt.tools.cmd_serve import check_sources
from mirrorckpt.tools.testbed.harness import free_port

DEMO = common.PCAPS / "demo"
SECRET = b"serve-preflight-secret-0123456789"


def demo_config(tmp: Path, text_after: str = "", **replace) -> Path:
    text = (DEMO / "job.toml").read_text().replace('source = "', f'source = "{DEMO}/')
    for a, b in replace.items():
        text = text.replace(a, b)
    p = tmp / "serve.toml"
    p.write_text(text + text_after)
    return p


@pytest.fixture
def netns():
    name = f"mck-pf-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "add", "cap0", "type", "veth", "peer", "name", "cap1"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)


def test_afpacket_iface_at_netns_is_looked_up_in_its_namespace(tmp_path, netns):
    def problems(source):
        job = load_job(demo_config(tmp_path))
        job.mirrors = [dataclasses.replace(job.mirrors[0], source=source)]
        return check_sources(job)

    assert problems(f"afpacket:cap0@{netns}") == []  # the documented form (refused before)
    assert problems("afpacket:cap0") == ["[[mirror]] #1 source: interface 'cap0' does not exist"]  # not here
    assert problems(f"afpacket:nope0@{netns}") == [
        f"[[mirror]] #1 source: interface 'nope0' does not exist in network namespace '{netns}'"]
    assert "no network namespace 'no-such-ns'" in problems("afpacket:cap0@no-such-ns")[0]
    assert "expected IFACE or IFACE@NETNS" in problems("afpacket:cap0@")[0]


def tree(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
            for p in sorted(root.rglob("*"))}


def test_serve_refuses_another_jobs_root_before_starting(tmp_path):
    from test_ckptdir import job_a_root

    job_a_root(tmp_path / "other", steps=3)  # another model's checkpoints
    before = tree(tmp_path / "other")
    cfg = demo_config(tmp_path, f'\n[persist]\ndirectory = "{tmp_path / "other"}"\n')
    res = subprocess.run([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "checkpoint directory of another job: its model differs" in res.stderr
    assert "nothing was written" in res.stderr
    assert tree(tmp_path / "other") == before


def test_half_a_tls_configuration_is_an_error(tmp_path):
    c = common.make_certs(tmp_path)
    (tmp_path / "secret").write_bytes(SECRET)
    cfg = demo_config(tmp_path, f'\n[control]\nlisten = "127.0.0.1:0"\nsecret_file = "{tmp_path / "secret"}"\n'
                                f'tls_cert = "{c["appliance_cert"]}"\ntls_key = "{c["appliance_key"]}"\n')
    res = CliRunner().invoke(main, ["serve", "--config", str(cfg)])
    assert res.exit_code == 2 and "TLS needs tls_cert, tls_key and tls_ca together" in res.stderr
    cfg.write_text(cfg.read_text() + f'tls_ca = "{tmp_path / "missing.pem"}"\n')
    res = CliRunner().invoke(main, ["serve", "--config", str(cfg)])
    assert res.exit_code == 2 and "tls_ca: No such file or directory" in res.stderr


def logs(stderr: str) -> list[dict]:
    return [json.loads(x) for x in stderr.splitlines() if x.startswith("{")]


def test_serve_without_persist_says_it_commits_nothing(tmp_path):
    cfg = demo_config(tmp_path)
    res = subprocess.run([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    warned = [x["msg"] for x in logs(res.stderr) if x["level"] == "warning"]
    assert any("no [persist] table" in w and "no checkpoint is ever committed" in w for w in warned), warned


def test_serve_says_each_stages_cpu_time(tmp_path):
    """At the end, the CPU seconds of every stage's thread: what tells an operator which stage
    limits a port (and whether more workers would help)."""
    cfg = demo_config(tmp_path)
    t = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - t
    assert res.returncode == 0, res.stderr[-2000:]
    cpu = [x for x in logs(res.stderr) if x["msg"] == "stage CPU seconds"][-1]
    ports = [str(k) for k in range(len(load_job(cfg).mirrors))]
    assert sorted(cpu["capture"]) == sorted(cpu["decode"]) == ports
    for v in [cpu["capture"][k] for k in ports] + [cpu["decode"][k] for k in ports] + [cpu["parser"], cpu["updater"]]:
        assert 0 < v < wall
    # the daemon's threads are part of its process (which also loaded torch and the job)
    assert cpu["parser"] + cpu["updater"] < cpu["daemon_process"]


def test_serve_sets_the_updaters_torch_threads(tmp_path):
    """[updater] threads reaches torch in the serve process (the default is covered in test_jobfile)."""
    cfg = demo_config(tmp_path, "\n[updater]\nthreads = 3\n")
    res = subprocess.run([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "updater: 3 torch thread(s)" in [x["msg"] for x in logs(res.stderr)]


def test_serve_control_plane_is_mutual_tls(tmp_path):
    c = common.make_certs(tmp_path)
    (tmp_path / "secret").write_bytes(SECRET)
    port = free_port()
    cfg = demo_config(tmp_path, f'\n[control]\nlisten = "127.0.0.1:{port}"\nsecret_file = "{tmp_path / "secret"}"\n'
                                f'tls_cert = "{c["appliance_cert"]}"\ntls_key = "{c["appliance_key"]}"\n'
                                f'tls_ca = "{c["ca"]}"\n')
    proc = subprocess.Popen([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", str(cfg),
                             "--pace", "0.0005"], stderr=subprocess.PIPE, text=True)
    try:
        assert common.wait_for(lambda: _listening(port), timeout=60), "the control plane never listened"
        with pytest.raises((ssl.SSLError, ConnectionError)):  # no client certificate: refused in the TLS handshake
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.load_verify_locations(c["ca"])
            with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5),
                                 server_hostname="localhost") as t:
                t.sendall(m.to_bytes(m.make(m.HELLO, role="trainer", nonce="00" * 32)))
                if not t.recv(1):
                    raise ConnectionError("closed")
        good = tls.client_context(c["trainer_cert"], c["trainer_key"], c["ca"])
        cli = ControlClient("127.0.0.1", port, SECRET, ssl_context=good, server_hostname="localhost")
        with cli:
            assert cli.wait_connected(20)  # TLS, then the HMAC handshake inside it
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    warned = [x["msg"] for x in logs(err) if x["level"] == "warning"]
    assert not any("without TLS" in w for w in warned)
    assert any("rejected" in w and "TLS" in w for w in warned), warned  # the client without a certificate


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        time.sleep(0.2)
        return False


PIPELINED = "\n[updater]\npipelined = true\n"


@pytest.fixture
def daemons(monkeypatch):
    """serve's Daemon, kept for the test to look at (serve's log handler and its SIGTERM/SIGINT
    handlers, which it leaves ignoring both, put back after)."""
    import logging

    from mirrorckpt.tools import serve as serve_mod

    made = []

    class Kept(serve_mod.Daemon):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(serve_mod, "Daemon", Kept)
    handlers = logging.getLogger("mirrorckpt").handlers[:]
    sigs = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield made
    logging.getLogger("mirrorckpt").handlers[:] = handlers
    for s, h in sigs.items():
        signal.signal(s, h)


@pytest.mark.parametrize("text, flags, want", [
    ("", [], False), (PIPELINED, [], True), (PIPELINED, ["--no-pipelined"], False), ("", ["--pipelined"], True)])
def test_pipelined_switch_reaches_the_appliance(tmp_path, monkeypatch, daemons, text, flags, want):
    """[updater] pipelined in the job file, overridden by --pipelined/--no-pipelined, is the
    serve appliance's: its buckets are stepped as they arrive (the demo job: one bucket in the
    first iteration, two after DDP's rebuild), or not at all."""
    from mirrorckpt.updater.replica import Replica

    stepped = []
    real = Replica.apply_bucket
    monkeypatch.setattr(Replica, "apply_bucket", lambda self, *a, **kw: stepped.append(a[:2]) or real(self, *a, **kw))
    res = CliRunner().invoke(main, ["serve", "--config", str(demo_config(tmp_path, text))] + flags)
    assert res.exit_code == 0, res.output[-2000:]
    (d,) = daemons
    assert d.appliance.pipelined is want
    assert d.appliance.summary.iterations_applied == 10
    assert len(stepped) == (1 + 9 * 2 if want else 0)


def test_pipelined_with_a_control_plane_is_an_error(tmp_path, daemons):
    (tmp_path / "secret").write_bytes(SECRET)
    control = f'\n[control]\nlisten = "127.0.0.1:0"\nsecret_file = "{tmp_path / "secret"}"\n'
    for text, flags in ((PIPELINED + control, []), (control, ["--pipelined"])):
        res = CliRunner().invoke(main, ["serve", "--config", str(demo_config(tmp_path, text))] + flags)
        assert res.exit_code == 2 and "pipelined (or --pipelined) cannot be used with [control]" in res.stderr
    assert not daemons
