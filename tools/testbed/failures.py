"""Failure injection on a real CPU DDP job: the job is killed at times drawn from an exponential
MTBF and restarted from its strategy's latest checkpoint until it reaches a fixed step count.

Strategies: ``sync`` (dcp.save every K steps, a pointer written when it returns), ``async``
(dcp.async_save every K steps, the pointer written when the background write is done) and
``mirror`` (the appliance follows every iteration over the frame stream and the control plane;
a restart pulls its replica with ``restore_from_appliance``); ``none`` checkpoints nothing (with
no failures: the baseline step). In mirror mode rank 0 also makes the frames NCCL would send
(the test rig's packetiser, a NIC's work on a real system): its time is logged per step apart.

A kill takes every rank at once (SIGKILL), as a lost node takes a job. Restarts use processes
forked from a server that has already imported torch (``forkserver`` with preloading), as a
cluster keeps warm spares: the restart time is process group set-up, DDP and the restore, not
Python's imports. Each step also sleeps ``device_s`` for the accelerator's share of a step, which
does not compete for the CPU cores. Every rank-0 event goes to a JSON-lines log on
CLOCK_MONOTONIC (shared by the processes), from which the driver takes steps, stalls, commits,
restarts and the step each failure rolled back to.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np

log = logging.getLogger("mirrorckpt.testbed.failures")
STRATEGIES = ("sync", "async", "mirror")
BASELINE = "none"  # no checkpoints, no appliance: the step time the others are compared with
SECRET = "failures-secret-0123456789abcdef"


# ------------------------------------------------------------------------------ one rank

def rank_main(cfg: dict) -> None:
    """One rank of one incarnation of the job (run in a forked process)."""
    import torch
    import torch.distributed as dist
    from mirrorckpt.tools.testbed import harness
    from torch import nn

    t_fork = time.monotonic()
    torch.set_num_threads(1)
    rank, world = cfg["rank"], cfg["world"]
    out = open(cfg["log"], "a", buffering=1) if rank == 0 else None

    def event(ev: str, **kw) -> None:
        if out is not None:
            out.write(json.dumps({"ev": ev, "t": time.monotonic(), **kw}) + "\n")

    event("forked", incarnation=cfg["incarnation"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['master_port']}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    dims = tuple(cfg["dims"])
    model = harness.build_model(dims, cfg["seed"] + rank)
    torch.manual_seed(cfg["seed"])  # one RNG stream on every rank (dropout)
    ddp = nn.parallel.DistributedDataParallel(model)
    mirror = cfg["strategy"] == "mirror"
    hs = harness.register(ddp, ("127.0.0.1", cfg["frames_port"]) if mirror else None, seed=1)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
    shard = harness.Shard(dims, cfg["seed"], rank, batch=cfg["batch"])
    t_init = time.monotonic()
    link, ckpt = None, None
    rig = [0.0]
    if mirror and hs.comm is not None:
        hs.comm.all_reduce = _timed(hs.comm.all_reduce, rig)
        hs.sink.flush = _timed(hs.sink.flush, rig)
    if mirror:
        from mirrorckpt.control.trainer import attach

        link = attach(ddp, opt, appliance=("127.0.0.1", cfg["control_port"]), secret=SECRET, scheduler=sched,
                      data=shard, ring=hs.ring, parts=3, fingerprint_every=cfg["fingerprint_every"],
                      restore="appliance" if cfg["restore"] else None, connect_timeout=10.0,
                      client_options={"backoff_max": 0.2})
        step = link.iterations_done
    elif cfg["strategy"] in ("sync", "async"):
        ckpt = _Checkpoints(Path(cfg["root"]), ddp, opt, sched, shard, rank, event)
        step = ckpt.load()
    else:
        step = 0
    event("ready", step=step, init_s=t_init - t_fork, restore_s=time.monotonic() - t_init)
    n, every = cfg["steps"], cfg["every"]
    while step < n:
        t0 = time.monotonic()
        rig[0], hooks = 0.0, link.stats.hook_seconds if link is not None else 0.0
        x, y = shard.next()
        x = x + 0.01 * torch.randn_like(x)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        time.sleep(cfg["device_s"])  # the accelerator's share of the step
        opt.step()
        sched.step()
        step += 1
        event("step", step=step, t0=t0, rig_s=rig[0],
              link_s=link.stats.hook_seconds - hooks if link is not None else 0.0)
        if ckpt is not None and step % every == 0 and step < n:  # none after the last step
            ckpt.save(step, cfg["strategy"])
    event("done", step=step)
    if link is not None:
        link.close()
    if ckpt is not None:
        ckpt.close()
    hs.close()
    dist.barrier()
    dist.destroy_process_group()


def _timed(fn, acc: list):
    def call(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[0] += time.perf_counter() - t0
    return call


class _Checkpoints:
    """DCP checkpoints under ``root``: ``step-N`` directories and a ``latest`` pointer that rank 0
    replaces atomically once a checkpoint is whole (after dcp.save returns; for async_save when its
    future is done). A restart loads what ``latest`` names; anything else is never read."""

    def __init__(self, root: Path, ddp, opt, sched, shard, rank: int, event):
        import torch.distributed as dist

        self.root, self.ddp, self.opt, self.sched, self.shard = root, ddp, opt, sched, shard
        self.rank, self.event = rank, event
        self.pending = None
        # the background write's collectives must not meet the training loop's on one group
        self.group = dist.new_group(backend="gloo")
        root.mkdir(parents=True, exist_ok=True)

    def _state(self, step: int) -> dict:
        import torch
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.ddp, self.opt)
        return {"model": msd, "optim": osd, "rng": torch.get_rng_state(),
                "extra": {"sched": self.sched.state_dict(), "data": self.shard.state_dict(), "step": step}}

    def load(self) -> int:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        ptr = self.root / "latest"
        if not ptr.exists():
            return 0
        sd = self._state(0)
        dcp.load(sd, checkpoint_id=str(self.root / ptr.read_text().strip()))
        set_state_dict(self.ddp, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        torch.set_rng_state(sd["rng"])
        self.sched.load_state_dict(sd["extra"]["sched"])
        self.shard.load_state_dict(sd["extra"]["data"])
        return int(sd["extra"]["step"])

    def _commit(self, step: int) -> None:
        if self.rank == 0:
            tmp = self.root / f".latest-{step}"
            tmp.write_text(f"step-{step}")
            os.replace(tmp, self.root / "latest")
            self.event("committed", step=step)

    def save(self, step: int, how: str) -> None:
        import torch.distributed.checkpoint as dcp

        t0 = time.monotonic()
        path = str(self.root / f"step-{step}")
        if how == "sync":
            dcp.save(self._state(step), checkpoint_id=path)
            self._commit(step)
        else:
            if self.pending is not None:
                self.pending.result()  # one background write at a time
            self.pending = dcp.async_save(self._state(step), checkpoint_id=path, process_group=self.group)
            self.pending.add_done_callback(lambda f, s=step: f.exception() is None and self._commit(s))
        self.event("checkpoint", step=step, stall_s=time.monotonic() - t0)

    def close(self) -> None:
        if self.pending is not None:
            self.pending.result()


# ------------------------------------------------------------------------------ the appliance

class _Incarnation:
    """The appliance's parser for one incarnation of the job: a restarted job's NCCL sets up new
    connections, so each incarnation gets its own frame stream and parser, in front of one control
    plane whose replica outlives them. Each incarnation registers with its own run id, so the plane
    re-arms: it numbers the incarnation's iterations from the step it registered at and lays its
    first one out in DDP's first buckets; this parser tags its iterations with the plane's run
    counter at that registration. Once the incarnation is killed, a torn last iteration is not a
    mirror loss: incomplete iterations after the kill are dropped, not applied."""

    def __init__(self, plane, world: int, registered_before: int):
        from mirrorckpt.tools.testbed import harness

        self.plane, self.world = plane, world
        self.ring, self.topo = harness.ring_for(world)
        self.frames = harness.FrameStreamServer(world)
        self.registered_before = registered_before
        self.over = threading.Event()
        self.run: int | None = None  # the plane's run counter once this incarnation registered
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="incarnation-parser", daemon=True)
        self.thread.start()

    def _registered(self) -> int | None:
        regs = [d for kind, d in list(self.plane.stats.events) if kind == "registered"]
        return regs[self.registered_before]["step"] if len(regs) > self.registered_before else None

    def _run(self) -> None:
        from mirrorckpt.parser.roce.collectives import NcclJobModel
        from mirrorckpt.parser.roce.jobstream import JobStream
        from mirrorckpt.parser.roce.streams import MirrorStreams
        from mirrorckpt.tools.testbed import harness
        from mirrorckpt.updater.drive import drive

        try:
            while self._registered() is None:
                if self.over.wait(0.005):
                    return
            self.run = self.plane.run
            streams = MirrorStreams(self.frames.sources())
            for path in getattr(streams, "paths", []):
                path.reassembler.psn_window = 16
            js = JobStream(streams, model=NcclJobModel.ddp(self.ring, self.plane.layout, with_startup=False),
                           ranks=self.ring.ranks_by_address(), channels=harness.channels_for(self.topo, self.ring),
                           nccl_version=self.ring.nccl_version, collective_window=1, infer_after=1)
            drive(js, self)
        except BaseException as e:  # noqa: BLE001 - read by the driver
            self.error = e
            log.error("incarnation parser: %s: %s", type(e).__name__, e)

    # the IterationSink the job stream drives
    def initial_weights(self, w) -> None:
        pass  # the replica comes from the trainer's registration or the previous incarnation

    def bucket(self, b) -> None:
        pass

    def apply(self, it) -> None:
        if self.over.is_set() and not it.complete:
            return
        it.run = self.run
        self.plane.apply(it)

    def end(self) -> None:
        self.over.set()

    def stop(self) -> None:
        self.over.set()
        self.frames.stop()
        self.thread.join(30)


class MirrorAppliance:
    """The control plane (replica in memory) and one parser per incarnation of the job."""

    def __init__(self, world: int):
        from mirrorckpt.control.appliance_side import AppliancePlane

        self.world = world
        self.applied: dict[int, float] = {}  # step -> when the replica reached it (monotonic)
        self.plane = AppliancePlane(SECRET, parts=3, fingerprint_every=4, fallback_timeout=60,
                                    on_iteration=self._applied).start()
        _warm_up()  # what the plane's first replica imports (seconds), before the job's clock starts
        self.incarnations: list[_Incarnation] = []

    def _applied(self, index: int, r) -> None:
        self.applied[r.iterations_done] = time.monotonic()

    def incarnation(self) -> _Incarnation:
        regs = sum(kind == "registered" for kind, _ in list(self.plane.stats.events))
        inc = _Incarnation(self.plane, self.world, regs)
        self.incarnations.append(inc)
        return inc

    def stop(self) -> None:
        for inc in self.incarnations:
            inc.stop()
        self.plane.stop()


def _warm_up() -> None:
    import torch

    torch.optim.Adam([torch.zeros(1, requires_grad=True)], foreach=False)


# ------------------------------------------------------------------------------ the driver

@dataclass
class Run:
    """What one strategy's run measured (times in seconds, CLOCK_MONOTONIC differences)."""
    strategy: str
    steps: int
    wall_s: float = 0.0
    failures: list[dict] = field(default_factory=list)  # at_s, last_step, restored_step, restart_s
    step_s: list[float] = field(default_factory=list)
    stall_s: list[float] = field(default_factory=list)
    lag_s: list[float] = field(default_factory=list)  # until a checkpoint can be restored
    restore_s: list[float] = field(default_factory=list)  # inside the rank: load or pull
    rig_s: list[float] = field(default_factory=list)  # per step: the rig's frame making (mirror)
    link_s: list[float] = field(default_factory=list)  # per step: the control link's hooks (mirror)
    incarnations: int = 0
    appliance: dict = field(default_factory=dict)  # mirror: the control plane's counters and events

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line torn by the kill
    return out


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["mirrorckpt.tools.testbed.failures", "mirrorckpt.tools.testbed.harness",
                                "torch.distributed.checkpoint", "mirrorckpt.control.trainer",
                                "torch._dynamo"])  # DDP's first construction imports it (seconds)
    return ctx


