"""Memory-mapped pcap and pcapng readers yielding `FrameBatch`es.

The file is mapped once; a batch's `data` is a view of the mapping covering its frames, so no
frame byte is copied. The record/block walk runs in Cython (`_walk.pyx`); this module keeps
the per-file state, converts timestamps and turns walk statuses into errors that name the
file and the byte offset. A damaged file yields every good frame before the damage, then
raises `CaptureError`.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np
from mirrorckpt.capture import _walk
from mirrorckpt.capture import formats as fmt
from mirrorckpt.capture._walk import Status
from mirrorckpt.capture.batch import CaptureError, FrameBatch
from mirrorckpt.capture.pcapng import PcapngBlocks

DEFAULT_BATCH_FRAMES = 65536
BATCH_BYTES = 16 << 20  # a batch also ends after this many bytes of file (jumbo frames: bounded memory).
# Each batch end leaves a message per QP begun in it, copied twice (held, then whole), and 32 MB
# halves that, but as the slope from a 2-step capture (best of 5, the sizes interleaved) 32 MB
# against 16 ran Simple no faster (0.288 vs 0.282 s/GB; CPU 0.42 vs 0.44) and LL 13 % slower
# (0.52 vs 0.45 s/GB), at 95 and 140 MB more peak RSS.


@dataclass
class CaptureStats:
    frames: int = 0
    truncated: int = 0  # frames with caplen < wirelen
    bytes: int = 0  # captured bytes
    wire_bytes: int = 0
    skipped_blocks: int = 0  # pcapng blocks that carry no packet (NRB, ISB, custom, ...)


class PcapRecords:
    """Walk state of one classic pcap file."""

    def __init__(self, name: str, buf: np.ndarray, magic: int):
        self.name = name
        self.buf = buf
        self.big = magic in (fmt.PCAP_MAGIC_US_SWAPPED, fmt.PCAP_MAGIC_NS_SWAPPED)
        self.nanosecond = magic in (fmt.PCAP_MAGIC_NS, fmt.PCAP_MAGIC_NS_SWAPPED)
        if len(buf) < fmt.PCAP_HEADER_SIZE:
            raise CaptureError(f"{name}: pcap file header is cut short "
                               f"({len(buf)} of {fmt.PCAP_HEADER_SIZE} bytes)")
        hdr = buf[: fmt.PCAP_HEADER_SIZE].view(fmt.pcap_header_dtype(">" if self.big else "<"))[0]
        if hdr["version_major"] != 2:
            raise CaptureError(f"{name}: pcap version {hdr['version_major']}."
                               f"{hdr['version_minor']} at byte 4 (only 2.x is defined)")
        # The upper bits of the link type field carry FCS information, not the link type.
        self.linktype = int(hdr["linktype"]) & 0xFFFF
        self.snaplen = int(hdr["snaplen"])
        self.pos = fmt.PCAP_HEADER_SIZE
        self.skipped = 0
        self.stride_min = _walk.STRIDE_MIN  # what the walk prefetches (CaptureReader.consumer_prefetches)

    @property
    def linktypes(self) -> dict[int, int]:
        return {0: self.linktype}

    def fill(self, offset, caplen, wirelen, ts_ns, iface) -> tuple[int, CaptureError | None, bool]:
        ticks = ts_ns.view(np.uint64)  # filled in place, then scaled to ns
        start = self.pos
        n, self.pos, status, a, b = _walk.walk_pcap(
            self.buf, start, self.big, 10**9 if self.nanosecond else 10**6, fmt.MAX_CAPLEN,
            offset, caplen, wirelen, ticks, 0, self.stride_min)
        if not self.nanosecond:
            ticks[:n] *= np.uint64(1000)
        iface[:n] = 0
        error = None
        if status >= Status.CUT_HEADER:
            where = f"{self.name}: record at byte {self.pos}"
            if status == Status.CUT_HEADER:
                msg = f"{where} is cut short: {a} bytes left, a record header needs 16"
            elif status == Status.CAPLEN_MAX:
                msg = f"{where} has captured length {a} (more than {b})"
            else:
                msg = f"{where} has captured length {a} but only {b} bytes follow its header"
            error = CaptureError(msg)
        return n, error, status == Status.END


def _format(name: str, buf: np.ndarray):
    """The walk state for the file's format, from its first bytes."""
    if len(buf) == 0:
        raise CaptureError(f"{name}: not a pcap or pcapng file (the file is empty)")
    head = buf[:4].tobytes()
    if len(head) == 4:
        magic = struct.unpack("<I", head)[0]
        if magic == fmt.BT_SHB:
            return PcapngBlocks(name, buf)
        if magic in (fmt.PCAP_MAGIC_US, fmt.PCAP_MAGIC_NS, fmt.PCAP_MAGIC_US_SWAPPED,
                     fmt.PCAP_MAGIC_NS_SWAPPED):
            return PcapRecords(name, buf, magic)
        if magic in (fmt.PCAP_MAGIC_MODIFIED, fmt.PCAP_MAGIC_MODIFIED_SWAPPED):
            raise CaptureError(f"{name}: modified (Kuznetzov) pcap is not supported; "
                               "convert it with editcap")
    first = buf[:16].tobytes().hex(" ")
    raise CaptureError(f"{name}: not a pcap or pcapng file (first bytes {first})")


