"""The CPU replica: fp32 master parameters and the real torch optimizer, stepped with the reduced
gradients read off the wire exactly as the trainer steps (ARCHITECTURE.md, "Trainer semantics").

The invariant: outside a bucket-by-bucket iteration in progress, the replica's state is the
trainer's state after ``iterations_done`` complete iterations. An incomplete iteration is never
applied: the replica turns stale and refuses every later iteration until ``resync``.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from mirrorckpt.config.layout import BucketSpec, JobLayout, numpy_dtype
from mirrorckpt.config.training import TrainingSpec
from mirrorckpt.parser.iteration import ReducedIteration
from mirrorckpt.updater import fingerprint as fp
from mirrorckpt.updater import numeric
from mirrorckpt.updater.dcp_keys import ReplicaState, rng_tensor, to_checkpoint
from mirrorckpt.updater.optim import (
    LossScaler,
    build_optimizer,
    build_scheduler,
    fresh_state,
    hparams_error,
    set_hparams,
    step_scheduler,
)

MASTER_DTYPES = ("float32", "bfloat16", "float16")  # model dtypes; the masters are always fp32
_OWN_FLAGS = ("foreach", "fused", "capturable", "differentiable")
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


log = logging.getLogger("mirrorckpt.updater.replica")

class ReplicaStale(RuntimeError):
    """The replica cannot go on at ``iteration`` and needs ``resync``. Missed gradient data leaves
    the state as it was, a good state one step behind (``state_good``: it may still be committed);
    drift from the trainer makes the state itself wrong."""

    def __init__(self, step: int, iteration: int, holes: dict | None = None, state_good: bool = True):
        self.step, self.iteration, self.holes = step, iteration, dict(holes or {})
        self.state_good = state_good
        missing = sum(n for hs in self.holes.values() for _, n in hs)
        what = (f"{len(self.holes)} bucket(s) incomplete, {missing} element(s) missing" if self.holes
                else "iteration not received")
        super().__init__(f"replica stale at iteration {iteration} (optimizer step {step}): {what}; "
                         "a resync from a checkpoint or the trainer is needed")


class LayoutMismatch(ValueError):
    """Gradient data or a state does not fit the job layout; nothing was applied."""


def wire_tensor(flat, grad_dtype: str) -> torch.Tensor:
    """A bucket's flat wire buffer as a torch tensor of the gradient dtype (no copy)."""
    if isinstance(flat, torch.Tensor):
        t = flat
        if grad_dtype == "bfloat16" and t.dtype in (torch.int16, torch.uint16):
            t = t.view(torch.bfloat16)
        return t
    a = np.asarray(flat)
    if grad_dtype == "bfloat16":
        a = a.view(np.int16)  # torch views int16 bits as bfloat16; uint16 views are less supported
    if a.flags.writeable:
        t = torch.from_numpy(a)
    else:
        with warnings.catch_warnings():  # read-only capture buffers: we only ever read them
            warnings.simplefilter("ignore")
            t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if grad_dtype == "bfloat16" else t


@dataclass
class _Pending:
    """An iteration being applied bucket by bucket."""

    iteration: int
    buckets: list[BucketSpec]
    done: set[int] = field(default_factory=set)
    journal: list[tuple[int, dict | None]] = field(default_factory=list)  # (param, saved state or None)
    meta: dict = field(default_factory=dict)
    # a step that waits for the last bucket (not separable): what each bucket contributes is
    # computed when it arrives; the last one only combines it
    found_inf: bool = False  # fp16: any non-finite gradient in the buckets unscaled so far
    norms: dict[int, torch.Tensor] = field(default_factory=dict)  # param -> its gradient's clip norm


