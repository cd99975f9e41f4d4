"""Sealing and opening chunk objects (FORMAT.md, Chunk object): header, codec, AES-256-GCM, BLAKE3 check."""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gpumigrate.errors import DecryptionError, IntegrityError
from gpumigrate.transfer.buffers import POOL
from gpumigrate.transfer.format import codecs
from gpumigrate.transfer.format.keys import derive_keys

MAGIC = b"GMC1"
HEADER = struct.Struct(">4sBBHQ12s32s")
HEADER_SIZE = HEADER.size  # 60
TAG_SIZE = 16
FLAG_ENCRYPTED = 0x01
ZERO_ID = bytes(32)
ZERO_NONCE = bytes(12)
MAX_RAW_LEN = 256 << 20  # no chunk is larger; a header claiming more is damaged or hostile
# Above this size BLAKE3 may use several threads on one buffer; below, threads cost more than they save.
_MT_HASH_BYTES = 8 << 20


def chunk_id_of(data: memoryview | bytes) -> str:
    """Chunk id: BLAKE3-256 of the plaintext, hex."""
    threads = blake3.blake3.AUTO if len(data) >= _MT_HASH_BYTES else 1
    return blake3.blake3(data, max_threads=threads).hexdigest()


@dataclass(frozen=True)
class ObjectHeader:
    codec: int
    encrypted: bool
    raw_len: int
    nonce: bytes
    base: str | None


def parse_header(blob: memoryview | bytes, chunk_id: str) -> ObjectHeader:
    if len(blob) < HEADER_SIZE:
        raise IntegrityError(f"chunk {chunk_id[:16]} is truncated ({len(blob)} bytes, header needs {HEADER_SIZE})")
    magic, codec, flags, _reserved, raw_len, nonce, base = HEADER.unpack_from(blob, 0)
    if magic != MAGIC:
        raise IntegrityError(f"chunk {chunk_id[:16]} is not a gpumigrate chunk object (bad magic)")
    if raw_len > MAX_RAW_LEN:  # checked before anyone allocates a buffer of that size
        raise IntegrityError(
            f"chunk {chunk_id[:16]} claims {raw_len} bytes, more than any chunk may hold ({MAX_RAW_LEN})"
        )
    return ObjectHeader(codec, bool(flags & FLAG_ENCRYPTED), raw_len, nonce, None if base == ZERO_ID else base.hex())


def sealed_size(payload_len: int, encrypted: bool) -> int:
    """Bytes of the stored object for a payload of ``payload_len`` bytes."""
    return HEADER_SIZE + payload_len + (TAG_SIZE if encrypted else 0)


