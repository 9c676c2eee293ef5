"""DeepSpeed ZeRO-1/2: an engine attached to the appliances that follow its partitions.

    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(...),
                                           lr_scheduler=scheduler, config=ds_config)
    link = attach_deepspeed(engine, {"pp0-tp0-sh0": (host, port0), "pp0-tp0-sh1": (host, port1)},
                            secret, data=loader)                       # restore=True to resume
    ... the usual loop: engine(x), engine.backward(loss), engine.step() ...
    link.close()

``zero_layout(engine)`` is the sharded layout: ``config.shard_rules.zero`` fed from the engine's
own settings (its ZeRO stage, data-parallel group, the optimizer's param groups
``bit16_groups``, ``reduce_bucket_size``, ``round_robin_gradients``, ``reduce_scatter`` and
``use_multi_rank_bucket_allreduce``, fp16's overflow check), checked against the partition the
engine made on this rank (``params_in_partition``, ``first_offset``): a DeepSpeed whose rules
differ from the builder's is refused by name, never registered wrong. The gradient buckets assume
the ready order is the reverse of the model's (the builder's default).

Each partition k is a DP group of the layout ("pp0-tp0-sh<k>"), followed by the control plane
``appliances`` names for it; its owner, DP rank k, is the only rank that talks to it
(``control.sharded.ShardLink``). The link's tensors are this rank's slices of the optimizer's
flat fp32 partitions (``single_partition_of_fp32_groups``): 1-d views sharing their storage, named
by the parameter they cut, with the torch optimizer's state (``step``, ``exp_avg``...) viewed the
same way. ZeRO steps each param group's partition in turn, its gradient living only during its
own step; the engine's ``_optimizer_step`` is wrapped so that the groups' steps run together once
every group's gradient is formed: the link's step hooks run before and after them (REGISTER,
STEP_META, GoCkpt parts with each slice's gradient), the bit16 partitions are copied from the
fp32 ones as ZeRO copies them. DeepSpeed's ``gradient_clipping`` is seen on the gradients
(``control.link.clip``: the one float32 factor ZeRO multiplied them by) and sent as the clip
coefficient; a step ZeRO skips (a non-finite norm) is reported skipped.

``restore=True`` (every rank, right after ``deepspeed.initialize``): each rank pulls its own
partition from its group's control plane (the ranks check that every group sent the same step),
loads the slices into the fp32 partitions and the optimizer state, the param groups, scheduler,
RNG and ``data``, then copies the fp32 partitions into the bit16 parameters and all-gathers them
(ZeRO's ``update_lp_params``, what it does after a step); the engine's step counters go on from
the restored step. ``link.restored`` says what was restored.

Refused at attach, by setting: ZeRO-3 and stage 0, fp16/bf16 (``fp16``/``bf16`` in the config:
the masters of low-precision gradients are not formed here), ``offload_optimizer``,
``gradient_accumulation_steps`` > 1 (ZeRO-2 reduces every micro-step: the ring's model has one
bucket sequence per step), an optimizer DeepSpeed builds from its config (FusedAdam,
DeepSpeedCPUAdam: the replica steps torch's Adam, AdamW, SGD), and what ``zero_layout`` refuses.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from mirrorckpt.config import shard_rules
from mirrorckpt.config.layout import ParamSpec
from mirrorckpt.config.shards import DpGroup, ShardedLayout, group_name
from mirrorckpt.config.training import ClipSpec, ParamGroupSpec
from mirrorckpt.control.link.checks import AttachError, check_scheduler
from mirrorckpt.control.link.clip import _indices, _sample, coefficient
from mirrorckpt.control.link.describe import DTYPE_NAMES, set_rng_states, training_spec
from mirrorckpt.control.sharded import ShardLink, check_followable, pull_shard
from mirrorckpt.control.trainer import started

log = logging.getLogger("mirrorckpt.control.integrations")


def zero_layout(engine, appliances: list[str] | None = None) -> ShardedLayout:
    """The ShardedLayout of a DeepSpeed ZeRO-1/2 engine (see the module text); AttachError when the
    engine is not ZeRO-1/2 or its partition differs from the layout's."""
    import torch.distributed as dist

    stage = engine.zero_optimization_stage()
    if stage not in (1, 2):
        raise AttachError(f"DeepSpeed ZeRO stage {stage}: the appliance follows ZeRO-1 and ZeRO-2 (stage 3 gathers "
                          "parameters per layer; stage 0 is plain data parallelism: use attach on engine.module)")
    zo = engine.optimizer
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    names = {id(p): n for n, p in named}
    params = [ParamSpec(n, tuple(p.shape), DTYPE_NAMES[p.dtype]) for n, p in named]
    groups = [[names[id(p)] for p in g] for g in zo.bit16_groups]
    ranks = dist.get_process_group_ranks(zo.dp_process_group) if dist.is_initialized() else None
    layout = shard_rules.zero(params, engine.dp_world_size, param_groups=groups,
                              reduce_bucket_size=int(zo.reduce_bucket_size), round_robin=bool(zo.round_robin_gradients),
                              reduce_scatter=bool(zo.reduce_scatter),
                              multi_rank_bucket_allreduce=bool(getattr(zo, "use_multi_rank_bucket_allreduce", True)),
                              check_grad_overflow=bool(engine.fp16_enabled()), ranks=ranks, appliances=appliances)
    check_partition(layout, zo, names, dist.get_rank(group=zo.dp_process_group) if dist.is_initialized() else 0)
    return layout


