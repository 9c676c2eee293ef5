"""`mirrorckpt inspect CAPTURE [--json]`: what a capture holds, layer by layer, and whether its
RoCE traffic is NCCL's.

The NCCL release is read from the wire (CTS layout, immediate byte order) as replay and doctor read
it; a stated ``--nccl-version`` the wire contradicts is an error. A WRITE is an NCCL send only
where its connection shows NCCL (``NcclDecoder._vouch``); RoCE traffic that shows none (an RDMA
application's WRITEs, READs, SENDs, atomics) gets the verdict "not NCCL".

Exit codes: 0 fine (NCCL or not); 1 no RoCEv2 traffic at all; 2 not a readable capture; 3 the
capture is damaged part-way (everything before the damage is reported); 4 the stated release
contradicts the wire.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

import click
from mirrorckpt.capture.batch import CaptureError
from mirrorckpt.capture.pcapfile import open_capture
from mirrorckpt.config.layout import address_text
from mirrorckpt.parser import encap
from mirrorckpt.parser.errors import VersionMismatch
from mirrorckpt.parser.roce import opcodes
from mirrorckpt.parser.roce.packet_path import PacketPath
from mirrorckpt.tools.cliutil import NcclVersion, fail
from mirrorckpt.tools.progress import Progress

OTHER_KINDS = {"read": "RDMA READ", "send": "SEND", "atomic": "atomic"}


def nccl_verdict(pp: PacketPath, nsends: int) -> dict:
    """Whether the RoCE traffic is NCCL's, and what showed it (or that nothing did)."""
    dec = pp.nccl
    fam = dec.family
    other = {}
    for name, n in pp.counters.by_opcode().items():
        op = opcodes.BY_NAME.get(name)
        if op is not None and op.kind in OTHER_KINDS:
            other[OTHER_KINDS[op.kind]] = other.get(OTHER_KINDS[op.kind], 0) + n
    nccl = bool(nsends or dec.cts_posts)
    if nccl:
        text = f"NCCL traffic: {fam.describe()} (" + ", ".join(
            f"{n} connection(s) by {why}" for why, n in sorted(dec.proofs.items())) + ")"
    else:
        shown = [f"{dec.not_nccl} WRITE message(s) that no NCCL connection claims" if dec.not_nccl else "",
                 ", ".join(f"{what} {n} packets" for what, n in sorted(other.items()))]
        text = ("not NCCL: no CTS post, no WRITE closed by an immediate equal to its length, no LL/LL128 line "
                "flags; " + ("; ".join(x for x in shown if x) or "no RDMA WRITE messages") +
                " (an RDMA application's traffic; NCCL's data path is RDMA WRITE only)")
    return {
        "nccl": nccl, "verdict": text, "release": fam.describe() if nccl else None,
        "cts_layout": fam.cts.name if fam.cts else None, "imm_order": fam.imm_order,
        "proofs": dict(dec.proofs), "not_nccl_writes": dec.not_nccl, "other_operations": other,
        "verbs_qps": [{"qp": f"{address_text(d)}/qp{q:#x}", "packets_left_out": n}
                      for (d, q), n in sorted(pp.verbs_qps.items())],
    }


def summarize(path: str, icrc: bool = True, nccl_version: str | None = None) -> tuple[dict, str | None]:
    """Runs the packet path over a capture; returns the report and the damage message, if any."""
    pp = PacketPath(icrc=icrc, nccl_version=nccl_version)
    msgs, sends, damage = [], [], None
    with open_capture(path) as reader, Progress("[inspect]", os.path.getsize(path) / 1e6, "MB") as bar:
        try:
            for batch in reader:
                m, s = pp.feed(batch)
                msgs += m
                sends += s
                bar.update(batch.nbytes / 1e6)
        except CaptureError as e:
            damage = str(e)
    m, s = pp.flush()
    msgs += m
    sends += s
    c = pp.counters
    roce_packets = sum(c.by_opcode().values())
    report = {
        "capture": str(path),
        "frames": c.frames,
        "truncated_frames": c.truncated_frames,
        "bytes": c.bytes,
        "roce": {
            "packets": roce_packets,
            "by_opcode": c.by_opcode(),
            "icrc_checked": icrc,
            "icrc_failed": c.icrc_failed,
            "icrc": dict(sorted(c.icrc.items())),
        },
        "other": {k: v for k, v in sorted(c.classes.items()) if v and not k.startswith("roce:")},
        "malformed": {k: v for k, v in sorted(c.malformed.items()) if v},
        "mirror": c.mirror.to_dict(),
        "qps": [dict(qp=str(q.key), **{k: v for k, v in vars(q.stats).items()})
                for q in pp.reassembler.qps.values()],
        "messages": [{
            "qp": str(x.qp), "psn": x.psn, "va": x.va, "bytes": len(x.data), "dlen": x.dlen,
            "imm": x.imm_raw, "complete": x.complete, "missing_bytes": x.missing_bytes,
        } for x in msgs],
        "cts_posts": pp.nccl.cts_posts,
        "sends": [{
            "connection": str(x.connection), "protocol": x.protocol, "ll_flag": x.flag,
            "seq": x.seq, "form": x.form, "size": x.size, "bytes": len(x.data),
            "wire_bytes": x.wire_bytes, "complete": x.complete,
            "missing_bytes": sum(n for _, n in x.holes), "sha256": x.sha256(),
        } for x in sends],
        "nccl": nccl_verdict(pp, len(sends)),
    }
    return report, damage


