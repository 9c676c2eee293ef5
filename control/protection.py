"""Whether the training job is protected: one measured verdict, always with its reason.

The appliance knows the trainer's newest step (its step metadata), the replica's, and the newest
committed and verified checkpoints. The *protected step* is the newest state it can restore (the
consistent replica in memory, or the newest committed checkpoint); the verdict compares it with
the trainer:

* ``protected``: a restorable state within ``max_lag_steps`` of the trainer, nothing failing;
* ``lagging``: a restorable state, but something may still resolve by itself (the replica follows
  the mirror and is behind the limit, or checkpoints fail to commit so the state is in memory only);
* ``not protected``: no restorable state within the limit and nothing bringing one by itself (a
  silent or failed mirror port, an incomplete iteration, a fallback given up, no trainer
  registered), said with what is under way (a fallback checkpoint).

Without a control plane the trainer's step is unknown: the verdict then says whether the replica
follows the wire. ``Guard`` keeps a job protected through a mirror fault (degraded mode): while
the verdict is ``not protected`` because the replica stopped following, it asks the trainer for a
fallback checkpoint, at most once per ``fallback_interval`` seconds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

log = logging.getLogger("mirrorckpt.protection")

PROTECTED, LAGGING, NOT_PROTECTED = "protected", "lagging", "not protected"
VERDICTS = (PROTECTED, LAGGING, NOT_PROTECTED)


@dataclass
class Limits:
    max_lag_steps: int = 10  # the trainer may be this many steps ahead of the protected step
    silent_seconds: float = 30.0  # a mirror port without RoCE this long is a fault
    fallback_interval: float = 60.0  # seconds between fallbacks asked because the replica stopped following
    # control-only mode (no mirror): a fallback whenever the protected step is this far behind
    fallback_every: int | None = None


@dataclass
class Facts:
    """What the appliance knows at one moment (``AppliancePlane.facts``, the persister, the ports)."""

    control: bool = False  # a trainer link is configured (else the trainer's step is unknown)
    registered: bool = False
    trainer_step: int | None = None
    trainer_seconds: float | None = None  # since the trainer last reported
    replica_step: int | None = None  # a consistent replica's steps (None: none, or not consistent)
    replica_stale: str | None = None  # why the replica is not consistent
    replica_seconds: float | None = None  # since the replica last advanced (None: never)
    committed_step: int | None = None
    committed_unix: float | None = None
    verified_step: int | None = None
    fallback: str | None = None  # a fallback under way: its reason
    fallback_error: str | None = None  # given up: why
    persist_error: str | None = None  # the newest commit failed: why
    wire: list[str] = field(default_factory=list)  # faults of the mirror, in words


@dataclass
class Verdict:
    state: str
    reason: str
    trainer_step: int | None = None
    protected_step: int | None = None
    lag: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _newest(*steps) -> int | None:
    known = [s for s in steps if s is not None]
    return max(known) if known else None


def _cause(f: Facts) -> str:
    """Why the replica does not follow, in words."""
    causes = list(f.wire)
    if f.replica_stale:
        causes.append(f.replica_stale)
    if not causes:
        causes.append("the replica is not advancing")
    return "; ".join(causes)


def judge(f: Facts, lim: Limits) -> Verdict:
    protected = _newest(f.replica_step, f.committed_step)
    under_way = f"; a fallback checkpoint is under way ({f.fallback})" if f.fallback else ""
    if not f.control:
        return _judge_wire(f, protected)
    if not f.registered:
        return Verdict(NOT_PROTECTED, "no trainer has registered the job" + _also(f.wire), None, protected)
    if f.fallback_error:
        return Verdict(NOT_PROTECTED, f"fallback given up: {f.fallback_error}", f.trainer_step, protected,
                       _lag(f.trainer_step, protected))
    if protected is None:
        return Verdict(NOT_PROTECTED, f"no consistent state: {_cause(f)}{under_way}", f.trainer_step)
    lag = _lag(f.trainer_step, protected) or 0
    where = f"state of step {protected}, {lag} step(s) behind the trainer's step {f.trainer_step}"
    if lag <= lim.max_lag_steps:
        if f.persist_error:
            return Verdict(LAGGING, f"{where}, in memory only: checkpoints fail to commit: {f.persist_error}",
                           f.trainer_step, protected, lag)
        how = f" (by fallbacks; mirror: {'; '.join(f.wire)})" if f.wire else ""
        return Verdict(PROTECTED, where + how, f.trainer_step, protected, lag)
    following = not f.wire and not f.replica_stale and f.replica_seconds is not None and \
        f.replica_seconds < lim.silent_seconds
    if following:
        return Verdict(LAGGING, f"{where} (limit {lim.max_lag_steps}): the replica follows the mirror",
                       f.trainer_step, protected, lag)
    return Verdict(NOT_PROTECTED, f"{where} (limit {lim.max_lag_steps}): {_cause(f)}{under_way}",
                   f.trainer_step, protected, lag)


def _lag(trainer: int | None, protected: int | None) -> int | None:
    if trainer is None or protected is None:
        return None
    return max(0, trainer - protected)


def _also(wire: list[str]) -> str:
    return f"; mirror: {'; '.join(wire)}" if wire else ""


def _judge_wire(f: Facts, protected: int | None) -> Verdict:
    """No control plane: whether the replica follows the wire (the trainer's step is unknown)."""
    if f.replica_step is None:
        why = f.replica_stale or "no replica yet (no initial weights or state)"
        return Verdict(NOT_PROTECTED, f"{why}{_also(f.wire)}; no control plane to ask a fallback", None, protected)
    if f.wire:
        return Verdict(NOT_PROTECTED, f"replica at step {f.replica_step} cannot follow: {'; '.join(f.wire)}", None,
                       protected)
    if f.persist_error:
        return Verdict(LAGGING, f"replica at step {f.replica_step}, in memory only: checkpoints fail to commit: "
                       f"{f.persist_error}", None, protected)
    return Verdict(PROTECTED, f"replica at step {f.replica_step} follows the mirror (the trainer's step is "
                   "unknown without [control])", None, protected)


class Guard:
    """Judges the facts, says each change of verdict in the log, and in degraded mode asks the
    trainer for fallbacks (``request(reason)``, the plane's; None without a control plane)."""

    def __init__(self, limits: Limits, request=None):
        self.limits, self.request = limits, request
        self.verdict = Verdict(NOT_PROTECTED, "starting")
        self.since = time.monotonic()  # of the current verdict
        self.degraded_fallbacks = 0
        self._last_degraded: float | None = None

    def check(self, f: Facts) -> Verdict:
        v = judge(f, self.limits)
        if v.state != self.verdict.state:
            self.since = time.monotonic()
            level = logging.INFO if v.state == PROTECTED else logging.WARNING
            log.log(level, "job %s: %s", v.state.upper(), v.reason, extra={"verdict": v.to_dict()})
        self.verdict = v
        self._degraded(f, v)
        return v

    def _degraded(self, f: Facts, v: Verdict) -> None:
        if self.request is None or not f.registered or f.fallback or f.fallback_error or v.lag is None:
            return
        every = self.limits.fallback_every
        if every is not None:  # control-only: a checkpoint every `every` steps
            due = v.lag >= every
        else:  # the replica stopped following: not protected, and no fallback of its own under way
            due = v.state == NOT_PROTECTED and not f.replica_stale
        now = time.monotonic()
        interval = 0.0 if every is not None else self.limits.fallback_interval
        if not due or (self._last_degraded is not None and now - self._last_degraded < interval):
            return
        reason = (f"control-only: the newest state is {v.lag} steps behind the trainer" if every is not None
                  else f"degraded mode: {v.reason}")
        if self.request(reason):
            self._last_degraded = now
            self.degraded_fallbacks += 1
