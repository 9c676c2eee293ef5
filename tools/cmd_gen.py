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


@click.command()
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--ranks", default=2, show_default=True, type=click.IntRange(2, 16))
@click.option("--channels", default=1, show_default=True, type=click.IntRange(1, 32), help="Communicator channels.")
@click.option("--protocol", default="LL", show_default=True, type=click.Choice(["LL", "LL128", "Simple", "auto"]),
              help="NCCL_PROTO, or auto: per collective by NCCL's tuning model (its default).")
@click.option("--nccl-version", default="2.18", show_default=True, type=NcclVersion())
@click.option("--nthreads", type=click.IntRange(32),
              help="Simple thread count, maxThreads[RING][Simple] (NCCL_NTHREADS, or 256 on a PCI-limited ring); "
                   "LL and LL128 keep their defaults.")
@click.option("--ring-orders", help="Ring order per channel from rank 0, e.g. '0,1,2;0,2,1' (default: 0..R-1).")
@click.option("--mtu", default=1024, show_default=True, type=click.Choice(["256", "512", "1024", "2048", "4096"]))
@click.option("--ipv6/--ipv4", default=True, show_default=True, help="RoCEv2 over IPv6 (link-local) or IPv4.")
@click.option("--grad-dtype", default="float32", show_default=True,
              type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--bucket-cap-mb", type=Number(0, min_open=True),
              help="DDP bucket_cap_mb (default: DDP's 25 MiB, 1 MiB first bucket).")
@click.option("--model", default="linear:5000", show_default=True, help="linear:N, mlp:IN,H,...,OUT or "
              "gpt:layers=L,d=D,heads=H,vocab=V,ctx=C.")
@click.option("--steps", default=10, show_default=True, type=click.IntRange(1))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--batch-size", default=4, show_default=True, type=click.IntRange(1))
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1), help="torch intra-op threads.")
@click.option("--optimizer", default="adamw", show_default=True, type=click.Choice(["adam", "adamw", "sgd"]))
@click.option("--lr", default=1e-3, show_default=True, type=Number())
@click.option("--betas", default="0.9,0.999", show_default=True)
@click.option("--eps", default=1e-8, show_default=True, type=Number())
@click.option("--weight-decay", default=0.0, show_default=True, type=Number())
@click.option("--momentum", default=0.0, show_default=True, type=Number())
@click.option("--dampening", default=0.0, show_default=True, type=Number())
@click.option("--nesterov", is_flag=True)
@click.option("--amsgrad", is_flag=True)
@click.option("--maximize", is_flag=True)
@click.option("--foreach", is_flag=True, help="Optimizer foreach implementation.")
@click.option("--lr-schedule", default="none", show_default=True, help="torch.optim.lr_scheduler class or none.")
@click.option("--lr-schedule-kwargs", default="{}", show_default=True, help="Its arguments as JSON.")
@click.option("--clip", "clip_norm", type=Number(), help="clip_grad_norm_ max_norm.")
@click.option("--clip-norm-type", default=2.0, show_default=True, type=Number(0, min_open=True, inf_ok=True))
@click.option("--loss-scale", type=Number(0, min_open=True),
              help="float16: initial loss scale (default 65536).")
@click.option("--growth-interval", type=click.IntRange(1), help="float16: good steps before the scale grows.")
@click.option("--force-overflow-at", type=click.IntRange(0),
              help="float16: put an inf into this 0-based iteration's gradient.")
@click.option("--mirror", "mirror", default="0:egress,1:egress", show_default=True,
              help="Ports and directions to capture: RANK:egress|ingress|both, comma-separated.")
@click.option("--format", "fmt", default="pcapng", show_default=True, type=click.Choice(["pcapng", "pcap"]))
@click.option("--adaptive-routing/--no-adaptive-routing", default=None,
              help="Split WRITE form above the AR threshold (default: NCCL's for the version on RoCE).")
