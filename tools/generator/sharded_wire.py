"""Sharded-optimizer jobs on the wire: FSDP2 HSDP, DeepSpeed ZeRO-2 and pure FSDP, every rank
simulated in one process, every communicator's collectives written onto the mirrored ports
NCCL-exactly (``packetize.NcclRing``), each communicator in the order ``config.shard_steps`` gives.

- ``hsdp``: ``ranks`` replicas x ``shard`` shard indices (global rank r*shard + k, DeviceMesh's
  row-major order; replica ring k is mesh column k, shard group r mesh row r). Per step: each shard
  group's all-gather of every ``fully_shard`` unit (forward order, each rank's padded shard); each
  rank's forward and backward on its own data; per unit in reduce order each shard group's
  reduce-scatter of the padded gradient buffer, then each replica ring's all-reduce of its shard
  (both ncclAvg: every contribution times float32(1/N) before its first send); with clipping each
  shard group's all-reduce of its shard's squared norm (DTensor's ``get_total_norm``); then every
  shard index's optimizer on its slices.
- ``zero``: DeepSpeed ZeRO-2 over ``ranks`` DP ranks, one ring: at start one broadcast per parameter;
  per step the gradient buckets divided by dp and all-reduced, each param group's squared norm
  (float64 norms of each rank's partition pieces, summed, float32), every partition's optimizer on
  its flat ranges, each param group's all-gather of the updated partitions.
- ``fsdp``: pure FSDP over ``shard`` ranks, one ring (all-gathers, reduce-scatters): its optimizer
  state never crosses the wire, its parameters do (weights-only).

Units: each parameterised top-level child of the model, the root's own parameters a unit before
them (``reshard_after_forward=False``: one all-gather per unit and step). Outputs under ``out``:
``shards.json`` (config.shards.ShardedLayout), ``job.toml`` (one [[ring]] per followed ring:
hsdp/zero one per shard index, fsdp one weights-only ring), ``seed/`` (hsdp: the initial model as
a DCP checkpoint, torchtitan's seed checkpoint: FSDP2 broadcasts nothing), one capture per
mirrored port (the first two ranks' egress of every followed ring), and ``truth.json``: per
communicator every collective's result sha256; per group the replica state digests per step;
the parameters' sha256 before each step (what each step's all-gathers carry).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from mirrorckpt.config import shard_rules, shard_steps
from mirrorckpt.config.jobfile import JobConfig, RingConfig, dump_job
from mirrorckpt.config.layout import MirrorSpec, ParamSpec, RingSpec
from mirrorckpt.config.shards import PAD, ShardedLayout
from mirrorckpt.config.training import TrainingSpec
from mirrorckpt.parser.roce import nccl_versions as nv
from mirrorckpt.parser.roce import ringreduce, schedule
from mirrorckpt.parser.roce.collectives import ring_threads
from mirrorckpt.tools.generator import mirrors as mirrors_mod
from mirrorckpt.tools.generator import models, topology
from mirrorckpt.tools.generator.ddp import to_wire
from mirrorckpt.tools.generator.gen import JOB_FILE, _no_none
from mirrorckpt.tools.generator.packetize import AllReduceValues, NcclRing, payload_bytes
from mirrorckpt.tools.generator.train import build_optimizer, build_scheduler, intra_op_threads
from mirrorckpt.tools.generator.truth import TRUTH_FILE, IterationRecord, RecordingComm
from mirrorckpt.tools.generator.wire import Wire, WireOptions
from mirrorckpt.updater.ckptdir import dcp_module
from mirrorckpt.updater.fingerprint import state_sha256
from mirrorckpt.updater.manifest import tensor_sha256
from mirrorckpt.updater.shard_clip import clip_coefficient, local_norm
from torch import nn

SCHEMES = ("hsdp", "zero", "fsdp")
SHARDS_FILE = "shards.json"
SEED_DIR = "seed"


@dataclass
class ShardedWireConfig:
    scheme: str = "hsdp"
    ranks: int = 2  # hsdp: replicas (ranks of each replica ring); zero: DP ranks; fsdp: unused
    shard: int = 2  # hsdp, fsdp: ranks of each shard group (shard indices)
    model: str = "mlp:16,33,8"
    steps: int = 3
    seed: int = 0
    batch_size: int = 4
    channels: int = 1
    protocol: str = "LL"
    nccl_version: str = "2.18"
    training: TrainingSpec = field(default_factory=TrainingSpec)
    reduce_bucket_size: int = 500_000_000  # zero: DeepSpeed's reduce_bucket_size (elements)
    fmt: str = "pcapng"
    wire: WireOptions = field(default_factory=WireOptions)
    threads: int = 1

    def check(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"sharded scheme {self.scheme!r} is not one of {', '.join(SCHEMES)}")
        if self.training.grad_dtype != "float32":
            raise ValueError("sharded jobs are generated with float32 gradients only")
        if self.training.clip is not None and self.scheme == "zero":
            raise ValueError("ZeRO clips by its own arithmetic (DeepSpeed's unscale_and_clip_grads), which the "
                             "replica does not model: generate zero jobs without clipping")
        if self.protocol not in nv.PROTOCOLS:
            raise ValueError(f"protocol {self.protocol!r}: pin one of {', '.join(nv.PROTOCOLS)}")
        if self.steps < 1:
            raise ValueError("steps must be >= 1")


# ---- communicators on one shared wire ------------------------------------------------------------


class _Pairs:
    """What NcclRing reads of a topology: one communicator's QP pairs."""

    def __init__(self, pairs: dict):
        self.pairs = pairs

    def pair(self, channel: int, pos: int):
        return self.pairs[(channel, pos)]


