"""Manifests (FORMAT.md, Manifest): canonical JSON, HMAC-SHA256 signature, checks in a fixed order."""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import math
import os
from collections.abc import Mapping
from itertools import chain
from typing import Any

import blake3
import orjson

from gpumigrate.errors import EXIT_INVALID, IntegrityError, InvalidInputError, TransferError
from gpumigrate.interfaces import RegionInfo
from gpumigrate.transfer.format.chunkobj import Sealer
from gpumigrate.transfer.format.keys import WrongKeyError

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


def canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


# orjson writes exactly ``canonical``'s bytes (sorted keys, no spaces, UTF-8, the same escapes: the tests compare
# every code point) ten times faster, for documents of str-keyed dicts, lists, tuples, str (and str subclasses
# other than enums, torch.__version__ among them), int, bool and None. Other values it writes otherwise (the float
# 1e-05 as 0.00001, NaN as null) or takes where json refuses (enums, dataclasses, UUIDs), so a document is checked
# to hold only those types (by type, a few passes over each nesting level) before orjson writes it; anything else,
# and whatever orjson refuses (ints past 64 bits, nesting past its limit), goes through json as before.
_SCALARS = frozenset({str, int, bool, type(None)})
_SEQS = frozenset({list, tuple})
_DICT = frozenset({dict})
_PLAIN = _SCALARS | _SEQS | _DICT
_STR = frozenset({str})
_SMALL = 32  # members of a dict written one by one (the objects table, a model's thousands, is checked whole)
_MAX_DEPTH = 256  # past orjson's own limit: a deeper (or circular) document goes to json, which says what is wrong


def _plain(obj: Any) -> bool:
    """Whether ``obj`` holds only the types that orjson and json write alike (see above)."""
    level = [obj]
    for _ in range(_MAX_DEPTH):
        types = set(map(type, level))
        odd = types - _PLAIN
        if odd and not all(issubclass(t, str) and not issubclass(t, enum.Enum) for t in odd):
            return False
        if types <= _SCALARS | odd:
            return True
        if types <= _SEQS:
            level = list(chain.from_iterable(level))
            continue
        rows = level if types == _DICT else [v for v in level if type(v) is dict]
        if not _STR.issuperset(map(type, chain.from_iterable(rows))):  # the keys
            return False
        inner = [] if types == _DICT else list(chain.from_iterable([v for v in level if type(v) in _SEQS]))
        inner.extend(chain.from_iterable(map(dict.values, rows)))
        level = inner
    return False


def canonical_fast(obj: object, _depth: int = 3) -> bytes:
    """``canonical(obj)``, the same bytes, written by orjson where that is safe (see above). The small dicts of the
    top ``_depth`` levels (the body, its metadata, the snapshot's) are written member by member in key order, as
    json writes them, so that a member that needs json (a training image's metadata holds the optimizer's float
    hyper-parameters) takes only itself through json, and every member is checked once."""
    if _depth and type(obj) is dict and len(obj) <= _SMALL and _STR.issuperset(map(type, obj)):
        return b"{" + b",".join(canonical(k) + b":" + canonical_fast(obj[k], _depth - 1) for k in sorted(obj)) + b"}"
    if _plain(obj):
        try:
            return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)
        except orjson.JSONEncodeError:
            pass
    return canonical(obj)


# The canonical document's keys in sorted order: "body" first, so the signed bytes of the body lie in the
# document verbatim, between _BODY_AT and the rest (_rest). Serialising a body once, not twice, and verifying
# the bytes as stored instead of a re-serialisation, saves time each way on the final round's clock.
_BODY_AT = b'{"body":'


def _rest(fmt: object, signature: object, version: object) -> bytes:
    """What follows the body in the canonical document (``canonical`` of the other three keys, in order)."""
    return (
        b',"format":'
        + canonical(fmt)
        + b',"signature":'
        + canonical(signature)
        + b',"version":'
        + canonical(version)
        + b"}"
    )


def region_entry(
    info: RegionInfo, chunks: Mapping[int, str], lengths: Mapping[int, int], chunk_size: int
) -> dict[str, Any]:
    """A region's entry in a manifest body (FORMAT.md, Manifest): its chunk ids in index order, and their sizes
    unless every chunk but the last is ``chunk_size`` long. ``chunks`` and ``lengths`` map the same indices."""
    count = len(chunks)
    # count distinct indices (none negative: the writer checks) whose largest is count - 1 are exactly 0 .. count - 1;
    # a larger one leaves some index below count missing
    if (count and max(chunks) != count - 1) or (count == 0 and info.nbytes > 0):
        missing = [i for i in range(count) if i not in chunks]
        raise TransferError(f"region {info.name!r} is missing chunks {missing[:10] or [0]}")
    if count == 1:  # most regions of a model
        ids, sizes = [chunks[0]], [lengths[0]]
    else:
        ids = list(map(chunks.__getitem__, range(count)))
        sizes = list(map(lengths.__getitem__, range(count)))
    if sum(sizes) != info.nbytes:
        raise TransferError(f"region {info.name!r}: chunks hold {sum(sizes)} bytes, the region declares {info.nbytes}")
    # Whole chunks but the last (the sum above fixes the last): one C-level count, not a call per chunk.
    fixed = count == math.ceil(info.nbytes / chunk_size) and (count < 2 or sizes[:-1].count(chunk_size) == count - 1)
    return {
        "name": info.name,
        "kind": info.kind,
        "nbytes": info.nbytes,
        "dtype": info.dtype,
        "shape": list(info.shape) if info.shape is not None else None,
        "device": info.device,
        "chunks": ids,
        "sizes": None if fixed else sizes,
    }


