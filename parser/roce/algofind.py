"""Which NCCL algorithm the traffic shows besides the ring, from the wire alone.

NCCL connects a channel's peer once, whatever algorithm asks (connIndex 0,
v2.30.7-1:src/transport/generic.cc:14-92), so a ring job sends collective traffic from each rank to
its ring successor only. What else shows on RoCE:

* Tree (all-reduce; NCCL_ALGO may pick it for multi-node jobs): a rank reduces up to its parent
  and broadcasts down to up to two children per channel (double binary tree, src/graph/trees.cc):
  all-reduce traffic to three peers, or both ways between a rank and two of its peers.
* PAT (all-gather and reduce-scatter, 2.23+, one rank per node): Simple sends to the ranks at
  distance 2, 4, ... besides the ring successor (ncclTransportPatConnect), a few at a time, while
  the ring connection carries the job's all-reduces.
* NVLS (all-reduce inside the node over NVLink SHARP) and CollNet (all-reduce in the network by
  SHARP): the ring carries DDP's start-up and bucket rebuild but no gradient all-reduce
  (``infer.startup_without_allreduces``); CollNet's data goes to and from an address that is no
  rank, in RDMA SENDs (no CTS, no RDMA WRITE).
Each finding comes with the NCCL setting that brings the ring back and what it costs.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from mirrorckpt.config.layout import address_text
from mirrorckpt.parser.roce import nccl_versions as nv
from mirrorckpt.parser.roce.nccl import ConnKey, NcclSend
from mirrorckpt.parser.roce.ringfind import POINT_TO_POINT, evidence

TREE, PAT, NVLS, COLLNET, RING_ORDERS = "Tree", "PAT", "NVLS", "CollNet", "ring orders"

# algorithm -> (the setting that brings the ring back, what it costs)
FIXES = {
    TREE: ("set NCCL_ALGO=Ring (NCCL 2.24+: NCCL_ALGO=allreduce:ring, which leaves other collectives to NCCL)",
           "large multi-node all-reduces lose Tree's latency advantage (a ring takes 2(R-1) steps, a tree about "
           "2 log2 R); bandwidth-bound gradient buckets run at about the same bus bandwidth"),
    PAT: ("set NCCL_PAT_ENABLE=0",
          "all-gathers and reduce-scatters of this communicator run on the ring: R-1 steps instead of log2 R, "
          "which shows only on small ones (DDP issues one at start-up; FSDP and ZeRO issue them every step)"),
    NVLS: ("set NCCL_NVLS_ENABLE=0",
           "all-reduces leave NVSwitch's in-switch reduction for the ring: each GPU moves about twice the "
           "gradient bytes over NVLink and the network, so all-reduce bus bandwidth drops on NVSwitch systems"),
    COLLNET: ("set NCCL_COLLNET_ENABLE=0",
              "the switch no longer reduces: each NIC sends 2(R-1)/R of the gradient bytes on the ring "
              "instead of about one copy to the switch, close to twice the all-reduce traffic"),
    RING_ORDERS: ("give the per-channel ring orders in the job file ([ring] orders), or set NCCL_ALGO=Ring "
                  "if it is Tree",
                  "none for the orders (they only describe the job); NCCL_ALGO=Ring as for Tree"),
}


@dataclass
class Finding:
    algorithm: str
    evidence: str

    @property
    def fix(self) -> str:
        return FIXES[self.algorithm][0]

    @property
    def cost(self) -> str:
        return FIXES[self.algorithm][1]

    def to_dict(self) -> dict:
        return {"algorithm": self.algorithm, "cause": self.evidence, "fix": self.fix, "cost": self.cost}


@dataclass
class _Link:
    """A sender's collective traffic to one peer (all connections between them)."""
    sends: int = 0
    protocols: frozenset = frozenset()
    first_ts: int = 0


def collective_links(seqs: dict[ConnKey, dict[int, NcclSend]]) -> dict[bytes, dict[bytes, _Link]]:
    """sender -> receiver -> its collective (not point-to-point) traffic."""
    out: dict[bytes, dict[bytes, _Link]] = defaultdict(dict)
    for k, seq in seqs.items():
        if evidence(seq) == POINT_TO_POINT:
            continue
        sends = list(seq.values())
        link = out[k.sender].get(k.receiver) or _Link(first_ts=min(s.ts_ns for s in sends))
        link.sends += len(sends)
        link.protocols |= {s.protocol for s in sends if s.protocol and s.nbytes}
        link.first_ts = min(link.first_ts, min(s.ts_ns for s in sends))
        out[k.sender][k.receiver] = link
    return out


