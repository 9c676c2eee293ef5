"""`mirrorckpt replay [CAPTURE ...]`: mirror captures of one job through the whole pipeline.

Capture, parser, concatenator, CPU replica and persistence. Each file is a mirror stream (a file
holding both directions of a port counts as two streams: they are told apart by address).
Without ``--config`` the job is inferred from the traffic (ranks from CTS tags, channels, DDP
start-up or plain all-reduce sizes). With no CAPTURE at all, the bundled demo capture is
replayed with its configuration.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import click
from click.core import ParameterSource
from mirrorckpt.capture.batch import CaptureError
from mirrorckpt.capture.pcapfile import open_capture
from mirrorckpt.parser import encap, memory
from mirrorckpt.parser.concat import CollectiveResult
from mirrorckpt.parser.errors import InferenceError
from mirrorckpt.parser.iteration import ReducedIteration
from mirrorckpt.parser.roce import SLOW_ICRC
from mirrorckpt.parser.roce.collectives import NcclJobModel
from mirrorckpt.parser.roce.jobstream import JobStream
from mirrorckpt.parser.roce.streams import MirrorStreams
from mirrorckpt.tools.cliutil import NcclVersion, Number, check_nccl_version, fail, writable_dir
from mirrorckpt.tools.progress import Progress
from mirrorckpt.tools.wirefit import nothing_matched

DEMO = Path(__file__).resolve().parents[1] / "tests" / "pcaps" / "demo"
# Lists of sends the packet path's thread may hold ready (each a batch's: tens of MB at most). One:
# the packet path is the slower side on every protocol, so a second waited rarely, but when it did
# it raised the peak (2 GB Simple capture, 10 runs: peak RSS median 300 -> 285 MB, no change in speed).
READ_AHEAD = 1
SHOWN = 5  # incomplete all-reduces listed without --verbose (a long capture can have tens of thousands)


class Digests:
    """The report's sha256 of each complete all-reduce, on threads of their own: hashlib lets go of
    the GIL, so the hashes overlap the packet path instead of adding to it. One core hashes about
    1.4 GB/s (SHA-NI), and a two-rank Simple capture carries half its bytes again as results, so a
    single hashing thread bounded a replay near 2.8 GB/s wherever the other stages had cores to
    spare: all-reduces are hashed side by side, one thread per two cores past the first two
    (``workers``). At most ``depth`` results per thread wait, so a slow hash holds the pipeline back
    rather than keeping every bucket alive (on Simple with one thread, 8 waiting peaked a 2 GB
    capture some 15 MB higher, median of 4, than 2)."""

    def __init__(self, depth: int = 2, workers: int | None = None):
        self.workers = workers or self.default_workers()
        self.depth = depth * self.workers
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="sha256")
        self.waiting: deque[Future] = deque()

    @staticmethod
    def default_workers(cap: int = 4) -> int:
        """One hashing thread, and one more per two cores this process may run on past two."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(cap, 1 + (cores - 2) // 2))

    def submit(self, data) -> Future:
        while len(self.waiting) >= self.depth:
            self.waiting.popleft().result()
        while self.waiting and self.waiting[0].done():
            self.waiting.popleft()
        f = self.pool.submit(lambda: hashlib.sha256(data).hexdigest())
        self.waiting.append(f)
        return f

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def allreduce_entry(r: CollectiveResult, digests: Digests | None = None, hashed: bool = True) -> dict | None:
    """What the report says of one finished all-reduce (None for other collectives). With
    ``digests`` its sha256 is a Future until ``allreduce_report`` reads it; not ``hashed``: None."""
    if r.spec.kind != "allreduce":
        return None
    if not hashed:
        sha = None
    else:
        sha = digests.submit(r.data) if digests is not None and r.complete else r.sha256()
    return {"collective": r.index, "iteration": r.spec.iteration, "bucket": r.spec.bucket,
            "count": r.count, "dtype": r.spec.dtype, "coverage": round(r.coverage, 6), "complete": r.complete,
            "sha256": sha, "holes": [list(h) for h in r.holes],
            "filled_by_p2p": [list(h) for h in r.filled_by_p2p], "p2p_candidate": r.p2p_candidate,
            "conflicts": r.conflicts}


