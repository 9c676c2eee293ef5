"""Issue 8 acceptance on real PyTorch DDP over gloo/TCP: 3 ranks in network namespaces.

One run (module fixture) of ``tools.ddp_gloo_job`` (CPU, an MLP of 1.51 M parameters, Adam,
8 steps, buckets rebuilt after step 1; TCPStore on rank 0; segmentation offloads on, so the
mirrors carry TSO super-frames with partial checksums) is mirrored at once to three monitors:

* monitor 0: rank 1's port, both directions: decoded live from AF_PACKET while training runs
  (and written to a pcap by tcpdump for the replay tests);
* monitor 1: the egress of ranks 0 and 1 (pcap);
* monitor 2: rank 1's port again, captured only from step 3 on, with the other ranks already in
  its all-reduces (mid-run attach, pcap).

The trainer records every iteration's reduced gradients, its initial weights and its final
parameters and Adam state; the appliance's results must be bit-identical, and the replica
(``updater.replica``) driven by them must end in the trainer's exact state. Needs root, as CI
has; without root these tests fail and say so (marker ``root``).
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from common import collect
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.capture.pcapfile import read_all
from mirrorckpt.config.jobfile import parse_job
from mirrorckpt.config.layout import JobLayout
from mirrorckpt.config.training import OptimizerSpec, TrainingSpec
from mirrorckpt.parser.collectives import JobModel
from mirrorckpt.parser.gloo.job import GlooJobStream, open_job_stream
from mirrorckpt.parser.iteration import ReducedIteration
from mirrorckpt.updater.replica import Replica

pytestmark = pytest.mark.root

STEPS = 8
LR = 1e-3


@dataclass
class Run:
    out: Path
    meta: dict
    grads: list[dict]  # per iteration: name -> reduced gradient (rank 0's p.grad)
    init: dict
    final: dict
    addrs: list[str]
    live: dict = field(default_factory=dict)  # monitor -> (GlooJobStream, results, iterations), live
    live_stats: dict = field(default_factory=dict)  # monitor -> AF_PACKET ring statistics
    tcpdump: dict = field(default_factory=dict)  # pcap name -> tcpdump's report

    def pcap(self, name: str) -> Path:
        return self.out / name


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    if os.geteuid() != 0:
        pytest.fail("the gloo DDP tests need root (namespaces, tc, AF_PACKET); CI runs them as root")
    for tool in ("tcpdump", "tc", "ip"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed (tools/install-system-deps.sh)")
    from mirrorckpt.tools.testbed import gloo_harness as h

    out = tmp_path_factory.mktemp("gloo_ddp")
    topo = h.gloo_topology(3, {0: [(1, "both")], 1: [(0, "egress"), (1, "egress")], 2: [(1, "both")]})
    try:
        dumps = {"r1both.pcap": h.Tcpdump(topo, topo.monitors[0], out / "r1both.pcap"),
                 "egress01.pcap": h.Tcpdump(topo, topo.monitors[1], out / "egress01.pcap")}
        lives = {m: h.LiveSource(topo.monitors[m]) for m in (0, 1)}

        def consume(live):  # the appliance, live: nothing configured
            js = GlooJobStream([(live.name, live)])
            res, its, w = collect(js)
            return js, res, its, w

        consumers = {m: h.Consumer(lambda live=live: consume(live)) for m, live in lives.items()}
        # rank 0 holds step 3 until the late capture runs; ranks 1 and 2 are already in its
        # all-reduces then, so the late capture starts with ops in flight
        procs = h.start_ranks(topo, out, steps=STEPS, extra=["--lr", str(LR), "--wait-step", "3",
                                                             "--wait-file", str(out / "go")])
        h.wait_file(out / "step_2.done")
        dumps["late.pcap"] = h.Tcpdump(topo, topo.monitors[2], out / "late.pcap")
        (out / "go").write_text("")
        h.wait_ranks(procs, out)
        reports = {k: d.stop() for k, d in dumps.items()}
        for live in lives.values():
            live.stop()
        decoded = {m: c.result() for m, c in consumers.items()}
        addrs = [hh.ip for hh in topo.hosts]
    finally:
        topo.teardown()
    meta = json.loads((out / "meta.json").read_text())
    return Run(out, meta, [torch.load(out / f"grads_{i}.pt") for i in range(STEPS)],
               torch.load(out / "init.pt"), torch.load(out / "final.pt"), addrs, decoded,
               {m: live.stats for m, live in lives.items()}, reports)


# -- checks ---------------------------------------------------------------------------------------


def assert_bit_exact(run: Run, layout: JobLayout, it: ReducedIteration) -> None:
    g = run.grads[it.index]
    names = list(g)
    assert it.complete and len(it.buckets) == len(layout.bucket_list(it.index))
    for b, (spec, flat) in enumerate(zip(layout.bucket_list(it.index), it.buckets)):
        assert flat.dtype == np.float32
        for pi, s, e in layout.bucket_slices(spec):
            want = g[names[pi]].reshape(-1).numpy()
            assert np.array_equal(want.view(np.uint32), flat[s:e].view(np.uint32)), \
                f"iteration {it.index} bucket {b} parameter {names[pi]} differs"


def training() -> TrainingSpec:
    return TrainingSpec(optimizer=OptimizerSpec(name="adam", lr=LR, foreach=False, fused=False))


def assert_final_state(run: Run, replica: Replica) -> None:
    want = run.final
    names = list(want["params"])
    for i, (n, p) in enumerate(zip(names, replica.params)):
        assert torch.equal(p, want["params"][n]), f"parameter {n} differs"
        mine = replica.optimizer.state[p]
        theirs = want["optimizer"]["state"][i]
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(mine[k], theirs[k]), f"Adam {k} of {n} differs"
        assert float(mine["step"]) == float(theirs["step"]) == STEPS


def configured_job(run: Run):
    """The layout as an operator writes it in the job file: names, shapes, rebuilt buckets."""
    raw = {
        "ring": {"nranks": 3, "addresses": run.addrs},
        "job": {"kind": "ddp", "params": [{"name": n, "shape": s} for n, s in
                                          zip(run.meta["names"], run.meta["shapes"])],
                "buckets": {"after_rebuild": [[int(x) for x in b.split()] for b in
                                              run.meta["ddp_logging"]["rebuilt_per_bucket_param_indices"]
                                              .split(",")]}},
    }
    return parse_job(raw, "gloo-job")


def check_iterations(run: Run, layout: JobLayout, its) -> tuple[int, int]:
    good = bad = 0
    for it in its:
        if it.complete:
            assert_bit_exact(run, layout, it)
            good += 1
        else:
            assert it.buckets == []
            bad += 1
    return good, bad


def batches(full: FrameBatch, idx: np.ndarray, size: int = 512):
    for k in range(0, len(idx), size):
        sel = idx[k:k + size]
        yield FrameBatch(full.data, full.offset[sel], full.caplen[sel], full.wirelen[sel], full.ts_ns[sel],
                         full.iface[sel], full.source, int(sel[0]) if len(sel) else 0, full.linktypes)


def decode(sources, **kw):
    js = GlooJobStream(sources, **kw)
    res, its, w = collect(js)
    return js, res, its, w


def run_replay(captures, job=None):
    js = open_job_stream(captures, job)
    return (js, *collect(js))


# -- tests ----------------------------------------------------------------------------------------


def test_capture_saw_every_frame(run: Run):
    for name, report in run.tcpdump.items():
        assert re.search(r"^0 packets dropped by kernel", report, re.M), (name, report)
    for stats in run.live_stats.values():
        assert stats.kernel_drops == 0 and stats.frames > 1000
    assert run.meta["ddp_logging"]["rebuilt_bucket_sizes"].count(",") == 1  # two buckets after the rebuild
    total = sum(int(np.prod(s)) for s in run.meta["shapes"])
    assert 1_400_000 < total < 1_600_000
    # offloads were on: large mirrored frames carry partial (wrong) TCP checksums, which the
    # decoder must not check
    full = read_all(run.pcap("r1both.pcap"))
    big = [full.frame(k) for k in range(len(full)) if full.caplen[k] > 20_000][:50]
    assert big and not any(tcp_checksum_ok(f) for f in big)
    fixed = bytearray(big[0])  # the check itself: the same frame with its checksum filled in
    at = 14 + (fixed[14] & 15) * 4 + 16
    fixed[at:at + 2] = b"\0\0"
    fixed[at:at + 2] = _checksum_fill(bytes(fixed), at).to_bytes(2, "big")
    assert tcp_checksum_ok(bytes(fixed))


@pytest.mark.parametrize("monitor", [0, 1], ids=["rank1-both-directions", "egress-of-ranks-0-and-1"])
def test_live_capture_drives_a_bit_exact_replica(run: Run, monitor: int):
    """AF_PACKET on a mirror, nothing configured: ranks, layout and the initial weights come
    from the wire; every iteration is bit-exact and the replica ends in the trainer's state."""
    js, results, its, init = run.live[monitor]
    layout = js.model.layout
    assert [p.shape for p in layout.params] == [tuple(s) for s in run.meta["shapes"]]
    assert [i.index for i in its] == list(range(STEPS)) and all(i.complete for i in its)
    for it in its:
        assert_bit_exact(run, layout, it)
    placement = js.report().placement
    assert placement["mismatch"] == 0 and placement["untrusted"] == 0
    assert init is not None
    want = np.concatenate([v.reshape(-1).numpy() for v in run.init.values()])
    assert np.array_equal(init.values.view(np.uint32), want.view(np.uint32))
    rep = Replica.from_initial_weights(layout, training(), init.values)
    for it in its:
        rep.apply(it)
    assert_final_state(run, rep)
    # the frames were TSO super-frames
    assert max(s.stats.bytes / max(1, s.stats.segments) for d in js.streams.decoders
               for s in d.tcp.streams.values()) > 10_000


