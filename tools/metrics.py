"""The appliance's Prometheus metrics, in one registry (so tests can run several appliances)."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        port = ["port"]
        self.frames = Counter("mirrorckpt_frames_received", "Frames received per mirror port", port, registry=r)
        self.bytes = Counter("mirrorckpt_bytes_received", "Bytes received per mirror port", port, registry=r)
        self.dropped = Counter("mirrorckpt_frames_dropped", "Frames dropped per port: at the capture edge "
                               "(the pipeline fell behind) or by the kernel/NIC", port + ["where"], registry=r)
        self.icrc = Counter("mirrorckpt_icrc_failures", "RoCE packets whose ICRC failed", port, registry=r)
        self.roce = Counter("mirrorckpt_roce_packets", "RoCEv2 packets decoded per mirror port (0 while the port "
                            "carries none: a silent mirror)", port, registry=r)
        self.other = Counter("mirrorckpt_other_frames", "Frames per mirror port that are not RoCEv2, by class "
                             "(arp, tcp, udp_other, ethertype_0x86dd, ...): foreign traffic on the mirror, never "
                             "followed; the port's most common classes, counted every few seconds", port + ["class"],
                             registry=r)
        # protection (control.protection): the verdict first, then the steps it compares
        self.protection = Gauge("mirrorckpt_protection", "1 for the current verdict: protected, lagging, "
                                "not protected (its reason: mirrorckpt_protection_reason)", ["verdict"], registry=r)
        self.protection_reason = Info("mirrorckpt_protection_reason", "Why the verdict is what it is", registry=r)
        self.trainer_step = Gauge("mirrorckpt_trainer_step", "The trainer's newest reported step (-1: unknown)",
                                  registry=r)
        self.protected_step = Gauge("mirrorckpt_protected_step", "The newest state the appliance can restore "
                                    "(-1: none)", registry=r)
        self.lag_steps = Gauge("mirrorckpt_lag_steps", "Steps the trainer is ahead of the protected step (-1: "
                               "unknown)", registry=r)
        self.verified_step = Gauge("mirrorckpt_verified_step", "The newest checkpoint proven equal to the trainer "
                                   "(-1: none)", registry=r)
        self.last_commit_time = Gauge("mirrorckpt_last_commit_timestamp_seconds", "Unix time of the newest committed "
                                      "checkpoint (0: none)", registry=r)
        self.fallback_given_up = Gauge("mirrorckpt_fallback_given_up", "1 while fallbacks are abandoned (until the "
                                       "trainer registers again)", registry=r)
        self.degraded_fallbacks = Counter("mirrorckpt_degraded_fallbacks", "Fallbacks asked because the replica "
                                          "stopped following the mirror (or, control-only, every N steps)", registry=r)
        self.mirror_lost = Counter("mirrorckpt_mirror_lost_frames", "Frames a remote mirror session lost between the "
                                   "switch and the capture (gaps in its GRE sequence numbers: ERSPAN II/III, gretap "
                                   "with seq)", port + ["session"], registry=r)
        self.truncated = Counter("mirrorckpt_truncated_frames", "Frames the mirror cut (ERSPAN's truncated bit, or "
                                 "shorter than their IP header): never followed", port, registry=r)
        self._lost_seen: dict[tuple[str, str], int] = {}
        self.iterations = Counter("mirrorckpt_iterations", "Iterations seen on the wire", ["state"], registry=r)
        self.replica_step = Gauge("mirrorckpt_replica_step", "Optimizer steps the replica has taken", registry=r)
        self.replica_iteration = Gauge("mirrorckpt_replica_iteration", "Last iteration applied to the replica",
                                       registry=r)
        self.wire_iteration = Gauge("mirrorckpt_wire_iteration", "Last iteration reassembled from the wire",
                                    registry=r)
        self.lag = Gauge("mirrorckpt_replica_lag_iterations", "Iterations the replica is behind the wire",
                         registry=r)
        self.stale = Gauge("mirrorckpt_replica_stale", "1 while the replica waits for a resync", registry=r)
        self.fallbacks = Counter("mirrorckpt_fallbacks", "Fallback checkpoints requested from the trainer",
                                 registry=r)
        self.rearms = Counter("mirrorckpt_rearms", "Restarts of the training job followed without an appliance "
                              "restart (a REGISTER from a new run on a new communicator)", registry=r)
        self.persist_seconds = Histogram("mirrorckpt_persist_seconds", "Time to commit one checkpoint",
                                         registry=r, buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300))
        lat = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.step_latency = Histogram("mirrorckpt_step_latency_seconds", "From an iteration's last captured packet "
                                      "to the replica's step (live capture only)", registry=r, buckets=lat)
        self.commit_latency = Histogram("mirrorckpt_commit_latency_seconds", "From an iteration's last captured "
                                        "packet to its committed checkpoint (live capture only)", registry=r,
                                        buckets=lat)
        self.last_committed = Gauge("mirrorckpt_last_committed_step", "Iterations in the newest committed "
                                    "checkpoint", registry=r)
        self.queue_depth = Gauge("mirrorckpt_queue_depth", "Items waiting between pipeline stages", ["queue"],
                                 registry=r)
        self.stage_cpu = Counter("mirrorckpt_stage_cpu_seconds", "CPU time of each pipeline stage's thread: a capture "
                                 "worker's capture and decode threads (per port), the parser and the updater; "
                                 "the stage near a core's worth per second is the one that limits the rate",
                                 ["stage", "port"], registry=r)
        self.memory = Gauge("mirrorckpt_resident_bytes", "Resident memory of the appliance process", registry=r)
        self.memory.set_function(_rss)

    def mirror_lost_sessions(self, port: str, lost: dict[str, int]) -> None:
        """A port's running count of frames lost per mirror session (its worker's MirrorHealth)."""
        for session, n in lost.items():
            seen = self._lost_seen.get((port, session), 0)
            if n > seen:
                self.mirror_lost.labels(port, session).inc(n - seen)
                self._lost_seen[(port, session)] = n

    def follow_persister(self, get) -> None:
        """Export the persister's counters at each scrape; ``get()`` returns the Persister or None
        (it exists only once the appliance has started)."""
        self.registry.register(_PersistCollector(get))

    def serve(self, listen: str, registry: CollectorRegistry | None = None):
        """Starts the HTTP endpoint on HOST:PORT (of ``registry``, default this one's); returns the
        bound (host, port)."""
        host, _, port = listen.rpartition(":")
        server, _ = start_http_server(int(port), addr=host or "127.0.0.1", registry=registry or self.registry)
        return server.server_address[:2]


def with_rings(job: Metrics, rings: dict[str, Metrics]) -> CollectorRegistry:
    """One registry for a sharded job's endpoint: the job's own metrics (its verdict, its joint
    commits) as they are, and each ring's under the same names with a ``ring`` label."""
    registry = CollectorRegistry()
    registry.register(_RingCollector(job, rings))
    return registry


class _RingCollector:
    def __init__(self, job: Metrics, rings: dict[str, Metrics]):
        self.job, self.rings = job, rings

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.metrics_core import Metric

        families: dict[str, Metric] = {}
        for ring, registry in [(None, self.job.registry)] + [(n, m.registry) for n, m in self.rings.items()]:
            for fam in registry.collect():
                out = families.get(fam.name)
                if out is None:
                    out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for smp in fam.samples:
                    labels = dict(smp.labels, ring=ring) if ring is not None else smp.labels
                    out.add_sample(smp.name, labels, smp.value, smp.timestamp, smp.exemplar)
        yield from families.values()


def _rss() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0.0


class _PersistCollector:
    """Persistence outcomes, read from updater.persist.PersistStats when scraped: what was
    written, what waited, what was skipped or failed and why, and the last error."""

    def __init__(self, get):
        self.get = get

    def describe(self):
        return []

    def collect(self):
        per = self.get()
        st = per.stats if per is not None else None
        c = CounterMetricFamily("mirrorckpt_persist_snapshots", "Snapshots by outcome: committed, written "
                                "unstaged (larger than memory_budget_bytes, the replica waited), skipped (staging "
                                "buffers busy, or mid-iteration), failed", labels=["outcome"])
        for outcome in ("committed", "unstaged", "skipped_budget", "skipped_busy", "failed", "verified",
                        "quarantined"):
            c.add_metric([outcome], getattr(st, outcome, 0) if st is not None else 0)
        yield c
        yield GaugeMetricFamily("mirrorckpt_persist_unstaged_seconds", "Time the replica waited for unstaged writes",
                                value=st.unstaged_seconds if st is not None else 0.0)
        yield GaugeMetricFamily("mirrorckpt_persist_refused", "1 when the checkpoint root belongs to another job "
                                "(nothing is written)", value=1 if st is not None and st.refused else 0)
        err = InfoMetricFamily("mirrorckpt_persist_last_error", "The last persistence error")
        if st is not None and (st.refused or st.last_error):
            err.add_metric([], {"error": (st.refused or st.last_error)[:300]})
        yield err
