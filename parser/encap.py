"""Mirror encapsulations taken off in the compiled frame walk, and the mirror's health they show.

``table(spec)`` turns a job's ``config.encap.EncapSpec`` into the walk's switches (which GRE
protocols and which VXLAN port are a mirror's). ``MirrorHealth`` is what the encapsulations
showed, kept per capture stream across batches: frames per encapsulation; per mirror session
with GRE sequence numbers (ERSPAN II/III, gretap with ``seq``; a session is its outer addresses,
GRE protocol, GRE key and ERSPAN session id) the frames lost between the switch and the
capture, as gaps in the numbering; frames the switch cut (ERSPAN's T bit) and frames whose IP
header says more than arrived, as a mirror session's MTU leaves them. A cut RoCE packet can
never be followed: ``truncation_advice`` says so with the switch settings to change.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from mirrorckpt.config.encap import EncapSpec
from mirrorckpt.config.jobfile import ConfigError
from mirrorckpt.parser import _fast
from mirrorckpt.parser.headers import (
    GRE_PROTO_ERSPAN,
    GRE_PROTO_ERSPAN3,
    GRE_PROTO_SPECTRUM,
    GRE_PROTO_TEB,
    GRE_SPECTRUM_BYTES,
    ROCEV2_PORT,
    VXLAN_PORT,
)

# Mirror sessions followed per capture stream (switches offer a handful: Spectrum 0-7, NX-OS 1-32);
# sequenced frames of sessions beyond these are counted as untracked.
MAX_SESSIONS = 64
_KINDS = dict(enumerate(_fast.MIRROR[:6]))
_BUILTIN_GRE = {GRE_PROTO_ERSPAN: "ERSPAN type I/II", GRE_PROTO_ERSPAN3: "ERSPAN type III",
                GRE_PROTO_TEB: "gretap (transparent Ethernet bridging)"}


@lru_cache(maxsize=32)
def _table(spec: EncapSpec) -> np.ndarray:
    if spec.vxlan_port == ROCEV2_PORT:
        raise ConfigError(f"[capture] vxlan_port: {ROCEV2_PORT} is RoCEv2's own port")
    if spec.gre_protocol in _BUILTIN_GRE:
        raise ConfigError(f"[capture] gre_protocol: 0x{spec.gre_protocol:04X} is {_BUILTIN_GRE[spec.gre_protocol]}, "
                          "taken off by its own rules (leave gre_protocol out)")
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
    ConfigError when the spec names a protocol or port that is not free for it."""
    return _table(spec if spec is not None else EncapSpec())


def check(spec: EncapSpec) -> None:
    """Raises the ConfigError ``table`` would: for a command's start, before any capture is read."""
    table(spec)


@dataclass
class MirrorHealth:
    """What the mirror encapsulations of one capture stream showed so far (adds up across batches;
    ``merge`` joins streams)."""

    counts: np.ndarray = field(default_factory=lambda: np.zeros(len(_fast.MIRROR), np.int64))
    keys: np.ndarray = field(default_factory=lambda: np.zeros((MAX_SESSIONS, _fast.SESSION_KEY_BYTES), np.uint8))
    rows: np.ndarray = field(default_factory=lambda: np.zeros((MAX_SESSIONS, len(_fast.SESSION_COLUMNS)), np.int64))
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
                self.counts[_fast.MIRROR.index("sessions_untracked")] += other.rows[k, 0]

    def count(self, name: str) -> int:
        return int(self.counts[_fast.MIRROR.index(name)])

    @property
    def encapsulated(self) -> dict[str, int]:
        """Frames per encapsulation taken off (only those seen)."""
        return {name: int(v) for name, v in zip(_fast.MIRROR[:6], self.counts[:6].tolist()) if v}

    def sessions(self) -> list[dict]:
        """Each GRE-sequenced mirror session: its name and counts (frames, lost, late, ...)."""
        cols = _fast.SESSION_COLUMNS
        return [{"session": session_name(self.keys[k]), **{c: int(v) for c, v in zip(cols, self.rows[k].tolist())
                                                           if c != "last_seq"}}
                for k in range(int(self.used[0]))]

    @property
    def lost(self) -> int:
        """Frames the mirror lost between the switch and the capture, from its sequence numbers."""
        return int(self.rows[:int(self.used[0]), _fast.SESSION_COLUMNS.index("lost")].sum())

    @property
    def truncated(self) -> int:
        """Frames the switch cut: ERSPAN T bits and frames shorter than their IP header."""
        return self.count("erspan_truncated") + self.cut

    def to_dict(self) -> dict:
        return {"encapsulated": self.encapsulated, "lost_frames": self.lost, "truncated_frames": self.truncated,
                "erspan_truncated": self.count("erspan_truncated"), "mirror_truncated": self.cut,
                "sessions": self.sessions(), "sessions_untracked": self.count("sessions_untracked")}

    def lines(self) -> list[str]:
        """The report's text: nothing for a bare mirror that lost and cut nothing."""
        out = []
        if self.encapsulated:
            out.append("mirror encapsulation: " + ", ".join(f"{k} {v}" for k, v in self.encapsulated.items()))
        for s in self.sessions():
            extra = "".join(f", {s[k]} {k}" for k in ("late", "duplicate", "restarts") if s[k])
            out.append(f"mirror session {s['session']}: {s['frames']} frames, {s['lost']} lost on the way{extra}")
        if self.count("sessions_untracked"):
            out.append(f"mirror sessions beyond {MAX_SESSIONS}: {self.count('sessions_untracked')} sequenced frames "
                       "not checked for loss")
        if self.truncated:
            out.append(f"mirror truncation: {self.truncated} frames cut by the switch "
                       f"({self.count('erspan_truncated')} with ERSPAN's T bit, {self.cut} shorter than their "
                       "IP header)")
        return out


def session_name(key: np.ndarray) -> str:
    """'erspan2 10.0.0.1>10.0.0.2 session 7' from a session key (see _fast._gre)."""
    raw, at = bytes(key), _fast.SESSION_KEY

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


def truncation_advice(health: MirrorHealth) -> str | None:
    """What to tell the operator, once, when the switch cuts mirror copies: a cut RoCE packet
    can never be followed, so every iteration it carries is lost to the replica."""
    if not health.truncated:
        return None
    return (f"the mirror truncates: {health.truncated} frames arrived cut by the switch "
            f"({health.count('erspan_truncated')} with ERSPAN's truncated bit, {health.cut} shorter than their IP "
            "header); a cut RoCE packet can never be followed, so no iteration it carries can be checkpointed. "
            "Let the mirror session carry whole frames: raise its MTU to the RoCE frame size plus the encapsulation "
            "(NX-OS: `monitor session N` / `mtu 9216`, or no `mtu` line; Arista: no `truncate` on the monitor "
            "session; SONiC/Cumulus: the session's destination and underlay MTU at least 4096 + 62 bytes), and "
            "the MTU of every underlay link between the switch and this port")
