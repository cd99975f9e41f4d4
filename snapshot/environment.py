"""Environment facts recorded in every image, and the policy check a restore applies to them.

A plan says per fact whether source and target ``must_match`` or ``may_differ`` (parity section).
A fact neither side records (e.g. one another component checks) is reported as not checked.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping
from typing import Any

import torch

from gpumigrate.errors import SnapshotError
from gpumigrate.snapshot.errors import EnvironmentMismatchError

POLICY_VALUES = ("must_match", "may_differ")


def _driver_version() -> str | None:
    try:  # lazy: cuda-bindings exists on GPU hosts only
        from cuda.bindings import driver as cu

        err, version = cu.cuDriverGetVersion()
        if int(err) == 0:
            return f"{version // 1000}.{(version % 1000) // 10}"
    except Exception:
        return None
    return None


_FACTS: dict[str, Any] | None = None


def env_facts() -> dict[str, Any]:
    """What a restore may compare: software versions and the accelerator, never secrets or paths.

    Read once per process (they do not change while it runs, and a final round must not pay for them).
    """
    global _FACTS
    if _FACTS is None:
        _FACTS = _read_facts()
    return dict(_FACTS)


def _read_facts() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__.split("+")[0],
        "machine": platform.machine(),
        "cuda": torch.version.cuda if cuda else None,
        "gpu_model": torch.cuda.get_device_name(0) if cuda else "none",
        "gpu_count": torch.cuda.device_count() if cuda else 0,
    }
    if cuda:
        facts["driver"] = _driver_version()
    return facts


def check_policy(
    source: Mapping[str, Any], here: Mapping[str, Any], policy: Mapping[str, str] | None
) -> dict[str, Any]:
    """Raise EnvironmentMismatchError listing every forbidden difference; return what was checked."""
    checked: dict[str, str] = {}
    not_checked: list[str] = []
    problems: list[str] = []
    for key, rule in (policy or {}).items():
        if rule not in POLICY_VALUES:
            raise SnapshotError(
                f"environment policy for {key!r} is {rule!r}: allowed values are {', '.join(POLICY_VALUES)}"
            )
        if key not in source and key not in here:
            not_checked.append(key)
            continue
        a, b = source.get(key), here.get(key)
        if rule == "must_match" and a != b:
            problems.append(f"{key}: image has {a!r}, this host has {b!r}")
        checked[key] = "match" if a == b else "differs (allowed)" if rule == "may_differ" else "differs"
    if problems:
        raise EnvironmentMismatchError(
            "refusing to restore: the source environment differs where the plan requires a match: "
            + "; ".join(problems),
            hint="set the fact to may_differ in the plan's parity.environment if the difference is acceptable",
        )
    return {"checked": checked, "not_checked": not_checked}
