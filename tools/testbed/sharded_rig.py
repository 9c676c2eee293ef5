"""The rig of the real sharded jobs (tp_dp_job, pp_dp_job): one appliance process per DP group,
then 4-process training jobs attached to them, each rank reporting to a JSON file."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import time
from pathlib import Path

from mirrorckpt.tools.testbed.harness import free_port

CTX = mp.get_context("spawn")


class RigError(AssertionError):
    """A process of the rig failed or did not answer in time."""


def wait_file(path: Path, timeout: float, procs) -> dict:
    """The JSON a process writes at ``path``; fails early when one of ``procs`` died."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            return json.loads(path.read_text())
        if any(not p.is_alive() and p.exitcode not in (None, 0) for p in procs):
            break
        time.sleep(0.05)
    raise RigError(f"{path.name} did not appear in {timeout} s")


def run_job(trainer_main, out: Path, appliances: dict, args: tuple, world: int = 4, timeout: float = 90) -> list[dict]:
    """``world`` ranks of ``trainer_main(rank, world, port, appliances, out, *args, result_path)``;
    every rank's report, checked for a fatal error."""
    out.mkdir()
    port = free_port()
    results = [out / f"rank{rank}.json" for rank in range(world)]
    procs = [CTX.Process(target=trainer_main, args=(rank, world, port, appliances, str(out), *args, str(res)))
             for rank, res in enumerate(results)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            for q in procs:
                q.kill()
            raise RigError(f"job {out.name}: a rank did not finish in {timeout:g} s")
    got = [json.loads(r.read_text()) if r.exists() else {"died": True} for r in results]
    for r in got:
        if "fatal" in r or "died" in r:
            raise RigError(f"job {out.name}: {r}")
    return got


@contextlib.contextmanager
def appliances(appliance_main, tmp: Path, groups: list[str], parts: int):
    """One appliance process per DP group (``appliance-K`` follows ``groups[K]``), joined over one
    rendezvous, writing to ``tmp / "root"``. Yields (their control ports by name, their result files);
    at exit they are told to stop and joined."""
    root, stop = tmp / "root", tmp / "stop"
    addr = f"127.0.0.1:{free_port()}"
    procs, results, ports = [], [], {}
    for r, g in enumerate(groups):
        res, pf = tmp / f"appliance{r}.json", tmp / f"ports{r}.json"
        results.append(res)
        p = CTX.Process(target=appliance_main, args=(f"appliance-{r}", [g], r, len(groups), addr, str(root), str(pf),
                                                     str(stop), str(res)), kwargs={"parts": parts})
        p.start()
        procs.append((p, pf))
    try:
        for p, pf in procs:
            ports.update(wait_file(pf, 60, [p]))
        yield ports, results, [p for p, _ in procs]
    finally:
        stop.write_text("")
        for p, _ in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def hold_for_fallback(link, report: dict, timeout: float = 60.0) -> None:
    """A group leader waits (before its optimizer step) until its appliance asked for a fallback,
    then lets it start: every group's fallback begins at the same step, which a joint checkpoint
    needs. ``report["held_for_request"]`` says whether the request came."""
    end = time.monotonic() + timeout
    while not link.fallback_pending and time.monotonic() < end:
        time.sleep(0.01)
    report["held_for_request"] = link.fallback_pending
    link.defer_fallbacks = False


def assert_tensors_equal(got: dict, want: dict, what) -> None:
    """The same keys, each tensor bit for bit (``what`` names the comparison in a failure)."""
    import torch

    assert set(got) == set(want), what
    for k in want:
        assert torch.equal(got[k], want[k]), (what, k)


def assert_model_and_optimizer_equal(path: Path, want: dict) -> None:
    """The model and optimizer tensors of the checkpoint at ``path`` equal ``want`` (flat key ->
    tensor, any shape of the same elements), bit for bit and key for key."""
    import torch
    from mirrorckpt.updater import ckptdir, restore

    md = ckptdir.dcp_module().FileSystemReader(path).read_metadata()
    got = restore._read_flat(path, [k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")], md)
    got = {k: v for k, v in got.items() if k.startswith(("model.", "optim.state."))}
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v.reshape(got[k].shape)), k


def end_rank(link, report: dict) -> None:
    """A rank's run is over: its link closed (``report["fallbacks"]``: the checkpoints it made)
    and the process group left."""
    import torch.distributed as dist

    if link is not None:
        link.close()
        report["fallbacks"] = link.stats.fallbacks
    dist.destroy_process_group()
