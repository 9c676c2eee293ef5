"""A real DeepSpeed ZeRO-2 CPU job (2 processes, gloo, ``DS_ACCELERATOR=cpu``): a small MLP, the
client's torch AdamW with two param groups (weight decay on the weights only), a LinearLR stepped
by the engine, DeepSpeed's ``gradient_clipping`` (below the gradients' norm: every step clips) and
input noise from the global RNG; attached with ``control.integrations.deepspeed.attach_deepspeed``
to the control planes that follow its two partitions. ``trainer_main`` runs in its own process
(``tools.testbed.sharded_rig.run_job``) and writes what it saw as JSON to ``result``.

Every rank is its own data-parallel rank (its own batches, from ``Position``: the data position
the link reports and a resumed job loads); batch ``NAN_BATCH`` makes ZeRO skip its step. Each
group's owner holds its step ``hold_step`` until its plane asked for a fallback, so both
partitions' checkpoints start at one step. After every
step each rank saves its link's state (its partition's slices and their AdamW state, keyed as a
replica keys them) and the engine's full module parameters (``rank<r>_<step>.pt``).

``restore_step`` > 0: first the job's training without the link (``plain_run``), then a fresh
job (other initial weights) that restores that step from the planes
(``attach_deepspeed(restore=True)``) and trains on to ``steps``.

DeepSpeed's CPU accelerator builds its shared-memory all-reduce op (used by inference's
all-reduce only) when ``init_distributed`` runs: about a minute of compiling on 2 cores the first
time, and probing every op builder before that. The job marks no op compatible
(``deepspeed.ops.__compatible_ops__``, a dict DeepSpeed lets its users edit), so neither runs:
ZeRO training with a torch optimizer uses none of them.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

from mirrorckpt.tools.testbed.tp_dp_job import SECRET, _write

DIMS = (8, 16, 4)
CLIP = 0.05
MICRO_BATCH = 4
NAN_BATCH = 5  # its inputs are NaN: ZeRO finds a non-finite norm and skips that step


class Position:
    """The data position: the index of the next batch."""

    def __init__(self):
        self.next = 0

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.next = int(state["next"])


def batch(rank: int, index: int):
    import torch

    g = torch.Generator().manual_seed(1_000 * index + rank)
    x, y = torch.randn(MICRO_BATCH, DIMS[0], generator=g), torch.randn(MICRO_BATCH, DIMS[-1], generator=g)
    return (x * float("nan") if index == NAN_BATCH else x), y


def build(seed: int):
    """The engine: model, the client's AdamW and LinearLR, the ZeRO-2 config."""
    import deepspeed
    import torch
    from torch import nn

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(DIMS[0], DIMS[1]), nn.ReLU(), nn.Linear(DIMS[1], DIMS[2]))
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
                             {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}],
                            lr=1e-2, foreach=False)
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=30)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": CLIP, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 150}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=config)
    return engine


def trainer_main(rank: int, world: int, port: int, appliances: dict, out: str, steps: int, hold_step: int,
                 parts: int, restore_step: int, result: str):
    res: dict = {"rank": rank}
    try:
        os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import deepspeed
        import deepspeed.ops
        import torch
        from mirrorckpt.control.integrations.deepspeed import attach_deepspeed
        from mirrorckpt.tools.testbed.sharded_rig import end_rank, hold_for_fallback
        from torch import nn

        deepspeed.ops.__compatible_ops__ = {}  # see the module text
        torch.set_num_threads(1)
        deepspeed.init_distributed(dist_backend="gloo")
        if restore_step:
            plain_run(rank, steps, Path(out))
        engine = build(seed=99 if restore_step else 3)
        addrs = {g: (h, int(p)) for g, (h, p) in appliances.items()}
        data = Position()
        link = attach_deepspeed(engine, addrs, SECRET, follows={g: "appliance-0" for g in addrs}, data=data,
                                parts=parts, job="deepspeed-rig", fingerprint_every=0, connect_timeout=30,
                                restore=bool(restore_step), restore_step=restore_step or None)
        res.update(leader=link.leader, group=link.group, layout=link.shards.to_dict(),
                   training=link.training.to_dict())
        if link.restored is not None:
            r = link.restored
            res["restored"] = {"source": r.source, "iterations_done": r.iterations_done, "data": r.data_position,
                               "engine_steps": engine.global_steps}
            _save(Path(out), rank, restore_step, link, engine)
        else:
            link.defer_fallbacks = True  # both partitions' fallbacks start after step hold_step
        start, coefs = link.iterations_done, []
        for step in range(start, steps):
            x, y = batch(rank, data.next)
            data.next += 1
            loss = nn.functional.mse_loss(engine(x + 0.01 * torch.randn_like(x)), y)
            engine.backward(loss)
            if not link.restored and step == hold_step:
                hold_for_fallback(link, res)
            engine.step()
            coefs.append([c for c, _ in link.zero_steps.coefficients])  # one per param group
            _save(Path(out), rank, step + 1, link, engine)
        res["clip_coefs"] = coefs
        res["steps_done"] = link.iterations_done
        res["engine_steps"] = engine.global_steps
        res["skipped"] = {"link": link.stats.skipped_steps, "engine": engine.skipped_steps}
        end_rank(link, res)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        res["fatal"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    _write(result, res)


def plain_run(rank: int, steps: int, out: Path) -> None:
    """The job's training without the link, from the job's seed: the engine's full parameters after
    each step (``plain<r>_<step>.pt``), what the attached job must equal."""
    import torch
    from torch import nn

    engine, data = build(seed=3), Position()
    for step in range(steps):
        x, y = batch(rank, data.next)
        data.next += 1
        engine.backward(nn.functional.mse_loss(engine(x + 0.01 * torch.randn_like(x)), y))
        engine.step()
        torch.save({f"module.{n}": p.detach().clone() for n, p in engine.module.named_parameters()},
                   out / f"plain{rank}_{step + 1}.pt")


def _save(out: Path, rank: int, step: int, link, engine) -> None:
    import torch

    state = {k: v.detach().clone() for k, v in link.named_state().items()}
    state.update({f"module.{n}": p.detach().clone() for n, p in engine.module.named_parameters()})
    torch.save(state, out / f"rank{rank}_{step}.pt")
