"""The CUDA driver backend: suspend an unmodified CUDA process and resume it in place (same host).

``cuCheckpointProcess*`` moves a process's GPU memory to host memory and back, optionally onto other
GPUs of the same host: the restored workload is the source process itself. So this backend cannot
be the migrate flow's: the flow proves parity between two endpoints and ramps traffic from one to
the other, and here there is one. :meth:`check` refuses before anything moved, saying so. The host
actions stay for moving a process between GPUs by hand, and their undo (``resume``) brings the
process back to running from whatever step it stopped at.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from gpumigrate.errors import InvalidInputError
from gpumigrate.interfaces import ImageRef, Restored
from gpumigrate.snapshot import cuda_driver, process
from gpumigrate.snapshot.backends import ImageFiles
from gpumigrate.snapshot.backends.hostlevel import HostLevel


class CudaDriverBackend(HostLevel):
    name = "cuda-driver"
    needs_launch = False  # the source process itself resumes
    suspends = True  # a freeze: ``checkpoint`` moves the process's GPU memory to host memory, the GPU freed

    def check(self) -> dict[str, Any]:
        raise InvalidInputError(
            "snapshot.backend cuda-driver suspends the source process and resumes it in place (same host, "
            "optionally on other GPUs): there would be no second endpoint to prove parity on or to ramp "
            "traffic to, so the migrate flow refuses it before anything moves; use backend agent or criu"
        )

    def restore(self, image: ImageRef | None) -> Restored:
        out = self._act("source", "restore", **self._source_process())
        return Restored(image_id="", seconds=float(out.get("seconds") or 0.0), pid=self.setup.source_pid)

    def discard(self) -> None:
        """Nothing on a target: the process never left its host."""


# ----------------------------------------------------------------------------- on the host that holds the process


def on_host(action: str, params: Mapping[str, Any], files: ImageFiles) -> dict[str, Any]:
    """One CUDA driver host action, here: ``checkpoint`` suspends the process (its GPU memory to host memory,
    the GPU freed), ``restore`` brings it back (onto other GPUs with ``gpu_pairs``), ``resume`` is the undo
    from whatever step it stopped at. ``discard`` and ``retire`` have nothing to do in place."""
    if action == "check":
        return {"driver_version": list(cuda_driver.driver_version()), "gpus": cuda_driver.gpu_uuids()}
    pid = int(params["pid"])
    process.require_same(pid, params.get("start"))
    proc = cuda_driver.CudaProcess(pid)
    t0 = time.monotonic()
    if action == "checkpoint":
        proc.suspend(int(params.get("timeout_ms", 10_000)))
    elif action == "restore":
        proc.unsuspend(params.get("gpu_pairs"))
    elif action == "resume":
        return {"pid": pid, "found": proc.ensure_running(), "state": proc.state()}
    return {"pid": pid, "state": proc.state(), "seconds": time.monotonic() - t0}
