"""pcap and pcapng writers (little-endian, as the host writes them).

`write` appends one frame; `write_batch` appends a whole `FrameBatch`: headers are built as
numpy structured arrays and `_pack.pack_records` lays out headers and frame bytes in one pass,
so the traffic generator can write millions of frames. Frames longer than the snaplen are cut
to it and keep their wire length, as a capture would.
"""

from __future__ import annotations

import struct

import numpy as np
from mirrorckpt.capture import _pack
from mirrorckpt.capture import formats as fmt
from mirrorckpt.capture.batch import LINKTYPE_ETHERNET, FrameBatch

# Frames per packing pass: bounds the staging buffer (about 16 MiB of 1 KiB frames).
CHUNK_FRAMES = 16384
_NS = 10**9


# Every write but a file's last starts and ends on a 2 MB boundary of the file. The page cache
# keeps what a write brings in folios no larger than the write and aligned in the file, and a
# replay maps a cached capture one folio per fault: a generated capture written as it came
# (writes of any size at any offset) walked in 13-28 ms per 336 MB here, written so in 2-3 ms.
WRITE_SPAN = 2 << 20
WRITE_HOLD = 8 << 20  # bytes held before a write


class _FileWriter:
    def __init__(self, path):
        self.path = str(path)
        self.frames = 0
        self._f = open(path, "wb", buffering=0)
        self._held: list = []
        self._nheld = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if not self._f.closed:
            try:
                self._drain(final=True)
            finally:
                self._f.close()

    def _write(self, b) -> None:
        self._held.append(b)
        self._nheld += len(b)
        if self._nheld >= WRITE_HOLD:
            self._drain(final=False)

    def _drain(self, final: bool) -> None:
        """Writes the bytes held, all of them if ``final``, else whole spans (the rest stays held)."""
        buf = memoryview(b"".join(self._held))
        n = len(buf) if final else len(buf) - len(buf) % WRITE_SPAN
        done = 0
        while done < n:
            done += self._f.write(buf[done:n])
        self._held = [bytes(buf[n:])] if n < len(buf) else []
        self._nheld = len(buf) - n

    def _frame_lengths(self, frame_len: int, wirelen: int | None, snaplen: int) -> tuple[int, int]:
        caplen = min(frame_len, snaplen) if snaplen else frame_len
        wire = frame_len if wirelen is None else int(wirelen)
        if wire < caplen:
            raise ValueError(f"{self.path}: wirelen {wire} is below the {caplen} captured bytes")
        if wire > 0xFFFFFFFF:
            raise ValueError(f"{self.path}: wirelen {wire} does not fit 32 bits")
        return caplen, wire

    def _check_batch(self, first: int, caplen: np.ndarray, wirelen: np.ndarray,
                     ts_ns: np.ndarray) -> None:
        """Checks frames first, first + 1, ... of a batch (one chunk of it)."""
        bad = np.flatnonzero((wirelen < caplen) | (wirelen > 0xFFFFFFFF) | (ts_ns < 0))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{self.path}: batch frame {first + i} has caplen {int(caplen[i])}, "
                             f"wirelen {int(wirelen[i])}, ts_ns {int(ts_ns[i])}")

    def _pack(self, head: np.ndarray, batch: FrameBatch, sel: slice, caplen: np.ndarray,
              align: int, tail: np.ndarray) -> None:
        head_b = head.view(np.uint8).reshape(len(head), -1)
        tail_b = tail.view(np.uint8).reshape(len(tail), -1)
        total = int(len(head) * (head_b.shape[1] + tail_b.shape[1])
                    + (caplen + (-(head_b.shape[1] + caplen)) % align).sum())
        out = np.empty(total, np.uint8)
        offset = np.ascontiguousarray(batch.offset[sel], dtype=np.int64)
        data = np.ascontiguousarray(batch.data, dtype=np.uint8)
        n = _pack.pack_records(head_b, data, offset, np.ascontiguousarray(caplen, np.int64),
                               align, tail_b, out)
        self._write(memoryview(out[:n]))


class PcapWriter(_FileWriter):
    """Classic pcap: one link type, µs or ns timestamps."""

    def __init__(self, path, nanosecond: bool = True, linktype: int = LINKTYPE_ETHERNET,
                 snaplen: int = fmt.MAX_CAPLEN):
        super().__init__(path)
        self.nanosecond = nanosecond
        self.snaplen = int(snaplen)
        self._unit = 1 if nanosecond else 1000  # ns per timestamp tick
        hdr = np.zeros(1, fmt.pcap_header_dtype("<"))
        hdr["magic"] = fmt.PCAP_MAGIC_NS if nanosecond else fmt.PCAP_MAGIC_US
        hdr["version_major"], hdr["version_minor"] = 2, 4
        hdr["snaplen"], hdr["linktype"] = self.snaplen, linktype
        self._write(hdr.tobytes())

    def _split_ts(self, ts_ns):
        return ts_ns // _NS, (ts_ns % _NS) // self._unit

    def write(self, frame: bytes, ts_ns: int, wirelen: int | None = None, iface: int = 0) -> None:
        if iface != 0:
            raise ValueError(f"{self.path}: pcap has one interface; frame given iface {iface}")
        caplen, wire = self._frame_lengths(len(frame), wirelen, self.snaplen)
        if not 0 <= ts_ns < (1 << 32) * _NS:
            raise ValueError(f"{self.path}: timestamp {ts_ns} ns does not fit pcap's 32-bit seconds")
        sec, frac = self._split_ts(int(ts_ns))
        self._write(struct.pack("<IIII", sec, frac, caplen, wire))
        self._write(bytes(frame[:caplen]))
        self.frames += 1

    def write_batch(self, batch: FrameBatch) -> None:
        if len(batch) and np.any(batch.iface != 0):
            raise ValueError(f"{self.path}: pcap has one interface; batch has frames of "
                             f"interfaces {sorted(set(np.unique(batch.iface).tolist()))}")
        for lo in range(0, len(batch), CHUNK_FRAMES):
            sel = slice(lo, lo + CHUNK_FRAMES)
            caplen = np.minimum(batch.caplen[sel], self.snaplen) if self.snaplen else batch.caplen[sel]
            wirelen, ts = batch.wirelen[sel], batch.ts_ns[sel]
            self._check_batch(lo, caplen, wirelen, ts)
            if ts.size and int(ts.max()) >= (1 << 32) * _NS:
                raise ValueError(f"{self.path}: timestamp {int(ts.max())} ns does not fit "
                                 "pcap's 32-bit seconds")
            head = np.empty(len(caplen), fmt.pcap_record_dtype("<"))
            head["ts_sec"], head["ts_frac"] = self._split_ts(ts)
            head["caplen"], head["wirelen"] = caplen, wirelen
            self._pack(head, batch, sel, caplen, 1, np.empty((len(caplen), 0), np.uint8))
            self.frames += len(caplen)