def allreduce_report(results) -> list[dict]:
    """``results``: finished collectives, or their ``allreduce_entry`` already taken."""
    out = []
    for r in results:
        e = allreduce_entry(r) if isinstance(r, CollectiveResult) else r
        if e is not None:
            out.append({"index": len(out), **e})
            if isinstance(e["sha256"], Future):
                out[-1]["sha256"] = e["sha256"].result()
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


def open_stream(captures, job=None, dtype=None, nccl_version=None, icrc=True, transport="roce", p2p_fill=False):
    """The job stream over capture files: NCCL over RoCEv2, or PyTorch DDP over gloo/TCP. ``p2p_fill``:
    the job declares that point-to-point sends carry all-reduce holes' values (Concatenator; or the job
    file, ``[job] p2p_fill``)."""
    if transport == "gloo":
        from mirrorckpt.parser.gloo.job import open_job_stream

        return open_job_stream(captures, job, dtype)
    # With a job file the packet path reads ahead on its own thread (MirrorStreams); inference reads
    # the decoders' state while it runs, so without one it stays on this thread.
    streams = MirrorStreams([(c, open_capture(c)) for c in captures], icrc=icrc, nccl_version=nccl_version,
                            ahead=READ_AHEAD if job is not None else 0,
                            encapsulation=job.encap if job is not None else None, blocks=True)
    kw = dict(model=NcclJobModel.from_job(job), ranks=job.ring.ranks_by_address()) if job is not None else {}
    p2p_fill = p2p_fill or (job is not None and job.p2p_fill)
    return JobStream(streams, dtype=dtype, nccl_version=nccl_version, p2p_fill=p2p_fill, **kw)


def run(captures, job=None, dtype=None, nccl_version=None, icrc=True, training=None,
        persist=None, progress=None, transport="roce", summarize=False, p2p_fill=False, pipelined=False,
        hashes=True):
    """The main job. ``training``: the replica's TrainingSpec, or a function of the layout; None
    keeps no replica. Returns (job stream, finished collectives, iterations, Appliance or None).
    ``summarize``: keep each all-reduce as its ``allreduce_entry`` and each iteration without its
    buckets, so replaying a capture of any length holds bounded memory (the CLI's report).
    ``hashes``: the summary's sha256 of each complete all-reduce (only ``--json`` shows them; on
    Simple they were a third of the CPU time)."""
    import dataclasses

    from mirrorckpt.updater.drive import drive

    js = open_stream(captures, job, dtype, nccl_version, icrc, transport, p2p_fill)
    app = None
    if training is not None:  # the replica (torch) only when one is kept
        from mirrorckpt.updater.appliance import Appliance

        app = Appliance(None, training, persist, on_iteration=progress, pipelined=pipelined)
    results, iterations = [], []
    digests = Digests() if summarize and hashes else None

    def keep(item):
        if isinstance(item, CollectiveResult):
            e = allreduce_entry(item, digests, hashes) if summarize else item
            if e is not None:
                results.append(e)
        elif isinstance(item, ReducedIteration):
            iterations.append(dataclasses.replace(item, buckets=[]) if summarize else item)

    try:
        drive(js, app, keep)
    except InferenceError as e:
        e.streams = js.streams.stats  # what the mirror showed is said with the refusal (replay)
        raise
    finally:
        if digests is not None:
            digests.close()
    return js, results, iterations, app


@click.command()
@click.argument("captures", nargs=-1, type=click.Path(dir_okay=False, exists=True))
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True),
              help="Job configuration (TOML); without it the job is inferred from the traffic.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16", "int32"]),
              help="Element type of the all-reduced data (inferred when absent).")
@click.option("--nccl-version", default=None, type=NcclVersion(),
              help="NCCL release (e.g. 2.23) if it must be stated; read from the wire when absent "
                   "(a stated release the wire contradicts is an error).")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False),
              help="Keep a CPU replica and commit checkpoints here.")
@click.option("--optimizer", type=click.Choice(["adam", "adamw", "sgd"]), default="adam", show_default=True,
              help="Replica optimizer when the configuration has no [training]: a replica is kept without "
                   "[training] only when --optimizer or --lr is stated.")
