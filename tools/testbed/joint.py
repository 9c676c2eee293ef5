"""Rigs for sharded jobs: appliance processes that follow generated DP rings and save joint
checkpoints together, and a TP-sharded (DTensor) reader of a joint checkpoint. Each ``*_main``
runs in its own process (multiprocessing spawn) and writes what it saw as JSON to ``result``."""

from __future__ import annotations

import json
import os
import signal
import traceback
from pathlib import Path


def _write(result, d: dict) -> None:
    Path(result).write_text(json.dumps(d, sort_keys=True))


def follow_rings(gen_dir, followed: list[str], joint=None):
    """RingSet over the generated captures of the DP groups ``followed`` (names), one Appliance
    per ring offering its replica to ``joint`` after every iteration."""
    from mirrorckpt.config.jobfile import load_job
    from mirrorckpt.config.training import TrainingSpec
    from mirrorckpt.tools.cmd_replay import open_stream
    from mirrorckpt.updater.appliance import Appliance
    from mirrorckpt.updater.rings import RingSet

    rings = RingSet()
    for name in followed:
        d = Path(gen_dir) / name
        job = load_job(d / "job.toml")
        captures = [str(d / m.source) for m in job.mirrors]
        app = Appliance(None, TrainingSpec.from_dict(job.training))
        if joint is not None:
            app.on_iteration = lambda _i, replica, g=name: joint.offer(g, replica)
        rings.add(name, open_stream(captures, job), app)
    return rings


