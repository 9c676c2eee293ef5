"""The ring from the traffic: which address is which rank, and the ring order.

Edges come from the data connections (sender -> receiver) and from the CTS posts (a receiver
posts to its upstream neighbour, so the egress of rank r shows the link into r even when the
upstream rank's egress is not mirrored). A CTS tag names the data sender's rank. Walking the
edges from rank 0 gives each address its ring position; with two adjacent ranks' egress the walk
sees every link but the one between the last two ranks, which closes the ring. Global ranks the
tags do not give are taken to equal the ring position (NCCL's usual single-ring order): the
reassembly depends only on positions, so this choice can relabel ranks, never misplace data.
"""

from __future__ import annotations

from collections import defaultdict

from mirrorckpt.config.layout import address_text
from mirrorckpt.parser.errors import InferenceError
from mirrorckpt.parser.roce import nccl_versions as nv
from mirrorckpt.parser.roce.nccl import ConnKey, NcclDecoder, NcclSend


def sequences(sends: list[NcclSend]) -> dict[ConnKey, dict[int, NcclSend]]:
    """Per connection its sends by message number (the CTS index - 1 where the CTS was seen, else
    the place in arrival order), from the stream that carries the most of them."""
    per = defaultdict(list)
    for s in sends:
        per[(s.stream, s.connection)].append(s)
    best: dict[ConnKey, list[NcclSend]] = {}
    for (_, conn), lst in per.items():
        if len(lst) > len(best.get(conn, ())):
            best[conn] = lst
    out = {}
    for conn, lst in best.items():
        d, m = {}, -1
        for s in lst:
            m = s.seq - 1 if s.seq is not None else m + 1
            d.setdefault(m, s)
        out[conn] = d
    return out


RING, MAYBE_RING, POINT_TO_POINT = "ring", "maybe ring", "point-to-point"
_RING_CTS_SIZES = frozenset(nv.cts_size(p, k, nv.NEWEST) for p in nv.PROTOCOLS for k in (nv.ALLREDUCE, nv.BROADCAST))


def evidence(seq: dict[int, NcclSend]) -> str:
    """What a connection's sends show it to be. LL/LL128 sends only travel on ring (collective)
    connections, and a CTS post of a ring step's or slice's size (doc 4.3) announces a ring
    receive: RING. A Simple-only connection looks point-to-point when its CTS posts announce other
    sizes, or two messages in a row land at one address (a ring message takes the next slot of the
    connection's buffer; point-to-point sends reuse a shared buffer): POINT_TO_POINT. Otherwise
    nothing decides (a few Simple sends seen without their CTS): MAYBE_RING."""
    sends = [seq[m] for m in sorted(seq)]
    if any(s.protocol in (nv.LL, nv.LL128) for s in sends):
        return RING
    sizes = {s.cts.size for s in sends if s.cts is not None}
    if sizes and not sizes <= _RING_CTS_SIZES:
        return POINT_TO_POINT
    vas = [s.va for s in sends if s.va is not None]
    if any(a == b for a, b in zip(vas, vas[1:])):
        return POINT_TO_POINT
    return RING if sizes else MAYBE_RING


def _ringlike(seq: dict[int, NcclSend]) -> bool:
    return evidence(seq) != POINT_TO_POINT


def ring_hypotheses(conns: dict[ConnKey, dict[int, NcclSend]]):
    """The ring connections to try, most first: ``(connections, left out)`` with every ring-like
    connection, then with one channel fewer per step down to the most connections a pair has that
    something proves ring. A pair above the channel count leaves out its MAYBE_RING connections,
    the latest created first (highest receiver QP number: NCCL connects the rings at init and a
    point-to-point peer on first use). A one-send point-to-point connection seen without its CTS
    (an egress-only mirror) looks like a Simple ring connection, and counted as one it made a
    1-channel job look like 2 channels that no plan fits."""
    # a connection seen only through lost messages (no send of known length; a lost CTS post makes
    # one on the reverse QP) shows nothing of its sizes: it never counts as a channel here
    blind = {k for k, v in conns.items() if not any(s.length_known for s in v.values())}
    pairs: dict[tuple, list[ConnKey]] = defaultdict(list)
    for k in conns:
        if k not in blind:
            pairs[(k.sender, k.receiver)].append(k)
    kind = {k: evidence(v) for k, v in conns.items()}
    most = max((len(v) for v in pairs.values()), default=0)
    proven = max((sum(kind[k] == RING for k in v) for v in pairs.values()), default=0)
    out = []
    for nch in range(most, max(proven, 1) - 1, -1):
        left = []
        for keys in pairs.values():
            maybe = sorted((k for k in keys if kind[k] == MAYBE_RING),
                           key=lambda k: -min(s.qp.dqp for s in conns[k].values()))
            left += maybe[:max(0, len(keys) - nch)]
        if left or not out:
            out.append(({k: v for k, v in conns.items() if k not in left and k not in blind}, left))
    return out


def cts_ranks(decoders: list[NcclDecoder]) -> dict[bytes, int]:
    """Address -> rank as the CTS posts' tags name it (a receiver tags its post with the data
    sender's rank); an address tagged with several ranks is left out."""
    out: dict[bytes, int] = {}
    for dec in decoders:
        for key, c in dec.conns.items():
            if len(set(c.tags)) == 1:
                out.setdefault(key.sender, next(iter(c.tags)))
    return out


