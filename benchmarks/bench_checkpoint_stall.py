"""Training stall per checkpoint on one CPU training job, measured in one run: none, torch.save,
dcp.save, dcp.async_save, the GoCkpt fallback (k = 1, 3, 7) and mirror mode; plus restore time
from appliance memory versus from disk.

The job is a 4-layer MLP (about 8 M parameters, Adam: about 95 MB of state) stepped in this
process. The appliance runs in a separate process (as it would on its own machine), so its
rebuild work does not compete with the training thread for the GIL.

Stall definitions:
* synchronous saves: the time the save call holds the training loop;
* dcp.async_save: the call (staging) plus any wait for the previous save at the next checkpoint;
* GoCkpt: the time the training thread spends on the checkpoint inside the optimizer hooks
  (``hook_stall_ms``: launching copies, waiting for parts that are late), and as a cross-check the
  excess of the k+1 affected steps over the median step without checkpointing (``step_excess_ms``);
* mirror mode: a checkpoint every iteration with no checkpoint work on the trainer; its stall is
  the step time of a 2-rank DDP job with the appliance attached and following it (frame stream,
  parser, replica, control link; tools/testbed/failures.py) minus the same job's step without it,
  less the test rig's making of the frames (a NIC's work on a real system), timed apart in the same
  steps. On this machine the appliance shares the trainers' cores, so this is an upper bound. The
  link's own per-step cost (STEP_META, a fingerprint every 10 steps) is measured on the main job.

Run: ``python -m mirrorckpt.benchmarks.bench_checkpoint_stall`` (prints JSON). Each function
returns a dict; nothing is written outside a temporary directory.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

SECRET = "bench-secret-0123456789abcdef-xyz"
DIMS = (1024, 1536, 1536, 1536, 1024)


class Job:
    def __init__(self, seed: int = 0, threads: int = 1):
        from mirrorckpt.tools.testbed.harness import Shard, build_model

        torch.set_num_threads(threads)
        self.model = build_model(DIMS, seed)
        torch.manual_seed(seed)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3, foreach=False)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=50, gamma=0.5)
        self.shard = Shard(DIMS, seed, 0, batch=32)

    def step(self) -> float:
        t0 = time.perf_counter()
        x, y = self.shard.next()
        self.opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(self.model(x), y).backward()
        self.opt.step()
        self.sched.step()
        return time.perf_counter() - t0

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    @property
    def state_bytes(self) -> int:
        n = sum(p.numel() * p.element_size() for p in self.model.parameters())
        for s in self.opt.state.values():
            n += sum(v.numel() * v.element_size() for v in s.values() if isinstance(v, torch.Tensor))
        return n


def _ms(xs) -> dict:
    xs = [x * 1e3 for x in xs]
    return {"median_ms": round(statistics.median(xs), 2), "min_ms": round(min(xs), 2), "max_ms": round(max(xs), 2),
            "n": len(xs)}


def bench_none(job: Job, steps: int = 20) -> dict:
    for _ in range(3):
        job.step()
    return {"step": _ms([job.step() for _ in range(steps)])}


def _sync_saves(job: Job, save, rounds: int, between: int) -> dict:
    stalls = []
    for r in range(rounds):
        for _ in range(between):
            job.step()
        t0 = time.perf_counter()
        save(r)
        stalls.append(time.perf_counter() - t0)
    return {"stall": _ms(stalls)}


def bench_torch_save(job: Job, tmp: Path, rounds: int = 3, between: int = 4) -> dict:
    return _sync_saves(job, lambda r: torch.save(job.state(), tmp / f"torch-{r}.pt"), rounds, between)


def bench_dcp_save(job: Job, tmp: Path, rounds: int = 3, between: int = 4) -> dict:
    import torch.distributed.checkpoint as dcp

    return _sync_saves(job, lambda r: dcp.save(job.state(), checkpoint_id=str(tmp / f"dcp-{r}")), rounds, between)


def bench_dcp_async_save(job: Job, tmp: Path, rounds: int = 3, between: int = 4) -> dict:
    import torch.distributed.checkpoint as dcp

    stalls, fut = [], None
    for r in range(rounds):
        for _ in range(between):
            job.step()
        t0 = time.perf_counter()
        if fut is not None:
            fut.result()  # the previous save must be done before the next starts
        fut = dcp.async_save(job.state(), checkpoint_id=str(tmp / f"async-{r}"))
        stalls.append(time.perf_counter() - t0)
    fut.result()
    return {"stall": _ms(stalls)}


# ---------------------------------------------------------------------------- the appliance process

def _appliance_main(conn, root: str) -> None:
    import logging

    from mirrorckpt.config.training import PersistSpec
    from mirrorckpt.control.appliance_side import AppliancePlane

    logging.basicConfig(level=logging.WARNING)
    plane = AppliancePlane(SECRET, parts=7, fingerprint_every=10, fallback_timeout=600,
                           persist=PersistSpec(directory=root, every_iterations=10**9, keep_last=2)).start()
    conn.send(plane.port)
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            plane.stop()
            conn.send("stopped")
            return
        if cmd[0] == "registered":
            end = time.monotonic() + 120
            while plane.replica is None and time.monotonic() < end:
                time.sleep(0.01)
            conn.send(plane.replica is not None)
        elif cmd[0] == "fallback":
            plane.parts = cmd[1]
            done = plane.stats.fallbacks_done
            plane.request_fallback(f"benchmark k={cmd[1]}")
            end = time.monotonic() + 300
            while plane.stats.fallbacks_done == done and time.monotonic() < end:
                time.sleep(0.005)
            ok = plane.stats.fallbacks_done > done
            if ok and plane.app.persister is not None:
                plane.app.persister.flush(120)
            conn.send({"done": ok, "step": plane.replica.iterations_done if ok else None})


class ApplianceProcess:
    def __init__(self, root: Path):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_appliance_main, args=(child, str(root)), daemon=True)
        self.proc.start()
        self.port = self.conn.recv()

    def ask(self, *cmd):
        self.conn.send(cmd)

    def stop(self) -> None:
        self.ask("stop")
        self.conn.recv()
        self.proc.join(30)


def bench_gockpt(job: Job, link, app: ApplianceProcess, k: int, rounds: int = 3) -> dict:
    stalls, excess, steps_per = [], [], []
    for _ in range(rounds):
        baseline_s = statistics.median(job.step() for _ in range(5))  # this round's own baseline
        n_before = len(link.stats.fallbacks)
        app.ask("fallback", k)
        durations = []
        while len(link.stats.fallbacks) == n_before:  # steps until the trainer has sent the last part
            durations.append(job.step())
            if len(durations) > 200:
                raise RuntimeError("fallback did not finish in 200 steps")
        rec = link.stats.fallbacks[-1]
        reply = app.conn.recv()
        if not reply["done"]:
            raise RuntimeError("the appliance did not verify the fallback")
        span = durations[-(rec["parts"] + 1):]  # steps N .. N+k carry the checkpoint's work
        stalls.append(rec["stall_s"])
        excess.append(max(0.0, sum(span) - len(span) * baseline_s))
        steps_per.append(len(durations))
    return {"parts": k, "hook_stall": _ms(stalls), "step_excess": _ms(excess)}


def bench_mirror(job: Job, link, steps: int = 30) -> dict:
    h0, s0 = link.stats.hook_seconds, link.stats.steps
    d = [job.step() for _ in range(steps)]
    per_step = (link.stats.hook_seconds - h0) / (link.stats.steps - s0)
    return {"link_per_step_ms": round(per_step * 1e3, 3), "step": _ms(d), "fingerprint_every": link.fingerprint_every}


MIRROR_DIMS = (256, 1024, 1024, 128)


def bench_mirror_following(tmp: Path, steps: int = 60, rounds: int = 2, dims=MIRROR_DIMS) -> dict:
    """Per-step cost of mirror mode on a 2-rank DDP job: step time with the appliance attached and
    following, minus without, minus the rig's frame making; rounds alternate the two."""
    import math

    from mirrorckpt.tools.testbed import failures

    runs = {"none": [], "mirror": []}
    for k in range(rounds):
        for s in ("none", "mirror"):
            runs[s].append(failures.run_strategy(s, tmp / f"mirror-{k}", steps=steps, every=steps, mtbf_s=math.inf,
                                                 seed=0, dims=dims, device_s=0.0))

    def mean(xs):
        return statistics.fmean(xs) if xs else 0.0

    def steps_of(s, attr="step_s"):
        return [x for r in runs[s] for x in getattr(r, attr)]

    base, mir, rig = mean(steps_of("none")), mean(steps_of("mirror")), mean(steps_of("mirror", "rig_s"))
    net = [a - b for a, b in zip(steps_of("mirror"), steps_of("mirror", "rig_s"))]
    plain = steps_of("none")
    # two standard errors of the difference of the means: how far from zero it is noise
    noise = 2 * math.sqrt(statistics.variance(net) / len(net) + statistics.variance(plain) / len(plain))
    m = runs["mirror"][-1]
    return {"dims": list(dims), "params": sum(dims[k] * dims[k + 1] + dims[k + 1] for k in range(len(dims) - 1)),
            "world": 2, "steps": steps, "rounds": rounds,
            "step_none_ms": _ms(steps_of("none")), "step_mirror_ms": _ms(steps_of("mirror")),
            "mean_step_none_ms": round(base * 1e3, 2), "mean_step_mirror_ms": round(mir * 1e3, 2),
            "rig_frames_ms": round(rig * 1e3, 2), "link_ms": round(mean(steps_of("mirror", "link_s")) * 1e3, 3),
            "stall_per_checkpoint_ms": round((mir - rig - base) * 1e3, 2), "noise_ms": round(noise * 1e3, 2),
            "appliance_lag_ms": _ms(m.lag_s) if m.lag_s else None,
            "followed_steps": len(m.lag_s), "appliance": {k: v for k, v in m.appliance.items() if k != "events"}}


