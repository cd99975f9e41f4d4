"""Environment facts a workload reports (``GET /v1/info``): what parity checks compare across hosts.

Only an allow-list of environment variables is reported, so secrets in the environment never leak.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from typing import Any

import torch

# Variables that change numerics or placement, the same allow-list the host probe reports (parity
# compares the two). Never a blanket dump: the environment holds secrets.
from gpumigrate.parity.probe import REPORTED_ENV


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def cuda_driver_facts() -> dict[str, Any]:
    """Driver version string (nvidia-smi) and the driver's CUDA API version (libcuda)."""
    facts: dict[str, Any] = {"driver_version": None, "driver_cuda_version": None}
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
            )
            facts["driver_version"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else None
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            facts["driver_cuda_version"] = f"{v.value // 1000}.{(v.value % 1000) // 10}"
    except OSError:
        pass
    return facts


@functools.cache
def _static_facts() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "lightning": _version("pytorch-lightning") or _version("lightning"),
        "numpy": _version("numpy"),
        "cuda_available": torch.cuda.is_available(),
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
    }


def environment_facts(device: str = "cpu") -> dict[str, Any]:
    """Facts about this process's software and hardware; GPU facts only when ``device`` is CUDA."""
    facts = dict(_static_facts())
    facts["num_threads"] = torch.get_num_threads()
    facts["pid"] = os.getpid()
    facts["env"] = {k: os.environ[k] for k in REPORTED_ENV if k in os.environ}
    facts["gpu_model"] = "none"
    facts["gpu_memory_bytes"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.device(device)
        props = torch.cuda.get_device_properties(dev)
        facts["gpu_model"] = props.name
        facts["gpu_memory_bytes"] = props.total_memory
        facts["gpu_count"] = torch.cuda.device_count()
        facts.update(cuda_driver_facts())
    facts["argv0"] = sys.argv[0]
    return facts
