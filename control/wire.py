"""Control-plane framing: length-prefixed frames of a JSON header plus raw tensor bytes.

A frame on the wire (all integers big-endian):

    u32 length    bytes that follow this field (everything below)
    u32 hlen      length of the header
    hlen bytes    UTF-8 JSON header
    payload       raw tensor bytes, described by the header's tensor table
    tag           HMAC-SHA256 of the frame (32 bytes once the session is authenticated, else none)

The header is ``{"v", "type", "seq", "body", "tensors", ["rid"], ["re"], ["stream"]}``; ``tensors``
lists ``{"name", "dtype", "shape", "offset", "nbytes"}`` with offsets relative to the payload start.
Tensor bytes are little-endian as stored; bfloat16 travels as its raw 16-bit patterns.

Streaming: a message whose payload is larger than the sender's frame size goes as a head frame
(the full header with ``"stream": payload bytes`` and no payload of its own) followed by MORE
frames ``{"v", "type": "MORE", "seq", "off"}`` whose payloads are consecutive byte ranges of the
message payload. Every frame has its own sequence number and tag; the receiver allocates the
payload once from the authenticated head and reads each MORE payload straight into its place, so
a state of any size needs its own bytes plus one frame header, on both sides. Other messages may
come between the frames of a stream; only one stream per direction is open at a time.

Nothing here trusts the peer: the length prefix is checked before anything is allocated, and every
malformed input raises a ``ProtocolError`` subclass naming the reason. Never pickle, never
``torch.load``: tensors are rebuilt as views of the received payload buffer.
"""

from __future__ import annotations

import json
import math
import select
import socket
import ssl
import struct
import time
from dataclasses import dataclass

import numpy as np
import torch

VERSION = 1
MAX_FRAME = 1 << 30  # default limit of one frame once authenticated: a guard against garbage
STREAM_FRAME = 64 << 20  # payload bytes per frame above which a message is streamed
MAX_MESSAGE = 1 << 40  # default limit of a streamed message's payload (checked before allocating)
MORE = "MORE"  # continuation frame of a streamed message (not a message type of its own)
PREAUTH_MAX_FRAME = 4096  # before authentication only small handshake frames are accepted
MAX_HEADER = 16 << 20  # a header is metadata; a REGISTER of 100k tensors still fits
ALIGN = 64  # tensor offsets in the payload are padded to this, so decoded views are aligned
TAG_LEN = 32
MAX_NDIM = 32
MAX_NAME = 512
_U32 = struct.Struct(">I")
_INT_MAX = (1 << 63) - 1

# wire dtype name -> (numpy dtype holding the bytes, torch dtype). bool is left out on purpose:
# torch assumes bool bytes are 0/1 and a peer could send anything.
DTYPES: dict[str, tuple[np.dtype, torch.dtype]] = {
    "float64": (np.dtype("<f8"), torch.float64),
    "float32": (np.dtype("<f4"), torch.float32),
    "float16": (np.dtype("<f2"), torch.float16),
    "bfloat16": (np.dtype("<u2"), torch.bfloat16),
    "int64": (np.dtype("<i8"), torch.int64),
    "int32": (np.dtype("<i4"), torch.int32),
    "int16": (np.dtype("<i2"), torch.int16),
    "int8": (np.dtype("i1"), torch.int8),
    "uint8": (np.dtype("u1"), torch.uint8),
}
_TORCH_NAMES = {t: n for n, (_, t) in DTYPES.items()}
_NUMPY_NAMES = {d: n for n, (d, _) in DTYPES.items() if n != "bfloat16"}  # uint16 is not bf16


# ---------------------------------------------------------------------------------------- errors

class ProtocolError(Exception):
    """The peer broke the protocol; the connection is closed and the reason logged."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason

    def describe(self) -> str:
        return f"{type(self).__name__}: {self.reason}"


class FrameTooLarge(ProtocolError):
    """Length prefix or header length above the configured limit (checked before allocating)."""


class TruncatedFrame(ProtocolError):
    """The stream ended in the middle of a frame."""


class MalformedFrame(ProtocolError):
    """Inconsistent lengths inside the frame."""


class TrailingBytes(ProtocolError):
    """Bytes after the frame or after the last tensor of the payload."""


class BadHeader(ProtocolError):
    """Header is not a UTF-8 JSON object, or a header field is missing or of the wrong type."""


class UnsupportedVersion(ProtocolError):
    """Header version is not ours."""


class UnknownMessageType(ProtocolError):
    """Header type is not in the message registry."""


class SchemaError(ProtocolError):
    """A message body does not match its type's schema (or is not allowed from this sender)."""


