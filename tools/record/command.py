"""`mirrorckpt record --out DIR ...`: record real NCCL (or gloo) traffic of a DDP-shaped job with its truth.

Exit status: 0 every all-reduce replayed equal to truth; 1 the replay differs, is incomplete or
could not run, or the recording failed; 2 the machine lacks something (each thing named) or the
options are wrong. ``--check`` prints what the machine has and lacks and exits 0 only when the
chosen backend and transport can record.
"""

from __future__ import annotations

import sys

import click
from mirrorckpt.tools.cliutil import Number

KNOBS = {  # option -> NCCL variable (docs/record.md)
    "proto": "NCCL_PROTO", "qps": "NCCL_IB_QPS_PER_CONNECTION", "split_data_on_qps": "NCCL_IB_SPLIT_DATA_ON_QPS",
    "gid_index": "NCCL_IB_GID_INDEX",
}


def _env_pairs(pairs: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep or not key.startswith(("NCCL_", "GLOO_")):
            raise click.BadParameter(f"expected NCCL_NAME=VALUE (or GLOO_...), got {p!r}", param_hint="--env")
        out[key] = value
    return out


# options that mean something to NCCL only: given with --backend gloo they are refused
NCCL_ONLY = ("transport", "nccl_lib", "rdma_debs", "gpu", "proto", "algo", "qps", "split_data_on_qps", "channels",
             "gid_index")


def _algo(text: str) -> str:
    """NCCL_ALGO's syntax: [^]NAME[,NAME...], or from 2.24 COLLECTIVE:[^]LIST;... per collective."""
    from mirrorckpt.parser.roce.nccl_versions import ALGO_NAMES

    known = {n.lower() for n in ALGO_NAMES}
    for part in text.split(";"):
        names = part.split(":", 1)[-1].lstrip("^").split(",")
        if not all(n.strip().lower() in known for n in names):
            raise click.BadParameter(f"{text!r}: expected NCCL algorithm names ({', '.join(ALGO_NAMES)}), "
                                     "comma-separated, '^' to exclude", param_hint="--algo")
    return text


def _gpu(text: str) -> str:
    if not (text.isdigit() or text.startswith(("GPU-", "MIG-"))):
        raise click.BadParameter(f"{text!r}: expected one GPU's index or UUID (GPU-..., MIG-...)", param_hint="--gpu")
    return text


def _given_for_nccl_only(ctx: click.Context, env_pairs) -> list[str]:
    from click.core import ParameterSource

    given = [f"--{n.replace('_', '-')}" for n in NCCL_ONLY if ctx.get_parameter_source(n) != ParameterSource.DEFAULT]
    return given + [f"--env {p}" for p in env_pairs if p.startswith("NCCL_")]


@click.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False), help="Capture folder to create (must be empty).")
@click.option("--check", is_flag=True, help="Print what this machine has and lacks for recording, and exit.")
@click.option("--backend", type=click.Choice(["nccl", "gloo"]), default="nccl", show_default=True,
              help="nccl: a libnccl.so.2 on the GPU; gloo: torch's gloo on the CPU (the CPU tests' stand-in).")
@click.option("--ranks", type=click.IntRange(2, 4), default=2, show_default=True)
@click.option("--transport", type=click.Choice(["roce", "socket", "auto"]), default="auto", show_default=True,
              help="NCCL's net transport: Soft-RoCE (rdma_rxe on each rank's veth), NCCL_NET=Socket (TCP), or "
                   "RoCE when the machine has all it needs, else sockets.")
@click.option("--nccl-lib", type=click.Path(dir_okay=False), help="libnccl.so.2 to record (default: torch's).")
@click.option("--rdma-debs", type=click.Path(file_okay=False),
              help="Folder of Debian packages the image lacks (libibverbs1, ibverbs-providers, libnl-3-200, "
                   "libnl-route-3-200, iproute2, tcpdump ...), or their unpacked tree; used from there, not installed.")
@click.option("--gpu", default="0", show_default=True, help="CUDA_VISIBLE_DEVICES of every rank (one GPU).")
@click.option("--proto", type=click.Choice(["LL", "LL128", "Simple"]), help="NCCL_PROTO (default: NCCL's choice).")
@click.option("--algo", default="Ring", show_default=True, help="NCCL_ALGO (the decoder follows Ring).")
@click.option("--qps", type=click.IntRange(1, 128), help="NCCL_IB_QPS_PER_CONNECTION.")
@click.option("--split-data-on-qps", type=click.Choice(["0", "1"]), help="NCCL_IB_SPLIT_DATA_ON_QPS.")
@click.option("--channels", type=click.IntRange(1, 64), help="NCCL_MIN_NCHANNELS = NCCL_MAX_NCHANNELS.")
@click.option("--gid-index", type=click.IntRange(0, 255),
              help="NCCL_IB_GID_INDEX (default: the rxe device's RoCE v2 IPv4 GID).")
