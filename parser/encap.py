"""Mirror encapsulations taken off in the compiled frame walk, and the mirror's health they show.

``WALK_OFFSETS`` are the compiled walk's field offsets from the header tables (parser/_walk.pxi:
``_inner`` here, the mirrored frames and flow ports every transport reads; the RoCEv2 decode's
copy is configured by parser.roce). ``table(spec)`` turns a job's
``config.encap.EncapSpec`` into the walk's switches (which GRE protocols and which VXLAN port are
a mirror's). ``MirrorHealth`` is what the encapsulations showed, kept per capture stream across
batches: frames per encapsulation; per mirror session with GRE sequence numbers (ERSPAN II/III,
gretap with ``seq``; a session is its outer addresses, GRE protocol, GRE key and ERSPAN session
id) the frames lost between the switch and the capture, as gaps in the numbering; frames the
switch cut (ERSPAN's T bit) and frames whose IP header says more than arrived, as a mirror
session's MTU leaves them. A cut RoCE packet can never be followed: ``truncation_advice`` says so
with the switch settings to change.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from mirrorckpt.config.encap import EncapSpec
from mirrorckpt.config.jobfile import ConfigError
from mirrorckpt.parser import _inner
from mirrorckpt.parser.headers import (
    AETH,
    BTH,
    DETH,
    ERSPAN2,
    ERSPAN3,
    ERSPAN3_O,
    ERSPAN3_PLATFORM,
    ERSPAN_SESSION,
    ERSPAN_TRUNCATED,
    ERSPAN_VERSION_II,
    ERSPAN_VERSION_III,
    ERSPAN_VERSION_SHIFT,
    ETH,
    ETHERTYPE_ARP,
    ETHERTYPE_IPV4,
    ETHERTYPE_IPV6,
    ETHERTYPE_LLDP,
    ETHERTYPE_PTP,
    ETHERTYPE_VLAN,
    GRE,
    GRE_CHECKSUM,
    GRE_KEY,
    GRE_PROTO_ERSPAN,
    GRE_PROTO_ERSPAN3,
    GRE_PROTO_SPECTRUM,
    GRE_PROTO_TEB,
    GRE_ROUTING,
    GRE_SEQUENCE,
    GRE_SPECTRUM_BYTES,
    GRE_VERSION,
    GRE_WORD,
    ICRC_BYTES,
    IMMDT,
    IPPROTO_GRE,
    IPPROTO_TCP,
    IPPROTO_UDP,
    IPV4,
    IPV4_FRAGMENT,
    IPV6,
    PTP_PORTS,
    RETH,
    ROCEV2_PORT,
    UDP,
    VLAN,
    VXLAN,
    VXLAN_PORT,
    VXLAN_VALID_VNI,
)

# Field offsets, EtherTypes and protocol numbers for the compiled frame walk, in its K_* order,
# taken from the header tables.
WALK_OFFSETS = (
    ETH["type"].offset, ETH.size, VLAN["type"].offset, VLAN.size,
     IPV4["ver_ihl"].offset, IPV4["total_len"].offset, IPV4["frag"].offset, IPV4["proto"].offset,
     IPV4["src"].offset, IPV4["dst"].offset, IPV4.size,
     IPV6["payload_len"].offset, IPV6["next"].offset, IPV6["src"].offset, IPV6["dst"].offset, IPV6.size,
     UDP["sport"].offset, UDP["dport"].offset, UDP["len"].offset, UDP.size,
     BTH["opcode"].offset, BTH["flags"].offset, BTH["dqp"].offset, BTH["ackreq"].offset, BTH["psn"].offset,
     BTH.size, RETH["va"].offset, RETH["rkey"].offset, RETH["dlen"].offset, RETH.size, IMMDT.size,
     AETH["syndrome"].offset, AETH["msn"].offset, AETH.size, DETH.size, ICRC_BYTES,
     ROCEV2_PORT, PTP_PORTS[0], PTP_PORTS[1],
     ETHERTYPE_IPV4, ETHERTYPE_IPV6, *ETHERTYPE_VLAN, ETHERTYPE_ARP, ETHERTYPE_LLDP, ETHERTYPE_PTP,
     IPPROTO_TCP, IPPROTO_UDP, IPPROTO_GRE,
     GRE["flags"].offset, GRE["proto"].offset, GRE.size, GRE_WORD, GRE_CHECKSUM, GRE_ROUTING, GRE_KEY,
     GRE_SEQUENCE, GRE_VERSION, GRE_PROTO_ERSPAN, GRE_PROTO_ERSPAN3, GRE_PROTO_TEB,
     ERSPAN2["ver_vlan"].offset, ERSPAN2["session"].offset, ERSPAN2.size, ERSPAN3["flags"].offset, ERSPAN3.size,
     ERSPAN3_PLATFORM.size, ERSPAN_VERSION_SHIFT, ERSPAN_VERSION_II, ERSPAN_VERSION_III, ERSPAN_TRUNCATED,
     ERSPAN_SESSION, ERSPAN3_O, VXLAN["flags"].offset, VXLAN.size, VXLAN_VALID_VNI, IPV4_FRAGMENT)
_inner.configure(WALK_OFFSETS)

# Mirror sessions followed per capture stream (switches offer a handful: Spectrum 0-7, NX-OS 1-32);
# sequenced frames of sessions beyond these are counted as untracked.
MAX_SESSIONS = 64
_KINDS = dict(enumerate(_inner.MIRROR[:6]))


@lru_cache(maxsize=32)
def _table(spec: EncapSpec) -> np.ndarray:
    if spec.vxlan_port == ROCEV2_PORT:
        raise ConfigError(f"[capture] vxlan_port: {ROCEV2_PORT} is RoCEv2's own port")
    vendor = (spec.gre_protocol, spec.gre_header_bytes) if spec.gre_protocol is not None \
        else (GRE_PROTO_SPECTRUM, GRE_SPECTRUM_BYTES)
    mode = spec.mode
    out = np.array([
        mode in ("auto", "erspan"),
        mode in ("auto", "gre"),
        vendor[0] if mode in ("auto", "gre") else -1,
        vendor[1] if mode in ("auto", "gre") else 0,
        (spec.vxlan_port or VXLAN_PORT) if mode in ("auto", "vxlan") else -1,
    ], np.int64)
    out.flags.writeable = False
    return out


def table(spec: EncapSpec | None = None) -> np.ndarray:
    """The compiled walk's encapsulation switches for ``spec`` (None: detect every one); a
    ConfigError when the spec names a port that is not free for it. A configured GRE protocol is
    tried before the built-in rules: ERSPAN's or gretap's own, for a switch whose header after
    GRE is not the standard's, overrides them."""
    return _table(spec if spec is not None else EncapSpec())


