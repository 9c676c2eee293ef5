"""`mirrorckpt replay [CAPTURE ...]`: mirror captures of one job through the whole pipeline.

Each file is a mirror stream (a file holding both directions of a port counts as two streams:
the directions are told apart by address). Without ``--config`` the job is inferred from the
traffic (ranks from CTS tags, channels, DDP start-up or plain all-reduce sizes).
"""

from __future__ import annotations

import json
import sys
import time

import click

from mirrorckpt.capture.batch import CaptureError
from mirrorckpt.capture.pcapfile import open_capture
from mirrorckpt.parser.infer import InferenceError
from mirrorckpt.parser.pipeline import JobStream
from mirrorckpt.parser.streams import MirrorStreams


def allreduce_report(results) -> list[dict]:
    out = []
    for r in results:
        if r.spec.kind != "allreduce":
            continue
        out.append({
            "index": len(out), "collective": r.index, "iteration": r.spec.iteration, "bucket": r.spec.bucket,
            "count": r.count, "dtype": r.spec.dtype, "coverage": round(r.coverage, 6), "complete": r.complete,
            "sha256": r.sha256(), "holes": [list(h) for h in r.holes],
            "filled_by_p2p": [list(h) for h in r.filled_by_p2p], "conflicts": r.conflicts,
        })
    return out


def run_parser(captures, dtype, nccl_version, icrc=True, job=None):
    """Decode and reassemble; returns (JobStream, results, iterations)."""
    sources = [(c, open_capture(c)) for c in captures]
    streams = MirrorStreams(sources, icrc=icrc, nccl_version=nccl_version)
    kw = {}
    if job is not None:
        kw = dict(model=job.model(), ranks=job.ranks(), channels=None)
    js = JobStream(streams, dtype=dtype, nccl_version=nccl_version, **kw)
    results, iterations = [], []
    for done, its in js:
        results += done
        iterations += its
    return js, results, iterations


@click.command()
@click.argument("captures", nargs=-1, type=click.Path(dir_okay=False, exists=True))
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True),
              help="Job configuration (TOML); without it the job is inferred from the traffic.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16", "int32"]),
              help="Element type of the all-reduced data (inferred when absent).")
@click.option("--nccl-version", default="2.18", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object with every all-reduce's verdict.")
@click.option("--no-icrc", is_flag=True, help="Skip the ICRC check.")
def replay(captures, config_path, dtype, nccl_version, as_json, no_icrc):
    """Replay mirror CAPTURES of one job: reassemble every all-reduce and report it."""
    job = None
    if config_path:
        from mirrorckpt.config.jobfile import ConfigError, load_job

        try:
            job = load_job(config_path)
        except ConfigError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        nccl_version = job.ring.nccl_version
    if not captures:
        click.echo("error: give at least one capture", err=True)
        sys.exit(2)
    t0 = time.perf_counter()
    try:
        js, results, iterations = run_parser(captures, dtype, nccl_version, not no_icrc, job)
    except CaptureError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except InferenceError as e:
        click.echo(f"error: cannot reassemble: {e}", err=True)
        sys.exit(1)
    secs = time.perf_counter() - t0
    ars = allreduce_report(results)
    damage = [s.damage for s in js.streams.stats if s.damage]
    report = {
        "captures": list(captures),
        "notes": js.notes,
        "placement": dict(js.reassembly.sm.counts) if js.reassembly else {},
        "mismatches": js.reassembly.sm.mismatches if js.reassembly else [],
        "allreduces": ars,
        "iterations": [{"index": it.index, "complete": it.complete,
                        "holes": {str(b): [list(h) for h in hs] for b, hs in it.holes.items()}}
                       for it in iterations],
        "damage": damage,
        "seconds": round(secs, 3),
    }
    if as_json:
        click.echo(json.dumps(report, indent=1))
    else:
        for n in js.notes:
            click.echo(f"note: {n}")
        for a in ars:
            state = "complete" if a["complete"] else f"INCOMPLETE coverage {a['coverage']:.4f} holes {a['holes'][:4]}"
            extra = " (hole filled by a point-to-point send)" if a["filled_by_p2p"] else ""
            click.echo(f"all-reduce {a['index']} (iteration {a['iteration']}, bucket {a['bucket']}): "
                       f"{a['count']} x {a['dtype']} {state}{extra}")
        good = sum(it.complete for it in iterations)
        click.echo(f"{len(ars)} all-reduces, {good}/{len(iterations)} iterations complete, {secs:.2f} s")
    for d in damage:
        click.echo(f"error: {d}", err=True)
    if damage:
        sys.exit(3)
