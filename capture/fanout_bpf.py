"""The AF_PACKET split's classic BPF programs: the packet decoder's walk to the mirrored flow's UDP
source port, in the kernel.

A frame's worker is its UDP source port mod N as ``parser.split.flow_ports`` reads it (the
compiled walk the decoder runs): Ethernet with up to two VLAN tags, IPv4 (version 4, IHL of at
least 5, not a fragment) or IPv6, UDP; through one mirror encapsulation, the inner frame's: GRE
(no routing, version 0; checksum, key and sequence words skipped) carrying ERSPAN type I, II,
III (and its platform sub-header), gretap or a vendor protocol with a fixed header, or UDP to the
VXLAN port; the encapsulated frame ends where its outer IP packet (VXLAN: UDP datagram) ends.
Everything else, and any header cut short, is worker 0's. The facts (offsets, EtherTypes,
protocol numbers, what to take off) come as ``walk``, a dict ``parser.encap.split_walk`` makes
from the header tables, so no offset is written here.

Registers: X holds the position of the header being read (loads are X-relative), scratch
memory the bound the frame's headers must fit in, the IP end, the protocol, the GRE flags.
"""

from __future__ import annotations

_LD, _LDX, _ST, _STX, _ALU, _JMP, _RET, _MISC = 0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07
_W, _H, _B = 0x00, 0x08, 0x10
_IMM, _ABS, _IND, _MEM, _LEN = 0x00, 0x20, 0x40, 0x60, 0x80
_ADD, _SUB, _RSH, _AND, _LSH, _MOD = 0x00, 0x10, 0x70, 0x50, 0x60, 0x90
_JA, _JEQ, _JGE, _JSET = 0x00, 0x10, 0x30, 0x40
_K, _X, _A = 0x00, 0x08, 0x10
_TAX, _TXA = 0x00, 0x80
_SKF_LL_OFF = -0x200000  # loads relative to the link-layer (MAC) header
_SKF_AD_VLAN_TAG_PRESENT = -0x1000 + 48  # 1 when the kernel holds an outer tag apart
M_END, M_IP_END, M_PROTO, M_FLAGS, M_GRE_PROTO, M_POS, M_TMP = range(7)  # scratch memory words


class _Asm:
    """Instructions with labels; a conditional jump reaches only the next 255 instructions, so
    the far ones go through an unconditional jump (``goto_if``, ``fail_unless``)."""

    def __init__(self):
        self.code: list[list] = []
        self.labels: dict[str, int] = {}

    def op(self, c, k=0, jt=0, jf=0):
        self.code.append([c, jt, jf, k if isinstance(k, str) else k & 0xFFFFFFFF])

    def at(self, name):
        self.labels[name] = len(self.code)

    def goto(self, label):
        self.op(_JMP | _JA, label)

    def goto_if(self, cond, k, label):
        """Jump to ``label`` when A ``cond`` k (a JEQ, JGE or JSET) holds."""
        self.op(_JMP | cond | _K, k, 0, 1)
        self.goto(label)

    def fail_unless(self, cond, k, src=_K):
        """Worker 0 unless A ``cond`` k (or X with src=_X) holds."""
        self.op(_JMP | cond | src, k, 1, 0)
        self.goto("zero")

    def rows(self):
        out = []
        for i, (c, jt, jf, k) in enumerate(self.code):
            jt, jf, k = (self.labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf, k))
            assert 0 <= jt < 256 and 0 <= jf < 256, "jump out of range"
            out.append((c, jt, jf, k & 0xFFFFFFFF))
        return out