def _ones_sum(frame: bytes) -> int:
    ihl = (frame[14] & 15) * 4
    total = int.from_bytes(frame[16:18], "big")
    seg = frame[14 + ihl:14 + total]
    data = frame[26:34] + bytes([0, 6]) + len(seg).to_bytes(2, "big") + seg + b"\0" * (len(seg) % 2)
    s = int(np.frombuffer(data, ">u2").astype(np.uint64).sum())
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def _checksum_fill(frame: bytes, at: int) -> int:
    """The checksum value for a frame whose checksum field (at ``at``) is zero."""
    return 0xFFFF - _ones_sum(frame)


def tcp_checksum_ok(frame: bytes) -> bool:
    """RFC 793 checksum of an IPv4/TCP frame (one's-complement sum over pseudo-header and segment)."""
    return _ones_sum(frame) == 0xFFFF


def test_replay_of_the_same_port_agrees_with_live(run: Run):
    js, results, its, _ = run_replay([str(run.pcap("r1both.pcap"))])
    live = {r.index: r.sha256() for r in run.live[0][1]}
    assert {r.index: r.sha256() for r in results} == live and None not in live.values()
    assert len(its) == STEPS and all(i.complete for i in its)


def test_two_ranks_egress_only(run: Run):
    """Egress of ranks 0 and 1: rank 0's all-gather sends cover every chunk but 2, rank 1's
    every chunk but 0; the start-up broadcasts leave rank 0."""
    js, results, its, init = run_replay([str(run.pcap("egress01.pcap"))])
    assert check_iterations(run, js.model.layout, its) == (STEPS, 0)
    want = np.concatenate([v.reshape(-1).numpy() for v in run.init.values()])
    assert np.array_equal(init.values.view(np.uint32), want.view(np.uint32))
    # each direction alone misses a third of every bucket: incomplete, never wrong
    for rank in (0, 1):
        full = read_all(run.pcap("egress01.pcap"))
        src = ipaddress.IPv4Address(run.addrs[rank]).packed
        ipsrc = np.array([bytes(full.data[o + 26:o + 30]) == src for o in full.offset.tolist()])
        idx = np.nonzero(ipsrc)[0]
        js1, _, its1, _ = decode([("one-rank", batches(full, idx))], model=js.model, ranks=js.ranks)
        assert check_iterations(run, js.model.layout, its1) == (0, STEPS)