class _Keyed:
    """One communicator's connections on the job's one wire (one clock for every capture)."""

    def __init__(self, wire: Wire, name: str):
        self.wire, self.name = wire, name

    @property
    def opts(self) -> WireOptions:
        return self.wire.opts

    def conn(self, key, qp):
        return self.wire.conn((self.name, key), qp)

    def run(self, *args) -> None:
        self.wire.run(*args)


class ReduceScatterValues(AllReduceValues):
    """What each reduce-scatter message carries: chunk c (ring position c's output part) starts
    with position c+1's input at step 0 and adds the next position's at each step, rounded in the
    element type (``ringreduce.add``); the owner adds its own term after the last hop, off the wire.
    The slots advance as an all-reduce's do; the result is one part per rank."""

    def __init__(self, plan: schedule.ReduceScatterPlan, inputs: list[np.ndarray], orders: list[list[int]]):
        super().__init__(plan, inputs, orders)
        self.count, self.orders = plan.count, orders
        self.result = [np.empty(self.count, inputs[0].dtype) for _ in range(self.R)]
        self.covered = [np.zeros(self.count, bool) for _ in range(self.R)]

    def _span(self, ch: int, c: int, loop: int) -> slice:
        off, n = self.plan.loops(ch)[loop]
        base = self.orders[ch][c] * self.count + off
        return slice(base, base + n)

    def _advance(self, ch: int, loop: int, step: int) -> None:
        xs, R = self.xs[ch], self.R
        if step == 0:
            self.acc[ch] = [xs[(c + 1) % R][self._span(ch, c, loop)].copy() for c in range(R)]
        else:
            self.acc[ch] = [ringreduce.add(a, xs[(c + step + 1) % R][self._span(ch, c, loop)], self.dtype)
                            for c, a in enumerate(self.acc[ch])]
        if step == R - 2:  # the last hop: each owner adds its own term
            off, n = self.plan.loops(ch)[loop]
            for c, a in enumerate(self.acc[ch]):
                rank = self.orders[ch][c]
                self.result[rank][off:off + n] = ringreduce.add(a, xs[c][self._span(ch, c, loop)], self.dtype)
                self.covered[rank][off:off + n] = True
        self.at[ch] = (loop, step)

    def payload(self, w, msg) -> np.ndarray:
        off = self.plan.loops(w.channel)[msg.loop][0]
        rel = msg.offset - off
        return payload_bytes(self.acc[w.channel][msg.chunk][rel:rel + msg.nelem])


