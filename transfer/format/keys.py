"""Image keys: where they come from (env var or file), and the subkeys derived from them.

The key itself never leaves this module's callers: messages name the variable or the file, never
the value, and nothing here logs.
"""

from __future__ import annotations

import base64
import binascii
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gpumigrate.errors import EXIT_INVALID, DecryptionError, InvalidInputError

KEY_BYTES = 32
_SALT = b"gpumigrate-image-v1"


class WrongKeyError(DecryptionError):
    """The key given is not the image's key (its key id differs). Bad input, so the CLI exits 2."""

    exit_code = EXIT_INVALID


def generate_key() -> str:
    """A fresh random 32-byte key, hex encoded (what `resolve_key` reads back)."""
    return secrets.token_hex(KEY_BYTES)


def _decode(text: bytes, where: str) -> bytes:
    """Accept raw 32 bytes, 64 hex characters or base64 of 32 bytes."""
    if len(text) == KEY_BYTES:
        return text
    stripped = text.strip()
    if len(stripped) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(stripped.decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            pass
    try:
        raw = base64.b64decode(stripped, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) == KEY_BYTES:
        return raw
    raise InvalidInputError(
        f"{where} does not hold a valid image key",
        hint="expected 32 bytes as 64 hex characters, base64, or raw bytes; make one with `gpumigrate image keygen`",
    )


def resolve_key(env: str | None = None, file: str | None = None) -> bytes:
    """Read the 32-byte image key from environment variable ``env`` or file ``file`` (exactly one)."""
    if bool(env) == bool(file):
        raise InvalidInputError("give exactly one key source: an environment variable name or a key file")
    if env:
        value = os.environ.get(env)
        if not value:
            raise InvalidInputError(
                f"environment variable {env} is not set or empty", hint="it must hold the image key"
            )
        return _decode(value.encode(), f"environment variable {env}")
    path = Path(str(file))
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidInputError(f"cannot read key file {path}: {exc.strerror or exc}") from None
    return _decode(data, f"key file {path}")


@dataclass(frozen=True)
class DerivedKeys:
    """The independent subkeys of one image key (see FORMAT.md, Keys and signature)."""

    encryption: bytes
    hmac: bytes
    key_id: str


def _hkdf(key: bytes, info: bytes, length: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=_SALT, info=info).derive(key)


def derive_keys(key: bytes) -> DerivedKeys:
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
        raise InvalidInputError(f"an image key must be exactly {KEY_BYTES} bytes")
    key = bytes(key)
    return DerivedKeys(
        encryption=_hkdf(key, b"chunk-encryption"),
        hmac=_hkdf(key, b"manifest-hmac"),
        key_id=_hkdf(key, b"key-id", 8).hex(),
    )
