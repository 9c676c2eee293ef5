"""One appliance process of a sharded (TP x PP x DP) job: a control plane per DP group it follows,
and the job's joint checkpoints with the other appliance processes.

Each followed DP group gets its own ``AppliancePlane`` on its own port (one control link per DP
group: the group's DP-rank-0 trainer process registers there), holding that group's replica shard
and running that group's GoCkpt fallbacks and restores as for an unsharded job. The trainer's
sharded REGISTER brings the job's ``ShardedLayout``; it is taken only when it says this appliance
(``name``) follows that group, every group the layout gives this appliance has a plane here, and
all planes of the process got the same layout. A plane's replica, after every applied iteration
and every installed fallback, is offered to the ``updater.joint.JointPersister`` (``open_joint``,
once the layout is known; the process must have joined the appliances' group,
``updater.joint.init_group``); ``save_round`` is the collective joint round.

A job registered ``weights_only`` (pure FSDP: no ring carries a finished gradient) is followed by
fallbacks alone: ``full_checkpoints_due`` says when the trainer is ``every`` steps past the newest
full state (the caller asks ``request_fallbacks`` then: one joint full checkpoint per ``every``
steps), and ``check_weights`` proves a weight snapshot of its all-gathers (``updater.weights``)
equal to the trainer's parameters by the fingerprints the trainer sends every
``fingerprint_every`` steps.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from mirrorckpt.config.shards import ShardedLayout
from mirrorckpt.control.appliance_side import AppliancePlane, Refused

log = logging.getLogger("mirrorckpt.control.sharded")


class ShardedAppliance:
    def __init__(self, secret, name: str, groups: dict[str, int] | list[str], *, host: str = "127.0.0.1",
                 **plane_options):
        """``groups``: the DP groups this appliance follows, each with its control port (0: any)."""
        ports = dict(groups) if isinstance(groups, dict) else {g: 0 for g in groups}
        if not ports:
            raise ValueError("a sharded appliance follows at least one DP group")
        self.name = name
        self.shards: ShardedLayout | None = None
        self.joint = None
        self._lock = threading.Lock()
        self.planes: dict[str, AppliancePlane] = {}
        for g, port in ports.items():
            self.planes[g] = AppliancePlane(secret, host=host, port=port, group=g, on_shards=self._on_shards,
                                            on_iteration=lambda _i, replica, g=g: self._offer(g, replica),
                                            **plane_options)

    def start(self) -> ShardedAppliance:
        for p in self.planes.values():
            p.start()
        return self

    def ports(self) -> dict[str, int]:
        return {g: p.port for g, p in self.planes.items()}

    def stop(self) -> None:
        for p in self.planes.values():
            p.stop()
        if self.joint is not None:
            self.joint.close()

    # ---- registration ------------------------------------------------------------------------

    def _on_shards(self, layout: ShardedLayout, group: str) -> None:
        with self._lock:
            if self.shards is not None and layout.digest() != self.shards.digest():
                raise Refused(f"group {group}: its sharded layout differs from the one this appliance's other "
                              "DP groups registered (one job per appliance)")
            follower = layout.group(group).appliance
            if follower != self.name:
                raise Refused(f"the trainer's layout has DP group {group} followed by appliance {follower!r}; this "
                              f"is {self.name!r}")
            mine = [g.name for g in layout.groups_of(self.name)]
            missing = sorted(set(mine) - set(self.planes))
            if missing:
                raise Refused(f"the trainer's layout gives appliance {self.name!r} DP groups {mine}; it has no "
                              f"control plane for {missing}")
            self.shards = layout

    def wait_registered(self, timeout: float) -> bool:
        """True once every followed group's trainer registered."""
        end = time.monotonic() + timeout
        for p in self.planes.values():
            if not p.registered.wait(max(0.0, end - time.monotonic())):
                return False
        return True

    # ---- state -------------------------------------------------------------------------------

    def request_fallbacks(self, reason: str) -> int:
        """Ask every followed group for a GoCkpt checkpoint; the number of requests sent."""
        return sum(p.request_fallback(reason) for p in self.planes.values())

    def steps(self) -> dict[str, int | None]:
        """Iterations applied per group's replica (None: no replica, or a stale one)."""
        out = {}
        for g, p in self.planes.items():
            with p.lock:  # a registration in progress holds it
                r = p.replica
                out[g] = r.iterations_done if r is not None and r.stale is None else None
        return out

    def full_checkpoints_due(self, every: int) -> bool:
        """A weights_only job's cadence: every group's trainer is ``every`` steps or more past its
        newest full state (none yet counts as step 0), and no fallback is under way."""
        for p in self.planes.values():
            f = p.facts()
            if not f.registered or f.trainer_step is None or f.fallback is not None:
                return False
            if f.trainer_step - (f.replica_step or 0) < every:
                return False
        return True

    def check_weights(self, step: int, params: dict) -> dict[str, str | None]:
        """A weight snapshot of ``step`` (every parameter whole, by FQN) against the trainer's
        parameter fingerprints of that step, per followed group: None where every slice is
        bit-equal, else what differs or why it cannot be told."""
        from mirrorckpt.updater.fingerprint import fingerprint
        from mirrorckpt.updater.shard_sink import group_slice

        if self.shards is None:
            raise ValueError("no sharded layout registered yet")
        out: dict[str, str | None] = {}
        for name, p in self.planes.items():
            words = p.trainer_parameters(step)
            if words is None:
                out[name] = f"no parameter fingerprints of step {step} from group {name}'s trainer"
                continue
            bad = [s.fqn for s in self.shards.group(name).shards
                   if words.get(f"model.{s.fqn}") != fingerprint(group_slice(s, params[s.fqn]))]
            out[name] = f"differs from the trainer's parameters in {', '.join(bad[:3])}" if bad else None
        return out

    def _offer(self, group: str, replica) -> None:
        if self.joint is not None:
            self.joint.offer(group, replica)

    def open_joint(self, root, **kw):
        """The JointPersister of this appliance (once the sharded layout is registered); the replicas
        already held are offered at once. ``kw``: every, hold, keep_last, job."""
        from mirrorckpt.updater.joint import JointPersister

        if self.shards is None:
            raise ValueError("no sharded layout registered yet: open_joint after wait_registered")
        self.joint = JointPersister(self.shards, [self.name], Path(root), **kw)
        for g, p in self.planes.items():
            with p.lock:
                if p.replica is not None and p.replica.stale is None:
                    self.joint.offer(g, p.replica)
        return self.joint

    def save_round(self):
        """One collective joint round (updater.joint.JointPersister.save_round)."""
        if self.joint is None:
            raise ValueError("open_joint first")
        return self.joint.save_round()