@click.option("--lr", type=Number(0), default=1e-3, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object with every all-reduce's verdict.")
@click.option("--verbose", is_flag=True, help=f"List every incomplete all-reduce (else the first {SHOWN}).")
@click.option("--no-icrc", is_flag=True, help="Skip the ICRC check.")
@click.option("--quiet", is_flag=True, help="No progress lines.")
@click.option("--transport", type=click.Choice(["roce", "gloo"]), default="roce", show_default=True,
              help="NCCL over RoCEv2, or PyTorch DDP over gloo/TCP.")
@click.option("--p2p-fill", is_flag=True,
              help="The workload sends each all-reduce's values its mirrors lack point to point (as the "
                   "iter_40000_p2p_iter10 capture's does): a send of exactly a finished all-reduce's one "
                   "remaining hole, after it, fills it. Off by default: nothing on the wire proves what a "
                   "point-to-point send carries, and a foreign one of that size would give wrong values. "
                   "A job file says it with [job] p2p_fill = true.")
@click.option("--pipelined/--no-pipelined", default=None,
              help="Step each bucket's parameters as soon as the bucket is final (overrides [updater] "
                   "pipelined; default off: see `serve --pipelined`).")
@click.pass_context
def replay(ctx, captures, config_path, dtype, nccl_version, checkpoint_dir, optimizer, lr, as_json, verbose,
           no_icrc, quiet, transport, p2p_fill, pipelined):
    """Replay mirror CAPTURES of one job: reassemble every all-reduce, keep the replica, commit checkpoints.

    With no CAPTURE, the bundled demo capture is replayed into ./mirrorckpt-demo. Exit status: 0
    done (incomplete all-reduces are listed), 1 nothing reassembled or a checkpoint write failed
    (the reason is said), 2 bad input, 3 a capture damaged part-way."""
    from mirrorckpt.config.training import SpecError

    if not captures and not config_path:
        if not (DEMO / "job.toml").is_file():
            fail(f"the bundled demo capture is missing ({DEMO}); regenerate it with `make pcaps`")
        config_path = str(DEMO / "job.toml")
        checkpoint_dir = checkpoint_dir or "mirrorckpt-demo"
    job = _load_job(config_path) if config_path else None
    if job is not None:
        nccl_version = nccl_version or job.ring.nccl_version
        if any(m.workers > 1 for m in job.mirrors) and not quiet:  # said, not silently ignored
            click.echo("note: [[mirror]] workers is serve's: replay decodes each capture on one thread "
                       "(use `mirrorckpt serve` to split a port over several processes)", err=True)
        if not captures:  # the job file lists its capture files as mirror sources
            captures = tuple(m.source for m in job.mirrors if not m.live)
    if not captures:
        fail("no capture to replay: give CAPTURE files, or a --config whose [[mirror]] sources are capture files")
    keep_replica = checkpoint_dir is not None or (job is not None and bool(job.persist))
    persist = training = None
    if keep_replica:
        stated = {p for p in ("optimizer", "lr") if ctx.get_parameter_source(p) != ParameterSource.DEFAULT}
        _say_optimizer(job, optimizer, lr, stated, checkpoint_dir)
        try:
            persist = persist_spec(job, checkpoint_dir)
        except SpecError as e:
            fail(str(e))
        training = lambda layout: training_spec(job, dtype or layout.grad_dtype, optimizer, lr)  # noqa: E731
        writable_dir(persist.directory, "--checkpoint-dir" if checkpoint_dir else "[persist] directory")
        if job is not None:  # another job's root: said before anything is written
            from mirrorckpt.updater import ckptdir

            foreign = ckptdir.foreign_root(persist.directory, job.layout, job.name)
            if foreign:
                fail(foreign)

    if job is not None and transport == "roce" and (nccl_version is None or job.ring.protocol == "auto"):
        try:  # what the job file leaves open (release, protocol per collective) is read from the wire
            job, nccl_version = _complete_from_wire(job, captures, nccl_version, dtype, not no_icrc)
        except InferenceError as e:
            _mirror_verdict(getattr(e, "streams", []), quiet=True)
            fail(f"cannot reassemble: {e}", 1)
    if SLOW_ICRC and not no_icrc and transport == "roce":
        click.echo(f"warning: {SLOW_ICRC}", err=True)
    t_imports = time.perf_counter()
    if keep_replica:  # the replica's imports are not replay time; its first optimizer imports torch's compiler
        import mirrorckpt.updater.appliance  # noqa: F401
        import torch
        from mirrorckpt.config.jobfile import default_updater_threads

        # the packet path: the capture reader thread and the consumer
        torch.set_num_threads(job.updater_threads(2) if job is not None else default_updater_threads(2))
        torch.optim.Adam([torch.zeros(1, requires_grad=True)], foreach=False)
    memory.freeze_startup_heap()
    t0 = time.perf_counter()
    bar = Progress("[replay]", unit="iterations applied", tick=0.5, enabled=False if quiet else None)
    applied = []  # when each iteration was applied (perf_counter)

    def progress(i, replica):
        applied.append(time.perf_counter())
        bar.update(1, note=f"step {replica.step}")
        if not (quiet or bar.enabled) and applied[-1] - shown["at"] >= 5.0:  # a log, not a terminal
            shown["at"] = applied[-1]
            click.echo(f"[replay] {len(applied)} iterations applied, {applied[-1] - t0:.0f} s", err=True)

    shown = {"at": t0}
    try:
        with bar:
            js, results, iterations, app = run(captures, job, dtype, nccl_version, not no_icrc, training, persist,
                                               progress, transport, summarize=True, p2p_fill=p2p_fill,
                                               pipelined=(job is not None and job.pipelined) if pipelined is None
                                               else pipelined, hashes=as_json)
    except CaptureError as e:
        fail(str(e))
    except InferenceError as e:
        _mirror_verdict(getattr(e, "streams", []), quiet=True)
        fail(f"cannot reassemble: {e}", 1)
    except SpecError as e:
        fail(str(e))
    t_parsed = time.perf_counter()
    summary = app.close().to_dict() if app is not None else None
    if summary is not None and persist is not None and not summary["checkpoints"]:
        from mirrorckpt.updater import ckptdir

        kept = ckptdir.read_pointer(persist.directory)  # e.g. a second run into the same directory
        summary["latest_kept"] = str(kept) if kept is not None else None
    secs = time.perf_counter() - t0
    ars = allreduce_report(results)
    rep = js.report()
    nbytes = rep.bytes
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
        "mirror": {st.source: st.mirror.to_dict() for st in rep.streams if st.mirror is not None},
        "damage": rep.damage,
        "seconds": round(secs, 3),
        "capture_bytes": nbytes,
        "timing": timing(t0, applied, t_parsed, t0 + secs, nbytes, len(iterations)) | {"imports_s": t0 - t_imports},
    }
    warnings, error, code = [], None, 0
    if rep.damage:
        error, code = "; ".join(rep.damage), 3
    else:
        named_by = "the job file" if job is not None else "the job read from the wire"
        error = nothing_matched(rep, len(ars), named_by)
        code = 1 if error else 0
    if error is None and persist is not None:
        error, warnings = _persistence_verdict(app, summary, persist, checkpoint_dir)
        code = 1 if error else 0
    if error is not None:
        report["error"] = error
    if as_json:
        click.echo(json.dumps(report, indent=1))
    else:
        _print(report, ars, iterations, summary, secs, nbytes, verbose)
        _print_timing(report["timing"])
    for w in warnings:
        click.echo(f"warning: {w}", err=True)
    _mirror_verdict(rep.streams, quiet=as_json)
    for line in (rep.damage or [error]) if error else []:
        click.echo(f"error: {line}", err=True)
    sys.exit(code)


