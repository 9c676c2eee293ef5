"""`mirrorckpt serve --config FILE`: the appliance on live mirror ports (or paced capture files)."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

import click


def interface_problem(spec: str) -> str | None:
    """Why ``IFACE`` or ``IFACE@NETNS`` (an afpacket source) cannot be captured, or None. The
    interface is looked up inside its namespace, from a thread that enters it (as the capture does)."""
    import socket
    import threading

    from mirrorckpt.capture.afpacket import in_netns
    from mirrorckpt.capture.batch import CaptureError

    iface, _, netns = spec.partition("@")
    if not iface or (_ and not netns):
        return f"{spec!r}: expected IFACE or IFACE@NETNS"
    out: list = []

    def look():
        try:
            with in_netns(netns):
                socket.if_nametoindex(iface)
        except CaptureError as e:
            out.append(str(e))
        except OSError:
            out.append(f"interface {iface!r} does not exist in network namespace {netns!r}")

    if not netns:
        return None if (Path("/sys/class/net") / iface).exists() else f"interface {iface!r} does not exist"
    t = threading.Thread(target=look)
    t.start()
    t.join()
    return out[0] if out else None


def check_sources(job) -> list[str]:
    """Problems with the configured mirror sources, each naming the [[mirror]] entry."""
    errors = []
    if not job.mirrors:
        errors.append("no [[mirror]] entries: nothing to capture")
    for i, m in enumerate(job.mirrors):
        where = f"[[mirror]] #{i + 1} source"
        if not m.source:
            errors.append(f"{where}: missing (afpacket:IFACE[@NETNS], dpdk:VDEV or a capture file)")
        elif m.source.startswith("afpacket:"):
            problem = interface_problem(m.source.split(":", 1)[1])
            if problem:
                errors.append(f"{where}: {problem}")
        elif not m.source.startswith("dpdk:") and not Path(m.source.removeprefix("file:")).is_file():
            errors.append(f"{where}: no capture file {m.source!r}")
    return errors


@click.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--pace", help="For capture-file sources: 'recorded' or a rate in Gbit/s (default: as fast as possible).")
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
def serve(config_path, pace, log_level):
    """Run the appliance: capture the mirror ports, keep the replica, commit checkpoints."""
    from mirrorckpt.config.jobfile import ConfigError, load_job
    from mirrorckpt.config.training import PersistSpec, SpecError, TrainingSpec
    from mirrorckpt.tools.metrics import Metrics
    from mirrorckpt.tools.serve import Daemon, setup_logging

    setup_logging(getattr(logging, log_level.upper()))
    log = logging.getLogger("mirrorckpt.serve")
    try:
        job = load_job(config_path)
        if job.kind == "ddp" and job.layout is None and not job.control.get("listen"):
            raise ConfigError(f"{config_path}: serve needs the job layout: [[job.params]] in [job], or a "
                              "[control] listen address where the trainer registers it")
        if not job.ring.addresses:
            raise ConfigError(f"{Path(config_path).name}: [ring] addresses: serve needs every rank's address")
        problems = check_sources(job)
        if problems:
            raise ConfigError("; ".join(f"{Path(config_path).name}: {p}" for p in problems))
        if job.training:
            training = TrainingSpec.from_dict(job.training)
        elif job.control.get("listen"):
            training = None  # the trainer's REGISTER brings it (a [training] table must agree with it)
        else:
            training = TrainingSpec(grad_dtype=job.grad_dtype)
        persist = PersistSpec.from_dict(job.persist) if job.persist else None
    except (ConfigError, SpecError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    pace_v = None if pace is None else ("recorded" if pace == "recorded" else float(pace))
    metrics = Metrics()
    if job.metrics.get("listen"):
        host, port = metrics.serve(job.metrics["listen"])
        log.info("metrics endpoint up", extra={"listen": f"{host}:{port}"})
    control = None
    if job.control.get("listen"):
        from mirrorckpt.control.appliance_side import AppliancePlane

        c = job.control
        host, _, port = c["listen"].rpartition(":")
        try:
            secret = Path(c["secret_file"]).read_bytes().strip() if c.get("secret_file") else None
        except OSError as e:
            click.echo(f"error: [control] secret_file: {e.strerror}: {c['secret_file']}", err=True)
            sys.exit(2)
        if not secret:
            click.echo(f"error: {Path(config_path).name}: [control] needs secret_file (a shared secret, "
                       "at least 16 bytes)", err=True)
            sys.exit(2)
        control = AppliancePlane(secret, host=host or "127.0.0.1", port=int(port), training=training,
                                 layout=job.layout, ring=job.ring, persist=persist,
                                 parts=c.get("fallback_parts", 7), fingerprint_every=c.get("fingerprint_every", 10))
    daemon = Daemon(job, training, persist, metrics, pace=pace_v, control=control)
    signal.signal(signal.SIGTERM, daemon.request_stop)
    signal.signal(signal.SIGINT, daemon.request_stop)
    code = daemon.run()
    for sig in (signal.SIGTERM, signal.SIGINT):  # already stopping: teardown must not be cut short
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(code)
