"""Direct I/O for the file store's objects: written from, and read into, the caller's memory by the disk's DMA.

A buffered ``write`` copies an object into the page cache, from where the kernel writes it back later; a buffered
``read`` copies it out again. For a capture's and a restore's tens of gigabytes that is a second pass over memory
per byte, dirty-page throttling on the writers, and a page cache full of bytes nobody reads twice. With
``O_DIRECT`` the disk moves the bytes straight between the device and the caller's buffer (a capture's page-locked
slot, ``direct.py``: the sealed object already lies there, page-aligned), at the disk's own rate.

Direct I/O needs the memory address, the file offset and the length aligned to the device's logical block size;
:data:`ALIGN` (4096) is a multiple of every block size in use. So an object is written in two parts: its aligned
body with ``O_DIRECT`` (set on the open descriptor with ``fcntl``), then the tail of less than one block through
the page cache (the next ``fdatasync`` writes it back with the file's size). A read asks for a whole number of
blocks and gets the object's bytes up to its end. Whatever does not qualify, an unaligned buffer, a small object,
goes the buffered way, as does everything on a filesystem that refuses ``O_DIRECT`` (tmpfs, some overlays; the
first refusal turns it off for the store, :class:`DirectIO`). Durability is the store's, as before: direct I/O
only skips the page cache, it does not flush the disk's own cache, so the ``fdatasync`` before a chunk's name
appears stays (file.py says what is synced when).
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading

ALIGN = 4096
MIN_DIRECT = 1 << 20  # smaller objects (manifests, the store marker, tiny chunks) are not worth two system calls
_REFUSALS = (errno.EINVAL, errno.EOPNOTSUPP, errno.EFAULT, errno.ENOTSUP)


def address_of(view: memoryview) -> int:
    """Where ``view``'s first byte lies in memory."""
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def _set_direct(fd: int, on: bool) -> None:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)


class DirectIO:
    """Direct I/O for one store: on unless turned off (``enabled=False``: memory filesystems, or
    ``GPUMIGRATE_FILE_DIRECT_IO=0``), and off for good once the filesystem refuses it.

    ``bytes_direct`` and ``bytes_buffered`` count what went each way (benchmarks read them)."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled and os.environ.get("GPUMIGRATE_FILE_DIRECT_IO", "1") != "0"
        self.bytes_direct = 0
        self.bytes_buffered = 0
        self._lock = threading.Lock()

    def _qualifies(self, view: memoryview) -> bool:
        return self.enabled and len(view) >= MIN_DIRECT and address_of(view) % ALIGN == 0

    def _refused(self, exc: OSError) -> bool:
        """Whether ``exc`` says this filesystem (or this memory) takes no direct I/O: then it is off for good."""
        if exc.errno in _REFUSALS:
            self.enabled = False
            return True
        return False

    def _count(self, direct: int, buffered: int) -> None:
        with self._lock:
            self.bytes_direct += direct
            self.bytes_buffered += buffered

    def write(self, fd: int, data: bytes | bytearray | memoryview) -> None:
        """All of ``data`` to ``fd`` (a fresh file, at offset 0): the aligned body directly where it qualifies."""
        view = memoryview(data).cast("B")
        direct = 0
        body = len(view) - len(view) % ALIGN
        if self._qualifies(view):
            try:
                _set_direct(fd, True)
                try:
                    while direct < body:
                        wrote = os.write(fd, view[direct:body])
                        direct += wrote
                        if wrote % ALIGN:  # a short write off a block boundary: the rest goes buffered
                            break
                finally:
                    _set_direct(fd, False)
            except OSError as exc:
                if direct or not self._refused(exc):
                    raise
        rest = view[direct:]
        while rest:
            rest = rest[os.write(fd, rest) :]
        self._count(direct, len(view) - direct)

    def read_into(self, fd: int, out: memoryview) -> tuple[int, bool]:
        """The file's bytes from offset 0 into ``out``: (bytes read, whether the file holds more than ``out``)."""
        got = direct = 0
        if self._qualifies(out) and len(out) % ALIGN == 0:
            try:
                _set_direct(fd, True)
                try:
                    while got < len(out):
                        n = os.preadv(fd, [out[got:]], got)
                        got += n
                        if n == 0 or got % ALIGN:  # the end of the file (a direct read stops there)
                            break
                finally:
                    _set_direct(fd, False)
                direct = got
            except OSError as exc:
                if got or not self._refused(exc):
                    raise
        if direct == 0:  # not direct: buffered from the start (a direct read stops only at the file's end)
            while got < len(out):
                n = os.preadv(fd, [out[got:]], got)
                if not n:
                    break
                got += n
        more = got == len(out) and bool(os.pread(fd, 1, got))
        self._count(direct, got - direct)
        return got, more


__all__ = ["ALIGN", "MIN_DIRECT", "DirectIO", "address_of"]
