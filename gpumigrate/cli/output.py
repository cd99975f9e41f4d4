"""Where CLI output goes: human text to stderr (rich), the one JSON object to stdout's last line.

User-supplied text never reaches the console as markup (gpumigrate/terminal.py says why): interpolate
it with :func:`esc`; :func:`fail` and :func:`warn` print their message as plain text.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.text import Text

from gpumigrate.terminal import clean, esc

__all__ = ["clean", "console", "emit_json", "esc", "fail", "warn"]

# Human output always goes to stderr so that `--json` leaves stdout machine-readable.
console = Console(stderr=True, highlight=False)


def emit_json(obj: Any) -> None:
    """Print one JSON object as the last line of stdout."""
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump(mode="json")
    sys.stdout.write(json.dumps(obj, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def fail(message: str) -> None:
    console.print(Text.assemble(("error:", "bold red"), " ", clean(message)), soft_wrap=True)


def warn(message: str) -> None:
    console.print(Text.assemble(("warning:", "yellow"), " ", clean(message)), soft_wrap=True)
