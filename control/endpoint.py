"""The two ends of the control plane: ``ControlServer`` (appliance) and ``ControlClient`` (trainer).

The server runs one thread per connection. A connection first completes the handshake (TLS when
configured, then HMAC; small frames only) within ``handshake_timeout`` in all, enforced by the
acceptor, which shuts down any connection past its deadline; after that each frame is verified,
sequence-checked and schema-checked before the handler for its type is called. Any violation
closes the connection with one WARNING line on the "mirrorckpt.control" logger; nothing escapes a
thread. Unauthenticated connections hold handshake slots: at most ``handshake_slots`` per source
address and ``max_handshakes`` in all, apart from the ``max_connections`` authenticated ones, so
idle or hostile connections cannot keep a trainer out.

The client never blocks the training loop: ``send`` only queues (see ``outbox``), a writer thread
sends, and a connection thread (re)connects with bounded exponential backoff and reads.
"""

from __future__ import annotations

import logging
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable

from mirrorckpt.control import auth, wire
from mirrorckpt.control import messages as m
from mirrorckpt.control.channel import POLL, Channel, RemoteError, Replies, RequestTimeout, peer_name  # noqa: F401 - re-exported
from mirrorckpt.control.outbox import Outbox, OutboxClosed, QueueFull  # noqa: F401 - re-exported
from mirrorckpt.control.wire import ConnectionClosed, ProtocolError


class Refused(ValueError):
    """A handler's answer to a message whose content does not fit its state; nothing was changed
    (the sender gets an ERROR with this text)."""

LOGGER = "mirrorckpt.control"
log = logging.getLogger(LOGGER)

Handler = Callable[[m.Message, Channel], "m.Message | None"]


def setup_logging(level: int = logging.INFO, stream=None) -> logging.Logger:
    """One readable line per event on stderr (or ``stream``); safe to call more than once."""
    logger = logging.getLogger(LOGGER)
    if not any(getattr(h, "mirrorckpt", False) for h in logger.handlers):
        h = logging.StreamHandler(stream)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        h.mirrorckpt = True
        logger.addHandler(h)
    logger.setLevel(level)
    return logger


def one_line(text: str, limit: int) -> str:
    """Peer- or handler-supplied text made safe for a single log line."""
    return text.replace("\r", "\\r").replace("\n", "\\n")[:limit]


def _internal_error(what: str, e: BaseException) -> None:
    # A bug of ours, not the peer's: one line, the traceback only when debugging.
    log.error("%s: internal error %s: %s", what, type(e).__name__, e,
              exc_info=log.isEnabledFor(logging.DEBUG))


def _check_handlers(handlers: dict, sender: str) -> dict:
    for t in handlers:
        spec = m.REGISTRY.get(t)
        if spec is None or t in m.HANDSHAKE or t == m.PING or spec.sender not in (m.ANY, sender):
            raise ValueError(f"no handler can be registered for message type {t!r} here")
    return dict(handlers)


def _run_handler(handlers: dict, msg: m.Message, chan: Channel, ctx) -> None:
    """Call the handler of an authenticated, valid message; send its reply if one was asked for."""
    handler = handlers.get(msg.type)
    if handler is None:
        if msg.type in (m.ACK, m.PONG):
            return  # an acknowledgement nobody waits for any more
        log.warning("%s: no handler for %s; ignored", chan.peer, msg.type)
        out = m.make(m.ERROR, reason=f"{msg.type} is not handled here", code="unhandled")
    else:
        try:
            out = handler(msg, ctx)
        except Exception as e:  # noqa: BLE001 - a handler's failure is answered, not fatal
            why = f"{type(e).__name__}: {e}"
            log.warning("%s: handler for %s refused it: %s", chan.peer, msg.type, one_line(why, 200))
            out = m.make(m.ERROR, reason=why[:m.MAX_STR], code="handler")
        if out is not None and not isinstance(out, m.Message):
            log.error("%s: handler for %s returned %s, not a Message; no reply sent",
                      chan.peer, msg.type, type(out).__name__)
            out = None
    if out is not None and msg.rid is not None:
        out.re = msg.rid
        chan.send(out)


