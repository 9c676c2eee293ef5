"""The trainer's half of a GoCkpt fallback checkpoint (schedule in ``control.gockpt``): on the
appliance's FALLBACK_REQUEST, from the next step boundary N, part j of the state S_{N+j} is
copied during step N+j together with the gradients of the parts already copied; the last part
goes with the tail (counters, groups, scheduler, loss scale, RNG, data position) and GOCKPT_DONE
carries the fingerprints of S_{N+k}."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch
from mirrorckpt.config.layout import JobLayout
from mirrorckpt.control import gockpt
from mirrorckpt.control import messages as m
from mirrorckpt.control.link.describe import group_dicts, local
from mirrorckpt.control.link.transport import Both
from mirrorckpt.updater.dcp_keys import dumps
from mirrorckpt.updater.optim import state_keys

log = logging.getLogger("mirrorckpt.control.trainer")


@dataclass
class FallbackRun:
    """One GoCkpt checkpoint in progress on the trainer."""

    start: int  # boundary N
    plan: list[list[int]]
    reason: str
    state_copy: gockpt.Copy | None = None  # part j of S_{N+j}, in flight
    grad_copy: gockpt.Copy | None = None
    held: tuple | None = None  # the last part, sent with the tail
    fingerprint: gockpt.Copy | None = None
    stall: float = 0.0  # seconds the training thread spent on this checkpoint
    blocked_parts: int = 0  # parts whose copy was not done when the step needed the state
    state_bytes: int = 0
    grad_bytes: int = 0
    t0: float = field(default_factory=time.perf_counter)

    @property
    def parts(self) -> int:
        return len(self.plan)


class Fallbacks:
    """Requests from the appliance (any thread) and the run in progress (training thread)."""

    def __init__(self, link):
        self._link = link  # names, masters, model_params, optimizer, training, layout, copier, transport...
        self._lock = threading.Lock()
        self._request: dict | None = None
        self.run: FallbackRun | None = None
        # True: a request waits (pending) until this is False again at a step boundary; a sharded
        # job's groups start their fallbacks at one step this way (control.sharded)
        self.defer = False

    # ---------------------------------------------------------------- requests (client thread)
    def requested(self, msg: m.Message) -> None:
        parts = max(1, min(gockpt.MAX_PARTS, msg.body["parts"]))
        with self._lock:
            self._request = {"parts": parts, "reason": msg.body["reason"], "at": msg.body["step"]}
        layout = self._link.layout
        if layout is not None:  # pinned buffers for the whole plan, here and not in the training thread
            self._link.copier.reserve(self.plan_bytes(layout, parts))
        log.info("fallback requested by the appliance (%s) at its step %d, %d parts",
                 msg.body["reason"], msg.body["step"], parts)

    @property
    def pending(self) -> bool:
        with self._lock:
            return self._request is not None

    def plan_bytes(self, layout: JobLayout, parts: int) -> list[int]:
        """Sizes of the host copies one fallback makes: part j's state once, its gradients in
        each of the steps N+j..N+k-1."""
        training = self._link.training
        keys = state_keys(training.optimizer)
        plan = gockpt.split(layout, parts)
        gsize = gockpt.GRAD_DTYPES[training.grad_dtype].itemsize
        out = []
        for j, part in enumerate(plan):
            for i in part:
                nb = 4 * layout.params[i].numel
                gb = gsize * layout.params[i].numel
                out += [nb] + [gb] * (len(plan) - j) + [4 if k == "step" else nb for k in keys]
        return out

    # ---------------------------------------------------------------- step hooks (training thread)
    def before_step(self, t0: float) -> None:
        if self.run is not None:
            self._pre(self.run, t0)

    def after_step(self, step: int) -> None:
        """Step ``step`` was taken: go on with the run, then start a request not deferred."""
        run = self.run
        if run is not None:
            self._post(run, step)
        with self._lock:
            req, self._request = (None, self._request) if self.defer else (self._request, None)
        if req is not None and self._link.layout is not None:
            if run is not None:
                log.warning("fallback %d..: abandoned for a new request", run.start)
            self._start(req, step)
        elif req is not None:
            with self._lock:
                self._request = req  # not registered yet: start after the first step

    def abandon(self, why: str) -> None:
        if self.run is not None:
            log.warning("GoCkpt checkpoint from step %d abandoned: %s", self.run.start, why)
            self.run = None

    def close(self) -> None:
        run = self.run
        if run is None:
            return
        if run.held is not None:  # only the tail is missing: the state at close is S_{N+k}
            self._link.copier.fence(run.fingerprint)
            self._finish(run)
        else:
            self.abandon("the link closed")

    # ---------------------------------------------------------------- the run
    def _part_state(self, j: int, plan) -> dict[str, torch.Tensor]:
        link, out = self._link, {}
        for i in plan[j]:
            n, p = link.names[i], link.masters[i]
            out[gockpt.param_key(n)] = local(p)
            for k, v in link.optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    out[gockpt.state_key(n, k)] = local(v)
        return out

    def _start(self, req: dict, step: int) -> None:
        plan = gockpt.split(self._link.layout, req["parts"])
        self.run = run = FallbackRun(start=step, plan=plan, reason=req["reason"])
        t0 = time.perf_counter()
        run.state_copy = self._link.copier.copy(self._part_state(0, plan))
        run.stall += time.perf_counter() - t0
        log.info("GoCkpt checkpoint from step %d in %d parts (%s)", step, run.parts, req["reason"])

    def _pre(self, run: FallbackRun, t0: float) -> None:
        link = self._link
        j = link.iterations_done - run.start
        if j < run.parts:
            if not run.state_copy.done():
                run.blocked_parts += 1  # GoCkpt's rule: a part not done in its step is finished blocking
            link.copier.fence(run.state_copy)
            # bf16/fp16: the reduced gradients (the model's, in the wire dtype) travel, half the
            # bytes; the rebuild forms the master gradients from them as the replica does
            src = link.masters if link.training.grad_dtype == "float32" else link.model_params
            grads = {}
            for jj in range(j + 1):
                for i in run.plan[jj]:
                    g = src[i].grad
                    g = local(g) if g is not None else torch.zeros_like(local(src[i]))
                    grads[gockpt.grad_key(link.names[i])] = g
            run.grad_copy = link.copier.copy(grads)
        else:  # step N+k: the state is S_{N+k}; send the last part with the tail, then DONE
            link.copier.fence(run.fingerprint)
            self._finish(run)
        run.stall += time.perf_counter() - t0

    def _post(self, run: FallbackRun, step: int) -> None:
        link = self._link
        t0 = time.perf_counter()
        j = step - 1 - run.start  # the step just taken was N+j
        link.copier.fence(run.grad_copy)
        b = link.meta.boundary
        hp = {"hparams": b["hparams"]}
        if link.training.grad_dtype != "float32":  # what turns the reduced gradients into the masters'
            hp["loss_scale"] = b.get("loss_scale") if link.training.loss_scale is not None else None
            hp["clip"] = b["clip"][1] if b.get("clip") is not None else None
        state, grads = run.state_copy, run.grad_copy
        if j < run.parts - 1:
            link.transport.emit(self._part_builder(run, j, state, grads, hp, None), Both(state, grads))
            run.state_copy = link.copier.copy(self._part_state(j + 1, run.plan))
        else:
            run.held = (j, state, grads, hp)
            run.fingerprint = link.copier.digest(link.named_state(), step)
        run.stall += time.perf_counter() - t0

    def _part_builder(self, run: FallbackRun, j: int, state, grads, hp: dict, tail: dict | None):
        names = [self._link.names[i] for i in run.plan[j]]
        start, parts = run.start, run.parts

        def build(both):
            st, gr = both
            tensors = {**st, **gr}
            slices = {"params": names, "hparams": hp["hparams"]}
            if "loss_scale" in hp:  # bf16/fp16 jobs; the clip coefficient is read here, off the training thread
                if hp["loss_scale"] is not None:
                    slices["loss_scale"] = hp["loss_scale"]
                if hp["clip"] is not None:
                    slices["clip"] = float(hp["clip"].item())
            if tail is not None:
                slices["tail"] = tail["body"]
                tensors.update({gockpt.rng_key(k): v for k, v in tail["rng"].items()})
            run.state_bytes += sum(v.numel() * v.element_size() for v in st.values())
            run.grad_bytes += sum(v.numel() * v.element_size() for v in gr.values())
            return m.make(m.GOCKPT_PART, tensors, step=start + j, index=j, parts=parts, slices=slices)
        return build

    def _tail(self) -> dict:
        link = self._link
        boundary = link.meta.boundary
        body = {"iterations_done": link.iterations_done, "step": link.iterations_done,
                "param_groups": dumps(group_dicts(link.optimizer), "param_groups"),
                "lr_scheduler": (dumps(link.scheduler.state_dict(), "lr_scheduler")
                                 if link.scheduler is not None else None),
                "loss_scale": ({"scale": float(link.scaler.get_scale()),
                                "growth_tracker": int(link.scaler._get_growth_tracker())}
                               if link.scaler is not None else None),
                "data_position": boundary.get("data_position")}
        return {"body": body, "rng": boundary.get("rng", {})}

    def _finish(self, run: FallbackRun) -> None:
        link = self._link
        j, state, grads, hp = run.held
        link.transport.emit(self._part_builder(run, j, state, grads, hp, self._tail()), Both(state, grads))
        fps = run.fingerprint
        final = run.start + run.parts
        link.transport.emit(lambda d: m.make(m.GOCKPT_DONE, gockpt.digest_tensors(d), step=final, parts=run.parts,
                                             fingerprints=d.words), fps)
        self.run = None
        rec = {"start": run.start, "parts": run.parts, "stall_s": run.stall, "blocked_parts": run.blocked_parts,
               "seconds": time.perf_counter() - run.t0}
        link.stats.fallbacks.append(rec)
        log.info("GoCkpt checkpoint steps %d..%d done: %d parts, training stalled %.2f ms (%d parts blocking)",
                 run.start, final, run.parts, run.stall * 1e3, run.blocked_parts)
