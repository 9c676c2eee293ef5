"""NCCL's socket transport written as NCCL writes it (``parser.roce.ncclsock`` states the framing), for tests.

``SocketConnection`` is one net connection: ``nsocks`` data sockets and the control socket, each
a TCP connection from the sender to the receiver's listening port, opened in index order with a
SYN and the hello and index byte. ``send(message)`` writes the size on the control socket and the
bytes inline (2.27+, up to 128 bytes), on the control socket (``nsocks == 0``) or as tasks over
the data sockets round robin. ``frames()`` gives every segment, cut at ``mss``, as
(capture time, frame bytes) in the order written. Test tooling: per-segment Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mirrorckpt.parser.gloo.tcp import ACK, SYN
from mirrorckpt.parser.headers import NCCL_SOCK_HELLO, NCCL_SOCK_SIZE
from mirrorckpt.parser.roce.ncclsock import DEFAULT_MAGIC, MIN_TASK_BYTES, NET_SOCKET_TYPE, inline_bytes
from mirrorckpt.tools.generator.tcpframes import tcp_frame


@dataclass
class _Socket:
    sport: int
    seq: int  # next sequence number


@dataclass
class SocketConnection:
    sender: str  # address text
    receiver: str
    port: int  # the receiver's listening port
    first_sport: int  # the sender's ports: first_sport + socket index
    nsocks: int = 0
    nccl_version: tuple[int, int] | None = None
    mss: int = 1448
    isn: int = 1000
    magic: int = DEFAULT_MAGIC
    socket_type: int = NET_SOCKET_TYPE
    min_task: int = MIN_TASK_BYTES
    out: list[tuple[int, bytes]] = field(default_factory=list)  # (time, frame)
    clock: int = 0
    next_sock: int = 0

    def __post_init__(self):
        self.socks: list[_Socket] = []
        for index in range(self.nsocks + 1):  # data sockets first, the control socket last
            sock = _Socket(self.first_sport + index, self.isn + 100_000 * index)
            self._emit(sock, b"", SYN)
            sock.seq += 1
            self.socks.append(sock)
            hello = NCCL_SOCK_HELLO.pack(magic=self.magic, type=self.socket_type, index=index)
            self.write(index, hello)

    @property
    def control(self) -> int:
        return self.nsocks

    def _emit(self, sock: _Socket, payload: bytes, flags: int = ACK) -> None:
        self.clock += 1000
        self.out.append((self.clock, tcp_frame(self.sender, self.receiver, sock.sport, self.port, sock.seq,
                                               payload, flags)))

    def write(self, index: int, data: bytes) -> None:
        """``data`` on socket ``index``, in segments of at most ``mss`` bytes."""
        sock = self.socks[index]
        for off in range(0, len(data), self.mss):
            piece = data[off:off + self.mss]
            self._emit(sock, piece)
            sock.seq += len(piece)

    def send(self, message: bytes) -> None:
        size = len(message)
        if self.nsocks == 0 or size <= inline_bytes(self.nccl_version):
            self.write(self.control, NCCL_SOCK_SIZE.pack(size=size) + message)
            return
        self.write(self.control, NCCL_SOCK_SIZE.pack(size=size))
        task = max(self.min_task, -(-size // self.nsocks))
        for off in range(0, size, task):
            self.write(self.next_sock, message[off:off + task])
            self.next_sock = (self.next_sock + 1) % self.nsocks

    def frames(self) -> list[tuple[int, bytes]]:
        return list(self.out)
