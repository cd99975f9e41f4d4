"""Manifests (FORMAT.md, Manifest): canonical JSON, HMAC-SHA256 signature, checks in a fixed order."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

import blake3

from gpumigrate.errors import EXIT_INVALID, IntegrityError, InvalidInputError
from gpumigrate.transfer.chunkobj import Sealer
from gpumigrate.transfer.keys import WrongKeyError

FORMAT_NAME = "gpumigrate-image"
FORMAT_VERSION = 1
# Development only: read images written without a key (signature "alg": "none"). Anyone who can
# write a store can forge such an image, so readers refuse them unless this is set to 1.
ALLOW_UNSIGNED_ENV = "GPUMIGRATE_ALLOW_UNSIGNED_IMAGES"


class UnsignedImageError(IntegrityError):
    """An unsigned image met a reader that may not accept one: refused before anything is read (exit 2)."""

    exit_code = EXIT_INVALID


def unsigned_allowed() -> bool:
    return os.environ.get(ALLOW_UNSIGNED_ENV) == "1"


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def seal_manifest(body: dict[str, Any], sealer: Sealer) -> tuple[str, bytes]:
    """Sign ``body`` and serialise; returns (image id, bytes)."""
    if sealer.hmac_key is not None:
        signature = {
            "alg": "hmac-sha256",
            "value": hmac.new(sealer.hmac_key, canonical(body), hashlib.sha256).hexdigest(),
        }
    else:
        signature = {"alg": "none", "value": ""}
    data = canonical({"format": FORMAT_NAME, "version": FORMAT_VERSION, "body": body, "signature": signature})
    return blake3.blake3(data).hexdigest(), data


def open_manifest(data: bytes, image_id: str, sealer: Sealer) -> dict[str, Any]:
    """Check id, format, key and signature (in that order); return the body."""
    digest = blake3.blake3(data).hexdigest()
    if digest != image_id:
        raise IntegrityError(f"manifest of image {image_id[:16]} was altered in storage (its BLAKE3 is {digest[:16]})")
    try:
        doc = json.loads(data)
        fmt, version, body, sig = doc["format"], doc["version"], doc["body"], doc["signature"]
    except (ValueError, KeyError, TypeError):
        raise IntegrityError(f"image {image_id[:16]}: manifest is not a gpumigrate manifest") from None
    if fmt != FORMAT_NAME:
        raise IntegrityError(f"image {image_id[:16]}: format {fmt!r} is not {FORMAT_NAME!r}")
    if version != FORMAT_VERSION:
        raise IntegrityError(
            f"image {image_id[:16]}: format version {version} is not supported (this reader: {FORMAT_VERSION})"
        )
    alg = sig.get("alg")
    if sealer.hmac_key is None:
        if alg != "none" or body.get("encryption") != "none":
            raise InvalidInputError(
                f"image {image_id[:16]} is encrypted and signed: give its key (--key-env or --key-file)"
            )
        if not unsigned_allowed():
            raise UnsignedImageError(
                f"image {image_id[:16]} is unsigned (alg none): anyone who can write its store could have "
                f"made it, so it is refused",
                hint=f"write images with a key; for development only, {ALLOW_UNSIGNED_ENV}=1 reads unsigned ones",
            )
        return body
    if alg != "hmac-sha256":
        raise IntegrityError(f"image {image_id[:16]} is not signed (alg {alg!r}) but a key was given: refusing it")
    if body.get("key_id") != sealer.key_id:
        raise WrongKeyError(
            f"wrong key for image {image_id[:16]}: it was written with key id {body.get('key_id')}, "
            f"the key given has id {sealer.key_id}"
        )
    expected = hmac.new(sealer.hmac_key, canonical(body), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, str(sig.get("value", ""))):
        raise IntegrityError(f"image {image_id[:16]}: manifest signature is invalid (forged or edited manifest)")
    return body
