"""NCCL's socket transport (``NCCL_NET=Socket``) on the wire: TCP streams -> each net connection's messages.

Facts, from NCCL's src/transport/net_socket.cc and src/misc/socket.cc (v2.18.6-1, v2.21.5-1,
v2.23.4-1, v2.26.2-1, v2.28.9-1, v2.30.7-1):

* A net connection (one per channel and direction between two ranks) is ``nsocks + 1`` TCP
  connections from the sender to a port the receiver listens on for that connection alone.
  ``nsocks = NCCL_NSOCKS_PERTHREAD x NCCL_SOCKET_NTHREADS``; both default to "auto", which is 0
  threads (so ``nsocks = 0``) except on AWS (0x1d0f: 2 x 8) and GCP (0x1ae0: 4 x 1) NICs.
* Each TCP connection opens, connector to acceptor, with the socket layer's hello
  (``headers.NCCL_SOCK_HELLO``: u64 magic, 0x564ab9f2fc4b9d6c unless NCCL_SOCKET_MAGIC says
  otherwise in 2.30; u32 type, 3 for a net socket; bootstrap and proxy sockets have other types)
  and then one byte, its index: 0..nsocks-1 data sockets, ``nsocks`` the control socket; they
  connect in index order, the control socket last. The acceptor sends nothing back.
* Each message (one NCCL step's send: the bytes a RoCE WRITE carries, LL/LL128 flags included)
  starts on the control socket with its size (``headers.NCCL_SOCK_SIZE``, int32, host order).
  From 2.27 a message of at most 128 bytes (NCCL_SOCKET_INLINE) follows inline on the control
  socket. Otherwise, with ``nsocks == 0`` the bytes follow on the control socket; with
  ``nsocks > 0`` they are cut into tasks of ``max(64 KiB, ceil(size / nsocks))`` bytes
  (NCCL_SOCKET_MIN_TASKSIZE from 2.27), handed to the data sockets round robin from where the
  previous message stopped (``nextSock``), each socket carrying its tasks back to back with no
  header. There is no message from receiver to sender (no CTS): TCP's own flow control.

``NcclSocketDecoder.feed(batch)`` reassembles TCP (``parser.gloo.tcp``) and returns each connection's
messages as ``SocketMessage`` once all their bytes are settled (present, or lost: holes).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from mirrorckpt.capture.batch import FrameBatch
from mirrorckpt.config.layout import address_text
from mirrorckpt.parser.gloo import tcp
from mirrorckpt.parser.headers import NCCL_SOCK_HELLO, NCCL_SOCK_SIZE

NET_SOCKET_TYPE = 3  # ncclSocketTypeNetSocket
DEFAULT_MAGIC = 0x564AB9F2FC4B9D6C  # NCCL_SOCKET_MAGIC
MIN_TASK_BYTES = 64 << 10  # MIN_CHUNKSIZE; NCCL_SOCKET_MIN_TASKSIZE's default from 2.27
INLINE_BYTES = 128  # NCCL_SOCKET_INLINE's default, 2.27 on
INLINE_FROM = (2, 27)
HELLO_BYTES = NCCL_SOCK_HELLO.size  # hello and index byte


def inline_bytes(nccl_version: tuple[int, int] | None) -> int:
    """Bytes a message may carry inline on the control socket in a release (None: before 2.27)."""
    return INLINE_BYTES if nccl_version is not None and tuple(nccl_version) >= INLINE_FROM else 0


@dataclass(frozen=True)
class SockConnKey:
    """One net connection: sender and receiver address (16 bytes) and the receiver's listening port."""

    sender: bytes
    receiver: bytes
    port: int

    def __str__(self) -> str:
        return f"{address_text(self.sender)}->{address_text(self.receiver)}:{self.port}"


@dataclass
class SocketMessage:
    conn: SockConnKey
    index: int  # 0-based message number on the connection
    size: int
    data: np.ndarray  # uint8, ``size`` bytes (zeros where a hole is)
    holes: list[tuple[int, int]]  # (offset, length) of bytes lost on the wire
    ts_ns: int  # capture time of the latest frame of its control socket when it was read


@dataclass
class _Conn:
    key: SockConnKey
    streams: dict[int, tcp.TcpStream] = field(default_factory=dict)  # socket index -> stream
    pos: dict[int, int] = field(default_factory=dict)  # socket index -> next unread byte
    nsocks: int | None = None
    next_sock: int = 0
    count: int = 0
    size_at: int | None = None  # the pending message's size, once read
    broken: str | None = None


