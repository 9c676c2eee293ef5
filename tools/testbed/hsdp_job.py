"""A real FSDP2 HSDP CPU job (gloo, 4 processes, mesh (dp_replicate=2, dp_shard=2), ``fully_shard``
on each Linear and on the root, AdamW with global-norm clipping) attached through the control plane
to the appliances that follow its two shard indices (``tools.testbed.tp_dp_job.appliance_main``:
both get the state by GoCkpt fallbacks and write one joint checkpoint). Each ``*_main`` runs in its
own process (multiprocessing spawn) and writes what it saw as JSON to ``result``.

The trainer: every rank is its own data-parallel rank (its own batches); the first Linear has 33
output rows, so shard 0 holds 17 and shard 1 16 rows plus one padding row in FSDP2's reduce
buffer. Every step each rank checks that what FSDP2 all-reduced over its replicate group (the
``set_all_reduce_hook`` sees each unit's buffer after the all-reduce) is laid out as the
registered layout says (``DpGroup.wire``: the unit order, each slice's gradient, zero padding).
Clipping goes through ``link.clip_grad_norm_`` (the job resumed unattached clips with torch's
``clip_grad_norm_``, the same operations). After every step all ranks gather the full state and
rank 0 saves it (``state_<step>.pt``).

A resumed job (``restore`` = the joint checkpoint root) restores the checkpoint's step in turn,
rank after rank (each waits for the previous one: a collective inside a restore would hang it):
from its group's appliance (``restore_sharded`` with the step), and from disk into a second HSDP
model (``restore.load_into``); then, together, from disk into FSDP2 on a 1-d mesh of 4 ranks and
into HSDP with 4 replicas of 1 shard; it saves each full state (``<how>_<step>.pt``), reports what
``attach_sharded`` says to the pure FSDP model and to HSDP reducing in bf16, and plain ``attach``
to an HSDP one, and trains the appliance-restored model on to ``steps``.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path

from mirrorckpt.tools.testbed.tp_dp_job import SECRET, _write, full_state

DIMS = (16, 33, 8)
MAX_NORM = 0.05  # below the gradients' norm: every step clips
MESH = ("dp_replicate", "dp_shard")


def build(mesh, seed: int = 3, **fsdp):
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(DIMS[0], DIMS[1]), nn.ReLU(), nn.Linear(DIMS[1], DIMS[2]))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, **fsdp)
    fully_shard(model, mesh=mesh, **fsdp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    return model, opt


def batch(rank: int, step: int, n: int = 8):
    import torch

    g = torch.Generator().manual_seed(1_000 * step + rank)
    return torch.randn(n, DIMS[0], generator=g), torch.randn(n, DIMS[-1], generator=g)


class WireCheck:
    """Records each FSDP2 unit's buffer as its replicate all-reduce leaves it and compares it with
    the layout's ``wire`` of this rank's group (after backward, before clipping touches the
    gradients)."""

    def __init__(self, model, group):
        self.group, self.seen, self.checked = group, [], 0
        self.params = dict(model.named_parameters())
        for name in ("0", "2"):
            model.get_submodule(name).set_all_reduce_hook(lambda out, name=name: self.seen.append((name, out.clone())))

    def check(self) -> None:
        import torch

        units = [name for name, _ in self.seen]
        if units != ["2", "0"]:  # the layout's order: reverse of the forward
            raise AssertionError(f"FSDP2 all-reduced units {units}, the layout says ['2', '0']")
        for (_, buf), segments in zip(self.seen, self.group.wire):
            if buf.numel() != sum(n for _, n in segments):
                raise AssertionError(f"all-reduce of {buf.numel()} elements, the layout says {segments}")
            pos = 0
            for i, n in segments:
                piece = buf[pos:pos + n]
                want = torch.zeros(n) if i < 0 else self.params[self.group.shards[i].fqn].grad.to_local().reshape(-1)
                if not torch.equal(piece, want):
                    what = "padding" if i < 0 else "that gradient"
                    raise AssertionError(f"segment ({i}, {n}) at {pos} is not {what}")
                pos += n
        self.seen.clear()
        self.checked += 1


def _in_turn(out: Path, rank: int, what: str, timeout: float = 30.0) -> None:
    """Wait until rank - 1 finished ``what`` alone."""
    end = time.monotonic() + timeout
    while rank and not (out / f"{what}{rank - 1}").exists():
        if time.monotonic() > end:
            raise TimeoutError(f"rank {rank - 1} did not finish {what} on its own in {timeout:g} s (a collective?)")
        time.sleep(0.01)


def _save(out: Path, rank: int, name: str, state: dict) -> None:
    import torch

    if rank == 0:
        torch.save(state, out / f"{name}.pt")


def _refusals(pure_fsdp, hsdp, addrs, mesh) -> dict:
    """What attach says to a pure FSDP job, to HSDP reducing in bf16, and plain ``attach`` to HSDP."""
    import torch
    from mirrorckpt.control.sharded import NotFollowable, attach_sharded
    from mirrorckpt.control.trainer import attach
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out = {}
    try:
        attach_sharded(*build(mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)), appliances=addrs,
                       secret=SECRET)
    except ValueError as e:
        out["bf16_reduce"] = str(e)
    try:
        attach_sharded(*pure_fsdp, appliances=addrs, secret=SECRET)
    except NotFollowable as e:
        out["pure_fsdp"] = str(e)
    try:
        attach(*hsdp, appliance=("127.0.0.1", 9), secret=SECRET)
    except ValueError as e:
        out["plain_attach"] = str(e)
    return out


def trainer_main(rank: int, world: int, port: int, appliances: dict, out: str, steps: int, hold_step: int,
                 parts: int, restore: str, result: str):
    """One rank. ``restore``: "" (train from the start, attached) or the joint checkpoint root (the
    resumed job, see the module text)."""
    res: dict = {"rank": rank}
    try:
        import torch
        import torch.distributed as dist
        from mirrorckpt.control.sharded import attach_sharded, restore_sharded
        from mirrorckpt.tools.testbed.sharded_rig import end_rank, hold_for_fallback
        from mirrorckpt.updater import ckptdir
        from mirrorckpt.updater.restore import load_into
        from torch import nn
        from torch.distributed.device_mesh import init_device_mesh

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=MESH)
        outd = Path(out)
        model, opt = build(mesh, seed=3 if not restore else 99)  # a resumed job's weights all come restored
        addrs = {g: (h, int(p)) for g, (h, p) in appliances.items()}
        link, start, wire = None, 0, None
        if restore:
            start = ckptdir.parse_step(ckptdir.latest(restore).name)
            _in_turn(outd, rank, "appliance")
            r = restore_sharded(model, opt, appliances=addrs, secret=SECRET, step=start)
            (outd / f"appliance{rank}").write_text(r.source)
            res["restored"] = {"source": r.source, "iterations_done": r.iterations_done}
            disk, disk_opt = build(mesh, seed=98)
            _in_turn(outd, rank, "disk")
            d = load_into(disk, disk_opt, restore)
            (outd / f"disk{rank}").write_text(str(d.path))
            res["from_disk"] = {"source": str(d.path), "iterations_done": d.iterations_done}
            _save(outd, rank, f"disk_hsdp_{start}", full_state(disk, disk_opt))
            others = {}
            for name, shape in (("fsdp4", (world,)), ("hsdp41", (world, 1))):
                others[name] = build(init_device_mesh("cpu", shape, mesh_dim_names=MESH[-len(shape):]), seed=97)
                load_into(*others[name], restore)
                _save(outd, rank, f"{name}_{start}", full_state(*others[name]))
            res["refused"] = _refusals(others["fsdp4"], (disk, disk_opt), addrs, mesh)
            _save(outd, rank, f"state_{start}", full_state(model, opt))
        else:
            link = attach_sharded(model, opt, mesh, appliances=addrs, secret=SECRET, parts=parts, job="hsdp-rig",
                                  connect_timeout=30)
            res["leader"] = link.leader
            res["group"] = link.group
            link.defer_fallbacks = True  # both groups' fallbacks start after step hold_step
            res["layout_digest"] = link.shards.digest()
            res["layout"] = link.shards.to_dict()
            wire = WireCheck(model, link.shards.group(link.group))
        clipped = 0
        for step in range(start, steps):
            x, y = batch(rank, step)
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            if wire is not None:
                wire.check()
            if link is not None:
                total = link.clip_grad_norm_(MAX_NORM)
            else:
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).full_tensor()
            clipped += bool(total > MAX_NORM)
            if link is not None and link.leader and step == hold_step:
                hold_for_fallback(link, res)
            opt.step()
            _save(outd, rank, f"state_{step + 1}", full_state(model, opt))
        res["clipped_steps"] = clipped
        res["wire_checked"] = wire.checked if wire is not None else 0
        res["steps_done"] = steps
        end_rank(link, res)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        res["fatal"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    _write(result, res)