def render(r: dict) -> str:
    out = [f"{r['capture']}: {r['frames']} frames ({r['truncated_frames']} truncated), {r['bytes']} bytes"]
    ro = r["roce"]
    icrc = f"{ro['icrc_failed']} ICRC failures" if ro["icrc_checked"] else "ICRC not checked"
    out.append(f"RoCEv2: {ro['packets']} packets, {icrc}")
    for k, v in ro["by_opcode"].items():
        out.append(f"  {k:<36} {v}")
    if r["other"]:
        out.append("other traffic: " + ", ".join(f"{k} {v}" for k, v in r["other"].items()))
    if r["malformed"]:
        out.append("malformed: " + ", ".join(f"{k} {v}" for k, v in r["malformed"].items()))
    out += encap.lines(r["mirror"])
    out.append("QPs (data):")
    for q in r["qps"]:
        out.append(f"  {q['qp']} sport {q['sport']}: {q['packets']} packets, PSN {q['psn_first']}..{q['psn_last']}, "
                   f"MTU {q['pmtu']}, lost {q['lost_packets']}, dup {q['duplicates']}, "
                   f"reordered {q['reordered']}, {q['messages']} messages ({q['incomplete']} incomplete)")
    inc = [m for m in r["messages"] if not m["complete"]]
    out.append(f"RDMA messages: {len(r['messages'])} ({len(inc)} incomplete), CTS posts {r['cts_posts']}")
    for m in inc:
        out.append(f"  incomplete: {m['qp']} PSN {m['psn']}: {m['missing_bytes']} of {m['bytes']} bytes missing")
    by_conn = defaultdict(list)
    for s in r["sends"]:
        by_conn[s["connection"]].append(s)
    out.append(f"NCCL sends: {len(r['sends'])}")
    for conn, ss in by_conn.items():
        protos = sorted({s["protocol"] or "?" for s in ss})
        flags = [s["ll_flag"] for s in ss if s["ll_flag"] is not None]
        bad = sum(not s["complete"] for s in ss)
        fl = f", flags {min(flags)}..{max(flags)}" if flags else ""
        out.append(f"  {conn}: {len(ss)} sends ({'/'.join(protos)}{fl}), "
                   f"{sum(s['bytes'] for s in ss)} data bytes, {bad} incomplete")
    for q in r["nccl"]["verbs_qps"]:
        out.append(f"  {q['qp']}: SEND/READ/atomic requests, {q['packets_left_out']} packets left out of reassembly")
    if r["roce"]["packets"]:
        out.append(f"verdict: {r['nccl']['verdict']}")
    return "\n".join(out)


@click.command()
@click.argument("capture", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of the summary.")
@click.option("--no-icrc", is_flag=True, help="Skip the ICRC check (every packet is taken as intact).")
@click.option("--nccl-version", default=None, type=NcclVersion(),
              help="NCCL release that produced the traffic (read from the wire when absent; a stated one the wire "
                   "contradicts is an error).")
def inspect(capture, as_json, no_icrc, nccl_version):
    """Decode CAPTURE: frames, RoCE packets, QPs, RDMA messages and NCCL sends."""
    try:
        report, damage = summarize(capture, icrc=not no_icrc, nccl_version=nccl_version)
    except CaptureError as e:
        fail(str(e))
    except OSError as e:
        fail(f"{capture}: {e.strerror or e}")
    except VersionMismatch as e:
        fail(f"{capture}: {e}", 4)
    error, code = None, 0
    if damage:
        report["damage"] = damage
        error, code = f"{damage} (everything before it is reported above)", 3
    elif report["roce"]["packets"] == 0:
        error, code = f"{capture}: no RoCEv2 traffic (UDP port 4791) in {report['frames']} frames", 1
    if error and as_json:
        report["error"] = error
    click.echo(json.dumps(report, indent=1) if as_json else render(report))
    if encap.truncation_advice(report["mirror"]):
        click.echo(f"error: {capture}: {encap.truncation_advice(report['mirror'])}", err=True)
    if error:
        click.echo(f"error: {error}", err=True)
        sys.exit(code)
