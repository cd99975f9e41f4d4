"""The receiver's TLS identity: a fresh self-signed certificate per start, pinned by its fingerprint.

Senders pin the certificate by the SHA-256 fingerprint the receiver publishes (``receiver.json``, the URL's
``?fingerprint=``), and HELLO binds the certificate a sender saw to the control key (``stores/wire.py``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import ssl
import tempfile


def _self_signed(host: str) -> tuple[bytes, bytes, str]:
    """A fresh ECDSA P-256 certificate: (cert PEM, key PEM, SHA-256 fingerprint of the DER cert)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"gpumigrate-receiver {host}")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=2))
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fingerprint = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()
    return cert.public_bytes(serialization.Encoding.PEM), pem_key, fingerprint


def tls_context(host: str) -> tuple[ssl.SSLContext, str]:
    """A TLS 1.3 server context with a fresh certificate for ``host``, and that certificate's fingerprint."""
    cert_pem, key_pem, fingerprint = _self_signed(host)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    with tempfile.TemporaryDirectory() as tmp:  # ssl loads certs from files only; the key never outlives this block
        cpath, kpath = os.path.join(tmp, "c.pem"), os.path.join(tmp, "k.pem")
        fd = os.open(kpath, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, key_pem)
        os.close(fd)
        with open(cpath, "wb") as fh:
            fh.write(cert_pem)
        ctx.load_cert_chain(cpath, kpath)
    return ctx, fingerprint
