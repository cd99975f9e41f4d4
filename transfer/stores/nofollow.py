"""Paths below a directory held open, never through a symbolic link: the file store's layout and unpack's output.

Whoever can write inside a store (or an output directory) can plant a link there: ``chunks/se -> /etc``. A path walk
from the root follows it, so every name here is resolved one component at a time from a directory file descriptor,
each opened with ``O_NOFOLLOW`` (``openat``); a link where a directory or a file belongs is refused, never followed.
``rename``, ``unlink`` and ``mkdir`` at a directory fd act on the name itself and never follow a link either.
Python's ``os`` functions take ``dir_fd`` for all of it, so no library is needed (``openat2``'s ``RESOLVE_BENEATH``
would do the walk in one call, but Python does not expose it and a directory fd held per fan-out directory already
makes each chunk one ``openat``).
"""

from __future__ import annotations

import errno
import os
import stat
import threading

from gpumigrate.errors import IntegrityError

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted where a file belongs must not hang the open; it changes nothing for a regular file.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_REFUSED = (errno.ELOOP, errno.ENOTDIR, errno.EMLINK)


class LinkRefusedError(IntegrityError):
    """A path inside a store or an output directory is a symbolic link, or not the kind of file it must be:
    refused, never followed. Whoever can write there planted it, or the directory is not what it seems."""


def kind_of(dir_fd: int, name: str) -> str:
    """What ``name`` below ``dir_fd`` is, in words (never following it)."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        return "something that changed while it was opened"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "a special file (FIFO, socket or device)"


def refused(dir_fd: int, name: str, where: str, wanted: str) -> LinkRefusedError:
    """The error for ``name`` (shown as ``where``) that is not ``wanted``; it names what it found, never its content."""
    return LinkRefusedError(
        f"{where} is {kind_of(dir_fd, name)}, not {wanted}: refusing to follow it",
        hint="a store's and an output directory's paths must be real directories and files; remove what was "
        "planted there (nothing was read or written through it)",
    )


def open_root(path: str | os.PathLike[str], *, create: bool) -> int | None:
    """A directory the caller named (its own path: links above it are the caller's), held open; None when it does
    not exist and ``create`` is False. The directory itself must not be a link."""
    if create:
        os.makedirs(path, exist_ok=True)
    try:
        return os.open(path, DIR_FLAGS)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as exc:
        if exc.errno in _REFUSED:
            raise LinkRefusedError(
                f"{os.fspath(path)} is a symbolic link or not a directory: refusing to follow it",
                hint="name the real directory",
            ) from None
        raise


def open_dir(dir_fd: int, name: str, where: str, *, create: bool, mode: int = 0o755) -> tuple[int | None, bool]:
    """``name`` below ``dir_fd`` as a directory fd, and whether this call created it; (None, False) when it does
    not exist and ``create`` is False. A link or a file there raises :class:`LinkRefusedError`."""
    created = False
    if create:
        try:
            os.mkdir(name, mode, dir_fd=dir_fd)  # never follows a link: one there is EEXIST, refused below
            created = True
        except FileExistsError:
            pass
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd), created
    except FileNotFoundError:
        return None, False
    except OSError as exc:
        if exc.errno in _REFUSED:
            raise refused(dir_fd, name, where, "a directory") from None
        raise


def open_regular(dir_fd: int, name: str, where: str) -> int | None:
    """``name`` below ``dir_fd`` opened for reading, or None when it does not exist; anything but a regular file
    (a link, a FIFO, a directory) raises :class:`LinkRefusedError`."""
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in _REFUSED or exc.errno == errno.EISDIR:
            raise refused(dir_fd, name, where, "a regular file") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise refused(dir_fd, name, where, "a regular file")
    return fd


def regular_size(dir_fd: int, name: str) -> int | None:
    """The size of the regular file ``name`` below ``dir_fd``; None when there is none (a link there counts as none)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def close_quietly(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class DirTree:
    """The directories below ``root`` (a path its caller chose), by their parts, each opened once from the one above
    it without following a link and held open; thread-safe. ``create`` makes what is missing, and ``created`` keeps
    what this tree made: the only directories its owner may chmod."""

    def __init__(self, root: str | os.PathLike[str], shown: str | None = None) -> None:
        self.root = root
        self.shown = shown or os.fspath(root)
        self.created: set[tuple[str, ...]] = set()
        self._fds: dict[tuple[str, ...], int] = {}
        self._lock = threading.Lock()

    def dir(self, parts: tuple[str, ...], *, create: bool) -> int | None:
        """The directory ``root/parts...`` as an fd (``()``: the root); None when it does not exist and ``create``
        is False; :class:`LinkRefusedError` for a link (or a file) on the way."""
        fd = self._fds.get(parts)
        if fd is not None:
            return fd
        with self._lock:
            return self._open(parts, create)

    def _open(self, parts: tuple[str, ...], create: bool) -> int | None:
        fd = self._fds.get(parts)
        if fd is not None:
            return fd
        made = False
        if not parts:
            fd = open_root(self.root, create=create)
        else:
            parent = self._open(parts[:-1], create)
            if parent is None:
                return None
            fd, made = open_dir(parent, parts[-1], f"{self.shown}/{'/'.join(parts)}", create=create)
        if fd is not None:
            self._fds[parts] = fd
            if made:
                self.created.add(parts)
        return fd

    def close(self) -> None:
        """Close every directory held (a later :meth:`dir` opens them again)."""
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        close_quietly(fds)
