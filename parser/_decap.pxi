# The frame walk through a remote mirror's encapsulation (included by _fast.pyx, whose K_*, C_*,
# M_*, E_*, X_* and S_* constants and `be` it uses): from a frame's Ethernet header, through GRE
# (ERSPAN I/II/III, gretap, a vendor header) or VXLAN, to the mirrored frame's transport header,
# following each GRE-sequenced mirror session's numbering on the way.


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
