"""Environment facts recorded in every image, and the policy a restore applies to them.

Both come from the core (:mod:`gpumigrate.environment`: the one collector, the one policy engine).
A restore enforces only what the plan's ``parity.environment`` names: a fact it calls ``must_match``
must be equal in the image and here; a fact neither side records is reported as not checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpumigrate.environment import collect_facts, compare
from gpumigrate.errors import InvalidInputError, SnapshotError
from gpumigrate.snapshot.errors import EnvironmentMismatchError

_FACTS: dict[str, Any] | None = None


def env_facts() -> dict[str, Any]:
    """This process's facts, read once (they do not change while it runs, and a final round must not pay for them)."""
    global _FACTS
    if _FACTS is None:
        _FACTS = collect_facts()
    return dict(_FACTS)


def check_policy(
    source: Mapping[str, Any], here: Mapping[str, Any], policy: Mapping[str, str] | None
) -> dict[str, Any]:
    """Raise EnvironmentMismatchError listing every forbidden difference; return what was checked."""
    try:
        report = compare(source, here, policy, defaults={})
    except InvalidInputError as exc:  # over the agent's wire every refusal is a SnapshotError
        raise SnapshotError(str(exc)) from None
    if not report.passed:
        problems = [f"{d.field}: image has {d.source!r}, this host has {d.target!r}" for d in report.violations]
        raise EnvironmentMismatchError(
            "refusing to restore: the source environment differs where the plan requires a match: "
            + "; ".join(problems),
            hint="set the fact to may_differ in the plan's parity.environment if the difference is acceptable",
        )
    differs = {d.field for d in (*report.violations, *report.notes)}
    named = [n for n in (policy or {}) if n in report.compared]
    checked = {n: "differs (allowed)" if n in differs else "match" for n in named}
    return {"checked": checked, "not_checked": report.not_checked}