@click.option("--ar-threshold", default=nv.AR_THRESHOLD_DEFAULT, show_default=True, type=click.IntRange(0))
@click.option("--write-only-train", is_flag=True, help="Split form as one WRITE ONLY per packet (NIC behaviour).")
@click.option("--psn-start", default="zero", show_default=True, type=click.Choice(["zero", "random", "wrap"]),
              help="Initial PSNs: NCCL's 0, random, or just below 2^24 (wrap-around early).")
@click.option("--qps-per-connection", default=1, show_default=True, type=int,
              help="NCCL_IB_QPS_PER_CONNECTION: QPs per connection.")
@click.option("--split-data-on-qps/--no-split-data-on-qps", default=None,
              help="NCCL_IB_SPLIT_DATA_ON_QPS: cut each message over the QPs (default: yes up to 2.19, no from 2.20).")
@click.option("--speed-update", is_flag=True, help="NCCL 2.31+ with NCCL_IB_EVENT_BASED_LB=1: each receiver writes "
              "its port speeds (32 bytes, no immediate) to the sender after its first CTS post.")
@click.option("--line-rate-gbps", default=100.0, show_default=True, type=Number(0, min_open=True))
@click.option("--p2p-fill", is_flag=True, help="After each gradient all-reduce, rank 0 sends its next rank the "
              "final values its egress lacks, point to point (as the iter_40000_p2p_iter10 capture does).")
@click.option("--algorithm", default="ring", show_default=True,
              type=click.Choice(["ring", "tree", "pat", "nvls", "collnet"]),
              help="What NCCL runs besides the ring: tree (gradient all-reduces by NCCL's double binary tree), pat "
              "(all-gathers to log-distance peers, one rank per node), nvls (gradient all-reduces inside the node: "
              "nothing on the network), collnet (gradient all-reduces through an in-network aggregation node). The "
              "appliance follows only the ring; `doctor` names the others.")
@click.option("--p2p-send", "p2p_send", default="", help="After each gradient all-reduce, point-to-point sends "
              "of values foreign to it (Simple, on each pair's own connection): SRC>DST:BYTES, comma-separated, "
              "e.g. '0>1:4096,1>0:8192'.")
@click.option("--noise", default="", help="Background traffic: comma-separated arp,ptp,tcp,probes,vendor or all.")
@click.option("--noise-rate", default=2000.0, show_default=True, type=Number(0),
              help="Events/s per kind and direction.")
@click.option("--loss", default=0.0, type=Number(), help="Fault rate per RC frame of a capture file.")
@click.option("--reorder", default=0.0, type=Number())
@click.option("--duplicate", default=0.0, type=Number())
@click.option("--corrupt", default=0.0, type=Number())
@click.option("--truncate", default=0.0, type=Number())
@click.option("--message-loss", default=0.0, type=Number(),
              help="Rate per RDMA WRITE message of losing all its frames.")
@click.option("--fault-seed", default=0, show_default=True, type=int)
@click.option("--no-send-truth", is_flag=True, help="Leave the per-send records out of truth.json (big runs).")
@click.option("--encap", default="none", show_default=True,
              help="Wrap every mirrored frame as a remote mirror does: none, erspan1, erspan2, erspan3, gre "
                   "(gretap), gretap (with checksum, key and sequence number), vxlan, or vendor:PROTOCOL:BYTES "
                   "(a GRE protocol and its fixed header, e.g. vendor:0x8949:22 for SONiC on Spectrum).")
@click.option("--outer-vlan", help="VLAN ids on the encapsulation's underlay, outermost first (e.g. 100 or "
              "100,200; 0: a priority-only tag).")
@click.option("--inner-vlan", help="VLAN ids put into the mirrored frames themselves (as --outer-vlan).")
@click.option("--underlay", default="ipv4", show_default=True, type=click.Choice(["ipv4", "ipv6"]),
              help="IP version of the encapsulation's outer header.")
