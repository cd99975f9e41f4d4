"""The golden set: the questions parity asks both sides, one JSON object per line (format: FORMAT.md).

Its own module, below ``request.py`` (which fills the plan's body template from a case) and ``output.py``
(which asks them), so neither imports the other for it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumigrate.errors import InvalidInputError

MAX_CASES = 10_000


@dataclass(frozen=True)
class GoldenCase:
    id: str
    request: dict[str, Any]  # the line without its "id": the body, or what parity.request.body is filled from


def load_golden(path: str | Path) -> list[GoldenCase]:
    """Read a golden-input JSONL file. Raises InvalidInputError naming the line that is wrong."""
    p = Path(path)
    if not p.is_file():
        raise InvalidInputError(f"golden inputs {p}: no such file")
    cases: list[GoldenCase] = []
    seen: set[str] = set()
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"golden inputs {p} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise InvalidInputError(f"{where}: must be a JSON object such as "
                                    '{"id": "c1", "text": "hello"}')  # fmt: skip
        cid = obj.get("id")
        if not isinstance(cid, str | int) or isinstance(cid, bool) or str(cid) == "":
            raise InvalidInputError(f"{where}: 'id' must be a non-empty string (or integer)")
        if str(cid) in seen:
            raise InvalidInputError(f"{where}: duplicate id {cid!r}: ids must be unique")
        request = {k: v for k, v in obj.items() if k != "id"}
        if not request:
            raise InvalidInputError(f"{where}: nothing to send besides 'id' (add the fields of the question)")
        seen.add(str(cid))
        cases.append(GoldenCase(id=str(cid), request=request))
        if len(cases) > MAX_CASES:
            raise InvalidInputError(f"golden inputs {p}: more than {MAX_CASES} cases; a smoke test needs tens")
    if not cases:
        raise InvalidInputError(f"golden inputs {p}: no cases (one JSON object per line)")
    return cases