class Sealer:
    """Turns plaintext chunks into stored objects and back, with or without a key. Thread-safe."""

    def __init__(self, key: bytes | None) -> None:
        self.encrypted = key is not None
        if key is not None:
            derived = derive_keys(key)
            self._aead: AESGCM | None = AESGCM(derived.encryption)
            self.key_id: str | None = derived.key_id
            self.hmac_key: bytes | None = derived.hmac
        else:
            self._aead, self.key_id, self.hmac_key = None, None, None

    def seal(
        self,
        chunk_id: str,
        codec: int,
        raw_len: int,
        payload: memoryview | bytes,
        base: str | None = None,
        out: bytearray | memoryview | None = None,
        *,
        in_place: bool = False,
    ) -> bytearray | memoryview:
        """The stored object for one encoded chunk.

        With ``out`` (at least :func:`sealed_size` bytes, e.g. a recycled buffer) the object is
        written there and a view of it returned; otherwise into a new bytearray. Reusing buffers
        matters: a fresh multi-MiB allocation per chunk is a new mapping whose pages fault in.
        ``in_place=True`` says the payload already sits at ``out[HEADER_SIZE:]`` (the encoder wrote
        it there): it is then encrypted where it lies, with no second buffer and no copy.
        """
        size = sealed_size(len(payload), self.encrypted)
        if in_place and out is None:
            raise ValueError("seal: in_place needs the buffer that holds the payload")
        if out is None:
            out = bytearray(size)
        elif len(out) < size:
            raise ValueError(f"seal: output buffer of {len(out)} bytes is smaller than the object ({size})")
        view = memoryview(out)[:size]
        nonce = os.urandom(12) if self._aead else ZERO_NONCE
        header = HEADER.pack(
            MAGIC,
            codec,
            FLAG_ENCRYPTED if self._aead else 0,
            0,
            raw_len,
            nonce,
            bytes.fromhex(base) if base else ZERO_ID,
        )
        view[:HEADER_SIZE] = header
        if in_place:
            payload = view[HEADER_SIZE : HEADER_SIZE + len(payload)]
        if self._aead is None:
            if not in_place:
                view[HEADER_SIZE:] = payload
        else:  # AESGCM releases the GIL while it encrypts; OpenSSL's GCM runs in place when in is out
            self._aead.encrypt_into(nonce, payload, bytes.fromhex(chunk_id) + header, view[HEADER_SIZE:])
        return out if len(out) == size else view

    def open_payload(self, chunk_id: str, blob: memoryview, where: str = "") -> tuple[ObjectHeader, memoryview]:
        """Authenticate and decrypt one object where it lies; return its header and encoded payload.

        The payload is a view of ``blob`` (decrypted in place: no second buffer). Nothing is decoded
        or hashed: the caller decodes and checks BLAKE3 against ``chunk_id`` wherever the bytes land.
        """
        label = f"chunk {chunk_id[:16]}{where}"
        hdr = parse_header(blob, chunk_id)
        body = blob[HEADER_SIZE:]
        if not hdr.encrypted:
            if self._aead is not None:
                raise IntegrityError(f"{label} is not encrypted, but this image requires encryption")
            return hdr, body
        if self._aead is None:
            raise DecryptionError(f"{label} is encrypted but no key was given")
        if len(body) < TAG_SIZE:
            raise IntegrityError(f"{label} is truncated")
        payload = body[: len(body) - TAG_SIZE]
        try:  # OpenSSL's GCM runs in place when the output is the input
            self._aead.decrypt_into(hdr.nonce, body, bytes.fromhex(chunk_id) + bytes(blob[:HEADER_SIZE]), payload)
        except InvalidTag:
            raise DecryptionError(
                f"{label} failed authentication: the key is wrong, or the object was altered, truncated or swapped"
            ) from None
        return hdr, payload

    def open_into(
        self,
        chunk_id: str,
        blob: memoryview | bytes,
        out: memoryview,
        fetch_base: Callable[[str], bytes] | None = None,
        where: str = "",
    ) -> int:
        """Decrypt, decode and verify one object into ``out``; return the plaintext length.

        ``fetch_base(id)`` returns a delta base's verified plaintext. ``where`` names the chunk's
        place in the image for error messages.
        """
        blob = memoryview(blob)
        label = f"chunk {chunk_id[:16]}{where}"
        hdr = parse_header(blob, chunk_id)
        if len(out) < hdr.raw_len:
            raise IntegrityError(f"{label}: records {hdr.raw_len} bytes, more than the {len(out)} expected")
        body = blob[HEADER_SIZE:]
        scratch: bytearray | None = None  # the decrypted payload's recycled buffer
        if hdr.encrypted:
            if self._aead is None:
                raise DecryptionError(f"{label} is encrypted but no key was given")
            aad = bytes.fromhex(chunk_id) + bytes(blob[:HEADER_SIZE])
            if len(body) < TAG_SIZE:
                raise IntegrityError(f"{label} is truncated")
            try:
                if hdr.codec == codecs.NONE:
                    if len(body) - TAG_SIZE != hdr.raw_len:
                        raise IntegrityError(f"{label} is truncated or padded")
                    self._aead.decrypt_into(hdr.nonce, body, aad, out[: hdr.raw_len])
                    payload: memoryview | None = None
                else:
                    scratch = POOL.take(len(body) - TAG_SIZE)
                    payload = memoryview(scratch)[: len(body) - TAG_SIZE]
                    self._aead.decrypt_into(hdr.nonce, body, aad, payload)
            except InvalidTag:
                raise DecryptionError(
                    f"{label} failed authentication: the key is wrong, or the object was altered, truncated or swapped"
                ) from None
        elif self._aead is not None:
            raise IntegrityError(f"{label} is not encrypted, but this image requires encryption")
        else:
            payload = body
        if payload is not None:
            try:
                codecs.decode_into(hdr.codec, payload, hdr.raw_len, out)
            except IntegrityError as exc:
                raise IntegrityError(f"{label}: {exc.message}") from None
            finally:
                if scratch is not None:
                    POOL.give(scratch)  # decode_into keeps no view of the payload
        if hdr.codec & codecs.DELTA_FLAG:
            if hdr.base is None or fetch_base is None:
                raise IntegrityError(f"{label} is a delta but its base cannot be read")
            codecs.xor_into(out, hdr.raw_len, fetch_base(hdr.base))
        got = chunk_id_of(out[: hdr.raw_len])
        if got != chunk_id:
            raise IntegrityError(f"{label} does not match its id (BLAKE3 of the content is {got[:16]})")
        return hdr.raw_len
