"""`mirrorckpt doctor CAPTURE...`: can the appliance follow the job these captures show, and what to
change when it cannot.

It leads with a verdict: **followable** (the inference `replay` runs finds a ring job), **not
followable** (each cause named, with the NCCL setting that brings the ring back and what that
costs), or **not NCCL** (RoCE traffic in which no connection shows NCCL: an RDMA application's
WRITEs, READs, SENDs, atomics). Then what it read: the NCCL release family (CTS layout, immediate
byte order), the connections per address pair with their protocols, QPs and kind (collective or
point-to-point, as the inferred ring has them), the inferred job and its Simple thread count.

Causes it names (parser.algofind for the algorithms):
* Tree (a rank sends all-reduce traffic to a parent and children) -> NCCL_ALGO=Ring;
* PAT (Simple sends to log-distance peers besides the ring successor) -> NCCL_PAT_ENABLE=0;
* NVLS (the ring carries DDP's start-up and bucket rebuild but no gradient all-reduce) ->
  NCCL_NVLS_ENABLE=0; CollNet (the same, and RDMA SENDs with an address that is no rank) ->
  NCCL_COLLNET_ENABLE=0;
* collective traffic to several peers that is neither (channels of different ring orders);
* only point-to-point sends: nothing to reassemble;
* a stated release the wire contradicts -> drop --nccl-version;
* sizes that fit no ring plan, with the advice for what the wire cannot show (user-buffer
  registration).
Exit codes: 0 followable, 1 not followable or not NCCL, 2 unreadable capture.
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
from mirrorckpt.parser.errors import InferenceError
from mirrorckpt.parser.roce.ringfind import sequences
from mirrorckpt.parser.roce.streams import MirrorStreams
from mirrorckpt.tools.cliutil import NcclVersion, fail
from mirrorckpt.tools.progress import Progress

FOLLOWABLE, NOT_FOLLOWABLE, NOT_NCCL = "followable", "not followable", "not NCCL"
ADVICE_OTHER = ("with user-buffer registration (CUDA graphs, ncclCommRegister) set NCCL_LOCAL_REGISTER=0 "
                "NCCL_GRAPH_REGISTER=0; with NVLS or Tree see their causes (NCCL_NVLS_ENABLE=0, NCCL_ALGO=Ring)")


def _cause(cause: str, fix: str, cost: str | None = None, algorithm: str | None = None) -> dict:
    out = {"cause": cause, "fix": fix}
    if cost:
        out["cost"] = cost
    if algorithm:
        out["algorithm"] = algorithm
    return out


def diagnose(captures, nccl_version=None, window: int = 20000) -> dict:
    from mirrorckpt.parser.roce import algofind
    from mirrorckpt.parser.roce.infer import infer, startup_without_allreduces, wire_family
    from mirrorckpt.parser.roce.ringfind import cts_ranks, evidence
    from mirrorckpt.tools.cmd_inspect import nccl_verdict

    streams = MirrorStreams([(c, open_capture(c)) for c in captures], nccl_version=nccl_version)
    sends = []
    try:
        with Progress("[doctor]", sum(os.path.getsize(c) for c in captures) / 1e6, "MB") as bar:
            for batch in streams:
                sends += batch
                bar.set(sum(s.bytes for s in streams.stats) / 1e6)
                if len(sends) >= window:
                    break
        fam = wire_family(streams.decoders)
    except InferenceError as e:  # a stated release the wire contradicts
        return {"verdict": NOT_FOLLOWABLE, "family": None, "connections": [], "inferred": None,
                "causes": [_cause(str(e), "drop --nccl-version (the release is read from the wire)")]}
    paths = streams.paths
    if not sends and not any(p.nccl.cts_posts for p in paths):
        what = [nccl_verdict(p, 0) for p in paths]
        roce = sum(sum(p.counters.by_opcode().values()) for p in paths)
        cause = (next(w["verdict"] for w in what).removeprefix("not NCCL: ") if roce
                 else "no RoCEv2 traffic (UDP port 4791) in the captures")
        return {"verdict": NOT_NCCL, "family": None, "connections": [], "inferred": None, "notes": [],
                "causes": [_cause(cause, "mirror the ports of the NCCL job's ranks (RoCEv2 traffic of NCCL's "
                                         "IB/RoCE transport)")]}
    seqs = sequences(sends)
    ranks = cts_ranks(streams.decoders)
    nqps = {k: n for d in streams.decoders for k, n in d.qps_by_connection().items()}
    conns, pair_conns = [], defaultdict(set)
    for k, seq in seqs.items():
        protos = sorted({s.protocol for s in seq.values() if s.protocol and len(s.data)})
        kind = "point-to-point" if evidence(seq) == "point-to-point" else "collective"
        conns.append({"key": k, "connection": str(k), "sends": len(seq), "qps": nqps.get(k, 1), "protocols": protos,
                      "kind": kind})
        pair_conns[(k.sender, k.receiver)].add(k.sport)
    links = algofind.collective_links(seqs)
    causes: list[dict] = []
    if seqs and not links:
        causes.append(_cause("only point-to-point sends (ncclSend/ncclRecv): no collective connection carries data, "
                             "so there are no all-reduce results to reassemble",
                             "all-reduce the gradients with a collective (DDP's bucket all-reduce); point-to-point "
                             "traffic can only fill holes of a ring all-reduce"))
    findings: list = []
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
            # only what no ring explains: a point-to-point peer besides the ring is no PAT
            verbs = {k: v for p in paths for k, v in p.verbs_senders.items()}
            findings = algofind.find_peers(links, ranks) or algofind.find_off_ring(
                links, verbs, ranks, startup_without_allreduces(sends, streams.decoders, nccl_version))
            if not findings:
                causes.append(_cause(str(e), "mirror the egress of two adjacent ranks from the job's start, or give "
                                             "the job file (--config); " + ADVICE_OTHER))
    causes += [dict(f.to_dict()) for f in findings]
    ring_peers = {a: len(p) for a, p in links.items()}
    return {
        "verdict": NOT_FOLLOWABLE if causes else FOLLOWABLE,
        "family": fam.describe(), "cts_layout": fam.cts.name if fam.cts else None, "imm_order": fam.imm_order,
        "connections_per_pair": {f"{address_text(a)}->{address_text(b)}": len(v)
                                 for (a, b), v in sorted(pair_conns.items())},
        "qps_per_connection": sorted({c["qps"] for c in conns}),
        "algorithm": (", ".join(f.algorithm for f in findings) if findings else
                      "ring" if inferred or (ring_peers and all(n == 1 for n in ring_peers.values())) else
                      "not a ring" if ring_peers else "none (no collective traffic)"),
        "connections": [{k: v for k, v in c.items() if k != "key"} for c in conns], "inferred": inferred,
        "notes": notes, "causes": causes,
    }


def render(rep: dict) -> list[str]:
    out = [f"verdict: {rep['verdict']}"]
    if rep["family"]:
        out.append(f"NCCL release: {rep['family']} (CTS {rep.get('cts_layout')}, immediates "
                   f"{rep.get('imm_order') or 'undecided'})")
        out.append(f"algorithm: {rep.get('algorithm')}")
    for pair, n in rep.get("connections_per_pair", {}).items():
        out.append(f"connections {pair}: {n}")
    if rep.get("qps_per_connection"):
        q = rep["qps_per_connection"]
        out.append(f"QPs per connection: {', '.join(map(str, q))}" + (
            " ([[mirror]] workers > 1 keeps every message in one worker)" if q == [1] else
            " ([[mirror]] workers > 1: a capture file's split keeps a connection's QPs together; a live port's "
            "kernel split would part them and their messages come out incomplete: use workers = 1 there)"))
    for c in rep["connections"]:
        out.append(f"connection {c['connection']}: {c['kind']}, {c['sends']} sends, {c['qps']} QP(s), "
                   f"protocols {', '.join(c['protocols']) or '-'}")
    if rep["inferred"]:
        i = rep["inferred"]
        out.append(f"job: {i['ranks']} ranks, {i['channels']} channels, NCCL {i['nccl_version']} schedule, "
                   f"protocol {i['protocol']}")
        out += [f"  {k}: {p}" for k, p in i["protocols"].items()]
        out.append(f"Simple threads: {i['simple_threads']}")
    out += [f"note: {n}" for n in rep.get("notes", [])]
    for c in rep["causes"]:
        out.append(f"{'not NCCL' if rep['verdict'] == NOT_NCCL else 'cannot follow'}: {c['cause']}")
        out.append(f"  fix: {c['fix']}")
        if c.get("cost"):
            out.append(f"  cost: {c['cost']}")
    return out


@click.command()
@click.argument("captures", nargs=-1, required=True, type=click.Path(dir_okay=False, exists=True))
@click.option("--nccl-version", default=None, type=NcclVersion(), help="Check the traffic against this NCCL release.")
@click.option("--json", "as_json", is_flag=True)
def doctor(captures, nccl_version, as_json):
    """Whether the appliance can follow the job CAPTURES show; for what it cannot, the NCCL setting that fixes it."""
    try:
        rep = diagnose(list(captures), nccl_version)
    except CaptureError as e:
        fail(str(e))
    click.echo(json.dumps(rep, indent=1) if as_json else "\n".join(render(rep)))
    sys.exit(0 if rep["verdict"] == FOLLOWABLE else 1)
