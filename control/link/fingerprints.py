"""FINGERPRINTs of the trainer's state every ``every`` steps. The digest is taken off the training
thread from a host copy started at the step's end; it is sent at the next step's start (after the
copy was fenced) or at close, so the job's last fingerprint reaches the appliance too."""

from __future__ import annotations

from mirrorckpt.control import gockpt
from mirrorckpt.control import messages as m


class Fingerprints:
    def __init__(self, every: int, link):
        self.every = every
        self._link = link  # copier, transport, named_state(), stats
        self._pending: tuple[int, gockpt.Copy] | None = None

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def take(self, step: int) -> None:
        """Start the digest of the state after ``step`` (the training thread goes on at once)."""
        self._pending = (step, self._link.copier.digest(self._link.named_state(), step))

    def send_pending(self) -> None:
        """Send the digest taken last, once its copy is done (the state must not move before)."""
        if self._pending is None:
            return
        step, copy = self._pending
        self._pending = None
        self._link.copier.fence(copy)
        self._link.transport.emit(lambda d: m.make(m.FINGERPRINT, gockpt.digest_tensors(d), step=step,
                                                   fingerprints=d.words), copy)
        self._link.stats.fingerprints_sent += 1
