"""Host-level snapshot actions: the embedded default runs them in-process with clear refusals here."""

from __future__ import annotations

import pytest

from gpumigrate.errors import GpumigrateError, InvalidInputError


def test_unknown_action_and_backend_are_refused() -> None:
    from gpumigrate.flows.host_actions import dispatch

    with pytest.raises(InvalidInputError, match="not one of"):
        dispatch("local-a", "teleport", {"backend": "criu"})
    with pytest.raises(InvalidInputError, match="cuda-driver and criu"):
        dispatch("local-a", "check", {"backend": "agent"})


@pytest.mark.parametrize("backend", ["criu", "cuda-driver"])
def test_check_runs_in_process_and_says_why_it_cannot(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No server, no host workers: the action runs here; on this machine (no GPU, CRIU < 4) it refuses
    with a GpumigrateError naming the reason, or reports what it found where it can run."""
    from gpumigrate.flows.host_actions import dispatch

    monkeypatch.delenv("GPUMIGRATE_HOST_WORKERS", raising=False)
    try:
        out = dispatch("local-a", "check", {"backend": backend})
    except GpumigrateError as exc:
        assert str(exc) and "Traceback" not in str(exc)
    else:
        assert out  # a GPU machine with the driver API / a host with CRIU 4+ and its CUDA plugin


def test_deployment_names_follow_the_per_host_queues() -> None:
    from gpumigrate.flows.host_actions import deployment_name

    assert deployment_name("gpu-7") == "host-action/gpu-7"
