"""Reading a plan: safe YAML, validated into :class:`~gpumigrate.plan.document.Plan`, every problem reported
as a :class:`~gpumigrate.errors.PlanError` with its field path and what is allowed (the CLI's exit code 2)."""

from __future__ import annotations

import difflib
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from gpumigrate.errors import PlanError
from gpumigrate.plan.document import Plan


def _loc(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("function-after", "function-before") or str(part).startswith(("function-", "literal[")):
            continue
        else:
            path += ("." if path else "") + str(part)
    return path or "(plan)"


def _unknown_field(loc: tuple[int | str, ...]) -> str:
    """An unknown field's message: the fields allowed where it stands, and the closest one."""
    model: Any = Plan
    for part in loc[:-1]:
        if isinstance(part, int):  # an item of a list: _model_in already took the list's item model
            continue
        field = model.model_fields.get(str(part)) if model is not None else None
        model = _model_in(field.annotation) if field is not None else None
    if model is None:
        return "unknown field (check the spelling; see examples/ for the allowed fields)"
    allowed = sorted(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown field: {hint}allowed here: {', '.join(allowed)}"


def _model_in(annotation: Any) -> Any:
    """The pydantic model an annotation holds (itself, or inside Optional/list/Annotated), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


_NAMED_FIELD = re.compile(r"^([a-z_]+(?:\.[a-z_]+)+): (.+)$", re.DOTALL)


def parse_plan(data: object, source: str = "<plan>") -> Plan:
    """Validate already-parsed YAML/JSON data. Raises :class:`PlanError` with field paths."""
    if not isinstance(data, dict):
        raise PlanError(
            source, [("(plan)", "the plan must be a YAML mapping with workload, target, data and transfer")]
        )
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            msg = err["msg"].removeprefix("Value error, ")
            loc = _loc(err["loc"])
            if err["type"] == "extra_forbidden":
                msg = _unknown_field(err["loc"])
            elif err["type"] == "missing":
                msg = "required field is missing"
            elif loc == "(plan)" and (named := _NAMED_FIELD.match(msg)):
                loc, msg = named.group(1), named.group(2)
            problems.append((loc, msg))
        raise PlanError(source, problems) from None


MAX_ALIASES = 20


class _PlanLoader(yaml.SafeLoader):
    """Safe YAML with a cap on aliases: a few are fine (``yaml.safe_dump`` writes them for shared values), but
    nested ones expand exponentially wherever a value is walked (``parity.request.body`` is free-form)."""

    aliases = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise yaml.YAMLError(f"more than {MAX_ALIASES} aliases (*name): write the values out")
        node: yaml.Node | None = super().compose_node(parent, index)
        return node


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file."""
    p = Path(path)
    if p.is_dir():
        raise PlanError(str(p), [("(file)", "is a directory: give a plan file (YAML) inside it")])
    if not p.is_file():
        raise PlanError(str(p), [("(file)", "no such file")])
    try:
        data = yaml.load(p.read_text(encoding="utf-8"), Loader=_PlanLoader)  # noqa: S506 (a SafeLoader)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise PlanError(str(p), [("(yaml)", f"not valid YAML{where}: {first}")]) from None
    except RecursionError:
        raise PlanError(str(p), [("(yaml)", "nested too deeply to be a plan")]) from None
    return parse_plan(data, str(p))


def resolve_relative(plan_path: str | Path, value: str) -> Path:
    """Paths inside a plan are relative to the plan file."""
    v = Path(value)
    return v if v.is_absolute() else (Path(plan_path).parent / v).resolve()
