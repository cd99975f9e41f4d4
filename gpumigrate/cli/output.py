"""Where CLI output goes: human text to stderr (rich), the one JSON object to stdout's last line."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

# Human output always goes to stderr so that `--json` leaves stdout machine-readable.
console = Console(stderr=True, highlight=False)


def emit_json(obj: Any) -> None:
    """Print one JSON object as the last line of stdout."""
    if hasattr(obj, "model_dump"):
        obj = obj.model_dump(mode="json")
    sys.stdout.write(json.dumps(obj, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}", soft_wrap=True)
