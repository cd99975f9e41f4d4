"""Who may steer the front door: private sockets for Envoy's admin and the xDS stream, a node token per Envoy,
files only their owner reads. The threat model is ``traffic/README.md`` ("Who can reach what").

* **Sockets.** Envoy's admin interface and the control plane's xDS server listen on Unix domain sockets
  (mode 0600) in a directory of their own (mode 0700, owned by this user, never a link): other users of
  the host cannot connect to them, and nothing of either listens on TCP. Socket paths are short (the
  kernel's limit is 107 bytes), so they live under ``$XDG_RUNTIME_DIR/gpumigrate`` or
  ``/tmp/gpumigrate-<uid>``, in a directory named by a digest of what they serve.
* **Node tokens.** The control plane keeps a key in its state directory (``xds.key``, 0600). The token of
  Envoy node N is HMAC-SHA256(key, N); Envoy's bootstrap sends it as gRPC metadata on its ADS stream
  (``x-gpumigrate-node-token``), and the control plane serves a stream only once the node id of its
  first request matches the token. The stream keeps that node id for its life: its status is written
  under it, whatever later requests claim. A stream without the token, or with another node's, is
  refused (UNAUTHENTICATED) before it sees any resource.
* **Files.** Everything the door writes (desired state, lease, status, ``frontdoor.json``, Envoy's
  bootstrap, which holds the node token, and the logs) is mode 0600 in 0700 directories.

Why a token beside the socket's permissions: the socket keeps out other users; the token binds a node id to
the stream that proved it, so a process that can connect (the same user, or a control plane listening on
TCP for ``traffic serve --port``) cannot speak for an Envoy it is not.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
import tempfile
from pathlib import Path

from gpumigrate.errors import TrafficError

PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700
TOKEN_HEADER = "x-gpumigrate-node-token"
XDS_KEY = "xds.key"
SOCKET_PATH_MAX = 107
_DOMAIN = b"gpumigrate-xds-node-v1\n"


def private_dir(path: Path) -> Path:
    """``path`` as a directory only its owner (this user) can enter: created 0700, or tightened to 0700. A link,
    or a directory another user owns, is refused (it could be swapped under us)."""
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise TrafficError(f"{path} must be a directory of this user's (uid {os.getuid()}), not a link or another's")
    if stat.S_IMODE(info.st_mode) != PRIVATE_DIR:
        os.chmod(path, PRIVATE_DIR)
    return path


def _runtime_base() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "gpumigrate"
    return Path(tempfile.gettempdir()) / f"gpumigrate-{os.getuid()}"


def socket_dir(for_path: Path, name: str) -> Path:
    """The private directory of the sockets that serve ``for_path`` (a state or work directory) as ``name``."""
    digest = hashlib.blake2b(f"{for_path.resolve()}\n{name}".encode(), digest_size=8).hexdigest()
    base = private_dir(_runtime_base())
    return private_dir(base / digest)


def socket_path(for_path: Path, name: str, filename: str) -> Path:
    path = socket_dir(for_path, name) / filename
    if len(str(path)) > SOCKET_PATH_MAX:
        raise TrafficError(
            f"the socket path {path} is longer than {SOCKET_PATH_MAX} bytes: set XDG_RUNTIME_DIR shorter"
        )
    return path


def admin_socket(workdir: Path, node_id: str) -> Path:
    """Where Envoy node ``node_id`` (working in ``workdir``) serves its admin interface."""
    return socket_path(workdir, f"envoy-admin\n{node_id}", "admin.sock")


def xds_socket(state_dir: Path) -> Path:
    """Where the control plane of ``state_dir`` serves xDS."""
    return socket_path(state_dir, "xds", "xds.sock")


def remove_socket(path: Path) -> None:
    """A socket and its private directory, once nothing serves there."""
    with contextlib.suppress(OSError):
        path.unlink()
    with contextlib.suppress(OSError):
        path.parent.rmdir()


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file readable by its owner only, replacing ``path`` atomically."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, PRIVATE_FILE)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def open_private_log(path: Path) -> int:
    """A log file for a child process, appended to, readable by its owner only (an older one is tightened)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, PRIVATE_FILE)
    os.fchmod(fd, PRIVATE_FILE)
    return fd


def _xds_key(state_dir: Path) -> bytes:
    """The control plane's token key, created (0600) on first use; a key readable by others is refused."""
    path = state_dir / XDS_KEY
    if not path.exists():
        private_dir(state_dir)
        tmp = path.with_name(f".{XDS_KEY}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        write_private(tmp, (secrets.token_hex(32) + "\n").encode())
        try:
            os.link(tmp, path)  # whole or not at all, and never over a key another process made first
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode) or stat.S_IMODE(info.st_mode) & 0o077:
        raise TrafficError(f"the xDS key {path} must be a file readable by its owner only (chmod 600)")
    try:
        return bytes.fromhex(path.read_text().strip())
    except ValueError:
        raise TrafficError(
            f"the xDS key {path} is not hex: remove it (a new one is made) and restart the door"
        ) from None


def node_token(state_dir: Path, node_id: str) -> str:
    """The token Envoy node ``node_id`` presents to the control plane of ``state_dir``."""
    return hmac.new(_xds_key(state_dir), _DOMAIN + node_id.encode(), hashlib.sha256).hexdigest()


def node_proven(state_dir: Path, node_id: str, token: str | None) -> bool:
    """Whether ``token`` proves ``node_id`` to the control plane of ``state_dir``."""
    return bool(node_id) and isinstance(token, str) and hmac.compare_digest(node_token(state_dir, node_id), token)
