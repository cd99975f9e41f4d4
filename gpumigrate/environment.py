"""Environment facts and the one policy engine that compares them.

A host or a process describes itself with *facts* (software versions, the accelerator, a few
environment variables); a plan's ``parity.environment`` says per fact whether source and target
``must_match`` or ``may_differ``. Three places compare facts, all through :func:`compare`:

- the preflight (source's ``/v1/info`` against a fresh target host: ``scope="host"``);
- the parity phase and ``gpumigrate parity check`` (both workloads running);
- a snapshot restore (the facts recorded in the image against the restoring process), which
  enforces only what the policy names (``defaults={}``).

:func:`collect_facts` is the one collector (the environment probe and the snapshot agent call it).
Names reported by other collectors (a workload's ``/v1/info``) are mapped onto one vocabulary by
:func:`normalize_facts`. Environment variables with secret-looking names are compared by digest and
never written in clear.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from gpumigrate.atomic import atomic_write_json
from gpumigrate.errors import InvalidInputError, ParityError, PolicyDeniedError

Policy = Literal["must_match", "may_differ"]
Scope = Literal["workload", "host"]
POLICY_VALUES: tuple[Policy, ...] = ("must_match", "may_differ")

# Sensible defaults for comparing two running workloads; the plan's policy overrides them fact by fact.
DEFAULT_POLICY: dict[str, Policy] = {
    "weights_digest": "must_match",
    "model": "must_match",
    "dtype": "must_match",
    "torch": "must_match",
    "cuda": "must_match",
    "gpu_model": "must_match",
    "driver": "may_differ",
    "cuda_driver": "may_differ",
    "cudnn": "may_differ",
    "lightning": "may_differ",
    "python": "may_differ",
    "threads": "may_differ",
    "gpu_memory_bytes": "may_differ",
}

# Names used by a workload's /v1/info and older collectors -> the policy's vocabulary.
ALIASES = {
    "torch_version": "torch",
    "torch_cuda": "cuda",
    "cuda_version": "cuda",
    "driver_version": "driver",
    "driver_cuda_version": "cuda_driver",
    "cudnn_version": "cudnn",
    "num_threads": "threads",
    "lightning_version": "lightning",
    "python_version": "python",
    "gpu_memory": "gpu_memory_bytes",
    "gpu_name": "gpu_model",
    "model_id": "model",
}

# Identity of one process or host, different by nature on every host: never compared.
NOT_COMPARED = frozenset({"host", "pid", "argv0", "ready", "hostname", "name", "started_at", "uptime_s", "address"})

# Facts of the loaded workload, not of the host: a probe of a fresh target cannot know them.
WORKLOAD_FACTS = frozenset(
    {"weights_digest", "model", "dtype", "seed", "size", "n_params", "params_mb", "device", "threads"}
)

# Environment variables that change numerics or placement. Never a blanket dump: the environment holds secrets.
REPORTED_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "CUBLAS_WORKSPACE_CONFIG",
    "NVIDIA_TF32_OVERRIDE",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "PYTORCH_CUDA_ALLOC_CONF",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
)

# Variables whose value must never be written anywhere: compared by digest only.
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|SESSION", re.IGNORECASE)


# ----------------------------------------------------------------------------- collecting


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _nvidia_smi() -> dict[str, Any]:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {}
    query = [smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return {}
    rows = [r.split(", ") for r in out.stdout.strip().splitlines() if r.strip()] if out.returncode == 0 else []
    if not rows or len(rows[0]) < 3:
        return {}
    name, mem_mib, driver = rows[0][:3]
    return {
        "gpu_model": name,
        "gpu_memory_bytes": int(float(mem_mib)) * 2**20,
        "driver": driver,
        "gpu_count": len(rows),
    }


def _torch_facts() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"torch": None}
    cuda = bool(torch.cuda.is_available())
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "threads": torch.get_num_threads(),
    }


def collect_facts(*, with_torch: bool = True) -> dict[str, Any]:
    """This host's facts, in the policy's vocabulary: software, accelerator, the allow-listed env vars.

    Never secrets, never paths. ``with_torch=False`` skips importing torch (fast; no torch facts).
    """
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "lightning": _version("pytorch-lightning") or _version("lightning"),
        "numpy": _version("numpy"),
        "env": {k: os.environ[k] for k in REPORTED_ENV if k in os.environ},
        "gpu_model": "none",
        "gpu_count": 0,
        "gpu_memory_bytes": None,
    }
    if with_torch:
        facts.update(_torch_facts())
    facts.update(_nvidia_smi())
    return facts


# ----------------------------------------------------------------------------- comparing


def _env_value(name: str, value: Any) -> Any:
    if value is None or not _SECRET_NAME.search(name):
        return value
    digest = hashlib.sha256(str(value).encode()).hexdigest()[:16]
    return f"<redacted sha256:{digest}>"  # still comparable, never readable


def normalize_facts(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Map reported facts to the policy's vocabulary; env vars become ``env.NAME``."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "env" and isinstance(value, Mapping):
            for name, v in value.items():
                out[f"env.{name}"] = _env_value(str(name), v)
            continue
        name = ALIASES.get(key, key)
        if name in NOT_COMPARED:
            continue
        if name in out and out[name] is not None and key != name:
            continue  # the canonical key wins over an alias that also appears
        out[name] = value
    return out


def validate_policy(policy: Mapping[str, str] | None) -> dict[str, Policy]:
    """The policy in canonical fact names; a value other than must_match/may_differ is invalid input."""
    out: dict[str, Policy] = {}
    for name, rule in (policy or {}).items():
        if rule not in POLICY_VALUES:
            raise InvalidInputError(
                f"environment policy for {name!r} is {rule!r}: allowed values are must_match or may_differ"
            )
        out[ALIASES.get(name, name)] = rule
    return out


@dataclass(frozen=True)
class EnvDifference:
    field: str
    source: Any
    target: Any
    policy: Policy
    note: str = ""

    def describe(self) -> str:
        text = f"{self.field}: source {self.source!r}, target {self.target!r} ({self.policy})"
        return f"{text}: {self.note}" if self.note else text


@dataclass
class EnvironmentReport:
    passed: bool
    violations: list[EnvDifference] = field(default_factory=list)  # must_match differences
    notes: list[EnvDifference] = field(default_factory=list)  # may_differ differences
    compared: list[str] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)  # named by the policy, known on neither side

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "violations": [asdict(d) | {"text": d.describe()} for d in self.violations],
            "notes": [asdict(d) | {"text": d.describe()} for d in self.notes],
            "compared": self.compared,
            "not_checked": self.not_checked,
        }

    def differences(self) -> list[str]:
        return [d.describe() for d in self.violations]

    def write(self, path: str | Path) -> None:
        """Keep the report beside the migration's other artifacts (atomic write)."""
        atomic_write_json(path, self.to_dict())

    def raise_if_forbidden(self) -> None:
        if not self.passed:
            raise EnvironmentParityError(self)