def run_strategy(strategy: str, workdir: Path, *, steps: int, every: int, mtbf_s: float, seed: int,
                 dims=(64, 256, 256, 16), batch: int = 16, device_s: float = 0.05, world: int = 2,
                 max_wall_s: float = 600.0) -> Run:
    """Train ``steps`` steps under failures drawn from ``seed`` (exponential, mean ``mtbf_s``,
    each drawn from the moment of the previous failure: the draws ``goodput.simulate`` makes with
    the same seed). The clock starts when the first incarnation is ready to step and stops at the
    last step."""
    from mirrorckpt.tools.testbed.harness import free_port

    if strategy not in STRATEGIES + (BASELINE,):
        raise ValueError(f"strategy {strategy!r}: expected one of {', '.join(STRATEGIES + (BASELINE,))}")
    ctx = _context()
    workdir = Path(workdir) / strategy
    workdir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    app = MirrorAppliance(world) if strategy == "mirror" else None
    run = Run(strategy, steps)
    logs: list[Path] = []
    base = {"world": world, "strategy": strategy, "steps": steps, "every": every, "dims": list(dims),
            "batch": batch, "device_s": device_s, "seed": 5, "root": str(workdir / "ckpt"),
            "fingerprint_every": 4, "control_port": app.plane.port if app else 0}
    t_start = fail_at = None
    killed_at = None
    try:
        while True:
            inc = app.incarnation() if app else None
            lg = workdir / f"incarnation{len(logs)}.jsonl"
            logs.append(lg)
            # a mirror job restores once the appliance holds its state (it registers at the first step)
            restore = len(logs) > 1 and (app is None or app.plane.replica is not None)
            cfg = base | {"master_port": free_port(), "log": str(lg), "incarnation": len(logs) - 1,
                          "restore": restore, "frames_port": inc.frames.port if inc else 0}
            procs = [ctx.Process(target=rank_main, args=(cfg | {"rank": r},), daemon=True) for r in range(world)]
            for p in procs:
                p.start()
            run.incarnations += 1
            if t_start is None:  # the clock (and the failure process) starts when the job first steps
                while not any(e["ev"] == "ready" for e in _events(lg)):
                    if any(p.exitcode not in (None, 0) for p in procs):
                        raise RuntimeError(f"{strategy}: a rank failed at start-up (exit codes "
                                           f"{[p.exitcode for p in procs]})")
                    time.sleep(0.005)
                t_start = next(e["t"] for e in _events(lg) if e["ev"] == "ready")
                fail_at = t_start + rng.exponential(mtbf_s)
            while True:
                if all(p.exitcode is not None for p in procs):
                    break
                if time.monotonic() >= fail_at and not any(e["ev"] == "done" for e in _events(lg)):
                    break  # once the last step is done the job has reached its goal
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"{strategy}: a rank died by itself (exit codes {[p.exitcode for p in procs]})"
                                       f"; see {lg}")
                if time.monotonic() - t_start > max_wall_s:
                    raise TimeoutError(f"{strategy}: not done in {max_wall_s:g} s")
                time.sleep(0.002)
            done = [e for e in _events(lg) if e["ev"] == "done"]
            if done and all(p.exitcode is not None for p in procs):
                if any(p.exitcode != 0 for p in procs):
                    raise RuntimeError(f"{strategy}: exit codes {[p.exitcode for p in procs]}")
                break
            if inc is not None:
                inc.end()  # the job is gone: its torn iteration is no mirror loss
            for p in procs:
                p.kill()
            killed_at = time.monotonic()
            for p in procs:
                p.join(10)
            if inc is not None:  # the restart asks for the newest state: what was on the wire is applied first
                inc.thread.join(60)
            ev = _events(lg)
            last = max((e["step"] for e in ev if e["ev"] in ("step", "ready")), default=None)
            run.failures.append({"at_s": killed_at - t_start, "last_step": last, "incarnation": len(logs) - 1})
            fail_at = killed_at + rng.exponential(mtbf_s)
    finally:
        if app is not None:
            app.stop()
    _measure(run, logs, t_start, app)
    return run


