"""Each capture stream's counters, from the workers' shared memory to the metrics and the log:
frames, drops (warned where they happen), ICRC failures, stage CPU, an uneven split of a port over
its workers, and whether the port carries RoCE at all (a silent mirror is a fault, named with what
the port does see)."""

from __future__ import annotations

import logging
import threading
import time

from mirrorckpt.parser.streams import StreamStats
from mirrorckpt.tools.daemon.worker import COUNTERS

log = logging.getLogger("mirrorckpt.serve")

# A port that keeps dropping frames is warned about at most this often (the count goes on in the
# metrics); the first drop is always said.
DROP_WARN_S = 10.0
# A live port split over workers has its shares of the bytes looked at once it has captured this
# much (a file's, from its plan); a worker above UNEVEN_SHARE / N of them is said.
SPLIT_CHECK_BYTES = 256 << 20
UNEVEN_SHARE = 1.5
# A port with no RoCE packet while the trainer took this many steps is silent (each data-parallel
# step all-reduces its gradients on the wire); without the trainer's steps, after [protection]
# silent_seconds.
SILENT_STEPS = 2


def stream_label(mirror: int, worker: int, workers: int) -> str:
    """A capture stream's name in metrics and logs: the port, and the worker when it has several."""
    return str(mirror) if workers == 1 else f"{mirror}.{worker}"


def warn_uneven(ports: list[str], share: list[float]) -> None:
    """A port is split by whole QP pairs: a few pairs (or one carrying most bytes) leave the extra
    workers idle, which the operator should hear of."""
    if max(share) > UNEVEN_SHARE / len(share):
        log.warning("a port's workers are unevenly loaded: it is split by whole QP pairs, and its pairs do not "
                    "spread (few of them, or one carrying most bytes; a live port's kernel splits by UDP source "
                    "port mod N): workers beyond the busiest add little",
                    extra={"ports": ports, "share_of_bytes": share})


