"""`mirrorckpt status`: what a running appliance reports on its metrics endpoint."""

from __future__ import annotations

import sys
import urllib.error
import urllib.parse
import urllib.request

import click


def fetch(url: str, timeout: float = 5.0) -> dict:
    """Metric samples as {name: {labels tuple: value}} from a Prometheus text endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as r:
        text = r.read().decode()
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def render(m: dict) -> str:
    def one(name, default=0.0):
        v = m.get(name, {})
        return next(iter(v.values()), default) if v else default

    def by(name, key):
        return {dict(k).get(key): v for k, v in m.get(name, {}).items()}

    lines = []
    ports = sorted(by("mirrorckpt_frames_received_total", "port"))
    for p in ports:
        fr = by("mirrorckpt_frames_received_total", "port").get(p, 0)
        by_ = by("mirrorckpt_bytes_received_total", "port").get(p, 0)
        drops = {dict(k).get("where"): v for k, v in m.get("mirrorckpt_frames_dropped_total", {}).items()
                 if dict(k).get("port") == p}
        icrc = by("mirrorckpt_icrc_failures_total", "port").get(p, 0)
        lines.append(f"port {p}: {fr:.0f} frames, {by_ / 1e6:.1f} MB, dropped {drops.get('capture', 0):.0f} "
                     f"(capture) {drops.get('kernel', 0):.0f} (kernel), {icrc:.0f} ICRC failures")
    it = by("mirrorckpt_iterations_total", "state")
    lines.append(f"iterations: {it.get('complete', 0):.0f} complete, {it.get('incomplete', 0):.0f} incomplete")
    lines.append(f"replica: step {one('mirrorckpt_replica_step'):.0f}, iteration "
                 f"{one('mirrorckpt_replica_iteration'):.0f}, lag {one('mirrorckpt_replica_lag_iterations'):.0f}, "
                 f"{'STALE (waiting for a fallback checkpoint)' if one('mirrorckpt_replica_stale') else 'in step'}")
    lines.append(f"fallbacks: {one('mirrorckpt_fallbacks_total'):.0f}")
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
def status(config_path, url):
    """Show frames, drops, iterations, replica step and lag, fallbacks, checkpoints and queues."""
    if url is None:
        if config_path is None:
            click.echo("error: give --config or --url", err=True)
            sys.exit(2)
        from mirrorckpt.config.jobfile import ConfigError, load_job

        try:
            listen = load_job(config_path).metrics.get("listen")
        except ConfigError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        if not listen:
            click.echo(f"error: {config_path} has no [metrics] listen address", err=True)
            sys.exit(2)
        url = f"http://{listen}/metrics"
    if urllib.parse.urlsplit(url).scheme not in ("http", "https") or not urllib.parse.urlsplit(url).netloc:
        click.echo(f"error: --url {url!r}: expected the metrics endpoint as http://HOST:PORT/metrics", err=True)
        sys.exit(2)
    try:
        click.echo(render(fetch(url)))
    except (urllib.error.URLError, OSError) as e:
        click.echo(f"error: no appliance answers at {url}: {getattr(e, 'reason', e)}", err=True)
        sys.exit(1)
    except (ValueError, UnicodeDecodeError) as e:  # a bad port, or an answer that is not Prometheus text
        click.echo(f"error: {url}: not an appliance's metrics endpoint ({e})", err=True)
        sys.exit(1)
