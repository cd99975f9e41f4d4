"""``gpumigrate demo``: not built yet; says so plainly."""

from __future__ import annotations

import typer

from gpumigrate.errors import NotBuiltError


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


def demo() -> None:
    """Not built yet."""
    raise NotBuiltError("'gpumigrate demo' is not built yet")
