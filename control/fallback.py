"""Fallback checkpoints on the appliance: asking the trainer for one, re-asking, giving up, and the
GoCkpt rebuild (GOCKPT_PART / GOCKPT_DONE) verified against the trainer's fingerprints.

Each trigger asks for exactly one fallback; one not finished within ``timeout`` or whose rebuild
does not verify is asked again, at most ``max_attempts`` times in all. Then the plane gives up:
``stats.fallback_error`` says why (logged once, counted in ``fallbacks_abandoned``), and nothing
is asked again until the trainer registers anew (a new trainer session may answer)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from mirrorckpt.control import gockpt
from mirrorckpt.control import messages as m
from mirrorckpt.control.endpoint import Refused
from mirrorckpt.updater.replica import Replica

log = logging.getLogger("mirrorckpt.control.appliance")


@dataclass
class Fallback:
    reason: str
    requested: float
    attempt: int = 1
    rebuild: gockpt.Rebuild | None = None


class FallbackController:
    """``push(msg)`` sends a FALLBACK_REQUEST to the trainer's connections (returns how many);
    ``step()`` is the replica's step now (0 without one); ``event(kind, detail)`` records what happened."""

    def __init__(self, stats, push, step, event, parts: int = 7, timeout: float = 60.0, max_attempts: int = 3):
        self.stats, self._push, self._step, self._event = stats, push, step, event
        self.parts, self.timeout, self.max_attempts = parts, timeout, max_attempts
        self.current: Fallback | None = None
        self.last_requested: float | None = None  # monotonic time of the newest request (any attempt)

    def request(self, reason: str, renew: bool = False) -> bool:
        """Ask the trainer for a GoCkpt checkpoint; False if one is already under way, or if the
        plane gave up and ``renew`` (a new registration) does not lift that."""
        if self.current is not None:
            return False
        if self.stats.fallback_error is not None:
            if not renew:
                return False
            log.warning("retrying after the abandoned fallback (%s): the trainer registered again",
                        self.stats.fallback_error)
            self.stats.fallback_error = None
        self.current = Fallback(reason, time.monotonic())
        self.stats.fallbacks_requested += 1
        self._event("fallback_requested", reason)
        self.push()
        return True

    def push(self) -> None:
        f = self.current
        self.last_requested = time.monotonic()
        msg = m.make(m.FALLBACK_REQUEST, reason=f.reason[:m.MAX_STR], step=self._step(), parts=self.parts)
        sent = self._push(msg)
        log.warning("fallback requested (%s), attempt %d, %s", f.reason, f.attempt,
                    f"sent to {sent} trainer connection(s)" if sent else "no trainer connected yet")

    def poll(self) -> None:
        """Re-ask a fallback that did not finish in time."""
        f = self.current
        if f is None or time.monotonic() - f.requested < self.timeout:
            return
        self.stats.fallbacks_failed += 1
        self.retry(f"no complete checkpoint within {self.timeout:g} s")

    def retry(self, why: str) -> None:
        """Ask again, or give up after ``max_attempts``."""
        f = self.current
        if f.attempt >= self.max_attempts:
            self.current = None
            self.stats.fallbacks_abandoned += 1
            self.stats.fallback_error = (f"fallback ({f.reason}) abandoned after {f.attempt} attempt(s); "
                                         f"last: {why}")
            self._event("fallback_abandoned", {"reason": f.reason, "attempts": f.attempt, "last": why})
            log.error("%s; the replica stays stale and no fallback is asked until the trainer registers "
                      "again", self.stats.fallback_error)
            return
        f.attempt += 1
        f.requested, f.rebuild = time.monotonic(), None
        log.warning("fallback attempt %d failed (%s); asking again", f.attempt - 1, why)
        self.push()

    def forget(self) -> None:
        """The job restarted: what was under way is moot."""
        self.current = None

    def part(self, b: dict, tensors: dict, layout, training, impl: str) -> None:
        f = self.current
        if f is None or layout is None:
            raise Refused("GOCKPT_PART without a fallback in progress")
        if b["index"] == 0:
            if not 1 <= b["parts"] <= gockpt.MAX_PARTS:
                raise Refused(f"parts must be in 1..{gockpt.MAX_PARTS}")
            rb = gockpt.Rebuild(layout, training, b["parts"], impl=impl)
            rb.add_part(b["step"], 0, b["parts"], b.get("slices", {}), tensors, own=True)
            f.rebuild = rb
        elif f.rebuild is None:
            raise Refused(f"part {b['index']} before part 0")
        else:
            f.rebuild.add_part(b["step"], b["index"], b["parts"], b.get("slices", {}), tensors, own=True)

    def done(self, b: dict, tensors: dict, layout, training, impl: str):
        """The rebuilt state as a replica and the digest it was verified with, or None when it
        does not match the trainer's fingerprints (asked again)."""
        f = self.current
        rb = f.rebuild if f is not None else None
        if rb is None or not rb.complete:
            raise Refused("GOCKPT_DONE before every part arrived")
        if b["step"] != rb.final_step or b["parts"] != rb.parts:
            raise Refused(f"GOCKPT_DONE for step {b['step']} ({b['parts']} parts), the rebuild is at "
                          f"{rb.final_step} ({rb.parts} parts)")
        if not b.get("fingerprints"):
            raise Refused("GOCKPT_DONE without fingerprints: the rebuilt state cannot be verified")
        try:
            want = gockpt.digest_of(b["fingerprints"], tensors)
        except gockpt.PartError as e:
            raise Refused(f"GOCKPT_DONE: {e}") from None
        # the rebuild's tensors become the replica's (no copy)
        rep = Replica(layout, training, rb.state(), impl, adopt=True)
        rep.synced_at = max(0, rep.step - rb.parts)  # each part took up to k steps of our own arithmetic
        v = rep.check(want)
        if not v.ok:
            diff = v.differing
            self.stats.fallbacks_failed += 1
            f.rebuild = None
            log.error("GoCkpt rebuild to step %d does not match the trainer's fingerprints (%d tensors, "
                      "first %s)", rb.final_step, len(diff), diff[0])
            self._event("fallback_unverified", {"step": rb.final_step, "tensors": diff[:8]})
            self.retry(f"rebuild to step {rb.final_step} differs from the trainer in {diff[0]}")
            return None
        self.current = None
        return rep, rb, want, v

    def completed(self) -> None:
        """Counted once the rebuilt replica is installed: a reader of the stats never sees a fallback
        done while the old replica is still in place."""
        self.stats.fallbacks_done += 1
