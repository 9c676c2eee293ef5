"""STEP_META: what the wire does not carry about each step (hyper-parameters it used, loss scale,
clip coefficient, a skip, RNG states, data position), recorded at the step's end and sent by the
sender thread. With ReduceLROnPlateau or a reported schedule (config.training.REPORTED) a step's
record is held until the loop has stepped the scheduler (the next step's start, or close) and goes
with the scheduler's state; a reported schedule's record also carries every group's
hyper-parameters as they are then: what the next step runs with."""

from __future__ import annotations

import torch
from mirrorckpt.control import gockpt
from mirrorckpt.control import messages as m
from mirrorckpt.control.link.describe import clip_coefficient, hyper_parameters, rng_states
from mirrorckpt.updater.dcp_keys import dumps


class StepMeta:
    def __init__(self, link, plateau: bool, reported: bool = False):
        self._link = link  # optimizer, scheduler, scaler, data, transport
        self.plateau, self.reported = plateau, reported
        self.holds = plateau or reported  # a record waits for the loop's scheduler step
        self.boundary: dict = {}  # the last step's record: rng, data position, hyper-parameters, clip...
        self._held: tuple | None = None
        self.clip: tuple | None = None  # (total_norm, coef, max_norm, norm_type) of this iteration

    def note_clip(self, total_norm, max_norm: float, norm_type: float = 2.0) -> None:
        total = torch.as_tensor(total_norm).detach()
        self.clip = (total, clip_coefficient(total, max_norm), float(max_norm), float(norm_type))

    def note_coefficient(self, coef: float, max_norm: float, norm_type: float) -> None:
        """A coefficient observed on the gradients (control.link.clip); the norm it implies is sent
        for the record only (0 when not clipped: the trainer's norm was not measured)."""
        total = max_norm / coef - 1e-6 if coef < 1 else 0.0
        self.clip = (torch.tensor(max(total, 0.0)), torch.tensor(coef, dtype=torch.float32), float(max_norm),
                     float(norm_type))

    def record(self, step: int, *, found_inf=None, skipped: bool = False) -> dict:
        """The record of ``step`` just taken (or skipped); held for sending."""
        link = self._link
        hp = hyper_parameters(link.optimizer)  # what the step used: the scheduler moves them only after
        clip, self.clip = self.clip, None
        self.boundary = {"rng": {k: v.clone() for k, v in rng_states().items()},
                         "data_position": link.data.state_dict() if link.data is not None else None,
                         "lr": hp[0]["lr"], "hparams": hp, "clip": None if skipped else clip,
                         # a fused step given GradScaler's found_inf skips inside the kernel
                         "found_inf": found_inf, "skipped": skipped, "unused": self._unused()}
        scale = float(link.scaler.get_scale()) if link.scaler is not None else None
        self.boundary["loss_scale"] = scale  # the scale this step's gradients carried
        self._held = (step, self.boundary, scale)
        return self.boundary

    def _unused(self) -> list[str] | None:
        """With DDP's find_unused_parameters: the parameters without a gradient at this step (no
        rank used them; the optimizer skips them), which the replica skips too."""
        link = self._link
        if link.layout is None or not link.layout.used_map:
            return None
        return [n for n, p in zip(link.names, link.masters) if p.grad is None]

    def release(self) -> None:
        """Send the held record (with the plateau scheduler's state, which the loop has stepped)."""
        held, self._held = self._held, None
        if held is None:
            return
        step, meta, scale = held
        sched = self._link.scheduler
        extra = {"lr_scheduler": dumps(sched.state_dict(), "lr_scheduler")} if self.holds else {}
        if self.reported:
            extra["hparams"] = hyper_parameters(self._link.optimizer)

        def build(_t):  # the sender thread: reading the clip and found_inf tensors waits there
            out = dict(extra)
            if meta.get("clip") is not None:
                total, coef = meta["clip"][:2]
                out["clip"] = {"total_norm": float(total.item()), "coef": float(coef.item())}
            if meta.get("unused") is not None:
                out["unused"] = meta["unused"]
            if meta.get("skipped"):
                out["skipped"] = True
            elif meta.get("found_inf") is not None:
                out["skipped"] = bool(meta["found_inf"].item())
            return m.make(m.STEP_META, {gockpt.rng_key(k): v for k, v in meta["rng"].items()},
                          step=step, lr=meta["lr"], loss_scale=scale, data_position=meta["data_position"], **out)
        self._link.transport.emit(build)


class ScalerWatch:
    """GradScaler skips ``optimizer.step()`` on inf/nan, so the step hooks never see that iteration;
    its ``update`` (called every iteration) does: ``on_skip()`` is called from there."""

    def __init__(self, scaler, optimizer, on_skip):
        self.scaler, self.stepped = scaler, False
        self._orig = scaler.update

        def update(new_scale=None):
            st = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
            found = st.get("found_inf_per_device") or {}
            skipped = not self.stepped and bool(sum(float(v.item()) for v in found.values()))  # synced by step
            self._orig(new_scale)
            self.stepped = False
            if skipped:
                on_skip()
        scaler.update = update

    def remove(self) -> None:
        self.scaler.update = self._orig