class ControlServer:
    """The appliance's control-plane endpoint.

    ``handlers`` maps a message type (``messages.REGISTER``...) to ``handler(msg, channel)``,
    called in the connection's thread for valid authenticated messages only; a returned message
    is sent as the reply when the trainer asked for one (``msg.rid``). PING is always answered by
    the server itself. Call ``start()`` (or use it as a context manager); ``port=0`` picks a free port.
    """

    def __init__(self, host: str, port: int, secret: bytes | str, handlers: dict[str, Handler],
                 *, roles=("trainer",), max_frame: int = wire.MAX_FRAME,
                 preauth_max_frame: int = wire.PREAUTH_MAX_FRAME, read_timeout: float = 10.0,
                 idle_timeout: float | None = 120.0, handshake_timeout: float = 3.0,
                 max_connections: int = 16, handshake_slots: int = 4, max_handshakes: int = 256,
                 ssl_context: ssl.SSLContext | None = None,
                 stream_frame: int = wire.STREAM_FRAME, max_message: int = wire.MAX_MESSAGE):
        self.host, self.port = host, port
        self.secret = auth.normalize_secret(secret)
        self.handlers = _check_handlers(handlers, m.CLIENT)
        self.roles = frozenset(roles)
        self.max_frame, self.preauth_max_frame = max_frame, preauth_max_frame
        self.stream_frame, self.max_message = stream_frame, max_message
        self.read_timeout, self.idle_timeout = read_timeout, idle_timeout
        self.handshake_timeout = handshake_timeout
        self.max_connections = max_connections
        self.handshake_slots, self.max_handshakes = handshake_slots, max_handshakes
        self.ssl_context = ssl_context
        self.replies = Replies()
        self.rejected = 0  # connections closed for a protocol violation
        self.refused = 0  # connections closed at once: no handshake slot, or no room after authentication
        self.expired = 0  # handshakes cut off at their deadline
        self._pending: dict[object, list] = {}  # handshake in progress: token -> [source, deadline, socket]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[Channel] = set()
        self._threads: set[threading.Thread] = set()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> ControlServer:
        if self._listener is not None:
            return self
        s = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.host, self.port))
        s.listen(min(socket.SOMAXCONN, self.max_connections + self.max_handshakes))
        s.settimeout(POLL)
        self._listener = s
        self.port = s.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, name="control-accept", daemon=True)
        self._acceptor.start()
        log.info("control server listening on %s:%d", self.host, self.port)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for c in conns:
            c.abort()  # each connection thread closes its own socket
        for t in [self._acceptor, *threads]:
            if t is not None and t is not threading.current_thread():
                t.join(timeout)

    def __enter__(self) -> ControlServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ talking to trainers
    def peers(self) -> list[Channel]:
        """Authenticated connections."""
        with self._lock:
            return [c for c in self._conns if c.authenticated and not c.closed]

    def push(self, msg: m.Message, peer: Channel | None = None) -> int:
        """Send ``msg`` now to ``peer`` or to every authenticated trainer; returns how many got it."""
        sent = 0
        for c in [peer] if peer is not None else self.peers():
            try:
                c.send(msg)
                sent += 1
            except (ConnectionClosed, ProtocolError) as e:
                log.warning("%s: push of %s failed: %s", c.peer, msg.type, e)
        return sent

    def request(self, peer: Channel, msg: m.Message, timeout: float = 10.0) -> m.Message:
        """Send ``msg`` to ``peer`` and wait for its reply (not from inside that peer's handler)."""
        msg.rid = self.replies.new()
        self.replies.sent_on(msg.rid, peer)
        try:
            peer.send(msg)
        except Exception:
            self.replies.cancel(msg.rid)
            raise
        return self.replies.wait(msg.rid, timeout)

    # ------------------------------------------------------------------ threads
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            self._expire()
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if not self._stop.is_set():
                    log.error("control server: accept failed; listener closed")
                return
            token = object()
            with self._lock:
                mine = sum(1 for p in self._pending.values() if p[0] == addr[0])
                full = mine >= self.handshake_slots or len(self._pending) >= self.max_handshakes
                if not full:
                    self._pending[token] = [addr[0], time.monotonic() + self.handshake_timeout, sock]
            if full:
                self._refuse(sock, f"{addr[0]}:{addr[1]}: refused: no handshake slot ({mine} of "
                                   f"{self.handshake_slots} for this address in use, {len(self._pending)} in all)")
                continue
            t = threading.Thread(target=self._serve, args=(sock, token), name=f"control-{addr[1]}", daemon=True)
            with self._lock:
                self._threads.add(t)
            t.start()

    def _refuse(self, sock: socket.socket, why: str) -> None:
        sock.close()
        with self._lock:
            self.refused += 1
            n = self.refused
        if n & (n - 1) == 0:  # 1, 2, 4, 8...: a flood does not flood the log
            log.warning("%s (%d refused so far)", why, n)

    def _expire(self) -> None:
        """Shut down connections whose handshake outlived its deadline (a slow TLS or HMAC peer);
        their threads then fail their read and close them."""
        now = time.monotonic()
        with self._lock:
            for p in self._pending.values():
                if p[1] is not None and now > p[1]:
                    p[1] = None
                    self.expired += 1
                    try:
                        socket.socket.shutdown(p[2], socket.SHUT_RDWR)  # the raw socket, also under TLS
                    except OSError:
                        pass

    def _serve(self, sock: socket.socket, token: object = None) -> None:
        chan = None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                sock = self._tls(sock, token)
            chan = Channel(sock, m.SERVER, max_frame=self.max_frame,
                           preauth_max_frame=self.preauth_max_frame,
                           stall_timeout=self.read_timeout, stop=self._stop,
                           stream_frame=self.stream_frame, max_message=self.max_message)
            with self._lock:
                self._conns.add(chan)
                left = self._pending[token][1] if token in self._pending else None
            chan.set_deadline(max(0.0, left - time.monotonic()) if left is not None else self.handshake_timeout)
            role = auth.server_handshake(chan, self.secret, self.roles)
            chan.set_deadline(None)
            with self._lock:
                self._pending.pop(token, None)
                room = sum(1 for c in self._conns if c.authenticated and not c.closed) <= self.max_connections
            if not room:
                raise ConnectionClosed(f"refused after authentication: already {self.max_connections} trainers")
            chan.source.idle_timeout = self.idle_timeout
            log.info("%s: authenticated as %s", chan.peer, role)
            while True:
                msg = chan.recv()
                self._dispatch(chan, msg)
        except ProtocolError as e:
            if self._stop.is_set():
                log.info("%s: closed by shutdown: %s", peer_name(sock), e.describe())
                return
            with self._lock:
                self.rejected += 1
            who = chan.peer_role if chan is not None and chan.peer_role else "unauthenticated"
            log.warning("rejected %s (%s): %s; connection closed",
                        chan.peer if chan is not None else "?", who, e.describe())
        except ConnectionClosed as e:
            log.info("%s: connection closed: %s", chan.peer if chan is not None else "?", e)
        except (ssl.SSLError, OSError) as e:
            with self._lock:
                self.rejected += 1
            log.warning("rejected %s: TLS/socket error: %s; connection closed", peer_name(sock), e)
        except Exception as e:  # noqa: BLE001 - nothing escapes a server thread
            _internal_error(chan.peer if chan is not None else "control", e)
        finally:
            with self._lock:
                self._pending.pop(token, None)  # before the descriptor can be reused
            if chan is not None:
                chan.close()
                self.replies.fail(chan, "connection closed")
            else:
                sock.close()
            with self._lock:
                self._conns.discard(chan)
                self._threads.discard(threading.current_thread())

    def _tls(self, sock: socket.socket, token: object) -> socket.socket:
        sock.settimeout(self.handshake_timeout)
        tls = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        with self._lock:
            if token in self._pending:
                self._pending[token][2] = tls  # the descriptor the deadline shuts down
        try:
            tls.do_handshake()
        except BaseException:
            tls.close()  # the TLS socket owns the descriptor now
            raise
        return tls

    def _dispatch(self, chan: Channel, msg: m.Message) -> None:
        if msg.re is not None and self.replies.deliver(msg, chan):
            return
        if msg.type == m.PING:  # always answered: the trainer's keepalive doubles as its liveness check
            chan.send(m.make(m.PONG, re=msg.rid))
            return
        _run_handler(self.handlers, msg, chan, chan)


