"""The small interfaces the subpackages implement and the flows wire together.

They live in the core so that siblings never import each other: ``snapshot/`` writes into an
:class:`ImageWriter` that ``transfer/`` implements; ``traffic/`` calls a :class:`OutputComparator`
that ``parity/`` implements; the flow drives a :class:`SnapshotBackend` whose host-level
implementations reach hosts through the flows' :class:`HostActions`; ``flows/`` (or a workload
embedding the agent) passes the concrete objects in. A new cloud, snapshot backend or store is one
new module implementing one Protocol.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeGuard, runtime_checkable

if TYPE_CHECKING:
    from gpumigrate.launch import WorkloadLaunch

# ----------------------------------------------------------------------------- infra


@dataclass(frozen=True)
class HostSpec:
    """What to provision. ``name`` is stable per migration so a retried provision finds its host."""

    name: str
    provider: str
    region: str
    zone: str | None = None
    instance_type: str | None = None
    gpu_model: str = "none"
    gpu_count: int = 0
    image: str | None = None
    tags: Mapping[str, str] = field(default_factory=dict)
    # The workload to start there (cloud providers put it in user data / a startup script at launch).
    launch: WorkloadLaunch | None = None


@dataclass
class Host:
    """A provisioned host. ``address`` is where its services listen; ``ports`` names them."""

    name: str
    provider: str
    region: str
    address: str
    instance_id: str | None = None
    zone: str | None = None
    ports: dict[str, int] = field(default_factory=dict)
    workdir: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Jurisdiction:
    country: str  # ISO 3166 alpha-2, or LOCAL for this machine's test regions
    blocs: tuple[str, ...]  # e.g. ("EU", "EEA")
    source: str  # where the mapping comes from


@runtime_checkable
class Provider(Protocol):
    name: str

    def check_capacity(self, spec: HostSpec) -> dict[str, Any] | None:
        """Raise CapacityError (exit 2) when the type, zone or quota cannot take ``spec``. Launches nothing.
        Returns what it saw, for the report (None: nothing to report)."""

    def provision(self, spec: HostSpec, *, migration_id: str) -> Host:
        """Launch (or find the host already launched for this migration: idempotent)."""

    def wait_ready(self, host: Host, *, timeout_s: float = 600) -> Host: ...

    def bootstrap(self, host: Host, launch: WorkloadLaunch, *, timeout_s: float) -> Host:
        """Start the workload on ``host`` (local: spawn it; cloud: wait for the boot script started at launch)
        and return the host with the ``service``/``agent`` ports it listens on. On failure: raise
        ProviderError carrying the workload's last output lines; the caller terminates the host."""

    def terminate(self, host: Host) -> None:
        """Idempotent; never raises for a host that is already gone."""

    def jurisdiction(self, region: str) -> Jurisdiction:
        """Raise ResidencyError for a region unknown to the map: denied, not guessed."""

    def price(self, spec: HostSpec) -> float:
        """USD per hour for ``spec`` in its region."""


# ----------------------------------------------------------------------------- images


@dataclass(frozen=True)
class RegionInfo:
    """One named region of an image: a tensor, a file, or a blob of opaque state."""

    name: str
    nbytes: int
    kind: Literal["tensor", "file", "blob"] = "tensor"
    dtype: str | None = None  # torch/numpy dtype name for tensors: "bfloat16", "float32", ...
    shape: tuple[int, ...] | None = None
    device: str | None = None  # where it lived on the source ("cuda:0", "cpu"), informational


@dataclass(frozen=True)
class ImageRef:
    """A committed image in a store. ``id`` is the manifest's BLAKE3 digest."""

    id: str
    store: str
    parent: str | None = None
    bytes_image: int = 0  # logical bytes of all regions
    bytes_sent: int = 0  # bytes that crossed to the store in this commit (after dedup, compression)
    bytes_stored: int = 0  # bytes the store holds for this image's new chunks


@runtime_checkable
class ImageWriter(Protocol):
    """Builds one image. Thread-safe: several threads may call put_chunk at once (that is the overlap)."""

    chunk_size: int

    def add_region(self, info: RegionInfo) -> None: ...

    def add_regions(self, infos: Iterable[RegionInfo]) -> None:
        """``add_region`` of each, in order (one call for a round's many)."""

    def put_chunk(self, region: str, index: int, data: memoryview) -> str:
        """Hash, compress, encrypt and store chunk ``index`` of ``region``; return its chunk id.

        Returns once ``data`` may be reused by the caller (so pinned ring buffers can be recycled).
        """

    def reuse_chunk(self, region: str, index: int, chunk_id: str) -> None:
        """Chunk unchanged since the parent image: reference it without sending bytes."""

    def reuse_chunks(self, chunks: Iterable[tuple[str, int, str]]) -> None:
        """``reuse_chunk(region, index, chunk_id)`` of each, in order (one call for a round's many)."""

    def reuse_regions(self, regions: Iterable[tuple[str, Sequence[str]]]) -> None:
        """``reuse_chunk(region, i, ids[i])`` of every chunk of each ``(region, ids)``: regions unchanged since the
        parent, whole (a writer may take the parent's record of each at once)."""

    def set_metadata(self, key: str, value: Any) -> None:
        """Small JSON-able state (step counters, RNG state, environment facts). Never secrets."""

    def commit(self) -> ImageRef: ...


