"""One exception hierarchy for the whole tool.

Every error a user can cause or meet derives from :class:`GpumigrateError` and carries the exit
code the CLI returns for it, so the CLI never decides codes by guessing from exception types.
Exit codes (the CLI contract): 0 completed, 2 invalid input or denied by policy before anything
moved, 3 rolled back (the source still serves), 1 any other failure.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_INVALID = 2
EXIT_ROLLED_BACK = 3


class GpumigrateError(Exception):
    """Base of every error gpumigrate raises on purpose."""

    exit_code: int = EXIT_FAILURE

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class InvalidInputError(GpumigrateError):
    """The user gave something we cannot accept (a bad plan, a bad flag, a missing file)."""

    exit_code = EXIT_INVALID


class PlanError(InvalidInputError):
    """A plan failed validation. ``problems`` holds (field path, message) pairs."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        lines = [f"{path}: {msg}" for path, msg in problems]
        super().__init__(f"invalid plan {source}:\n  " + "\n  ".join(lines))
        self.source = source
        self.problems = problems


class PolicyDeniedError(GpumigrateError):
    """A rule (residency, quota, capacity, environment parity) forbids the move before anything moved."""

    exit_code = EXIT_INVALID

    def __init__(self, rule: str, message: str, *, region: str | None = None) -> None:
        super().__init__(f"denied by {rule}: {message}")
        self.rule = rule
        self.region = region


class RolledBackError(GpumigrateError):
    """The migration was rolled back; the source still serves."""

    exit_code = EXIT_ROLLED_BACK

    def __init__(self, reason: str, *, seconds_to_detect: float | None = None) -> None:
        super().__init__(f"rolled back: {reason}")
        self.reason = reason
        self.seconds_to_detect = seconds_to_detect


class NotFoundError(InvalidInputError):
    """A migration id, image, host or file that does not exist."""


class IntegrityError(GpumigrateError):
    """Data failed verification: a digest, a signature, an audit chain, a chunk."""


class DecryptionError(IntegrityError):
    """A chunk could not be decrypted: wrong key or tampered ciphertext."""


class ProviderError(GpumigrateError):
    """A cloud or local provider failed in a way that is not a policy denial."""


class CapacityError(PolicyDeniedError):
    """No capacity or quota for the requested GPUs; raised before anything is launched."""

    def __init__(self, message: str, *, region: str | None = None, rule: str = "capacity") -> None:
        super().__init__(rule, message, region=region)


class ResidencyError(PolicyDeniedError):
    """Data would leave the jurisdictions its classification allows."""

    def __init__(self, message: str, *, region: str | None = None) -> None:
        super().__init__("data-residency", message, region=region)


class SnapshotError(GpumigrateError):
    """Capturing or restoring GPU state failed."""


class TransferError(GpumigrateError):
    """Moving an image between stores failed."""


class TrafficError(GpumigrateError):
    """Envoy, the control plane or the ramp failed."""


class ParityError(GpumigrateError):
    """The target does not answer like the source, or its environment differs where forbidden."""


class NotBuiltError(GpumigrateError):
    """A command whose capability has not been built yet. Never reports success."""