def seal_manifest(body: dict[str, Any], sealer: Sealer) -> tuple[str, bytes]:
    """Sign ``body`` and serialise; returns (image id, bytes): the canonical JSON of the whole document."""
    signed = canonical_fast(body)
    if sealer.hmac_key is not None:
        signature = {"alg": "hmac-sha256", "value": hmac.new(sealer.hmac_key, signed, hashlib.sha256).hexdigest()}
    else:
        signature = {"alg": "none", "value": ""}
    data = _BODY_AT + signed + _rest(FORMAT_NAME, signature, FORMAT_VERSION)
    return blake3.blake3(data).hexdigest(), data


def _signed_bytes(data: bytes, body: object, fmt: object, signature: object, version: object) -> bytes:
    """The body's bytes as the signature covers them: its slice of ``data`` when the document is laid out
    canonically (every manifest a writer makes), else its canonical re-serialisation. The slice is the
    body the parser read: a signed body is one whole JSON object, so nothing else can follow it as a key."""
    rest = _rest(fmt, signature, version)
    if data.startswith(_BODY_AT) and data.endswith(rest) and len(data) > len(_BODY_AT) + len(rest):
        return data[len(_BODY_AT) : len(data) - len(rest)]
    return canonical(body)


def _parse(data: bytes) -> Any:
    """``json.loads(data)``, the same document, parsed by orjson where that is provably the same: about twice as
    fast, on the final restore's clock.

    orjson reads some documents otherwise than json (an integer past 64 bits becomes a float) and refuses some
    that json takes (NaN, lone surrogates, a BOM). So a part of its result is kept only where orjson writes that
    part back as exactly its bytes in ``data`` (:func:`_exact`): then every number's token there is the shortest
    form of the value read, which json reads back as that very value, every string's token is the escaped form
    of the string read, and no key repeats; json's parse of those bytes is the same. Writers' manifests are
    canonical (sorted keys, no spaces), which orjson writes alike except for some floats (json writes 1e-08,
    orjson 1e-8): a training image's optimizer hyper-parameters are parsed again by json, they alone."""
    try:
        return _exact(orjson.loads(data), data, 4)
    except (ValueError, TypeError, KeyError, IndexError, RecursionError):  # orjson's or json's refusal of a part
        return json.loads(data)


def _exact(value: Any, raw: bytes, depth: int) -> Any:
    """``json.loads(raw)``, given ``value``, orjson's parse of ``raw``.

    ``value`` itself when orjson writes it as ``raw``. Else, for an object laid out canonically, its members
    are matched against ``raw`` from the front and from the back (each member's bytes beside its delimiter,
    compared where they lie: a 400 KB document is not copied); the one member left between is parsed again
    (recursively, ``depth`` levels of objects), the rest is kept. Anything else is json's parse of ``raw``; a
    ``raw`` that is not one whole JSON value raises."""
    if not depth or type(value) is not dict or not value:
        return value if orjson.dumps(value, option=orjson.OPT_SORT_KEYS) == raw else json.loads(raw)
    if raw[:1] != b"{" or raw[-1:] != b"}":
        return json.loads(raw)
    keys = sorted(value)  # the canonical order
    members = [(orjson.dumps(k) + b":", orjson.dumps(value[k], option=orjson.OPT_SORT_KEYS)) for k in keys]
    last = len(members) - 1

    def lies_at(i: int, at: int) -> bool:
        key, val = members[i]
        return raw.startswith(key, at) and raw.startswith(val, at + len(key))

    first, at = 0, 1  # raw[1:at] holds members[:first], each followed by its comma (the last by the closing brace)
    while first <= last and lies_at(first, at):
        after = at + len(members[first][0]) + len(members[first][1])
        if raw[after : after + 1] != (b"}" if first == last else b","):
            break
        first, at = first + 1, after + 1
    if first > last:
        return value if at == len(raw) else json.loads(raw)
    back, end = last, len(raw) - 1  # raw[end:-1] holds members[back + 1 :], each after its comma
    while back > first:
        start = end - len(members[back][0]) - len(members[back][1])
        if start - 1 < at or raw[start - 1 : start] != b"," or not lies_at(back, start):
            break
        back, end = back - 1, start - 1
    key = members[first][0]
    if back != first or not raw.startswith(key, at):  # more than one member differs: parse it all again
        return json.loads(raw)
    member = _exact(value[keys[first]], raw[at + len(key) : end], depth - 1)
    return value if member is value[keys[first]] else {**value, keys[first]: member}


def open_manifest(data: bytes, image_id: str, sealer: Sealer) -> dict[str, Any]:
    """Check id, format, key and signature (in that order); return the body."""
    digest = blake3.blake3(data).hexdigest()
    if digest != image_id:
        # nothing of what was read is shown (not even its digest): only that it is not the manifest the id names
        raise IntegrityError(f"manifest of image {image_id[:16]} was altered in storage (its BLAKE3 is not its id)")
    try:
        doc = _parse(data)
        fmt, version, body, sig = doc["format"], doc["version"], doc["body"], doc["signature"]
        if not isinstance(body, dict) or not isinstance(sig, dict):
            raise TypeError("a manifest's body and signature are objects")
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
    expected = hmac.new(sealer.hmac_key, _signed_bytes(data, body, fmt, sig, version), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, str(sig.get("value", ""))):
        raise IntegrityError(f"image {image_id[:16]}: manifest signature is invalid (forged or edited manifest)")
    return body