def split_walk(spec: EncapSpec | None = None) -> dict:
    """The facts the AF_PACKET split's BPF program walks by (capture.fanout_bpf): the decoder's
    headers and, per ``spec``, the encapsulations it takes off, so both split frames alike."""
    enc = table(spec).tolist()
    return {
        "eth_size": ETH.size, "eth_type_at": ETH["type"].offset, "vlan_size": VLAN.size,
        "vlan_type_at": VLAN["type"].offset, "tpids": list(ETHERTYPE_VLAN), "ipv4": ETHERTYPE_IPV4,
        "ipv6": ETHERTYPE_IPV6, "ipv4_size": IPV4.size, "ipv4_vihl_at": IPV4["ver_ihl"].offset,
        "ipv4_frag_at": IPV4["frag"].offset, "ipv4_frag_mask": IPV4_FRAGMENT,
        "ipv4_total_len_at": IPV4["total_len"].offset, "ipv4_proto_at": IPV4["proto"].offset,
        "ipv6_size": IPV6.size, "ipv6_payload_len_at": IPV6["payload_len"].offset, "ipv6_next_at": IPV6["next"].offset,
        "udp": IPPROTO_UDP, "gre": IPPROTO_GRE, "udp_size": UDP.size, "udp_sport_at": UDP["sport"].offset,
        "udp_dport_at": UDP["dport"].offset, "udp_len_at": UDP["len"].offset, "roce_port": ROCEV2_PORT,
        "vxlan_port": enc[4], "vxlan_size": VXLAN.size, "vxlan_flags_at": VXLAN["flags"].offset,
        "vxlan_valid": VXLAN_VALID_VNI, "erspan": bool(enc[0]), "gretap": bool(enc[1]), "vendor_protocol": enc[2],
        "vendor_bytes": enc[3], "gre_size": GRE.size, "gre_proto_at": GRE["proto"].offset,
        "gre_flags_at": GRE["flags"].offset, "gre_reject": GRE_ROUTING | GRE_VERSION,
        "gre_words": [GRE_CHECKSUM, GRE_KEY, GRE_SEQUENCE], "gre_word": GRE_WORD, "gre_sequence": GRE_SEQUENCE,
        "erspan_protocol": GRE_PROTO_ERSPAN, "erspan3_protocol": GRE_PROTO_ERSPAN3, "gretap_protocol": GRE_PROTO_TEB,
        "erspan_ver_at": ERSPAN2["ver_vlan"].offset, "erspan_ver_shift": ERSPAN_VERSION_SHIFT,
        "erspan2_size": ERSPAN2.size, "erspan2_version": ERSPAN_VERSION_II, "erspan3_size": ERSPAN3.size,
        "erspan3_version": ERSPAN_VERSION_III, "erspan3_flags_at": ERSPAN3["flags"].offset, "erspan3_o": ERSPAN3_O,
        "erspan3_platform_size": ERSPAN3_PLATFORM.size,
    }


