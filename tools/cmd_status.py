"""`mirrorckpt status`: what a running appliance reports on its metrics endpoint."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import click
from mirrorckpt.tools.cliutil import Number, fail


def fetch(url: str, timeout: float = 5.0) -> dict:
    """Metric samples as {name: {labels tuple: value}} from a Prometheus text endpoint."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return parse(r.read().decode())


def parse(text: str) -> dict:
    """Prometheus text as {name: {labels tuple: value}}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _one(m: dict, name: str, default=0.0):
    v = m.get(name, {})
    return next(iter(v.values()), default) if v else default


def _step(v) -> int | None:
    return None if v is None or v < 0 else int(v)


def summary(m: dict) -> dict:
    """The verdict first, then the steps it compares (control.protection), as a JSON object."""
    info = next(iter(m.get("mirrorckpt_protection_reason_info", {})), ())
    info = dict(info)
    commit = _one(m, "mirrorckpt_last_commit_timestamp_seconds", 0.0)
    return {"verdict": info.get("verdict", "unknown"), "reason": info.get("reason", "the appliance did not say"),
            "trainer_step": _step(_one(m, "mirrorckpt_trainer_step", None)),
            "protected_step": _step(_one(m, "mirrorckpt_protected_step", None)),
            "lag_steps": _step(_one(m, "mirrorckpt_lag_steps", None)),
            "verified_step": _step(_one(m, "mirrorckpt_verified_step", None)),
            "last_commit_unix": commit or None,
            "fallback_given_up": bool(_one(m, "mirrorckpt_fallback_given_up")),
            "replica_step": int(_one(m, "mirrorckpt_replica_step")),
            "replica_iteration": int(_one(m, "mirrorckpt_replica_iteration")),
            "replica_stale": bool(_one(m, "mirrorckpt_replica_stale")),
            "fallbacks": int(_one(m, "mirrorckpt_fallbacks_total")),
            "degraded_fallbacks": int(_one(m, "mirrorckpt_degraded_fallbacks_total")),
            "rearms": int(_one(m, "mirrorckpt_rearms_total")),
            "ports": {dict(k).get("port"): {"frames": int(v)} for k, v in
                      m.get("mirrorckpt_frames_received_total", {}).items()}}


def verdict_lines(m: dict) -> list[str]:
    s = summary(m)

    def step(v):
        return "-" if v is None else str(v)
    ago = f"{time.time() - s['last_commit_unix']:.0f} s ago" if s["last_commit_unix"] else "never"
    return [f"{s['verdict'].upper()}: {s['reason']}",
            f"trainer: step {step(s['trainer_step'])}, protected: step {step(s['protected_step'])} (lag "
            f"{step(s['lag_steps'])}), verified: step {step(s['verified_step'])}, last commit: {ago}"]


def render(m: dict) -> str:
    def one(name, default=0.0):
        return _one(m, name, default)

    def by(name, key):
        return {dict(k).get(key): v for k, v in m.get(name, {}).items()}

    lines = verdict_lines(m)
    ports = sorted(by("mirrorckpt_frames_received_total", "port"))
    for p in ports:
        fr = by("mirrorckpt_frames_received_total", "port").get(p, 0)
        by_ = by("mirrorckpt_bytes_received_total", "port").get(p, 0)
        drops = {dict(k).get("where"): v for k, v in m.get("mirrorckpt_frames_dropped_total", {}).items()
                 if dict(k).get("port") == p}
        icrc = by("mirrorckpt_icrc_failures_total", "port").get(p, 0)
        roce = by("mirrorckpt_roce_packets_total", "port").get(p, 0)
        other = sorted(((v, dict(k).get("class")) for k, v in m.get("mirrorckpt_other_frames_total", {}).items()
                        if dict(k).get("port") == p and v), reverse=True)
        named = "; other: " + ", ".join(f"{c} {v:.0f}" for v, c in other[:4]) if other else ""
        lines.append(f"port {p}: {fr:.0f} frames ({roce:.0f} RoCE{named}), {by_ / 1e6:.1f} MB, dropped "
                     f"{drops.get('capture', 0):.0f} (capture) {drops.get('kernel', 0):.0f} (kernel), {icrc:.0f} ICRC "
                     "failures")
        lost = {dict(k).get("session"): v for k, v in m.get("mirrorckpt_mirror_lost_frames_total", {}).items()
                if dict(k).get("port") == p}
        for session, n in sorted(lost.items()):
            lines.append(f"port {p}: mirror session {session}: {n:.0f} frames lost between the switch and the port")
        cut = by("mirrorckpt_truncated_frames_total", "port").get(p, 0)
        if cut:
            lines.append(f"port {p}: {cut:.0f} frames TRUNCATED by the mirror (never followed: raise the mirror "
                         "session's MTU)")
    it = by("mirrorckpt_iterations_total", "state")
    lines.append(f"iterations: {it.get('complete', 0):.0f} complete, {it.get('incomplete', 0):.0f} incomplete")
    lines.append(f"replica: step {one('mirrorckpt_replica_step'):.0f}, iteration "
                 f"{one('mirrorckpt_replica_iteration'):.0f}, lag {one('mirrorckpt_replica_lag_iterations'):.0f}, "
                 f"{'STALE (waiting for a fallback checkpoint)' if one('mirrorckpt_replica_stale') else 'in step'}")
    degraded = one("mirrorckpt_degraded_fallbacks_total")
    lines.append(f"fallbacks: {one('mirrorckpt_fallbacks_total'):.0f} ({degraded:.0f} in degraded mode)"
                 f"{', GIVEN UP' if one('mirrorckpt_fallback_given_up') else ''}")
    lines.append(f"re-arms: {one('mirrorckpt_rearms_total'):.0f} (job restarts followed on a new communicator)")
    lines.append(f"last committed checkpoint: iteration {one('mirrorckpt_last_committed_step'):.0f}")
    snaps = by("mirrorckpt_persist_snapshots_total", "outcome")
    if snaps:
        lines.append(f"persistence: {snaps.get('committed', 0):.0f} committed, {snaps.get('failed', 0):.0f} failed, "
                     f"{snaps.get('unstaged', 0):.0f} written unstaged (over memory_budget_bytes; the replica "
                     f"waited {one('mirrorckpt_persist_unstaged_seconds'):.1f} s), skipped "
                     f"{snaps.get('skipped_budget', 0):.0f} (staging busy) {snaps.get('skipped_busy', 0):.0f} "
                     f"(mid-iteration), {snaps.get('verified', 0):.0f} verified, "
                     f"{snaps.get('quarantined', 0):.0f} quarantined")
    if one("mirrorckpt_persist_refused"):
        lines.append("persistence: REFUSED: the checkpoint directory belongs to another job; nothing is written")
    err = m.get("mirrorckpt_persist_last_error_info", {})
    for labels in err:
        lines.append(f"persistence error: {dict(labels).get('error')}")
    q = by("mirrorckpt_queue_depth", "queue")
    if q:
        lines.append("queues: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(q.items())))
    lines.append(f"memory: {one('mirrorckpt_resident_bytes') / 2**20:.0f} MiB resident")
    return "\n".join(lines)


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True),
              help="The appliance's configuration (its [metrics] listen address).")
@click.option("--url", help="The metrics endpoint, e.g. http://127.0.0.1:9100/metrics.")
@click.option("--json", "as_json", is_flag=True, help="The verdict and the steps it compares as one JSON object.")
@click.option("--watch", type=Number(0.1), metavar="SECONDS", help="Show it again every SECONDS until interrupted.")
def status(config_path, url, as_json, watch):
    """Whether the job is protected, and why; then frames, drops, iterations, replica, fallbacks,
    checkpoints and queues. Exits 1 when no appliance answers, 3 when the job is not protected."""
    url = _metrics_url(config_path, url)
    while True:
        try:
            m = fetch(url)
        except (urllib.error.URLError, OSError) as e:
            fail(f"no appliance answers at {url}: {getattr(e, 'reason', e)}", 1)
        except (ValueError, UnicodeDecodeError) as e:  # a bad port, or an answer that is not Prometheus text
            fail(f"{url}: not an appliance's metrics endpoint ({e})", 1)
        click.echo(json.dumps(summary(m)) if as_json else render(m))
        if watch is None:
            break
        try:
            time.sleep(watch)
        except KeyboardInterrupt:
            break
        if not as_json:
            click.echo("")
    sys.exit(3 if summary(m)["verdict"] == "not protected" else 0)


def _metrics_url(config_path, url) -> str:
    if url is None:
        if config_path is None:
            fail("give --config or --url")
        from mirrorckpt.config.jobfile import ConfigError, load_job

        try:
            listen = load_job(config_path).metrics.get("listen")
        except ConfigError as e:
            fail(str(e))
        if not listen:
            fail(f"{config_path} has no [metrics] listen address")
        url = f"http://{listen}/metrics"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        fail(f"--url {url!r}: expected the metrics endpoint as http://HOST:PORT/metrics")
    return url
