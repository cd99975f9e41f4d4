"""Each agent's own identity and key, derived from the deployment's control key (spec: ``gpumigrate/CONTROL.md``).

An agent (the snapshot agent inside a workload) is named by an **id** and, for the life of its process, an
**epoch** (fresh random digits at each start). Its **agent key** is derived from the deployment's control key
and its id, one step per ``/``-separated part of the id (so the agent ``job/r1`` of rank 1 derives from
``job``'s key: the ranks of one workload share a trust domain, two workloads do not). The orchestrator holds
the control key and derives any agent's key; an agent needs only its own. A request to an agent names its
``id#epoch`` (``control.sign_request(audience=...)``) and is signed with its agent key, so a request
captured on its way to one agent is void at every other, and at the same agent after a restart.

An agent started by the orchestrator (a target) is given its agent key only, in an **agent key file**
(``GPUMIGRATE_AGENT_KEY_FILE``, one line ``gpumigrate-agent-key/1 ID HEX``, mode 0600): it cannot sign as
the source, nor answer as it. A source started by a user holds whatever key the user gave it: the
deployment's (the default: ``control.key`` under the state root), or an agent key file of its own.

The **lend key** lets a target ask its source for one thing only, ``lend`` (a fill from the source's
memory): derived from the source's agent key and epoch, sealed by the orchestrator to the target's agent
key (AES-256-GCM, from ``cryptography``) inside the ``restore`` request that asks for the fill.

Why derivations with HMAC-SHA256 rather than a key-exchange protocol: every party already shares a secret
with the orchestrator; a derivation adds no message, no state and no dependency, and one HMAC is the
whole cost of a new agent.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gpumigrate import control
from gpumigrate.errors import InvalidInputError

TARGET_PREFIX = "gm-target-"  # the ids the orchestrator gives the targets it starts: never a source's
AGENT_ID_ENV = "GPUMIGRATE_AGENT_ID"  # the id an agent takes (the orchestrator sets it for a target)
AGENT_KEY_FILE_ENV = "GPUMIGRATE_AGENT_KEY_FILE"  # an agent key file: this agent's id and key, nothing more
KEY_FILE_MAGIC = "gpumigrate-agent-key/1"
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
ID_RE = re.compile(rf"^{_PART}(/{_PART}){{0,3}}$")
_DERIVE = b"gpumigrate-derive-v1\n"


def derive(key: bytes, label: str) -> bytes:
    """A key for ``label`` from ``key`` (HMAC-SHA256): knowing it reveals nothing of ``key`` or its other labels."""
    return hmac.new(key, _DERIVE + label.encode(), hashlib.sha256).digest()


def check_id(agent_id: str, where: str = "the agent id") -> str:
    if not isinstance(agent_id, str) or not ID_RE.match(agent_id):
        raise InvalidInputError(
            f"{where} {str(agent_id)[:80]!r} is not an agent id: 1 to 4 parts joined by '/', each a letter or digit "
            "then up to 63 letters, digits, '.', '_' or '-'"
        )
    return agent_id


def agent_key(root: bytes, agent_id: str) -> bytes:
    """The agent key of ``agent_id``, from the deployment's control key ``root``."""
    key = root
    for part in check_id(agent_id).split("/"):
        key = derive(key, "agent\n" + part)
    return key


def lend_key(key: bytes, epoch: str) -> bytes:
    """The key a target uses to ask the source (agent key ``key``, this ``epoch``) to ``lend``, and nothing else."""
    return derive(key, "lend\n" + epoch)


def grant_label(source: str, target: str) -> str:
    """What a sealed lend key is bound to: the source's ``id#epoch`` and the target agent it was sealed to."""
    return f"lend-grant\n{source}\n{target}"


def seal(key: bytes, label: str, secret: bytes) -> str:
    """``secret`` sealed to the holder of agent key ``key`` (AES-256-GCM, ``label`` authenticated with it): hex."""
    nonce = secrets.token_bytes(12)
    return (nonce + AESGCM(derive(key, "seal")).encrypt(nonce, secret, label.encode())).hex()


def unseal(key: bytes, label: str, sealed: object) -> bytes:
    """The secret :func:`seal` sealed to ``key`` under ``label``; InvalidInputError when it was not."""
    try:
        raw = bytes.fromhex(sealed) if isinstance(sealed, str) and len(sealed) <= 512 else b""
        return AESGCM(derive(key, "seal")).decrypt(raw[:12], raw[12:], label.encode()) if len(raw) > 28 else b""
    except (ValueError, InvalidTag):
        return b""


