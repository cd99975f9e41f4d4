"""``gpumigrate cost``: not built yet; says so plainly."""

from __future__ import annotations

import typer

from gpumigrate.errors import NotBuiltError


def register(app: typer.Typer) -> None:
    app.command("cost")(cost)


def cost() -> None:
    """Not built yet."""
    raise NotBuiltError("'gpumigrate cost' is not built yet")
