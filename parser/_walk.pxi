# The compiled frame walk shared by every wire: Ethernet, VLAN tags, a remote mirror's encapsulation
# (ERSPAN I/II/III, GRE, VXLAN) and IP, to a frame's transport header. Included by parser/_inner.pyx
# (the mirrored frames and flow ports every transport reads) and parser/roce/_fast.pyx (the RoCEv2
# decode); each module holds its own copy of the K table, set from parser.headers by its configure().

# Field offsets are not written here: each including module's configure() takes them from the
# tables of parser.headers (parser.encap.WALK_OFFSETS).

cdef int64_t[96] K  # field offsets, EtherTypes and protocol numbers, indexed by the K_* constants below
DEF K_ETH_TYPE = 0
DEF K_ETH_SIZE = 1
DEF K_VLAN_TYPE = 2
DEF K_VLAN_SIZE = 3
DEF K_V4_VIHL = 4
DEF K_V4_TOTLEN = 5
DEF K_V4_FRAG = 6
DEF K_V4_PROTO = 7
DEF K_V4_SRC = 8
DEF K_V4_DST = 9
DEF K_V4_SIZE = 10
DEF K_V6_PLEN = 11
DEF K_V6_NEXT = 12
DEF K_V6_SRC = 13
DEF K_V6_DST = 14
DEF K_V6_SIZE = 15
DEF K_UDP_SPORT = 16
DEF K_UDP_DPORT = 17
DEF K_UDP_LEN = 18
DEF K_UDP_SIZE = 19
DEF K_BTH_OPCODE = 20
DEF K_BTH_FLAGS = 21
DEF K_BTH_DQP = 22
DEF K_BTH_ACKREQ = 23
DEF K_BTH_PSN = 24
DEF K_BTH_SIZE = 25
DEF K_RETH_VA = 26
DEF K_RETH_RKEY = 27
DEF K_RETH_DLEN = 28
DEF K_RETH_SIZE = 29
DEF K_IMM_SIZE = 30
DEF K_AETH_SYN = 31
DEF K_AETH_MSN = 32
DEF K_AETH_SIZE = 33
DEF K_DETH_SIZE = 34
DEF K_ICRC = 35
DEF K_ROCE_PORT = 36
DEF K_PTP_EVENT = 37
DEF K_PTP_GENERAL = 38
DEF K_ET_IPV4 = 39
DEF K_ET_IPV6 = 40
DEF K_ET_VLAN = 41
DEF K_ET_QINQ = 42
DEF K_ET_ARP = 43
DEF K_ET_LLDP = 44
DEF K_ET_PTP = 45
DEF K_IP_TCP = 46
DEF K_IP_UDP = 47
DEF K_IP_GRE = 48
DEF K_GRE_FLAGS = 49
DEF K_GRE_PROTO = 50
DEF K_GRE_SIZE = 51
DEF K_GRE_WORD = 52
DEF K_GRE_CSUM = 53
DEF K_GRE_ROUTING = 54
DEF K_GRE_KEY = 55
DEF K_GRE_SEQ = 56
DEF K_GRE_VERSION = 57
DEF K_GP_ERSPAN = 58
DEF K_GP_ERSPAN3 = 59
DEF K_GP_TEB = 60
DEF K_ER_VERVLAN = 61
DEF K_ER_SESSION = 62
DEF K_ER2_SIZE = 63
DEF K_ER3_FLAGS = 64
DEF K_ER3_SIZE = 65
DEF K_ER3_SUB_SIZE = 66
DEF K_ER_VER_SHIFT = 67
DEF K_ER_V2 = 68
DEF K_ER_V3 = 69
DEF K_ER_T = 70
DEF K_ER_SESSION_MASK = 71
DEF K_ER3_O = 72
DEF K_VX_FLAGS = 73
DEF K_VX_SIZE = 74
DEF K_VX_VALID = 75
DEF K_V4_FRAGMENT = 76
DEF K_NKEYS = 77

# Frame classes counted by decode (index into the `classes` output). "mirror_truncated": the IP
# header says more than arrived, though the capture kept the whole frame (a mirror session's MTU
# cut it); "gre_other": GRE not taken as a mirror encapsulation.
CLASSES = ("roce", "truncated", "not_ethernet", "arp", "lldp", "llc_stp", "ptp_l2", "ethertype_other",
           "ipv4_fragment", "tcp", "ip_other", "udp_ptp_event", "udp_ptp_general", "udp_other",
           "malformed:short_ethernet", "malformed:short_vlan", "malformed:bad_ipv4_header",
           "malformed:short_ip", "malformed:short_udp", "malformed:bad_udp_length",
           "malformed:short_roce_headers", "mirror_truncated", "gre_other", "malformed:short_gre",
           "malformed:bad_gre", "malformed:short_erspan", "malformed:bad_erspan_version",
           "malformed:bad_vxlan")