class NcclSocketDecoder:
    """Messages of NCCL's socket transport from frame batches; ``notes`` says what was not followed."""

    def __init__(self, nccl_version: tuple[int, int] | None = None, min_task: int = MIN_TASK_BYTES,
                 window_bytes: int = tcp.DEFAULT_WINDOW_BYTES, hole_ns: int = tcp.DEFAULT_HOLE_NS):
        self.inline = inline_bytes(nccl_version)
        self.min_task = min_task
        self.tcp = tcp.TcpReassembler(window_bytes, hole_ns)
        self.conns: dict[SockConnKey, _Conn] = {}
        self._kind: dict[tcp.StreamKey, str] = {}  # "net" or why a stream is not followed
        self.ignored: Counter = Counter()
        self.counters = tcp.TcpCounters()

    def feed(self, batch: FrameBatch) -> list[SocketMessage]:
        segs, counters = tcp.decode(batch)
        self.counters.add(counters)
        return self._read(self.tcp.feed(segs, batch.data, int(batch.ts_ns[-1]) if len(batch) else None))

    def flush(self) -> list[SocketMessage]:
        return self._read(self.tcp.flush())

    @property
    def notes(self) -> list[str]:
        out = [f"{n} TCP stream(s) not followed: {why}" for why, n in sorted(self.ignored.items())]
        out += [f"connection {c.key}: {c.broken}" for c in self.conns.values() if c.broken]
        return out

    # -- streams to connections -----------------------------------------------------------------

    def _read(self, streams: list[tcp.TcpStream]) -> list[SocketMessage]:
        touched = {}
        for st in streams:
            conn = self._classify(st)
            if conn is not None:
                touched[conn.key] = conn
        out: list[SocketMessage] = []
        for conn in touched.values():
            out += self._messages(conn)
        return out

    def _classify(self, st: tcp.TcpStream) -> _Conn | None:
        kind = self._kind.get(st.key)
        if kind is None:
            if not st.from_syn:
                kind = "joined after its first byte (no SYN)"
            elif st.settled - st.start < HELLO_BYTES:
                return None  # its hello is still to come
            elif st.holes(st.start, st.start + HELLO_BYTES):
                kind = "its hello was lost"
            else:
                hello = NCCL_SOCK_HELLO.unpack(st.view(st.start, st.start + HELLO_BYTES))
                kind = "net" if hello["type"] == NET_SOCKET_TYPE else f"socket type {hello['type']} (not a net socket)"
                if kind == "net":
                    key = SockConnKey(st.key.src, st.key.dst, st.key.dport)
                    conn = self.conns.setdefault(key, _Conn(key))
                    conn.streams[hello["index"]] = st
                    conn.pos[hello["index"]] = st.start + HELLO_BYTES
                    if hello["magic"] != DEFAULT_MAGIC:
                        self.ignored[f"(followed) magic {hello['magic']:#x}, not NCCL's default"] += 1
            self._kind[st.key] = kind
            if kind != "net":
                self.ignored[kind] += 1
        if kind != "net":
            return None
        return self.conns[SockConnKey(st.key.src, st.key.dst, st.key.dport)]

    # -- connections to messages ----------------------------------------------------------------

    def _messages(self, conn: _Conn) -> list[SocketMessage]:
        if conn.broken:
            return []
        if conn.nsocks is None:
            # data starts only after every socket has connected (the control socket last)
            if not any(conn.streams[i].settled > conn.pos[i] for i in conn.streams):
                return []
            conn.nsocks = max(conn.streams)
            missing = sorted(set(range(conn.nsocks + 1)) - set(conn.streams))
            if missing:
                conn.broken = f"sockets {missing} of {conn.nsocks + 1} never opened on the wire"
                return []
        ctl_index = conn.nsocks
        ctl = conn.streams[ctl_index]
        out = []
        while True:
            if conn.size_at is None:
                at = conn.pos[ctl_index]
                if ctl.settled < at + NCCL_SOCK_SIZE.size:
                    break
                if ctl.holes(at, at + NCCL_SOCK_SIZE.size):
                    conn.broken = f"the size of message {conn.count} was lost: its framing cannot be followed"
                    break
                conn.size_at = NCCL_SOCK_SIZE.unpack(ctl.view(at, at + NCCL_SOCK_SIZE.size))["size"]
                if conn.size_at < 0:
                    conn.broken = f"message {conn.count} has size {conn.size_at}"
                    break
                conn.pos[ctl_index] = at + NCCL_SOCK_SIZE.size
            pieces, next_sock = self._pieces(conn, conn.size_at)
            ends = {}
            for sock, n in pieces:
                ends[sock] = ends.get(sock, conn.pos[sock]) + n
            if any(conn.streams[s].settled < e for s, e in ends.items()):
                break  # still in flight
            data = np.empty(conn.size_at, np.uint8)
            holes: list[tuple[int, int]] = []
            off = 0
            for sock, n in pieces:
                st, a = conn.streams[sock], conn.pos[sock]
                data[off:off + n] = st.view(a, a + n)
                holes += [(off + s, ln) for s, ln in st.holes(a, a + n)]
                conn.pos[sock] = a + n
                off += n
            out.append(SocketMessage(conn.key, conn.count, conn.size_at, data, holes, ctl.last_ts))
            conn.count += 1
            conn.size_at = None
            conn.next_sock = next_sock
            for sock in {s for s, _ in pieces} | {ctl_index}:
                conn.streams[sock].release(conn.pos[sock])
        return out

    def _pieces(self, conn: _Conn, size: int) -> tuple[list[tuple[int, int]], int]:
        """[(socket index, bytes)] in message order, and the connection's next data socket after it."""
        if conn.nsocks == 0 or size <= self.inline:
            return [(conn.nsocks, size)], conn.next_sock
        task = max(self.min_task, -(-size // conn.nsocks))
        out, sock, off = [], conn.next_sock, 0
        while off < size:
            n = min(task, size - off)
            out.append((sock, n))
            sock = (sock + 1) % conn.nsocks
            off += n
        return out, sock
