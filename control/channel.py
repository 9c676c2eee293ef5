"""One control-plane connection: framing, tags and sequence numbers over a socket.

A channel has one reader (the thread that owns it) and any number of writers (sends are
serialised by a lock, so pushes from other threads interleave whole frames only). A message with
more payload than ``stream_frame`` bytes is streamed (``wire``: a head and MORE frames); one
stream is written at a time, and small messages from other threads may pass between its frames.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from dataclasses import dataclass

import numpy as np
from mirrorckpt.control import messages as m
from mirrorckpt.control import wire
from mirrorckpt.control.wire import ConnectionClosed, FrameTooLarge, MalformedFrame, SequenceError

POLL = 0.1  # socket timeout: how often blocked reads and writes look at the stop flag


@dataclass
class _Stream:
    """A streamed message being received: its checked header and its payload, filled in order."""

    header: dict
    payload: np.ndarray
    got: int = 0


class Channel:
    def __init__(self, sock: socket.socket, side: str, *, max_frame: int = wire.MAX_FRAME,
                 preauth_max_frame: int = wire.PREAUTH_MAX_FRAME, stall_timeout: float = 10.0,
                 idle_timeout: float | None = None, stop: threading.Event | None = None,
                 stream_frame: int = wire.STREAM_FRAME, max_message: int = wire.MAX_MESSAGE):
        stream_frame = min(stream_frame, max_frame - 1024)  # a MORE frame's header is tiny
        if stream_frame < 1:
            raise ValueError(f"max_frame of {max_frame} bytes leaves no room for a frame's payload")
        self.sock = sock
        self.side = side  # our side: messages.CLIENT (trainer) or messages.SERVER (appliance)
        self.peer_side = m.SERVER if side == m.CLIENT else m.CLIENT
        self.max_frame = max_frame
        self.preauth_max_frame = preauth_max_frame
        self.stall_timeout = stall_timeout
        self.stream_frame, self.max_message = stream_frame, max_message
        self.stop = stop if stop is not None else threading.Event()
        # OpenSSL objects must not be read and written concurrently: TLS serialises its I/O.
        self.io_lock = threading.Lock() if isinstance(sock, ssl.SSLSocket) else None
        self.source = wire.SocketSource(sock, stall_timeout, idle_timeout, self.stop, self.io_lock)
        self.session = None  # auth.Session once the handshake is done
        self.peer_role: str | None = None
        self.send_seq = 0
        self.recv_seq = 0
        self._wlock = threading.Lock()
        self._slock = threading.Lock()  # one outgoing stream at a time
        self._stream: _Stream | None = None  # incoming stream in progress
        self.frames_sent = self.frames_received = 0
        self.closed = False
        self.peer = peer_name(sock)
        sock.settimeout(POLL)

    @property
    def authenticated(self) -> bool:
        return self.session is not None

    def _sign(self, header: bytes, pieces: list, n: int) -> list:
        """Number-checked, tagged buffers of one frame; the caller holds the write lock."""
        limit = self.max_frame if self.session is not None else self.preauth_max_frame
        if 4 + len(header) + n + wire.TAG_LEN > limit:
            raise ValueError(f"frame of {4 + len(header) + n} bytes exceeds the {limit}-byte frame limit")
        tag = self.session.sign(header, pieces, n) if self.session is not None else b""
        self.send_seq += 1
        self.frames_sent += 1
        return wire.pack(header, pieces, n, tag)

    def _streamed(self, n: int) -> bool:
        return self.session is not None and n > self.stream_frame

    def seal(self, msg: m.Message) -> list:
        """Encode, number and tag ``msg`` as one frame; the caller holds the write lock."""
        table, pieces, n = m.encode_payload(msg)
        if self._streamed(n):
            raise ValueError(f"{msg.type} of {n} payload bytes is streamed: use send()")
        msg.seq = self.send_seq
        return self._sign(m.encode_header(msg, self.send_seq, table), pieces, n)

    def _frames(self, msg: m.Message):
        """The buffers of each frame of ``msg``, sealed one at a time under the write lock."""
        table, pieces, n = m.encode_payload(msg)
        if n > self.max_message:
            raise ValueError(f"{msg.type} of {n} payload bytes exceeds the {self.max_message}-byte message limit")
        if not self._streamed(n):
            with self._wlock:
                msg.seq = self.send_seq
                yield self._sign(m.encode_header(msg, self.send_seq, table), pieces, n)
            return
        with self._wlock:
            msg.seq = self.send_seq
            yield self._sign(m.encode_header(msg, self.send_seq, table, stream=n), [], 0)
        for off, views, k in wire.chunks(pieces, self.stream_frame):
            with self._wlock:
                yield self._sign(wire.more_header(self.send_seq, off), views, k)

    def seal_bytes(self, msg: m.Message) -> bytes:
        """The frames of ``msg`` as bytes without sending them (tests capture and replay frames)."""
        with self._slock:
            return b"".join(bytes(b) for buffers in self._frames(msg) for b in buffers)

    def send(self, msg: m.Message) -> int:
        """Send one message now (streamed when large); returns its sequence number. Raises
        ConnectionClosed/PeerTimeout; a stream cut in the middle leaves the channel aborted."""
        if self.closed:
            raise ConnectionClosed("channel closed")
        table_n = wire.payload_bound(msg.tensors)
        lock = self._slock if self.session is not None and table_n > self.stream_frame else _NO_LOCK
        with lock:
            gen = self._frames(msg)
            while True:
                # each frame is written while the write lock is held (the generator holds it
                # between yields), so frames of different threads never interleave mid-frame
                try:
                    buffers = next(gen)
                except StopIteration:
                    break
                try:
                    wire.send_buffers(self.sock, buffers, self.stall_timeout, self.stop, self.io_lock)
                except Exception:
                    gen.close()
                    self.abort()  # a frame or stream cut in half leaves the stream unusable
                    raise
        return msg.seq

    def send_raw(self, data: bytes) -> None:
        """Write bytes as they are (tests: hostile frames)."""
        with self._wlock:
            wire.send_buffers(self.sock, [data], self.stall_timeout, self.stop, self.io_lock)

    def _place(self, header: bytes, n: int):
        """Where the payload of the frame being read goes: a MORE frame's bytes go straight into
        the open stream's buffer, at the next offset (anything else there is refused)."""
        more = wire.parse_more(header)
        if more is None:
            return None
        st = self._stream
        if st is None:
            raise MalformedFrame("MORE frame without a stream in progress")
        _, off = more
        if off != st.got or n == 0 or off + n > st.payload.size:
            raise MalformedFrame(f"MORE frame of {n} bytes at offset {off}; the stream expects offset "
                                 f"{st.got} and has {st.payload.size - st.got} bytes left")
        return st.payload[off:off + n]

    def _check_seq(self, seq: int) -> None:
        if seq != self.recv_seq:
            kind = "replayed or duplicated" if seq < self.recv_seq else "out-of-order"
            raise SequenceError(f"{kind} frame: seq {seq}, expected {self.recv_seq}")
        self.recv_seq += 1

    def recv(self) -> m.Message:
        """Read, verify and check the next message. Raises ProtocolError or ConnectionClosed."""
        while True:
            if self.session is None:
                raw = wire.read_frame(self.source, self.preauth_max_frame, 0)
            else:
                raw = wire.read_frame(self.source, self.max_frame, wire.TAG_LEN, self._place)
                self.session.verify(raw)  # before a byte of it is interpreted
            self.frames_received += 1
            more = wire.parse_more(raw.header) if self.session is not None else None
            if more is not None:
                self._check_seq(more[0])
                st = self._stream
                st.got += raw.payload.size
                if st.got < st.payload.size:
                    continue
                self._stream = None
                return m.from_header(st.header, st.payload)
            h = m.check_header(raw.header, raw.payload.size, sender=self.peer_side)
            self._check_seq(h["seq"])
            if "stream" not in h:
                return m.from_header(h, raw.payload)
            if self._stream is not None:
                raise MalformedFrame("a new stream began before the last one ended")
            if h["stream"] > self.max_message:
                raise FrameTooLarge(f"streamed {h['type']} of {h['stream']} bytes exceeds the limit "
                                    f"of {self.max_message} bytes")
            self._stream = _Stream(h, wire.aligned_buffer(h["stream"]))

    def stream_progress(self) -> tuple[int, int] | None:
        """(bytes received, bytes in all) of the stream being received, if any."""
        st = self._stream
        return None if st is None else (st.got, int(st.payload.size))

    def set_deadline(self, seconds: float | None) -> None:
        self.source.deadline = None if seconds is None else time.monotonic() + seconds

    def abort(self) -> None:
        """End the connection from any thread. Only shuts the socket down: the reader thread
        still uses the descriptor and closes it (closing here could let a new socket reuse it)."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Shut down and release the socket; only the thread that reads the channel calls this."""
        self.abort()
        self.sock.close()


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_LOCK = _NoLock()


