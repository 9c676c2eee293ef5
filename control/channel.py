"""One control-plane connection: framing, tags and sequence numbers over a socket.

A channel has one reader (the thread that owns it) and any number of writers (sends are
serialised by a lock, so pushes from other threads interleave whole frames only).
"""

from __future__ import annotations

import socket
import ssl
import threading
import time

from . import messages as m
from . import wire
from .wire import ConnectionClosed, SequenceError

POLL = 0.1  # socket timeout: how often blocked reads and writes look at the stop flag


class Channel:
    def __init__(self, sock: socket.socket, side: str, *, max_frame: int = wire.MAX_FRAME,
                 preauth_max_frame: int = wire.PREAUTH_MAX_FRAME, stall_timeout: float = 10.0,
                 idle_timeout: float | None = None, stop: threading.Event | None = None):
        self.sock = sock
        self.side = side  # our side: messages.CLIENT (trainer) or messages.SERVER (appliance)
        self.peer_side = m.SERVER if side == m.CLIENT else m.CLIENT
        self.max_frame = max_frame
        self.preauth_max_frame = preauth_max_frame
        self.stall_timeout = stall_timeout
        self.stop = stop if stop is not None else threading.Event()
        # OpenSSL objects must not be read and written concurrently: TLS serialises its I/O.
        self.io_lock = threading.Lock() if isinstance(sock, ssl.SSLSocket) else None
        self.source = wire.SocketSource(sock, stall_timeout, idle_timeout, self.stop, self.io_lock)
        self.session = None  # auth.Session once the handshake is done
        self.peer_role: str | None = None
        self.send_seq = 0
        self.recv_seq = 0
        self._wlock = threading.Lock()
        self.closed = False
        self.peer = peer_name(sock)
        sock.settimeout(POLL)

    @property
    def authenticated(self) -> bool:
        return self.session is not None

    def seal(self, msg: m.Message) -> list:
        """Encode, number and tag ``msg``; the caller holds the write lock (or owns the channel)."""
        header, pieces, n = m.encode(msg, self.send_seq)
        limit = self.max_frame if self.session is not None else self.preauth_max_frame
        if 4 + len(header) + n + wire.TAG_LEN > limit:
            raise ValueError(f"{msg.type} frame of {4 + len(header) + n} bytes exceeds the "
                             f"{limit}-byte frame limit; split it")
        tag = self.session.sign(header, pieces, n) if self.session is not None else b""
        msg.seq = self.send_seq
        self.send_seq += 1
        return wire.pack(header, pieces, n, tag)

    def seal_bytes(self, msg: m.Message) -> bytes:
        """The next frame as bytes without sending it (tests capture and replay frames with it)."""
        with self._wlock:
            return b"".join(bytes(b) for b in self.seal(msg))

    def send(self, msg: m.Message) -> int:
        """Send one message now; returns its sequence number. Raises ConnectionClosed/PeerTimeout."""
        if self.closed:
            raise ConnectionClosed("channel closed")
        with self._wlock:
            buffers = self.seal(msg)
            try:
                wire.send_buffers(self.sock, buffers, self.stall_timeout, self.stop, self.io_lock)
            except Exception:
                self.abort()  # a frame cut in half leaves the stream unusable
                raise
        return msg.seq

    def send_raw(self, data: bytes) -> None:
        """Write bytes as they are (tests: hostile frames)."""
        with self._wlock:
            wire.send_buffers(self.sock, [data], self.stall_timeout, self.stop, self.io_lock)

    def recv(self) -> m.Message:
        """Read, verify and check the next message. Raises ProtocolError or ConnectionClosed."""
        if self.session is None:
            raw = wire.read_frame(self.source, self.preauth_max_frame, 0)
        else:
            raw = wire.read_frame(self.source, self.max_frame, wire.TAG_LEN)
            self.session.verify(raw)  # before a byte of it is interpreted
        msg = m.from_frame(raw, sender=self.peer_side)
        if msg.seq != self.recv_seq:
            kind = "replayed or duplicated" if msg.seq < self.recv_seq else "out-of-order"
            raise SequenceError(f"{kind} frame: seq {msg.seq}, expected {self.recv_seq}")
        self.recv_seq += 1
        return msg

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