class ControlClient:
    """The trainer's control-plane endpoint.

    ``start()`` returns at once; a background thread connects (``connect_timeout`` per attempt,
    backoff from ``backoff_initial`` doubling up to ``backoff_max`` between attempts) and
    reconnects whenever the connection is lost. ``send`` queues and returns; ``request`` waits for
    the reply. ``handlers`` answer messages the appliance pushes (FALLBACK_REQUEST...):
    ``handler(msg, client)`` runs in the connection thread and should only hand work over.
    ``on_connect(client)`` may return messages sent first on every new connection (e.g. REGISTER).
    """

    def __init__(self, host: str, port: int, secret: bytes | str, role: str = "trainer", *,
                 handlers: dict[str, Callable] | None = None, connect_timeout: float = 5.0,
                 read_timeout: float = 10.0, idle_timeout: float | None = None,
                 ping_interval: float = 10.0, backoff_initial: float = 0.05,
                 backoff_max: float = 5.0, max_queue: int = 256, block_timeout: float = 30.0,
                 max_frame: int = wire.MAX_FRAME, ssl_context: ssl.SSLContext | None = None,
                 server_hostname: str | None = None, stream_frame: int = wire.STREAM_FRAME,
                 max_message: int = wire.MAX_MESSAGE,
                 on_connect: Callable[[ControlClient], list] | None = None):
        if role == auth.APPLIANCE_ROLE or not m.ROLE.fullmatch(role):
            raise ValueError(f"invalid trainer role {role!r}")
        self.host, self.port = host, port
        self.secret = auth.normalize_secret(secret)
        self.role = role
        self.handlers = _check_handlers(handlers or {}, m.SERVER)
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.idle_timeout, self.ping_interval = idle_timeout, ping_interval
        self.backoff_initial, self.backoff_max = backoff_initial, backoff_max
        self.max_frame = max_frame
        self.stream_frame, self.max_message = stream_frame, max_message
        self.ssl_context, self.server_hostname = ssl_context, server_hostname
        self.on_connect = on_connect
        self.outbox = Outbox(max_queue, block_timeout)
        self.replies = Replies()
        self.connections = 0  # successful handshakes so far
        self.connect_failures = 0
        self.sent = 0
        self._chan: Channel | None = None
        self._connected = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def drops(self):
        """Messages dropped by the queue policy, by type."""
        return self.outbox.drops

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def start(self) -> ControlClient:
        if self._threads:
            return self
        for target, name in ((self._run, "control-client"), (self._write, "control-writer")):
            t = threading.Thread(target=target, name=name, daemon=True)
            self._threads.append(t)
            t.start()
        return self

    def wait_connected(self, timeout: float) -> bool:
        return self._connected.wait(timeout)

    def send(self, msg: m.Message, timeout: float | None = None) -> bool:
        """Queue ``msg``; False when the queue policy dropped it (STEP_META). See ``Outbox.put``.
        A message above ``max_message`` is refused here (ValueError), not after queueing; one
        above ``stream_frame`` goes in several frames."""
        self._check_size(msg)
        return self.outbox.put(msg, timeout)

    def _check_size(self, msg: m.Message) -> None:
        bound = wire.payload_bound(msg.tensors)
        if bound > self.max_message:  # the exact check runs when sending
            raise ValueError(f"{msg.type} with {bound} payload bytes may exceed the {self.max_message}-byte "
                             f"message limit")

    def request(self, msg: m.Message, timeout: float = 10.0) -> m.Message:
        """Send ``msg`` and wait for the reply; ERROR replies raise ``RemoteError``."""
        self._check_size(msg)
        msg.rid = self.replies.new()
        try:
            self.outbox.put(msg, timeout)
        except Exception:
            self.replies.cancel(msg.rid)
            raise
        return self.replies.wait(msg.rid, timeout)

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued has been written; False on timeout."""
        return self.outbox.wait_empty(timeout)

    def close(self, flush_timeout: float = 0.0) -> None:
        if flush_timeout > 0:
            self.flush(flush_timeout)
        self._stop.set()
        self.outbox.close()
        chan = self._chan
        if chan is not None:
            chan.abort()  # the connection thread closes the socket
        for t in self._threads:
            t.join(5.0)

    def __enter__(self) -> ControlClient:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ connection thread
    def _dial(self) -> Channel:
        sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(sock, server_hostname=self.server_hostname or self.host)
            chan = Channel(sock, m.CLIENT, max_frame=self.max_frame, stall_timeout=self.read_timeout,
                           stop=self._stop, stream_frame=self.stream_frame, max_message=self.max_message)
            chan.set_deadline(self.connect_timeout)
            auth.client_handshake(chan, self.secret, self.role)
            chan.set_deadline(None)
            chan.source.idle_timeout = self.idle_timeout
            for msg in (self.on_connect(self) if self.on_connect else None) or []:
                chan.send(msg)
            return chan
        except BaseException:
            sock.close()
            raise

    def _run(self) -> None:
        delay = self.backoff_initial
        where = f"{self.host}:{self.port}"
        while not self._stop.is_set():
            try:
                chan = self._dial()
            except (OSError, ssl.SSLError, ProtocolError, ConnectionClosed) as e:
                if self._stop.is_set():
                    break
                self.connect_failures += 1
                why = e.describe() if isinstance(e, ProtocolError) else f"{type(e).__name__}: {e}"
                log.warning("appliance %s: connection failed (%s); retrying in %.2f s", where, why, delay)
                self._stop.wait(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, self.backoff_max)
                continue
            except Exception as e:  # noqa: BLE001 - e.g. on_connect failed; keep trying
                _internal_error(f"appliance {where}", e)
                self._stop.wait(delay)
                delay = min(delay * 2, self.backoff_max)
                continue
            delay = self.backoff_initial
            self.connections += 1
            self._chan = chan
            self._connected.set()
            log.info("appliance %s: connected (session %d)", where, self.connections)
            try:
                while True:
                    self._dispatch(chan, chan.recv())
            except ProtocolError as e:
                log.warning("rejected appliance %s: %s; connection closed", where, e.describe())
            except ConnectionClosed as e:
                if not self._stop.is_set():
                    log.info("appliance %s: connection lost: %s", where, e)
            except Exception as e:  # noqa: BLE001
                _internal_error(f"appliance {where}", e)
            finally:
                self._connected.clear()
                self._chan = None
                chan.close()
                self.replies.fail(chan, "connection lost")

    def _dispatch(self, chan: Channel, msg: m.Message) -> None:
        if msg.re is not None and self.replies.deliver(msg, chan):
            return
        if msg.type == m.PING:
            if msg.rid is not None:
                chan.send(m.make(m.PONG, re=msg.rid))
            return
        _run_handler(self.handlers, msg, chan, self)

    # ------------------------------------------------------------------ writer thread
    def _write(self) -> None:
        last = time.monotonic()
        while True:
            chan = self._wait_channel()  # nothing leaves the queue while there is no connection
            if chan is None:
                return
            msg = self.outbox.get(POLL)
            if msg is None:
                if self.outbox.closed:
                    return
                if time.monotonic() - last > self.ping_interval:
                    last = time.monotonic()
                    try:
                        chan.send(m.make(m.PING))  # keeps the appliance's idle timer from firing
                    except (ConnectionClosed, ProtocolError):
                        pass
                continue
            if msg.rid is not None:
                self.replies.sent_on(msg.rid, chan)
            try:
                chan.send(msg)
                self.sent += 1
                last = time.monotonic()
                self.outbox.done()
            except (ConnectionClosed, wire.PeerTimeout) as e:
                if msg.rid is not None:  # the caller hears of it now rather than at its timeout
                    self.replies.fail(chan, str(e))
                    self.outbox.done()
                else:
                    self.outbox.put_back(msg)  # resent on the next connection
            except Exception as e:  # noqa: BLE001 - a message that cannot be encoded
                log.error("dropped %s: cannot be sent: %s", msg.type, e)
                if msg.rid is not None:
                    self.replies.abort(msg.rid, f"cannot be sent: {e}")
                self.outbox.done()

    def _wait_channel(self) -> Channel | None:
        while not self._stop.is_set():
            chan = self._chan
            if chan is not None and not chan.closed:
                return chan
            self._connected.wait(POLL)
        return None