class TensorTableError(ProtocolError):
    """A tensor table entry is out of range, overlapping, or has the wrong size for dtype x shape."""


class AuthError(ProtocolError):
    """Handshake failed: wrong secret, wrong role, or a frame sent before authentication."""


class BadMac(ProtocolError):
    """Frame tag does not verify: tampered, or sent in another session."""


class SequenceError(ProtocolError):
    """Sequence number is not the next one: a replayed, duplicated or reordered frame."""


class PeerTimeout(ProtocolError):
    """The peer stalled (mid-frame, during the handshake, or idle past the limit)."""


class ConnectionClosed(Exception):
    """The peer closed the connection between frames (not a protocol violation)."""


# ---------------------------------------------------------------------------------------- reading

@dataclass
class RawFrame:
    """One frame as read, before anything in it is trusted."""

    header: bytes
    payload: np.ndarray  # uint8, 64-byte aligned, writable: decoded tensors are views of it
    tag: bytes


def aligned_buffer(n: int) -> np.ndarray:
    """Writable uint8 buffer of ``n`` bytes starting on an ALIGN boundary."""
    raw = np.empty(n + ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + n]


class BytesSource:
    """Reads a frame from bytes in memory (tests, fuzzing, files)."""

    def __init__(self, data: bytes):
        self.data = memoryview(data).cast("B")
        self.pos = 0

    def read_into(self, view: memoryview, started: bool) -> None:
        n = len(view)
        got = min(n, len(self.data) - self.pos)
        view[:got] = self.data[self.pos:self.pos + got]
        self.pos += got
        if got < n:
            if not started and got == 0:
                raise ConnectionClosed("end of data")
            raise TruncatedFrame(f"data ends after {got} of {n} bytes of a frame part")


class SocketSource:
    """Reads from a socket whose timeout is a short poll interval, enforcing our own limits.

    ``stall_timeout`` bounds the silence inside a frame, ``idle_timeout`` the silence before a
    frame starts (None: wait for ever), ``deadline`` (monotonic) the whole read, e.g. a handshake.
    ``stop`` (a threading.Event) ends the wait when the endpoint shuts down.
    """

    def __init__(self, sock: socket.socket, stall_timeout: float, idle_timeout: float | None = None,
                 stop=None, io_lock=None):
        self.sock = sock
        self.stall_timeout = stall_timeout
        self.idle_timeout = idle_timeout
        self.deadline: float | None = None
        self.stop = stop
        self.io_lock = io_lock  # TLS: shared with the writers; held only while data is there

    def _recv_into(self, view: memoryview) -> int:
        if self.io_lock is None:
            return self.sock.recv_into(view)
        if not self.sock.pending():
            ready, _, _ = select.select([self.sock], [], [], self.sock.gettimeout())
            if not ready:
                raise TimeoutError("no data")
        with self.io_lock:
            return self.sock.recv_into(view)

    def read_into(self, view: memoryview, started: bool) -> None:
        n, got = len(view), 0
        last = time.monotonic()
        while got < n:
            if self.stop is not None and self.stop.is_set():
                raise ConnectionClosed("endpoint stopping")
            try:
                k = self._recv_into(view[got:])
            except (TimeoutError, BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                now = time.monotonic()
                if self.deadline is not None and now > self.deadline:
                    raise PeerTimeout("handshake not completed in time") from None
                in_frame = started or got > 0
                limit = self.stall_timeout if in_frame else self.idle_timeout
                if limit is not None and now - last > limit:
                    if in_frame:
                        raise PeerTimeout(f"peer stalled mid-frame for {limit:g} s "
                                          f"({got} of {n} bytes of a frame part received)") from None
                    raise PeerTimeout(f"peer idle for more than {limit:g} s") from None
                continue
            except OSError as e:
                raise ConnectionClosed(f"socket error: {e}") from None
            if k == 0:
                if not started and got == 0:
                    raise ConnectionClosed("peer closed the connection")
                raise TruncatedFrame(f"connection closed mid-frame ({got} of {n} bytes of a "
                                     f"frame part received)")
            got += k
            last = time.monotonic()


def _read_exact(source, n: int, started: bool) -> bytearray:
    buf = bytearray(n)
    if n:
        source.read_into(memoryview(buf), started)
    return buf


def read_frame(source, max_frame: int, tag_len: int, place=None) -> RawFrame:
    """Read one frame; sizes are checked against ``max_frame`` before any buffer is allocated.
    ``place(header, payload_len)`` may return the uint8 view the payload is read into (a MORE
    frame's place in its message), or None for a buffer of its own."""
    (length,) = _U32.unpack(_read_exact(source, 4, started=False))
    if length > max_frame:
        raise FrameTooLarge(f"length prefix {length} exceeds the limit of {max_frame} bytes")
    if length < 4 + tag_len:
        raise MalformedFrame(f"length prefix {length} is too small for a frame "
                             f"(needs at least {4 + tag_len})")
    (hlen,) = _U32.unpack(_read_exact(source, 4, started=True))
    if hlen > MAX_HEADER:
        raise FrameTooLarge(f"header length {hlen} exceeds the limit of {MAX_HEADER} bytes")
    if hlen == 0 or hlen > length - 4 - tag_len:
        raise MalformedFrame(f"header length {hlen} does not fit a frame of {length} bytes")
    header = bytes(_read_exact(source, hlen, started=True))
    plen = length - 4 - hlen - tag_len
    payload = place(header, plen) if place is not None else None
    if payload is None:
        payload = aligned_buffer(plen)
    if payload.size:
        source.read_into(memoryview(payload), started=True)
    tag = bytes(_read_exact(source, tag_len, started=True))
    return RawFrame(header, payload, tag)


def decode_frame(data: bytes, max_frame: int = MAX_FRAME, tag_len: int = 0) -> RawFrame:
    """Split exactly one frame held in ``data``; anything after it is an error."""
    src = BytesSource(data)
    try:
        frame = read_frame(src, max_frame, tag_len)
    except ConnectionClosed:
        raise TruncatedFrame("no data") from None
    if src.pos != len(src.data):
        raise TrailingBytes(f"{len(src.data) - src.pos} bytes after the end of the frame")
    return frame


# ---------------------------------------------------------------------------------------- header

def _no_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text):
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:20]} overflows")
    return v


