"""Glue that embeds the snapshot agent in the reference workloads and wires the transfer engine in.

``workloads/`` may import anything, so this is where ``gpumigrate.snapshot`` (which must not import
``gpumigrate.transfer``) gets its image writer/reader factories: the agent passes a store URL and a
key *reference*; :func:`open_writer`/:func:`open_reader` resolve the key here, in the workload.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from gpumigrate.interfaces import ImageReader, ImageWriter
from gpumigrate.snapshot.agent import Agent
from gpumigrate.snapshot.server import AgentServer, serve
from gpumigrate.snapshot.stepgate import StepGate


def _key(key_ref: Mapping[str, str]) -> bytes | None:
    """The image key from its reference; none for an empty reference (a store without encryption)."""
    if not key_ref:
        return None
    from gpumigrate import transfer

    return transfer.resolve_key(env=key_ref.get("env"), file=key_ref.get("file"))


def open_writer(
    store: str,
    key_ref: Mapping[str, str],
    parent: str | None,
    *,
    compression: str = "auto",
    parallelism: int | None = None,
) -> ImageWriter:
    from gpumigrate import transfer

    workers = parallelism or int(os.environ.get("GPUMIGRATE_SNAPSHOT_PARALLELISM", "4"))
    # Larger chunks suit GPU capture (fewer per-chunk launches); default: the transfer engine's (4 MiB).
    chunk_mb = int(os.environ.get("GPUMIGRATE_SNAPSHOT_CHUNK_MB", "0"))
    return transfer.open_writer(
        store,
        key=_key(key_ref),
        parent=parent,
        parallelism=workers,
        source="agent",
        compression=compression,
        chunk_size=(chunk_mb << 20) or None,
    )


def open_reader(store: str, image_id: str, key_ref: Mapping[str, str]) -> ImageReader:
    from gpumigrate import transfer

    return transfer.open_reader(store, image_id, key=_key(key_ref))


class AgentHandle:
    """What a workload keeps: the agent and its control server. ``close()`` stops both."""

    def __init__(self, agent: Agent, server: AgentServer) -> None:
        self.agent = agent
        self.server = server
        self.address = server.address

    def close(self) -> None:
        self.server.stop()
        self.agent.close()


def make_agent(**kwargs: Any) -> Agent:
    return Agent(writer_factory=open_writer, reader_factory=open_reader, **kwargs)


def start_inference_agent(state: Any, port: int, host: str = "127.0.0.1") -> AgentHandle:
    """Embed an agent in the inference server: the model's tensors, frozen at the request SafePoint."""
    agent = make_agent(freezer=state.safe_point, set_ready=state.set_ready)
    agent.track_module("model", state.model)
    if getattr(state, "mutable", None) is not None:  # the server's --mutable-mb state
        agent.track_tensor("mutable", state.mutable)
    return AgentHandle(agent, serve(agent, port, host))


def training_callback(state: Any = None, port: int = 0, *, host: str = "127.0.0.1", await_restore: bool = False) -> Any:
    """A Lightning Callback that embeds the agent in a training job (``workloads/training.py``).

    Tracks the job's model and optimizer (``state.model``/``state.optimizer``; without a state, the
    LightningModule and the Trainer's optimizers), every RNG stream, and ``state.step``/``state.losses``;
    serves the agent at once; freezes between steps (``on_train_batch_end``); with ``await_restore``
    the first step waits until a restore made the agent ready. ``close()`` stops the agent.
    """
    import pytorch_lightning as pl

    class SnapshotCallback(pl.Callback):
        def __init__(self) -> None:
            self.gate = StepGate()
            self._ready = threading.Event()
            self.agent = make_agent(freezer=self.gate, set_ready=self._set_ready)
            self.handle: AgentHandle | None = None
            self._tracked_trainer = False
            if await_restore:
                self._set_ready(False)
            else:
                self._ready.set()
            if state is not None and hasattr(state, "model"):
                self.agent.track_module("model", state.model)
                if getattr(state, "optimizer", None) is not None:
                    self.agent.track_optimizer("optim", state.optimizer)
                self.agent.track_rng("rng")
                if hasattr(state, "step"):
                    self.agent.track_state("progress", self._get_progress, self._set_progress)
                self._tracked_trainer = True
                self.handle = AgentHandle(self.agent, serve(self.agent, port, host))

        @property
        def address(self) -> str | None:
            return self.handle.address if self.handle else None

        def _get_progress(self) -> dict[str, Any]:
            return {"step": int(state.step), "losses": list(getattr(state, "losses", []))}

        def _set_progress(self, value: dict[str, Any]) -> None:
            state.step = int(value["step"])
            if hasattr(state, "losses"):
                state.losses = list(value["losses"])

        def _set_ready(self, ready: bool) -> None:
            (self._ready.set if ready else self._ready.clear)()
            if state is not None and hasattr(state, "set_ready"):
                state.set_ready(ready)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if not self._tracked_trainer:  # no workload state given: track what the Trainer runs
                self.agent.track_module("model", pl_module)
                for i, opt in enumerate(trainer.optimizers):
                    self.agent.track_optimizer(f"optim{i}", opt)
                self.agent.track_rng("rng")
                self._tracked_trainer = True
                self.handle = AgentHandle(self.agent, serve(self.agent, port, host))
            self.gate.loop_running = True
            self._ready.wait()  # a target job waits here until its state is restored

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.gate.checkpoint()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.gate.stop_loop()

        def close(self) -> None:
            self.gate.stop_loop()
            if self.handle is not None:
                self.handle.close()
                self.handle = None

    return SnapshotCallback()