def _mirror_verdict(streams, quiet: bool) -> None:
    """Per capture, what its mirror encapsulation showed (unless ``quiet``: the JSON has it), and
    on stderr, whatever the output, loss measured by the mirror's sequence numbers and truncation
    by the switch: a truncated mirror can never be followed."""
    for st in streams:
        h = st.mirror
        if h is None:
            continue
        if not quiet:
            for line in h.lines():
                click.echo(f"{st.source}: {line}")
        if h.lost:
            click.echo(f"warning: {st.source}: the mirror lost {h.lost} frames between the switch and this capture "
                       "(gaps in its GRE sequence numbers): the iterations they carried are incomplete", err=True)
        advice = encap.truncation_advice(h)
        if advice:
            click.echo(f"error: {st.source}: {advice}", err=True)


def _load_job(config_path):
    from mirrorckpt.config.jobfile import ConfigError, load_job

    try:
        job = load_job(config_path)
        if job.kind == "ddp" and job.layout is None:
            raise ConfigError(f"{config_path}: replay needs the layout ([[job.params]] in [job]); "
                              "without --config it is inferred from the traffic")
        encap.check(job.encap)
    except ConfigError as e:
        fail(str(e))
    check_nccl_version(job.ring.nccl_version, f"{config_path}: [ring] nccl_version")
    return job