@runtime_checkable
class ImageReader(Protocol):
    """Reads a verified image: the manifest's signature is checked when the reader opens."""

    ref: ImageRef

    def regions(self) -> Sequence[RegionInfo]: ...

    def metadata(self) -> Mapping[str, Any]: ...

    def chunk_count(self, region: str) -> int: ...

    def read_chunk_into(self, region: str, index: int, out: memoryview) -> int:
        """Fetch, verify (BLAKE3), decrypt and decompress into ``out``; return bytes written."""


@dataclass(frozen=True)
class TensorChunk:
    """One chunk of a region as a flat uint8 tensor (torch), where it lives: a CUDA device or host memory."""

    region: str
    index: int
    data: Any


@dataclass(frozen=True)
class ChunkRun:
    """Chunks of one region that a frozen round expects unchanged: chunk ``indices[k]`` of the region's flat uint8
    bytes ``view`` (torch, where they live; chunk ``i`` starts at ``i * chunk_size``, the last may be shorter)
    should still have the id ``ids[k]``. One per region, not one object per chunk: a model has 1,400 of them."""

    region: str
    view: Any
    indices: Sequence[int]
    ids: Sequence[str]


@runtime_checkable
class DirectImageWriter(ImageWriter, Protocol):
    """An ImageWriter that takes chunks as tensors where they live and moves their bytes itself.

    For device tensors the writer computes each chunk id on the device, encodes there where it can,
    copies into its own pinned host memory and seals and stores from that memory: the caller makes
    no host copy and hashes nothing. Host tensors are read in place by the writer's threads.
    """

    def put_tensors(self, chunks: Sequence[TensorChunk]) -> list[Future[str]]:
        """Queue ``chunks``; each future gives its chunk id (BLAKE3 of the bytes read) once stored.

        Device tensors are read by work queued on each device's current CUDA stream before this
        returns: the caller may overwrite them with work it queues on that stream afterwards.
        Host tensors may be overwritten once their futures are done.
        """

    def pacing(self) -> Mapping[str, Any]:
        """What this round's pacing did (transfer/pacing.py: the rates it set and why); empty when unpaced."""

    def confirm_chunks(self, runs: Sequence[ChunkRun], *, background: bool = False) -> Callable[[], list[list[bool]]]:
        """Start hashing the runs' chunks where they live (BLAKE3, as chunk ids are); nothing is stored.

        Returns a function that waits and gives, per run and chunk, whether the bytes still have their id (called
        again, it gives the same answer). Device work is ordered after what each device's current stream holds
        when this is called and runs beside what the caller queues next (the frozen round ships its dirty chunks
        meanwhile: the bytes confirmed are frozen); ``background``: behind that work where the device can order
        it (a lower stream priority), for hashes the round does not wait for before it ships. The frozen final
        round confirms with it that chunks its fingerprints call unchanged really are.
        """


class LatencySignal(Protocol):
    """How long the source's own requests take, as the workload sees them: what the pacing of a live capture round
    yields to (transfer/pacing.py). The SDK's safe point implements it (snapshot/stepgate.py: the time from a
    request's admission to its end), so a service that wraps its requests in ``safe_point()`` needs nothing more."""

    def latencies(self, since: float) -> list[float]:
        """Durations in seconds of the requests that ended after ``since`` (``time.monotonic()``), oldest first."""

    @property
    def in_flight(self) -> int:
        """Requests under way now."""

    def running_for(self, since: float) -> float:
        """How long the oldest request that began after ``since`` (``time.monotonic()``) and is still under way has
        run, in seconds (0.0: none)."""


@runtime_checkable
class DirectImageReader(ImageReader, Protocol):
    """An ImageReader that fills destination tensors itself (fetch, open, decode, copy, verify)."""

    def read_tensors(self, chunks: Sequence[TensorChunk]) -> int:
        """Fill each chunk's tensor with its verified plaintext; return the bytes loaded.

        Every chunk's BLAKE3 is checked against its id where its bytes landed (on the device for
        device tensors) before this returns; a mismatch raises IntegrityError, and the destinations
        then hold unverified bytes that the caller must not serve.
        """


