"""The plan's transfer bounds (gpumigrate/bounds.py): read from the plan, shared among ranks, and carried as a
round's writer options, each bad value refused with what is allowed."""

from __future__ import annotations

import pytest

from gpumigrate.bounds import MIN_RATE, TransferBounds, parse_rate
from gpumigrate.plan import Transfer


@pytest.mark.parametrize(
    ("text", "rate"),
    [
        (2_000_000, 2_000_000),
        ("500MB/s", 500_000_000),
        ("2GiB/s", 2 << 30),
        ("1.5G", 1_500_000_000),
        ("8 MiB", 8 << 20),
    ],
)
def test_rates_read_as_bytes_per_second(text: object, rate: int) -> None:
    assert parse_rate(text) == rate


@pytest.mark.parametrize(("text", "says"), [("fast", "not a rate"), ("10KB/s", "below"), (True, "bytes per second")])
def test_a_bad_rate_says_what_is_allowed(text: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_rate(text)


def test_the_plan_gives_the_bounds_and_their_wire_form() -> None:
    plan = Transfer(store="file:///s", parallelism=8, rate_limit="2GB/s", pacing="adaptive")
    bounds = plan.bounds()
    assert bounds == TransferBounds(8, 2_000_000_000, "adaptive")
    assert bounds.options() == {"parallelism": 8, "rate_limit": 2_000_000_000, "pacing": "adaptive"}
    assert TransferBounds.from_options({"compression": "auto", **bounds.options()}) == bounds
    default = Transfer(store="file:///s").bounds()
    assert default == TransferBounds(4, None, "adaptive")  # the plan's defaults: 4 threads, no cap, adaptive
    assert default.options() == {"parallelism": 4, "pacing": "adaptive"}


def test_ranks_on_one_host_share_its_bounds() -> None:
    bounds = TransferBounds(8, 4_000_000_000, "adaptive")
    assert bounds.share(1) is bounds
    assert bounds.share(4) == TransferBounds(2, 1_000_000_000, "adaptive")
    assert bounds.share(16) == TransferBounds(1, 250_000_000, "adaptive")  # every rank keeps a thread
    assert TransferBounds(2, 2 * MIN_RATE).share(8) == TransferBounds(1, MIN_RATE)  # and the smallest cap
    assert TransferBounds().share(3) == TransferBounds()  # no bound stays no bound


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"parallelism": 0}, "parallelism 0: must be a whole number from 1 to 64"),
        ({"parallelism": True}, "parallelism True"),
        ({"rate_limit": "slow"}, "not a rate"),
        ({"pacing": "gentle"}, "pacing 'gentle': allowed are adaptive, off"),
    ],
)
def test_bad_options_are_named(options: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        TransferBounds.from_options(options)