def _measure(run: Run, logs: list[Path], t_start: float, app: MirrorAppliance | None) -> None:
    ends: dict[int, float] = {}  # step -> when it ended, in the incarnation that got furthest
    for k, lg in enumerate(logs):
        ev = _events(lg)
        ready = next((e for e in ev if e["ev"] == "ready"), None)
        if ready is not None and k > 0:
            run.restore_s.append(ready["restore_s"])
        for f in run.failures:
            if f["incarnation"] == k - 1 and ready is not None:
                f["restored_step"] = ready["step"]
                f["restart_s"] = ready["t"] - (t_start + f["at_s"])
        commit_t = {e["step"]: e["t"] for e in ev if e["ev"] == "committed"}
        for e in ev:
            if e["ev"] == "step":
                run.step_s.append(e["t"] - e["t0"])
                run.rig_s.append(e.get("rig_s", 0.0))
                run.link_s.append(e.get("link_s", 0.0))
                ends[e["step"]] = e["t"]
            elif e["ev"] == "checkpoint":
                run.stall_s.append(e["stall_s"])
                if e["step"] in commit_t:  # restorable from then on
                    run.lag_s.append(max(0.0, commit_t[e["step"]] - e["t"]))
            elif e["ev"] == "done":
                run.wall_s = e["t"] - t_start
    if app is not None:
        st = app.plane.stats
        run.appliance = {"fallbacks_requested": st.fallbacks_requested, "fallbacks_done": st.fallbacks_done,
                         "fingerprints_checked": st.fingerprints_checked,
                         "drift_events": st.drift_events, "restores": dict(st.restores),
                         "events": [(k, str(d)[:200]) for k, d in st.events],
                         "parser_errors": [repr(i.error) for i in app.incarnations if i.error is not None]}
        run.lag_s = [max(0.0, app.applied[s] - t) for s, t in ends.items() if s in app.applied]
