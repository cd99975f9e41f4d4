"""The audit key: the HMAC key that authenticates audit records and anchored chain heads.

It is named by reference and never lives in the state directory, so that whoever can write
``$GPUMIGRATE_HOME`` (and with it the logs and ``state.json``) cannot forge or re-chain a record.
Resolution, first match wins (spec: ``gpumigrate/AUDIT.md``):

1. ``$GPUMIGRATE_AUDIT_KEY``: the key itself, hex (for a process started with it);
2. ``$GPUMIGRATE_AUDIT_KEY_FILE``: a file holding the hex key, mode 0600;
3. ``$XDG_CONFIG_HOME/gpumigrate/audit.key`` (``~/.config/gpumigrate/audit.key``), created 0600 on the
   first record written without a key.

A key file inside the state root is refused: a key kept beside the logs protects nothing.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from gpumigrate.control import _create_key_file as create_key_file
from gpumigrate.errors import InvalidInputError
from gpumigrate.settings import state_root, user_config_dir

KEY_ENV = "GPUMIGRATE_AUDIT_KEY"
KEY_FILE_ENV = "GPUMIGRATE_AUDIT_KEY_FILE"
KEY_BYTES = 32
MIN_KEY_BYTES = 16


def default_key_file() -> Path:
    return user_config_dir() / "audit.key"


def key_id(key: bytes) -> str:
    """Which key wrote a record (12 hex digits), without revealing it."""
    return hashlib.blake2b(key, digest_size=6, person=b"gm-audit-key").hexdigest()


def _outside_state_root(path: Path, what: str) -> Path:
    resolved = path.expanduser().resolve()
    root = state_root()
    if resolved == root or resolved.is_relative_to(root):
        raise InvalidInputError(
            f"the {what} {resolved} is inside the state root {root} ($GPUMIGRATE_HOME): whoever can rewrite the "
            f"logs could rewrite it too. Keep it elsewhere (the default is under {user_config_dir()})"
        )
    return resolved


def _from_hex(text: str, where: str) -> bytes:
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise InvalidInputError(f"the audit key in {where} is not hex: write {KEY_BYTES * 2} hex digits") from None
    if len(key) < MIN_KEY_BYTES:
        raise InvalidInputError(
            f"the audit key in {where} is {len(key)} bytes: at least {MIN_KEY_BYTES} are needed ({KEY_BYTES} advised)"
        )
    return key


def key_location() -> str:
    """Where the key comes from, for messages (a variable's name or a path; never the key)."""
    if os.environ.get(KEY_ENV):
        return f"${KEY_ENV}"
    return str(Path(os.environ.get(KEY_FILE_ENV) or default_key_file()).expanduser())


def load_audit_key(*, create: bool = False) -> bytes:
    """The audit key from its reference; ``create`` makes the default file when no key exists anywhere."""
    if os.environ.get(KEY_ENV):
        return _from_hex(os.environ[KEY_ENV], f"${KEY_ENV}")
    named = os.environ.get(KEY_FILE_ENV)
    path = _outside_state_root(Path(named) if named else default_key_file(), "audit key file")
    if not path.exists() and create and not named:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        create_key_file(path)  # the control key's writer: 0600, fsynced, never replaces a key made first
    try:
        text = path.read_text()
        loose = path.stat().st_mode & 0o077
    except FileNotFoundError:
        raise InvalidInputError(
            f"no audit key at {path}: the logs were keyed with another key, or it was moved; set {KEY_FILE_ENV} "
            f"to the key file (or {KEY_ENV} to its hex)"
        ) from None
    except OSError as exc:
        raise InvalidInputError(f"cannot read the audit key {path}: {exc.strerror}") from None
    if loose:
        raise InvalidInputError(f"the audit key {path} is readable by others (mode {oct(loose)}): chmod 600 it")
    return _from_hex(text, str(path))
