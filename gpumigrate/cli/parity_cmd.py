"""``gpumigrate parity``: owned by the parity work (see the issue); says plainly what is not built yet."""

from __future__ import annotations

import typer

from gpumigrate.errors import NotBuiltError

app = typer.Typer(help="parity commands (not built yet).", no_args_is_help=True)


@app.command("info")
def info() -> None:
    """Say what is not built yet."""
    raise NotBuiltError("'gpumigrate parity' is not built yet")
