"""Joint checkpoints of a sharded job: the time of one joint save (updater.joint.save_round) by 1, 2
and 4 appliance processes holding the same total state (a TP=4 job: four DP groups, dealt
round-robin to the appliances), against ``dcp.save`` of the same state, unsharded, from one
process, and against one appliance's committed single checkpoint (updater.persist).

Every replica is a real Replica that has applied one iteration (Adam state present). Each process
runs in its own spawned interpreter; a round is timed on the coordinator between two barriers.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from mirrorckpt.config import shards
from mirrorckpt.config.layout import BucketSpec, JobLayout, ParamSpec
from mirrorckpt.config.training import TrainingSpec
from mirrorckpt.parser.iteration import ReducedIteration
from mirrorckpt.tools.testbed.harness import free_port

TP, LAYERS = 4, 4


def _params(nparams: int) -> tuple[list[ParamSpec], dict]:
    """LAYERS square Linear weights (column/row parallel in turn) and their biases."""
    d = int((nparams / LAYERS) ** 0.5) // TP * TP
    params, plan = [], {}
    for i in range(LAYERS):
        params += [ParamSpec(f"{i}.weight", (d, d)), ParamSpec(f"{i}.bias", (d,))]
        plan[f"{i}.weight"] = (i % 2, 0)
        plan[f"{i}.bias"] = (0 if i % 2 == 0 else None, 0)
    return params, plan


def _replica(specs: list[ParamSpec], seed: int, steps: int):
    from mirrorckpt.updater.replica import Replica

    g = torch.Generator().manual_seed(seed)
    layout = JobLayout(params=specs, buckets=[BucketSpec(tuple(range(len(specs))))])
    r = Replica(layout, TrainingSpec(), {p.name: torch.randn(p.shape, generator=g) for p in specs})
    for i in range(steps):
        r.apply(ReducedIteration(i, [torch.randn(layout.total_numel, generator=g).numpy()]))
    return r


def _member(rank: int, world: int, address: str, nparams: int, root: str, reps: int, result: str) -> None:
    import torch.distributed as dist
    from mirrorckpt.updater import joint

    torch.set_num_threads(1)
    params, plan = _params(nparams)
    layout = shards.build(params, plan, TP, 1, 2, appliances=[f"a{i}" for i in range(world)])
    joint.init_group(address, rank, world, timeout_s=300)
    jp = joint.JointPersister(layout, [f"a{rank}"], root, keep_last=1)
    reps_s = []
    for step in range(1, reps + 1):
        for g in layout.groups_of(f"a{rank}"):
            jp.offer(g.name, _replica(layout.group_params(g.name), step, step))
        dist.barrier()
        t0 = time.perf_counter()
        path = jp.save_round()
        dist.barrier()
        reps_s.append(time.perf_counter() - t0)
        assert path is not None
    jp.close()
    if rank == 0:
        Path(result).write_text(json.dumps({"seconds": reps_s}))
    dist.destroy_process_group()


def _address() -> str:
    return f"127.0.0.1:{free_port()}"


def joint_save(world: int, nparams: int, scratch: Path, reps: int) -> list[float]:
    ctx = mp.get_context("spawn")
    root, res = scratch / f"joint-{world}", scratch / f"joint-{world}.json"
    addr = _address()
    procs = [ctx.Process(target=_member, args=(r, world, addr, nparams, str(root), reps, str(res)))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"joint save with {world} appliances: exit codes {[p.exitcode for p in procs]}")
    shutil.rmtree(root, ignore_errors=True)
    return json.loads(res.read_text())["seconds"]


def single(nparams: int, scratch: Path, reps: int) -> dict:
    """The same state unsharded in one process: dcp.save alone, and a committed checkpoint."""
    from mirrorckpt.updater.ckptdir import dcp_module
    from mirrorckpt.updater.persist import write_checkpoint

    torch.set_num_threads(1)
    params, _ = _params(nparams)
    out = {"dcp_save": [], "write_checkpoint": []}
    dcp = dcp_module()
    for step in range(1, reps + 1):
        r = _replica(params, step, step)
        sd = r.state_dict_for_checkpoint()
        d = scratch / f"dcp-{step}"
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(d, single_file_per_rank=True, sync_files=True,
                                                         thread_count=1), no_dist=True)
        out["dcp_save"].append(time.perf_counter() - t0)
        shutil.rmtree(d)
        t0 = time.perf_counter()
        write_checkpoint(scratch / "single", sd, keep_last=1)
        out["write_checkpoint"].append(time.perf_counter() - t0)
    shutil.rmtree(scratch / "single", ignore_errors=True)
    return out


def run(nparams: int = 16_000_000, reps: int = 3, directory: str | None = None) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="bench-joint-", dir=directory))
    try:
        params, _ = _params(nparams)
        n = sum(p.numel for p in params)
        res = {"nparams": n, "state_MB": n * 12 / 1e6, "tp": TP, "groups": TP, "reps": reps}
        base = single(nparams, scratch, reps)
        ref = statistics.median(base["dcp_save"])
        res["dcp_save"] = {"median_s": ref, "all_s": base["dcp_save"]}
        res["write_checkpoint"] = {"median_s": statistics.median(base["write_checkpoint"]),
                                   "all_s": base["write_checkpoint"]}
        for world in (1, 2, 4):
            s = joint_save(world, nparams, scratch, reps)
            res[f"joint_{world}"] = {"median_s": statistics.median(s), "all_s": s,
                                     "of_dcp_save": statistics.median(s) / ref}
        return res
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    import sys

    print(json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 16_000_000,
                         reps=int(sys.argv[2]) if len(sys.argv) > 2 else 3), indent=1))