def peer_name(sock) -> str:
    """host:port of the peer, for log lines."""
    try:
        addr = sock.getpeername()
    except OSError:
        return "?"
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr or "local")


class Replies:
    """Request ids and the threads waiting for their replies."""

    def __init__(self):
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: dict[int, list] = {}  # rid -> [event, reply or None, channel or None]

    def new(self) -> int:
        with self._lock:
            self._next += 1
            self._waiting[self._next] = [threading.Event(), None, None]
            return self._next

    def sent_on(self, rid: int, chan) -> None:
        with self._lock:
            if rid in self._waiting:
                self._waiting[rid][2] = chan

    def deliver(self, msg: m.Message, chan) -> bool:
        """Hand a reply to its waiter; False if nobody waits for it (late or unsolicited)."""
        with self._lock:
            w = self._waiting.get(msg.re) if msg.re is not None else None
            if w is None or (w[2] is not None and w[2] is not chan):
                return False
            w[1] = msg
            w[0].set()
            return True

    def fail(self, chan, why: str) -> None:
        """Wake the waiters whose request went out on ``chan``: their reply will never come."""
        with self._lock:
            for w in self._waiting.values():
                if w[2] is chan and w[1] is None:
                    w[1] = why
                    w[0].set()

    def abort(self, rid: int, why: str) -> None:
        """Wake one waiter whose request could not be sent."""
        with self._lock:
            w = self._waiting.get(rid)
            if w is not None and w[1] is None:
                w[1] = why
                w[0].set()

    def wait(self, rid: int, timeout: float) -> m.Message:
        with self._lock:
            w = self._waiting[rid]
        try:
            if not w[0].wait(timeout):
                raise RequestTimeout(f"no reply to request {rid} within {timeout:g} s")
        finally:
            with self._lock:
                self._waiting.pop(rid, None)
        if isinstance(w[1], str):
            raise ConnectionClosed(f"connection lost before the reply to request {rid}: {w[1]}")
        if w[1].type == m.ERROR:
            raise RemoteError(w[1].body["reason"], w[1])
        return w[1]

    def cancel(self, rid: int) -> None:
        with self._lock:
            self._waiting.pop(rid, None)


class RequestTimeout(TimeoutError):
    pass


class RemoteError(Exception):
    """The peer answered a request with ERROR."""

    def __init__(self, reason: str, reply: m.Message):
        super().__init__(reason)
        self.reply = reply