class Replica:
    """``impl``: the optimizer implementation the replica runs ("mirror": the trainer's, see
    updater.numeric); it decides, with where the trainer steps, whether the replica is expected
    bit-exact or within a tolerance (``policy``)."""

    def __init__(self, layout: JobLayout, training: TrainingSpec, initial_params, impl: str = "mirror",
                 adopt: bool = False):
        """``adopt``: the float32 tensors of a ReplicaState given as ``initial_params`` become the
        replica's own (no copy; the caller hands them over), as a fallback's rebuild does."""
        if layout.grad_dtype != training.grad_dtype:
            raise LayoutMismatch(f"layout grad_dtype {layout.grad_dtype!r} differs from training "
                                 f"grad_dtype {training.grad_dtype!r}")
        for p in layout.params:
            if p.dtype not in MASTER_DTYPES:
                raise LayoutMismatch(f"parameter {p.name}: dtype {p.dtype!r} is not one of {', '.join(MASTER_DTYPES)}")
        names = [p.name for p in layout.params]
        if len(set(names)) != len(names):
            raise LayoutMismatch("layout parameter names are not unique")
        self.layout, self.training = layout, training
        self.names = names
        # empty: every construction fills them (or adopts tensors); untouched pages cost no memory
        self.params = [torch.empty(p.shape, dtype=torch.float32) for p in layout.params]
        self._grads = [torch.empty_like(p) for p in self.params]  # touched by the first mirror step
        self.separable = training.separable and not layout.used_map  # which parameters step: known at the end
        self.impl = impl
        self.policy = numeric.policy(training.optimizer, impl)
        self.synced_at = 0  # optimizer step at which the state was last the trainer's own
        self.decisions_overridden = 0  # skip decisions of the trainer that our own check disagreed with
        self._fresh_optimizer()
        self.iterations_done = 0
        self.step = 0
        self.stale: ReplicaStale | None = None
        self._pending: _Pending | None = None
        self._undo: dict[int, tuple[torch.Tensor, dict]] = {}  # pipelined mode: pre-bucket copies
        self.rng: dict[str, torch.Tensor] = {}
        self.data_position = None
        # a reported schedule (config.training.REPORTED): the trainer's scheduler state, as it sent it
        self.reported_schedule: dict | None = None
        if isinstance(initial_params, (ReplicaState, str, Path)):
            self.load_state(initial_params, adopt=adopt)
        else:
            self._set_params(initial_params)

    @classmethod
    def from_initial_weights(cls, layout: JobLayout, training: TrainingSpec, flat_or_dict,
                             impl: str = "mirror") -> Replica:
        """Weights seen on the wire (e.g. DDP's start-up broadcast), fresh optimizer at step 0.
        A flat buffer holds the parameters concatenated in layout order (bf16 as uint16 bits)."""
        if isinstance(flat_or_dict, dict):
            return cls(layout, training, flat_or_dict, impl)
        flat = flat_or_dict
        is_bf16 = (isinstance(flat, np.ndarray) and flat.dtype in (np.uint16, np.int16)) or (
            isinstance(flat, torch.Tensor) and flat.dtype in (torch.bfloat16, torch.int16, torch.uint16))
        t = wire_tensor(flat, "bfloat16" if is_bf16 else "float32").reshape(-1)
        if t.numel() != layout.total_numel:
            raise LayoutMismatch(f"initial weights hold {t.numel()} elements, the layout {layout.total_numel}")
        out, pos = {}, 0
        for p in layout.params:
            out[p.name] = t[pos:pos + p.numel].view(p.shape)
            pos += p.numel
        return cls(layout, training, out, impl)

    # ---- state -------------------------------------------------------------------------------

    @property
    def iteration(self) -> int:
        """Last applied 0-based iteration (-1 before the first)."""
        return self.iterations_done - 1

    def _fresh_optimizer(self):
        try:
            groups = self.training.groups(self.names)
        except ValueError as e:
            raise LayoutMismatch(str(e)) from None
        index = {n: i for i, n in enumerate(self.names)}
        self._order = [index[n] for names, _ in groups for n in names]  # optimizer position -> layout index
        self._group_names = [list(names) for names, _ in groups]
        self._specs = {index[n]: gs for names, gs in groups for n in names}  # layout index -> its group's spec
        spec = dataclasses.replace(self.training.optimizer, **numeric.replica_flags(self.training.optimizer, self.impl))
        self.optimizer = build_optimizer(spec, self.params,
                                         [([self.params[index[n]] for n in names], gs) for names, gs in groups])
        self.scheduler = build_scheduler(self.training.lr_schedule, self.optimizer)
        self.scaler = LossScaler(self.training.loss_scale) if self.training.loss_scale else None

    @torch.no_grad()
    def _set_params(self, tensors: dict, adopt: bool = False):
        if not isinstance(tensors, dict):
            raise TypeError(f"initial parameters must be a dict name -> tensor, a ReplicaState or a "
                            f"checkpoint path, got {type(tensors).__name__}")
        missing = [n for n in self.names if n not in tensors]
        extra = [n for n in tensors if n not in set(self.names)]
        if missing or extra:
            raise LayoutMismatch(f"parameters do not match the layout: missing {missing[:5]}, unexpected {extra[:5]}")
        for spec, p in zip(self.layout.params, self.params):
            v = tensors[spec.name]
            if not isinstance(v, torch.Tensor):
                v = np.asarray(v)
                v = wire_tensor(v, "bfloat16" if v.dtype in (np.uint16, np.int16) else "float32")
            if v.numel() != spec.numel or (v.dim() > 1 and tuple(v.shape) != spec.shape):
                raise LayoutMismatch(f"parameter {spec.name}: shape {tuple(v.shape)}, layout says {spec.shape}")
            if adopt and v.dtype == torch.float32 and v.is_contiguous() and tuple(v.shape) == spec.shape:
                p.set_(v)  # handed over: the replica's from now on
            else:
                p.copy_(v.reshape(spec.shape))  # exact widening for bf16/fp16

    @torch.no_grad()
    def load_state(self, state, adopt: bool = False) -> None:
        """Replace the whole state (params, optimizer, scheduler, loss scale, counters) from a
        ReplicaState (a trainer registration) or a checkpoint directory / root. The optimizer
        state's tensors are always taken as they are (torch's load_state_dict keeps them);
        ``adopt`` takes the parameters too."""
        if isinstance(state, (str, Path)):
            from mirrorckpt.updater.restore import read_state

            state = read_state(state)
        tr = (state.training or {}).get("optimizer", {}).get("name")
        if tr is not None and tr != self.training.optimizer.name:
            raise LayoutMismatch(f"state was made by optimizer {tr!r}, the training spec says "
                                 f"{self.training.optimizer.name!r}")
        self._set_params(state.params, adopt)
        self._fresh_optimizer()  # scheduler built before the optimizer state is loaded, as torch expects
        self.optimizer.load_state_dict(self._indexed_optim(state.optim, getattr(state, "unstepped", ())))
        self.reported_schedule = None
        if self.training.lr_schedule.reported:
            if not isinstance(state.lr_scheduler, dict):
                raise LayoutMismatch("state has no lr_scheduler state, the training spec's schedule is reported "
                                     "by the trainer with it")
            self.reported_schedule = state.lr_scheduler
        elif self.scheduler is not None:
            if state.lr_scheduler is None:
                raise LayoutMismatch(f"state has no lr_scheduler state, the training spec configures "
                                     f"{self.training.lr_schedule.name}")
            self.scheduler.load_state_dict(state.lr_scheduler)
        elif state.lr_scheduler is not None:
            raise LayoutMismatch("state carries lr_scheduler state, the training spec configures none")
        if self.scaler is not None:
            if state.loss_scale is not None:
                self.scaler.load_state_dict(state.loss_scale)
            elif state.iterations_done > 0:
                raise LayoutMismatch("fp16 state without loss-scale state after iteration 0")
        self.iterations_done, self.step = int(state.iterations_done), int(state.step)
        self.synced_at = self.step
        self.rng = {k: rng_tensor(v, f"rng.{k}") for k, v in (state.rng or {}).items()}
        self.data_position = state.data_position
        self._pending = None

    def resync(self, state) -> None:
        """Leave the stale state: load a complete state, then accept iterations after it."""
        self.load_state(state)
        self.stale = None

    def _indexed_optim(self, optim: dict, unstepped=()) -> dict:
        """Name-keyed optimizer state (get_state_dict's form) to torch's index-keyed form; the
        ``unstepped`` parameters get no state (a placeholder is not a stepped optimizer's state)."""
        try:
            groups, st = optim["param_groups"], optim.get("state", {})
        except (KeyError, TypeError):
            raise LayoutMismatch("optimizer state needs 'param_groups' and 'state'") from None
        st = {n: s for n, s in st.items() if n not in set(unstepped)}
        if len(groups) != len(self._group_names):
            raise LayoutMismatch(f"optimizer state has {len(groups)} param groups; the training spec "
                                 f"{len(self._group_names)}")
        index = {n: i for i, n in enumerate(self.names)}
        pos = {self.names[i]: k for k, i in enumerate(self._order)}
        out_groups = []
        own = self.optimizer.param_groups
        for k, (g, want) in enumerate(zip(groups, self._group_names)):
            gnames = list(g.get("params", []))
            if sorted(gnames) != sorted(want):
                bad = sorted(set(gnames) ^ set(want))[:5]
                raise LayoutMismatch(f"optimizer param group does not list the parameters of the training "
                                     f"spec's group (differs in {bad})")
            group = {k: v for k, v in g.items() if k != "params"}
            for flag in _OWN_FLAGS:  # the replica's implementation, whoever wrote the state
                if flag in own[k]:
                    group[flag] = own[k][flag]
            group["params"] = [pos[n] for n in want]  # torch pairs them with our group's order
            out_groups.append(group)
        unknown = [n for n in st if n not in index]
        if unknown:
            raise LayoutMismatch(f"optimizer state for unknown parameter(s) {unknown[:5]}")
        for n, s in st.items():
            for k, v in s.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != self.layout.params[index[n]].shape:
                    raise LayoutMismatch(f"optimizer state {n}.{k}: shape {tuple(v.shape)}, layout says "
                                         f"{self.layout.params[index[n]].shape}")
        return {"state": {pos[n]: dict(s) for n, s in st.items()}, "param_groups": out_groups}

    def state(self) -> ReplicaState:
        """The current state by reference (no copies)."""
        if self._pending is not None:
            raise RuntimeError(f"iteration {self._pending.iteration} is half applied (bucket by bucket); "
                               "the state is consistent only between iterations")
        sd = self.optimizer.state_dict()
        pos = {i: k for k, i in enumerate(self._order)}
        ostate, unstepped = {}, []
        for i, (n, p) in enumerate(zip(self.names, self.params)):
            s = sd["state"].get(pos[i])
            ostate[n] = dict(s) if s else fresh_state(self._specs[i], p)
            if not s:
                unstepped.append(n)
        groups = []
        for g in sd["param_groups"]:
            g = dict(g)
            g["params"] = [self.names[self._order[k]] for k in g["params"]]
            groups.append(g)
        return ReplicaState(
            params=dict(zip(self.names, self.params)),
            optim={"state": ostate, "param_groups": groups},
            iterations_done=self.iterations_done,
            step=self.step,
            lr_scheduler=self.scheduler.state_dict() if self.scheduler is not None else self.reported_schedule,
            loss_scale=self.scaler.state_dict() if self.scaler is not None else None,
            rng=dict(self.rng),
            data_position=self.data_position,
            layout=self.layout.to_dict(),
            training=self.training.to_dict(),
            unstepped=unstepped,
        )

    @property
    def committable(self) -> bool:
        """The state is one the trainer had: not stale, or stale only for missing data."""
        return self.stale is None or self.stale.state_good

    def state_dict_for_checkpoint(self) -> dict:
        """Nested DCP state dict {"model", "optim", "extra"} (see updater.dcp_keys); references."""
        return to_checkpoint(self.state())

    def state_sha256(self) -> tuple[str, str]:
        return fp.state_sha256(self.params, self.optimizer)

    def named_tensors(self, optimizer: bool = True) -> dict[str, torch.Tensor]:
        """Every state tensor by DCP flat key ("model.<name>" and, with ``optimizer``,
        "optim.state.<name>.<key>"), by reference."""
        out = {f"model.{n}": p for n, p in zip(self.names, self.params)}
        if optimizer:
            for n, p in zip(self.names, self.params):
                for k, v in sorted(self.optimizer.state.get(p, {}).items()):
                    if isinstance(v, torch.Tensor):
                        out[f"optim.state.{n}.{k}"] = v
        return out

    def fingerprints(self, optimizer: bool = False) -> dict[str, int]:
        """updater.fingerprint.fingerprint per tensor of ``named_tensors``."""
        return {k: fp.fingerprint(t) for k, t in self.named_tensors(optimizer).items()}

    def digest(self) -> numeric.Digest:
        """Exact and distance fingerprints of the whole state at this step (updater.numeric)."""
        return numeric.digest(self.named_tensors(), self.iterations_done)

    def check(self, want: numeric.Digest) -> numeric.Verdict:
        """The trainer's digest at this step against ours, under the replica's numeric policy."""
        return numeric.compare(want, self.digest(), self.policy, self.iterations_done, self.step - self.synced_at)

    # ---- applying iterations ---------------------------------------------------------------

    def _refuse_if_stale(self):
        if self.stale is not None:
            s = self.stale
            raise ReplicaStale(s.step, s.iteration, s.holes)

    def _go_stale(self, iteration: int, holes: dict):
        self.stale = ReplicaStale(self.step, iteration, holes)
        raise self.stale

    def _check_next(self, index: int):
        if index < self.iterations_done:
            raise ValueError(f"iteration {index} is already applied (replica is at {self.iterations_done} iterations)")
        if index > self.iterations_done:
            self._go_stale(self.iterations_done, {})  # iterations in between never arrived

    def _check_bucket(self, iteration: int, b: int, bucket: BucketSpec, flat) -> torch.Tensor:
        want_dtype = numpy_dtype(self.layout.grad_dtype)
        n = self.layout.bucket_count(bucket)
        if isinstance(flat, np.ndarray):
            ok_dtype = flat.dtype == want_dtype or (self.layout.grad_dtype == "bfloat16" and flat.dtype == np.int16)
            if not ok_dtype:
                raise LayoutMismatch(f"iteration {iteration} bucket {b}: dtype {flat.dtype}, layout says "
                                     f"{self.layout.grad_dtype} ({want_dtype})")
        t = wire_tensor(flat, self.layout.grad_dtype)
        if t.dtype != _TORCH_DTYPES[self.layout.grad_dtype]:
            raise LayoutMismatch(f"iteration {iteration} bucket {b}: dtype {t.dtype}, "
                                 f"layout says {self.layout.grad_dtype}")
        if t.dim() != 1 or t.numel() != n:
            raise LayoutMismatch(f"iteration {iteration} bucket {b}: {t.numel()} elements "
                                 f"(shape {tuple(t.shape)}), layout says {n}")
        return t

    def _check_buckets(self, it: ReducedIteration) -> list[torch.Tensor]:
        buckets = self.layout.bucket_list(it.layout_index)
        if len(it.buckets) != len(buckets):
            raise LayoutMismatch(f"iteration {it.index}: {len(it.buckets)} buckets, layout says {len(buckets)}")
        return [self._check_bucket(it.index, b, spec, flat) for b, (spec, flat) in enumerate(zip(buckets, it.buckets))]

    def _load_grads(self, bucket: BucketSpec, flat: torch.Tensor) -> list[int]:
        idx = []
        for i, a, z in self.layout.bucket_slices(bucket):
            self._grads[i].copy_(flat[a:z].view(self._grads[i].shape))  # bf16/fp16 -> fp32 is exact, as .float()
            idx.append(i)
        return idx

    def _optimizer_step(self, idx: list[int], meta: dict | None = None, norms: dict | None = None):
        """optimizer.step() over the parameters ``idx``; the others carry no gradient and are skipped.
        Clipping multiplies by the trainer's own coefficient when it sent one (its norm's reduction
        order is its device's); else the norm is computed here, or combined from ``norms`` (each
        parameter's gradient norm, computed as its bucket arrived: ``_total_norm``)."""
        for i in idx:
            self.params[i].grad = self._grads[i]
        try:
            if self.training.clip is not None:
                c = self.training.clip
                given = (meta or {}).get("clip")
                if given is not None:
                    coef = torch.tensor(float(given["coef"]), dtype=torch.float32)
                    for i in idx:
                        self._grads[i].mul_(coef)  # what clip_grads_with_norm_ does: one exact-rounded product
                elif norms is not None:
                    torch.nn.utils.clip_grads_with_norm_([self.params[i] for i in idx], c.max_norm,
                                                         _total_norm([norms[i] for i in idx], c.norm_type))
                else:
                    torch.nn.utils.clip_grad_norm_([self.params[i] for i in idx], c.max_norm, c.norm_type)
            with numeric.kernel_scalars(self.optimizer, self.training.optimizer):
                self.optimizer.step()
        finally:
            for i in idx:
                self.params[i].grad = None

    def _step_all(self, meta: dict | None = None, pending: _Pending | None = None) -> bool:
        """The trainer's step over all parameters once every gradient is loaded; False if skipped.
        The trainer's skip decision (its inf/nan check) is taken as given when it sent one.
        ``pending``: an iteration whose buckets were unscaled and measured as they arrived
        (``_prepare_bucket``)."""
        idx = self._used(meta)
        if self.scaler is None:
            found_inf = False
        elif pending is not None:
            found_inf = pending.found_inf
        else:
            found_inf = self.scaler.unscale_(self._grads)
        given = (meta or {}).get("skipped")
        if given is not None and bool(given) != found_inf:
            self.decisions_overridden += 1
            found_inf = bool(given)
        if not found_inf:
            self._optimizer_step(idx, meta, pending.norms if pending is not None and self.training.clip else None)
        if self.scaler is not None:
            self.scaler.update(found_inf)
        return not found_inf

    def _used(self, meta: dict | None) -> list[int]:
        """The parameters this step updates: all, or with DDP's find_unused_parameters those the
        trainer had a gradient for (no rank used the others: torch's optimizer skips grad=None).
        Without the trainer's report the step cannot be taken as it was: stale, nothing changed."""
        if not self.layout.used_map:
            return list(range(len(self.params)))
        unused = (meta or {}).get("unused")
        if not isinstance(unused, list) or not set(unused) <= set(self.names):
            log.warning("iteration %d: find_unused_parameters without the trainer's report of unused parameters",
                        self.iterations_done)
            self._go_stale(self.iterations_done, {})
        return [i for i, n in enumerate(self.names) if n not in set(unused)]

    def _finish(self, index: int, stepped: bool, meta: dict):
        if stepped:
            self.step += 1
        on_skip = self.scaler is None or self.scaler.spec.scheduler_step_on_skip
        if self.scheduler is not None and (stepped or on_skip):
            step_scheduler(self.scheduler, self.training.lr_schedule, meta)
        self.iterations_done = index + 1
        rng = (meta or {}).get("rng")
        if isinstance(rng, dict):
            for k, v in rng.items():
                try:
                    self.rng[str(k)] = rng_tensor(v, f"rng.{k}")
                except TypeError:
                    pass  # metadata we cannot store must not stop the replica; the state is still exact
        if (meta or {}).get("data_position") is not None:
            self.data_position = meta["data_position"]
        if self.training.lr_schedule.reported:
            self._take_reported(index, meta or {})

    def _take_reported(self, index: int, meta: dict) -> None:
        """A reported schedule: the param groups take the hyper-parameters the trainer's next step
        runs with, and the scheduler state is the trainer's; without them (or malformed) the
        replica cannot take its next step as the trainer does: stale, its state not committable."""
        hp, sched = meta.get("hparams"), meta.get("lr_scheduler")
        err = hparams_error(hp, self.optimizer.param_groups) if hp is not None else "no hparams"
        if err is None and not isinstance(sched, dict):
            err = "no scheduler state"
        if err is not None:
            self.stale = ReplicaStale(self.step, index + 1, {}, state_good=False)
            log.warning("iteration %d: the reported schedule's step metadata is unusable (%s)", index, err)
            raise self.stale
        set_hparams(self.optimizer, hp)
        self.reported_schedule = sched

    def apply(self, it: ReducedIteration) -> bool:
        """Apply one complete iteration; returns whether an optimizer step was taken (fp16 may skip).
        Raises ReplicaStale, without touching the state, if ``it`` is incomplete or one was missed."""
        self._refuse_if_stale()
        if self._pending is not None:
            if it.index == self._pending.iteration and not it.complete:
                self._abort_pending(it.holes)
            raise RuntimeError(f"iteration {self._pending.iteration} is being applied bucket by bucket; "
                               f"finish it with apply_bucket before apply({it.index})")
        self._check_next(it.index)
        if not it.complete:
            self._go_stale(it.index, it.holes)
        flats = self._check_buckets(it)
        for spec, flat in zip(self.layout.bucket_list(it.layout_index), flats):
            self._load_grads(spec, flat)
        stepped = self._step_all(it.meta)
        self._finish(it.index, stepped, it.meta)
        return stepped

    def apply_bucket(self, iteration: int, bucket_index: int, flat, meta: dict | None = None) -> bool:
        """Apply one complete bucket of ``iteration`` as soon as it is reduced. When the step is
        per-parameter separable the bucket's parameters are stepped now (bit-identical to apply()),
        after copying them and their state to undo buffers (as large as what they copy, allocated
        on first use) so that an iteration that turns out incomplete is rolled back. Otherwise the
        bucket waits in the fp32 gradient buffers and the step runs with the last bucket. Returns
        True when this bucket completed the iteration."""
        self._refuse_if_stale()
        p = self._pending
        if p is not None and p.iteration != iteration:
            self._abort_pending({})  # the earlier iteration can no longer complete
        if p is None:
            self._check_next(iteration)
            p = _Pending(iteration, self.layout.bucket_list(iteration))
        if not 0 <= bucket_index < len(p.buckets):
            raise LayoutMismatch(f"iteration {iteration}: bucket {bucket_index} out of range "
                                 f"(layout has {len(p.buckets)})")
        if bucket_index in p.done:
            raise ValueError(f"iteration {iteration} bucket {bucket_index} was already applied")
        t = self._check_bucket(iteration, bucket_index, p.buckets[bucket_index], flat)
        self._pending = p
        idx = self._load_grads(p.buckets[bucket_index], t)  # the fp32 grad buffers hold it from here
        if self.separable:
            p.journal += self._save_undo(idx)
            self._optimizer_step(idx)
        else:
            self._prepare_bucket(p, idx)
        p.done.add(bucket_index)
        p.meta.update(meta or {})
        if len(p.done) < len(p.buckets):
            return False
        stepped = True if self.separable else self._step_all(p.meta, p)
        self._pending = None
        self._finish(iteration, stepped, p.meta)
        return True

    @torch.no_grad()
    def _prepare_bucket(self, p: _Pending, idx: list[int]) -> None:
        """A bucket of a step that cannot run before the last one: what of the step is per
        parameter is done now, on this bucket's fp32 gradients, with the ops the whole step runs on
        them: fp16's unscale and inf check (elementwise, the loss scale only changes after the
        step) and each gradient's clip norm (torch's per-tensor norms; the last bucket only
        combines them). Nothing of the state changes, so an incomplete iteration needs no undo."""
        grads = [self._grads[i] for i in idx]
        if self.scaler is not None:
            p.found_inf |= self.scaler.unscale_(grads)
        if self.training.clip is not None:
            p.norms.update(zip(idx, _param_norms(grads, self.training.clip.norm_type)))

    def _save_undo(self, idx: list[int]) -> list[tuple[int, dict | None]]:
        """Copy parameters ``idx`` and their optimizer state into undo buffers that are allocated
        once and reused (a fresh copy per bucket would page-fault its way through memory)."""
        entries = []
        for i in idx:
            param = self.params[i]
            saved_param, saved = self._undo.setdefault(i, (torch.empty_like(param), {}))
            saved_param.copy_(param)
            st = self.optimizer.state.get(param)
            if not st:
                entries.append((i, None))
                continue
            kept = {}
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    u = saved.get(k)
                    if u is None or u.shape != v.shape or u.dtype != v.dtype:
                        u = saved[k] = torch.empty_like(v)
                    kept[k] = u.copy_(v)
                else:
                    kept[k] = v
            entries.append((i, kept))
        return entries

    @torch.no_grad()
    def _abort_pending(self, holes: dict):
        """Undo the buckets already stepped and turn stale at the pending iteration."""
        p, self._pending = self._pending, None
        for i, kept in reversed(p.journal):
            param = self.params[i]
            param.copy_(self._undo[i][0])
            if kept is None:
                self.optimizer.state.pop(param, None)
            else:  # clones: the undo buffers stay private to the journal
                self.optimizer.state[param] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                               for k, v in kept.items()}
        self._go_stale(p.iteration, holes)


# Global-norm clipping in two halves, the ops torch.nn.utils.clip_grad_norm_ (torch 2.13-2.14,
# ``_get_total_norm``) runs on CPU float32 gradients: one norm per tensor (``_foreach_norm``,
# each tensor's norm on its own), then the norm of those norms stacked in parameter order. So the
# per-tensor half can run bucket by bucket and the result is bit-identical (tests/test_replica.py).


def _param_norms(grads: list[torch.Tensor], norm_type: float) -> list[torch.Tensor]:
    return list(torch._foreach_norm(grads, float(norm_type)))


def _total_norm(norms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack(norms), float(norm_type))
