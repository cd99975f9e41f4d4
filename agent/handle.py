"""``attach()`` and its :class:`Handle`: the agent embedded in a user's process.

``attach`` builds the snapshot engine over the user's objects (``tracking.py``), wires the transfer
engine (``images.py``), starts the agent's control server on ``GPUMIGRATE_AGENT_ADDR`` and warms the
device kernels (``warmup.py``). The
handle's safe point (``snapshot/stepgate.py``) is where a freeze parks the workload; it also counts
steps and keeps the losses the workload reports, for training parity.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from gpumigrate import agent_keys
from gpumigrate.errors import InvalidInputError
from gpumigrate.launch import AGENT_ADDR_ENV, AWAIT_RESTORE_ENV
from gpumigrate.snapshot import tracked as tr
from gpumigrate.snapshot.engine import SnapshotEngine
from gpumigrate.snapshot.engine.dirty import Report
from gpumigrate.snapshot.ranks import RankGroup
from gpumigrate.snapshot.server import AgentServer, serve
from gpumigrate.snapshot.stepgate import SafePointGate, StepReport

from . import distributed, images, tracking, warmup
from .inflight import InFlight

DEFAULT_AGENT_ADDR = "127.0.0.1:7070"
SERVING_WAIT_S = 30.0  # a request held at a frozen safe point waits this long, then gets a 503
_UNSET: Any = object()

_current: Handle | None = None
_current_lock = threading.Lock()


class AgentAddressError(InvalidInputError):
    """The agent cannot listen where ``GPUMIGRATE_AGENT_ADDR`` says (in use, malformed, not local)."""


def awaiting_restore() -> bool:
    """True in a process that gpumigrate started to receive a migrated state (``GPUMIGRATE_AWAIT_RESTORE=1``):
    build the model from its config and skip loading weights; the restore fills them."""
    return os.environ.get(AWAIT_RESTORE_ENV, "") == "1"


def agent_address() -> tuple[str, int]:
    """Where the agent listens: ``$GPUMIGRATE_AGENT_ADDR`` (host:port; port 0 picks a free one), else 127.0.0.1:7070."""
    text = os.environ.get(AGENT_ADDR_ENV) or DEFAULT_AGENT_ADDR
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise AgentAddressError(f"{AGENT_ADDR_ENV}={text!r} is not HOST:PORT (e.g. {DEFAULT_AGENT_ADDR})")
    return host.strip("[]"), int(port)


def current() -> Handle | None:
    """The handle attached in this process, if any (the ASGI middleware's default)."""
    return _current


class Handle:
    """The agent attached to one workload. ``close()`` stops its control server."""

    def __init__(
        self, engine: SnapshotEngine, gate: SafePointGate, server: AgentServer, *, name: str, training: bool
    ) -> None:
        self.engine = engine
        self.rank = engine.group.rank if engine.group is not None else None
        self.world_size = engine.group.world_size if engine.group is not None else None
        self.gate = gate
        self.name = name
        self.training = training
        self._server: AgentServer | None = server
        self.address = server.address

    @property
    def ready(self) -> bool:
        """True when the workload may serve or train: its state is loaded and it is not frozen."""
        return self.gate.reason() is None

    @property
    def frozen(self) -> bool:
        return self.gate.frozen

    @property
    def steps(self) -> int:
        """Safe points completed so far (training steps, or requests served); travels with the state."""
        return self.gate.steps

    def reason(self) -> str | None:
        """Why the workload is not ready ("frozen", "awaiting restore", "retired: state zeroized"), or None."""
        return self.gate.reason()

    @contextmanager
    def safe_point(self, timeout_s: float | None = _UNSET) -> Iterator[StepReport]:
        """Wrap one request or one training step. A freeze waits for those in flight and holds new
        ones until resume or cut-over; so does a target that awaits its restore. ``timeout_s``: how
        long a held one waits before ``Unavailable`` (503) — default 30 s for a service, no limit
        for training (a handle with an optimizer, or a LightningModule). Yields the step, on which
        ``step.report(loss=...)`` records the step's loss."""
        wait = (None if self.training else SERVING_WAIT_S) if timeout_s is _UNSET else timeout_s
        with self.gate.safe_point(wait) as step:
            yield step

    def close(self) -> None:
        """Stop the control server and the agent; safe points held by a freeze go on. Idempotent."""
        global _current
        server, self._server = self._server, None
        if server is None:
            return
        server.stop()
        self.engine.close()
        self.gate.reopen()
        with _current_lock:
            if _current is self:
                _current = None

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_lightning_module(obj: Any) -> bool:
    return any(c.__name__ == "LightningModule" for c in type(obj).__mro__)


def attach(
    obj: Any,
    *,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    state: dict[str, Any] | None = None,
    name: str | None = None,
    process_group: Any = None,
    on_teardown: Callable[[], None] | None = None,
    on_rebuild: Callable[[], None] | None = None,
    written: Mapping[str, Report] | None = None,
    in_flight: InFlight | None = None,
) -> Handle:
    """Attach the migration agent to ``obj`` (a torch.nn.Module, a LightningModule, or a dict[str, torch.Tensor]).

    ``optimizer``: its state travels too (a list of optimizers works as well). ``lr_scheduler``: a
    ``torch.optim.lr_scheduler`` scheduler (or a list), whose position in its schedule travels. ``state``: a dict of
    extra tensors and plain values (step counters, RNG generators, a KV cache) that travels with it.
    A restore updates the same objects in place. Starts the agent's control server on
    ``GPUMIGRATE_AGENT_ADDR`` (default 127.0.0.1:7070), authenticated with the control key.

    ``process_group``: this process is one rank of that torch.distributed group (e.g.
    ``torch.distributed.group.WORLD``); every rank attaches, each rank's agent listens on the
    address's port + its local rank, and the ranks freeze together at one step. ``on_teardown`` /
    ``on_rebuild``: called around the group's teardown and rebuild (an in-place capture; see
    ``distributed.py``), e.g. to drop and re-create a DistributedDataParallel wrapper.

    ``written``: for a tensor of ``state`` (by its key) that the workload writes a few rows of at a time (a KV
    cache), a callable returning the byte ranges ``(offset, length)`` written since its previous call (None: it
    cannot say); pre-copy rounds then ship only the chunks those touch. ``in_flight``: an :class:`InFlight` whose
    hooks carry the work in flight at the safe point (an engine loop's requests) to the target (README.md).
    """
    if process_group is None and (on_teardown is not None or on_rebuild is not None):
        raise TypeError("attach(on_teardown=..., on_rebuild=...) go with process_group=...")
    group = None if process_group is None else distributed.rank_group(process_group, on_teardown, on_rebuild)
    return attach_items(
        obj,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        state=state,
        name=name,
        group=group,
        written=written,
        in_flight=in_flight,
    )


def attach_items(
    obj: Any,
    *,
    optimizer: Any = None,
    lr_scheduler: Any = None,
    state: dict[str, Any] | None = None,
    name: str | None = None,
    extra: Sequence[tr.Item] = (),
    training: bool | None = None,
    group: RankGroup | None = None,
    written: Mapping[str, Report] | None = None,
    in_flight: InFlight | None = None,
) -> Handle:
    """:func:`attach` plus ``extra`` tracked items (the Lightning callback's loop counters)."""
    global _current
    name = "model" if name is None else name
    if not isinstance(name, str) or not name or "/" in name or name in tracking.RESERVED:
        raise ValueError(f"name {name!r}: a non-empty string without '/', not one of {', '.join(tracking.RESERVED)}")
    opts = tracking.optimizers(optimizer)
    scheds = tracking.scheduler_items(tracking.schedulers(lr_scheduler))
    items = [
        tracking.model_item(obj, name),
        *tracking.optimizer_items(opts),
        *scheds,
        *tracking.state_items(state),
        *extra,
    ]
    if training is None:
        training = bool(opts) or _is_lightning_module(obj)
    reports = tracking.written_regions(state, written)
    if in_flight is not None and not isinstance(in_flight, InFlight):
        raise TypeError(
            f"attach(in_flight=...) takes a gpumigrate.agent.InFlight (subclass it); got {type(in_flight).__qualname__}"
        )
    host, port = agent_address()
    if group is not None:
        host, port = distributed.rank_address(host, port, group)
    identity = agent_keys.load_identity(create=True)
    if group is not None and group.world_size > 1:  # each rank its own identity and key, derived from the workload's
        identity = identity.rank(group.rank)
    with _current_lock:
        if _current is not None:
            raise RuntimeError(
                f"an agent is already attached in this process (at {_current.address}): close() it first"
            )
        gate = SafePointGate(ready=not awaiting_restore())
        engine = images.make_engine(freezer=gate, set_ready=gate.set_ready, group=group)
        for item in items:
            engine.track(item)
        # A rank carries its own GPU's RNG stream, by position: the target rank may use another index.
        engine.track_rng("rng", cuda_devices=distributed.cuda_devices(items[0].tensors()) if group else None)
        for region, report in reports.items():
            engine.track_written(region, report)
        if in_flight is not None:
            engine.track_work(in_flight)
        try:
            server = serve(engine, port, host, identity=identity)
        except OSError as exc:
            engine.close()
            raise _address_error(host, port, exc) from None
        _current = Handle(engine, gate, server, name=name, training=training)
        devices = distributed.cuda_devices({k: t for i in items for k, t in i.tensors().items()})
        # A target awaiting its restore warms what a restore runs; its first capture, if it ever moves on, compiles
        # the rest then (warming it now would hold the GIL and the GPU beside the restore it waits for).
        warmup.reports_writes(bool(reports))  # the chunk size: before the warm-up page-locks slots at it
        warmup.warm_device_kernels(devices, capture=not awaiting_restore())
        return _current


def _address_error(host: str, port: int, exc: OSError) -> AgentAddressError:
    where = f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return AgentAddressError(
            f"the agent address {where} is already in use (another process, or another agent here)",
            hint=f"set {AGENT_ADDR_ENV} to a free HOST:PORT (port 0 picks one)",
        )
    return AgentAddressError(
        f"the agent cannot listen on {where}: {exc.strerror or exc}", hint=f"set {AGENT_ADDR_ENV} to a local HOST:PORT"
    )