def reads_directly(reader: ImageReader) -> TypeGuard[DirectImageReader]:
    """Whether ``reader`` places chunks itself (a DirectImageReader), decided as ``isinstance`` decides from Python
    3.12 on, whatever Python runs this: the method must be found statically (``inspect.getattr_static``), not only
    through a ``__getattr__``. A reader that offered it dynamically took the direct path on 3.11 (CI) and lost it on
    the GPU machines' 3.12 (issue 32: a rank's restore at 0.15x of one rank's); now both see the same."""
    return isinstance(reader, DirectImageReader) and callable(inspect.getattr_static(reader, "read_tensors", None))


# ----------------------------------------------------------------------------- snapshot


@dataclass(frozen=True)
class RoundStats:
    round: int
    chunks_total: int
    chunks_dirty: int
    bytes_dirty: int
    seconds: float
    phases: Mapping[str, float] = field(default_factory=dict)  # where ``seconds`` went, step by step
    pacing: Mapping[str, Any] = field(default_factory=dict)  # what the round's pacing did (live rounds only)


@dataclass(frozen=True)
class Round:
    """One live pre-copy round: the dirty set it shipped and the image it committed (the next round's parent)."""

    stats: RoundStats
    image: ImageRef


@dataclass(frozen=True)
class Restored:
    """What a restore did on the target."""

    image_id: str
    seconds: float
    bytes_loaded: int = 0
    chunks_loaded: int = 0
    chunks_skipped: int = 0
    ready: bool = True  # False after a pre-load: the workload does not serve yet
    pid: int | None = None  # the process the restore started (CRIU), where it started one
    pid_start: int | None = None  # when it started (clock ticks since boot): with pid, one process, never a reused pid
    environment: Mapping[str, Any] = field(default_factory=dict)  # what the environment policy checked
    from_source: Mapping[str, Any] = field(default_factory=dict)  # a fill from the source's memory: way, chunks
    # A workload of ranks: per rank, where it ran on the source and runs here (devices, GPU UUIDs), its own load
    ranks: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class StepLosses:
    """Steps a training workload has taken and the losses it reported for them (``advance``, its step metrics)."""

    steps: int
    losses: tuple[tuple[int, float], ...]  # (step, loss), oldest first (rank 0's, for a workload of ranks)
    frozen: bool | None = None
    ready: bool | None = None
    ranks: tuple[tuple[tuple[int, float], ...], ...] = ()  # every rank's losses, rank 0's first; () for one process


Side = Literal["source", "target"]


@runtime_checkable
class HostActions(Protocol):
    """Runs one host-level snapshot action (a driver checkpoint, a CRIU dump) on the host that holds the process.

    The flows implement it twice: through that host's Prefect worker, or in-process when the host is
    this machine (and refused otherwise). ``params`` and the reply are small JSON-able dicts.
    """

    def __call__(self, host: str, action: str, params: Mapping[str, Any]) -> dict[str, Any]: ...


