"""`mirrorckpt serve --config FILE`: the appliance on live mirror ports (or paced capture files)."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

import click
from mirrorckpt.tools.cliutil import Pace, unwritable_dir


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


def check_sources(job, table: str = "[[mirror]]") -> list[str]:
    """Problems with the configured mirror sources, each naming its entry (of ``table``)."""
    errors = []
    if not job.mirrors:
        errors.append(f"no {table} entries: nothing to capture (to follow a trainer over the control plane "
                      "alone, serve --control-only)")
    for i, m in enumerate(job.mirrors):
        where = f"{table} #{i + 1} source"
        if not m.source:
            errors.append(f"{where}: missing (afpacket:IFACE[@NETNS], dpdk:VDEV or a capture file)")
        elif m.source.startswith("afpacket:"):
            problem = interface_problem(m.source.split(":", 1)[1])
            if problem:
                errors.append(f"{where}: {problem}")
        elif not m.source.startswith("dpdk:") and not Path(m.source.removeprefix("file:")).is_file():
            errors.append(f"{where}: no capture file {m.source!r}")
        if m.workers > 1 and m.source.startswith("dpdk:"):
            errors.append(f"{table} #{i + 1} workers = {m.workers}: a dpdk source has one worker (splitting "
                          "its port over RSS queues is not built); use afpacket or workers = 1")
    return errors


def check_sharded(job, name: str, pipelined: bool) -> list[str]:
    """Problems with a job of [[ring]] tables that `serve` would meet, each naming the ring and key."""
    import dataclasses

    layout, errors = job.shards, []
    control = bool(job.control)
    grad = [rc for rc in job.rings if not rc.weights_only]
    for i, rc in enumerate(job.rings):
        where = f"[[ring]] #{i + 1}"
        if not rc.ring.addresses:
            errors.append(f"{where} addresses: serve needs every rank's address")
        if rc.ring.protocol == "auto" or rc.ring.nccl_version is None:
            errors.append(f"{where}: a sharded job's ring names its protocol (LL, LL128, Simple) and nccl_version")
        errors += check_sources(dataclasses.replace(job, mirrors=rc.mirrors), f"{where} [[ring.mirror]]")
    # with [joint] the other appliances follow the other groups (config.jobfile checked this one's)
    missing = sorted({g.name for g in layout.groups} - {rc.group for rc in grad}) \
        if layout is not None and not job.joint else []
    if grad and missing and job.persist:
        errors.append(f"[persist]: a joint checkpoint holds every shard, and no [[ring]] follows group(s) "
                      f"{', '.join(missing)} (one serve follows every ring of the job, or each appliance's "
                      "serve its own with [joint])")
    clip = (job.training or {}).get("clip")
    if clip and grad and not control:  # with a control plane the trainer sends the coefficient it applied
        if layout.scheme != "fsdp2":
            errors.append(f"[training] clip: the replicas clip a sharded job by torch's global norm over its "
                          f"shards (FSDP2); {layout.scheme}'s own clipping arithmetic is not modelled")
        elif missing:
            errors.append(f"[training] clip: the global norm needs every shard's, and no [[ring]] follows group(s) "
                          f"{', '.join(missing)}")
        if pipelined:
            errors.append("[updater] pipelined (or --pipelined): with clipping no shard steps a bucket before every "
                          "shard's norm is known")
    if grad and not control and layout.scheme == "fsdp2" and not job.initial:
        errors.append("[job] initial: missing; FSDP2 broadcasts nothing at start, so the replicas start from a seed "
                      "checkpoint (a DCP checkpoint of model.<fqn> tensors at step 0), or from the trainer's "
                      "registration with [control]")
    if control and job.initial:
        errors.append("[job] initial: with [control] the replicas start from the trainer's registration (its initial "
                      "state, or a fallback)")
    return errors


def tls_context(control: dict, name: str):
    """The control plane's mutual-TLS context from [control] tls_cert/tls_key/tls_ca, or None."""
    from mirrorckpt.config.jobfile import ConfigError
    from mirrorckpt.control.tls import TlsConfigError, server_context

    keys = ("tls_cert", "tls_key", "tls_ca")
    given = [k for k in keys if control.get(k)]
    if not given:
        return None
    if len(given) != 3:
        raise ConfigError(f"{name}: [control] TLS needs tls_cert, tls_key and tls_ca together (mutual TLS); "
                          f"missing {', '.join(k for k in keys if k not in given)}")
    try:
        return server_context(control["tls_cert"], control["tls_key"], control["tls_ca"])
    except TlsConfigError as e:
        raise ConfigError(f"{name}: [control] {e}") from None