def find_ring(seqs: dict[ConnKey, dict[int, NcclSend]], decoders: list[NcclDecoder],
              known_ranks: dict[bytes, int] | None = None, known_links=()):
    """(address -> rank, ring order from rank 0, ring connections, notes). ``known_ranks`` and
    ``known_links`` ((sender, receiver) addresses): the configured ring, taken like CTS posts."""
    notes: list[str] = []
    tags: dict[bytes, int] = dict(known_ranks or {})
    for a, r in cts_ranks(decoders).items():
        tags.setdefault(a, r)
    edges: dict[bytes, dict[bytes, int]] = defaultdict(lambda: defaultdict(int))  # a -> b -> weight
    for a, b in known_links:
        edges[a][b] += 1
    for dec in decoders:
        for key, c in dec.conns.items():
            if c.tags:
                edges[key.sender][key.receiver] += 1
    ring = {k: v for k, v in seqs.items() if _ringlike(v)}
    strong = {k for k, v in ring.items() if any(s.protocol in (nv.LL, nv.LL128) for s in v.values())}
    for k in ring:
        edges[k.sender][k.receiver] += 100 if k in strong else 10
    if not ring:
        raise InferenceError("no collective (ring) traffic among the sends: nothing to infer the ring from")
    by_rank: dict[int, list[bytes]] = defaultdict(list)
    for a, r in tags.items():
        by_rank[r].append(a)
    if any(len(v) > 1 for v in by_rank.values()):
        raise InferenceError(f"CTS tags give one rank to several addresses: "
                             f"{ {r: [address_text(a) for a in v] for r, v in by_rank.items()} }")
    nxt = {}
    for a, bs in edges.items():
        best = max(bs.values())
        top = [b for b, w in bs.items() if w == best]
        if len(top) > 1 or any(w >= 100 for b, w in bs.items() if b not in top):
            raise InferenceError(f"{address_text(a)} sends ring traffic to "
                                 f"{', '.join(address_text(b) for b in bs)}: channels use different ring orders; "
                                 "give them in the configuration")
        nxt[a] = top[0]
    # the ring's addresses: every sender and each one's successor (a receiver only a lesser edge
    # reaches, e.g. one Simple send to another host's second port, is none of the ring's)
    addrs = set(edges) | set(nxt.values())
    zero = by_rank.get(0, [None])[0]
    untagged = sorted(addrs - set(tags))
    if zero is None and len(untagged) == 1 and len(addrs) == len(tags) + 1:
        zero = untagged[0]  # every other address has its rank from a tag, none rank 0
    if zero is None:
        zero = _rank0_without_tags(ring, addrs, notes)
    order = [zero]
    while nxt.get(order[-1]) is not None and nxt[order[-1]] not in order:
        order.append(nxt[order[-1]])
    closed = nxt.get(order[-1]) == zero
    if not closed:
        prev = {b: a for a, b in nxt.items()}
        back = []
        a = prev.get(zero)
        while a is not None and a not in order and a not in back:
            back.append(a)
            a = prev.get(a)
        unseen = addrs - set(order) - set(back)
        if unseen or not back:
            missing = ", ".join(address_text(a) for a in sorted(unseen)) or "the rank upstream of rank 0"
            raise InferenceError(f"the ring order is not visible: the walk from rank 0 ({address_text(zero)}) stops at "
                                 f"{address_text(order[-1])}, and {missing} cannot be placed; mirror the egress of two "
                                 "adjacent ranks, or give [ring] addresses and orders in the configuration")
        notes.append(f"ring closed between {address_text(order[-1])} and {address_text(back[-1])}: "
                     "that link is not mirrored")
        order += list(reversed(back))
    R = len(order)
    ranks = {a: tags[a] for a in order if a in tags}
    if sorted(ranks.values()) != sorted(set(ranks.values())) or any(r >= R for r in ranks.values()):
        raise InferenceError(f"CTS tags {sorted(ranks.values())} do not fit a ring of {R} addresses")
    free = [r for r in range(R) if r not in ranks.values()]
    guessed = [a for a in order if a not in ranks]
    for a in guessed:  # in ring order: rank = position where the tags allow it
        pos = order.index(a)
        r = pos if pos in free else free[0]
        free.remove(r)
        ranks[a] = r
    if len(guessed) > 1 or (guessed and R > 2):
        notes.append(f"ranks of {', '.join(address_text(a) for a in guessed)} taken from their ring positions (no CTS "
                     "from their receivers seen); data placement depends only on the positions")
    conns = {k: v for k, v in ring.items() if k.sender in ranks and k.receiver in ranks
             and nxt.get(k.sender) == k.receiver}
    return ranks, [ranks[a] for a in order], conns, notes


def _rank0_without_tags(ring, addrs, notes) -> bytes:
    """Two ranks, no CTS: rank 0 sent the start-up broadcasts, so its connection carries more steps."""
    if len(addrs) != 2:
        raise InferenceError("rank 0 is unknown: no CTS posts (their tags name the sender's rank) are in the "
                             "mirrored traffic; mirror a receiver's egress, or give [ring] addresses")
    steps = {a: max((s.flag or 0 for k, v in ring.items() if k.sender == a for s in v.values()), default=0)
             for a in addrs}
    notes.append("no CTS seen: rank 0 taken to be the address that sent the start-up broadcasts")
    return max(sorted(addrs), key=lambda a: steps[a])