class Comm(RecordingComm):
    """One communicator (its global ranks ``members``) on the job's wire; records every collective."""

    def __init__(self, name: str, members: list[int], ring: RingSpec, net: NcclRing):
        super().__init__(net)
        self.name, self.members, self.ring = name, members, ring

    def reduce_scatter(self, per_rank: list[np.ndarray], what: str) -> list[np.ndarray]:
        """Ring reduce-scatter: each rank's buffer holds one part per rank (rank order); returns
        every rank's reduced part."""
        net: NcclRing = self.inner
        a = per_rank[0]
        R = len(per_rank)
        if R != self.ring.nranks or any(x.dtype != a.dtype or x.size != a.size for x in per_rank) or a.size % R:
            raise ValueError(f"{what}: {R} buffers of unequal size or not {self.ring.nranks} parts each")
        proto = net.proto(nv.REDUCESCATTER, a.nbytes)
        plan = schedule.reducescatter_plan(a.size // R, a.itemsize, R, self.ring.nchannels, proto, net.version,
                                           nthreads=ring_threads(self.ring, proto))
        vals = ReduceScatterValues(plan, [np.ascontiguousarray(x).reshape(-1) for x in per_rank], net.orders)
        net.emit(nv.REDUCESCATTER, what, a, plan, vals)
        if not all(c.all() for c in vals.covered):
            raise AssertionError(f"{what}: the plan left elements unreduced")
        self._add("reduce_scatter", what, vals.result)
        return vals.result


def _premul(x: np.ndarray, n: int) -> np.ndarray:
    """ncclAvg on float32: each contribution times float32(1/n) before its first send."""
    return (x.astype(np.float32) * np.float32(1.0 / n)).astype(np.float32)


# ---- the model's pieces -----------------------------------------------------------------------


def units_of(model: nn.Module) -> list[list[str]]:
    """FSDP2 units in forward order: the root's own parameters, then each parameterised child."""
    root = [n for n, _ in model.named_parameters(recurse=False)]
    children = [[f"{c}.{n}" for n, _ in m.named_parameters()] for c, m in model.named_children()]
    return [u for u in [root] + children if u]


def _block(t: torch.Tensor, s) -> torch.Tensor:
    """A group's slice of the global tensor ``t`` (a view): a block, or a flat range of one."""
    for dim, (o, n) in enumerate(zip(s.offset, s.shape)):
        t = t.narrow(dim, o, n)
    return t if s.flat is None else t.reshape(-1)[s.flat[0]:s.flat[1]]


def _padded_chunk(t: torch.Tensor, shard: int, k: int) -> torch.Tensor:
    """FSDP2's padded dim-0 shard k of ``t`` (ceil-sized rows, zeros past the end), flat."""
    rows = math.ceil(t.shape[0] / shard)
    out = torch.zeros((rows,) + tuple(t.shape[1:]), dtype=t.dtype)
    lo, hi = min(k * rows, t.shape[0]), min((k + 1) * rows, t.shape[0])
    out[:hi - lo] = t[lo:hi]
    return out.reshape(-1)


# ---- a run ------------------------------------------------------------------------------------


@dataclass
class Shard:
    """One optimizer shard index: its slices of the model, optimizer and record."""

    name: str
    tensors: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    scheduler: object
    comm: str  # the communicator whose all-reduces carry its gradient ("" for fsdp)
    iterations: list[IterationRecord] = field(default_factory=list)


@dataclass
class WireJob:
    cfg: ShardedWireConfig
    layout: ShardedLayout
    model: nn.Module  # the global model after the last step
    shards: dict[str, Shard]
    comms: dict[str, Comm]
    out: Path
    params: list[dict[str, str]] = field(default_factory=list)  # per step: sha256 of each parameter before it
    norms: list[float] = field(default_factory=list)  # per step with clipping: the global norm clipped by

    def state(self) -> dict:
        """The trainer's state as unsharded DCP flat keys (``model.<fqn>``, ``optim.state.<fqn>.<k>``)."""
        out = {f"model.{n}": p.detach().clone() for n, p in self.model.named_parameters()}
        for g in self.layout.groups:
            sh = self.shards[g.name]
            for s, t in zip(g.shards, sh.tensors):
                for k, v in sh.optimizer.state[t].items():
                    key = f"optim.state.{s.fqn}.{k}"
                    if v.dim() == 0 or s.whole:
                        out[key] = v.detach().clone()
                        continue
                    if key not in out:
                        out[key] = torch.zeros(s.global_shape, dtype=v.dtype)
                    _block(out[key], s).copy_(v.reshape(s.local_shape))
        return out