@dataclass(frozen=True)
class AgentIdentity:
    """Who an agent is (``agent``, ``epoch``) and its own key. ``audience`` is what a request to it names."""

    agent: str
    key: bytes = field(repr=False)
    epoch: str = field(default_factory=lambda: secrets.token_hex(8))

    @property
    def audience(self) -> str:
        return f"{self.agent}#{self.epoch}"

    @property
    def key_id(self) -> str:
        return control.key_id(self.key)

    def rank(self, rank: int) -> AgentIdentity:
        """Rank ``rank``'s identity within this workload (``ID/rRANK``): its key derives from this one."""
        agent = f"{self.agent}/r{rank}"
        return AgentIdentity(agent, derive(self.key, "agent\n" + f"r{rank}"))

    def lend_key(self) -> bytes:
        return lend_key(self.key, self.epoch)


def _random_id() -> str:
    return "agent-" + secrets.token_hex(6)


def identity_from_root(root: bytes, agent_id: str | None = None) -> AgentIdentity:
    """An agent's identity from the deployment's control key: ``agent_id``, else ``$GPUMIGRATE_AGENT_ID``, else a
    fresh random id."""
    chosen = agent_id or os.environ.get(AGENT_ID_ENV) or _random_id()
    return AgentIdentity(
        check_id(chosen, f"${AGENT_ID_ENV}" if not agent_id else "the agent id"), agent_key(root, chosen)
    )


def load_identity(*, create: bool = False) -> AgentIdentity:
    """This process's agent identity: the agent key file (``$GPUMIGRATE_AGENT_KEY_FILE``) when one is given,
    else derived from the deployment's control key (``control.load_key(None, create=create)``)."""
    path = os.environ.get(AGENT_KEY_FILE_ENV)
    if path:
        agent, key = read_agent_key_file(Path(path))
        named = os.environ.get(AGENT_ID_ENV)
        if named and named != agent:
            raise InvalidInputError(
                f"${AGENT_ID_ENV} is {named!r} but the agent key file {path} is agent {agent!r}: unset one of them"
            )
        return AgentIdentity(agent, key)
    return identity_from_root(control.load_key(None, create=create))


def read_agent_key_file(path: Path) -> tuple[str, bytes]:
    """(agent id, agent key) from an agent key file; a file readable by others is refused."""
    try:
        text = path.read_text()
        mode = path.stat().st_mode & 0o077
    except OSError as exc:
        raise InvalidInputError(f"cannot read the agent key file {path}: {exc.strerror}") from None
    if mode:
        raise InvalidInputError(f"the agent key file {path} is readable by others (mode {oct(mode)}): chmod 600 it")
    parts = text.split()
    if len(parts) != 3 or parts[0] != KEY_FILE_MAGIC:
        raise InvalidInputError(f"{path} is not an agent key file: one line '{KEY_FILE_MAGIC} ID HEX' is expected")
    try:
        key = bytes.fromhex(parts[2])
    except ValueError:
        key = b""
    if len(key) != 32:
        raise InvalidInputError(f"the agent key in {path} is not 64 hex digits")
    return check_id(parts[1], f"the agent id in {path}"), key


def write_agent_key_file(path: Path, root: bytes, agent_id: str) -> Path:
    """Write ``agent_id``'s agent key file (0600, created afresh: an older one is replaced atomically)."""
    line = f"{KEY_FILE_MAGIC} {check_id(agent_id)} {agent_key(root, agent_id).hex()}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def target_agent_id(migration_id: str) -> str:
    """The id of the target agent the orchestrator starts for a migration (the same on a resume)."""
    return TARGET_PREFIX + hashlib.blake2b(migration_id.encode(), digest_size=6, person=b"gm-target").hexdigest()


def check_pinned(claimed: object, expect: str | None, *, source: bool = False) -> str:
    """The id an agent's hello gave, if the caller accepts it: a valid id, and ``expect`` itself or one of its
    ranks (``expect/...``) when the caller pinned one; with ``source``, never a target's id (a target cannot
    answer for its source). Raises AuthError otherwise."""
    if not isinstance(claimed, str) or not ID_RE.match(claimed):
        raise control.AuthError(f"the agent's hello gives no valid id ({str(claimed)[:80]!r})")
    if expect is not None and claimed != expect and not claimed.startswith(expect + "/"):
        raise control.AuthError(f"the agent there is {claimed!r}, not {expect!r} (the agent this migration knows)")
    if source and claimed.startswith(TARGET_PREFIX):
        raise control.AuthError(f"the agent there is {claimed!r}, a migration's target: it cannot answer as a source")
    return claimed
