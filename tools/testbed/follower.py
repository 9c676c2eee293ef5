"""The control-plane tests' parser thread: mirror streams -> JobStream -> ``drive`` -> the plane."""

from __future__ import annotations

import logging
import threading

from mirrorckpt.config.layout import RingSpec
from mirrorckpt.control.appliance_side import AppliancePlane
from mirrorckpt.parser.iteration import ReducedIteration
from mirrorckpt.parser.roce.collectives import NcclJobModel
from mirrorckpt.parser.roce.jobstream import JobStream
from mirrorckpt.updater.drive import drive

log = logging.getLogger("mirrorckpt.testbed.follower")


class MirrorFollower(threading.Thread):
    """Waits for the layout (from the configuration or the trainer's REGISTER) before it reads, so
    frames queue up until then."""

    def __init__(self, plane: AppliancePlane, streams, ring: RingSpec, with_startup: bool = False,
                 wait_timeout: float = 120.0, collective_window: int = 2, channels: dict | None = None,
                 psn_window: int | None = None):
        super().__init__(name="mirror-follower", daemon=True)
        self.plane, self.streams, self.ring = plane, streams, ring
        self.with_startup, self.wait_timeout = with_startup, wait_timeout
        self.channels = channels  # ring connection -> channel; None: inferred from the first sends
        if psn_window is not None:  # PSNs a QP moves past a hole before its message is given up
            for path in getattr(streams, "paths", []):
                path.reassembler.psn_window = psn_window
        # collectives past an all-reduce before it is final: small, the stream is live
        self.collective_window = collective_window
        self.error: BaseException | None = None
        self.iterations = 0
        self.js = None

    def run(self) -> None:
        try:
            if not self.plane.registered.wait(self.wait_timeout):
                raise TimeoutError("no layout: nobody registered the job")
            model = NcclJobModel.ddp(self.ring, self.plane.layout, with_startup=self.with_startup)
            self.js = JobStream(self.streams, model=model, ranks=self.ring.ranks_by_address(),
                                channels=self.channels, nccl_version=self.ring.nccl_version,
                                collective_window=self.collective_window,
                                infer_after=1 if self.channels is not None else 20000)
            drive(self.js, self.plane, self._count)
        except BaseException as e:  # noqa: BLE001 - handed to whoever joins
            self.error = e
            log.error("mirror follower stopped: %s: %s", type(e).__name__, e)

    def _count(self, item) -> None:
        if isinstance(item, ReducedIteration):
            self.iterations += 1