def generate_sharded_wire(cfg: ShardedWireConfig, out_dir) -> WireJob:
    """Train ``cfg`` into ``out_dir`` (see the module text)."""
    cfg.check()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = models.parse_spec(cfg.model)
    model = models.build_model(spec, cfg.seed)
    named = list(model.named_parameters())
    params = [ParamSpec(n, tuple(p.shape)) for n, p in named]
    forward = units_of(model)
    if cfg.scheme == "hsdp":
        layout = shard_rules.hsdp(params, cfg.ranks, cfg.shard, units=list(reversed(forward)))
    elif cfg.scheme == "fsdp":
        layout = shard_rules.hsdp(params, 1, cfg.shard, units=list(reversed(forward)))
    else:
        layout = shard_rules.zero(params, cfg.ranks, reduce_bucket_size=cfg.reduce_bucket_size)
    rings = _rings(cfg, layout)
    world = max(r for _, members in rings.items() for r in members) + 1
    version = nv.version(cfg.nccl_version)
    topo = topology.fabric(world, cfg.seed)
    followed = _followed(cfg, layout)
    mirrored = sorted({rings[c][i] for c in followed.values() for i in (0, 1)})
    captures = mirrors_mod.CaptureSet(out, [MirrorSpec(g, "egress") for g in mirrored], topo, cfg.wire.ipv6, cfg.fmt,
                                      switch_ns=cfg.wire.switch_ns)
    wire = Wire(str(version), cfg.wire, captures, cfg.seed, send_truth=False)
    comms = {}
    for name, members in rings.items():
        ring = RingSpec(nranks=len(members), nchannels=cfg.channels, protocol=nv.protocol(cfg.protocol),
                        nccl_version=str(version),
                        addresses={i: topo.nics[g].ip_text(cfg.wire.ipv6) for i, g in enumerate(members)})
        pairs = topology.ring_pairs(topo, members, ring.orders(), version, nqps=cfg.wire.qps_per_connection)
        comms[name] = Comm(name, members, ring, NcclRing(ring, _Pairs(pairs), _Keyed(wire, name)))
    by_name = dict(named)
    shards = {}
    for g in layout.groups:
        tensors = [_block(by_name[s.fqn].detach(), s).clone().reshape(s.local_shape) for s in g.shards]
        opt = build_optimizer(tensors, cfg.training.optimizer)
        shards[g.name] = Shard(g.name, tensors, opt, build_scheduler(opt, cfg.training.lr_schedule),
                               followed.get(g.name, ""))
    job = WireJob(cfg, layout, model, shards, comms, out)
    if cfg.scheme == "hsdp":
        _write_seed(model, out / SEED_DIR)
    with intra_op_threads(cfg.threads):
        try:
            {"hsdp": _train_fsdp, "fsdp": _train_fsdp, "zero": _train_zero}[cfg.scheme](job, spec)
        finally:
            files = captures.close()
    _write_outputs(job, rings, followed, files)
    return job


def _rings(cfg: ShardedWireConfig, layout: ShardedLayout) -> dict[str, list[int]]:
    """Every communicator's global ranks (ring order)."""
    if cfg.scheme == "zero":
        return {"dp": list(layout.groups[0].ranks)}
    out = {}
    if cfg.scheme == "hsdp":
        out.update({f"replica{g.shard_index}": list(g.ranks) for g in layout.groups})
    for r in range(layout.dp):
        out[f"shard{r}"] = shard_steps.shard_group_ring(layout, r).ranks
    return out


def _followed(cfg: ShardedWireConfig, layout: ShardedLayout) -> dict[str, str]:
    """Followed ring -> communicator: each group's gradient ring, or (fsdp) the weights ring."""
    if cfg.scheme == "fsdp":
        return {"weights": "shard0"}
    return {g.name: ("dp" if cfg.scheme == "zero" else f"replica{g.shard_index}") for g in layout.groups}


def _step(job: WireJob, it: int) -> None:
    """Every shard's optimizer (its gradients set), its record, then the slices back into the model."""
    for sh in job.shards.values():
        lr = float(sh.optimizer.param_groups[0]["lr"])
        sh.optimizer.step()
        if sh.scheduler is not None:
            sh.scheduler.step()
        for t in sh.tensors:
            t.grad = None
        psha, osha = state_sha256(sh.tensors, sh.optimizer)
        sh.iterations.append(IterationRecord(index=it, step=it + 1, lr=lr, loss_scale=None, skipped=False,
                                             losses=[], buckets_sha256=[], params_sha256=psha, optim_sha256=osha))
    with torch.no_grad():
        by_name = dict(job.model.named_parameters())
        for g in job.layout.groups:
            for s, t in zip(g.shards, job.shards[g.name].tensors):
                _block(by_name[s.fqn], s).copy_(t.reshape(_block(by_name[s.fqn], s).shape))