DEF C_ROCE = 0
DEF C_TRUNC = 1
DEF C_NOT_ETH = 2
DEF C_ARP = 3
DEF C_LLDP = 4
DEF C_LLC = 5
DEF C_PTP_L2 = 6
DEF C_ETYPE_OTHER = 7
DEF C_FRAG = 8
DEF C_TCP = 9
DEF C_IP_OTHER = 10
DEF C_PTP_EV = 11
DEF C_PTP_GEN = 12
DEF C_UDP_OTHER = 13
DEF M_SHORT_ETH = 14
DEF M_SHORT_VLAN = 15
DEF M_BAD_V4 = 16
DEF M_SHORT_IP = 17
DEF M_SHORT_UDP = 18
DEF M_BAD_ULEN = 19
DEF M_SHORT_ROCE = 20
DEF C_MIRROR_TRUNC = 21
DEF C_GRE_OTHER = 22
DEF M_SHORT_GRE = 23
DEF M_BAD_GRE = 24
DEF M_SHORT_ERSPAN = 25
DEF M_BAD_ERSPAN = 26
DEF M_BAD_VXLAN = 27
DEF NCLASSES = 28

# The encapsulations a call may take off (parser.encap.table), indexed by E_*: ERSPAN I/II/III on
# or off, gretap on or off, a vendor's GRE protocol (-1: none) and its header bytes, the VXLAN
# UDP port (-1: none).
DEF E_ERSPAN = 0
DEF E_GRETAP = 1
DEF E_VENDOR_PROTO = 2
DEF E_VENDOR_BYTES = 3
DEF E_VXLAN_PORT = 4
DEF E_SIZE = 5

# What the encapsulations showed (the `mirror` output): frames per encapsulation, frames whose
# ERSPAN T bit says the switch cut them, sequenced frames of sessions beyond the session table,
# frames shorter than their IP header without a T bit (with the T bits: every frame cut).
MIRROR = ("erspan1", "erspan2", "erspan3", "gretap", "gre_vendor", "vxlan", "erspan_truncated",
          "sessions_untracked", "cut_unmarked")
DEF X_ERSPAN1 = 0
DEF X_ERSPAN2 = 1
DEF X_ERSPAN3 = 2
DEF X_GRETAP = 3
DEF X_VENDOR = 4
DEF X_VXLAN = 5
DEF X_TBIT = 6
DEF X_UNTRACKED = 7
DEF X_CUT_UNMARKED = 8
DEF NMIRROR = 9

# Mirror sessions with GRE sequence numbers, one row each: the key (outer source and destination
# as IPv6 or IPv4-mapped, GRE protocol, encapsulation, GRE key, ERSPAN session id) and the counts.
SESSION_KEY_BYTES = 48
SESSION_KEY = {"src": 0, "dst": 16, "gre_protocol": 32, "kind": 34, "gre_key": 36, "erspan_session": 40}
SESSION_COLUMNS = ("frames", "last_seq", "lost", "late", "duplicate", "restarts")
DEF KEY_BYTES = 48
DEF KEY_PROTO = 32
DEF KEY_KIND = 34
DEF KEY_GRE = 36
DEF KEY_ERSPAN = 40
DEF KEY_REST = 42
DEF S_FRAMES = 0
DEF S_LAST = 1
DEF S_LOST = 2
DEF S_LATE = 3
DEF S_DUP = 4
DEF S_RESTART = 5
DEF NSCOLS = 6
# A sequence number this far behind the session's newest is a late (reordered) frame; further
# behind, the session restarted its numbering (a mirror's path reorders little, if at all).
DEF REORDER_WINDOW = 64


cdef extern from * nogil:
    """
    #include <stdint.h>
    #include <string.h>
    /* Big-endian fields by one unaligned load and a byte swap (x86 and any GCC/Clang target). */
    static inline uint64_t mck_be(const uint8_t *p, int n) {
        uint64_t v;
        uint32_t w;
        uint16_t h;
        switch (n) {
        case 1: return p[0];
        case 2: memcpy(&h, p, 2); return __builtin_bswap16(h);
        case 3: return ((uint64_t)p[0] << 16) | ((uint64_t)p[1] << 8) | p[2];
        case 4: memcpy(&w, p, 4); return __builtin_bswap32(w);
        case 8: memcpy(&v, p, 8); return __builtin_bswap64(v);
        default: v = 0; for (int i = 0; i < n; i++) v = (v << 8) | p[i]; return v;
        }
    }
    /* Every 64-byte line of [p, p + n) towards the cache; never faults. */
    static inline void mck_prefetch(const uint8_t *p, int64_t n) {
        for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(p + i, 0, 3);
    }
    """
    uint64_t mck_be(const uint8_t *p, int n)
    void mck_prefetch(const uint8_t *p, int64_t n)