@click.option("--erspan-platform", is_flag=True, help="erspan3: the O flag and an 8-byte platform sub-header.")
@click.option("--mirror-mtu", type=click.IntRange(14), help="Cut every mirrored frame to this many bytes, as a "
              "mirror session's MTU does (ERSPAN sets its truncated bit).")
@click.option("--vxlan-port", default=4789, show_default=True, type=click.IntRange(1, 65535))
@click.option("--sharded", type=click.Choice(["hsdp", "zero", "fsdp"]),
              help="A sharded-optimizer job (tools.generator.sharded_wire): FSDP2 HSDP (--ranks replicas x "
                   "--shard-size shards), DeepSpeed ZeRO-2 (--ranks DP ranks) or pure FSDP (--shard-size ranks, "
                   "weights only); one job.toml of [[ring]] tables.")
@click.option("--shard-size", default=2, show_default=True, type=click.IntRange(2, 16),
              help="--sharded hsdp/fsdp: ranks of each FSDP2 shard group.")
def gen(out_dir, ranks, channels, protocol, nccl_version, nthreads, ring_orders, mtu, ipv6, grad_dtype,
        bucket_cap_mb, model, steps, seed, batch_size, threads, optimizer, lr, betas, eps, weight_decay, momentum,
        dampening, nesterov, amsgrad, maximize, foreach, lr_schedule, lr_schedule_kwargs, clip_norm,
        clip_norm_type, loss_scale, growth_interval, force_overflow_at, mirror, fmt, adaptive_routing,
        ar_threshold, write_only_train, psn_start, qps_per_connection, split_data_on_qps, speed_update,
        line_rate_gbps, p2p_fill, algorithm, p2p_send, noise, noise_rate, loss, reorder,
        duplicate, corrupt, truncate, message_loss, fault_seed, no_send_truth, encap, outer_vlan, inner_vlan, underlay,
        erspan_platform, mirror_mtu, vxlan_port, sharded, shard_size):
    """Generate the NCCL ring all-reduce RoCEv2 traffic of a training job into --out."""
    from mirrorckpt.config.training import (
        ClipSpec,
        LossScaleSpec,
        OptimizerSpec,
        SpecError,
        TrainingSpec,
    )
    from mirrorckpt.tools.generator import noise as noise_mod
    from mirrorckpt.tools.generator.encap import EncapOptions, parse_tags
    from mirrorckpt.tools.generator.faults import FaultOptions
    from mirrorckpt.tools.generator.gen import JOB_FILE, GenConfig, generate
    from mirrorckpt.tools.generator.wire import WireOptions

    writable_dir(out_dir, "--out")
    try:
        ls = None
        if grad_dtype == "float16":
            d = {}
            if loss_scale is not None:
                d["init_scale"] = loss_scale
            if growth_interval is not None:
                d["growth_interval"] = growth_interval
            ls = LossScaleSpec(**d)
        training = TrainingSpec(
            optimizer=OptimizerSpec(name=optimizer, lr=lr, betas=_floats(betas, 2, "--betas"), eps=eps,
                                    weight_decay=weight_decay, momentum=momentum, dampening=dampening,
                                    nesterov=nesterov, amsgrad=amsgrad, maximize=maximize, foreach=foreach),
            lr_schedule=_schedule(lr_schedule, lr_schedule_kwargs),
            clip=ClipSpec(clip_norm, clip_norm_type) if clip_norm is not None else None,
            loss_scale=ls, grad_dtype=grad_dtype)
        kinds = set(noise_mod.KINDS) if noise.strip() == "all" else {k.strip() for k in noise.split(",") if k.strip()}
        wire = WireOptions(pmtu=int(mtu), ipv6=ipv6, adaptive_routing=adaptive_routing, ar_threshold=ar_threshold,
                           write_only_train=write_only_train, initial_psn=psn_start, line_rate_gbps=line_rate_gbps,
                           qps_per_connection=qps_per_connection, split_data_on_qps=split_data_on_qps,
                           speed_update=speed_update)
        if sharded:
            _sharded(sharded, out_dir, ranks, shard_size, channels, protocol, nccl_version, model, steps, seed,
                     batch_size, threads, training, fmt, wire,
                     {"--mirror": mirror != "0:egress,1:egress", "--noise": bool(kinds), "--p2p-fill": p2p_fill,
                      "--loss/--reorder/--duplicate/--corrupt/--truncate/--message-loss":
                          any((loss, reorder, duplicate, corrupt, truncate, message_loss)),
                      "--ring-orders": bool(ring_orders), "--nthreads": nthreads is not None,
                      "--bucket-cap-mb": bucket_cap_mb is not None,
                      "--force-overflow-at": force_overflow_at is not None})
            return
        cfg = GenConfig(
            ranks=ranks, channels=channels, protocol=protocol, nccl_version=nccl_version, nthreads=nthreads,
            ring_orders=_orders(ring_orders, ranks, channels), model=model, steps=steps, seed=seed,
            batch_size=batch_size,
            bucket_cap_mb=bucket_cap_mb, training=training, threads=threads, force_overflow_at=force_overflow_at,
            mirrors=mirror, fmt=fmt, wire=wire,
            noise=noise_mod.NoiseOptions(frozenset(kinds), noise_rate, seed),
            faults=FaultOptions(loss, duplicate, reorder, corrupt, truncate, fault_seed, message_loss),
            p2p_fill=p2p_fill, p2p_noise=_p2p_sends(p2p_send), algorithm=algorithm, send_truth=not no_send_truth,
            encap=EncapOptions(kind=encap, outer_vlan=parse_tags(outer_vlan), inner_vlan=parse_tags(inner_vlan),
                               ipv6=underlay == "ipv6", platform=erspan_platform, mirror_mtu=mirror_mtu,
                               vxlan_port=vxlan_port))
        with Progress("[gen]", total=steps, unit="iterations", tick=0.5) as bar:
            truth = generate(cfg, out_dir, on_step=bar.set)
    except (ValueError, SpecError, json.JSONDecodeError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    w = truth["wire"]
    for c in w["captures"]:
        click.echo(f"{out_dir}/{c['file']}: {c['frames']} frames (rank {c['rank']} {c['direction']})")
    click.echo(f"{len(truth['collectives'])} collectives, {len(truth['iterations'])} iterations, "
               f"{len(w['faults'])} faults; truth.json and job.toml in {out_dir}")
    click.echo(f"replay it: mirrorckpt replay --config {shlex.quote(str(Path(out_dir) / JOB_FILE))}")


def _sharded(scheme, out_dir, ranks, shard_size, channels, protocol, nccl_version, model, steps, seed, batch_size,
             threads, training, fmt, wire, unmodelled: dict) -> None:
    """``gen --sharded``: every rank of a sharded job on one wire (tools.generator.sharded_wire)."""
    from mirrorckpt.tools.generator.sharded_wire import ShardedWireConfig, generate_sharded_wire

    given = [opt for opt, on in unmodelled.items() if on]
    if given:
        raise ValueError(f"--sharded does not generate {', '.join(given)}: its mirrors are the first two ranks' "
                         "egress of every followed ring, on a clean wire")
    job = generate_sharded_wire(ShardedWireConfig(scheme=scheme, ranks=ranks, shard=shard_size, model=model,
                                                  steps=steps, seed=seed, batch_size=batch_size, channels=channels,
                                                  protocol=protocol, nccl_version=nccl_version, training=training,
                                                  fmt=fmt, wire=wire, threads=threads), out_dir)
    for name, c in job.comms.items():
        click.echo(f"{name}: ranks {c.members}, {len(c.records)} collectives")
    click.echo(f"{len(job.layout.groups)} shard(s) of {job.layout.scheme}; shards.json, job.toml and truth.json in "
               f"{out_dir}")
