"""Issue 7 acceptance: `mirrorckpt serve` behind a real Linux port mirror keeps a bit-exact replica.

Hosts are network namespaces on a bridge (tools.netns), one per rank of a generated 3-rank,
2-channel job (tools.generator, 8 steps); the bridge knows every rank's NIC MAC on that rank's
port (static fdb entries, as a switch that has learned them), so unicast frames are never flooded.
Every rank's egress frames are injected from its own namespace, all ranks interleaved in
timestamp order (the recorded schedule, slowed down so this VM keeps up). tc (clsact, u32
match-all, mirred) copies the ports of ranks 0 and 1 to one monitor interface, where the
appliance runs (`ip netns exec`): AF_PACKET, or DPDK net_af_packet, reading that interface.

What the monitor carries, and what the configuration says about it:
- Mirroring what ranks 0 and 1 send (the tc ingress hook of their bridge ports) gives exactly
  the generator's `0:egress,1:egress` captures, which cover every reduced byte of the job.
- Both ports' copies arrive on one interface, so they are ONE capture source: one [[mirror]]
  entry (serve starts one capture worker per entry; two entries naming the same interface would
  capture every frame twice, in two workers). Its `rank` is informational: serve uses `source`.
- A port mirrored in both directions also copies what the host receives: the frames between
  the two mirrored ranks then arrive twice on the same source. The last test checks that these
  duplicates are harmless (the reassembler drops them per QP).

Each test waits until `mirrorckpt status` shows the last iteration applied and committed (the
appliance settles complete collectives once the wire goes quiet), checks the metrics endpoint,
then stops the appliance with SIGTERM (exit 0) and compares the committed checkpoints with the
trainer's truth. Needs root, as CI has; without root the tests fail and say so.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mirrorckpt.capture.afpacket import in_netns
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.capture.pcapfile import read_all
from mirrorckpt.config.jobfile import dump_job, load_job
from mirrorckpt.config.layout import MirrorSpec
from mirrorckpt.config.training import OptimizerSpec, TrainingSpec
from mirrorckpt.tools.cmd_status import fetch
from mirrorckpt.tools.generator.gen import GenConfig, generate
from mirrorckpt.tools.testbed.netns import FrameSender, Topology
from mirrorckpt.updater import ckptdir, restore
from mirrorckpt.updater.replica import Replica

pytestmark = pytest.mark.root

RANKS, STEPS = 3, 8
MIRRORED = (0, 1)  # ranks whose ports are mirrored to the monitor
LISTEN = "127.0.0.1:9100"  # metrics, inside the monitor's own namespace (nothing else there)
STRETCH = 40  # the recorded schedule (about 16 ms) replayed 40 times slower
DEADLINE = 240  # seconds for any one wait on a loaded machine (never a timing assertion)


@pytest.fixture(autouse=True)
def _root():
    if os.geteuid() != 0:
        pytest.fail("live serve tests need root (namespaces, tc, AF_PACKET, DPDK EAL); CI runs them as root")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The generated job: every rank's egress capture, truth.json and job.toml."""
    d = tmp_path_factory.mktemp("gen")
    generate(GenConfig(ranks=RANKS, channels=2, model="mlp:32,64,16,4", steps=STEPS, seed=3,
                       training=TrainingSpec(optimizer=OptimizerSpec(name="adam", lr=1e-2)),
                       mirrors=",".join(f"{r}:egress" for r in range(RANKS))), d)
    truth = json.loads((d / "truth.json").read_text())
    return {"dir": d, "truth": truth,
            "frames": [read_all(d / f"rank{r}_egress.pcapng") for r in range(RANKS)],
            "macs": [bytes.fromhex(n["mac"].replace(":", "")) for n in truth["wire"]["topology"]["nics"]]}


# -- the network --------------------------------------------------------------------------


def mirror_topology(job, hook: str) -> Topology:
    """3 hosts and a monitor; rank r's NIC MAC is static on host r's bridge port; the ports of
    MIRRORED copied to the monitor at tc hook `hook` ("ingress": what the host sends, "both")."""
    topo = Topology(hosts=RANKS, monitors=1).setup()
    try:
        for h, mac in zip(topo.hosts, job["macs"]):
            topo.run(None, "bridge", "fdb", "replace", mac.hex(":"), "dev", h.port, "master", "static")
        for r in MIRRORED:
            topo.mirror(r, hook)
    except BaseException:
        topo.teardown()
        raise
    return topo


def _rows(b: FrameBatch, rows: np.ndarray) -> FrameBatch:
    return FrameBatch(b.data, b.offset[rows], b.caplen[rows], b.wirelen[rows], b.ts_ns[rows], b.iface[rows],
                      b.source)


