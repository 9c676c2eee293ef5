"""Mutual TLS contexts for the control plane: both ends present a certificate signed by one CA.

TLS keeps weights, gradients and proofs off the wire in clear and refuses a peer without a
CA-signed certificate before any application frame; the HMAC handshake still runs inside it
(the shared secret and the certificate are two separate proofs)."""

from __future__ import annotations

import ssl


class TlsConfigError(ValueError):
    """A certificate, key or CA file that cannot be used; the message names it."""


def _load(ctx: ssl.SSLContext, cert: str, key: str, ca: str) -> ssl.SSLContext:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    for what, path in (("tls_cert", cert), ("tls_key", key), ("tls_ca", ca)):
        try:
            open(path, "rb").close()
        except OSError as e:
            raise TlsConfigError(f"{what}: {e.strerror}: {path}") from None
    try:
        ctx.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as e:
        raise TlsConfigError(f"tls_cert/tls_key: {cert}, {key}: {e}") from None
    try:
        ctx.load_verify_locations(cafile=ca)
    except (ssl.SSLError, OSError) as e:
        raise TlsConfigError(f"tls_ca: {ca}: {e}") from None
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def server_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """The appliance's side: its certificate, and trainers must present one signed by ``ca``."""
    return _load(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), cert, key, ca)


def client_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """The trainer's side: its certificate, and the appliance's must be signed by ``ca`` and name
    the address dialled (``server_hostname``)."""
    return _load(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), cert, key, ca)