cdef inline uint64_t be(const uint8_t *p, int n) noexcept nogil:
    return mck_be(p, n)




cdef struct Walk:
    int64_t l2  # the (innermost) Ethernet header
    int64_t end  # where that frame's bytes end (an encapsulated frame: its outer IP's or UDP's end)
    int64_t l3
    int64_t hl
    int64_t ip_end  # where the IP header says the packet ends
    int64_t l4
    int64_t etype
    int64_t proto
    int64_t outer_l3  # the outer IP header of an encapsulated frame (-1: none)
    bint v6
    bint outer_v6
    bint marked  # ERSPAN's T bit: the switch says it cut the frame


cdef struct Sessions:
    uint8_t *keys  # cap x KEY_BYTES
    int64_t *rows  # cap x NSCOLS
    int64_t *used  # [0]: rows in use
    int64_t cap
    int64_t last  # the row matched last (a mirror's frames come from one session in runs)


cdef inline void _addr_key(uint8_t *key, const uint8_t *p, int64_t l3, bint v6) noexcept nogil:
    """The IP header's source and destination into key[0:32], IPv4 as mapped IPv6."""
    cdef int k
    if v6:
        memcpy(key, p + l3 + K[K_V6_SRC], 16)
        memcpy(key + 16, p + l3 + K[K_V6_DST], 16)
        return
    for k in range(10):
        key[k] = 0
        key[16 + k] = 0
    key[10] = key[11] = key[26] = key[27] = 0xFF
    memcpy(key + 12, p + l3 + K[K_V4_SRC], 4)
    memcpy(key + 28, p + l3 + K[K_V4_DST], 4)


cdef inline void _sequence(Sessions *ss, int64_t *mirror, const uint8_t *key, uint32_t seq) noexcept nogil:
    """One sequenced frame of the session ``key``: a gap is frames the mirror lost on its way here."""
    cdef int64_t i = ss.last, n = ss.used[0], k
    cdef int64_t *row
    cdef uint32_t ahead, behind
    if i < 0 or i >= n or memcmp(ss.keys + i * KEY_BYTES, key, KEY_BYTES) != 0:
        i = -1
        for k in range(n):
            if memcmp(ss.keys + k * KEY_BYTES, key, KEY_BYTES) == 0:
                i = k
                break
        if i < 0:
            if n >= ss.cap:
                mirror[X_UNTRACKED] += 1
                return
            i = n
            ss.used[0] = n + 1
            memcpy(ss.keys + i * KEY_BYTES, key, KEY_BYTES)
            memset(ss.rows + i * NSCOLS, 0, NSCOLS * sizeof(int64_t))
        ss.last = i
    row = ss.rows + i * NSCOLS
    if row[S_FRAMES] == 0:
        row[S_LAST] = seq
    else:
        ahead = seq - <uint32_t>row[S_LAST]
        behind = <uint32_t>row[S_LAST] - seq
        if ahead == 0:
            row[S_DUP] += 1
        elif ahead < 0x80000000u:
            row[S_LOST] += ahead - 1
            row[S_LAST] = seq
        elif behind <= REORDER_WINDOW:
            row[S_LATE] += 1  # counted lost when its successors came: it was not
            if row[S_LOST] > 0:
                row[S_LOST] -= 1
        else:
            row[S_RESTART] += 1
            row[S_LAST] = seq
    row[S_FRAMES] += 1