def check_partition(layout: ShardedLayout, zo, names: dict[int, str], dp_rank: int) -> None:
    """The slices ``layout`` gives partition ``dp_rank`` (parameter, start) against those the ZeRO
    optimizer holds there: per param group, ``params_in_partition`` from ``first_offset`` in the first."""
    got = [(s.fqn, s.flat[0]) for s in layout.groups[dp_rank].shards]
    want = [(names[id(p)], offset if k == 0 else 0)
            for members, offset in zip(zo.params_in_partition, zo.first_offset) for k, p in enumerate(members)]
    if got != want:
        raise AttachError(f"DeepSpeed partitioned the optimizer state of DP rank {dp_rank} as {want[:4]} (parameter, "
                          f"start), the ZeRO layout says {got[:4]}: this DeepSpeed's partition rules are not the ones "
                          "config.shard_rules models")


def check_engine(engine) -> None:
    """AttachError naming the setting when the link cannot follow this engine (module text)."""
    zo = engine.optimizer
    if engine.fp16_enabled() or engine.bfloat16_enabled():
        raise AttachError("DeepSpeed with fp16/bf16 enabled: attach_deepspeed follows fp32 ZeRO jobs (the fp32 masters "
                          "of 16-bit gradients are not formed here); train without the fp16/bf16 config sections")
    if getattr(zo, "cpu_offload", False):
        raise AttachError("DeepSpeed zero_optimization.offload_optimizer: ZeRO-Offload steps the partitions on the "
                          "host through other buffers, which the link does not follow; train without it")
    if getattr(zo, "torch_autocast_gradscaler", None) is not None or getattr(zo, "zenflow", False):
        raise AttachError("DeepSpeed with torch_autocast or ZenFlow: the link follows ZeRO's plain optimizer step")
    if engine.gradient_accumulation_steps() != 1:
        raise AttachError(f"DeepSpeed gradient_accumulation_steps={engine.gradient_accumulation_steps()}: ZeRO reduces "
                          "every micro-step, the ZeRO layout models one bucket sequence per step; set it to 1")
    if not hasattr(zo, "single_partition_of_fp32_groups") or not hasattr(zo, "_optimizer_step"):
        raise AttachError(f"DeepSpeed optimizer {type(zo).__name__}: attach_deepspeed follows DeepSpeedZeroOptimizer "
                          "(ZeRO-1/2)")


