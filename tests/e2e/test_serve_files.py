"""`mirrorckpt serve` on generated mirror captures (file sources): bit-exact replica, metrics and
status while running, clean stop on SIGTERM, and back-pressure that drops instead of corrupting."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mirrorckpt.config.jobfile import load_job
from mirrorckpt.config.training import OptimizerSpec, PersistSpec, TrainingSpec
from mirrorckpt.tools.generator.gen import GenConfig, generate
from mirrorckpt.tools.metrics import Metrics
from mirrorckpt.tools.serve import Daemon
from mirrorckpt.tools.testbed.harness import free_port
from mirrorckpt.updater import restore
from mirrorckpt.updater.replica import Replica

STEPS = 8


def _generate(d, steps):
    generate(GenConfig(ranks=3, channels=2, model="mlp:32,64,16,4", steps=steps, seed=3,
                       training=TrainingSpec(optimizer=OptimizerSpec(name="adam", lr=1e-2)),
                       mirrors="0:egress,1:egress"), d)
    return d


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory):
    return _generate(tmp_path_factory.mktemp("gen"), STEPS)


@pytest.fixture(scope="module")
def long_job_dir(tmp_path_factory):
    return _generate(tmp_path_factory.mktemp("gen_long"), 40)


def config(job_dir: Path, tmp: Path, persist_every: int | None = None, workers: int = 1, **extra) -> Path:
    text = (job_dir / "job.toml").read_text()
    text = text.replace('source = "', f'source = "{job_dir}/')
    if workers > 1:
        text = text.replace('direction = "egress"', f'direction = "egress"\nworkers = {workers}')
    text += f'\n[persist]\ndirectory = "{tmp / "ck"}"\nkeep_last = 2\n'
    if persist_every is not None:
        text += f"every_iterations = {persist_every}\n"
    for k, v in extra.items():
        text += f"\n[{k}]\n" + "".join(f'{a} = {json.dumps(b)}\n' for a, b in v.items())
    p = tmp / "serve.toml"
    p.write_text(text)
    return p


def truth(job_dir: Path) -> dict:
    return json.loads((job_dir / "truth.json").read_text())


def replica_sha(ckpt: Path, job) -> tuple[str, str]:
    from mirrorckpt.config.training import TrainingSpec as T

    r = Replica(job.layout, T.from_dict(job.training), restore.latest(ckpt))
    return r.state_sha256()


def serve_every_iteration_bit_exact(job_dir: Path, cfg: Path, ck: Path) -> None:
    """`mirrorckpt serve` to the end of the captures: every iteration applied, none incomplete,
    and the last committed replica is the trainer's."""
    res = subprocess.run([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    logs = [json.loads(line) for line in res.stderr.splitlines() if line.startswith("{")]
    stopped = [x for x in logs if x["msg"] == "appliance stopped"][-1]
    assert stopped["iterations_applied"] == STEPS and stopped["iterations_incomplete"] == 0
    want = truth(job_dir)["iterations"][-1]
    assert replica_sha(ck, load_job(cfg)) == (want["params_sha256"], want["optim_sha256"])


def test_serve_keeps_a_bit_exact_replica(job_dir, tmp_path):
    cfg = config(job_dir, tmp_path)
    serve_every_iteration_bit_exact(job_dir, cfg, tmp_path / "ck")
    assert restore.verify(restore.latest(tmp_path / "ck")).ok


@pytest.mark.parametrize("workers", [2, 3])
def test_serve_splits_a_port_over_workers_and_keeps_a_bit_exact_replica(job_dir, tmp_path, workers):
    """[[mirror]] workers = N: N capture processes share each port, each decoding the frames of its
    QP pairs (capture.fanout); every iteration is still reassembled and the replica is bit-exact."""
    import numpy as np
    from mirrorckpt.capture.pcapfile import read_all
    from mirrorckpt.parser.roce import split

    cfg = config(job_dir, tmp_path, workers=workers)
    job = load_job(cfg)
    assert [m.workers for m in job.mirrors] == [workers, workers]
    # the generated QP pairs fall into more than one share, as the workers deal them: the split is real
    shares = np.concatenate([split.worker_of(read_all(m.source), workers,
                                              split.plan(iter([read_all(m.source)]), workers)[0])
                             for m in job.mirrors])
    assert len(np.unique(shares)) > 1
    serve_every_iteration_bit_exact(job_dir, cfg, tmp_path / "ck")


QP_SPLITS = {  # how a connection uses 2 QPs -> (job, what the warning says)
    "cut": (dict(protocol="LL", nccl_version="2.18", model="mlp:600,64,8", seed=4), "cuts messages over several QPs"),
    "round_robin": (dict(protocol="Simple", nccl_version="2.23", model="mlp:300,128,16", seed=7), "workers > 1"),
}


@pytest.mark.parametrize("split", list(QP_SPLITS))
def test_workers_on_a_port_whose_connections_use_several_qps(tmp_path, split):
    """NCCL_IB_QPS_PER_CONNECTION = 2. Split by port, as a live port's kernel fanout does
    (``file_split = "port"``), a port's workers each see part of a connection: 2.18 cuts each
    message over both QPs, so its pieces land in different workers; 2.20+ sends whole messages
    round robin, so each worker has every other Simple message, which fits no channel's plan.
    Nothing can be reassembled (never wrong), and serve says why in a warning (the worker that sees
    cut messages; the parser for each connection it cannot place) instead of running on silently.
    A capture file's own split (the default) keeps each connection's QPs in one worker, found by
    the receive buffer (rkey) they write: two workers then follow the job bit-exactly, as one does."""
    from mirrorckpt.capture.pcapfile import read_all
    from mirrorckpt.parser.roce.split import flow_ports
    from mirrorckpt.tools.generator.wire import WireOptions

    job, says = QP_SPLITS[split]
    d = tmp_path / "gen"
    adam = TrainingSpec(optimizer=OptimizerSpec(name="adam", lr=1e-2))
    generate(GenConfig(ranks=3, channels=2, steps=3, training=adam, mirrors="0:egress,1:egress",
                       wire=WireOptions(qps_per_connection=2), **job), d)
    for workers, file_split in ((2, "port"), (2, "connection"), (1, "connection")):
        run = tmp_path / f"w{workers}_{file_split}"
        run.mkdir()
        cfg = config(d, run, workers=workers, capture={"file_split": file_split})
        if workers > 1:  # the connections' QPs do fall into different shares by port
            sport_of = [flow_ports(read_all(m.source)) for m in load_job(cfg).mirrors]
            assert any(len(set((sp[sp >= 0] % workers).tolist())) > 1 for sp in sport_of)
        res = subprocess.run([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", str(cfg)],
                             capture_output=True, text=True, timeout=300)
        # nothing reassembled is work that matched nothing: said, and a non-zero exit
        assert res.returncode == (1 if file_split == "port" else 0), res.stderr[-2000:]
        logs = [json.loads(x) for x in res.stderr.splitlines() if x.startswith("{")]
        warned = [x for x in logs if x["level"] == "warning" and says in x["msg"]]
        assert bool(warned) == (file_split == "port"), res.stderr[-2000:]
        unmatched = [x for x in logs if x["level"] == "error" and "nothing was followed" in x["msg"]]
        assert bool(unmatched) == (file_split == "port"), res.stderr[-2000:]
        stopped = [x for x in logs if x["msg"] == "appliance stopped"][-1]
        assert stopped["iterations_applied"] == (0 if file_split == "port" else 3)
        planned = [x for x in logs if x["msg"] == "capture file split over its workers"]
        assert len(planned) == (2 if workers == 2 else 0)
        assert all(x["connections_of_several_qps"] >= 1 for x in planned)
        if file_split == "connection":
            want = truth(d)["iterations"][-1]
            assert replica_sha(run / "ck", load_job(cfg)) == (want["params_sha256"], want["optim_sha256"])


def test_status_while_running_and_clean_sigterm(long_job_dir, tmp_path):
    job_dir = long_job_dir
    port = free_port()
    # Nothing is due before the stop: the checkpoint checked below is the one SIGTERM commits. The
    # stop lands inside an iteration (paced slowly): the drained part of it leaves the replica
    # stale for missing data, and its last complete step must still be committed.
    cfg = config(job_dir, tmp_path, persist_every=100_000, metrics={"listen": f"127.0.0.1:{port}"})
    # Paced slowly enough to be looked at while it runs.
    p = subprocess.Popen([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", str(cfg),
                          "--pace", "0.0005"], stderr=subprocess.PIPE, text=True)
    try:
        seen = None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
            st = subprocess.run([sys.executable, "-m", "mirrorckpt.tools.cli", "status", "--config", str(cfg)],
                                capture_output=True, text=True)
            if st.returncode in (0, 3) and "replica: step" in st.stdout and " 0 frames" not in st.stdout:
                step = int(st.stdout.split("replica: step ")[1].split(",")[0])
                if step >= 2:
                    seen = st.stdout
                    break
        assert seen is not None, "status never showed a running appliance"
        assert "port 0:" in seen and "port 1:" in seen and "iterations:" in seen
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-2000:]
    assert "stop requested" in err
    logs = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    stopped = [x for x in logs if x["msg"] == "appliance stopped"][-1]
    done = stopped["iterations_applied"]
    assert 2 <= done < 40 and stopped["checkpoints"], stopped
    want = truth(job_dir)["iterations"][done - 1]
    assert replica_sha(tmp_path / "ck", load_job(cfg)) == (want["params_sha256"], want["optim_sha256"])


def test_slow_updater_drops_at_the_capture_edge_never_corrupts(long_job_dir, tmp_path):
    # The 40-step job: the 8-step one (0.7 MB of capture) could be read whole before the parser
    # blocked behind the updater, and then nothing was dropped (seen once on a fresh clone).
    job_dir = long_job_dir
    cfg = config(job_dir, tmp_path, capture={"queue_bytes": 150_000, "batch_frames": 64})
    job = load_job(cfg)
    metrics = Metrics()
    d = Daemon(job, TrainingSpec.from_dict(job.training), PersistSpec.from_dict(job.persist), metrics,
               iteration_queue=1, sends_queue=1, updater_delay=0.2)
    said = _Records()
    logging.getLogger("mirrorckpt.serve").addHandler(said)
    try:
        assert d.run() == 0
    finally:
        logging.getLogger("mirrorckpt.serve").removeHandler(said)
    s = d.appliance.summary
    dropped = sum(v for k, v in _samples(metrics, "mirrorckpt_frames_dropped_total").items()
                  if ("where", "capture") in k)
    assert dropped > 0
    # the log says so, not only the metrics: where it happens (with what to do for a file) and at stop
    first = [r for r in said.records if r.getMessage().startswith("frames dropped: ")]
    assert first and first[0].dropped_capture > 0 and "queue_bytes" in first[0].hint, said.records
    total = [r for r in said.records if r.getMessage() == "frames dropped while serving"]
    assert len(total) == 1 and sum(v["capture"] for v in total[0].ports.values()) == dropped
    assert s.iterations_incomplete > 0 and s.stale_events >= 1
    # Whatever was applied is exactly the trainer's state at that iteration.
    r = d.appliance.replica
    if r is not None and r.iterations_done:
        want = truth(job_dir)["iterations"][r.iterations_done - 1]
        assert r.state_sha256() == (want["params_sha256"], want["optim_sha256"])


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def _samples(metrics, name):
    out = {}
    for fam in metrics.registry.collect():
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


@pytest.fixture(scope="module")
def job_dir_223(tmp_path_factory):
    d = tmp_path_factory.mktemp("gen223")
    generate(GenConfig(ranks=3, channels=2, model="mlp:32,64,16,4", steps=STEPS, seed=5, nccl_version="2.23",
                       training=TrainingSpec(optimizer=OptimizerSpec(name="adam", lr=1e-2)),
                       mirrors="0:egress,1:egress"), d)
    return d


def _with_release(job_dir: Path, tmp: Path, release: str | None, workers: int = 1) -> Path:
    cfg = config(job_dir, tmp, workers=workers)
    lines = [x for x in cfg.read_text().splitlines() if not x.startswith("nccl_version")]
    if release is not None:
        lines.insert(lines.index("[ring]") + 1, f'nccl_version = "{release}"')
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


def test_serve_reads_the_nccl_release_from_the_wire(job_dir_223, tmp_path):
    cfg = _with_release(job_dir_223, tmp_path, None)
    assert load_job(cfg).ring.nccl_version is None
    res = subprocess.run([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    logs = [json.loads(line) for line in res.stderr.splitlines() if line.startswith("{")]
    read = [x for x in logs if x["msg"] == "NCCL release and protocols read from the wire"]
    assert read and read[0]["nccl_version"] in ("2.20", "2.21", "2.22", "2.23"), read  # the 2.20-2.23 CTS layout
    stopped = [x for x in logs if x["msg"] == "appliance stopped"][-1]
    assert stopped["iterations_applied"] == STEPS and stopped["iterations_incomplete"] == 0
    want = truth(job_dir_223)["iterations"][-1]
    assert replica_sha(tmp_path / "ck", load_job(cfg)) == (want["params_sha256"], want["optim_sha256"])


@pytest.mark.parametrize("workers", [1, 2])
def test_serve_refuses_a_release_the_wire_contradicts(job_dir_223, tmp_path, workers):
    """Also with the port's file split over two workers: each worker's decode thread stops behind
    its compact thread, which must not keep the worker (and serve) from ending."""
    cfg = _with_release(job_dir_223, tmp_path, "2.18", workers)
    res = subprocess.run([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr[-2000:]
    logs = [json.loads(line) for line in res.stderr.splitlines() if line.startswith("{")]
    stopped = [x for x in logs if x["msg"] == "parser stopped"]
    assert stopped and "contradicts the stated NCCL 2.18" in stopped[0]["exc"], res.stderr[-2000:]
    assert not any(x["msg"] == "checkpoint committed" for x in logs)


def test_serve_reads_each_collectives_protocol_from_the_wire(tmp_path):
    """A job file that pins the release but leaves the protocol to NCCL ([ring] protocol = "auto",
    what a job sends when nothing is pinned): serve reads each collective shape's protocol from the
    first sends, as replay does, instead of stopping at the first collective. Two workers a port."""
    d = tmp_path / "gen"
    generate(GenConfig(ranks=3, channels=2, protocol="auto", nccl_version="2.23", model="mlp:300,128,16", steps=STEPS,
                       seed=7, training=TrainingSpec(optimizer=OptimizerSpec(name="adam", lr=1e-2)),
                       mirrors="0:egress,1:egress"), d)
    cfg = config(d, tmp_path, workers=2)
    job = load_job(cfg)
    assert job.ring.protocol == "auto" and job.ring.nccl_version == "2.23"
    res = subprocess.run([sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    logs = [json.loads(line) for line in res.stderr.splitlines() if line.startswith("{")]
    read = [x for x in logs if x["msg"] == "NCCL release and protocols read from the wire"]
    assert read and read[0]["nccl_version"] == "2.23", read
    stopped = [x for x in logs if x["msg"] == "appliance stopped"][-1]
    assert stopped["iterations_applied"] == STEPS and stopped["iterations_incomplete"] == 0
    want = truth(d)["iterations"][-1]
    assert replica_sha(tmp_path / "ck", job) == (want["params_sha256"], want["optim_sha256"])


def test_unevenly_loaded_workers_of_a_port_are_said(tmp_path):
    """A 2-rank job whose QP pairs all have odd UDP source ports: split by port mod 2 (as a live
    port's kernel splits), one worker of each port gets every frame, and serve says so once per
    port; the capture file's own split deals the pairs out, and nothing is said."""
    d = tmp_path / "gen"
    generate(GenConfig(ranks=2, channels=2, model="linear:20000", steps=3, seed=7, mirrors="0:egress,1:egress"), d)
    for file_split in ("port", "connection"):
        run = tmp_path / file_split
        run.mkdir()
        cfg = config(d, run, workers=2, capture={"file_split": file_split})
        job = load_job(cfg)
        said = _Records()
        logging.getLogger("mirrorckpt.serve").addHandler(said)
        try:
            daemon = Daemon(job, TrainingSpec.from_dict(job.training), PersistSpec.from_dict(job.persist), Metrics())
            assert daemon.run() == 0
        finally:
            logging.getLogger("mirrorckpt.serve").removeHandler(said)
        uneven = [r for r in said.records if r.getMessage().startswith("a port's workers are unevenly loaded")]
        if file_split == "port":
            assert sorted(r.ports for r in uneven) == [[str(m.source)] for m in job.mirrors], said.records
            assert all(max(r.share_of_bytes) == 1.0 for r in uneven)
        else:
            assert not uneven, [r.share_of_bytes for r in uneven]
        assert daemon.appliance.summary.iterations_applied == 3


def test_unevenly_loaded_workers_of_a_live_port_are_said_once(monkeypatch):
    """A live port's shares come from its workers' counters, once it has captured enough."""
    import ctypes

    from mirrorckpt.tools.daemon import ports as ports_mod
    from mirrorckpt.tools.daemon.worker import COUNTERS

    monkeypatch.setattr(ports_mod, "SPLIT_CHECK_BYTES", 1000)
    shared = [(ctypes.c_int64 * len(COUNTERS))() for _ in range(4)]
    ports = ports_mod.PortMonitor(Metrics(), ["0.0", "0.1", "1.0", "1.1"], shared=shared,
                                  split_groups=[[0, 1], [2, 3]])
    said = _Records()
    logging.getLogger("mirrorckpt.serve").addHandler(said)

    def counted(port: int, nbytes: int) -> None:
        shared[port][:] = [{"capturing": 1, "frames": 1, "bytes": nbytes}.get(k, 0) for k in COUNTERS]
        ports.sync()
    try:
        for port, nbytes in ((0, 900), (1, 0), (2, 400), (3, 500)):  # below the threshold: nothing yet
            counted(port, nbytes)
        assert not said.records
        for port, nbytes in ((1, 100), (0, 1900), (2, 900), (3, 1000), (0, 5000), (1, 200)):
            counted(port, nbytes)
    finally:
        logging.getLogger("mirrorckpt.serve").removeHandler(said)
    # port 0 as it passed the mark (900 + 100 bytes); port 1's workers share evenly; each port looked at once
    assert [(r.ports, r.share_of_bytes) for r in said.records] == [(["0.0", "0.1"], [0.9, 0.1])]