@runtime_checkable
class SnapshotBackend(Protocol):
    """One way to capture a workload's state on the source and bring it back on the target.

    The migrate flow calls only this, for every workload kind; one factory
    (``gpumigrate.snapshot.backends.snapshot_backend``) picks the implementation from ``plan.snapshot.backend``
    and ``plan.workload.ranks``: ``agent`` (the agents embedded in the workload's ranks, over their control
    addresses), ``cuda-driver`` and ``criu`` (host-level actions on an unmodified process). Source-side methods
    never leave the source frozen on an error. Where a training job differs from a service (its step boundary,
    the steps that prove parity, a freeze kept for the rest of the migration) the difference is a method here,
    which a backend without safe points refuses naming what it cannot do.
    """

    name: str
    # Whether the workload on the target is started by the flow (``workload.launch``) and then filled by
    # restore (agent); False: restore itself brings the process up (CRIU) or resumes the source (cuda-driver).
    needs_launch: bool
    # Whether precopy() runs live rounds while the source serves; False: everything moves while frozen.
    live_rounds: bool
    # Whether preload() can load a pre-copy image into the target while the source serves (the target stays
    # unready), so that restore() loads only what the final image changed; False: preload() is never called.
    preloads: bool
    # Whether freeze() parks the source under a lease that resumes it unless renew() is called in time (the flow
    # renews it while it works on the frozen source); False: renew() is never called.
    leases: bool

    def check(self) -> dict[str, Any]:
        """Preflight: raise (exit 2 for a plan that cannot work) naming what is missing; moves nothing.

        Returns what it found (small JSON-able facts): the flow records it and hands it back in later
        phases as ``Setup.checked`` (the source process's start time, say)."""

    def facts(self, side: Side) -> dict[str, Any]:
        """The environment facts the workload on ``side`` reports through its agent ({} where the backend knows no
        agent there); raises GpumigrateError naming the agent when it does not answer."""

    # -- source side
    def precopy(self) -> Round:
        """One live round while the source serves: ship what changed since the last round."""

    def freeze(self, lease_s: float | None = None) -> int | None:
        """Stop the source at a safe point; with ``lease_s`` it resumes by itself unless the lease is renewed.
        Returns the safe points (steps, requests) it completed before it stopped; None without safe points."""

    def renew(self, lease_s: float) -> bool:
        """Extend the freeze's lease from now; whether the source is still frozen. Only for a backend that ``leases``."""

    def final(self) -> ImageRef | None:
        """While frozen: ship the last dirty set and commit. None: the state stays in the process (in place)."""

    def advance(self, steps: int, *, timeout_s: float) -> StepLosses:
        """A frozen training source takes exactly ``steps`` more steps and stops again; the losses it reported."""

    def resume(self) -> None:
        """The source runs again (the undo of freeze and final). Idempotent."""

    def retire(self) -> dict[str, Any]:
        """After the cut-over held: wipe (or stop) the source; return the audit record."""

    # -- target side
    def preload(self, image: ImageRef) -> Restored:
        """Load a pre-copy image into the target before the final one, so that restore loads only the delta.

        The target stays unready (``Restored.ready`` is False). Only for a backend that ``preloads``."""

    def restore(self, image: ImageRef | None) -> Restored:
        """Rebuild the state on the target from the verified image; the workload reports ready after it."""

    def wait_for_steps(self, side: Side, *, since: int, count: int, timeout_s: float) -> StepLosses:
        """Once the workload on ``side`` reported ``count`` losses for steps after step ``since``: its steps and
        those losses (a restored training target trains on; raises naming what it saw after ``timeout_s``)."""

    def discard(self) -> None:
        """Undo of restore for what the host's terminate does not stop (a process CRIU restored). Idempotent."""

    # -- work in flight (a workload whose safe point lands inside its clients' work: an LLM engine between two
    # decode steps). The final image carries that work; the source keeps it sealed until one of these two.
    def hand_over(self, target: str) -> dict[str, Any]:
        """Once the target is restored and ready: the work in flight the final image carried goes on there
        (``target``: its service URL, as the source reaches it; the source relays its clients' streams). What was
        handed over; ``{}`` where the workload hands nothing over (every backend but the agent's)."""

    def take_back(self) -> dict[str, Any]:
        """Undo of a final round that sealed work in flight: the source goes on with it. Idempotent; ``{}`` where
        nothing was sealed."""

    def work(self, side: Side) -> dict[str, Any]:
        """The workload's figures of its work in flight on ``side`` (``in_flight``: served there, ``relayed``: handed
        over and still relayed to its clients, ``held``), for the live view and the undo's drain; ``{}`` where the
        workload reports none."""


# ----------------------------------------------------------------------------- parity


@dataclass(frozen=True)
class ParityReport:
    passed: bool
    cases: int
    max_abs_err: float | None
    failures: tuple[str, ...] = ()  # readable reasons, one per failing case/column


@dataclass(frozen=True)
class ParityQuery:
    """One golden case as the HTTP request that asks it (built by ``parity.request.build_requests`` from the
    plan's ``parity.request``); the smoke test and the ramp's live probes send the same requests."""

    case: str
    method: str
    path: str
    body: Any = None  # JSON body (None: no body)
    params: Mapping[str, str] = field(default_factory=dict)  # query string (GET)
    headers: Mapping[str, str] = field(default_factory=dict)


@runtime_checkable
class OutputComparator(Protocol):
    """Compares the outputs of source and target for the same inputs (parity/ implements it)."""

    def compare(self, source: Sequence[Mapping[str, Any]], target: Sequence[Mapping[str, Any]]) -> ParityReport: ...


# ----------------------------------------------------------------------------- audit


@runtime_checkable
class AuditAnchor(Protocol):
    """Keeps audit chain heads outside the state directory (gpumigrate/AUDIT.md). A head is a small signed
    JSON object; the anchor stores every one it is given, never rewrites one, and returns them in the order
    published. Implementations: a local file outside the state root (core), an S3 object under object lock
    (infra), a Prefect artifact (core, published from the flow)."""

    def describe(self) -> str:
        """Where the heads go, for messages and reports (never a credential)."""

    def publish(self, log: str, chain: str, head: Mapping[str, Any]) -> None: ...

    def latest(self, log: str, chain: str) -> dict[str, Any] | None: ...

    def heads(self, log: str, chain: str) -> list[dict[str, Any]]:
        """Every head published for this chain, oldest first."""

    def chains(self, log: str) -> list[str]:
        """The chains ever anchored for this log name (a removed and re-created log leaves its old one)."""