@click.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--pace", type=Pace(),
              help="For capture-file sources: 'recorded' or a rate in Gbit/s (default: as fast as possible).")
@click.option("--pipelined/--no-pipelined", default=None,
              help="Step each bucket's parameters as soon as the bucket is final, so the replica's step ends "
                   "soon after the iteration's last packet (overrides [updater] pipelined; default off: the "
                   "undo copies that roll back an iteration that turns out incomplete cost about 45 % of the "
                   "replica's step rate). Not with [control].")
@click.option("--control-only", is_flag=True,
              help="No mirror: follow the trainer over the control plane only, asking for a fallback checkpoint "
                   "every [protection] fallback_every steps (default: max_lag_steps) and keeping them: try an "
                   "integration on a laptop before touching a switch. Needs [control].")
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--log-format", default="json", type=click.Choice(["json", "text"]), show_default=True,
              help="JSON lines for a log collector, or text for a terminal.")
def serve(config_path, pace, pipelined, control_only, log_level, log_format):
    """Run the appliance: capture the mirror ports, keep the replica, commit checkpoints."""
    from mirrorckpt.config.jobfile import ConfigError, load_job
    from mirrorckpt.config.training import PersistSpec, SpecError, TrainingSpec
    from mirrorckpt.control.protection import Limits
    from mirrorckpt.parser.roce import SLOW_ICRC
    from mirrorckpt.tools.metrics import Metrics
    from mirrorckpt.tools.serve import Daemon, setup_logging
    from mirrorckpt.updater import ckptdir

    setup_logging(getattr(logging, log_level.upper()), log_format)
    log = logging.getLogger("mirrorckpt.serve")
    if SLOW_ICRC and not control_only:
        log.warning(SLOW_ICRC)
    try:
        job = load_job(config_path)
        name = Path(config_path).name
        pipelined = job.pipelined if pipelined is None else pipelined
        # a trainer link: [control] listen, or a sharded job's planes (each [[ring]] listens)
        has_control = bool(job.control.get("listen")) or bool(job.rings and job.control)
        if job.rings:
            if control_only:
                raise ConfigError(f"{name}: --control-only follows one trainer link; this job file lists [[ring]] "
                                  "tables to follow from the wire")
            problems = check_sharded(job, name, pipelined)
            if problems:
                raise ConfigError("; ".join(f"{name}: {p}" for p in problems))
        elif control_only:
            if not job.control.get("listen"):
                raise ConfigError(f"{name}: --control-only needs [control] (listen, secret_file): the trainer is "
                                  "followed over the control plane alone")
            if job.mirrors:
                raise ConfigError(f"{name}: --control-only captures nothing, yet the file has [[mirror]] entries "
                                  "(remove them, or serve without --control-only)")
        elif job.kind == "ddp" and job.layout is None and not job.control.get("listen"):
            raise ConfigError(f"{config_path}: serve needs the job layout: [[job.params]] in [job], or a "
                              "[control] listen address where the trainer registers it")
        elif not job.ring.addresses:
            raise ConfigError(f"{name}: [ring] addresses: serve needs every rank's address")
        limits = Limits(**job.protection)
        if control_only and limits.fallback_every is None:
            limits.fallback_every = limits.max_lag_steps
        problems = [] if control_only or job.rings else check_sources(job)
        if problems:
            raise ConfigError("; ".join(f"{name}: {p}" for p in problems))
        if job.training:
            training = TrainingSpec.from_dict(job.training)
        elif has_control:
            training = None  # the trainer's REGISTER brings it (a [training] table must agree with it)
        else:
            training = TrainingSpec(grad_dtype=job.grad_dtype)
        persist = PersistSpec.from_dict(dict(job.persist, **({"job_name": job.name} if job.name else {}))) \
            if job.persist else None
        layout = (job.shards.global_layout() if job.shards is not None else None) if job.rings else job.layout
        foreign = ckptdir.foreign_root(persist.directory, layout, job.name) if persist else None
        if foreign:
            raise ConfigError(f"{Path(config_path).name}: [persist] {foreign}")
        problem = unwritable_dir(persist.directory, "[persist] directory") if persist else None
        if problem:
            raise ConfigError(f"{Path(config_path).name}: {problem}")
        ssl_context = tls_context(job.control, Path(config_path).name) if has_control else None
        if pipelined and has_control:
            raise ConfigError(f"{Path(config_path).name}: [updater] pipelined (or --pipelined) cannot be used with "
                              "[control]: the control plane steps whole iterations (each waits for its step metadata)")
    except (ConfigError, SpecError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    if persist is None:
        log.warning("no [persist] table: the replica is kept in memory only and no checkpoint is ever committed")
    metrics = Metrics()
    control = None
    if has_control:
        from mirrorckpt.control.appliance_side import AppliancePlane
        from mirrorckpt.control.auth import MIN_SECRET

        c = job.control
        try:
            secret = Path(c["secret_file"]).read_bytes().strip() if c.get("secret_file") else None
        except OSError as e:
            click.echo(f"error: [control] secret_file: {e.strerror}: {c['secret_file']}", err=True)
            sys.exit(2)
        if not secret or len(secret) < MIN_SECRET:
            have = f" ({c['secret_file']} holds {len(secret)} bytes)" if secret else ""
            click.echo(f"error: {Path(config_path).name}: [control] needs secret_file (a shared secret, "
                       f"at least {MIN_SECRET} bytes){have}", err=True)
            sys.exit(2)
        if ssl_context is None:
            log.warning("control plane without TLS: weights, gradients and HMAC proofs cross the network in clear "
                        "(set [control] tls_cert, tls_key and tls_ca)")
        options = {"ssl_context": ssl_context} if ssl_context is not None else None
        if job.rings:  # one plane per gradient ring (tools.daemon.rings)
            control = dict(c, secret=secret, server_options=options)
        else:
            host, _, port = c["listen"].rpartition(":")
            control = AppliancePlane(secret, host=host or "127.0.0.1", port=int(port), training=training,
                                     layout=job.layout, ring=None if control_only else job.ring, persist=persist,
                                     parts=c.get("fallback_parts", 7),
                                     fingerprint_every=c.get("fingerprint_every", 10),
                                     max_lag_steps=limits.max_lag_steps, server_options=options)
    if pipelined:
        log.info("pipelined update: each bucket is stepped as soon as it is final")
    import torch

    # the packet path: each capture process and the parser thread (of every ring)
    rings = job.rings or [job]
    torch.set_num_threads(job.updater_threads(sum(m.workers for r in rings for m in r.mirrors) + len(rings)))
    log.info("updater: %d torch thread(s)", torch.get_num_threads())
    registry = None
    if job.rings:
        from mirrorckpt.tools.daemon.rings import ShardedDaemon
        from mirrorckpt.tools.metrics import with_rings

        daemon = ShardedDaemon(job, training, persist, metrics, limits, pace=pace, pipelined=pipelined,
                               control=control)
        registry = with_rings(metrics, daemon.ring_metrics)
    else:
        daemon = Daemon(job, training, persist, metrics, pace=pace, control=control, pipelined=pipelined,
                        limits=limits, control_only=control_only)
        metrics.follow_persister(lambda: getattr(daemon.appliance, "persister", None))
    daemon.judge()  # the endpoint answers with a verdict from its first request
    if job.metrics.get("listen"):
        host, port = metrics.serve(job.metrics["listen"], registry)
        log.info("metrics endpoint up", extra={"listen": f"{host}:{port}"})
    signal.signal(signal.SIGTERM, daemon.request_stop)
    signal.signal(signal.SIGINT, daemon.request_stop)
    code = daemon.run()
    for sig in (signal.SIGTERM, signal.SIGINT):  # already stopping: teardown must not be cut short
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(code)
