"""Large states (issue 15): a GoCkpt fallback and a restore against the state's size, and a committed
checkpoint against a plain sequential write + fsync of the same bytes, per DCP writer-thread count.

The fallback runs in one process: a trainer (AdamW in two param groups, OneCycleLR, fp32) attached
to an ``AppliancePlane`` over loopback, asked for a one-part fallback; timed from the request to
the verified resync (two training steps are inside it), and the trainer's stall. The restore is
``restore_from_appliance`` into a fresh model and optimizer (the state streamed in 64 MiB frames).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch
from mirrorckpt.benchmarks.bench_updater import _iteration, _replica, plain_write_seconds
from mirrorckpt.config.training import PersistSpec
from mirrorckpt.control.appliance_side import AppliancePlane
from mirrorckpt.control.trainer import attach, restore_from_appliance
from mirrorckpt.updater.persist import write_checkpoint
from torch import nn

SECRET = "bench-large-secret-0123456789abcdef"


def _job(nparams: int, width: int = 2048):
    """An MLP of about ``nparams`` parameters, its AdamW (decay on matrices only) and OneCycleLR."""
    layers = max(1, round(nparams / (width * width + width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    decay = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
                            lr=3e-4, foreach=False)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=1000)
    return model, opt, sched


def _step(model, opt, sched, width: int = 2048) -> None:
    x = torch.randn(4, width)
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()
    sched.step()


def fallback_and_restore(nparams: int) -> dict:
    model, opt, sched = _job(nparams)
    n = sum(p.numel() for p in model.parameters())
    plane = AppliancePlane(SECRET, parts=1, fingerprint_every=0, fallback_timeout=600).start()
    link = attach(model, opt, appliance=("127.0.0.1", plane.port), secret=SECRET, scheduler=sched, parts=1,
                  fingerprint_every=0, connect_timeout=30)
    try:
        _step(model, opt, sched)  # registers with the initial state
        assert link.flush(120) and plane.registered.wait(120)
        t0 = time.perf_counter()
        plane.request_fallback("benchmark")
        steps = 0
        while plane.stats.fallbacks_done == 0 and steps < 10:
            _step(model, opt, sched)
            steps += 1
            link.flush(300)
            f = plane.fallback
            end = time.monotonic() + (300 if f is not None and f.rebuild is not None else 1)
            while plane.stats.fallbacks_done == 0 and time.monotonic() < end:
                time.sleep(0.005)  # the last part is in: its verification, not another step
        fallback_s = time.perf_counter() - t0
        assert plane.stats.fallbacks_done == 1, plane.stats
        stall = link.stats.fallbacks[-1]["stall_s"]
        model2, opt2, sched2 = _job(nparams)
        t0 = time.perf_counter()
        restore_from_appliance(model2, opt2, appliance=("127.0.0.1", plane.port), secret=SECRET,
                               scheduler=sched2, timeout=600)
        restore_s = time.perf_counter() - t0
    finally:
        link.close()
        plane.stop()
    state = 12 * n
    return {"nparams": n, "state_bytes": state, "fallback_s": fallback_s, "fallback_steps": steps,
            "trainer_stall_s": stall, "restore_s": restore_s, "restore_GBps": state / restore_s / 1e9}


def commit_vs_plain(nparams: int, threads=(1, 2, 4), directory: str | None = None) -> dict:
    """One run: the same Adam state written plainly (one file, one fsync) and committed as a
    checkpoint with each writer-thread count."""
    layout, rep = _replica(nparams, 100, 4, "adamw", "forloop", "float32")
    rep.apply(_iteration(layout, 0))
    sd = rep.state_dict_for_checkpoint()
    tensors = [v for v in [*sd["model"].values(), *(x for s in sd["optim"]["state"].values() for x in s.values())]
               if isinstance(v, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    scratch = tempfile.mkdtemp(prefix="bench-commit-", dir=directory)
    out = {"nparams": layout.total_numel, "state_bytes": nbytes, "commits": []}
    try:
        out["plain_s"] = plain_write_seconds(tensors, os.path.join(scratch, "plain.bin"))
        for k in threads:
            t = time.perf_counter()
            write_checkpoint(os.path.join(scratch, f"t{k}"), sd, threads=k)
            s = time.perf_counter() - t
            out["commits"].append({"threads": k, "seconds": s, "GBps": nbytes / s / 1e9,
                                   "ratio_to_plain": out["plain_s"] / s})
            shutil.rmtree(os.path.join(scratch, f"t{k}"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out["plain_GBps"] = nbytes / out["plain_s"] / 1e9
    out["default_threads"] = PersistSpec().writer_threads
    return out


def run_all(sizes=(5_000_000, 20_000_000, 50_000_000), commit_params: int = 50_000_000) -> dict:
    return {"fallback": [fallback_and_restore(n) for n in sizes], "commit": commit_vs_plain(commit_params)}
