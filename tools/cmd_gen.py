"""`mirrorckpt gen --out DIR ...`: NCCL ring traffic of a real training job, as mirror captures.

R ranks train a built-in model in one process (tools.generator.train); every collective DDP issues
goes over a simulated NCCL ring on RoCEv2 (tools.generator.packetize), and the mirrored ports are
written as pcapng/pcap with truth.json and job.toml next to them (tools.generator.gen); it ends with
the command that replays them. A terminal shows its progress per iteration trained.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click
from mirrorckpt.parser.roce import nccl_versions as nv
from mirrorckpt.tools.cliutil import NcclVersion, Number, writable_dir
from mirrorckpt.tools.progress import Progress


def _floats(text: str, n: int, name: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise click.BadParameter(f"expected {n} comma-separated numbers, got {text!r}", param_hint=name) from None
    if len(vals) != n:
        raise click.BadParameter(f"expected {n} comma-separated numbers, got {text!r}", param_hint=name)
    return vals


def _p2p_sends(text: str) -> tuple[tuple[int, int, int], ...]:
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        try:
            pair, nbytes = item.split(":")
            src, dst = pair.split(">")
            out.append((int(src), int(dst), int(nbytes)))
        except ValueError:
            raise click.BadParameter(f"expected SRC>DST:BYTES, got {item!r}", param_hint="--p2p-send") from None
    return tuple(out)


def _orders(text: str | None, ranks: int, channels: int) -> list[list[int]] | None:
    if not text:
        return None
    from mirrorckpt.tools.generator.gen import GenConfig

    try:
        orders = [[int(x) for x in o.split(",")] for o in text.split(";")]
    except ValueError:
        raise click.BadParameter(f"expected 'a,b,c;a,c,b' (one ring order per channel), got {text!r}",
                                 param_hint="--ring-orders") from None
    try:  # the ring's own checks, on this ring
        GenConfig(ranks=ranks, channels=channels, ring_orders=orders).ring()
    except ValueError as e:
        raise click.BadParameter(f"{text!r}: {e}", param_hint="--ring-orders") from None
    return orders


def _schedule(name: str, kwargs_text: str):
    from mirrorckpt.config.training import LRScheduleSpec, SpecError

    try:
        kwargs = json.loads(kwargs_text)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"{kwargs_text!r} is not JSON ({e})", param_hint="--lr-schedule-kwargs") from None
    if not isinstance(kwargs, dict):
        raise click.BadParameter(f"{kwargs_text!r}: expected a JSON object of the scheduler's arguments",
                                 param_hint="--lr-schedule-kwargs")
    try:
        return LRScheduleSpec(name, kwargs)
    except SpecError as e:
        raise click.BadParameter(str(e), param_hint="--lr-schedule/--lr-schedule-kwargs") from None


def options(*groups):
    """Apply groups of click options in the order listed (click applies decorators bottom-up)."""
    def apply(f):
        for opt in reversed([o for g in groups for o in g]):
            f = opt(f)
        return f
    return apply


# the communicator: ranks, channels, protocol, release, and what NCCL runs besides the ring
JOB_OPTIONS = [
    click.option("--ranks", default=2, show_default=True, type=click.IntRange(2, 16)),
    click.option("--channels", default=1, show_default=True, type=click.IntRange(1, 32), help="Communicator channels."),
    click.option("--protocol", default="LL", show_default=True, type=click.Choice(["LL", "LL128", "Simple", "auto"]),
                 help="NCCL_PROTO, or auto: per collective by NCCL's tuning model (its default)."),
    click.option("--nccl-version", default="2.18", show_default=True, type=NcclVersion()),
    click.option("--nthreads", type=click.IntRange(32),
                 help="Simple thread count, maxThreads[RING][Simple] (NCCL_NTHREADS, or 256 on a PCI-limited ring); "
                       "LL and LL128 keep their defaults."),
    click.option("--ring-orders", help="Ring order per channel from rank 0, e.g. '0,1,2;0,2,1' (default: 0..R-1)."),
    click.option("--algorithm", default="ring", show_default=True,
                 type=click.Choice(["ring", "tree", "pat", "nvls", "collnet"]),
                 help="What NCCL runs besides the ring: tree (gradient all-reduces by NCCL's double binary tree), pat "
                 "(all-gathers to log-distance peers, one rank per node), nvls (gradient all-reduces inside the node: "
                 "nothing on the network), collnet (gradient all-reduces through an in-network aggregation node). The "
                 "appliance follows only the ring; `doctor` names the others."),
    click.option("--sharded", type=click.Choice(["hsdp", "zero", "fsdp"]),
                 help="A sharded-optimizer job (tools.generator.sharded_wire): FSDP2 HSDP (--ranks replicas x "
                       "--shard-size shards), DeepSpeed ZeRO-2 (--ranks DP ranks) or pure FSDP (--shard-size ranks, "
                       "weights only); one job.toml of [[ring]] tables."),
    click.option("--shard-size", default=2, show_default=True, type=click.IntRange(2, 16),
                 help="--sharded hsdp/fsdp: ranks of each FSDP2 shard group."),
]

# the model and its DDP buckets
MODEL_OPTIONS = [
    click.option("--model", default="linear:5000", show_default=True, help="linear:N, mlp:IN,H,...,OUT or "
                 "gpt:layers=L,d=D,heads=H,vocab=V,ctx=C."),
    click.option("--steps", default=10, show_default=True, type=click.IntRange(1)),
    click.option("--seed", default=0, show_default=True, type=int),
    click.option("--batch-size", default=4, show_default=True, type=click.IntRange(1)),
    click.option("--threads", default=1, show_default=True, type=click.IntRange(1), help="torch intra-op threads."),
    click.option("--grad-dtype", default="float32", show_default=True,
                 type=click.Choice(["float32", "bfloat16", "float16"])),
    click.option("--bucket-cap-mb", type=Number(0, min_open=True),
                 help="DDP bucket_cap_mb (default: DDP's 25 MiB, 1 MiB first bucket)."),
]

# the optimizer step the replica must reproduce
TRAINING_OPTIONS = [
    click.option("--optimizer", default="adamw", show_default=True, type=click.Choice(["adam", "adamw", "sgd"])),
    click.option("--lr", default=1e-3, show_default=True, type=Number()),
    click.option("--betas", default="0.9,0.999", show_default=True),
    click.option("--eps", default=1e-8, show_default=True, type=Number()),
    click.option("--weight-decay", default=0.0, show_default=True, type=Number()),
    click.option("--momentum", default=0.0, show_default=True, type=Number()),
    click.option("--dampening", default=0.0, show_default=True, type=Number()),
    click.option("--nesterov", is_flag=True),
    click.option("--amsgrad", is_flag=True),
    click.option("--maximize", is_flag=True),
    click.option("--foreach", is_flag=True, help="Optimizer foreach implementation."),
    click.option("--lr-schedule", default="none", show_default=True, help="torch.optim.lr_scheduler class or none."),
    click.option("--lr-schedule-kwargs", default="{}", show_default=True, help="Its arguments as JSON."),
    click.option("--clip", "clip_norm", type=Number(), help="clip_grad_norm_ max_norm."),
    click.option("--clip-norm-type", default=2.0, show_default=True, type=Number(0, min_open=True, inf_ok=True)),
    click.option("--loss-scale", type=Number(0, min_open=True),
                 help="float16: initial loss scale (default 65536)."),
    click.option("--growth-interval", type=click.IntRange(1), help="float16: good steps before the scale grows."),
    click.option("--force-overflow-at", type=click.IntRange(0),
                 help="float16: put an inf into this 0-based iteration's gradient."),
]

# RoCE and NCCL's network settings
WIRE_OPTIONS = [
    click.option("--mtu", default=1024, show_default=True, type=click.Choice(["256", "512", "1024", "2048", "4096"])),
    click.option("--ipv6/--ipv4", default=True, show_default=True, help="RoCEv2 over IPv6 (link-local) or IPv4."),
    click.option("--adaptive-routing/--no-adaptive-routing", default=None,
                 help="Split WRITE form above the AR threshold (default: NCCL's for the version on RoCE)."),
    click.option("--ar-threshold", default=nv.AR_THRESHOLD_DEFAULT, show_default=True, type=click.IntRange(0)),
    click.option("--write-only-train", is_flag=True, help="Split form as one WRITE ONLY per packet (NIC behaviour)."),
    click.option("--psn-start", default="zero", show_default=True, type=click.Choice(["zero", "random", "wrap"]),
                 help="Initial PSNs: NCCL's 0, random, or just below 2^24 (wrap-around early)."),
    click.option("--qps-per-connection", default=1, show_default=True, type=int,
                 help="NCCL_IB_QPS_PER_CONNECTION: QPs per connection."),
    click.option("--split-data-on-qps/--no-split-data-on-qps", default=None,
                 help="NCCL_IB_SPLIT_DATA_ON_QPS: cut each message over the QPs (default: yes up to 2.19, "
                 "no from 2.20)."),
    click.option("--speed-update", is_flag=True, help="NCCL 2.31+ with NCCL_IB_EVENT_BASED_LB=1: each receiver writes "
                 "its port speeds (32 bytes, no immediate) to the sender after its first CTS post."),
    click.option("--line-rate-gbps", default=100.0, show_default=True, type=Number(0, min_open=True)),
]

# what the mirror delivers and how it is written
MIRROR_OPTIONS = [
    click.option("--mirror", "mirror", default="0:egress,1:egress", show_default=True,
                 help="Ports and directions to capture: RANK:egress|ingress|both, comma-separated."),
    click.option("--format", "fmt", default="pcapng", show_default=True, type=click.Choice(["pcapng", "pcap"])),
    click.option("--encap", default="none", show_default=True,
                 help="Wrap every mirrored frame as a remote mirror does: none, erspan1, erspan2, erspan3, gre "
                       "(gretap), gretap (with checksum, key and sequence number), vxlan, or vendor:PROTOCOL:BYTES "
                       "(a GRE protocol and its fixed header, e.g. vendor:0x8949:22 for SONiC on Spectrum)."),
    click.option("--outer-vlan", help="VLAN ids on the encapsulation's underlay, outermost first (e.g. 100 or "
                 "100,200; 0: a priority-only tag)."),
    click.option("--inner-vlan", help="VLAN ids put into the mirrored frames themselves (as --outer-vlan)."),
    click.option("--underlay", default="ipv4", show_default=True, type=click.Choice(["ipv4", "ipv6"]),
                 help="IP version of the encapsulation's outer header."),
    click.option("--erspan-platform", is_flag=True, help="erspan3: the O flag and an 8-byte platform sub-header."),
    click.option("--mirror-mtu", type=click.IntRange(14), help="Cut every mirrored frame to this many bytes, as a "
                 "mirror session's MTU does (ERSPAN sets its truncated bit)."),
    click.option("--vxlan-port", default=4789, show_default=True, type=click.IntRange(1, 65535)),
    click.option("--no-send-truth", is_flag=True, help="Leave the per-send records out of truth.json (big runs)."),
]

# other traffic on the mirrored ports
TRAFFIC_OPTIONS = [
    click.option("--p2p-fill", is_flag=True, help="After each gradient all-reduce, rank 0 sends its next rank the "
                 "final values its egress lacks, point to point (as the iter_40000_p2p_iter10 capture does)."),
    click.option("--p2p-send", "p2p_send", default="", help="After each gradient all-reduce, point-to-point sends "
                 "of values foreign to it (Simple, on each pair's own connection): SRC>DST:BYTES, comma-separated, "
                 "e.g. '0>1:4096,1>0:8192'."),
    click.option("--noise", default="", help="Background traffic: comma-separated arp,ptp,tcp,probes,vendor or all."),
    click.option("--noise-rate", default=2000.0, show_default=True, type=Number(0),
                 help="Events/s per kind and direction."),
]

# faults of the mirror, per capture file
FAULTS_OPTIONS = [
    click.option("--loss", default=0.0, type=Number(), help="Fault rate per RC frame of a capture file."),
    click.option("--reorder", default=0.0, type=Number()),
    click.option("--duplicate", default=0.0, type=Number()),
    click.option("--corrupt", default=0.0, type=Number()),
    click.option("--truncate", default=0.0, type=Number()),
    click.option("--message-loss", default=0.0, type=Number(),
                 help="Rate per RDMA WRITE message of losing all its frames."),
    click.option("--fault-seed", default=0, show_default=True, type=int),
]


@click.command()
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output directory.")
@options(JOB_OPTIONS, MODEL_OPTIONS, TRAINING_OPTIONS, WIRE_OPTIONS, MIRROR_OPTIONS, TRAFFIC_OPTIONS, FAULTS_OPTIONS)
def gen(out_dir, **o):
    """Generate the NCCL ring all-reduce RoCEv2 traffic of a training job into --out."""
    from mirrorckpt.config.training import SpecError
    from mirrorckpt.tools.generator.gen import JOB_FILE, generate

    writable_dir(out_dir, "--out")
    try:
        training, wire = _training(o), _wire(o)
        if o["sharded"]:
            _sharded(out_dir, o, training, wire)
            return
        with Progress("[gen]", total=o["steps"], unit="iterations", tick=0.5) as bar:
            truth = generate(_config(o, training, wire), out_dir, on_step=bar.set)
    except (ValueError, SpecError, json.JSONDecodeError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    w = truth["wire"]
    for c in w["captures"]:
        click.echo(f"{out_dir}/{c['file']}: {c['frames']} frames (rank {c['rank']} {c['direction']})")
    click.echo(f"{len(truth['collectives'])} collectives, {len(truth['iterations'])} iterations, "
               f"{len(w['faults'])} faults; truth.json and job.toml in {out_dir}")
    click.echo(f"replay it: mirrorckpt replay --config {shlex.quote(str(Path(out_dir) / JOB_FILE))}")


def _training(o: dict):
    from mirrorckpt.config.training import ClipSpec, LossScaleSpec, OptimizerSpec, TrainingSpec

    loss_scale = None
    if o["grad_dtype"] == "float16":
        given = {"init_scale": o["loss_scale"], "growth_interval": o["growth_interval"]}
        loss_scale = LossScaleSpec(**{k: v for k, v in given.items() if v is not None})
    optimizer = OptimizerSpec(name=o["optimizer"], lr=o["lr"], betas=_floats(o["betas"], 2, "--betas"), eps=o["eps"],
                              **{k: o[k] for k in ("weight_decay", "momentum", "dampening", "nesterov", "amsgrad",
                                                   "maximize", "foreach")})
    return TrainingSpec(optimizer=optimizer, lr_schedule=_schedule(o["lr_schedule"], o["lr_schedule_kwargs"]),
                        clip=ClipSpec(o["clip_norm"], o["clip_norm_type"]) if o["clip_norm"] is not None else None,
                        loss_scale=loss_scale, grad_dtype=o["grad_dtype"])


def _wire(o: dict):
    from mirrorckpt.tools.generator.wire import WireOptions

    return WireOptions(pmtu=int(o["mtu"]), initial_psn=o["psn_start"],
                       **{k: o[k] for k in ("ipv6", "adaptive_routing", "ar_threshold", "write_only_train",
                                            "line_rate_gbps", "qps_per_connection", "split_data_on_qps",
                                            "speed_update")})


def _config(o: dict, training, wire):
    from mirrorckpt.tools.generator import noise
    from mirrorckpt.tools.generator.encap import EncapOptions, parse_tags
    from mirrorckpt.tools.generator.faults import FaultOptions
    from mirrorckpt.tools.generator.gen import GenConfig

    kinds = set(noise.KINDS) if o["noise"].strip() == "all" else {k.strip() for k in o["noise"].split(",") if k.strip()}
    encap = EncapOptions(kind=o["encap"], outer_vlan=parse_tags(o["outer_vlan"]),
                         inner_vlan=parse_tags(o["inner_vlan"]), ipv6=o["underlay"] == "ipv6",
                         platform=o["erspan_platform"], mirror_mtu=o["mirror_mtu"], vxlan_port=o["vxlan_port"])
    faults = FaultOptions(o["loss"], o["duplicate"], o["reorder"], o["corrupt"], o["truncate"], o["fault_seed"],
                          o["message_loss"])
    return GenConfig(
        **{k: o[k] for k in ("ranks", "channels", "protocol", "nccl_version", "nthreads", "model", "steps", "seed",
                             "batch_size", "bucket_cap_mb", "threads", "force_overflow_at", "p2p_fill",
                             "algorithm")},
        ring_orders=_orders(o["ring_orders"], o["ranks"], o["channels"]), training=training, mirrors=o["mirror"],
        fmt=o["fmt"], wire=wire, noise=noise.NoiseOptions(frozenset(kinds), o["noise_rate"], o["seed"]),
        faults=faults, p2p_noise=_p2p_sends(o["p2p_send"]), send_truth=not o["no_send_truth"], encap=encap)


def _names(group) -> set[str]:
    return {p.name for p in click.command()(options(group)(lambda **_: None)).params}


# what --sharded generates (its own communicators and mirrors, on a clean wire): any other option given is refused
SHARDED_MODELS = ({"ranks", "channels", "protocol", "nccl_version", "sharded", "shard_size", "fmt", "out_dir"}
                  | _names(MODEL_OPTIONS) | _names(TRAINING_OPTIONS) | _names(WIRE_OPTIONS)) \
    - {"bucket_cap_mb", "force_overflow_at"}


def _sharded(out_dir, o: dict, training, wire) -> None:
    """``gen --sharded``: every rank of a sharded job on one wire (tools.generator.sharded_wire)."""
    from click.core import ParameterSource
    from mirrorckpt.tools.generator.gen import JOB_FILE
    from mirrorckpt.tools.generator.sharded_wire import ShardedWireConfig, generate_sharded_wire

    ctx = click.get_current_context()
    given = [p.opts[0] for p in ctx.command.params
             if p.name not in SHARDED_MODELS and ctx.get_parameter_source(p.name) != ParameterSource.DEFAULT]
    if given:
        raise ValueError(f"--sharded does not generate {', '.join(given)}: its mirrors are the first two ranks' "
                         "egress of every followed ring, on a clean wire")
    job = generate_sharded_wire(ShardedWireConfig(
        scheme=o["sharded"], ranks=o["ranks"], shard=o["shard_size"], training=training, wire=wire,
        **{k: o[k] for k in ("model", "steps", "seed", "batch_size", "channels", "protocol", "nccl_version", "fmt",
                             "threads")}), out_dir)
    for name, c in job.comms.items():
        click.echo(f"{name}: ranks {c.members}, {len(c.records)} collectives")
    click.echo(f"{len(job.layout.groups)} shard(s) of {job.layout.scheme}; shards.json, job.toml and truth.json in "
               f"{out_dir}")
    click.echo(f"serve it: mirrorckpt serve --config {shlex.quote(str(Path(out_dir) / JOB_FILE))} (a [persist] "
               "table keeps its joint checkpoints)")