def _rank_grads(job: WireJob, spec, it: int, world: int) -> list[dict[str, torch.Tensor]]:
    """Every rank's forward and backward of the whole model on its own data."""
    model, cfg = job.model, job.cfg
    out = []
    for rank in range(world):
        x, y = models.make_batch(spec, cfg.seed, rank, it, cfg.batch_size)
        model.zero_grad(set_to_none=True)
        models.compute_loss(spec, model(x), y).backward()
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    return out


def _params_sha(job: WireJob) -> dict[str, str]:
    return {n: tensor_sha256(p.detach()) for n, p in job.model.named_parameters()}


def _train_fsdp(job: WireJob, spec) -> None:
    """HSDP and pure FSDP (see the module text)."""
    cfg, layout = job.cfg, job.layout
    S, R = cfg.shard, layout.dp
    groups = sorted(layout.groups, key=lambda g: g.shard_index)
    by_name = dict(job.model.named_parameters())
    reduce_units = [[groups[0].shards[i].fqn for i, _ in seg if i != PAD] for seg in groups[0].wire]
    forward = list(reversed(range(len(reduce_units))))
    for it in range(cfg.steps):
        job.params.append(_params_sha(job))
        for k, u in enumerate(forward):
            for r in range(R):
                parts = [to_wire(torch.cat([_padded_chunk(by_name[n].detach(), S, j) for n in reduce_units[u]]))
                         for j in range(S)]
                job.comms[f"shard{r}"].all_gather(parts, f"params:iter={it}:gather={k}")
        grads = _rank_grads(job, spec, it, R * S)
        shard_grads: dict[int, list[torch.Tensor | None]] = {k: [None] * len(g.shards) for k, g in enumerate(groups)}
        for u, names in enumerate(reduce_units):
            reduced = {}
            for r in range(R):
                inputs = [_premul(to_wire(torch.cat([_padded_chunk(grads[r * S + k][n], S, j)
                                                     for j in range(S) for n in names])), S) for k in range(S)]
                reduced[r] = job.comms[f"shard{r}"].reduce_scatter(inputs, f"reduce_scatter:iter={it}:unit={u}")
            for k, g in enumerate(groups):
                if R > 1:
                    buf = job.comms[f"replica{k}"].all_reduce([_premul(reduced[r][k], R) for r in range(R)],
                                                              f"grad:iter={it}:bucket={u}")
                else:
                    buf = reduced[0][k]
                pos = 0
                for i, n in g.wire[u]:
                    if i != PAD:
                        shard_grads[k][i] = torch.from_numpy(buf[pos:pos + n].copy()).reshape(g.shards[i].local_shape)
                    pos += n
        for k, g in enumerate(groups):
            for t, grad in zip(job.shards[g.name].tensors, shard_grads[k]):
                t.grad = grad
        if cfg.training.clip is not None:
            _clip(job, groups, R, it)
        _step(job, it)


def _clip(job: WireJob, groups, replicas: int, it: int) -> None:
    """DTensor's global norm (each shard's local norm, its square all-reduced over the shard group,
    the root of the sum), every shard's gradients times the clipping coefficient."""
    c = job.cfg.training.clip
    local = [local_norm([t.grad for t in job.shards[g.name].tensors], c.norm_type) for g in groups]
    squares = [(n ** float(c.norm_type)).reshape(1).numpy() for n in local]
    total = None
    for r in range(replicas):
        summed = job.comms[f"shard{r}"].all_reduce(squares, f"norm:iter={it}")
        total = torch.from_numpy(summed.copy()).reshape(()) ** (1.0 / float(c.norm_type))
    job.norms.append(float(total))
    coef = clip_coefficient(total, c.max_norm)
    for g in groups:
        torch._foreach_mul_([t.grad for t in job.shards[g.name].tensors], coef)


