"""A reader's regions: the RegionInfo objects shared between the readers of one process (reader.py ``_INFOS``)
describe each manifest's regions exactly as new ones would."""

from __future__ import annotations

from typing import Any

from gpumigrate.interfaces import RegionInfo
from gpumigrate.transfer.reader import StoreImageReader


def _regions(*regions: dict[str, Any]) -> list[RegionInfo]:
    """regions() of a reader over a body holding ``regions`` (only the body is read: no store, no manifest)."""
    reader = StoreImageReader.__new__(StoreImageReader)
    reader.body = {"regions": list(regions)}
    return list(reader.regions())


def _region(**changes: Any) -> dict[str, Any]:
    base = {"name": "m/w", "nbytes": 64, "kind": "tensor", "dtype": "bfloat16", "shape": [4, 8], "device": "cuda:0"}
    return base | changes


def test_the_same_layout_gives_the_same_objects_and_a_new_one_new_objects() -> None:
    first = _regions(_region(), _region(name="m/b", shape=[8], nbytes=16))
    again = _regions(_region(), _region(name="m/b", shape=[8], nbytes=16))
    assert first == again and all(a is b for a, b in zip(first, again, strict=True))
    assert first[0] == RegionInfo("m/w", 64, "tensor", "bfloat16", (4, 8), "cuda:0")
    for change in ({"dtype": "float16"}, {"shape": [8, 4]}, {"nbytes": 65}, {"device": "cpu"}, {"kind": "blob"}):
        other = _regions(_region(**change))[0]
        assert other is not first[0]
        want = _region(**change)
        assert other == RegionInfo(**{**want, "shape": tuple(want["shape"])})


def test_dimensions_that_are_not_whole_numbers_keep_their_own_type() -> None:
    ints = _regions(_region(shape=[1, 8]))[0]
    floats = _regions(_region(shape=[1.0, 8]))[0]
    bools = _regions(_region(shape=[True, 8]))[0]
    assert [type(d) for d in floats.shape or ()] == [float, int]
    assert [type(d) for d in bools.shape or ()] == [bool, int]
    assert _regions(_region(shape=[1, 8]))[0] is ints and [type(d) for d in ints.shape or ()] == [int, int]


def test_unhashable_fields_are_described_as_before() -> None:
    odd = _regions(_region(dtype=["bfloat16"]))[0]
    assert odd.dtype == ["bfloat16"]  # type: ignore[comparison-overlap]
    assert _regions(_region(shape=None, kind="blob"))[0].shape is None