RELEASE_BYTES = 4 << 20  # hand back consumed pages in steps of this many bytes (16 MB kept up to 30 MB
# more of a 2-stream replay resident, a quarter of its capture pages)


def _huge_pages(mm: mmap.mmap) -> None:
    """Asks for 2 MB pages for the file's page cache (Linux 6.x, file systems with large folios).
    A file read from disk this way is cached in 2 MB folios, and mapping them later costs one fault
    per 2 MB: walking a cached 1.5 GB LL capture measured 0.19 s mapped in 4 KB pages, 0.06 s
    in 2 MB ones. Pages already cached keep their size; elsewhere the advice is a no-op."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mm.madvise(advice)
        except OSError:
            pass


class CaptureReader:
    """Iterable of `FrameBatch`es of up to `batch_frames` frames; `.stats` counts what was read."""

    stable_batches = True  # a batch stays valid after the next is read (a view of the read-only mapping)

    def __init__(self, path, batch_frames: int = DEFAULT_BATCH_FRAMES):
        if int(batch_frames) < 1:
            raise ValueError(f"batch_frames must be at least 1, not {batch_frames}")
        self.name = str(path)
        self.batch_frames = int(batch_frames)
        self.stats = CaptureStats()
        self._mm = None
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size:
                    self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise CaptureError(f"{self.name}: cannot open: {e.strerror}") from e
        if self._mm is not None and hasattr(self._mm, "madvise"):
            self._mm.madvise(mmap.MADV_SEQUENTIAL)
            _huge_pages(self._mm)
        self._buf = np.frombuffer(self._mm, np.uint8) if self._mm is not None else np.zeros(0, np.uint8)
        try:
            self._walk = _format(self.name, self._buf)
        except CaptureError:
            self.close()
            raise
        self._pending: CaptureError | None = None
        self._done = False
        self._released = 0  # mapped pages below this offset were handed back (see __next__)
        self._handed = 0  # end of the last batch handed on
        self._frames_next = min(self.batch_frames, 4096)
        self._rest = None  # columns of frames read but not yet handed on (a batch cut at BATCH_BYTES)
        # Set by a reader whose batches are still read on another thread after the next is asked
        # for: that thread gives their pages back (release_before), the walk does not.
        self.consumer_releases = False
        # Set by a reader that prefetches each frame it reads (the RoCE decode with its ICRC): the
        # walk then asks for the records' boundaries only, not for every line (capture/_walk.pyx).
        self.consumer_prefetches = False

    def __enter__(self) -> CaptureReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Unmaps the file; a batch still held keeps the mapping alive until it is dropped."""
        self._walk = None
        self._buf = None
        self._done = True
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # views exported to batches: the mapping goes when they do
            self._mm = None

    @property
    def linktypes(self) -> dict[int, int]:
        return self._walk.linktypes if self._walk is not None else {}

    def __iter__(self) -> CaptureReader:
        return self

    def __next__(self) -> FrameBatch:
        if self._rest is None:
            # The batch handed on last is done with: its pages go before the walk maps the next
            # batch's, else both are resident at once (and for every capture of a job at once).
            if not self.consumer_releases:
                self._release(self._handed)
        cols, self._rest = (self._rest, None) if self._rest is not None else (self._next_columns(), None)
        offset = cols[0]
        if len(offset) > 1 and int(offset[-1]) - int(offset[0]) > BATCH_BYTES:
            cut = max(1, int(np.searchsorted(offset, int(offset[0]) + BATCH_BYTES)))
            cols, self._rest = tuple(c[:cut] for c in cols), tuple(c[cut:] for c in cols)
            offset = cols[0]
        # The batch's data covers its own frames only, so a stage that copies it copies little.
        lo = int(offset[0])
        hi = int((offset + cols[1]).max())
        if not self.consumer_releases:
            self._release(lo)
        self._handed = hi
        return self._batch(self._buf[lo:hi], offset - lo, cols)

    def release_before(self, batch: FrameBatch, keep_from: int | None = None) -> None:
        """With ``consumer_releases``: every frame handed on before ``batch`` (one of this reader's,
        or a part of one) is done with, and its pages go, but those from address ``keep_from`` on
        (bytes of an earlier batch still to be read: packets a reassembler held)."""
        if self._buf is not None and len(batch):
            upto = batch.data.ctypes.data + int(batch.offset[0])
            if keep_from is not None:
                upto = min(upto, keep_from)
            self._release(upto - self._buf.ctypes.data)

    def _release(self, upto: int) -> None:
        """Drops the mapped pages before ``upto`` from the resident set: the batches there are done
        with (a batch is valid until the next one is asked for), and a capture of any length then
        costs the same memory. A read-only file mapping reads them again if a view is still used."""
        upto -= upto % mmap.PAGESIZE
        if self._mm is None or upto - self._released < RELEASE_BYTES or not hasattr(self._mm, "madvise"):
            return
        self._mm.madvise(mmap.MADV_DONTNEED, self._released, upto - self._released)
        self._released = upto

    def _batch(self, data, offset, cols) -> FrameBatch:
        _, caplen, wirelen, ts_ns, iface = cols
        batch = FrameBatch(data=data, offset=offset, caplen=caplen, wirelen=wirelen, ts_ns=ts_ns,
                           iface=iface, source=self.name, first_index=self.stats.frames,
                           linktypes=dict(self._walk.linktypes))
        s = self.stats
        s.frames += len(batch)
        s.truncated += int(np.count_nonzero(batch.truncated))
        s.bytes += int(caplen.sum())
        s.wire_bytes += int(wirelen.sum())
        return batch

    def _next_columns(self):
        """The next batch's columns with offsets into the whole file; raises at the end/error."""
        while True:
            if self._pending is not None:
                error, self._pending, self._done = self._pending, None, True
                raise error
            if self._done:
                raise StopIteration
            k = self._frames_next
            cols = (np.empty(k, np.int64), np.empty(k, np.int64), np.empty(k, np.int64),
                    np.empty(k, np.int64), np.empty(k, np.int32))
            self._walk.stride_min = _walk.BOUNDS_STRIDE_MIN if self.consumer_prefetches else _walk.STRIDE_MIN
            n, self._pending, self._done = self._walk.fill(*cols)
            self.stats.skipped_blocks = self._walk.skipped
            if n:
                # The walk touches every frame it lists: size the next walk to about BATCH_BYTES.
                span = int(cols[0][n - 1]) - int(cols[0][0]) + int(cols[1][n - 1])
                self._frames_next = int(min(self.batch_frames, max(256, n * BATCH_BYTES // max(span, 1))))
                return tuple(c[:n] for c in cols)
            # No frame: the walk ended or hit damage, which the next pass raises.
            if not (self._done or self._pending):
                raise AssertionError(f"{self.name}: walk stalled at byte {self._walk.pos}")


def open_capture(path, batch_frames: int = DEFAULT_BATCH_FRAMES) -> CaptureReader:
    """Opens a pcap or pcapng file (format from its first bytes)."""
    return CaptureReader(path, batch_frames)


def read_all(path) -> FrameBatch:
    """Every frame of a capture in one batch (tests and tools; the mapping lives as long as it)."""
    reader = CaptureReader(path)
    parts = []
    try:
        while True:
            try:
                parts.append(reader._next_columns())
            except StopIteration:
                break
        buf = reader._buf
        cols = tuple(np.concatenate([p[i] for p in parts]) if parts else
                     np.zeros(0, np.int32 if i == 4 else np.int64) for i in range(5))
        return reader._batch(buf, cols[0], cols)
    finally:
        reader.close()