def inject(topo: Topology, frames: list[FrameBatch], stretch: float = STRETCH) -> int:
    """Sends rank r's frames from host r's namespace, every rank's frames merged in timestamp
    order; each run of one rank's consecutive frames is one sendmmsg, sent when due on the
    recorded schedule slowed down `stretch` times (late runs go at once). Returns frames sent."""
    rank = np.concatenate([np.full(len(b), r) for r, b in enumerate(frames)])
    row = np.concatenate([np.arange(len(b)) for b in frames])
    ts = np.concatenate([b.ts_ns for b in frames])
    order = np.lexsort((rank, ts))
    rank, row, ts = rank[order], row[order], ts[order]
    starts = np.flatnonzero(np.concatenate(([True], rank[1:] != rank[:-1])))
    ends = np.append(starts[1:], len(rank))
    senders = [FrameSender(h.ifname, netns=h.netns) for h in topo.hosts]
    try:
        sent, t0 = 0, time.monotonic()
        for a, b in zip(starts, ends):
            wait = t0 + (ts[a] - ts[0]) * stretch / 1e9 - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            sent += senders[rank[a]].send(_rows(frames[rank[a]], row[a:b]))
        return sent
    finally:
        for s in senders:
            s.close()


def on_monitor(job, hook: str) -> tuple[int, int]:
    """(frames, bytes) the monitor receives: what the mirrored hosts send, plus with "both" what
    the bridge delivers to them (frames between two mirrored ranks then come twice)."""
    mirrored = {job["macs"][r] for r in MIRRORED}
    frames = nbytes = 0
    for r, b in enumerate(job["frames"]):
        copies = np.full(len(b), int(r in MIRRORED))
        if hook == "both":
            copies += [b.data[o:o + 6].tobytes() in mirrored for o in b.offset.tolist()]
        frames += int(copies.sum())
        nbytes += int((copies * b.caplen).sum())
    return frames, nbytes


# -- the appliance ------------------------------------------------------------------------


def serve_config(job, tmp: Path, source: str, workers: int = 1) -> Path:
    """The generated job.toml with one live [[mirror]] source, persistence and metrics."""
    cfg = load_job(job["dir"] / "job.toml")
    cfg.mirrors = [MirrorSpec(MIRRORED[0], "egress", source, workers)]  # one interface: one capture source
    cfg.persist = {"directory": str(tmp / "ck"), "keep_last": 3}
    cfg.metrics = {"listen": LISTEN}
    path = tmp / "serve.toml"
    path.write_text(dump_job(cfg))
    assert [m.source for m in load_job(path).mirrors] == [source]
    return path