@click.option("--env", "env_pairs", multiple=True, help="Any NCCL_NAME=VALUE for every rank (repeatable).")
@click.option("--model", default="mlp:16,64,96,384", show_default=True,
              help="Generator model spec (linear:N, mlp:IN,H,...,OUT, gpt:...).")
@click.option("--steps", type=click.IntRange(2), default=3, show_default=True,
              help="Iterations (the second rebuilds DDP's buckets).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--bucket-cap-mb", type=Number(0, min_open=True), default=0.01, show_default=True,
              help="DDP bucket_cap_mb.")
@click.option("--batch-size", type=click.IntRange(1), default=4, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--mtu", type=click.IntRange(576, 9216), default=1500, show_default=True,
              help="veth MTU (Soft-RoCE's path MTU follows).")
@click.option("--subnet", type=click.IntRange(0, 255), help="Ranks at 10.SUBNET.0.R+1 (default: from the process id).")
@click.option("--ingress/--no-ingress", default=True, show_default=True,
              help="Also capture what each rank receives (the same frames as another rank's egress).")
@click.option("--max-mb", type=Number(0, min_open=True), default=16.0, show_default=True,
              help="Refuse captures larger than this.")
@click.option("--timeout", type=Number(0, min_open=True), default=180.0, show_default=True,
              help="Seconds the ranks may take.")
@click.option("--replay/--no-replay", default=True, show_default=True, help="Run the replay check at the end.")
def record(out_dir, check, backend, ranks, transport, nccl_lib, rdma_debs, gpu, proto, algo, qps, split_data_on_qps,
           channels, gid_index, env_pairs, model, steps, dtype, bucket_cap_mb, batch_size, seed, mtu, subnet, ingress,
           max_mb, timeout, replay):
    """Record a DDP-shaped job's NCCL traffic (R ranks on one GPU, one network namespace each) with tcpdump,
    write truth.json from the ranks, and check that replay gives every all-reduce equal to it."""
    from pathlib import Path

    from mirrorckpt.tools.record import machine
    from mirrorckpt.tools.record.recorder import RecordError, RecordOptions
    from mirrorckpt.tools.record.recorder import record as run_record
    from mirrorckpt.tools.testbed.netns import TopologyError

    _gpu(gpu)
    _algo(algo)
    nccl_env = _env_pairs(env_pairs)
    if backend == "gloo" and (given := _given_for_nccl_only(click.get_current_context(), env_pairs)):
        raise click.UsageError(f"{', '.join(given)}: NCCL's only, not used by --backend gloo")
    try:
        from mirrorckpt.tools.generator.models import parse_spec

        parse_spec(model)
    except ValueError as e:
        raise click.BadParameter(f"{model!r}: {e}", param_hint="--model") from None
    try:
        if check:
            sys.exit(_check(backend, transport, nccl_lib, rdma_debs))
        if not out_dir:
            raise click.UsageError("--out DIR is needed (or --check)")
        for name, value in (("proto", proto), ("qps", qps), ("split_data_on_qps", split_data_on_qps),
                            ("gid_index", gid_index)):
            if value is not None:
                nccl_env[KNOBS[name]] = str(value)
        if channels is not None:
            nccl_env.update(NCCL_MIN_NCHANNELS=str(channels), NCCL_MAX_NCHANNELS=str(channels))
        opts = RecordOptions(out=Path(out_dir), backend=backend, ranks=ranks, transport=transport, nccl_lib=nccl_lib,
                             rdma_debs=rdma_debs, gpu=gpu, algo=algo, nccl_env=nccl_env, model=model, steps=steps,
                             dtype=dtype, bucket_cap_mb=bucket_cap_mb, batch_size=batch_size, seed=seed, mtu=mtu,
                             subnet=subnet, ingress=ingress, max_mb=max_mb, timeout=timeout, replay=replay)
        rec = run_record(opts, say=lambda m: click.echo(m, err=True))
    except machine.MachineError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except (RecordError, TopologyError, ValueError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    caps = ", ".join(f"{n} {s / 1e6:.2f} MB" for n, s in rec.truth["record"]["captures"].items())
    click.echo(f"{rec.folder}: {len(rec.truth['collectives'])} collectives recorded ({rec.transport}); {caps}")
    if rec.verdict is None:
        click.echo("replay check skipped (--no-replay)")
        return
    click.echo(rec.verdict.text())
    if not rec.verdict.ok:
        sys.exit(1)


def _check(backend: str, transport: str, nccl_lib, rdma_debs) -> int:
    from mirrorckpt.tools.record import machine

    probes, _ = machine.probe_all(nccl_lib, machine.Carried(rdma_debs), gpu=backend == "nccl")
    for p in probes:
        click.echo(p.line())
    chosen = "tcp" if backend == "gloo" else machine.choose_transport(transport, probes)
    lacking = machine.missing(probes, backend, chosen)
    what = f"{backend}" + (f" over {chosen}" if backend == "nccl" else "")
    if lacking:
        click.echo(f"cannot record {what}: missing {', '.join(p.name for p in lacking)}")
        return 2
    click.echo(f"can record {what}")
    return 0