def _option(code: int, value: bytes) -> bytes:
    return struct.pack("<HH", code, len(value)) + value + b"\0" * (fmt.pad4(len(value)) - len(value))


def _block(block_type: int, body: bytes) -> bytes:
    length = 12 + len(body)
    return struct.pack("<II", block_type, length) + body + struct.pack("<I", length)


class PcapngWriter(_FileWriter):
    """pcapng: one section, one IDB per (name, linktype, snaplen), Enhanced Packet Blocks."""

    def __init__(self, path, interfaces=(("eth0", LINKTYPE_ETHERNET, fmt.MAX_CAPLEN),), tsresol_ns: bool = True):
        super().__init__(path)
        self.interfaces = [(str(n), int(lt), int(sl)) for n, lt, sl in interfaces]
        if not self.interfaces:
            raise ValueError(f"{self.path}: a pcapng file needs at least one interface")
        self._unit = 1 if tsresol_ns else 1000
        self._snaplen = np.array([sl for _, _, sl in self.interfaces], np.int64)
        shb = struct.pack("<IHHq", fmt.BYTE_ORDER_MAGIC, 1, 0, -1)  # section length unknown
        out = [_block(fmt.BT_SHB, shb)]
        for name, linktype, snaplen in self.interfaces:
            opts = (_option(fmt.OPT_IF_NAME, name.encode())
                    + _option(fmt.OPT_IF_TSRESOL, bytes([9 if tsresol_ns else 6]))
                    + _option(fmt.OPT_ENDOFOPT, b""))
            out.append(_block(fmt.BT_IDB, struct.pack("<HHI", linktype, 0, snaplen) + opts))
        self._write(b"".join(out))

    def write(self, frame: bytes, ts_ns: int, wirelen: int | None = None, iface: int = 0) -> None:
        if not 0 <= iface < len(self.interfaces):
            raise ValueError(f"{self.path}: interface {iface} not declared "
                             f"({len(self.interfaces)} interfaces)")
        caplen, wire = self._frame_lengths(len(frame), wirelen, int(self._snaplen[iface]))
        if ts_ns < 0:
            raise ValueError(f"{self.path}: negative timestamp {ts_ns} ns")
        ticks = int(ts_ns) // self._unit
        pad = fmt.pad4(caplen) - caplen
        length = 32 + caplen + pad
        self._write(struct.pack("<IIIIIII", fmt.BT_EPB, length, iface, ticks >> 32,
                                ticks & 0xFFFFFFFF, caplen, wire))
        self._write(bytes(frame[:caplen]))
        self._write(b"\0" * pad + struct.pack("<I", length))
        self.frames += 1

    def write_batch(self, batch: FrameBatch) -> None:
        for lo in range(0, len(batch), CHUNK_FRAMES):
            sel = slice(lo, lo + CHUNK_FRAMES)
            iface = batch.iface[sel].astype(np.int64)
            bad = np.flatnonzero((iface < 0) | (iface >= len(self.interfaces)))
            if bad.size:
                raise ValueError(f"{self.path}: batch frame {lo + int(bad[0])} has interface "
                                 f"{int(iface[bad[0]])}, not declared "
                                 f"({len(self.interfaces)} interfaces)")
            snap = self._snaplen[iface]
            caplen = np.where(snap > 0, np.minimum(batch.caplen[sel], snap), batch.caplen[sel])
            wirelen, ts = batch.wirelen[sel], batch.ts_ns[sel]
            self._check_batch(lo, caplen, wirelen, ts)
            ticks = (ts // self._unit).astype(np.uint64)
            length = 32 + caplen + (-caplen) % 4
            head = np.empty(len(caplen), fmt.epb_header_dtype("<"))
            head["type"], head["length"], head["iface"] = fmt.BT_EPB, length, iface
            head["ts_hi"], head["ts_lo"] = ticks >> np.uint64(32), ticks & np.uint64(0xFFFFFFFF)
            head["caplen"], head["wirelen"] = caplen, wirelen
            self._pack(head, batch, sel, caplen, 4, length.astype("<u4"))
            self.frames += len(caplen)
