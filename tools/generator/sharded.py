"""TP x PP x DP jobs: one model cut into TP*PP shards, each trained by its own DP group over its own
NCCL ring, all rings written at once (one capture directory per group).

The model is trained as the sharded job computes it: per DP rank, the forward and backward of the
whole model on that rank's data shard; each group then DDP-all-reduces its slices of those
gradients over its ring (config.shards: Megatron-style TP plan, DTensor's ``Shard`` slicing)
and steps its own optimizer on its own slices; the slices are written back into the model
before the next iteration. With an element-wise optimizer (Adam, AdamW, SGD) this is the
trainer of a sharded job exactly; clipping (a global norm) is refused.

TP and PP traffic (activations a rank exchanges with its TP peer and the next stage) is written
onto every mirrored port as point-to-point Simple sends on QPs of their own, carrying the real
activation bytes: noise the appliance following the ring must ignore. The wire simulator knows
one NIC set per ring, so these flows run between the ring's own NICs.

Outputs under ``out``: ``shards.json`` (config.shards.ShardedLayout) and per DP group a
directory ``<group>/`` as ``mirrorckpt gen`` writes one (captures, job.toml, truth.json).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from mirrorckpt.config import shards as shards_mod
from mirrorckpt.config.jobfile import JobConfig, dump_job
from mirrorckpt.config.layout import MirrorSpec, ParamSpec, RingSpec
from mirrorckpt.config.training import TrainingSpec
from mirrorckpt.parser.roce import nccl_versions as nv
from mirrorckpt.tools.generator import mirrors as mirrors_mod
from mirrorckpt.tools.generator import models, topology
from mirrorckpt.tools.generator.ddp import DDP, to_wire
from mirrorckpt.tools.generator.gen import JOB_FILE, _no_none
from mirrorckpt.tools.generator.packetize import NcclRing
from mirrorckpt.tools.generator.topology import P2P_CHUNK_BYTES
from mirrorckpt.tools.generator.train import build_optimizer, build_scheduler, intra_op_threads
from mirrorckpt.tools.generator.truth import IterationRecord, RecordingComm, sha256_arrays, write_truth
from mirrorckpt.tools.generator.wire import Layer, P2pMsg, Wire, WireOptions, Work
from mirrorckpt.updater.fingerprint import state_sha256
from torch import nn

SHARDS_FILE = "shards.json"


@dataclass
class ShardedConfig:
    tp: int = 2
    pp: int = 1
    dp: int = 2
    model: str = "mlp:32,64,16"
    steps: int = 4
    seed: int = 0
    batch_size: int = 4
    channels: int = 1
    protocol: str = "Simple"
    nccl_version: str = "2.18"
    bucket_cap_mb: float | None = None
    training: TrainingSpec = field(default_factory=TrainingSpec)
    appliances: list[str] | None = None  # round-robin over the groups; default one per group
    mirrors: str = "0:egress,1:egress"  # DP ranks of every group
    mp_noise: bool = True  # TP/PP traffic on QPs of its own on every mirrored port
    fmt: str = "pcapng"
    wire: WireOptions = field(default_factory=WireOptions)
    threads: int = 1


def tp_plan(model: nn.Module, tp: int, pp: int) -> dict[str, tuple[int | None, int]]:
    """FQN -> (TP dimension or None, PP stage). Stages: the model's top-level children cut into
    ``pp`` contiguous runs. TP: within a stage, Linear layers alternate column-parallel (weight
    and bias on dim 0) and row-parallel (weight on dim 1, bias whole), as Megatron pairs them;
    other parameters (norms, embeddings) are whole on every TP rank."""
    children = [name for name, m in model.named_children() if any(True for _ in m.parameters())]
    if not children and any(True for _ in model.parameters(recurse=False)):
        children = [""]
    if len(children) < pp:
        raise ValueError(f"{len(children)} parameterised layers cannot fill {pp} pipeline stages")
    stage_of = {c: int(s) for s, part in enumerate(np.array_split(np.arange(len(children)), pp)) for c in
                (children[i] for i in part)}
    plan: dict[str, tuple[int | None, int]] = {}
    linears_in_stage: dict[int, int] = {}
    for mname, m in model.named_modules():
        top = mname.split(".")[0] if mname else ""
        if top not in stage_of:
            continue
        stage = stage_of[top]
        row = False
        if isinstance(m, nn.Linear) and tp > 1:
            k = linears_in_stage.get(stage, 0)
            linears_in_stage[stage] = k + 1
            row = k % 2 == 1
        for pname, p in m.named_parameters(recurse=False):
            fqn = f"{mname}.{pname}" if mname else pname
            dim = None
            if isinstance(m, nn.Linear) and tp > 1:
                dim = (1 if row else 0) if pname == "weight" else (None if row else 0)
                if dim is not None and p.shape[dim] < tp:
                    dim = None  # too narrow to cut: kept whole
            plan[fqn] = (dim, stage)
    return plan


def shard_module(named: list[tuple[str, torch.Tensor]]) -> nn.Module:
    """A module holding ``named`` tensors as parameters under their FQNs (nested submodules)."""
    root = nn.Module()
    for name, t in named:
        node, parts = root, name.split(".")
        for part in parts[:-1]:
            if not hasattr(node, part):
                node.add_module(part, nn.Module())
            node = getattr(node, part)
        node.register_parameter(parts[-1], nn.Parameter(t))
    return root


def _slice(t: torch.Tensor, s: shards_mod.Shard) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(s.offset, s.shape)):
        t = t.narrow(dim, o, n)
    return t


@dataclass
class GroupRun:
    name: str
    ring: RingSpec
    comm: RecordingComm
    ddp: DDP
    optimizer: torch.optim.Optimizer
    scheduler: object
    captures: mirrors_mod.CaptureSet
    wire: Wire
    net: NcclRing
    initial: list[torch.Tensor]
    iterations: list[IterationRecord] = field(default_factory=list)


@dataclass
class ShardedResult:
    layout: shards_mod.ShardedLayout
    model: nn.Module  # the global model after the last step
    groups: dict[str, GroupRun]
    out: Path

    def state(self) -> dict:
        """The trainer's state as unsharded DCP flat keys (``model.<fqn>``, ``optim.state.<fqn>.<k>``)."""
        out = {f"model.{n}": p.detach().clone() for n, p in self.model.named_parameters()}
        full: dict[str, torch.Tensor] = {}
        for g in self.layout.groups:
            run = self.groups[g.name]
            for (name, p), s in zip(zip(run.ddp.names, run.ddp.params), g.shards):
                for k, v in run.optimizer.state[p].items():
                    key = f"optim.state.{name}.{k}"
                    if v.dim() == 0 or s.whole:
                        full[key] = v.detach().clone()
                        continue
                    if key not in full:
                        full[key] = torch.zeros(s.global_shape, dtype=v.dtype)
                    _slice(full[key], s).copy_(v)
        out.update(full)
        return out


