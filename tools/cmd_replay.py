"""`mirrorckpt replay [CAPTURE ...]`: mirror captures of one job through the whole pipeline.

Capture, parser, concatenator, CPU replica and persistence. Each file is a mirror stream (a file
holding both directions of a port counts as two streams: they are told apart by address).
Without ``--config`` the job is inferred from the traffic (ranks from CTS tags, channels, DDP
start-up or plain all-reduce sizes). With no CAPTURE at all, the bundled demo capture is
replayed with its configuration.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
from mirrorckpt.capture.batch import CaptureError
from mirrorckpt.capture.pcapfile import open_capture
from mirrorckpt.parser.collectives import JobModel
from mirrorckpt.parser.concat import CollectiveResult
from mirrorckpt.parser.infer import InferenceError
from mirrorckpt.parser.iteration import ReducedIteration
from mirrorckpt.parser.pipeline import JobStream
from mirrorckpt.parser.roce import SLOW_ICRC
from mirrorckpt.parser.streams import MirrorStreams

DEMO = Path(__file__).resolve().parents[1] / "tests" / "pcaps" / "demo"


def allreduce_entry(r: CollectiveResult) -> dict | None:
    """What the report says of one finished all-reduce (None for other collectives)."""
    if r.spec.kind != "allreduce":
        return None
    return {"collective": r.index, "iteration": r.spec.iteration, "bucket": r.spec.bucket,
            "count": r.count, "dtype": r.spec.dtype, "coverage": round(r.coverage, 6), "complete": r.complete,
            "sha256": r.sha256(), "holes": [list(h) for h in r.holes],
            "filled_by_p2p": [list(h) for h in r.filled_by_p2p], "conflicts": r.conflicts}


def allreduce_report(results) -> list[dict]:
    """``results``: finished collectives, or their ``allreduce_entry`` already taken."""
    out = []
    for r in results:
        e = allreduce_entry(r) if isinstance(r, CollectiveResult) else r
        if e is not None:
            out.append({"index": len(out), **e})
    return out


def training_spec(job, dtype, optimizer, lr):
    from mirrorckpt.config.training import OptimizerSpec, TrainingSpec

    if job is not None and job.training:
        return TrainingSpec.from_dict(job.training)
    return TrainingSpec(optimizer=OptimizerSpec(name=optimizer, lr=lr), grad_dtype=dtype or "float32")


def persist_spec(job, checkpoint_dir):
    from mirrorckpt.config.training import PersistSpec

    if checkpoint_dir is None and not (job and job.persist):
        return None
    d = dict(job.persist) if job and job.persist else {}
    if checkpoint_dir is not None:
        d["directory"] = str(checkpoint_dir)
    if job is not None and job.name:
        d["job_name"] = job.name
    return PersistSpec.from_dict(d)


def check_root(job, persist) -> str | None:
    """Whether the checkpoint root belongs to another job, told before anything is read or
    written; only possible here when the configuration gives the layout (else the persister
    checks at its first snapshot)."""
    if persist is None or job is None or job.layout is None:
        return None
    from mirrorckpt.updater import ckptdir

    try:
        ckptdir.check_identity(persist.directory, ckptdir.identity(job.layout.to_dict(), job.name))
    except ckptdir.ForeignRoot as e:
        return str(e)
    return None


def open_stream(captures, job=None, dtype=None, nccl_version=None, icrc=True, transport="roce"):
    """The job stream over capture files: NCCL over RoCEv2, or PyTorch DDP over gloo/TCP."""
    if transport == "gloo":
        from mirrorckpt.parser.gloo_job import open_job_stream

        return open_job_stream(captures, job, dtype)
    streams = MirrorStreams([(c, open_capture(c)) for c in captures], icrc=icrc, nccl_version=nccl_version)
    kw = dict(model=JobModel.from_job(job), ranks=job.ring.ranks_by_address()) if job is not None else {}
    return JobStream(streams, dtype=dtype, nccl_version=nccl_version, **kw)


def run(captures, job=None, dtype=None, nccl_version=None, icrc=True, training=None,
        persist=None, progress=None, transport="roce"):
    """The main job. ``training``: the replica's TrainingSpec, or a function of the layout; None
    keeps no replica. Returns (job stream, finished collectives, iterations, Appliance or None)."""
    js = open_stream(captures, job, dtype, nccl_version, icrc, transport)
    app = None
    if training is not None:
        from mirrorckpt.updater.appliance import Appliance

        app = Appliance(None, training, persist, on_iteration=progress)
    results, iterations = [], []

    def keep(item):
        if isinstance(item, CollectiveResult):
            results.append(item)
        elif isinstance(item, ReducedIteration):
            iterations.append(item)

    from mirrorckpt.updater.appliance import drive

    drive(js, app, keep)
    return js, results, iterations, app


def run_summarized(captures, job=None, dtype=None, nccl_version=None, icrc=True, training=None,
                   persist=None, progress=None, transport="roce"):
    """``run`` for the report: each finished all-reduce kept as its ``allreduce_entry`` and each
    iteration without its buckets, so replaying a capture of any length holds bounded memory."""
    import dataclasses

    from mirrorckpt.updater.appliance import Appliance, drive

    js = open_stream(captures, job, dtype, nccl_version, icrc, transport)
    app = Appliance(None, training, persist, on_iteration=progress) if training is not None else None
    entries, iterations = [], []

    def keep(item):
        if isinstance(item, CollectiveResult):
            e = allreduce_entry(item)
            if e is not None:
                entries.append(e)
        elif isinstance(item, ReducedIteration):
            iterations.append(dataclasses.replace(item, buckets=[]))

    drive(js, app, keep)
    return js, entries, iterations, app


@click.command()
@click.argument("captures", nargs=-1, type=click.Path(dir_okay=False, exists=True))
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True),
              help="Job configuration (TOML); without it the job is inferred from the traffic.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16", "int32"]),
              help="Element type of the all-reduced data (inferred when absent).")
@click.option("--nccl-version", default=None,
              help="NCCL release (e.g. 2.23) if it must be stated; read from the wire when absent "
                   "(a stated release the wire contradicts is an error).")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False),
              help="Keep a CPU replica and commit checkpoints here.")
@click.option("--optimizer", type=click.Choice(["adam", "adamw", "sgd"]), default="adam", show_default=True,
              help="Replica optimizer when the configuration has no [training].")
@click.option("--lr", type=float, default=1e-3, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object with every all-reduce's verdict.")
@click.option("--no-icrc", is_flag=True, help="Skip the ICRC check.")
@click.option("--quiet", is_flag=True, help="No progress lines.")
@click.option("--transport", type=click.Choice(["roce", "gloo"]), default="roce", show_default=True,
              help="NCCL over RoCEv2, or PyTorch DDP over gloo/TCP.")
def replay(captures, config_path, dtype, nccl_version, checkpoint_dir, optimizer, lr, as_json, no_icrc, quiet,
           transport):
    """Replay mirror CAPTURES of one job: reassemble every all-reduce, keep the replica, commit checkpoints.

    With no CAPTURE, the bundled demo (tests/pcaps/demo) is replayed into ./mirrorckpt-demo."""
    from mirrorckpt.config.jobfile import ConfigError, load_job
    from mirrorckpt.config.training import SpecError

    demo = not captures and not config_path
    if demo:
        if not (DEMO / "job.toml").is_file():
            click.echo(f"error: the bundled demo capture is missing ({DEMO}); regenerate it with `make pcaps`",
                       err=True)
            sys.exit(2)
        config_path = str(DEMO / "job.toml")
        checkpoint_dir = checkpoint_dir or "mirrorckpt-demo"
    job = None
    if config_path:
        try:
            job = load_job(config_path)
            if job.kind == "ddp" and job.layout is None:
                raise ConfigError(f"{config_path}: replay needs the layout ([[job.params]] in [job]); "
                                  "without --config it is inferred from the traffic")
        except ConfigError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        nccl_version = nccl_version or job.ring.nccl_version
        if not captures:  # the job file lists its capture files as mirror sources
            captures = tuple(m.source for m in job.mirrors if not m.source.startswith(("afpacket:", "dpdk:")))
    if not captures:
        click.echo("error: no capture to replay: give CAPTURE files, or a --config whose [[mirror]] sources "
                   "are capture files", err=True)
        sys.exit(2)
    keep_replica = checkpoint_dir is not None or (job is not None and bool(job.persist))
    try:
        persist = persist_spec(job, checkpoint_dir) if keep_replica else None
        training = (lambda layout: training_spec(job, dtype or layout.grad_dtype, optimizer, lr)) \
            if keep_replica else None
    except SpecError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    foreign = check_root(job, persist)
    if foreign:
        click.echo(f"error: {foreign}", err=True)
        sys.exit(2)

    if job is not None and transport == "roce" and (nccl_version is None or job.ring.protocol == "auto"):
        try:  # what the job file leaves open (release, protocol per collective) is read from the wire
            job, nccl_version = _complete_from_wire(job, captures, nccl_version, dtype, not no_icrc)
        except InferenceError as e:
            click.echo(f"error: cannot reassemble: {e}", err=True)
            sys.exit(1)
    if keep_replica:
        import mirrorckpt.updater.appliance  # noqa: F401  (torch's import is not replay time)
    if SLOW_ICRC and not no_icrc and transport == "roce":
        click.echo(f"warning: {SLOW_ICRC}", err=True)
    t0 = time.perf_counter()
    shown = {"n": 0}

    def progress(i, replica):
        shown["n"] += 1
        if not (quiet or as_json):
            click.echo(f"  iteration {i} applied", err=True)

    try:
        js, results, iterations, app = run_summarized(captures, job, dtype, nccl_version, not no_icrc, training,
                                                      persist, progress, transport)
    except CaptureError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except InferenceError as e:
        click.echo(f"error: cannot reassemble: {e}", err=True)
        sys.exit(1)
    except SpecError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    summary = app.close().to_dict() if app is not None else None
    if summary is not None and persist is not None and not summary["checkpoints"]:
        from mirrorckpt.updater import ckptdir

        kept = ckptdir.read_pointer(persist.directory)  # e.g. a second run into the same directory
        summary["latest_kept"] = str(kept) if kept is not None else None
    secs = time.perf_counter() - t0
    ars = allreduce_report(results)
    rep = js.report()
    damage, nbytes = rep.damage, rep.bytes
    report = {
        "captures": list(captures),
        "notes": rep.notes,
        "placement": rep.placement,
        "mismatches": rep.mismatches,
        "allreduces": ars,
        "iterations": [{"index": it.index, "complete": it.complete,
                        "holes": {str(b): [list(h) for h in hs] for b, hs in it.holes.items()}}
                       for it in iterations],
        "replica": summary,
        "damage": damage,
        "seconds": round(secs, 3),
        "capture_bytes": nbytes,
    }
    if as_json:
        click.echo(json.dumps(report, indent=1))
    else:
        _print(report, ars, iterations, summary, secs, nbytes)
    for d in damage:
        click.echo(f"error: {d}", err=True)
    if damage:
        sys.exit(3)
    if persist is not None:
        _persistence_verdict(app, summary, persist, checkpoint_dir)


def _persistence_verdict(app, summary, persist, checkpoint_dir) -> None:
    """Say so when checkpoints were asked for and none or not all were written; exit 1 when the
    root was refused or a write failed."""
    stats = app.persister.stats if app is not None and app.persister is not None else None
    if stats is not None and stats.refused:
        click.echo(f"error: {stats.refused}", err=True)
        sys.exit(1)
    if stats is not None and stats.failed:
        click.echo(f"error: {stats.failed} checkpoint write(s) failed; last: {stats.last_error}", err=True)
        sys.exit(1)
    what = f"--checkpoint-dir {checkpoint_dir}" if checkpoint_dir else f"[persist] directory {persist.directory}"
    if app is None:
        click.echo(f"warning: {what} ignored: nothing to checkpoint (the capture holds no DDP job: no layout, "
                   "no initial weights; give --config with [job] and [training] for a plain all-reduce job)",
                   err=True)
    elif summary["no_initial_state"] and not summary["iterations_applied"]:
        click.echo(f"warning: {what}: nothing committed: the capture does not start with the job (no initial "
                   "weights broadcast on the wire to start the replica from)", err=True)


def _complete_from_wire(job, captures, nccl_version, dtype, icrc):
    """The job file with the NCCL release and the protocol of each collective shape taken from the
    captures' first sends (inference checks them against the job's own collective sequence)."""
    import dataclasses

    from mirrorckpt.parser.infer import infer_from_streams

    streams = MirrorStreams([(c, open_capture(c)) for c in captures], icrc=icrc, nccl_version=nccl_version)
    got = infer_from_streams(streams, dtype or job.grad_dtype, nccl_version, JobModel.from_job(job))
    ring = dataclasses.replace(job.ring, nccl_version=got.model.ring.nccl_version, protocol=got.model.ring.protocol)
    return dataclasses.replace(job, ring=ring, protocols=dict(got.model.protocols)), ring.nccl_version


def _print(report, ars, iterations, summary, secs, nbytes):
    for n in report["notes"]:
        click.echo(f"note: {n}")
    for m in report["mismatches"]:
        click.echo(f"mismatch: {m}")
    for a in ars:
        state = "complete" if a["complete"] else f"INCOMPLETE coverage {a['coverage']:.4f} holes {a['holes'][:4]}"
        extra = " (hole filled by a point-to-point send)" if a["filled_by_p2p"] else ""
        click.echo(f"all-reduce {a['index']} (iteration {a['iteration']}, bucket {a['bucket']}): "
                   f"{a['count']} x {a['dtype']} {state}{extra}")
    good = sum(it.complete for it in iterations)
    click.echo(f"{len(ars)} all-reduces, {good}/{len(iterations)} iterations complete")
    if summary is not None:
        click.echo(f"replica: {summary['iterations_applied']} iterations applied (optimizer step "
                   f"{summary['replica_step']}), {summary['iterations_incomplete']} incomplete, "
                   f"{summary['iterations_skipped']} skipped while stale"
                   + (", no initial state on the wire" if summary["no_initial_state"] else ""))
        last = summary["checkpoints"][-1] if summary["checkpoints"] else None
        kept = summary.get("latest_kept")
        click.echo(f"checkpoints: {len(summary['checkpoints'])} committed, latest {last}" if last or not kept else
                   f"checkpoints: 0 committed: {kept} was already there (a committed checkpoint is never "
                   "overwritten; use another --checkpoint-dir)")
    click.echo(f"throughput: {nbytes / 1e6:.1f} MB of capture in {secs:.2f} s "
               f"({nbytes / max(secs, 1e-9) / 1e6:.1f} MB/s)")
