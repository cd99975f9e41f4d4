"""The engine's byte pipelines (``pipeline.py``), one per device and chunk size, made on first use and kept."""

from __future__ import annotations

import torch

from gpumigrate.snapshot.pipeline import Pipeline


class Pipelines:
    """Capture and restore share them: their rings and streams are allocated once per device and chunk size."""

    def __init__(self, *, workers: int, streams: int) -> None:
        self.workers = workers
        self.streams = streams
        self._made: dict[tuple[str, int], Pipeline] = {}

    def get(self, device: torch.device, chunk_size: int) -> Pipeline:
        key = (str(device), chunk_size)
        p = self._made.get(key)
        if p is None:
            p = Pipeline(device, chunk_size, streams=self.streams, workers=self.workers)
            self._made[key] = p
        return p

    def zeroize(self) -> None:
        """The rings held copies of workload memory: wiped."""
        for p in self._made.values():
            p.ring.zeroize()

    def close(self) -> None:
        for p in self._made.values():
            p.close()
        self._made.clear()
