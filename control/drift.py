"""FINGERPRINT on the appliance: the trainer's per-tensor digests against the replica's at the same
step, under the replica's numeric policy (updater.numeric): bit-exact where the trainer runs the
replica's arithmetic, else within the measured tolerance. A digest may arrive before the replica
reaches its step (kept until then) or after it (the replica's own digest of that step is kept for
the steps the trainer fingerprints: every ``every`` steps)."""

from __future__ import annotations

import collections

from mirrorckpt.updater import numeric
from mirrorckpt.updater.numeric import Digest


class DriftCheck:
    KEPT_TRAINER = 16  # digests of steps the replica has not reached yet
    KEPT_OWN = 4  # the replica's own digests of fingerprinted steps

    def __init__(self, stats, every: int):
        self.stats, self.every = stats, every  # stats: the plane's PlaneStats
        self._trainer: dict[int, Digest] = {}
        self._own: collections.OrderedDict[int, Digest] = collections.OrderedDict()

    def clear(self, after: int | None = None) -> None:
        """Forget the digests (a re-arm), or only those of steps up to ``after`` (a resync)."""
        self._own.clear()
        self._trainer = {} if after is None else {k: v for k, v in self._trainer.items() if k > after}

    def pending(self) -> list[int]:
        """Steps whose trainer digest waits for the replica to reach them."""
        return sorted(self._trainer)

    def due(self, step: int) -> bool:
        """The trainer fingerprints this step (a checkpoint there can be proven)."""
        return bool(self.every) and step % self.every == 0

    def trainer_digest(self, step: int, want: Digest, replica) -> numeric.Verdict | None:
        """A FINGERPRINT of ``step``: compared now if the replica holds that step (or its digest of
        it), kept if it is ahead, counted as missed if the replica has passed it unrecorded."""
        if step in self._own:
            return self.compare(replica, step, want, self._own.pop(step))
        if step == replica.iterations_done:
            return self.compare(replica, step, want)
        if step > replica.iterations_done:
            self._trainer[step] = want
            while len(self._trainer) > self.KEPT_TRAINER:
                self._trainer.pop(min(self._trainer))
        else:
            self.stats.fingerprints_missed += 1
        return None

    def stepped(self, replica) -> tuple[int, Digest, numeric.Verdict] | None:
        """The replica took a step: compared with the trainer's digest of it if one waits, else its
        own digest kept when the trainer will send one."""
        t = replica.iterations_done
        want = self._trainer.pop(t, None)
        if want is not None:
            return t, want, self.compare(replica, t, want)
        if self.due(t):
            self._own[t] = replica.digest()
            while len(self._own) > self.KEPT_OWN:
                self._own.popitem(last=False)
        return None

    def compare(self, replica, step: int, want: Digest, have: Digest | None = None) -> numeric.Verdict:
        have = have if have is not None else replica.digest()
        v = numeric.compare(want, have, replica.policy, step, replica.step - replica.synced_at)
        st = self.stats
        st.fingerprints_checked += 1
        st.fingerprints_exact += v.match == "exact"
        st.last_distance = v.distance
        if v.ok:
            st.max_distance = max(st.max_distance, v.distance)
        else:
            st.drift_events += 1
        return v