class _Slices:
    """The slices as a module whose parameters are ``named`` (what TrainerLink reads them from)."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]]):
        self._named = named

    def named_modules(self):
        yield "", self

    def named_parameters(self, recurse: bool = True):
        yield from self._named


class _SliceState(Mapping):
    """The torch optimizer's state of each slice: views of its partition's state tensors."""

    def __init__(self, view: Partition):
        self._view = view

    def __getitem__(self, p):
        group_index, start, stop = self._view.place[id(p)]
        state_of = self._view.base.state.get(self._view.flats[group_index])
        if not state_of:
            raise KeyError(p)
        return {k: v[start:stop] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in state_of.items()}

    def __iter__(self):
        view = self._view
        return iter([p for p in view.params if view.base.state.get(view.flats[view.place[id(p)][0]])])

    def __len__(self):
        return len(list(iter(self)))


class _Hook:
    def __init__(self, hooks: list, fn):
        self._hooks, self._fn = hooks, fn
        hooks.append(fn)

    def remove(self) -> None:
        if self._fn in self._hooks:
            self._hooks.remove(self._fn)


class Partition:
    """This rank's ZeRO partition as the link's module and optimizer: ``module`` holds the slices
    (``group``'s, in its order) and ``param_groups``/``state``/step hooks are those of the torch
    optimizer ZeRO steps, per slice."""

    def __init__(self, zo, group: DpGroup, param_groups: list[list[str]]):
        self.zo, self.base = zo, zo.optimizer
        self.flats = list(zo.single_partition_of_fp32_groups)
        member_of = {n: i for i, names in enumerate(param_groups) for n in names}
        used = [0] * len(self.flats)
        named, self.place, self.members = [], {}, [[] for _ in self.flats]
        for s in group.shards:
            group_index = member_of[s.fqn]
            start, stop = used[group_index], used[group_index] + s.numel
            if stop > self.flats[group_index].numel():
                raise AttachError(f"{s.fqn}: slice {start}..{stop} outside param group {group_index}'s fp32 "
                                  f"partition of {self.flats[group_index].numel()} elements")
            used[group_index] = stop
            p = torch.nn.Parameter(self.flats[group_index].detach()[start:stop])  # shares the partition's storage
            named.append((s.fqn, p))
            self.place[id(p)] = (group_index, start, stop)
            self.members[group_index].append(p)
        self.params = [p for _, p in named]
        self.module = _Slices(named)
        self.state = _SliceState(self)
        self.pre_hooks: list = []
        self.post_hooks: list = []

    @property
    def param_groups(self) -> list[dict]:
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": self.members[i]}
                for i, g in enumerate(self.base.param_groups)]

    def register_step_pre_hook(self, fn) -> _Hook:
        return _Hook(self.pre_hooks, fn)

    def register_step_post_hook(self, fn) -> _Hook:
        return _Hook(self.post_hooks, fn)

    def set_grads(self, grads: dict[int, torch.Tensor]) -> None:
        for p in self.params:
            group_index, start, stop = self.place[id(p)]
            p.grad = grads[group_index][start:stop]

    def clear_grads(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def load(self, params: dict, ostate: dict, groups: list[dict]) -> None:
        """Restored slices, their optimizer state and the param groups into the fp32 partitions and
        the torch optimizer (the partitions' padding: zeros, as ZeRO keeps it)."""
        from mirrorckpt.updater.restore import keep_implementation

        names = {id(p): n for n, p in self.module.named_parameters()}
        for p in self.params:
            p.copy_(params[names[id(p)]])
        if len(groups) != len(self.base.param_groups):
            raise ValueError(f"restored state has {len(groups)} param groups, the optimizer "
                             f"{len(self.base.param_groups)}")
        state = {}
        for group_index, flat in enumerate(self.flats):
            held = [(p, ostate[names[id(p)]]) for p in self.members[group_index] if names[id(p)] in ostate]
            if not held:
                continue
            state_of = {}
            for k, v in held[0][1].items():
                if v.dim():
                    state_of[k] = torch.zeros_like(flat)
                else:
                    if any(not torch.equal(other[k], v) for _, other in held):
                        raise ValueError(f"restored {k!r} differs between the slices of param group {group_index}")
                    state_of[k] = v.clone()
            for p, saved in held:
                _, start, stop = self.place[id(p)]
                for k, v in saved.items():
                    if v.dim():
                        state_of[k][start:stop].copy_(v)
            state[group_index] = state_of
        out = []
        for group_index, g in enumerate(groups):
            g = dict(g, params=[group_index])
            if "betas" in g:
                g["betas"] = tuple(g["betas"])
            out.append(g)
        keep_implementation(out, self.base.param_groups)
        self.base.load_state_dict({"state": state, "param_groups": out})


class ZeroSteps:
    """The engine's ZeRO optimizer with its param groups' steps run together (module text): the
    link's hooks around them, the clip coefficient found on the gradients, skipped steps said."""

    def __init__(self, zo, view: Partition, link):
        self.zo, self.view, self.link = zo, view, link
        self._grads: dict[int, torch.Tensor] = {}
        self.coefficients: list = []
        self._orig = {k: getattr(zo, k) for k in ("_optimizer_step", "unscale_and_clip_grads", "step")}
        zo._optimizer_step, zo.unscale_and_clip_grads, zo.step = self._group_step, self._clip, self._step

    def remove(self) -> None:
        for k, fn in self._orig.items():
            setattr(self.zo, k, fn)

    def _step(self, *args, **kwargs):
        self.coefficients = []
        out = self._orig["step"](*args, **kwargs)
        if getattr(self.zo, "overflow", False):  # ZeRO skipped the step (non-finite norm)
            self._grads.clear()
            self.link._skipped_step()
        return out

    def _clip(self, grads, total_norm):
        indices = [_indices(g.numel(), g.device) for g in grads]
        before = _sample(grads, indices)
        out = self._orig["unscale_and_clip_grads"](grads, total_norm)
        self.coefficients.append(coefficient(before, _sample(grads, indices)))
        return out

    def _coefficient(self):
        got = {c for c, _ in self.coefficients}
        if len(got) == 1 and None not in got:
            return got.pop()
        why = "; ".join(w for c, w in self.coefficients if c is None) or f"the param groups were scaled by {got}"
        log.error("step %d: the clip ZeRO applied cannot be told from its gradients (%s); the appliance cannot "
                  "follow this step", self.link.iterations_done + 1, why)
        return None

    def _group_step(self, group_no: int) -> None:
        zo, view = self.zo, self.view
        self._grads[group_no] = view.flats[group_no].grad
        last = len(view.flats) - 1
        if group_no != last:
            return  # stepped below with the others, once every group's gradient is formed
        spec = self.link.training.clip
        if spec is not None and self.link.leader:
            coef = self._coefficient()
            if coef is not None:
                self.link.meta.note_coefficient(coef, spec.max_norm, spec.norm_type)
        view.set_grads(self._grads)
        for fn in list(view.pre_hooks):
            fn(view, (view,), {})
        for k in range(last + 1):
            view.flats[k].grad = self._grads[k]
            self._orig["_optimizer_step"](k)
            if k != last:  # ZeRO copied this group's partition before its step ran: copy it again
                view.flats[k].grad = None
                owner = torch.distributed.get_rank(group=zo.real_dp_process_group[k])
                zo.parallel_partitioned_bit16_groups[k][owner].data.copy_(view.flats[k].data)
        view.clear_grads()
        self._grads.clear()
        for fn in list(view.post_hooks):
            fn(view, (view,), {})


def _training(engine, view: Partition, scheduler):
    """The TrainingSpec of the torch optimizer ZeRO steps, its param groups named by this rank's slices."""
    import dataclasses

    base = engine.optimizer.optimizer
    spec = training_spec(base, scheduler, "float32", {id(f): f"param group {i}" for i, f in enumerate(view.flats)})
    if spec.param_groups is not None:
        names = {id(p): n for n, p in view.module.named_parameters()}
        spec = dataclasses.replace(spec, param_groups=[
            ParamGroupSpec([names[id(p)] for p in members], g.options)
            for members, g in zip(view.members, spec.param_groups)])
    clip = float(engine.gradient_clipping() or 0.0)
    if clip > 0:
        spec = dataclasses.replace(spec, clip=ClipSpec(clip, 2.0))
    return spec


@torch.no_grad()
def restore_engine(engine, view: Partition, group: DpGroup, appliances: dict, secret, *, scheduler=None,
                   data=None, step: int | None = None, timeout: float = 60.0, client_options: dict | None = None):
    """This rank's partition from its group's control plane into the engine (module text);
    collective (every rank). Returns the Restored record."""
    from mirrorckpt.control.link.restore import Restored
    from mirrorckpt.updater.dcp_keys import loads

    params, ostate, rng, meta = pull_shard(group, appliances, secret, step=step, timeout=timeout,
                                           client_options=client_options)
    view.load(params, ostate, loads(meta["param_groups"]))
    if scheduler is not None:
        if meta.get("lr_scheduler") is None:
            raise ValueError("the restored state has no scheduler state, but the engine has a scheduler")
        scheduler.load_state_dict(loads(meta["lr_scheduler"]))
    engine.optimizer.update_lp_params()  # ZeRO's own: bit16 partitions from the fp32 ones, all-gathered
    set_rng_states(rng)
    position = meta.get("data_position")
    if data is not None and position is not None:
        data.load_state_dict(position)
    done = int(meta["iterations_done"])
    engine.global_steps = done
    engine.global_samples = done * engine.train_batch_size()
    engine.micro_steps = done * engine.gradient_accumulation_steps()
    out = Restored(f"appliance:{group.name}", done, int(meta["step"]), position, rng)
    log.info("DeepSpeed: restored step %d of partition %s from %s: %d slices with their optimizer state, the param "
             "groups%s; bit16 parameters all-gathered", done, group.name, appliances[group.name], len(params),
             ", the scheduler" if scheduler is not None else "")
    return out


def attach_deepspeed(engine, appliances: dict[str, tuple[str, int]], secret, *, follows: dict[str, str] | None = None,
                     data=None, restore: bool = False, restore_step: int | None = None, connect_timeout: float = 0.0,
                     **link_kw):
    """Attach a DeepSpeed ZeRO-1/2 engine (see the module text); every rank calls it, right after
    ``deepspeed.initialize``. ``appliances``: group name ("pp0-tp0-sh<k>", partition k) -> the
    address of its control plane; ``follows``: group -> appliance name (default one each).
    ``restore=True``: every rank first pulls its partition (``restore_step``: that step, else
    whatever step all the planes hold). Other keywords go to the link (parts, job,
    fingerprint_every...). Returns the ShardLink of this rank's partition."""
    import torch.distributed as dist

    check_engine(engine)
    zo = engine.optimizer
    order = [follows[group_name(0, 0, k)] for k in range(engine.dp_world_size)] if follows else None
    layout = zero_layout(engine, order)
    check_followable(layout)
    group = layout.groups[dist.get_rank(group=zo.dp_process_group)]
    if group.name not in appliances:
        raise AttachError(f"no control-plane address for partition {group.name} (appliances= names "
                          f"{sorted(appliances)})")
    scheduler = engine.lr_scheduler
    if scheduler is not None:
        check_scheduler(scheduler, zo.optimizer)
    view = Partition(zo, group, layout.steps["param_groups"])
    training = _training(engine, view, scheduler)
    restored = None
    if restore:
        restored = restore_engine(engine, view, group, appliances, secret, scheduler=scheduler, data=data,
                                  step=restore_step, client_options=link_kw.get("client_options"))
    link = ZeroLink(engine, view, shards=layout, group=group.name, appliance=appliances[group.name], secret=secret,
                    scheduler=scheduler, data=data, training=training, **link_kw)
    return started(link, restored, connect_timeout)


class ZeroLink(ShardLink):
    """The ShardLink of this rank's ZeRO partition (module text); ``close`` gives the engine its
    own step back."""

    def __init__(self, engine, view: Partition, **kw):
        super().__init__(view.module, view, **kw)
        self.engine, self.view = engine, view
        self.zero_steps = ZeroSteps(engine.optimizer, view, self)

    def clip_grad_norm_(self, *_a, **_kw):
        raise ValueError("a DeepSpeed engine clips with gradient_clipping in its config (the link finds the "
                         "coefficient it applied)")

    def close(self, flush_timeout: float = 30.0) -> None:
        self.zero_steps.remove()
        super().close(flush_timeout)