def _mp_send(run: GroupRun, src: int, dst: int, data: np.ndarray, what: str) -> None:
    """One TP/PP activation transfer as NCCL point-to-point Simple sends on its own QP pair."""
    pair = run.net.topo.p2p_pair(src, dst, run.net.version)
    conn = run.wire.conn(("mp", src, dst), pair)
    flat = np.ascontiguousarray(data).reshape(-1)
    per = P2P_CHUNK_BYTES // flat.itemsize
    msgs = [P2pMsg(min(per, flat.size - lo) * flat.itemsize, k, lo, min(per, flat.size - lo))
            for k, lo in enumerate(range(0, flat.size, per))]
    from mirrorckpt.tools.generator.packetize import SliceValues

    label = {"collective": None, "what": what, "kind": "p2p"}
    run.wire.run([Work(conn, msgs, channel=-1)], Layer(nv.SIMPLE, nv.BROADCAST, p2p=True), SliceValues(flat),
                 label, run.wire.opts.collective_gap_ns)


def generate_sharded(cfg: ShardedConfig, out_dir) -> ShardedResult:
    """Train ``cfg`` into ``out_dir`` (see the module text)."""
    if cfg.training.grad_dtype != "float32":
        raise ValueError("sharded jobs are generated with float32 gradients only")
    if cfg.training.clip is not None:
        raise ValueError("clipping needs the norm over every shard: not generated for sharded jobs")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = models.parse_spec(cfg.model)
    model = models.build_model(spec, cfg.seed)
    named = list(model.named_parameters())
    plan = tp_plan(model, cfg.tp, cfg.pp)
    layout = shards_mod.build([ParamSpec(n, tuple(p.shape)) for n, p in named], plan, cfg.tp, cfg.pp, cfg.dp,
                              cfg.appliances)
    if cfg.dp < 2:
        raise ValueError("a DP group needs at least 2 ranks")
    by_name = dict(named)
    version = nv.version(cfg.nccl_version)
    runs: dict[str, GroupRun] = {}
    with intra_op_threads(cfg.threads):
        for k, g in enumerate(layout.groups):
            ring = RingSpec(nranks=cfg.dp, nchannels=cfg.channels, protocol=nv.protocol(cfg.protocol),
                            nccl_version=str(version))
            mirrors = mirrors_mod.parse_mirrors(cfg.mirrors, cfg.dp)
            topo = topology.build(cfg.dp, ring.orders(), cfg.seed * 1009 + k + 1, ring.nccl_version)
            ring.addresses = {n.rank: n.ip_text(cfg.wire.ipv6) for n in topo.nics}
            captures = mirrors_mod.CaptureSet(out / g.name, mirrors, topo, cfg.wire.ipv6, cfg.fmt)
            wire = Wire(ring.nccl_version, cfg.wire, captures, cfg.seed + k, send_truth=False)
            net = NcclRing(ring, topo, wire)
            comm = RecordingComm(net)
            params = [(s.fqn, _slice(by_name[s.fqn].detach(), s).clone()) for s in g.shards]
            ddp = DDP(shard_module(params), cfg.dp, comm, bucket_cap_mb=cfg.bucket_cap_mb)
            opt = build_optimizer(ddp.params, cfg.training.optimizer)
            runs[g.name] = GroupRun(g.name, ring, comm, ddp, opt, build_scheduler(opt, cfg.training.lr_schedule),
                                    captures, wire, net, [p.detach().clone() for p in ddp.params])
        try:
            _train(cfg, spec, model, layout, runs)
        finally:
            for run in runs.values():
                run.captures.close()
    for g in layout.groups:
        _write_group(cfg, out / g.name, runs[g.name])
    (out / SHARDS_FILE).write_text(json.dumps(layout.to_dict(), sort_keys=True, indent=1) + "\n")
    return ShardedResult(layout, model, runs, out)