def check(spec: EncapSpec) -> None:
    """Raises the ConfigError ``table`` would: for a command's start, before any capture is read."""
    table(spec)


@dataclass
class MirrorHealth:
    """What the mirror encapsulations of one capture stream showed so far (adds up across batches;
    ``merge`` joins streams)."""

    counts: np.ndarray = field(default_factory=lambda: np.zeros(len(_inner.MIRROR), np.int64))
    keys: np.ndarray = field(default_factory=lambda: np.zeros((MAX_SESSIONS, _inner.SESSION_KEY_BYTES), np.uint8))
    rows: np.ndarray = field(default_factory=lambda: np.zeros((MAX_SESSIONS, len(_inner.SESSION_COLUMNS)), np.int64))
    used: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    cut: int = 0  # frames shorter than their IP header says (a mirror MTU cut them)

    def state(self) -> tuple:
        """The arguments the compiled walk updates (counts, session keys, rows, rows in use)."""
        return self.counts, self.keys, self.rows, self.used

    def merge(self, other: MirrorHealth) -> None:
        self.counts += other.counts
        self.cut += other.cut
        for k in range(int(other.used[0])):
            key = other.keys[k]
            mine = np.flatnonzero((self.keys[:int(self.used[0])] == key).all(axis=1))
            if len(mine):
                self.rows[mine[0]] += other.rows[k]
            elif self.used[0] < MAX_SESSIONS:
                n = int(self.used[0])
                self.keys[n], self.rows[n] = key, other.rows[k]
                self.used[0] = n + 1
            else:
                self.counts[_inner.MIRROR.index("sessions_untracked")] += other.rows[k, 0]

    def count(self, name: str) -> int:
        return int(self.counts[_inner.MIRROR.index(name)])

    @property
    def encapsulated(self) -> dict[str, int]:
        """Frames per encapsulation taken off (only those seen)."""
        return {name: int(v) for name, v in zip(_inner.MIRROR[:6], self.counts[:6].tolist()) if v}

    def sessions(self) -> list[dict]:
        """Each GRE-sequenced mirror session: its name and counts (frames, lost, late, ...)."""
        cols = _inner.SESSION_COLUMNS
        return [{"session": session_name(self.keys[k]), **{c: int(v) for c, v in zip(cols, self.rows[k].tolist())
                                                           if c != "last_seq"}}
                for k in range(int(self.used[0]))]

    @property
    def lost(self) -> int:
        """Frames the mirror lost between the switch and the capture, from its sequence numbers."""
        return int(self.rows[:int(self.used[0]), _inner.SESSION_COLUMNS.index("lost")].sum())

    @property
    def truncated(self) -> int:
        """Frames the switch cut: with ERSPAN's T bit, or shorter than their IP header."""
        return self.count("erspan_truncated") + self.count("cut_unmarked")

    def to_dict(self) -> dict:
        """The report's form (replay --json, inspect --json; ``lines`` and ``truncation_advice`` read it)."""
        return {"encapsulated": self.encapsulated, "lost_frames": self.lost, "truncated_frames": self.truncated,
                "erspan_truncated": self.count("erspan_truncated"), "mirror_truncated": self.cut,
                "sessions": self.sessions(), "sessions_untracked": self.count("sessions_untracked")}

    def lines(self) -> list[str]:
        return lines(self.to_dict())