def bench_restore(job: Job, app: ApplianceProcess, root: Path, rounds: int = 3) -> dict:
    from mirrorckpt.control.trainer import restore_from_appliance, restore_from_disk

    mem, disk = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        r = restore_from_appliance(job.model, job.opt, appliance=("127.0.0.1", app.port), secret=SECRET,
                                   scheduler=job.sched, data=job.shard)
        mem.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        d = restore_from_disk(job.model, job.opt, root, scheduler=job.sched, data=job.shard)
        disk.append(time.perf_counter() - t0)
    return {"memory": _ms(mem), "disk": _ms(disk), "memory_step": r.iterations_done, "disk_step": d.iterations_done}


def run_all() -> dict:
    from mirrorckpt.control.trainer import attach

    if not dist.is_initialized():  # dcp.async_save wants a process group; one rank, gloo
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    out: dict = {}
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        job = Job()
        out["job"] = {"dims": list(DIMS), "params": sum(p.numel() for p in job.model.parameters()),
                      "threads": torch.get_num_threads()}
        none = bench_none(job)
        out["none"] = none
        out["job"]["state_MB"] = round(job.state_bytes / 1e6, 1)
        out["torch.save"] = bench_torch_save(job, tmp)
        out["dcp.save"] = bench_dcp_save(job, tmp)
        out["dcp.async_save"] = bench_dcp_async_save(job, tmp)
        app = ApplianceProcess(tmp / "appliance")
        try:
            link = attach(job.model, job.opt, appliance=("127.0.0.1", app.port), secret=SECRET, scheduler=job.sched,
                          data=job.shard, fingerprint_every=10, connect_timeout=30)
            # the job already trained: the appliance has no state for it and asks for a fallback
            app.ask("registered")
            for _ in range(400):
                job.step()
                if app.conn.poll(0):
                    break
            if not app.conn.recv():
                raise RuntimeError("the appliance did not get the job's state")
            out["mirror"] = bench_mirror(job, link)
            for k in (1, 3, 7):
                out[f"gockpt_k{k}"] = bench_gockpt(job, link, app, k)
            link.close()
            out["none_after"] = bench_none(job)  # the baseline again, under the load of the end of the run
            out["restore"] = bench_restore(job, app, tmp / "appliance")
        finally:
            app.stop()
        out["mirror"]["following"] = bench_mirror_following(tmp)
        out["mirror"]["stall_per_checkpoint_ms"] = out["mirror"]["following"]["stall_per_checkpoint_ms"]
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    print(json.dumps(run_all(), indent=1))
