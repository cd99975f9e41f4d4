"""The manifest's fast canonical form (orjson where it writes json's bytes) against json's, byte for byte."""

from __future__ import annotations

import enum
import json
import math
import sys
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpumigrate.transfer.format.chunkobj import Sealer
from gpumigrate.transfer.format.manifest import _BODY_AT, _rest, canonical, canonical_fast, open_manifest, seal_manifest


def _same(obj: Any) -> None:
    """canonical_fast gives canonical's bytes, or fails as canonical fails."""
    try:
        want: bytes | type[BaseException] = canonical(obj)
    except Exception as exc:  # noqa: BLE001 - the failure itself is what is compared
        want = type(exc)
    try:
        got: bytes | type[BaseException] = canonical_fast(obj)
    except Exception as exc:  # noqa: BLE001
        got = type(exc)
    assert got == want


def test_every_code_point_is_written_alike() -> None:
    chars = [chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c <= 0xDFFF]
    assert canonical_fast(chars) == canonical(chars)
    # as keys too: the sort order is the code points' order in both
    keyed = {c: i for i, c in enumerate(chars[::7])}
    assert canonical_fast(keyed) == canonical(keyed)


def test_a_lone_surrogate_fails_as_before() -> None:
    with pytest.raises(UnicodeEncodeError):
        canonical_fast({"name": "\ud800"})


class Colour(enum.Enum):
    RED = 1


class Level(enum.IntEnum):
    HIGH = 3


class Named(enum.StrEnum):
    BLUE = "blue"


class Version(str):
    """As torch.__version__ (a str subclass): its text is what both write, whatever its str() says."""

    def __str__(self) -> str:
        return "not this"


@dataclass
class Point:
    x: int


@pytest.mark.parametrize(
    "value",
    [
        1e-05,  # orjson writes 0.00001
        [1.0, 0.1, 1e16, 1e22, 5e-324, -0.0],
        {"nan": math.nan, "inf": math.inf},
        2**64,  # past orjson's range
        -(2**63) - 1,
        [2**63, 2**64 - 1, -(2**63)],
        {"e": Level.HIGH},  # an int subclass: json writes its int
        {"s": Version("2.13.0+cpu\u2028\n")},
        {"n": Named.BLUE},
        {Version("key"): 1},
        {1: "int key"},  # json writes it as "1"
        {"c": Colour.RED},  # json refuses, orjson would take them
        {"p": Point(1)},
        {"t": (1, "a", None, True)},
        {"b": b"bytes"},
    ],
)
def test_values_orjson_writes_otherwise_go_through_json(value: Any) -> None:
    _same(value)
    _same({"metadata": {"x": [value]}, "regions": [{"name": "a", "chunks": ["0" * 64]}]})


def test_deep_and_circular_documents_fail_or_pass_as_before() -> None:
    deep: Any = "leaf"
    for _ in range(300):
        deep = [deep]
    _same(deep)
    loop: list[Any] = []
    loop.append(loop)
    _same({"a": loop})
    cycle: dict[str, Any] = {"f": 0.5}
    cycle["self"] = cycle
    _same({"metadata": {"m": cycle}})


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(),
)
_docs = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.tuples(inner, inner),
        st.dictionaries(st.text(), inner, max_size=6),
    ),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_docs)
def test_any_json_document_is_written_alike(doc: Any) -> None:
    _same(doc)


def _body(key_id: str | None, regions: int = 40, chunks: int = 3) -> dict[str, Any]:
    ids = [f"{k:064x}" for k in range(regions * chunks)]
    return {
        "created": "2026-11-24T13:00:00Z",
        "source": "agent",
        "parent": None,
        "chunk_size": 1 << 20,
        "encryption": "aes-256-gcm",
        "key_id": key_id,
        "regions": [
            {
                "name": f"model/layers.{r}.wéight",
                "kind": "tensor",
                "nbytes": (chunks << 20) - 7,
                "dtype": "bfloat16",
                "shape": [chunks, (1 << 19) - 3],
                "device": "cuda:0",
                "chunks": ids[r * chunks : (r + 1) * chunks],
                "sizes": None,
            }
            for r in range(regions)
        ],
        "objects": {cid: [1000 + k, 3, None] for k, cid in enumerate(ids)},
        "metadata": {"snapshot": {"format": 1, "round": 2, "final": True, "items": {"opt": {"lr": 1e-05}}}},
    }