def _no_duplicates(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("duplicate key in a JSON object")
    return d


def loads_json(raw: bytes) -> object:
    """Strict JSON: UTF-8, no NaN/Infinity, no duplicate keys, bounded nesting."""
    try:
        text = raw.decode("utf-8")
        return json.loads(text, parse_constant=_no_constant, parse_float=_finite_float,
                          object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise BadHeader(f"header is not valid JSON: {str(e)[:120]}") from None


def is_int(v, lo: int = 0, hi: int = _INT_MAX) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


_HEADER_KEYS = {"v", "type", "seq", "body", "tensors"}
_OPTIONAL_KEYS = {"rid", "re", "stream"}
_MORE_KEYS = {"v", "type", "seq", "off"}
_ENTRY_KEYS = {"name", "dtype", "shape", "offset", "nbytes"}


def parse_header(raw: bytes, payload_len: int) -> dict:
    """Decode and check the generic header fields and the tensor table against the payload."""
    h = loads_json(raw)
    if not isinstance(h, dict):
        raise BadHeader(f"header must be a JSON object, got {type(h).__name__}")
    if "v" not in h:
        raise BadHeader("header has no version field 'v'")
    if h["v"] != VERSION or not is_int(h["v"]):
        raise UnsupportedVersion(f"protocol version {h['v']!r} is not supported (expected {VERSION})")
    missing = _HEADER_KEYS - h.keys()
    if missing:
        raise BadHeader(f"header misses field(s) {', '.join(sorted(missing))}")
    extra = h.keys() - _HEADER_KEYS - _OPTIONAL_KEYS
    if extra:
        raise BadHeader(f"header has unknown field(s) {', '.join(sorted(extra)[:5])}")
    if not isinstance(h["type"], str):
        raise BadHeader("header field 'type' must be a string")
    if not is_int(h["seq"]):
        raise BadHeader(f"header field 'seq' must be an integer in [0, 2^63), got {h['seq']!r:.40}")
    for k in _OPTIONAL_KEYS & h.keys():
        if not is_int(h[k], lo=1):
            raise BadHeader(f"header field {k!r} must be a positive integer")
    if not isinstance(h["body"], dict):
        raise BadHeader("header field 'body' must be an object")
    if not isinstance(h["tensors"], list):
        raise BadHeader("header field 'tensors' must be a list")
    if "stream" in h:
        if payload_len:
            raise MalformedFrame(f"a stream head carries no payload, got {payload_len} bytes")
        payload_len = h["stream"]  # the table describes the whole streamed payload
    check_table(h["tensors"], payload_len)
    return h


def more_header(seq: int, off: int) -> bytes:
    return dumps_header({"v": VERSION, "type": MORE, "seq": seq, "off": off})


def parse_more(raw: bytes) -> tuple[int, int] | None:
    """(seq, offset) of a MORE frame's header; None for any other frame's header. MORE headers
    are tiny: a longer header is never one (and is parsed once, by ``parse_header``)."""
    if len(raw) > 96 or b'"MORE"' not in raw:
        return None
    h = loads_json(raw)
    if not isinstance(h, dict) or h.get("type") != MORE:
        return None
    if h.keys() != _MORE_KEYS or h["v"] != VERSION or not is_int(h["seq"]) or not is_int(h["off"]):
        raise BadHeader(f"MORE header must be exactly {{v: {VERSION}, type, seq, off}} with integer values")
    return h["seq"], h["off"]


def chunks(pieces: list, limit: int):
    """(offset, views, nbytes) of consecutive payload ranges of at most ``limit`` bytes; the
    views are slices of ``pieces`` (nothing is copied)."""
    off, cur, n = 0, [], 0
    for p in pieces:
        view = memoryview(p).cast("B")
        while len(view):
            take = min(len(view), limit - n)
            cur.append(view[:take])
            view, n = view[take:], n + take
            if n == limit:
                yield off, cur, n
                off, cur, n = off + n, [], 0
    if n:
        yield off, cur, n


def check_table(table: list, payload_len: int) -> None:
    """Entries well typed, sized by dtype x shape, aligned, inside the payload, not overlapping,
    and covering it up to its end (gaps only as alignment padding)."""
    names, spans = set(), []
    for i, e in enumerate(table):
        if not isinstance(e, dict) or e.keys() != _ENTRY_KEYS:
            raise TensorTableError(f"tensor entry {i} must have exactly the fields "
                                   f"{', '.join(sorted(_ENTRY_KEYS))}")
        name, dtype, shape = e["name"], e["dtype"], e["shape"]
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise TensorTableError(f"tensor entry {i}: name must be a non-empty string")
        if name in names:
            raise TensorTableError(f"tensor {name!r} listed twice")
        names.add(name)
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise TensorTableError(f"tensor {name!r}: unknown dtype {dtype!r:.40}")
        if (not isinstance(shape, list) or len(shape) > MAX_NDIM
                or not all(is_int(s) for s in shape)):
            raise TensorTableError(f"tensor {name!r}: shape must be a list of at most {MAX_NDIM} "
                                   f"non-negative integers")
        off, nbytes = e["offset"], e["nbytes"]
        if not is_int(off) or not is_int(nbytes):
            raise TensorTableError(f"tensor {name!r}: offset and nbytes must be non-negative integers")
        size = DTYPES[dtype][0].itemsize
        if math.prod(shape) * size != nbytes:
            raise TensorTableError(f"tensor {name!r}: nbytes {nbytes} != {size} x prod{tuple(shape)}")
        if off % size:
            raise TensorTableError(f"tensor {name!r}: offset {off} not aligned to its {size}-byte dtype")
        if off + nbytes > payload_len:
            raise TensorTableError(f"tensor {name!r}: bytes [{off}, {off + nbytes}) lie outside the "
                                   f"{payload_len}-byte payload")
        if nbytes:
            spans.append((off, off + nbytes, name))
    end = 0
    for start, stop, name in sorted(spans):
        if start < end:
            raise TensorTableError(f"tensor {name!r} overlaps the previous tensor at byte {start}")
        if start - end >= ALIGN:
            raise TensorTableError(f"{start - end} unexplained bytes before tensor {name!r}")
        end = stop
    if payload_len - end:
        raise TrailingBytes(f"{payload_len - end} payload bytes after the last tensor")


# ---------------------------------------------------------------------------------------- tensors

def tensor_to_wire(value) -> tuple[str, np.ndarray]:
    """(wire dtype, contiguous little-endian numpy array of the bytes) for a torch or numpy tensor."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        name = _TORCH_NAMES.get(t.dtype)
        if name is None:
            raise ValueError(f"torch dtype {t.dtype} cannot travel on the control plane")
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        return name, t.numpy()
    a = np.asarray(value)
    name = _NUMPY_NAMES.get(a.dtype.newbyteorder("<"))
    if name is None:
        raise ValueError(f"numpy dtype {a.dtype} cannot travel on the control plane "
                         f"(bfloat16: pass a torch.bfloat16 tensor)")
    return name, np.ascontiguousarray(a, dtype=DTYPES[name][0])


def encode_tensors(tensors: dict) -> tuple[list[dict], list, int]:
    """(tensor table, payload pieces, payload length); pieces are views, not copies."""
    table, pieces, pos = [], [], 0
    for name, value in tensors.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
            raise ValueError(f"tensor name {name!r:.40} must be a string of 1 to {MAX_NAME} characters")
        dtype, arr = tensor_to_wire(value)
        pad = (-pos) % ALIGN
        if pad and arr.nbytes:
            pieces.append(bytes(pad))
            pos += pad
        table.append({"name": name, "dtype": dtype, "shape": list(arr.shape),
                      "offset": pos, "nbytes": int(arr.nbytes)})
        if arr.nbytes:
            pieces.append(memoryview(arr.reshape(-1).view(np.uint8)))
            pos += arr.nbytes
    return table, pieces, pos


def payload_bound(tensors: dict) -> int:
    """Upper bound of the payload bytes ``encode_tensors`` would produce (nothing is copied)."""
    total = 0
    for value in tensors.values():
        n = value.numel() * value.element_size() if isinstance(value, torch.Tensor) else np.asarray(value).nbytes
        total += n + ALIGN
    return total


def decode_tensors(table: list[dict], payload: np.ndarray) -> dict[str, torch.Tensor]:
    """Torch tensors sharing memory with ``payload`` (call after ``check_table``)."""
    out = {}
    for e in table:
        np_dtype, t_dtype = DTYPES[e["dtype"]]
        a = payload[e["offset"]:e["offset"] + e["nbytes"]].view(np_dtype).reshape(e["shape"])
        t = torch.from_numpy(a)
        out[e["name"]] = t.view(torch.bfloat16) if t_dtype == torch.bfloat16 else t
    return out


def as_numpy(t) -> np.ndarray:
    """numpy view of a decoded tensor; bfloat16 as its raw uint16 bits (config.layout.numpy_dtype)."""
    if isinstance(t, torch.Tensor):
        return (t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16
                else t.numpy())
    return np.asarray(t)


# ---------------------------------------------------------------------------------------- writing

def dumps_header(header: dict) -> bytes:
    try:
        return json.dumps(header, separators=(",", ":"), allow_nan=False,
                          ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise SchemaError(f"header cannot be encoded as strict JSON: {e}") from None


def pack(header: bytes, pieces: list, payload_len: int, tag: bytes = b"") -> list:
    """The buffers of one frame, in order (the payload pieces are not copied)."""
    length = 4 + len(header) + payload_len + len(tag)
    if length > 0xFFFFFFFF:
        raise ValueError(f"a frame of {length} bytes does not fit the 32-bit length prefix")
    return [_U32.pack(length) + _U32.pack(len(header)) + header, *pieces, tag]


def frame_bytes(header: bytes, payload: bytes = b"", tag: bytes = b"") -> bytes:
    """One frame as bytes; tests use it to build hostile frames."""
    return b"".join(bytes(p) for p in pack(header, [payload], len(payload), tag))


def send_buffers(sock: socket.socket, buffers: list, stall_timeout: float, stop=None,
                 io_lock=None) -> None:
    """Write all buffers on a socket with a short poll timeout; a peer that stops reading for
    ``stall_timeout`` seconds is given up on (the frame is then cut and the socket unusable)."""
    for buf in buffers:
        view = memoryview(buf).cast("B")
        sent, last = 0, time.monotonic()
        while sent < len(view):
            if stop is not None and stop.is_set():
                raise ConnectionClosed("endpoint stopping")
            try:
                if io_lock is None:
                    k = sock.send(view[sent:sent + (1 << 24)])
                else:
                    with io_lock:
                        k = sock.send(view[sent:sent + (1 << 20)])
            except (TimeoutError, BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                if time.monotonic() - last > stall_timeout:
                    raise PeerTimeout(f"peer did not read for {stall_timeout:g} s") from None
                continue
            except OSError as e:
                raise ConnectionClosed(f"socket error: {e}") from None
            sent += k
            last = time.monotonic()
