"""Environment parity: compare the facts of source and target by the plan's policy, before traffic moves.

Facts come from the inference server's ``GET /v1/info``, from the snapshot agent's info, or from the
probe (``python -m gpumigrate.parity.probe`` run on the host, printing JSON). Whatever the source,
:func:`normalize_facts` maps them onto one vocabulary (FORMAT.md lists it), so a plan's
``parity.environment`` policy names ``torch``, ``gpu_model``, ``driver``, ``env.OMP_NUM_THREADS``...

A difference in a ``must_match`` field (or such a field known on one side only) is a violation:
:meth:`EnvironmentReport.raise_if_forbidden` raises :class:`EnvironmentParityError`, a policy denial
(exit 2: nothing has moved yet when the preflight runs it). ``may_differ`` differences are notes.
Fields the policy does not name are compared as ``may_differ``. In preflight, before the target
has loaded the workload, call it with ``scope="host"`` so that workload facts (weights digest,
model, dtype) are not demanded of a bare host. Environment variables with secret-looking names are
compared by digest and never written in clear.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from gpumigrate.atomic import atomic_write_json
from gpumigrate.errors import InvalidInputError, ParityError, PolicyDeniedError
from gpumigrate.parity.urls import redact_url

Policy = Literal["must_match", "may_differ"]

# Sensible defaults; the plan's ``parity.environment`` overrides them field by field.
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

# Names used by the workload's /v1/info, the agent and the probe -> the policy's vocabulary.
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

# Facts of the loaded workload, not of the host: a preflight probe of a fresh target cannot know them.
WORKLOAD_FACTS = frozenset({"weights_digest", "model", "dtype", "seed", "size", "n_params", "params_mb", "device",
                            "threads"})  # fmt: skip

# Environment variables whose value must never be written anywhere: compared by digest only.
_SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|SESSION", re.IGNORECASE)


def _env_value(name: str, value: Any) -> Any:
    if value is None or not _SECRET_NAME.search(name):
        return value
    digest = hashlib.sha256(str(value).encode()).hexdigest()[:16]
    return f"<redacted sha256:{digest}>"  # still comparable, never readable


class EnvironmentParityError(PolicyDeniedError, ParityError):
    """The target's environment differs from the source's where the plan forbids it (exit 2)."""

    def __init__(self, report: EnvironmentReport) -> None:
        lines = "; ".join(d.describe() for d in report.violations)
        super().__init__("environment-parity", f"the target's environment differs where the plan forbids it: {lines}")
        self.report = report


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "violations": [asdict(d) | {"text": d.describe()} for d in self.violations],
            "notes": [asdict(d) | {"text": d.describe()} for d in self.notes],
            "compared": self.compared,
        }

    def write(self, path: str | Path) -> None:
        """Keep the report beside the migration's other artifacts (atomic write)."""
        atomic_write_json(path, self.to_dict())

    def raise_if_forbidden(self) -> None:
        if not self.passed:
            raise EnvironmentParityError(self)


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


def _note(name: str, source: Any, target: Any) -> str:
    if name == "gpu_memory_bytes" and isinstance(source, int | float) and isinstance(target, int | float):
        return "the target has LESS GPU memory than the source" if target < source else "more GPU memory on the target"
    if name == "driver":
        return "driver differs: allowed; output parity decides whether numerics changed"
    if source is None or target is None:
        return f"unknown on the {'source' if source is None else 'target'}"
    return ""


def check_environment(
    source_info: Mapping[str, Any],
    target_info: Mapping[str, Any],
    policy: Mapping[str, str] | None = None,
    *,
    scope: Literal["workload", "host"] = "workload",
) -> EnvironmentReport:
    """Compare two fact sets by policy (the plan's ``parity.environment`` over :data:`DEFAULT_POLICY`).

    ``scope="workload"`` (both sides run the workload: the parity phase, ``parity check``) compares
    every fact. ``scope="host"`` (preflight against a probe of a target that has loaded nothing yet)
    skips :data:`WORKLOAD_FACTS` such as ``weights_digest``; host facts (torch, GPU, CUDA) still count.
    """
    if scope not in ("workload", "host"):
        raise InvalidInputError(f"scope must be 'workload' or 'host', got {scope!r}")
    merged: dict[str, Policy] = dict(DEFAULT_POLICY)
    for name, rule in (policy or {}).items():
        if rule not in ("must_match", "may_differ"):
            raise InvalidInputError(f"environment policy for {name!r} is {rule!r}: use must_match or may_differ")
        merged[ALIASES.get(name, name)] = rule  # type: ignore[assignment]
    src, tgt = normalize_facts(source_info), normalize_facts(target_info)
    report = EnvironmentReport(passed=True)
    for name in sorted(set(src) | set(tgt) | {n for n, r in merged.items() if r == "must_match"}):
        if scope == "host" and name in WORKLOAD_FACTS:
            continue
        s, t = src.get(name), tgt.get(name)
        rule = merged.get(name, "may_differ")
        if s is None and t is None:
            continue  # neither side knows it (a CPU host has no driver): nothing to compare
        report.compared.append(name)
        if s == t:
            continue
        diff = EnvDifference(name, s, t, rule, _note(name, s, t))
        (report.violations if rule == "must_match" else report.notes).append(diff)
    report.passed = not report.violations
    return report


def fetch_info(url: str, *, path: str = "/v1/info", timeout_s: float = 10.0) -> dict[str, Any]:
    """Facts from a running service's info endpoint. Raises ParityError when it does not answer."""
    where = redact_url(url.rstrip("/") + path)
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False) as client:
            resp = client.get(url.rstrip("/") + path)
    except httpx.HTTPError as exc:
        raise ParityError(f"environment facts: {where} did not answer: {type(exc).__name__}: {exc}") from None
    if resp.status_code != 200:
        raise ParityError(f"environment facts: {where} answered HTTP {resp.status_code}")
    try:
        body = resp.json()
    except ValueError:
        raise ParityError(f"environment facts: {where} did not return JSON") from None
    if not isinstance(body, dict):
        raise ParityError(f"environment facts: {where} did not return a JSON object")
    return body


def run_probe(command: Sequence[str], *, timeout_s: float = 120.0) -> dict[str, Any]:
    """Run the probe command on a host (e.g. ``[python, -m, gpumigrate.parity.probe]`` or via ssh).

    The last non-empty stdout line must be the JSON object the probe prints.
    """
    try:
        proc = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ParityError(f"environment probe {command[0]!r} failed to run: {exc}") from None
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
        raise ParityError(f"environment probe exited {proc.returncode}: {tail[0]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    try:
        facts = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        facts = None
    if not isinstance(facts, dict):
        raise ParityError("environment probe did not print a JSON object as its last line")
    return facts