def _say_optimizer(job, optimizer, lr, stated, checkpoint_dir) -> None:
    """The replica steps with the trainer's optimizer: a job file's [training], or one stated on the
    command line (said as an assumption); never the options' defaults unasked. A guessed optimizer
    would commit checkpoints that look valid and restore another job's state."""
    if job is not None and job.training:
        if stated:
            click.echo(f"note: {', '.join('--' + p for p in sorted(stated))} ignored: the job file's [training] "
                       "names the replica's optimizer", err=True)
        return
    where = f"--checkpoint-dir {checkpoint_dir}" if checkpoint_dir else "[persist] directory"
    if not stated:
        fail(f"{where}: the replica needs the trainer's optimizer and the job names none: give --config with a "
             "[training] table (as `mirrorckpt gen` writes it), or state --optimizer and --lr (then the replica "
             "steps with exactly that)")
    click.echo(f"warning: the replica steps with {optimizer} at lr {lr:g} (torch's defaults otherwise), as stated "
               "on the command line, not read from the trainer: its checkpoints are the trainer's state only if "
               "the job trains with exactly this optimizer", err=True)


def _persistence_verdict(app, summary, persist, checkpoint_dir) -> tuple[str | None, list[str]]:
    """(error, warnings) when checkpoints were asked for: an error when the root was refused or a
    write failed, a warning when none or not all could be written."""
    stats = app.persister.stats if app is not None and app.persister is not None else None
    if stats is not None and stats.refused:
        return stats.refused, []
    if stats is not None and stats.failed:
        return f"{stats.failed} checkpoint write(s) failed; last: {stats.last_error}", []
    what = f"--checkpoint-dir {checkpoint_dir}" if checkpoint_dir else f"[persist] directory {persist.directory}"
    if app is None:
        return None, [f"{what} ignored: nothing to checkpoint (the capture holds no DDP job: no layout, no initial "
                      "weights; give --config with [job] and [training] for a plain all-reduce job)"]
    if summary["no_initial_state"] and not summary["iterations_applied"]:
        return None, [f"{what}: nothing committed: the capture does not start with the job (no initial weights "
                      "broadcast on the wire to start the replica from)"]
    return None, []


def _complete_from_wire(job, captures, nccl_version, dtype, icrc):
    """The job file with the NCCL release and the protocol of each collective shape taken from the
    captures' first sends (inference checks them against the job's own collective sequence)."""
    import dataclasses

    from mirrorckpt.parser.roce.infer import infer_from_streams

    streams = MirrorStreams([(c, open_capture(c)) for c in captures], icrc=icrc, nccl_version=nccl_version,
                            encapsulation=job.encap)
    # the file's addresses and ring orders place ranks the mirrored links alone do not
    try:
        got = infer_from_streams(streams, dtype or job.grad_dtype, nccl_version, NcclJobModel.from_job(job),
                                 known=job.ring if job.ring.addresses else None)
    except InferenceError as e:
        e.streams = streams.stats
        raise
    ring = dataclasses.replace(job.ring, nccl_version=got.model.ring.nccl_version, protocol=got.model.ring.protocol,
                               nthreads=got.model.ring.nthreads)
    return dataclasses.replace(job, ring=ring, protocols=dict(got.model.protocols)), ring.nccl_version