class EnvironmentParityError(PolicyDeniedError, ParityError):
    """The target's environment differs from the source's where the plan forbids it (exit 2)."""

    def __init__(self, report: EnvironmentReport) -> None:
        lines = "; ".join(report.differences())
        super().__init__("environment-parity", f"the target's environment differs where the plan forbids it: {lines}")
        self.report = report


def _note(name: str, source: Any, target: Any) -> str:
    if name == "gpu_memory_bytes" and isinstance(source, int | float) and isinstance(target, int | float):
        return "the target has LESS GPU memory than the source" if target < source else "more GPU memory on the target"
    if name == "driver":
        return "driver differs: allowed; output parity decides whether numerics changed"
    if source is None or target is None:
        return f"unknown on the {'source' if source is None else 'target'}"
    return ""


def compare(
    source: Mapping[str, Any],
    target: Mapping[str, Any],
    policy: Mapping[str, str] | None = None,
    *,
    scope: Scope = "workload",
    defaults: Mapping[str, Policy] = DEFAULT_POLICY,
) -> EnvironmentReport:
    """Compare two fact sets by ``policy`` over ``defaults``; facts neither names may differ.

    ``scope="host"`` (a fresh target that has loaded nothing yet) skips :data:`WORKLOAD_FACTS`. A
    ``must_match`` fact known on one side only is a violation; one known on neither side is listed
    in ``not_checked`` when the policy names it (a CPU host has no driver: nothing to compare).
    """
    if scope not in ("workload", "host"):
        raise InvalidInputError(f"scope must be 'workload' or 'host', got {scope!r}")
    named = validate_policy(policy)
    rules: dict[str, Policy] = {**defaults, **named}
    src, tgt = normalize_facts(source), normalize_facts(target)
    report = EnvironmentReport(passed=True)
    for name in sorted(set(src) | set(tgt) | {n for n, r in rules.items() if r == "must_match"} | set(named)):
        if scope == "host" and name in WORKLOAD_FACTS:
            continue
        s, t = src.get(name), tgt.get(name)
        if s is None and t is None:
            if name in named:
                report.not_checked.append(name)
            continue
        report.compared.append(name)
        if s == t:
            continue
        rule = rules.get(name, "may_differ")
        diff = EnvDifference(name, s, t, rule, _note(name, s, t))
        (report.violations if rule == "must_match" else report.notes).append(diff)
    report.passed = not report.violations
    return report