def appliance_main(name: str, rank: int, world: int, address: str, gen_dir: str, root: str, rounds_at: list[int],
                   result: str, every: int = 1, kill_in_round: int | None = None, names: list[str] | None = None):
    """One appliance process: follows the groups of appliance ``name`` (or of every name in
    ``names``), joins the appliances' group and runs a joint round once all its rings reached each
    step of ``rounds_at`` (and a last one at the end). ``kill_in_round``: SIGKILL itself in that
    round, after writing its files and before the coordinator's commit."""
    out = {"rounds": [], "errors": []}
    try:
        from mirrorckpt.config.shards import ShardedLayout
        from mirrorckpt.updater import joint as joint_mod

        layout = ShardedLayout.from_dict(json.loads((Path(gen_dir) / "shards.json").read_text()))
        joint_mod.init_group(address, rank, world, timeout_s=30)
        mine = names or [name]
        jp = joint_mod.JointPersister(layout, mine, root, every=every, hold=4)
        if kill_in_round is not None:
            from torch.distributed.checkpoint import FileSystemWriter

            write = FileSystemWriter.write_data

            def write_then_die(self, plan, planner):
                fut = write(self, plan, planner)
                if jp.stats.rounds == kill_in_round:
                    fut.wait()
                    os.kill(os.getpid(), signal.SIGKILL)
                return fut

            FileSystemWriter.write_data = write_then_die
        todo = list(rounds_at)

        def one_round():
            try:
                path = jp.save_round()
                out["rounds"].append(str(path) if path else None)
            except joint_mod.JointSaveError as e:
                out["errors"].append(str(e))

        def on_pass(_rings):
            while todo and max(jp.held(), default=0) >= todo[0]:
                todo.pop(0)
                one_round()

        rings = follow_rings(gen_dir, [g.name for n in mine for g in layout.groups_of(n)], jp)
        rings.run(on_pass)
        for _ in todo:  # streams ended before these steps: the rounds still pair up
            one_round()
        out["applied"] = {n: a.summary.iterations_applied for n, a in rings.appliances().items()}
        out["stats"] = {k: v for k, v in jp.stats.__dict__.items()}
        jp.close()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out["fatal"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    _write(result, out)


def dtensor_load_main(rank: int, world: int, address: str, root: str, result: str):
    """A TP=``world`` trainer process: the joint checkpoint loaded by dcp.load into DTensors laid
    out by the checkpoint's own plan (Shard(tp_dim) or Replicate on a 1-d CPU mesh); writes the
    sha256 of each local shard."""
    out = {}
    try:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from mirrorckpt.config.shards import ShardedLayout
        from mirrorckpt.updater import ckptdir
        from mirrorckpt.updater.joint import fqn_of, init_group
        from mirrorckpt.updater.manifest import read_manifest, tensor_sha256
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
        from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor

        init_group(address, rank, world)
        d = ckptdir.latest(root)
        layout = ShardedLayout.from_dict(read_manifest(d)["joint"]["shards"])
        mesh = DeviceMesh("cpu", list(range(world)))
        md = dcp.FileSystemReader(d).read_metadata()
        dims = {g.shards[i].fqn: g.shards[i].tp_dim for g in layout.groups for i in range(len(g.shards))}
        sd: dict = {}
        for key, m in md.state_dict_metadata.items():
            if not hasattr(m, "chunks"):
                continue
            fqn = fqn_of(key)
            if fqn is None:
                continue
            dim = dims[fqn] if len(m.size) else None
            place = [Shard(dim)] if dim is not None else [Replicate()]
            sd[key] = distribute_tensor(torch.zeros(m.size, dtype=m.properties.dtype), mesh, place)
        dcp.load(sd, storage_reader=dcp.FileSystemReader(d), planner=DefaultLoadPlanner(allow_partial_load=True))
        out["shards"] = {k: {"sha256": tensor_sha256(v.to_local()), "shape": list(v.to_local().shape),
                             "placement": str(v.placements[0])} for k, v in sd.items()}
        extra = {"extra.step": None}
        dcp.load(extra, storage_reader=dcp.FileSystemReader(d), planner=DefaultLoadPlanner(allow_partial_load=True))
        out["step"] = extra["extra.step"]
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        out["fatal"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    _write(result, out)


SECRET = "joint-rig-secret-0123456789abcdef"


def register_message(layout, group: str, full: dict, training: dict, **extra):
    """The sharded REGISTER of ``group`` (config.shards.ShardedLayout) at step 0, its initial state
    its slices of ``full`` (FQN -> global tensor): blocks, or flat ranges of them; ``extra``: more
    REGISTER fields (weights_only)."""
    from mirrorckpt.config.layout import BucketSpec, JobLayout
    from mirrorckpt.control import messages as m

    g = layout.group(group)
    state = {}
    for s in g.shards:
        block = full[s.fqn][tuple(slice(o, o + n) for o, n in zip(s.offset, s.shape))]
        state[f"p:{s.fqn}"] = (block if s.flat is None else block.reshape(-1)[s.flat[0]:s.flat[1]]).clone()
    job = g.job_layout() if g.wire is not None else JobLayout(layout.group_params(group),
                                                               [BucketSpec(tuple(range(len(g.shards))))])
    return m.make(m.REGISTER, state, job="j", step=0, run="r1", layout=job.to_dict(), ring=None, training=training,
                  shards=layout.to_dict(), group=group, **extra)


def registered_joint_main(layouts: list[dict], weights: str, address: str, roots: list[str], result: str):
    """One appliance process following every group of each of ``layouts`` in turn: each group's
    plane takes its registration with its slices of the weights saved at ``weights`` (FQN ->
    tensor), then one joint round writes them (step 0) under that layout's root."""
    out: dict = {"committed": []}
    try:
        import torch
        from mirrorckpt.config.shards import ShardedLayout
        from mirrorckpt.config.training import OptimizerSpec, TrainingSpec
        from mirrorckpt.control.sharded_appliance import ShardedAppliance
        from mirrorckpt.updater.joint import init_group

        init_group(address, 0, 1, timeout_s=30)
        full = torch.load(weights)
        training = TrainingSpec(optimizer=OptimizerSpec(name="adamw", lr=0.01)).to_dict()
        for layout, root in zip(layouts, roots):
            lay = ShardedLayout.from_dict(layout)
            sa = ShardedAppliance(SECRET, lay.appliances[0], [g.name for g in lay.groups])
            for g in lay.groups:
                sa.planes[g.name]._on_register(register_message(lay, g.name, full, training), None)
            sa.open_joint(root)
            out["committed"].append(str(sa.save_round()))
            sa.stop()
    except BaseException as e:  # noqa: BLE001
        out["fatal"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    _write(result, out)
