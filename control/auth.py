"""Mutual HMAC-SHA256 challenge-response and the per-session frame tags.

Handshake (frames 0 and 1 of each direction; only the last one is tagged):

    trainer   -> appliance  HELLO {role, nonce_t}
    appliance -> trainer    HELLO {role: "appliance", nonce_a}
    trainer   -> appliance  AUTH  {proof_t}      the appliance checks it: a wrong secret is
                                                 refused (and logged) here
    appliance -> trainer    AUTH  {proof_a}      first tagged frame; the trainer checks both

With T = the length-prefixed transcript (trainer role, nonce_t, appliance role, nonce_a):
``proof_x = HMAC(secret, "proof|" + side_x + "|" + T)`` and ``key = HMAC(secret, "session|" + T)``.
Both nonces are fresh per connection, so a proof or a frame is worthless in any other session,
and the side label stops a peer from reflecting the other side's proof back. The secret must be
high-entropy (e.g. 32 random bytes): a proof lets whoever saw it test guesses offline.

Afterwards every frame carries ``tag = HMAC(key, direction, len(header), header, len(payload),
payload)``; the header holds the frame's sequence number, which the receiver requires to be
exactly the next one, so replayed, duplicated or reordered frames are refused.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

from mirrorckpt.control import messages as m
from mirrorckpt.control.wire import TAG_LEN, AuthError, BadMac, ConnectionClosed, RawFrame, TruncatedFrame

APPLIANCE_ROLE = "appliance"
NONCE_LEN = 32
MIN_SECRET = 16
_LABEL = b"mirrorckpt-auth-v1"
_FRAME = b"mirrorckpt-frame-v1"


def normalize_secret(secret: bytes | str) -> bytes:
    s = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
    if len(s) < MIN_SECRET:
        raise ValueError(f"the control-plane secret must be at least {MIN_SECRET} bytes")
    return s


def transcript(client_role: str, client_nonce: bytes, server_role: str, server_nonce: bytes) -> bytes:
    out = [_LABEL]
    for part in (client_role.encode(), client_nonce, server_role.encode(), server_nonce):
        out.append(struct.pack(">H", len(part)) + part)
    return b"".join(out)


def proof(secret: bytes, side: str, t: bytes) -> bytes:
    return hmac.new(secret, b"proof|" + side.encode() + b"|" + t, hashlib.sha256).digest()


def session_key(secret: bytes, t: bytes) -> bytes:
    return hmac.new(secret, b"session|" + t, hashlib.sha256).digest()


class Session:
    """Tags frames we send and verifies frames we receive, with the session key."""

    def __init__(self, key: bytes, side: str):
        self.key = key
        self.send_dir = b"c2s" if side == m.CLIENT else b"s2c"
        self.recv_dir = b"s2c" if side == m.CLIENT else b"c2s"

    def _tag(self, direction: bytes, header: bytes, pieces, payload_len: int) -> bytes:
        h = hmac.new(self.key, digestmod=hashlib.sha256)
        h.update(_FRAME + direction + struct.pack(">I", len(header)) + header)
        h.update(struct.pack(">Q", payload_len))
        for p in pieces:
            h.update(p)
        return h.digest()

    def sign(self, header: bytes, pieces, payload_len: int) -> bytes:
        return self._tag(self.send_dir, header, pieces, payload_len)

    def verify(self, raw: RawFrame) -> None:
        want = self._tag(self.recv_dir, raw.header, [memoryview(raw.payload)], raw.payload.size)
        if len(raw.tag) != TAG_LEN or not hmac.compare_digest(want, raw.tag):
            raise BadMac("frame tag does not verify: tampered, or a frame of another session")


def _nonce(body: dict) -> bytes:
    return bytes.fromhex(body["nonce"])  # the schema guarantees 64 hex digits


def server_handshake(chan, secret: bytes, roles) -> str:
    """Authenticate a trainer on a fresh channel; returns its role. Raises ``ProtocolError``."""
    hello = chan.recv()
    if hello.type != m.HELLO:
        raise AuthError(f"expected HELLO before authentication, got {hello.type}")
    role = hello.body["role"]
    if role == APPLIANCE_ROLE or role not in roles:
        raise AuthError(f"role {role!r} is not accepted here")
    nonce = secrets.token_bytes(NONCE_LEN)
    t = transcript(role, _nonce(hello.body), APPLIANCE_ROLE, nonce)
    chan.send(m.make(m.HELLO, role=APPLIANCE_ROLE, nonce=nonce.hex()))
    auth = chan.recv()
    if auth.type != m.AUTH:
        raise AuthError(f"expected AUTH, got {auth.type}")
    if not hmac.compare_digest(bytes.fromhex(auth.body["proof"]), proof(secret, m.CLIENT, t)):
        raise AuthError(f"proof of {role!r} does not verify: wrong secret")
    chan.session = Session(session_key(secret, t), m.SERVER)
    chan.peer_role = role
    chan.send(m.make(m.AUTH, proof=proof(secret, m.SERVER, t).hex()))  # first tagged frame
    return role


def client_handshake(chan, secret: bytes, role: str) -> None:
    """Authenticate ourselves and the appliance on a fresh channel. Raises ``ProtocolError``."""
    nonce = secrets.token_bytes(NONCE_LEN)
    chan.send(m.make(m.HELLO, role=role, nonce=nonce.hex()))
    hello = chan.recv()
    if hello.type != m.HELLO:
        raise AuthError(f"expected the appliance's HELLO, got {hello.type}")
    if hello.body["role"] != APPLIANCE_ROLE:
        raise AuthError(f"peer claims role {hello.body['role']!r}, not {APPLIANCE_ROLE!r}")
    t = transcript(role, nonce, APPLIANCE_ROLE, _nonce(hello.body))
    chan.send(m.make(m.AUTH, proof=proof(secret, m.CLIENT, t).hex()))
    chan.session = Session(session_key(secret, t), m.CLIENT)
    try:
        auth = chan.recv()
    except (ConnectionClosed, TruncatedFrame) as e:
        raise AuthError(f"the appliance refused our proof (wrong secret or role?): {e}") from None
    except BadMac:
        raise AuthError("the appliance's first frame does not verify: wrong secret") from None
    if auth.type != m.AUTH:
        raise AuthError(f"expected the appliance's AUTH, got {auth.type}")
    if not hmac.compare_digest(bytes.fromhex(auth.body["proof"]), proof(secret, m.SERVER, t)):
        raise AuthError("the appliance's proof does not verify: wrong secret")
    chan.peer_role = APPLIANCE_ROLE
