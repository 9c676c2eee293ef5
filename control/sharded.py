"""Trainer side of a sharded job (TP x PP x DP, or a sharded optimizer: FSDP2 HSDP): its layout read
from the DTensor modules, one control link per group, and a restore in which every rank pulls its
own shard.

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {...ColwiseParallel()/RowwiseParallel()...})
    link = attach_sharded(model, optimizer, mesh, appliances={"pp0-tp0": (host, port0),
                                                             "pp0-tp1": (host, port1)}, secret=SECRET)

``describe`` (collective over the default process group, torch's ``all_gather_object``) reads
every rank's parameters: a DTensor's placement on the TP mesh dimension (``Shard(d)``: TP dimension
d; ``Replicate()``: the whole tensor) and its local shape and global offset as DTensor computes
them; a plain tensor is whole. A pipeline stage is the rank's coordinate on the mesh's "pp"
dimension (or ``pp_stage``/``pp``) and holds only its own modules, named by their global FQNs
(torch's manual pipeline split: the full model with the other stages' layers deleted). The ranks'
reports form a ``config.shards.ShardedLayout``: one DP group per (stage, TP rank), its global ranks
in DP order (read from the mesh's DP process group), its slices, and the appliance that follows it.

An FSDP2 model (``fully_shard`` units) is read from its parameters alone, on each rank without a
collective: the placements on its mesh (``Replicate()`` on the replicate dimension, ``Shard(0)``
on the shard dimension), the mesh's ranks and each unit's parameters give the layout
(``config.shard_rules.hsdp``): one group per shard index, whose ring is the replicate group. A
job whose optimizer state its all-reduces do not carry (pure FSDP on a 1-d mesh; a layout with
``refusal``, e.g. one-instance Megatron from ``config.shard_rules``) is refused at attach with the
reason and the setting that makes it followable (``NotFollowable``). With ``weights_only=True``
a pure FSDP job registers anyway, each rank its own shard (a group of one), saying so in its
REGISTER (``weights_only``): its appliances take full checkpoints by GoCkpt fallbacks at their
own cadence and hold the trainer's parameter fingerprints, which the weight snapshots its
all-gathers give (``updater.weights``) are checked against.

``ShardLink`` is a ``TrainerLink`` on one DP group's shard: the group's DP-rank-0 process (a ZeRO
partition's owner: control.integrations.deepspeed attaches those) talks to the control plane that
follows the group (``appliances[group]``), registering the group's ring
(its slices under their global FQNs, local shapes) with the whole sharded layout and the group's
name (a sharded REGISTER); the other ranks only count steps. GoCkpt parts, fingerprints and
gradients are the local shards (``to_local()``). The DP all-reduce of the gradients is the
training loop's (a DDP-style mean over the mesh's DP dimension, or FSDP2's); its buckets matter
only to an appliance that follows the ring on the wire (a group with ``wire`` registers one
bucket per all-reduce, its padding left out). ``link.clip_grad_norm_`` clips by the norm of the
whole model as torch computes it over DTensor gradients (no pipeline stages) and sends every
group the coefficient it applied.

``restore_sharded`` is ``restore_from_appliance`` per shard: each rank sends RESTORE_REQUEST to
its own group's control plane and loads the reply into its DTensors (local shards); the ranks
then agree (``all_gather_object``) that every group's state is the same step, unless the caller
names the ``step``: then no rank waits for another (an FSDP2 job restores without a collective).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from mirrorckpt.config import shard_rules
from mirrorckpt.config.ddp import reducer_params
from mirrorckpt.config.layout import JobLayout, ParamSpec
from mirrorckpt.config.shards import DpGroup, Shard, ShardedLayout, group_name
from mirrorckpt.control import messages as m
from mirrorckpt.control.endpoint import ControlClient
from mirrorckpt.control.trainer import (
    Restored,
    TrainerLink,
    ddp_layout,
    load_trainer_state,
    local,
    parse_restore,
    set_rng_states,
    started,
    unwrap,
)
from mirrorckpt.updater.dcp_keys import loads


def _is_dtensor(p) -> bool:
    return hasattr(p, "placements") and hasattr(p, "device_mesh")


def _entry(name: str, p, tp_dim_name: str | None) -> dict:
    """What one rank holds of parameter ``name``: global shape, TP dimension, offset, local shape."""
    if p.dtype != torch.float32:
        raise ValueError(f"{name}: {p.dtype} parameters; the sharded link follows float32 models")
    if not _is_dtensor(p):
        return {"fqn": name, "global_shape": list(p.shape), "tp_dim": None, "offset": [0] * p.dim(),
                "shape": list(p.shape)}
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    names = p.device_mesh.mesh_dim_names
    if p.device_mesh.ndim != 1 or (tp_dim_name is not None and names is not None and names[0] != tp_dim_name):
        raise ValueError(f"{name}: a DTensor on mesh dimensions {names}; the sharded layout holds parameters "
                         f"distributed over the TP dimension {tp_dim_name!r} only (DP is the training loop's "
                         "all-reduce)")
    place = p.placements[0]
    if isinstance(place, DShard):
        dim = place.dim % p.dim()
    elif isinstance(place, Replicate):
        dim = None
    else:
        raise ValueError(f"{name}: placement {place}; parameters are Shard(d) or Replicate()")
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return {"fqn": name, "global_shape": list(p.shape), "tp_dim": dim, "offset": [int(x) for x in offset],
            "shape": [int(x) for x in shape]}


def _mesh_rank(mesh, dim: str | None) -> tuple[int, int, list[int]]:
    """(this rank's coordinate, size, global ranks of its group) along mesh dimension ``dim``."""
    if dim is None or mesh.mesh_dim_names is None or dim not in mesh.mesh_dim_names:
        return 0, 1, [dist.get_rank()]
    return mesh.get_local_rank(dim), mesh.size(mesh.mesh_dim_names.index(dim)), \
        dist.get_process_group_ranks(mesh.get_group(dim))


class NotFollowable(ValueError):
    """The job's optimizer state cannot be followed exactly from its all-reduces; the message
    says why and which setting makes the job followable."""


def fsdp_units(module) -> list[list[str]] | None:
    """The FQNs of each FSDP2 ``fully_shard`` unit's parameters (its reduce buffer's order), in
    the order backward reduces them: the inner units in reverse registration order (the reverse
    of the forward), the root's own last. None: no FSDP2 unit in ``module``."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(p): n for n, p in reducer_params(module)}
    inner, root, found = [], [], False
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            found = True
            for group in sub._get_fsdp_state()._fsdp_param_groups:
                mp = group.mp_policy
                reduce = mp.reduce_dtype or mp.param_dtype or torch.float32
                if reduce != torch.float32:
                    raise ValueError(f"FSDP2 unit {type(sub).__name__} reduces its gradients in {reduce}; the "
                                     "sharded link follows float32 reduction "
                                     "(MixedPrecisionPolicy(reduce_dtype=torch.float32))")
                unit = [names[id(fp.sharded_param)] for fp in group.fsdp_params if id(fp.sharded_param) in names]
                (root if sub is module else inner).append(unit)
    if not found:
        return None
    return [u for u in list(reversed(inner)) + root if u]


def describe_fsdp(model, units: list[list[str]], appliances: dict[str, str] | None = None) -> ShardedLayout:
    """The layout of an FSDP2 job, from this rank's parameters (no collective): every parameter a
    DTensor on one mesh, ``(Shard(0),)`` (pure FSDP: the layout comes back with its refusal) or
    ``(Replicate(), Shard(0))`` (HSDP)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard

    named = reducer_params(unwrap(model))
    first = named[0][1]
    for n, p in named:
        if p.dtype != torch.float32:
            raise ValueError(f"{n}: {p.dtype} parameters; the sharded link follows float32 models")
        if not _is_dtensor(p) or p.device_mesh != first.device_mesh or p.placements != first.placements:
            raise ValueError(f"{n}: not a DTensor on the FSDP mesh with placements {first.placements} (every "
                             "parameter must be in a fully_shard unit of one mesh)")
    place, mesh = tuple(first.placements), first.device_mesh
    if place == (DShard(0),):
        ranks = [mesh.mesh.tolist()]
    elif place == (Replicate(), DShard(0)):
        ranks = mesh.mesh.tolist()
    else:
        raise ValueError(f"FSDP2 parameters placed {place} on mesh {mesh.mesh_dim_names}: the sharded link follows "
                         "fully_shard on a 1-d mesh (Shard(0)) or a 2-d (replicate, shard) mesh (Replicate(), "
                         "Shard(0)); TP inside FSDP2 is not supported")
    params = [ParamSpec(n, tuple(p.shape), "float32") for n, p in named]
    lay = shard_rules.hsdp(params, len(ranks), len(ranks[0]), units=units, ranks=ranks)
    if appliances:
        names = [g.name for g in lay.groups]
        if sorted(appliances) != sorted(names):
            raise ValueError(f"appliances name groups {sorted(appliances)}, the job's groups are {names}")
        lay = shard_rules.hsdp(params, len(ranks), len(ranks[0]), units=units, ranks=ranks,
                               appliances=[appliances[n] for n in names])
    return lay


def check_followable(layout: ShardedLayout, weights_only: bool = False) -> None:
    """NotFollowable when the layout's optimizer state cannot be followed exactly, unless the job
    asks for weight snapshots instead (``weights_only``: FSDP2's parameter all-gathers carry them)."""
    if layout.refusal is None:
        if weights_only:
            raise ValueError("weights_only=True is for jobs whose optimizer state cannot be followed from the "
                             "wire; this job's can: attach it without weights_only")
        return
    if weights_only:
        if layout.scheme != "fsdp2":
            raise ValueError(f"weights-only protection follows FSDP2's parameter all-gathers; a {layout.scheme} "
                             f"layout's are not modelled. The job as it is: {layout.refusal}")
        return
    raise NotFollowable(f"{layout.refusal}. attach refuses the job rather than leave it unprotected (or attach "
                        "it with weights_only=True for weight snapshots and fallback checkpoints)"
                        if layout.scheme == "fsdp2" else
                        f"{layout.refusal}. attach refuses the job rather than leave it unprotected")


def describe(model, mesh=None, *, appliances: dict[str, str] | None = None, pp_stage: int | None = None,
             pp: int | None = None, dp_dim: str = "dp", tp_dim: str | None = "tp",
             pp_dim: str = "pp") -> ShardedLayout:
    """The job's ShardedLayout from every rank's parameters (collective: every rank calls it;
    an FSDP2 model's is read locally, ``describe_fsdp``). ``appliances``: DP group name -> name of
    the appliance that follows it (default: one appliance per group, "appliance-<i>" in group
    order). ``mesh`` names the DP and (optional) TP dimensions; the stage is the mesh's ``pp_dim``
    coordinate when it has one (``pp_stage``/``pp``, if given, must agree), else ``pp_stage`` of
    ``pp`` (default 0 of 1)."""
    units = fsdp_units(unwrap(model))
    if units is not None:
        if (pp_stage or 0) != 0 or (pp or 1) != 1 or (mesh is not None and pp_dim in (mesh.mesh_dim_names or ())):
            raise ValueError("FSDP2 with pipeline stages is not supported by the sharded link")
        return describe_fsdp(model, units, appliances)
    if mesh is None:
        raise ValueError("describe needs the job's DeviceMesh (dims named dp, tp, pp)")
    names = mesh.mesh_dim_names or ()
    if dp_dim not in names:
        raise ValueError(f"the mesh has no {dp_dim!r} dimension (dims {mesh.mesh_dim_names})")
    if pp_dim in names:
        at, size = mesh.get_local_rank(pp_dim), mesh.size(names.index(pp_dim))
        if (pp_stage is not None and pp_stage != at) or (pp is not None and pp != size):
            raise ValueError(f"pp_stage={pp_stage}, pp={pp}, but this rank is stage {at} of {size} on the mesh's "
                             f"{pp_dim!r} dimension")
        pp_stage, pp = at, size
    pp_stage, pp = (0 if pp_stage is None else pp_stage), (1 if pp is None else pp)
    if not 0 <= pp_stage < pp:
        raise ValueError(f"pp_stage {pp_stage} outside 0..{pp - 1}")
    dp_rank, dp, dp_ranks = _mesh_rank(mesh, dp_dim)
    tp_rank, tp, _ = _mesh_rank(mesh, tp_dim)
    mine = {"rank": dist.get_rank(), "stage": pp_stage, "dp_rank": dp_rank, "dp": dp, "tp_rank": tp_rank, "tp": tp,
            "dp_ranks": dp_ranks, "entries": [_entry(n, p, tp_dim) for n, p in reducer_params(unwrap(model))]}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return layout_of(every, pp, appliances)


def layout_of(reports: list[dict], pp: int, appliances: dict[str, str] | None = None) -> ShardedLayout:
    """The ShardedLayout of the ranks' reports (``describe``); a job whose ranks disagree is an error."""
    tp, dp = reports[0]["tp"], reports[0]["dp"]
    if any(r["tp"] != tp or r["dp"] != dp for r in reports):
        raise ValueError("the ranks report different TP/DP sizes")
    if len(reports) != tp * dp * pp:
        raise ValueError(f"{len(reports)} ranks for TP={tp} x DP={dp} x PP={pp}")
    by_group: dict[tuple[int, int], list[dict]] = {}
    for r in reports:
        by_group.setdefault((r["stage"], r["tp_rank"]), []).append(r)
    want = {(s, t) for s in range(pp) for t in range(tp)}
    if set(by_group) != want:
        raise ValueError(f"DP groups {sorted(by_group)} do not cover stages 0..{pp - 1} x TP ranks 0..{tp - 1} "
                         "(pp_stage per rank?)")
    names = [group_name(s, t) for s, t in sorted(want)]
    follows = dict(appliances or {name: f"appliance-{i}" for i, name in enumerate(names)})
    unknown = set(follows) - set(names)
    if unknown or set(names) - set(follows):
        raise ValueError(f"appliances name groups {sorted(follows)}, the job's groups are {names}")
    groups, params, seen = [], [], {}
    for (s, t), members in sorted(by_group.items()):
        members.sort(key=lambda r: r["dp_rank"])
        name = group_name(s, t)
        ranks = [r["rank"] for r in members]
        if [r["dp_rank"] for r in members] != list(range(dp)):
            raise ValueError(f"group {name}: DP ranks {[r['dp_rank'] for r in members]}")
        if any(sorted(r["dp_ranks"]) != sorted(ranks) for r in members):
            raise ValueError(f"group {name}: the mesh's DP group {members[0]['dp_ranks']} is not the ranks "
                             f"{ranks} of stage {s}, TP rank {t}")
        first = members[0]["entries"]
        for r in members[1:]:
            if r["entries"] != first:
                raise ValueError(f"group {name}: DP ranks {ranks[0]} and {r['rank']} hold different parameters "
                                 "(a DP group's ranks must be replicas)")
        shards = []
        for e in first:
            owner = seen.setdefault(e["fqn"], s)
            if owner != s:
                raise ValueError(f"{e['fqn']} is held by stages {owner} and {s}: a parameter belongs to one stage")
            if t == 0:
                params.append(ParamSpec(e["fqn"], tuple(e["global_shape"]), "float32"))
            shards.append(Shard(e["fqn"], tuple(e["global_shape"]), e["tp_dim"], tuple(e["offset"]),
                                tuple(e["shape"])))
        groups.append(DpGroup(name, s, t, ranks, follows[name], shards))
    order = list(dict.fromkeys(follows[n] for n in names))
    return ShardedLayout(tp, pp, dp, params, groups, order)


def group_of(layout: ShardedLayout, rank: int) -> DpGroup:
    for g in layout.groups:
        if rank in g.ranks:
            return g
    raise ValueError(f"rank {rank} is in no DP group of the layout")


class ShardLink(TrainerLink):
    """A TrainerLink on DP group ``group``'s shard (see the module text); every rank makes one,
    the group's DP-rank-0 process talks to ``appliance``."""

    def __init__(self, model, optimizer, *, shards: ShardedLayout, group: str, appliance, secret,
                 weights_only: bool = False, **kw):
        g = shards.group(group)
        if dist.get_rank() not in g.ranks:
            raise ValueError(f"rank {dist.get_rank()} is not in DP group {group} (ranks {g.ranks})")
        named = reducer_params(unwrap(model))
        have = [(n, tuple(local(p).shape)) for n, p in named]
        want = [(s.fqn, s.local_shape) for s in g.shards]
        if have != want:
            raise ValueError(f"the module's parameters are not DP group {group}'s slices: {have[:3]}... vs "
                             f"{want[:3]}...")
        self.weights_only = weights_only
        self.shards, self.group = shards, group
        # ZeRO: every rank is on the one ring, but only partition k's owner (DP rank k) holds its state
        leader = g.ranks[g.shard_index] if shards.scheme == "zero" else g.ranks[0]
        super().__init__(model, optimizer, appliance=appliance, secret=secret, leader=leader, **kw)

    def _job_layout(self, order: list[int]) -> JobLayout:
        g = self.shards.group(self.group)
        if g.wire is None:
            return ddp_layout(self.ddp_model, [local(p) for p in self.model_params], self.names, order)
        # the framework's own all-reduces (config.shard_rules), one bucket each; their padding is in ``shards``
        return g.job_layout(self.grad_dtype)

    def _register_extra(self) -> dict:
        return {"shards": self.shards.to_dict(), "group": self.group} | ({"weights_only": True}
                                                                           if self.weights_only else {})

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model: the norm of every group's
        DTensor gradients as torch reduces it over the mesh (the same on every rank), and the
        coefficient applied sent to every group's appliance. Returns the total norm (a plain tensor)."""
        if self.shards.pp > 1:
            raise ValueError("clipping through a sharded link with pipeline stages is not supported: the norm spans "
                             "every stage, which no DTensor reduces")
        if not all(_is_dtensor(p) for p in self.masters):
            raise ValueError("clipping through a sharded link needs every parameter a DTensor (its norm is then "
                             "reduced over the mesh)")
        grads = [p.grad for p in self.masters if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
        torch.nn.utils.clip_grads_with_norm_(self.masters, max_norm, total, foreach)
        total = total.full_tensor() if _is_dtensor(total) else total
        self.note_clip(total, max_norm, norm_type)
        return total


def attach_sharded(model, optimizer, mesh=None, *, appliances: dict[str, tuple[str, int]], secret,
                   follows: dict[str, str] | None = None, layout: ShardedLayout | None = None,
                   weights_only: bool = False, pp_stage: int | None = None, pp: int | None = None,
                   dp_dim: str = "dp", tp_dim: str | None = "tp", pp_dim: str = "pp", restore: str | None = None,
                   connect_timeout: float = 0.0, **kw) -> ShardLink:
    """Attach a TP-sharded (DTensor) model, a pipeline stage's, or an FSDP2 HSDP model to the appliances
    that follow its groups; every rank calls it (collective for TP/PP). ``appliances``: group name
    ("pp<s>-tp<t>", "pp0-tp0-sh<k>" for shard index k) -> the address of the control plane following
    that group; ``follows``: group -> appliance name (which appliance process, for joint checkpoints).
    ``layout``: the job's layout when the framework's rules give it (``config.shard_rules``) instead
    of reading it from the model. A job whose optimizer state cannot be followed exactly raises
    NotFollowable (reason and setting); ``weights_only=True`` registers a pure FSDP job for weight
    snapshots and fallback checkpoints instead (see the module text). ``restore="appliance"``: every
    rank first pulls its shard (``restore_sharded``). ``connect_timeout``: seconds the leaders wait
    for their first connection. Other keywords go to TrainerLink (scheduler, data, parts, job...)."""
    shards = layout if layout is not None else describe(model, mesh, appliances=follows, pp_stage=pp_stage, pp=pp,
                                                        dp_dim=dp_dim, tp_dim=tp_dim, pp_dim=pp_dim)
    check_followable(shards, weights_only)
    if shards.scheme == "zero":
        raise ValueError("the zero layout is DeepSpeed's: attach the engine with "
                         "mirrorckpt.control.integrations.deepspeed.attach_deepspeed (it registers the optimizer's "
                         "flat fp32 partitions as the link's tensors)")
    if shards.scheme == "megatron":
        raise ValueError("the megatron layout can be followed, but attaching such a job needs that framework's "
                         "integration (the optimizer's flat partitions as the link's tensors), which this version "
                         "does not have")
    g = group_of(shards, dist.get_rank())
    if g.name not in appliances:
        raise ValueError(f"no control-plane address for DP group {g.name} (appliances= names {sorted(appliances)})")
    restored = None
    if restore == "appliance":
        restored = restore_sharded(model, optimizer, shards=shards, appliances=appliances, secret=secret,
                                   scheduler=kw.get("scheduler"), data=kw.get("data"))
    elif restore is not None:
        raise ValueError(f"restore={restore!r}: a sharded job restores from 'appliance' (or loads a joint "
                         "checkpoint with dcp.load itself)")
    link = ShardLink(model, optimizer, shards=shards, group=g.name, appliance=appliances[g.name], secret=secret,
                     weights_only=weights_only, **kw)
    return started(link, restored, connect_timeout)


def _as_dtensor(src: torch.Tensor, like):
    if not _is_dtensor(like):
        return src
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(src, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def restore_sharded(model, optimizer, *, appliances: dict[str, tuple[str, int]], secret, mesh=None,
                    shards: ShardedLayout | None = None, step: int | None = None, scheduler=None, data=None,
                    timeout: float = 60.0, role: str = "trainer", client_options: dict | None = None,
                    **describe_kw) -> Restored:
    """Every rank pulls its own shard from the control plane of its DP group (RESTORE_REQUEST) and
    loads it into its DTensors (parameters and optimizer state), scheduler, RNG and ``data``.
    Without ``step`` it is collective: the ranks check that all groups' states are the same step
    (else ValueError: the appliances hold different steps; restore from a joint checkpoint instead).
    With ``step`` every rank asks its plane for that step and none waits for another (with an FSDP2
    model, whose layout each rank reads alone, or ``shards`` given: no collective at all)."""
    if shards is None:
        shards = describe(model, mesh, **describe_kw)
    g = group_of(shards, dist.get_rank())
    module = unwrap(model)
    named = reducer_params(module)
    params, ostate, rng, meta = pull_shard(g, appliances, secret, step=step, timeout=timeout, role=role,
                                           client_options=client_options)
    by_name = dict(named)
    params = {n: _as_dtensor(v, by_name[n]) for n, v in params.items()}
    for n, st in ostate.items():
        p = by_name.get(n)
        for k, v in sorted(st.items()):  # every rank's state in one key order, whatever the appliance sent
            del st[k]
            st[k] = _as_dtensor(v, p) if p is not None and v.dim() and tuple(v.shape) == tuple(local(p).shape) else v
    groups = loads(meta["param_groups"])
    sched = loads(meta["lr_scheduler"]) if meta.get("lr_scheduler") is not None else None
    load_trainer_state(module, optimizer, scheduler, params, ostate, groups, sched)
    set_rng_states(rng)
    dp = meta.get("data_position")
    if data is not None and dp is not None:
        data.load_state_dict(dp)
    return Restored(f"appliance:{g.name}", int(meta["iterations_done"]), int(meta["step"]), dp, rng)


def pull_shard(g: DpGroup, appliances: dict[str, tuple[str, int]], secret, *, step: int | None = None,
               timeout: float = 60.0, role: str = "trainer", client_options: dict | None = None):
    """RESTORE_REQUEST to the control plane of DP group ``g``: (parameters, optimizer state, RNG
    states, meta) of its slices, checked against the group's. With ``step`` the plane must send
    that step; without, every rank checks (collective) that all groups' planes sent the same."""
    host, port = appliances[g.name]
    with ControlClient(host, port, secret, role, **{"backoff_max": 0.5, **(client_options or {})}) as cli:
        if not cli.wait_connected(timeout):
            raise ConnectionError(f"appliance {host}:{port} of DP group {g.name} not reachable in {timeout:g} s")
        reply = cli.request(m.make(m.RESTORE_REQUEST, step=step), timeout=timeout)
    if reply.type != m.RESTORE_STATE:
        raise ValueError(f"appliance of DP group {g.name} answered {reply.type}, not RESTORE_STATE")
    params, ostate, rng, meta = parse_restore(reply)
    got = sorted((n, tuple(v.shape)) for n, v in params.items())
    want = sorted((s.fqn, s.local_shape) for s in g.shards)
    if got != want:
        raise ValueError(f"the appliance of DP group {g.name} holds {got[:3]}..., the group's slices are "
                         f"{want[:3]}...")
    if step is not None:
        if int(meta["iterations_done"]) != step:
            raise ValueError(f"the appliance of DP group {g.name} sent step {meta['iterations_done']}, not {step}")
    else:
        steps: list = [None] * dist.get_world_size()
        dist.all_gather_object(steps, (g.name, int(meta["iterations_done"])))
        if len({s for _, s in steps}) != 1:
            raise ValueError(f"the DP groups' appliances hold different steps {sorted(set(steps))}: no consistent "
                             "sharded state to resume from (load the joint checkpoint instead)")
    return params, ostate, rng, meta
