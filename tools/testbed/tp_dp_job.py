"""A real TP=2 x DP=2 CPU job (gloo, DeviceMesh, DTensor) attached through the control plane to
the appliances that follow its two DP groups. Each ``*_main`` runs in its own process
(multiprocessing spawn) and writes what it saw as JSON to ``result``.

The trainer: ``init_device_mesh("cpu", (2, 2), ("dp", "tp"))``, an MLP whose first Linear is
``ColwiseParallel`` and second ``RowwiseParallel`` (``parallelize_module`` on the TP dimension),
a DDP-style mean all-reduce of every local gradient over the DP dimension, Adam (for-loop, the
replica's arithmetic). Every rank builds the model from the same seed; each DP rank draws its own
batches (both TP ranks of a DP rank the same). After every step all ranks gather the full state
(``full_tensor``) and rank 0 saves it (``state_<step>.pt``): the trainer's own state to compare
checkpoints and resumed runs with. ``hold_step``: the group leaders wait before that step's
optimizer step until their appliance's fallback request arrived (``link.defer_fallbacks`` keeps
it pending until then), so both groups' GoCkpt checkpoints start at the same step: this rig's
appliances follow no mirror traffic, the state reaches them by the fallbacks alone, and a joint
checkpoint needs a step both hold.

The appliance: ``control.sharded_appliance.ShardedAppliance`` for its groups, in the appliances'
gloo group (``updater.joint.init_group``); once its groups registered it asks each for a fallback,
waits for the rebuilt, verified replicas, runs joint rounds until one commits, then serves
restores until ``stop`` appears.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

DIMS = (16, 32, 8)
SECRET = b"tp-dp-rig-secret-0123456789abcdef"


def _write(path, d: dict) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(d, sort_keys=True, default=str))
    os.replace(tmp, path)


def build(mesh, seed: int = 3):
    import torch
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(DIMS[0], DIMS[1]), nn.ReLU(), nn.Linear(DIMS[1], DIMS[2]))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False, fused=False)
    return model, opt


def batch(dp_rank: int, step: int, n: int = 8):
    import torch

    g = torch.Generator().manual_seed(1_000 * step + dp_rank)
    return torch.randn(n, DIMS[0], generator=g), torch.randn(n, DIMS[-1], generator=g)


def full_state(model, opt) -> dict:
    """The trainer's whole state as plain tensors under the checkpoint's keys (collective)."""
    out = {}
    for n, p in model.named_parameters():
        out[f"model.{n}"] = p.detach().full_tensor().clone()
        for k, v in sorted(opt.state.get(p, {}).items()):  # the same order on every rank: full_tensor gathers
            out[f"optim.state.{n}.{k}"] = v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
    return out


def trainer_main(rank: int, world: int, port: int, appliances: dict, out: str, steps: int, hold_step: int,
                 parts: int, restore: str, result: str):
    """One rank of the job. ``appliances``: group -> [host, port]. ``restore``: "" (train from the
    start, attached), "appliance" (every rank pulls its own shard from its group's appliance) or a
    checkpoint root (every rank loads its DTensor shards of the joint checkpoint: dcp.load through
    ``updater.restore.load_into``); a restored job goes on unattached."""
    res: dict = {"rank": rank}
    try:
        import torch
        import torch.distributed as dist
        from mirrorckpt.control.sharded import attach_sharded, restore_sharded
        from mirrorckpt.tools.testbed.sharded_rig import end_rank, hold_for_fallback
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh.get_local_rank("dp")
        dp_group = mesh.get_group("dp")
        model, opt = build(mesh, seed=3 if not restore else 99)  # a resumed job's weights all come restored
        addrs = {g: (h, int(p)) for g, (h, p) in appliances.items()}
        link, start = None, 0
        t0 = time.monotonic()
        if restore == "appliance":
            r = restore_sharded(model, opt, appliances=addrs, secret=SECRET, mesh=mesh)
            start = r.iterations_done
            res["restored"] = {"source": r.source, "iterations_done": r.iterations_done}
        elif restore:
            from mirrorckpt.updater.restore import load_into

            r = load_into(model, opt, restore)
            start = r.iterations_done
            res["restored"] = {"source": str(r.path), "iterations_done": r.iterations_done}
        else:
            link = attach_sharded(model, opt, mesh, appliances=addrs, secret=SECRET, parts=parts, job="tp-dp-rig",
                                  connect_timeout=30)
            res["leader"] = link.leader
            link.defer_fallbacks = True  # both groups' fallbacks start after step hold_step
            res["layout_digest"] = link.shards.digest()
        res["attach_s"] = time.monotonic() - t0
        outd = Path(out)
        if restore:
            st = full_state(model, opt)  # what was restored, before any step
            if rank == 0:
                torch.save(st, outd / f"state_{start}.pt")
        for step in range(start, steps):
            x, y = batch(dp_rank, step)
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            for p in model.parameters():  # DDP's mean over the DP dimension, per local gradient
                g = p.grad.to_local()
                g.mul_(1.0 / mesh.size(0))
                dist.all_reduce(g, group=dp_group)
            if link is not None and link.leader and step == hold_step:
                hold_for_fallback(link, res)
            opt.step()
            st = full_state(model, opt)
            if rank == 0:
                torch.save(st, outd / f"state_{step + 1}.pt")
        res["steps_done"] = steps
        end_rank(link, res)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        res["fatal"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    _write(result, res)


def appliance_main(name: str, groups: list[str], rank: int, world: int, joint_address: str, root: str,
                   ports_file: str, stop_file: str, result: str, parts: int = 3, timeout: float = 90.0):
    out: dict = {"name": name}
    sa = None
    try:
        from mirrorckpt.control.sharded_appliance import ShardedAppliance
        from mirrorckpt.updater.joint import JointSaveError, init_group

        init_group(joint_address, rank, world, timeout_s=timeout)
        sa = ShardedAppliance(SECRET, name, groups, parts=parts, fallback_timeout=timeout).start()
        _write(ports_file, {g: ["127.0.0.1", p] for g, p in sa.ports().items()})
        end = time.monotonic() + timeout
        while not sa.wait_registered(0.1):
            if os.path.exists(stop_file) or time.monotonic() > end:
                raise TimeoutError("the trainer's groups did not register")
        out["registered_steps"] = sa.steps()
        out["fallbacks_asked"] = sa.request_fallbacks("this rig follows no mirror traffic: the state comes by GoCkpt")
        while any(p.stats.fallbacks_done < 1 for p in sa.planes.values()) and time.monotonic() < end \
                and not os.path.exists(stop_file):
            time.sleep(0.02)
        out["fallbacks"] = {g: {"done": p.stats.fallbacks_done, "failed": p.stats.fallbacks_failed,
                                "events": [e for e in p.stats.events if e[0] in ("resynced", "fallback_unverified")]}
                            for g, p in sa.planes.items()}
        out["steps"] = sa.steps()
        sa.open_joint(root, every=1, hold=4)
        rounds = []
        while time.monotonic() < end:  # every appliance calls the same rounds: they pair up
            try:
                path = sa.save_round()
            except JointSaveError as e:
                rounds.append(f"error: {e}")
                break
            rounds.append(str(path) if path else None)
            if path is not None:
                break
            time.sleep(0.05)
        out["rounds"] = rounds
        out["joint"] = {k: v for k, v in sa.joint.stats.__dict__.items()}
        _write(result, out)
        while not os.path.exists(stop_file) and time.monotonic() < end + timeout:
            time.sleep(0.05)
        out["restores"] = {g: dict(p.stats.restores) for g, p in sa.planes.items()}
        out["stopped"] = True
    except BaseException as e:  # noqa: BLE001
        out["fatal"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        if sa is not None:
            sa.stop()
    _write(result, out)