def _term_with_parent() -> None:
    """SIGTERM to the appliance if this test process dies (a killed CI job leaves nothing behind)."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG; `ip netns exec` keeps it across exec


class Appliance:
    """`mirrorckpt serve --config CFG` in the monitor's namespace; logs go to a file."""

    def __init__(self, topo: Topology, cfg: Path, tmp: Path):
        self.topo, self.cfg, self.mon = topo, cfg, topo.monitors[0]
        self.log = tmp / "serve.log"
        with open(self.log, "w") as err:
            self.proc = topo.popen(self.mon, sys.executable, "-m", "mirrorckpt.tools.cli", "serve", "--config",
                                   str(cfg), stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                                   preexec_fn=_term_with_parent)
        self.last_status = ""

    def status(self) -> str | None:
        r = self.topo.run(self.mon, sys.executable, "-m", "mirrorckpt.tools.cli", "status", "--config",
                          str(self.cfg), check=False)
        self.last_status = r.stdout + r.stderr
        return r.stdout if r.returncode in (0, 3) else None  # 3: answered, the job not protected

    def metrics(self) -> dict:
        with in_netns(self.mon.netns):  # the endpoint listens inside the monitor's namespace
            return fetch(f"http://{LISTEN}/metrics")

    def wait_status(self, ok, what: str) -> str:
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"serve exited ({self.proc.returncode}) before {what}:\n{self.tail()}"
            out = self.status()
            if out is not None and ok(out):
                return out
            time.sleep(0.5)
        raise AssertionError(f"no {what} within {DEADLINE} s; status:\n{self.last_status}\n{self.tail()}")

    def stop(self) -> list[dict]:
        """SIGTERM, then the JSON log lines; serve must exit 0."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"serve did not stop within {DEADLINE} s of SIGTERM:\n{self.tail()}") from None
        assert code == 0, self.tail()
        return [json.loads(x) for x in self.log.read_text().splitlines() if x.startswith("{")]

    def kill(self) -> None:
        if self.proc.poll() is None:  # a failed test: the appliance and its capture workers
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def tail(self) -> str:
        return self.log.read_text()[-3000:]


def progress(text: str) -> dict:
    """The numbers of a `mirrorckpt status` report this test waits on."""
    out = {}
    for key, pat in {"complete": r"iterations: (\d+) complete", "incomplete": r"(\d+) incomplete",
                     "step": r"replica: step (\d+)", "iteration": r"replica: step \d+, iteration (\d+)",
                     "lag": r"lag (\d+)", "committed": r"last committed checkpoint: iteration (\d+)",
                     "queued": r"queues:[^\n]*\biterations (\d+)"}.items():
        m = re.search(pat, text)
        out[key] = int(m.group(1)) if m else -1
    out["stale"] = "STALE" in text
    return out


def settled(text: str) -> bool:
    """Every iteration came off the wire (complete or not), the updater applied every complete one
    (its queue empty, the replica's step at their count), and the persister caught up: a status read
    with two iterations still queued had the persister caught up at an earlier step."""
    p = progress(text)
    return p["complete"] + p["incomplete"] >= STEPS and p["queued"] <= 0 and \
        (p["stale"] or p["committed"] == p["step"] >= p["complete"])


def samples(m: dict, name: str) -> dict:
    return {tuple(v for _, v in k): x for k, x in m.get(name, {}).items()}


def replica_matches_truth(job, cfg: Path) -> list[int]:
    """Steps of the kept checkpoints; each one's params/optimizer sha256 must be the trainer's."""
    c = load_job(cfg)
    training = TrainingSpec.from_dict(c.training)
    iters = job["truth"]["iterations"]
    steps = []
    for step, path in ckptdir.committed(Path(c.persist["directory"])):
        assert restore.verify(path).ok, path
        sha = Replica(c.layout, training, path).state_sha256()
        assert sha == (iters[step - 1]["params_sha256"], iters[step - 1]["optim_sha256"]), f"step {step}"
        steps.append(step)
    return steps


def shares(job, hook: str, workers: int) -> list[int]:
    """Frames the monitor receives per fanout worker (ingress: each mirrored rank's frames once)."""
    from mirrorckpt.parser.roce import split

    assert hook == "ingress"
    return [sum(int((split.worker_of(job["frames"][r], workers) == k).sum()) for r in MIRRORED)
            for k in range(workers)]


def port_line(text: str, label: str, roce: int) -> int:
    """Checks a port's status line: exactly ``roce`` RoCE frames, and any other frame on the
    monitor foreign (the hosts' own traffic, which the mirror copies too: once, 26 such frames
    came on a DPDK run); returns how many of those there were."""
    m = re.search(rf"^port {re.escape(label)}: (\d+) frames \({roce} RoCE[;)]", text, re.M)
    assert m and int(m[1]) >= roce, (label, roce, text)
    return int(m[1]) - roce


def run_through_mirror(job, tmp: Path, source_of, hook: str = "ingress", workers: int = 1) -> None:
    """The whole acceptance on one backend: `source_of(monitor interface)` is the [[mirror]] source."""
    frames, nbytes = on_monitor(job, hook)
    topo = mirror_topology(job, hook)
    app = None
    try:
        mon = topo.monitors[0]
        cfg = serve_config(job, tmp, source_of(mon.ifname), workers)
        app = Appliance(topo, cfg, tmp)
        # The capture is open once the worker reports its port (before that, frames would be lost).
        app.wait_status(lambda s: "port 0" in s, "capture port reported")
        if workers > 1:  # and every worker of the port joined its fanout group (default id: the ifindex)
            from mirrorckpt.capture.afpacket import fanout_members

            group = int(topo.run(mon.netns, "cat", f"/sys/class/net/{mon.ifname}/ifindex").stdout)
            deadline = time.monotonic() + DEADLINE
            while fanout_members(group, mon.netns) != list(range(workers)):
                assert time.monotonic() < deadline, "the port's workers never all joined its fanout group"
                time.sleep(0.1)
        assert inject(topo, job["frames"]) == sum(len(b) for b in job["frames"])
        text = app.wait_status(settled, "last iteration applied and committed")

        # `mirrorckpt status`: every frame, no drop, every iteration applied, replica at the last step
        if workers == 1:
            foreign = port_line(text, "0", frames)
        else:  # each worker its share: the frames of its QP pairs
            foreign = sum(port_line(text, f"0.{k}", n) for k, n in enumerate(shares(job, hook, workers)))
        assert "dropped 0 (capture) 0 (kernel), 0 ICRC failures" in text, text
        assert f"iterations: {STEPS} complete, 0 incomplete" in text, text
        assert f"replica: step {STEPS}, iteration {STEPS - 1}, lag 0, in step" in text, text
        assert f"last committed checkpoint: iteration {STEPS}" in text, text
        assert "port 1:" not in text

        # the Prometheus endpoint itself
        m = app.metrics()
        if workers == 1:
            assert samples(m, "mirrorckpt_roce_packets_total") == {("0",): frames}
            assert samples(m, "mirrorckpt_frames_received_total") == {("0",): frames + foreign}
            if not foreign:
                assert samples(m, "mirrorckpt_bytes_received_total") == {("0",): nbytes}
            assert samples(m, "mirrorckpt_frames_dropped_total") == {("0", "capture"): 0, ("0", "kernel"): 0}
            assert samples(m, "mirrorckpt_icrc_failures_total") == {("0",): 0}
        else:
            assert samples(m, "mirrorckpt_roce_packets_total") == {
                (f"0.{k}",): n for k, n in enumerate(shares(job, hook, workers))}
            if not foreign:
                assert sum(samples(m, "mirrorckpt_bytes_received_total").values()) == nbytes
        assert samples(m, "mirrorckpt_iterations_total") == {("complete",): STEPS}
        for name, want in [("mirrorckpt_replica_step", STEPS), ("mirrorckpt_replica_iteration", STEPS - 1),
                           ("mirrorckpt_wire_iteration", STEPS - 1), ("mirrorckpt_replica_lag_iterations", 0),
                           ("mirrorckpt_replica_stale", 0), ("mirrorckpt_fallbacks_total", 0),
                           ("mirrorckpt_last_committed_step", STEPS)]:
            assert samples(m, name) == {(): want}, name
        # capture timestamps are this host's clock: every step, and the committed checkpoints, timed
        # from their iteration's last packet; every commit's own duration
        committed = len(ckptdir.committed(Path(load_job(cfg).persist["directory"])))
        assert samples(m, "mirrorckpt_step_latency_seconds_count") == {(): STEPS}
        assert 1 <= samples(m, "mirrorckpt_commit_latency_seconds_count")[()] <= STEPS
        assert samples(m, "mirrorckpt_persist_seconds_count")[()] >= committed >= 1
        assert 0 < samples(m, "mirrorckpt_step_latency_seconds_sum")[()] < 60 * STEPS

        logs = app.stop()
    finally:
        if app is not None:
            app.kill()
        topo.teardown()
    assert any(x["msg"] == "stop requested: draining, then committing a last checkpoint" for x in logs)
    stopped = [x for x in logs if x["msg"] == "appliance stopped"][-1]
    assert stopped["iterations_applied"] == STEPS and stopped["replica_step"] == STEPS, stopped
    assert stopped["iterations_incomplete"] == 0 and stopped["stale_events"] == 0, stopped
    assert not [x for x in logs if x["level"] == "error"], [x for x in logs if x["level"] == "error"]
    assert replica_matches_truth(job, cfg)[-1] == STEPS


# -- the tests ----------------------------------------------------------------------------


def test_afpacket_serve_keeps_a_bit_exact_replica_through_a_port_mirror(job, tmp_path):
    run_through_mirror(job, tmp_path, lambda iface: f"afpacket:{iface}")


def test_afpacket_serve_with_two_workers_on_the_port_keeps_a_bit_exact_replica(job, tmp_path):
    """[[mirror]] workers = 2 on a live port: the kernel splits it by QP pair (AF_PACKET fanout),
    each worker receives exactly its share, and the replica is bit-exact."""
    assert min(shares(job, "ingress", 2)) > 0  # both workers have QP pairs to decode
    run_through_mirror(job, tmp_path, lambda iface: f"afpacket:{iface}", workers=2)


def test_dpdk_net_af_packet_serve_keeps_a_bit_exact_replica_through_a_port_mirror(job, tmp_path):
    # EAL: serve's defaults (--no-huge -m 512 --no-pci, a per-process --file-prefix, every CPU);
    # the af_packet PMD's ring as the platform notes size it (its overflow is never counted).
    run_through_mirror(job, tmp_path, lambda iface: f"dpdk:net_af_packet0,iface={iface},framecnt=8192,"
                                                    "blocksz=65536,framesz=2048")


def test_ports_mirrored_both_ways_deliver_duplicates_on_one_source_harmlessly(job, tmp_path):
    frames, _ = on_monitor(job, "both")
    assert frames > on_monitor(job, "ingress")[0]  # the copies this test is about
    run_through_mirror(job, tmp_path, lambda iface: f"afpacket:{iface}", hook="both")