@pytest.mark.parametrize("key", [b"k" * 32, None])
def test_sealed_manifest_is_the_canonical_document_as_before(key: bytes | None) -> None:
    sealer = Sealer(key)
    for body in (_body(sealer.key_id), {**_body(sealer.key_id), "metadata": {"plain": [1, "two", None]}}):
        image_id, data = seal_manifest(body, sealer)
        _, signature_doc = data.split(b',"signature":', 1)
        signature = json.loads(signature_doc.split(b',"version":', 1)[0])
        assert data == _BODY_AT + canonical(body) + _rest("gpumigrate-image", signature, 1)
        assert data == canonical(json.loads(data))
        if key is not None:
            assert open_manifest(data, image_id, sealer) == json.loads(canonical(body))


def test_a_writers_body_takes_the_fast_path_and_floats_do_not() -> None:
    from gpumigrate.transfer.format.manifest import _plain

    assert _plain({**_body("k"), "metadata": {"snapshot": {"round": 2, "final": True, "chunks": {"a": ["0" * 64]}}}})
    assert not _plain(_body("k"))  # its metadata holds a float
    assert not _plain([[[{"x": [1, {"y": 0.5}]}]]])
    assert not _plain({1: "a"})
    assert _plain({"torch": Version("2.13.0")}) and not _plain({"n": Named.BLUE})


# ------------------------------------------------------------------ reading: orjson's parse only where it is json's


def _strict(a: Any, b: Any) -> bool:
    """Equal values of equal types all the way down (1 == 1.0 == True in Python; here they differ), NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_strict(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_strict(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    return bool(a == b)


def _parses_as_json(data: bytes) -> None:
    """_parse gives json.loads's document, or fails as json.loads fails."""
    from gpumigrate.transfer.format.manifest import _parse

    try:
        want: Any = json.loads(data)
    except ValueError:
        with pytest.raises(ValueError):
            _parse(data)
        return
    assert _strict(_parse(data), want)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_docs)
def test_any_json_document_is_read_as_json_reads_it(doc: Any) -> None:
    for write in (canonical, lambda d: json.dumps(d, indent=1).encode(), lambda d: json.dumps(d).encode()):
        try:
            data = write(doc)
        except (ValueError, UnicodeEncodeError):
            continue
        _parses_as_json(data)
        _parses_as_json(_BODY_AT + data + _rest("gpumigrate-image", {"alg": "none"}, 1))


@pytest.mark.parametrize(
    "data",
    [
        b'{"a":18446744073709551616}',  # past 64 bits: orjson reads a float, json an int
        b'{"a":[1,-9223372036854775809]}',
        b'{"a":{"b":{"c":{"d":{"e":100000000000000000000000000000}}}},"z":1}',
        b'{"body":{"metadata":{"snapshot":{"items":{"lr":1e-08,"n":123456789012345678901234567890}}},"x":[1]}}',
        b'{"a":1,"a":2}',  # a repeated key
        b'{"a":{"b":1},"a":{"b":1}}',
        b'{"a":{"b":1,"b":2},"c":3}',
        b'{"b":1,"a":2}',  # not sorted
        b'{"a":NaN,"b":Infinity,"c":1e400}',
        b'{"a":"\\ud800"}',  # a lone surrogate
        b'\xef\xbb\xbf{"a":1}',  # a BOM
        b'{"a":-0,"b":-0.0,"c":1.0,"d":1E2,"e":"\\u00e9\\/"}',
        b'{"a":1}{"b":2}',  # trailing data: both refuse
        b'{"a":1,"b":}',
        b'{"a": 1 , "b" : [ 2 ] }',
        b"[]",
        b"{}",
        b"7",
    ],
)
def test_documents_orjson_reads_otherwise_are_read_by_json(data: bytes) -> None:
    _parses_as_json(data)


def test_a_training_manifest_reads_as_before_with_its_floats() -> None:
    sealer = Sealer(b"k" * 32)
    body = _body(sealer.key_id)
    body["metadata"]["snapshot"]["items"]["opt"] = {"lr": 1e-05, "eps": 1e-08, "betas": [0.9, 0.999], "big": 2**80}
    image_id, data = seal_manifest(body, sealer)
    assert _strict(open_manifest(data, image_id, sealer), json.loads(data)["body"])
