"""`mirrorckpt doctor CAPTURE...`: what NCCL traffic the captures hold, and what to change when the
appliance cannot follow it.

It reports the NCCL release family (CTS layout, immediate byte order), the protocols and the
QPs (NCCL_IB_QPS_PER_CONNECTION) each connection carries, the connections (UDP ports) between
each pair of addresses, and whether the collectives run as one ring; then it tries the inference
``replay`` runs, and reports the Simple thread count it proved (512, or 256 on a PCI-limited ring),
or "not determinable" when the Simple collectives seen plan alike under both. Each thing the
appliance cannot follow is named with the NCCL setting that fixes it:

* collective traffic from one rank to several peers: Tree (or per-channel ring orders) -> NCCL_ALGO=Ring;
* only point-to-point sends (no collective connection): nothing to reassemble -> the gradients
  must go through an all-reduce (DDP's), not ncclSend/ncclRecv;
* a stated release the wire contradicts -> drop --nccl-version.
NVLS and user-buffer registration leave nothing the appliance can follow on the mirror (NVLS
stays inside the node; registered buffers change the message sizes): the advice for them
(NCCL_NVLS_ENABLE=0; NCCL_LOCAL_REGISTER=0 NCCL_GRAPH_REGISTER=0) is printed whenever the traffic
does not fit a ring. Exit codes: 0 the appliance can follow the job, 1 it cannot (the causes are
listed), 2 unreadable capture.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import click
from mirrorckpt.capture.batch import CaptureError
from mirrorckpt.capture.pcapfile import open_capture
from mirrorckpt.config.layout import address_text
from mirrorckpt.parser.errors import InferenceError
from mirrorckpt.parser.ringfind import _ringlike, sequences
from mirrorckpt.parser.streams import MirrorStreams

ADVICE_OTHER = ("if the job uses NVLS (NVSwitch systems) set NCCL_NVLS_ENABLE=0; with user-buffer registration "
                "(CUDA graphs, ncclCommRegister) set NCCL_LOCAL_REGISTER=0 NCCL_GRAPH_REGISTER=0")


def diagnose(captures, nccl_version=None, window: int = 20000) -> dict:
    from mirrorckpt.parser.infer import infer, wire_family

    streams = MirrorStreams([(c, open_capture(c)) for c in captures], nccl_version=nccl_version)
    sends = []
    causes: list[dict] = []
    try:
        for batch in streams:
            sends += batch
            if len(sends) >= window:
                break
        fam = wire_family(streams.decoders)
    except InferenceError as e:  # a stated release the wire contradicts
        return {"family": None, "causes": [{"cause": str(e), "fix": "drop --nccl-version (the release is read "
                                            "from the wire)"}], "connections": [], "inferred": None}
    seqs = sequences(sends)
    nqps = {k: n for d in streams.decoders for k, n in d.qps_by_connection().items()}
    conns, peers = [], defaultdict(set)
    pair_conns = defaultdict(set)
    for k, seq in seqs.items():
        protos = sorted({s.protocol for s in seq.values() if s.protocol and len(s.data)})
        ring = _ringlike(seq)
        conns.append({"key": k, "connection": str(k), "sends": len(seq), "qps": nqps.get(k, 1), "protocols": protos,
                      "kind": "collective" if ring else "point-to-point"})
        pair_conns[(k.sender, k.receiver)].add(k.sport)
        if ring:
            peers[k.sender].add(k.receiver)
    if seqs and not peers:
        causes.append({"cause": "only point-to-point sends (ncclSend/ncclRecv): no collective connection carries "
                                "data, so there are no all-reduce results to reassemble",
                       "fix": "all-reduce the gradients with a collective (DDP's bucket all-reduce); point-to-point "
                              "traffic can only fill holes of a ring all-reduce"})
    for a, bs in peers.items():
        if len(bs) > 1:
            causes.append({"cause": f"{address_text(a)} sends collective traffic to {len(bs)} peers "
                                    f"({', '.join(address_text(b) for b in sorted(bs))}): NCCL's Tree algorithm (or "
                                    "channels with different ring orders)",
                           "fix": "set NCCL_ALGO=Ring (2.24+: NCCL_ALGO=allreduce:ring); per-channel ring orders "
                                  "can be given in the job file ([ring] orders)"})
    inferred, notes = None, []
    if not causes:
        try:
            got = infer(sends, streams.decoders, None, nccl_version)
            inferred = {"ranks": got.model.ring.nranks, "channels": got.model.ring.nchannels,
                        "nccl_version": got.model.ring.nccl_version, "protocol": got.model.ring.protocol,
                        "simple_threads": got.simple_threads or got.threads_note.removeprefix("Simple threads: "),
                        "protocols": {f"{k[0]} {k[1]}x{k[2]}": p for k, p in sorted(got.model.protocols.items())}}
            notes = got.notes
            for c in conns:  # what the inferred ring left out is point-to-point
                if c["kind"] == "collective" and c["key"] not in got.channels:
                    c["kind"] = "point-to-point"
        except InferenceError as e:
            causes.append({"cause": str(e), "fix": "mirror the egress of two adjacent ranks from the job's start, "
                                                   "or give the job file (--config); " + ADVICE_OTHER})
    return {
        "family": fam.describe(), "cts_layout": fam.cts.name if fam.cts else None, "imm_order": fam.imm_order,
        "connections_per_pair": {f"{address_text(a)}->{address_text(b)}": len(v)
                                 for (a, b), v in sorted(pair_conns.items())},
        "qps_per_connection": sorted({c["qps"] for c in conns}),
        "algorithm": "ring" if peers and all(len(b) == 1 for b in peers.values()) else
                     ("not a ring" if peers else "none (no collective traffic)"),
        "connections": [{k: v for k, v in c.items() if k != "key"} for c in conns], "inferred": inferred, "notes": notes, "causes": causes,
    }


@click.command()
@click.argument("captures", nargs=-1, required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--nccl-version", default=None, help="Check the traffic against this NCCL release.")
@click.option("--json", "as_json", is_flag=True)
def doctor(captures, nccl_version, as_json):
    """What NCCL traffic CAPTURES hold and, for what the appliance cannot follow, the NCCL setting that fixes it."""
    try:
        rep = diagnose(list(captures), nccl_version)
    except CaptureError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    if as_json:
        click.echo(json.dumps(rep, indent=1))
    else:
        how = f" (CTS {rep.get('cts_layout')}, immediates {rep.get('imm_order') or 'undecided'})"
        click.echo(f"NCCL release: {rep['family']}" + (how if rep["family"] else ""))
        click.echo(f"algorithm: {rep.get('algorithm')}")
        for pair, n in rep.get("connections_per_pair", {}).items():
            click.echo(f"connections {pair}: {n}")
        if rep.get("qps_per_connection"):
            q = rep["qps_per_connection"]
            click.echo(f"QPs per connection: {', '.join(map(str, q))}" + (
                " ([[mirror]] workers > 1 keeps every message in one worker)" if q == [1] else
                " ([[mirror]] workers > 1: a capture file's split keeps a connection's QPs together; a "
                "live port's kernel split would part them and their messages come out incomplete: use "
                "workers = 1 there)"))
        for c in rep["connections"]:
            click.echo(f"connection {c['connection']}: {c['kind']}, {c['sends']} sends, {c['qps']} QP(s), "
                       f"protocols {', '.join(c['protocols']) or '-'}")
        if rep["inferred"]:
            i = rep["inferred"]
            click.echo(f"job: {i['ranks']} ranks, {i['channels']} channels, NCCL {i['nccl_version']} schedule, "
                       f"protocol {i['protocol']}")
            for k, p in i["protocols"].items():
                click.echo(f"  {k}: {p}")
            click.echo(f"Simple threads: {i['simple_threads']}")
        for n in rep.get("notes", []):
            click.echo(f"note: {n}")
        for c in rep["causes"]:
            click.echo(f"cannot follow: {c['cause']}\n  fix: {c['fix']}")
    sys.exit(1 if rep["causes"] else 0)