def find_peers(links: dict[bytes, dict[bytes, _Link]], ranks: dict[bytes, int]) -> list[Finding]:
    """Tree, PAT or rings of several orders, from senders with collective traffic to more than one peer."""
    out: list[Finding] = []
    tree, pat, orders = [], [], []
    mains = {a: max(peers, key=lambda b: peers[b].sends) for a, peers in links.items()}
    # the job's ranks as far as the wire shows them: senders, their main peers, CTS-tagged addresses
    members = set(links) | set(mains.values()) | set(ranks)
    for a, peers in links.items():
        if len(peers) < 2:
            continue
        main = mains[a]
        extra = [b for b in peers if b != main]
        if not all(b in members for b in extra):
            continue  # a host that is none of the job's ranks: point-to-point, not an algorithm
        if all(peers[b].protocols <= {nv.SIMPLE} and peers[b].sends * 4 <= peers[main].sends for b in extra):
            pat.append((a, main, extra))
        elif len(peers) >= 3 or sum(a in links.get(b, {}) for b in peers) >= 2:
            tree.append((a, peers))
        else:
            orders.append((a, peers))
    if tree:
        a, peers = max(tree, key=lambda t: len(t[1]))
        both = [b for b in peers if a in links.get(b, {})]
        out.append(Finding(TREE, f"{address_text(a)} sends all-reduce traffic to {len(peers)} peers "
                                 f"({_names(peers, ranks)})" + (f", and {_names(both, ranks)} sends to it too" if both
                                                                else "") +
                           ": NCCL's Tree (reduce up to a parent, broadcast down to children on each channel)"))
    if pat:
        a, main, extra = pat[0]
        everyone = set(links) | {b for p in links.values() for b in p} | set(ranks)
        dist = _distances(a, extra, ranks, max(len(everyone), max(ranks.values(), default=0) + 1))
        out.append(Finding(PAT, f"{address_text(a)} sends a few Simple messages to {_names(extra, ranks)} besides its "
                                f"ring successor {_name(main, ranks)}" + (f" (rank distances {dist})" if dist else "")
                           + ": NCCL's PAT all-gather/reduce-scatter, whose peers are at distances 1, 2, 4, ..."))
    if orders and not tree:
        a, peers = orders[0]
        out.append(Finding(RING_ORDERS, f"{address_text(a)} sends collective traffic to {len(peers)} peers "
                                        f"({_names(peers, ranks)}): channels with different ring orders, or "
                                        "NCCL's Tree"))
    return out


def find_off_ring(links: dict[bytes, dict[bytes, _Link]], verbs: dict[tuple[bytes, int], bytes], ranks,
                  absent: str | None) -> list[Finding]:
    """NVLS or CollNet, when the ring shows DDP's start-up and rebuild but no gradient all-reduce
    (``absent``: infer.startup_without_allreduces's sentence); CollNet when RDMA SENDs also go
    between a rank and an address that is no rank."""
    members = set(ranks) | set(links) | {b for peers in links.values() for b in peers}
    aggregation = sorted({dst if src in members else src for (dst, _), src in verbs.items()
                          if (src in members) != (dst in members)})
    if absent is None:
        return []
    if aggregation:
        return [Finding(COLLNET, f"{absent}; the ranks exchange RDMA SENDs with {_names(aggregation, {})}, which is "
                                 "no rank: CollNet (SHARP) reduces the gradients in the network")]
    return [Finding(NVLS, f"{absent}: the gradients are reduced off the mirrored links (NVLS inside the node over "
                          "NVSwitch, or CollNet whose traffic is not mirrored)")]


def _name(a: bytes, ranks: dict[bytes, int]) -> str:
    return address_text(a) + (f" (rank {ranks[a]})" if a in ranks else "")


def _names(addrs, ranks: dict[bytes, int]) -> str:
    return ", ".join(_name(a, ranks) for a in sorted(addrs))


def _distances(a: bytes, peers, ranks: dict[bytes, int], nranks: int) -> str:
    """Rank distances to the peers whose ranks the CTS tags gave."""
    if a not in ranks:
        return ""
    return ", ".join(str(min((ranks[b] - ranks[a]) % nranks, (ranks[a] - ranks[b]) % nranks))
                     for b in sorted(peers) if b in ranks)