def _train(cfg, spec, model, layout, runs) -> None:
    params = dict(model.named_parameters())
    index = {p: n for n, p in params.items()}
    order: list[str] = []
    for it in range(cfg.steps):
        for run in runs.values():
            run.ddp.begin_iteration(it)
        per_rank: list[dict[str, torch.Tensor]] = []
        acts: list[list[torch.Tensor]] = []
        for d in range(cfg.dp):
            x, y = models.make_batch(spec, cfg.seed, d, it, cfg.batch_size)
            model.zero_grad(set_to_none=True)
            hooks = [p.register_post_accumulate_grad_hook(lambda q: order.append(index[q]))
                     for p in params.values()] if it == 0 and d == 0 else []
            seen: list[torch.Tensor] = []
            fh = [m.register_forward_hook(lambda _m, _i, o, seen=seen: seen.append(o.detach()))
                  for _, m in model.named_children()] if cfg.mp_noise else []
            models.compute_loss(spec, model(x), y).backward()
            for h in hooks + fh:
                h.remove()
            per_rank.append({n: p.grad.detach().clone() for n, p in params.items()})
            acts.append(seen)
        for g in layout.groups:
            run = runs[g.name]
            if it == 0:
                mine = [s.fqn for s in g.shards]
                run.ddp.ready_order = [mine.index(n) for n in order if n in mine]
            grads = [[_slice(per_rank[d][s.fqn], s).contiguous() for s in g.shards] for d in range(cfg.dp)]
            reduced = run.ddp.reduce(it, grads)
            if cfg.mp_noise:
                for d in range(cfg.dp):
                    a = acts[d][min(g.pp_stage, len(acts[d]) - 1)]
                    _mp_send(run, d, (d + 1) % cfg.dp, to_wire(a.float().contiguous()), f"mp:iter={it}")
            lr = float(run.optimizer.param_groups[0]["lr"])
            run.optimizer.step()
            if run.scheduler is not None:
                run.scheduler.step()
            psha, osha = state_sha256(run.ddp.params, run.optimizer)
            run.iterations.append(IterationRecord(
                index=it, step=it + 1, lr=lr, loss_scale=None, skipped=False, losses=[],
                buckets_sha256=[sha256_arrays([b]) for b in reduced], params_sha256=psha, optim_sha256=osha))
        with torch.no_grad():  # the shards back into the model
            for g in layout.groups:
                for s, p in zip(g.shards, runs[g.name].ddp.params):
                    _slice(params[s.fqn], s).copy_(p)


def _write_group(cfg: ShardedConfig, d: Path, run: GroupRun) -> None:
    layout = run.ddp.layout()
    result = SimpleNamespace(layout=layout, collectives=run.comm.records, iterations=run.iterations,
                             initial_params=run.initial)
    result.config = {"model": cfg.model, "tp": cfg.tp, "pp": cfg.pp, "dp": cfg.dp, "group": run.name,
                     "steps": cfg.steps,
                      "seed": cfg.seed, "training": cfg.training.to_dict(),
                     "torch": torch.__version__}
    write_truth(result, d)
    mirrors = mirrors_mod.parse_mirrors(cfg.mirrors, cfg.dp)
    job = JobConfig(ring=run.ring, kind="ddp", startup=True, layout=layout, grad_dtype="float32",
                    training=_no_none(cfg.training.to_dict()),
                    mirrors=[MirrorSpec(m.rank, m.direction, mirrors_mod.file_name(m, cfg.fmt)) for m in mirrors])
    (d / JOB_FILE).write_text(dump_job(job))
