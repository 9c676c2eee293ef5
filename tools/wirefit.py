"""Why work matched nothing: one sentence setting what the wire shows against what the job names.

Read from ``JobStream.report()`` (``parser.pipeline.JobReport``) once a replay or a serve pass has
ended without a single all-reduce: a capture with no RoCEv2 at all, or connections none of which is
a link of the configured ring (another job's file, two rank addresses swapped), or ring links whose
sends fit no channel (``protocol = "Simple"`` on LL traffic).
"""

from __future__ import annotations

from collections import defaultdict

from mirrorckpt.config.layout import address_text
from mirrorckpt.parser.pipeline import JobReport

SHOWN = 6  # address pairs named one by one; the rest are counted


def nothing_matched(rep: JobReport, allreduces: int, named_by: str = "the job file") -> str | None:
    """The sentence, or None when at least one all-reduce came out (complete or not)."""
    if allreduces:
        return None
    frames = f"{rep.frames:,} frame{'s' if rep.frames != 1 else ''}"
    if rep.roce_packets == 0:
        kinds = sorted(rep.other_frames.items(), key=lambda kv: -kv[1])
        what = f" ({', '.join(f'{k} {n:,}' for k, n in kinds[:SHOWN])})" if kinds else ""
        gre = rep.other_frames.get("gre_other", 0)
        hint = (f"; {gre:,} GRE packets of a protocol not taken off as a mirror encapsulation: a vendor's mirror "
                "header needs [capture] gre_protocol and gre_header_bytes in the job file, or [capture] "
                "encapsulation pins another kind") if gre else ""
        return (f"no RoCEv2 traffic (UDP port 4791) in {frames}{what}: nothing to reassemble; is the mirror "
                f"session copying the ranks' RDMA port (interface, VLAN, mirror encapsulation)?{hint}")
    sends = sum(rep.placement.values())
    placed = rep.placement.get("placed", 0)
    if not sends and rep.roce_packets and rep.ring is None:
        return (f"no NCCL send in the captures: {rep.roce_packets:,} RoCEv2 packets in {frames} show nothing of "
                "NCCL (an RDMA application's traffic?): nothing to reassemble (`mirrorckpt inspect` and `doctor` "
                "say what they hold)")
    if rep.connections:
        shown = _wire(rep, named_by)
    elif rep.roce_packets:
        shown = f"{rep.roce_packets:,} RoCEv2 packets in {frames}, no NCCL data connection among them"
    else:  # a stream that does not count RoCE (gloo over TCP)
        shown = frames
    if not sends:
        outcome = "nothing to place"
    elif not placed:
        outcome = f"none of its {sends:,} sends placed"
    else:
        outcome = f"{placed:,} of its {sends:,} sends placed, but no all-reduce came out of them"
    return f"{_named(rep, named_by)}; the wire shows {shown}: {outcome}"


def _named(rep: JobReport, named_by: str) -> str:
    ring = rep.ring
    if ring is None:
        return f"{named_by} names no ring"
    by_rank = {r: address_text(a) for a, r in rep.ranks.items()} or dict(ring.addresses)
    ranks = ", ".join(f"{r} {a}" for r, a in sorted(by_rank.items())) or "without addresses"
    version = f", NCCL {ring.nccl_version}" if ring.nccl_version else ""
    return (f"{named_by} names {ring.nranks} ranks ({ranks}) on {ring.nchannels} "
            f"channel{'s' if ring.nchannels != 1 else ''} (protocol {ring.protocol}{version})")


def _wire(rep: JobReport, named_by: str) -> str:
    pairs: dict[tuple[bytes, bytes], list] = defaultdict(list)
    for conn in rep.connections:
        pairs[(conn.sender, conn.receiver)].append(conn)
    parts = []
    for (a, b), conns in sorted(pairs.items())[:SHOWN]:
        n = len(conns)
        parts.append(f"{n} connection{'s' if n != 1 else ''} {address_text(a)} -> {address_text(b)} "
                     f"({_why(rep, a, b, conns, named_by)})")
    more = len(pairs) - SHOWN
    if more > 0:
        parts.append(f"and {more} more address pair{'s' if more != 1 else ''}")
    return "; ".join(parts)


def _why(rep: JobReport, sender: bytes, receiver: bytes, conns: list, named_by: str) -> str:
    """What the job makes of one address pair's connections."""
    ring = rep.ring
    a, b = rep.ranks.get(sender), rep.ranks.get(receiver)
    missing = [address_text(x) for x, r in ((sender, a), (receiver, b)) if r is None]
    if ring is None:
        return "no ring to place them on"
    if missing:
        return f"{' and '.join(missing)} not among the ranks {named_by} names"
    if not any(ring.next_rank(ch, a) == b for ch in range(ring.nchannels)):
        return f"rank {a} -> rank {b} by {named_by}: not a link of its ring"
    if all(c in rep.unfit for c in conns):
        return f"rank {a} -> rank {b}, a ring link whose sends fit no channel under protocol {ring.protocol}"
    return f"rank {a} -> rank {b}, a ring link"
