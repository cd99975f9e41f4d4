"""Where gpumigrate keeps its files, and who is acting. One environment variable per setting (README)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


def state_root() -> Path:
    """Root of per-migration directories: ``$GPUMIGRATE_HOME`` or ``./.gpumigrate``."""
    return Path(os.environ.get("GPUMIGRATE_HOME", ".gpumigrate")).resolve()


def migrations_dir() -> Path:
    return state_root() / "migrations"


def hosts_dir() -> Path:
    """Where local hosts keep their work directories and pid files."""
    return state_root() / "hosts"


def user_config_dir() -> Path:
    """The user's own gpumigrate configuration (the audit key): ``$XDG_CONFIG_HOME/gpumigrate``."""
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "gpumigrate"


def user_state_dir() -> Path:
    """The user's own gpumigrate state outside any state root (audit anchors): ``$XDG_STATE_HOME/gpumigrate``."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "gpumigrate"


def operator() -> str:
    """Who says they started an action: ``$GPUMIGRATE_OPERATOR``, else ``$USER``. A claim, not a proof."""
    return os.environ.get("GPUMIGRATE_OPERATOR") or os.environ.get("USER") or f"uid:{os.getuid()}"


# ----------------------------------------------------------------------------- identity
@dataclass(frozen=True)
class Identity:
    """Who this process acts as. ``auth`` names what proved it: ``aws-sts``, ``gcp``, ``prefect``, or
    ``none`` when nothing did (then ``name`` is the operator's claim, :func:`operator`)."""

    name: str
    auth: str = "none"

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "auth": self.auth}


IdentityResolver = Callable[[], Identity | None]
_identity_lock = threading.Lock()
_resolver: IdentityResolver | None = None
_resolved: Identity | None = None
_asked = False


def set_identity_resolver(resolver: IdentityResolver | None) -> None:
    """The hook the application layer (CLI, flows) sets: a function returning the authenticated identity
    (``gpumigrate.infra.identity.resolve_identity``) or None, called once, when the first record is
    written. Core never imports a cloud SDK itself."""
    global _resolver, _resolved, _asked
    with _identity_lock:
        _resolver, _resolved, _asked = resolver, None, False


def set_identity(identity: Identity | None) -> None:
    """Use ``identity`` for this process's records (a flow that resolved it already); None forgets it."""
    global _resolved, _asked
    with _identity_lock:
        _resolved, _asked = identity, identity is not None


def identity() -> Identity:
    """The authenticated identity where the resolver found one, else the operator's claim (``auth: none``)."""
    global _resolved, _asked
    with _identity_lock:
        if not _asked and _resolver is not None:
            _asked = True
            try:
                _resolved = _resolver()
            except Exception:  # an identity service that fails leaves the claim, marked unauthenticated
                logging.getLogger("gpumigrate").warning("identity lookup failed; recording $USER", exc_info=True)
                _resolved = None
        return _resolved or Identity(operator(), "none")