def _train_zero(job: WireJob, spec) -> None:
    cfg, layout = job.cfg, job.layout
    dp = layout.dp
    comm = job.comms["dp"]
    ring = shard_steps.gradient_ring(layout, layout.groups[0].name)
    for k, p in enumerate(job.model.parameters()):
        comm.broadcast(to_wire(p.detach().clone()), 0, f"{shard_steps.INIT_PARAMS}{k}")
    buckets = shard_rules.zero_buckets(layout.params, reduce_bucket_size=cfg.reduce_bucket_size)
    if len(buckets) != len(layout.groups[0].wire):
        raise AssertionError("the generator's ZeRO buckets are not the layout's")
    partitions = shard_rules.zero_partitions(layout.params, dp, (layout.steps or {}).get("param_groups"))
    for it in range(cfg.steps):
        job.params.append(_params_sha(job))
        grads = _rank_grads(job, spec, it, dp)
        for b, bucket in enumerate(buckets):
            flats = [torch.cat([grads[r][p.name].reshape(-1) for p in bucket]) for r in range(dp)]
            reduced = comm.all_reduce([to_wire(f.div_(dp)) for f in flats], f"grad:iter={it}:bucket={b}")
            for g in layout.groups:
                pos = 0
                for i, n in g.wire[b]:
                    if i != PAD:
                        job.shards[g.name].tensors[i].grad = torch.from_numpy(reduced[pos:pos + n].copy())
                    pos += n
        for k, (_, members) in enumerate(partitions):
            mine = {p.name for p, _ in members}
            squares = []
            for g in layout.groups:  # DeepSpeed's get_grad_norm_direct on each rank's partition pieces
                norms = [torch.linalg.vector_norm(t.grad.double(), 2.0)
                         for s, t in zip(g.shards, job.shards[g.name].tensors) if s.fqn in mine]
                total = torch.stack(norms).square().sum().float() if norms else torch.tensor(0.0)
                squares.append(total.reshape(1).numpy())
            comm.all_reduce(squares, f"norm:iter={it}:group={k}")
        _step(job, it)
        for k, (size, members) in enumerate(partitions):
            by_name = dict(job.model.named_parameters())
            flat = torch.zeros(size * dp)
            for p, at in members:
                flat[at:at + p.numel] = by_name[p.name].detach().reshape(-1)
            comm.all_gather([to_wire(flat[r * size:(r + 1) * size].clone()) for r in range(dp)],
                            f"params:iter={it}:gather={k}")
    if [c.label for c in ring.per_iteration] != ["grad"] * len(buckets) + ["norm"] * len(partitions) + \
            ["params"] * len(partitions):
        raise AssertionError("the generator's ZeRO step is not config.shard_steps'")


def _write_seed(model: nn.Module, d: Path) -> None:
    """The initial model as a DCP checkpoint of ``model.<fqn>`` keys (no process group)."""
    dcp = dcp_module()
    sd = {"model": {n: p.detach().clone() for n, p in model.named_parameters()}}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)


def _write_outputs(job: WireJob, rings: dict[str, list[int]], followed: dict[str, str], files: list[dict]) -> None:
    cfg, out, layout = job.cfg, job.out, job.layout
    (out / SHARDS_FILE).write_text(json.dumps(layout.to_dict(), sort_keys=True, indent=1) + "\n")
    truth = {
        "format": 1,
        "config": {"scheme": cfg.scheme, "ranks": cfg.ranks, "shard": cfg.shard, "model": cfg.model,
                   "steps": cfg.steps, "seed": cfg.seed, "batch_size": cfg.batch_size,
                   "training": cfg.training.to_dict(), "protocol": cfg.protocol, "nccl_version": cfg.nccl_version,
                   "torch": torch.__version__},
        "comms": {n: {"ranks": c.members, "ring": c.ring.to_dict(), "collectives": [asdict(r) for r in c.records]}
                  for n, c in job.comms.items()},
        "groups": {n: {"comm": sh.comm, "iterations": [asdict(it) for it in sh.iterations]}
                   for n, sh in job.shards.items()},
        "params": job.params,  # before each step: what that step's all-gathers carry
        "grad_norms": job.norms,
        "final_params": _params_sha(job),
        "captures": files,
    }
    (out / TRUTH_FILE).write_text(json.dumps(truth, sort_keys=True, indent=1) + "\n")
    ring_tables = []
    for group, comm_name in followed.items():
        c = job.comms[comm_name]
        mirrors = [MirrorSpec(i, "egress", mirrors_mod.file_name(MirrorSpec(c.members[i], "egress"), cfg.fmt))
                   for i in (0, 1)]
        ring_tables.append(RingConfig(c.ring, mirrors, None if group == "weights" else group,
                                      weights_only=group == "weights"))
    jc = JobConfig(ring=ring_tables[0].ring, kind="sharded", grad_dtype="float32",
                   training=_no_none(cfg.training.to_dict()), rings=ring_tables, shards=layout,
                   shards_path=SHARDS_FILE, initial=SEED_DIR if cfg.scheme == "hsdp" else None,
                   name=f"{cfg.scheme}-{cfg.model}")
    (out / JOB_FILE).write_text(dump_job(jc))