def lines(health: dict) -> list[str]:
    """A stream's ``MirrorHealth.to_dict()`` as text: nothing for a bare mirror that lost and cut nothing."""
    out = []
    if health["encapsulated"]:
        out.append("mirror encapsulation: " + ", ".join(f"{k} {v}" for k, v in health["encapsulated"].items()))
    for s in health["sessions"]:
        extra = "".join(f", {s[k]} {k}" for k in ("late", "duplicate", "restarts") if s[k])
        out.append(f"mirror session {s['session']}: {s['frames']} frames, {s['lost']} lost on the way{extra}")
    if health["sessions_untracked"]:
        out.append(f"mirror sessions beyond {MAX_SESSIONS}: {health['sessions_untracked']} sequenced frames "
                   "not checked for loss")
    if health["truncated_frames"]:
        out.append(f"mirror truncation: {health['truncated_frames']} frames cut by the switch ({_cut_text(health)})")
    return out


def _cut_text(health: dict) -> str:
    return (f"ERSPAN's truncated bit on {health['erspan_truncated']}, {health['mirror_truncated']} frames shorter "
            "than their IP header")


def session_name(key: np.ndarray) -> str:
    """'erspan2 10.0.0.1>10.0.0.2 session 7' from a session key (see _inner._gre)."""
    raw, at = bytes(key), _inner.SESSION_KEY

    def addr(name: str) -> str:
        a = ipaddress.IPv6Address(raw[at[name]:at[name] + 16])
        return str(a.ipv4_mapped or a)

    def number(name: str, size: int) -> int:
        return int.from_bytes(raw[at[name]:at[name] + size], "big")

    kind = _KINDS.get(raw[at["kind"]], "gre")
    name = f"{kind} {addr('src')}>{addr('dst')}"
    if kind in ("erspan2", "erspan3"):
        name += f" session {number('erspan_session', 2)}"
    if kind == "gre_vendor":
        name += f" protocol 0x{number('gre_protocol', 2):04X}"
    return name + (f" key {number('gre_key', 4)}" if number("gre_key", 4) else "")


def truncation_advice(health: MirrorHealth | dict) -> str | None:
    """What to tell the operator, once, when the switch cuts mirror copies: a cut RoCE packet
    can never be followed, so every iteration it carries is lost to the replica."""
    d = health.to_dict() if isinstance(health, MirrorHealth) else health
    if not d["truncated_frames"]:
        return None
    return (f"the mirror truncates: {d['truncated_frames']} frames arrived cut by the switch ({_cut_text(d)}); "
            "a cut RoCE packet can never be followed, so no iteration it carries can be checkpointed. "
            "Let the mirror session carry whole frames: raise its MTU to the RoCE frame size plus the encapsulation "
            "(NX-OS: `monitor session N` / `mtu 9216`, or no `mtu` line; Arista: no `truncate` on the monitor "
            "session; SONiC/Cumulus: the session's destination and underlay MTU at least 4096 + 62 bytes), and "
            "the MTU of every underlay link between the switch and this port")