def test_mid_run_attach_continues_bit_exactly(run: Run):
    """The capture started after step 2 (no SYN, no start-up): with the layout and addresses
    from the job file, the iterations in flight are reported incomplete and every one from the
    first complete iteration on is bit-exact; a replica brought to that iteration continues to
    the trainer's final state."""
    job = configured_job(run)
    js, results, its, _ = run_replay([str(run.pcap("late.pcap"))], job=job)
    good, bad = check_iterations(run, job.layout, its)
    done = [i.complete for i in its]
    assert good >= 3 and bad >= 3 and True in done, done
    first = done.index(True)
    assert all(done[first:]) and len(done) == STEPS, done
    assert js.report().placement["untrusted"] > 0  # the ops in flight at the attach were not used
    # the replica: initial weights, the trainer's gradients up to the attach, then the wire's
    rep = Replica(job.layout, training(), {n: v.clone() for n, v in run.init.items()})
    for i in range(first):
        flat = [torch.cat([run.grads[i][job.layout.params[p].name].reshape(-1) for p in b.params]).numpy()
                for b in job.layout.bucket_list(i)]
        rep.apply(ReducedIteration(i, flat))
    for it in its[first:]:
        rep.apply(it)
    assert_final_state(run, rep)


def test_loss_and_late_attach_never_yield_a_wrong_iteration(run: Run):
    """Frames dropped at random, captures cut at random points, copies corrupted: every
    iteration reported complete is bit-exact (0 silent corruptions), the others carry nothing."""
    rng = random.Random(8)
    full = read_all(run.pcap("r1both.pcap"))
    job = configured_job(run)
    model, ranks = JobModel.from_job(job), job.ring.ranks_by_address()
    n = len(full)
    totals = {"good": 0, "bad": 0, "trials": 0}
    for trial in range(14):
        keep = np.ones(n, bool)
        kind = trial % 3
        if kind == 0:  # random drops (each a TSO super-frame: up to 64 KiB of stream)
            for k in rng.sample(range(n), rng.randint(1, 4)):
                keep[k] = False
        elif kind == 1:  # attach at a random frame, then a drop
            keep[:rng.randrange(n // 10, n // 2)] = False
            keep[rng.randrange(n // 2, n)] = False
        idx = np.nonzero(keep)[0]
        src = full
        if kind == 2:  # a disagreeing second copy of a large frame
            big = [k for k in range(n) if full.caplen[k] > 30_000]
            k = rng.choice(big)
            frame = bytearray(full.frame(k))
            frame[rng.randrange(100, len(frame))] ^= 0x10
            data = np.concatenate([full.data, np.frombuffer(bytes(frame), np.uint8)])
            src = FrameBatch(data, np.append(full.offset, len(full.data)), np.append(full.caplen, len(frame)),
                             np.append(full.wirelen, len(frame)), np.append(full.ts_ns, full.ts_ns[k]),
                             np.append(full.iface, 0), full.source, 0, full.linktypes)
            idx = np.insert(np.arange(n), k + 1, n)
        _, _, its, _ = decode([(f"trial{trial}", batches(src, idx))], model=model, ranks=ranks)
        good, bad = check_iterations(run, job.layout, its)
        totals["good"] += good
        totals["bad"] += bad
        totals["trials"] += 1
    assert totals["bad"] > 0 and totals["good"] > totals["bad"], totals


def test_mirrorckpt_replay_cli_takes_gloo_captures(run: Run):
    from click.testing import CliRunner
    from mirrorckpt.tools.cmd_replay import replay

    res = CliRunner().invoke(replay, ["--transport", "gloo", "--json", str(run.pcap("egress01.pcap"))])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert [it["complete"] for it in report["iterations"]] == [True] * STEPS
    live = [r.sha256() for r in run.live[1][1] if r.spec.kind == "allreduce"]
    assert [a["sha256"] for a in report["allreduces"]] == live
    assert report["placement"].get("mismatch", 0) == 0 and report["placement"]["placed"] > 0
