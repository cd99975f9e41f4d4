"""Environment probe: ``python -m gpumigrate.parity.probe [--weights FILE ...]`` prints one JSON line.

Run on a host (locally, over ssh, or by a cloud's run-command) when no workload is up yet to ask
through ``/v1/info``. Keys follow the workload's ``/v1/info`` names, which
:func:`gpumigrate.parity.environment.normalize_facts` maps onto the policy's vocabulary. Only an
allow-list of environment variables is reported: the environment holds secrets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

REPORTED_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "CUBLAS_WORKSPACE_CONFIG",
    "NVIDIA_TF32_OVERRIDE",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "PYTORCH_CUDA_ALLOC_CONF",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _nvidia_smi() -> dict[str, Any]:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {}
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    rows = [r.split(", ") for r in out.stdout.strip().splitlines() if r.strip()] if out.returncode == 0 else []
    if not rows or len(rows[0]) < 3:
        return {}
    name, mem_mib, driver = rows[0][:3]
    return {"gpu_model": name, "gpu_memory_bytes": int(float(mem_mib)) * 2**20, "driver_version": driver,
            "gpu_count": len(rows)}  # fmt: skip


def _torch_facts() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"torch": None}
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "num_threads": torch.get_num_threads(),
    }


def weights_file_digest(paths: list[Path]) -> str:
    """BLAKE3 over the files in the order given (name-independent: only bytes count)."""
    import blake3

    h = blake3.blake3()
    for p in paths:
        with p.open("rb") as fh:
            while block := fh.read(8 << 20):
                h.update(block)
    return h.hexdigest()


def collect(weights: list[Path] | None = None, *, with_torch: bool = True) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "lightning": _version("pytorch-lightning") or _version("lightning"),
        "numpy": _version("numpy"),
        "env": {k: os.environ[k] for k in REPORTED_ENV if k in os.environ},
        "gpu_model": "none",
        "gpu_memory_bytes": None,
    }
    if with_torch:
        facts.update(_torch_facts())
    facts.update(_nvidia_smi())
    if weights:
        facts["weights_digest"] = weights_file_digest(weights)
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpumigrate.parity.probe", description=__doc__.split("\n")[0])
    parser.add_argument("--weights", type=Path, action="append", default=[], help="weights file to digest (repeatable)")
    parser.add_argument("--no-torch", action="store_true", help="do not import torch (faster; no torch facts)")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.weights if not p.is_file()]
    if missing:
        print(f"error: no such weights file: {', '.join(missing)}", file=sys.stderr)
        return 2
    print(json.dumps(collect(args.weights, with_torch=not args.no_torch), sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