cdef inline int64_t _gre(const uint8_t *p, int64_t l3, bint v6, int64_t g, int64_t end,
                         const int64_t *enc, int64_t *mirror, Sessions *ss, Walk *w) noexcept nogil:
    """The mirrored frame inside the GRE packet at ``g`` (its IP header at ``l3``, its bytes up to
    ``end``): the offset of its Ethernet header, or minus the class of a GRE packet not taken off."""
    cdef int64_t flags, proto, h, seq_at = -1, key_at = -1, inner, er, kind, sess = 0
    cdef uint8_t key[KEY_BYTES]
    if g + K[K_GRE_SIZE] > end:
        return -M_SHORT_GRE
    flags = be(p + g + K[K_GRE_FLAGS], 2)
    proto = be(p + g + K[K_GRE_PROTO], 2)
    if flags & (K[K_GRE_VERSION] | K[K_GRE_ROUTING]):
        return -M_BAD_GRE  # GRE version 1 (PPTP) or source routing: not a mirror's
    h = g + K[K_GRE_SIZE]
    if flags & K[K_GRE_CSUM]:
        h += K[K_GRE_WORD]
    if flags & K[K_GRE_KEY]:
        key_at = h
        h += K[K_GRE_WORD]
    if flags & K[K_GRE_SEQ]:
        seq_at = h
        h += K[K_GRE_WORD]
    if h > end:
        return -M_SHORT_GRE
    if proto == enc[E_VENDOR_PROTO]:  # first: a configured protocol overrides the built-in rules
        kind, inner = X_VENDOR, h + enc[E_VENDOR_BYTES]
        if inner > end:
            return -M_SHORT_GRE
    elif proto == K[K_GP_ERSPAN] and enc[E_ERSPAN]:
        if seq_at < 0:  # type I: no sequence number, no ERSPAN header
            kind, inner = X_ERSPAN1, h
        else:
            if h + K[K_ER2_SIZE] > end:
                return -M_SHORT_ERSPAN
            if (be(p + h + K[K_ER_VERVLAN], 2) >> K[K_ER_VER_SHIFT]) != K[K_ER_V2]:
                return -M_BAD_ERSPAN
            kind, inner, sess = X_ERSPAN2, h + K[K_ER2_SIZE], be(p + h + K[K_ER_SESSION], 2)
    elif proto == K[K_GP_ERSPAN3] and enc[E_ERSPAN]:
        if h + K[K_ER3_SIZE] > end:
            return -M_SHORT_ERSPAN
        if (be(p + h + K[K_ER_VERVLAN], 2) >> K[K_ER_VER_SHIFT]) != K[K_ER_V3]:
            return -M_BAD_ERSPAN
        kind, inner, sess = X_ERSPAN3, h + K[K_ER3_SIZE], be(p + h + K[K_ER_SESSION], 2)
        if be(p + h + K[K_ER3_FLAGS], 2) & K[K_ER3_O]:
            inner += K[K_ER3_SUB_SIZE]
        if inner > end:
            return -M_SHORT_ERSPAN
    elif proto == K[K_GP_TEB] and enc[E_GRETAP]:
        kind, inner = X_GRETAP, h
    else:
        return -C_GRE_OTHER
    mirror[kind] += 1
    if sess & K[K_ER_T]:
        mirror[X_TBIT] += 1
        w.marked = True
    if seq_at >= 0 and ss != NULL:
        _addr_key(key, p, l3, v6)  # [0, 32)
        key[KEY_PROTO] = <uint8_t>(proto >> 8)
        key[KEY_PROTO + 1] = <uint8_t>proto
        key[KEY_KIND] = <uint8_t>kind
        key[KEY_KIND + 1] = 0
        if key_at >= 0:
            memcpy(key + KEY_GRE, p + key_at, 4)
        else:
            memset(key + KEY_GRE, 0, 4)
        er = sess & K[K_ER_SESSION_MASK]
        key[KEY_ERSPAN] = <uint8_t>(er >> 8)
        key[KEY_ERSPAN + 1] = <uint8_t>er
        memset(key + KEY_REST, 0, KEY_BYTES - KEY_REST)
        _sequence(ss, mirror, key, <uint32_t>be(p + seq_at, 4))
    return inner


