"""pcapng sections and interfaces around the compiled block walk.

The walk (`_walk.walk_pcapng`) handles packet blocks and skips the rest; it stops at section
headers (which may switch the byte order) and interface descriptions, parsed here in Python
because they are rare. Interface ids are per section; the reader numbers interfaces across
the file (section 2's interface 0 follows section 1's last), and that number is `iface`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from mirrorckpt.capture import _walk
from mirrorckpt.capture import formats as fmt
from mirrorckpt.capture._walk import Status
from mirrorckpt.capture.batch import CaptureError

# if_tsoffset is in seconds; beyond this the offset in ns no longer fits an int64.
MAX_TSOFFSET_S = 9_000_000_000


@dataclass(frozen=True)
class Interface:
    linktype: int
    snaplen: int
    tsresol: tuple[int, int]  # (base 10 or 2, exponent): one tick is base**-exponent s
    tsoffset: int = 0  # seconds added to every timestamp


def ticks_to_ns(ticks: np.ndarray, base: int, exp: int) -> np.ndarray:
    """uint64 ticks of base**-exp seconds to uint64 ns, rounded down (as Wireshark does).

    Exact for every exponent: the binary fraction is multiplied by 1e9 in two 32-bit halves so
    no product leaves 64 bits.
    """
    u = np.uint64
    if base == 10:
        if exp <= 9:
            return ticks * u(10 ** (9 - exp))
        if exp - 9 <= 19:
            return ticks // u(10 ** (exp - 9))
        return np.zeros_like(ticks)  # every uint64 tick count is below one ns
    if exp <= 32:
        frac = ticks & u((1 << exp) - 1)
        return (ticks >> u(exp)) * u(10**9) + ((frac * u(10**9)) >> u(exp))
    if exp < 64:
        whole = (ticks >> u(exp)) * u(10**9)
        frac = ticks & u((1 << exp) - 1)
    else:
        whole, frac = np.zeros_like(ticks), ticks
    # floor(frac * 1e9 / 2**exp) with frac = hi * 2**32 + lo, both halves below 2**32.
    part = (frac >> u(32)) * u(10**9) + (((frac & u(0xFFFFFFFF)) * u(10**9)) >> u(32))
    if exp - 32 >= 64:
        return whole
    return whole + (part >> u(exp - 32))


class PcapngBlocks:
    """Walk state of one pcapng file: position, section byte order, interfaces."""

    def __init__(self, name: str, buf: np.ndarray):
        self.name = name
        self.buf = buf
        self.pos = 0
        self.big = False
        self.interfaces: list[Interface] = []
        self.section_base = 0  # file-wide number of the section's interface 0
        self.sections = 0
        self.skipped = 0
        self.stride_min = _walk.STRIDE_MIN  # what the walk prefetches (CaptureReader.consumer_prefetches)

    @property
    def linktypes(self) -> dict[int, int]:
        return {i: itf.linktype for i, itf in enumerate(self.interfaces)}

    def fill(self, offset, caplen, wirelen, ts_ns, iface) -> tuple[int, CaptureError | None, bool]:
        """Fills the arrays from the current position: (frames, error after them, at end)."""
        ticks = np.empty(offset.shape[0], np.uint64)
        n, error, done = 0, None, False
        while True:
            local = len(self.interfaces) - self.section_base
            spb_snaplen = self.interfaces[self.section_base].snaplen if local else 0
            n, self.pos, status, a, b, skipped = _walk.walk_pcapng(
                self.buf, self.pos, self.big, self.section_base, local, spb_snaplen,
                fmt.MAX_CAPLEN, offset, caplen, wirelen, ticks, iface, n, self.stride_min)
            self.skipped += skipped
            try:
                if status == Status.AT_SHB:
                    self._section()
                    continue
                if status == Status.AT_IDB:
                    self._interface()
                    continue
            except CaptureError as e:
                error = e
                break
            done = status == Status.END
            if status >= Status.CUT_HEADER:
                error = CaptureError(self._message(status, a, b))
            break
        self._to_ns(ticks[:n], iface[:n], ts_ns[:n])
        return n, error, done

    def _to_ns(self, ticks, iface, out) -> None:
        groups: dict[tuple, list[int]] = {}
        for i, itf in enumerate(self.interfaces):
            groups.setdefault((itf.tsresol, itf.tsoffset), []).append(i)
        for ((base, exp), off_s), ids in groups.items():
            ns = ticks_to_ns(ticks, base, exp).view(np.int64) + np.int64(off_s * 10**9)
            if len(groups) == 1:
                out[:] = ns
            else:
                mask = np.isin(iface, np.asarray(ids, np.int32))
                out[mask] = ns[mask]

    def _fail(self, what: str) -> CaptureError:
        return CaptureError(f"{self.name}: {what}")

    def _message(self, status: int, a: int, b: int) -> str:
        pos = self.pos
        kind = "block"
        if len(self.buf) - pos >= 4:
            order = ">" if self.big else "<"
            kind = fmt.block_name(struct.unpack_from(order + "I", self.buf, pos)[0]) + " block"
        where = f"{self.name}: block at byte {pos}"
        if status == Status.CUT_HEADER:
            return f"{where} is cut short: {a} bytes left, a block header needs 8"
        if status == Status.SHORT:
            return f"{where} ({kind}) has length {a} (minimum {b})"
        if status == Status.UNALIGNED:
            return f"{where} ({kind}) has length {a}, not a multiple of 4"
        if status == Status.PAST_END:
            return f"{where} ({kind}) has length {a} but only {b} bytes are left in the file"
        if status == Status.TRAILER:
            return f"{where} ({kind}) has trailing length {a}, leading length {b}"
        if status == Status.CAPLEN_BODY:
            return f"{where} ({kind}) has captured length {a}, more than its {b} bytes of room"
        if status == Status.CAPLEN_MAX:
            return f"{where} ({kind}) has captured length {a} (more than {b})"
        if status == Status.IFACE:
            return (f"{where} ({kind}) refers to interface {a}, but its section has "
                    f"{b} interface description block(s) before it")
        return f"{where}: walk status {status}"  # a status added to _walk but not here

    def _section(self) -> None:
        buf, pos = self.buf, self.pos
        left = len(buf) - pos
        where = f"section header block at byte {pos}"
        if left < 12:
            raise self._fail(f"{where} is cut short: {left} bytes left")
        bom = buf[pos + 8 : pos + 12].tobytes()
        if bom == b"\x4d\x3c\x2b\x1a":
            big = False
        elif bom == b"\x1a\x2b\x3c\x4d":
            big = True
        else:
            raise self._fail(f"{where} has byte-order magic {bom.hex()} "
                             "(expected 4d3c2b1a or 1a2b3c4d)")
        order = ">" if big else "<"
        blen = struct.unpack_from(order + "I", buf, pos + 4)[0]
        if blen < fmt.MIN_SHB:
            raise self._fail(f"{where} has length {blen} (minimum {fmt.MIN_SHB})")
        if blen % 4:
            raise self._fail(f"{where} has length {blen}, not a multiple of 4")
        if blen > left:
            raise self._fail(f"{where} has length {blen} but only {left} bytes are left in the file")
        trail = struct.unpack_from(order + "I", buf, pos + blen - 4)[0]
        if trail != blen:
            raise self._fail(f"{where} has trailing length {trail}, leading length {blen}")
        major, minor = struct.unpack_from(order + "HH", buf, pos + 12)
        if major != 1:
            raise self._fail(f"{where} has version {major}.{minor} (only 1.x is defined)")
        self.big = big
        self.section_base = len(self.interfaces)
        self.sections += 1
        self.pos += blen

    def _interface(self) -> None:
        # The walk has checked the block's length, alignment and trailing length.
        buf, pos = self.buf, self.pos
        order = ">" if self.big else "<"
        blen = struct.unpack_from(order + "I", buf, pos + 4)[0]
        linktype, _, snaplen = struct.unpack_from(order + "HHI", buf, pos + 8)
        where = f"interface description block at byte {pos}"
        tsresol, tsoffset = (10, 6), 0
        p, end = pos + 16, pos + blen - 4
        while p + 4 <= end:
            code, olen = struct.unpack_from(order + "HH", buf, p)
            if code == fmt.OPT_ENDOFOPT:
                break
            if p + 4 + olen > end:
                raise self._fail(f"{where}: option {code} at byte {p} has length {olen}, "
                                 f"past the block end at byte {end}")
            if code == fmt.OPT_IF_TSRESOL:
                if olen != 1:
                    raise self._fail(f"{where}: if_tsresol at byte {p} has length {olen} (must be 1)")
                v = int(buf[p + 4])
                tsresol = (2, v & 0x7F) if v & 0x80 else (10, v)
            elif code == fmt.OPT_IF_TSOFFSET:
                if olen != 8:
                    raise self._fail(f"{where}: if_tsoffset at byte {p} has length {olen} (must be 8)")
                tsoffset = struct.unpack_from(order + "q", buf, p + 4)[0]
                if abs(tsoffset) > MAX_TSOFFSET_S:
                    raise self._fail(f"{where}: if_tsoffset at byte {p} is {tsoffset} s "
                                     f"(beyond ±{MAX_TSOFFSET_S})")
            p += 4 + fmt.pad4(olen)
        self.interfaces.append(Interface(linktype, snaplen, tsresol, tsoffset))
        self.pos += blen
