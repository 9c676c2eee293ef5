"""RESTORE_REQUEST on the appliance: the newest consistent state, from memory or from disk, and
never a silent rollback.

A state is served from memory (the consistent replica) when there is one, else the latest
committed checkpoint is read from disk. The trainer's last reported step is known from its step
metadata: a state further behind it than the protection limit (``max_lag_steps``) is refused with
both steps named, unless the trainer asks for it (``allow_behind``, or a ``step`` of its own).
The reply says how far behind the trainer it is. The state served from memory is held until the
next REGISTER (at most ``hold_seconds``): a job resuming from it goes on from it although the
replica applied the killed run's last iterations meanwhile, and every rank restores the same step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch
from mirrorckpt.control import gockpt
from mirrorckpt.control import messages as m
from mirrorckpt.control.endpoint import Refused
from mirrorckpt.updater.dcp_keys import ReplicaState, dumps

log = logging.getLogger("mirrorckpt.control.appliance")


class RestoreServer:
    def __init__(self, persist, max_lag_steps: int | None = None, hold_seconds: float = 300.0):
        self.persist = persist
        self.max_lag_steps = max_lag_steps  # None: any state may be served
        self.hold_seconds = hold_seconds
        self.served = {"memory": 0, "disk": 0}
        self._held: tuple[float, ReplicaState] | None = None

    def held(self) -> ReplicaState | None:
        """The state last served from memory, while it is held."""
        if self._held is not None and time.monotonic() - self._held[0] > self.hold_seconds:
            self._held = None
        return self._held[1] if self._held is not None else None

    def forget(self) -> None:
        self._held = None

    def copy_budget(self) -> int:
        """Bytes a restore may copy the state into: the persist memory budget (unbounded without)."""
        return self.persist.memory_budget_bytes if self.persist is not None else 1 << 62

    def check_behind(self, step: int, source: str, trainer_step: int | None, body: dict) -> int | None:
        """How far ``step`` is behind the trainer; Refused past the limit unless the trainer asked
        for an older state (a step of its own, or ``allow_behind``)."""
        if trainer_step is None:
            return None
        behind = max(0, trainer_step - step)
        asked = body.get("step") is not None or body.get("allow_behind")
        if self.max_lag_steps is not None and behind > self.max_lag_steps and not asked:
            raise Refused(f"the newest consistent state ({source}) is step {step}, {behind} steps behind the "
                          f"trainer's last reported step {trainer_step} (protection limit {self.max_lag_steps}): "
                          "restoring it would roll the job back; restore with allow_behind=True to take it "
                          "anyway, or from a checkpoint on disk")
        return behind

    def reply(self, state, source: str, trainer_step: int | None, behind: int | None) -> m.Message:
        self.served[source] += 1
        said = "" if behind is None else f", {behind} step(s) behind the trainer's last reported step {trainer_step}"
        if trainer_step is None:
            said = " (the trainer's step is not known to this appliance)"
        log.info("restore: state of step %d sent from %s%s", state.iterations_done, source, said)
        return restore_message(state, source, trainer_step, behind)

    def from_memory(self, state, trainer_step: int | None, body: dict, peer, rid) -> m.Message | None:
        """Serves ``state`` (the replica's, the plane's lock held); a state too large for a copy
        is sent from the replica itself while the plane waits (returns None), else a copy is held."""
        behind = self.check_behind(state.iterations_done, "memory", trainer_step, body)
        if _state_bytes(state) > self.copy_budget():
            msg = self.reply(state, "memory", trainer_step, behind)
            msg.re = rid
            peer.send(msg)
            return None
        state = cloned(state)
        self._held = (time.monotonic(), state)
        return self.reply(state, "memory", trainer_step, behind)

    def from_disk(self, trainer_step: int | None, body: dict) -> m.Message:
        from mirrorckpt.updater.restore import read_state

        if self.persist is None:
            raise Refused("no consistent state in memory (replica stale or never started) and no checkpoint root")
        try:
            state = read_state(self.persist.directory)
        except Exception as e:  # noqa: BLE001 - no committed checkpoint, or one that fails verification
            raise Refused(f"no consistent state in memory and none on disk: {type(e).__name__}: {e}") from None
        want = body.get("step")
        if want is not None and state.iterations_done != want:
            raise Refused(f"step {want} is neither in memory nor the latest on disk ({state.iterations_done})")
        behind = self.check_behind(state.iterations_done, "disk", trainer_step, body)
        return self.reply(state, "disk", trainer_step, behind)


def _state_bytes(st) -> int:
    n = sum(v.numel() * v.element_size() for v in st.params.values())
    for s in st.optim["state"].values():
        n += sum(v.numel() * v.element_size() for v in s.values() if isinstance(v, torch.Tensor))
    return n


def cloned(st):
    return replace(st, params={k: v.clone() for k, v in st.params.items()},
                   optim={"state": {n: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
                                    for n, s in st.optim["state"].items()},
                          "param_groups": [dict(g) for g in st.optim["param_groups"]]},
                   rng={k: v.clone() for k, v in st.rng.items()})


def restore_message(state, source: str, trainer_step: int | None = None, behind: int | None = None) -> m.Message:
    """RESTORE_STATE for a ReplicaState: p:/o:/rng: tensors, the rest in ``meta``."""
    tensors = {gockpt.param_key(n): v for n, v in state.params.items()}
    unstepped = set(getattr(state, "unstepped", ()))
    for n, s in state.optim["state"].items():
        if n in unstepped:  # a placeholder: the trainer's optimizer keeps no state for it either
            continue
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                tensors[gockpt.state_key(n, k)] = v
    tensors.update({gockpt.rng_key(k): v for k, v in (state.rng or {}).items()})
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state.optim["param_groups"]]
    meta = {"iterations_done": int(state.iterations_done), "step": int(state.step), "source": source,
            "param_groups": dumps(groups, "param_groups"),
            "lr_scheduler": dumps(state.lr_scheduler, "lr_scheduler") if state.lr_scheduler is not None else None,
            "loss_scale": state.loss_scale, "data_position": state.data_position,
            "trainer_step": trainer_step, "behind": behind}
    return m.make(m.RESTORE_STATE, tensors, step=int(state.iterations_done), layout=state.layout or {}, meta=meta)