cdef inline int _walk(const uint8_t *p, int64_t base, int64_t end, const int64_t *enc, int64_t *mirror,
                      Sessions *ss, Walk *w) noexcept nogil:
    """Walks the frame at ``base`` (its bytes up to ``end``) from Ethernet to its transport header,
    through one mirror encapsulation that ``enc`` allows; returns its class. C_ROCE: a UDP datagram
    to the RoCEv2 port; ``w`` then holds the innermost frame's offsets (l4 also for other UDP and
    TCP). Encapsulations and GRE sequence numbers are counted into ``mirror`` and ``ss`` (NULL: no
    sessions followed)."""
    cdef int64_t l2 = base, l3, etype, hl, ip_end, proto, l4, dport, ulen, inner, h
    cdef int depth, k
    cdef bint v6
    w.outer_l3 = -1
    w.marked = False
    for depth in range(2):
        w.l2, w.end = l2, end
        if l2 + K[K_ETH_SIZE] > end:
            return M_SHORT_ETH
        etype = be(p + l2 + K[K_ETH_TYPE], 2)
        l3 = l2 + K[K_ETH_SIZE]
        for k in range(2):  # up to two VLAN tags (802.1Q, 802.1ad)
            if etype != K[K_ET_VLAN] and etype != K[K_ET_QINQ]:
                break
            if l3 + K[K_VLAN_SIZE] > end:
                return M_SHORT_VLAN
            etype = be(p + l3 + K[K_VLAN_TYPE], 2)
            l3 += K[K_VLAN_SIZE]
        w.etype = etype
        if etype == K[K_ET_IPV4]:
            if l3 + K[K_V4_SIZE] > end:
                return M_SHORT_IP
            h = p[l3 + K[K_V4_VIHL]]
            if (h >> 4) != 4 or (h & 15) < 5:
                return M_BAD_V4
            hl = (h & 15) * 4
            if be(p + l3 + K[K_V4_FRAG], 2) & K[K_V4_FRAGMENT]:
                return C_FRAG
            proto = p[l3 + K[K_V4_PROTO]]
            ip_end = l3 + <int64_t>be(p + l3 + K[K_V4_TOTLEN], 2)
            v6 = False
        elif etype == K[K_ET_IPV6]:
            if l3 + K[K_V6_SIZE] > end:
                return M_SHORT_IP
            hl = K[K_V6_SIZE]
            proto = p[l3 + K[K_V6_NEXT]]
            ip_end = l3 + hl + <int64_t>be(p + l3 + K[K_V6_PLEN], 2)
            v6 = True
        elif etype < 0x0600:
            return C_LLC
        elif etype == K[K_ET_ARP]:
            return C_ARP
        elif etype == K[K_ET_LLDP]:
            return C_LLDP
        elif etype == K[K_ET_PTP]:
            return C_PTP_L2
        else:
            return C_ETYPE_OTHER
        l4 = l3 + hl
        w.l3, w.hl, w.ip_end, w.l4, w.proto, w.v6 = l3, hl, ip_end, l4, proto, v6
        if proto == K[K_IP_UDP]:
            if l4 + K[K_UDP_SIZE] > end:
                return M_SHORT_UDP
            dport = be(p + l4 + K[K_UDP_DPORT], 2)
            if dport == K[K_ROCE_PORT]:
                return C_ROCE
            if depth == 0 and dport == enc[E_VXLAN_PORT]:
                if ip_end > end:
                    return C_MIRROR_TRUNC
                ulen = be(p + l4 + K[K_UDP_LEN], 2)
                if ulen < K[K_UDP_SIZE] + K[K_VX_SIZE] or l4 + ulen > ip_end:
                    return M_BAD_ULEN
                if not (p[l4 + K[K_UDP_SIZE] + K[K_VX_FLAGS]] & K[K_VX_VALID]):
                    return M_BAD_VXLAN
                mirror[X_VXLAN] += 1
                w.outer_l3, w.outer_v6 = l3, v6
                l2, end = l4 + K[K_UDP_SIZE] + K[K_VX_SIZE], l4 + ulen
                continue
            if dport == K[K_PTP_EVENT]:
                return C_PTP_EV
            if dport == K[K_PTP_GENERAL]:
                return C_PTP_GEN
            return C_UDP_OTHER
        if proto == K[K_IP_TCP]:
            return C_TCP
        if proto != K[K_IP_GRE]:
            return C_IP_OTHER
        if depth > 0 or not (enc[E_ERSPAN] or enc[E_GRETAP] or enc[E_VENDOR_PROTO] >= 0):
            return C_GRE_OTHER  # one encapsulation is taken off, not two
        if ip_end > end:
            return C_MIRROR_TRUNC
        inner = _gre(p, l3, v6, l4, ip_end, enc, mirror, ss, w)
        if inner < 0:
            return <int>(-inner)
        w.outer_l3, w.outer_v6 = l3, v6
        l2, end = inner, ip_end
    return C_GRE_OTHER


def _check_walk_state(const int64_t[::1] enc, int64_t[::1] mirror, uint8_t[:, ::1] session_keys,
                      int64_t[:, ::1] session_rows, int64_t[::1] sessions_used):
    if enc.shape[0] != E_SIZE or mirror.shape[0] != NMIRROR or sessions_used.shape[0] < 1 \
            or session_keys.shape[1] != KEY_BYTES or session_rows.shape[1] != NSCOLS \
            or session_keys.shape[0] != session_rows.shape[0] or session_rows.shape[0] < 1 \
            or not 0 <= sessions_used[0] <= session_rows.shape[0]:
        raise ValueError("the walk: encapsulation table or mirror state of the wrong shape")