def fanout_program(workers: int, worker: int | None, walk: dict) -> list[tuple[int, int, int, int]]:
    """The program of the split as (code, jt, jf, k) rows.

    `worker` None: the fanout program (run with the packet data at the network header, the way
    the kernel runs it on received frames), returning the frame's worker. Otherwise the socket
    filter of member `worker` (data at the MAC header): the whole frame when the frame is that
    worker's, nothing else. The outer EtherType is read at MAC header + 12 (after the outer tag,
    which the kernel moved into metadata); the tags still in the data make at most two with it."""
    w = walk
    net = 0 if worker is None else w["eth_size"]  # where the network header is in the program's data
    a = _Asm()
    op = a.op

    def need(n):
        """The header at X holds n bytes before the bound (else worker 0); clobbers A."""
        op(_LD | _MEM, M_END)
        a.fail_unless(_JGE, n)
        op(_ALU | _SUB | _K, n)
        a.fail_unless(_JGE, 0, _X)

    def x_plus(n):
        op(_MISC | _TXA)
        op(_ALU | _ADD | _K, n)
        op(_MISC | _TAX)

    def fits(mem):
        """The end in scratch word ``mem`` lies within the bound (else worker 0); X kept."""
        op(_STX, M_POS)
        op(_LDX | _MEM, mem)
        op(_LD | _MEM, M_END)
        a.fail_unless(_JGE, 0, _X)
        op(_LDX | _MEM, M_POS)

    # -- the outer Ethernet header: tags moved out by the kernel, then in the data ------------
    op(_LD | _W | _LEN)
    op(_ST, M_END)
    op(_LD | _H | _ABS, _SKF_LL_OFF + w["eth_type_at"])

    def dispatch(base: int, next_tag: str | None):
        """A holds the EtherType of the header ending at `base`."""
        op(_LDX | _IMM, base)
        a.goto_if(_JEQ, w["ipv4"], "ip4_outer")
        a.goto_if(_JEQ, w["ipv6"], "ip6_outer")
        if next_tag is None:
            a.goto("zero")
            return
        a.goto_if(_JEQ, w["tpids"][0], next_tag)
        a.goto_if(_JEQ, w["tpids"][1], next_tag)
        a.goto("zero")

    dispatch(net, "tag1")
    a.at("tag1")  # one tag in the data (the outer one, if any, is in metadata)
    op(_LDX | _IMM, net)
    need(w["vlan_size"])
    op(_LD | _H | _ABS, net + w["vlan_type_at"])
    dispatch(net + w["vlan_size"], "tag2")
    a.at("tag2")  # a second tag in the data: only if the kernel holds none apart
    op(_LD | _W | _ABS, _SKF_AD_VLAN_TAG_PRESENT)
    a.fail_unless(_JEQ, 0)
    op(_LDX | _IMM, net + w["vlan_size"])
    need(w["vlan_size"])
    op(_LD | _H | _ABS, net + w["vlan_size"] + w["vlan_type_at"])
    dispatch(net + 2 * w["vlan_size"], None)

    # -- IP headers (X at the IP header): its end and protocol to scratch, X to its payload ---
    def ip(prefix: str, then: str):
        a.at(f"ip4_{prefix}")
        need(w["ipv4_size"])
        op(_LD | _B | _IND, w["ipv4_vihl_at"])
        op(_ALU | _RSH | _K, 4)
        a.fail_unless(_JEQ, 4)
        op(_LD | _B | _IND, w["ipv4_vihl_at"])
        op(_ALU | _AND | _K, 0x0F)
        a.fail_unless(_JGE, 5)
        op(_LD | _H | _IND, w["ipv4_frag_at"])
        op(_ALU | _AND | _K, w["ipv4_frag_mask"])
        a.fail_unless(_JEQ, 0)
        op(_LD | _H | _IND, w["ipv4_total_len_at"])
        op(_ALU | _ADD | _X)
        op(_ST, M_IP_END)
        op(_LD | _B | _IND, w["ipv4_proto_at"])
        op(_ST, M_PROTO)
        op(_LD | _B | _IND, w["ipv4_vihl_at"])
        op(_ALU | _AND | _K, 0x0F)
        op(_ALU | _LSH | _K, 2)
        op(_ALU | _ADD | _X)
        op(_MISC | _TAX)
        a.goto(then)
        a.at(f"ip6_{prefix}")
        need(w["ipv6_size"])
        op(_LD | _H | _IND, w["ipv6_payload_len_at"])
        op(_ALU | _ADD | _K, w["ipv6_size"])
        op(_ALU | _ADD | _X)
        op(_ST, M_IP_END)
        op(_LD | _B | _IND, w["ipv6_next_at"])
        op(_ST, M_PROTO)
        x_plus(w["ipv6_size"])
        a.goto(then)

    ip("outer", "l4_outer")
    a.at("l4_outer")  # X at the transport header
    op(_LD | _MEM, M_PROTO)
    a.goto_if(_JEQ, w["udp"], "udp_outer")
    gre_on = w["erspan"] or w["gretap"] or w["vendor_protocol"] >= 0
    if gre_on:
        a.goto_if(_JEQ, w["gre"], "gre")
    a.goto("zero")

    a.at("udp_outer")
    need(w["udp_size"])
    if w["vxlan_port"] >= 0:
        op(_LD | _H | _IND, w["udp_dport_at"])
        a.goto_if(_JEQ, w["roce_port"], "sport")
        a.goto_if(_JEQ, w["vxlan_port"], "vxlan")
    a.goto("sport")

    if w["vxlan_port"] >= 0:
        a.at("vxlan")  # the datagram within the packet, the packet within the frame, a valid VNI
        fits(M_IP_END)
        op(_LD | _H | _IND, w["udp_len_at"])
        a.fail_unless(_JGE, w["udp_size"] + w["vxlan_size"])
        op(_ALU | _ADD | _X)
        op(_ST, M_TMP)
        op(_STX, M_POS)
        op(_LDX | _MEM, M_TMP)
        op(_LD | _MEM, M_IP_END)
        a.fail_unless(_JGE, 0, _X)
        op(_LD | _MEM, M_TMP)
        op(_ST, M_END)  # the encapsulated frame ends with the datagram
        op(_LDX | _MEM, M_POS)
        op(_LD | _B | _IND, w["udp_size"] + w["vxlan_flags_at"])
        op(_JMP | _JSET | _K, w["vxlan_valid"], 1, 0)
        a.goto("zero")
        x_plus(w["udp_size"] + w["vxlan_size"])
        a.goto("inner")

    if gre_on:
        a.at("gre")  # X at the GRE header
        fits(M_IP_END)
        op(_LD | _MEM, M_IP_END)
        op(_ST, M_END)  # the encapsulated frame ends with the outer packet
        need(w["gre_size"])
        op(_LD | _H | _IND, w["gre_proto_at"])
        op(_ST, M_GRE_PROTO)
        op(_LD | _H | _IND, w["gre_flags_at"])
        op(_ST, M_FLAGS)
        op(_JMP | _JSET | _K, w["gre_reject"], 0, 1)
        a.goto("zero")
        x_plus(w["gre_size"])
        for bit in w["gre_words"]:  # checksum, key, sequence number
            op(_LD | _MEM, M_FLAGS)
            op(_JMP | _JSET | _K, bit, 0, 3)  # absent: past the next 3
            x_plus(w["gre_word"])
        need(0)
        op(_LD | _MEM, M_GRE_PROTO)
        if w["vendor_protocol"] >= 0:  # first: a configured protocol overrides the built-in rules
            a.goto_if(_JEQ, w["vendor_protocol"], "vendor")
        if w["erspan"]:
            a.goto_if(_JEQ, w["erspan_protocol"], "erspan2")
            a.goto_if(_JEQ, w["erspan3_protocol"], "erspan3")
        if w["gretap"]:
            a.goto_if(_JEQ, w["gretap_protocol"], "inner")
        a.goto("zero")
        if w["erspan"]:
            a.at("erspan2")  # type I without a sequence number, else type II
            op(_LD | _MEM, M_FLAGS)
            op(_JMP | _JSET | _K, w["gre_sequence"], 1, 0)
            a.goto("inner")
            need(w["erspan2_size"])
            op(_LD | _H | _IND, w["erspan_ver_at"])
            op(_ALU | _RSH | _K, w["erspan_ver_shift"])
            a.fail_unless(_JEQ, w["erspan2_version"])
            x_plus(w["erspan2_size"])
            a.goto("inner")
            a.at("erspan3")
            need(w["erspan3_size"])
            op(_LD | _H | _IND, w["erspan_ver_at"])
            op(_ALU | _RSH | _K, w["erspan_ver_shift"])
            a.fail_unless(_JEQ, w["erspan3_version"])
            op(_LD | _H | _IND, w["erspan3_flags_at"])
            op(_JMP | _JSET | _K, w["erspan3_o"], 0, 3)
            x_plus(w["erspan3_platform_size"])
            x_plus(w["erspan3_size"])
            need(0)
            a.goto("inner")
        if w["vendor_protocol"] >= 0:
            a.at("vendor")
            x_plus(w["vendor_bytes"])
            need(0)
            a.goto("inner")

    # -- the encapsulated frame (X at its Ethernet header): up to two tags, IP, then UDP only --
    a.at("inner")
    need(w["eth_size"])
    for tag in range(3):
        op(_LD | _H | _IND, w["eth_type_at"])
        for etype, where in ((w["ipv4"], "ip4_inner"), (w["ipv6"], "ip6_inner")):
            op(_JMP | _JEQ | _K, etype, 0, 4)  # else past the next 4
            x_plus(w["eth_size"])
            a.goto(where)
        if tag == 2:
            a.goto("zero")
            break
        op(_JMP | _JEQ | _K, w["tpids"][0], 2, 0)  # a tag: past the next test
        a.fail_unless(_JEQ, w["tpids"][1])
        x_plus(w["vlan_size"])
        need(w["eth_size"])
    ip("inner", "l4_inner")
    a.at("l4_inner")
    op(_LD | _MEM, M_PROTO)
    a.fail_unless(_JEQ, w["udp"])
    need(w["udp_size"])

    a.at("sport")  # X at a UDP header within the bound
    op(_LD | _H | _IND, w["udp_sport_at"])
    op(_ALU | _MOD | _K, int(workers))
    if worker is None:
        op(_RET | _A)
        a.at("zero")
        op(_RET | _K, 0)
    else:
        op(_JMP | _JEQ | _K, int(worker), 0, 1)
        op(_RET | _K, 0xFFFFFFFF)  # the whole frame
        op(_RET | _K, 0)
        a.at("zero")  # a frame without a UDP source port is worker 0's
        op(_RET | _K, 0xFFFFFFFF if worker == 0 else 0)
    return a.rows()