def timing(t0: float, applied: list[float], t_parsed: float, t_end: float, nbytes: int, iterations: int) -> dict:
    """Where a replay's time went: start-up (opening, inference, the replica, up to the first
    iteration applied), the pipeline's steady state (first to last iteration applied) and the
    background checkpoint writes finished at close. The steady state's bytes are estimated as the
    capture's bytes per iteration (averaged over the whole capture, start-up traffic included)."""
    out = {"total_s": t_end - t0, "parse_s": t_parsed - t0, "close_s": t_end - t_parsed}
    if len(applied) >= 2:
        steady = applied[-1] - applied[0]
        n = len(applied) - 1
        out |= {"start_up_s": applied[0] - t0, "steady_s": steady, "steady_iterations": n,
                "iterations_per_s": n / steady if steady > 0 else None,
                "steady_MBps_estimated": (nbytes / max(iterations, 1)) * n / steady / 1e6 if steady > 0 else None}
    return out


def _print_timing(t: dict) -> None:
    if t.get("iterations_per_s"):
        click.echo(f"pipeline after start-up ({t['start_up_s']:.2f} s to the first iteration applied): "
                   f"{t['steady_iterations']} iterations in {t['steady_s']:.2f} s, {t['iterations_per_s']:.3g} "
                   f"iterations/s, about {t['steady_MBps_estimated']:.1f} MB/s of capture; checkpoint writes "
                   f"took {t['close_s']:.2f} s more at the end")


def _print(report, ars, iterations, summary, secs, nbytes, verbose=False):
    for n in report["notes"]:
        click.echo(f"note: {n}")
    for m in report["mismatches"]:
        click.echo(f"mismatch: {m}")
    incomplete = [a for a in ars if not a["complete"]]
    for a in incomplete if verbose else incomplete[:SHOWN]:
        click.echo(f"incomplete: all-reduce {a['index']} (iteration {a['iteration']}, bucket {a['bucket']}): "
                   f"{a['count']} x {a['dtype']}, coverage {a['coverage']:.4f}, holes {a['holes'][:4]}"
                   + (f" and {len(a['holes']) - 4} more" if len(a["holes"]) > 4 else ""))
    if len(incomplete) > SHOWN and not verbose:
        click.echo(f"incomplete: {len(incomplete) - SHOWN} more (--verbose lists them, --json gives every verdict)")
    filled = sum(bool(a["filled_by_p2p"]) for a in ars)
    good = sum(it.complete for it in iterations)
    click.echo(f"{len(ars)} all-reduces ({len(ars) - len(incomplete)} complete, {len(incomplete)} incomplete"
               + (f", {filled} with a hole filled by a point-to-point send" if filled else "")
               + f"), {good}/{len(iterations)} iterations complete")
    hinted = sum(bool(a.get("p2p_candidate")) for a in ars)
    if hinted:
        click.echo(f"note: {hinted} incomplete all-reduce(s) have their one hole followed, before the next "
                   "collective, by exactly one point-to-point send of its size; nothing proves what such a send "
                   "carries, so it is not used. If the job's own workload sends those values (as the "
                   "iter_40000_p2p_iter10 capture's does), replay with --p2p-fill ([job] p2p_fill = true)")
    if summary is not None:
        click.echo(f"replica: {summary['iterations_applied']} iterations applied (optimizer step "
                   f"{summary['replica_step']}), {summary['iterations_incomplete']} incomplete, "
                   f"{summary['iterations_skipped']} skipped while stale"
                   + (", no initial state on the wire" if summary["no_initial_state"] else ""))
        last = summary["checkpoints"][-1] if summary["checkpoints"] else None
        kept = summary.get("latest_kept")
        click.echo(f"checkpoints: {len(summary['checkpoints'])} committed, latest {last}" if last else
                   "checkpoints: 0 committed" if not kept else
                   f"checkpoints: 0 committed: {kept} was already there (a committed checkpoint is never "
                   "overwritten; use another --checkpoint-dir)")
    click.echo(f"throughput: {nbytes / 1e6:.1f} MB of capture in {secs:.2f} s "
               f"({nbytes / max(secs, 1e-9) / 1e6:.1f} MB/s; imports before it not counted)")