class PortMonitor:
    """``shared``: per stream, the worker's counters (``worker.COUNTERS``); ``sources``: what each
    stream captures (named in what is said of it); ``drop_hints``: what to do about drops at its
    capture edge; ``split_groups``: the streams of each live port split over several workers."""

    def __init__(self, metrics, labels: list[str], sources: list[str] | None = None, shared: list | None = None,
                 drop_hints: list[str] | None = None, split_groups: list[list[int]] | None = None):
        self.metrics, self.labels, self.shared = metrics, labels, shared
        self.nports = len(labels)
        self.sources = sources or [""] * self.nports
        self.drop_hints = drop_hints or [""] * self.nports
        self.split_unchecked = [g for g in (split_groups or []) if len(g) > 1]
        self.stats = [StreamStats(f"port {lab}") for lab in labels]
        self.counters: dict[int, dict] = {}
        self.classes: dict[int, dict] = {}  # port -> what its frames were, by class (worker.Seen)
        self.damage: dict[int, str | None] = {}  # ended ports
        self._roce_at: dict[int, tuple[int, float]] = {}  # port -> (RoCE packets, when that count was reached)
        self._judged: dict[int, tuple[int, int | None]] = {}  # port -> (RoCE packets, trainer's step when seen)
        self._drop_warned: dict[int, tuple[float, int]] = {}  # port -> (time, drops) of its last warning
        self._lock = threading.Lock()

    # -- from the workers ----------------------------------------------------------------------
    def seen(self, port: int, classes: dict) -> None:
        old = self.classes.get(port, {})
        for k, n in classes.items():  # running counts: a class can leave the top few and come back
            if not k.startswith("roce:") and n > old.get(k, 0):
                self.metrics.other.labels(self.labels[port], k).inc(n - old.get(k, 0))
        self.classes[port] = old | classes

    def ended(self, port: int, damage: str | None) -> None:
        self.damage[port] = damage

    def mirror_lost(self, port: int, sessions: dict) -> None:
        """Frames each mirror session lost so far (GRE/ERSPAN sequence gaps)."""
        self.metrics.mirror_lost_sessions(self.labels[port], sessions)

    def sync(self, stats: list[StreamStats] | None = None) -> None:
        """Brings the metrics up to the workers' shared counters (any thread; the daemon calls it
        every 0.2 s, so the drop counters move while the queues are full)."""
        if self.shared is None:
            return
        with self._lock:
            for port, arr in enumerate(self.shared):
                self._sync(port, dict(zip(COUNTERS, arr[:])), stats or self.stats)

    def _sync(self, port: int, c: dict, stats: list[StreamStats]) -> None:
        if not c.get("capturing") and not c.get("frames"):
            return  # not capturing yet: the port is not reported (status, metrics) before it can see frames
        old = self.counters.get(port, {})
        m, lp = self.metrics, self.labels[port]

        def delta(k):
            return max(0, c[k] - old.get(k, 0))
        m.frames.labels(lp).inc(delta("frames"))
        m.bytes.labels(lp).inc(delta("bytes"))
        m.dropped.labels(lp, "capture").inc(delta("dropped_capture"))
        m.dropped.labels(lp, "kernel").inc(delta("dropped_kernel"))
        m.icrc.labels(lp).inc(delta("icrc"))
        m.roce.labels(lp).inc(delta("roce"))
        m.truncated.labels(lp).inc(delta("mirror_truncated"))
        for stage in ("capture", "decode"):
            m.stage_cpu.labels(stage, lp).inc(delta(f"cpu_{stage}_ns") / 1e9)
        if port not in self._roce_at or c["roce"] != self._roce_at[port][0]:
            self._roce_at[port] = (c["roce"], time.monotonic())
        self.counters[port] = c
        stats[port].frames, stats[port].bytes = c["frames"], c["bytes"]
        self._warn_drops(port, c)
        self._check_split()

    def _check_split(self) -> None:
        """Says once per live port when its workers' shares of the bytes are uneven (a capture
        file's are known from its plan, and its workers read it at their own pace)."""
        for g in list(self.split_unchecked):
            got = [self.counters.get(p, {}).get("bytes", 0) for p in g]
            if sum(got) < SPLIT_CHECK_BYTES:
                continue
            self.split_unchecked.remove(g)
            warn_uneven([self.labels[p] for p in g], [round(x / sum(got), 3) for x in got])

    def _warn_drops(self, port: int, c: dict) -> None:
        """Drops make iterations incomplete (a fallback each): the log says so where it happens,
        not only the metrics."""
        n = c["dropped_capture"] + c["dropped_kernel"]
        when, said = self._drop_warned.get(port, (0.0, 0))
        now = time.monotonic()
        if n > said and (not said or now - when >= DROP_WARN_S):
            self._drop_warned[port] = (now, n)
            log.warning("frames dropped: the iterations they carried are incomplete",
                        extra={"port": self.labels[port], "dropped_capture": c["dropped_capture"],
                               "dropped_kernel": c["dropped_kernel"], "frames": c["frames"],
                               "hint": self.drop_hints[port]})

    # -- what is said of the ports -------------------------------------------------------------
    def drops(self) -> dict:
        """Per stream with any: frames dropped at its capture edge and by the kernel (or NIC)."""
        return {self.labels[p]: {"capture": c["dropped_capture"], "kernel": c["dropped_kernel"]}
                for p, c in sorted(self.counters.items()) if c["dropped_capture"] or c["dropped_kernel"]}

    def sees(self, port: int) -> str:
        """What a port's frames are, for a person: "120 frames (tcp 100, arp 20)", "no frames"."""
        frames = self.counters.get(port, {}).get("frames", 0)
        if not frames:
            return "no frames at all"
        top = ", ".join(f"{k} {v}" for k, v in sorted(self.classes.get(port, {}).items(), key=lambda kv: -kv[1])[:5])
        return f"{frames} frames" + (f" ({top})" if top else "")

    def silent(self, seconds: float, trainer_step: int | None = None) -> list[str]:
        """Each capturing port that brought no RoCE packet while the trainer took SILENT_STEPS steps
        (a data-parallel step all-reduces on the wire), or for ``seconds``, in words naming it and
        what it does see; a port whose source failed, with its error."""
        now, out = time.monotonic(), []
        for port in range(self.nports):
            where = f"port {self.labels[port]} ({self.sources[port]})"
            if port in self.damage:  # a source that ended is not a silent mirror (a file read to its end)
                if self.damage[port]:
                    out.append(f"capture on {where} failed: {self.damage[port]}")
                continue
            if port not in self._roce_at:
                continue  # not capturing yet
            count, since = self._roce_at[port]
            judged = self._judged.get(port)
            if judged is None or judged[0] != count or judged[1] is None:
                self._judged[port] = judged = (count, trainer_step)
            steps = trainer_step - judged[1] if trainer_step is not None and judged[1] is not None else 0
            if now - since >= seconds or steps >= SILENT_STEPS:
                before = f" ({count} RoCE packets before)" if count else ""
                during = f" while the trainer took {steps} steps" if steps else ""
                out.append(f"no RoCE on {where} for {now - since:.0f} s{during}{before}; it sees {self.sees(port)}")
        return out
