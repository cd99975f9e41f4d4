"""One migration's working context: its plan, its state record, and the runtime facts the phases share.

The phases hand each other facts (the target host, the image) through :class:`Runtime`, kept in the
``runtime`` section of the migration's ``state.json``, never only in memory, so that a re-run in
another process (``--resume``, the rollback deployment) finds them. Nothing in it is a secret: keys
are kept as references (``{"env": NAME}`` or ``{"file": PATH}``).

The phases reach the sibling libraries through :class:`Siblings`: the real ones by default, fakes
of the same Protocols in the phases' unit tests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict

from gpumigrate.errors import InvalidInputError
from gpumigrate.flows.report import Sample
from gpumigrate.interfaces import Host, HostActions, ImageRef, Provider, SnapshotBackend
from gpumigrate.plan import Plan, load_plan, resolve_relative
from gpumigrate.snapshot.backends import Setup, snapshot_backend
from gpumigrate.state import Migration, new_migration_id, plan_sha256
from gpumigrate.traffic.frontdoor import find_dir

T = TypeVar("T")
Fact = str | int | float | bool | None


class Runtime(BaseModel):
    """What the phases share, in ``state.json``'s ``runtime``. Each field is set by one phase and read later."""

    # A state written by an older gpumigrate still loads: facts it no longer knows are dropped.
    model_config = ConfigDict(extra="ignore")

    # plan_dir is the folder of the plan as submitted: relative paths in the plan resolve against it.
    plan_dir: str | None = None
    # source_facts are the source's facts from its /v1/info at preflight (the environment, its pid).
    source_facts: dict[str, Fact] = {}
    # backend_facts is what the snapshot backend's preflight check found (a host-level backend: the source
    # process's start time, so that a reused pid is never taken for it); handed back to it in later phases.
    backend_facts: dict[str, Fact] = {}
    # target_host is the host the provision phase launched (or found) for this migration.
    target_host: Host | None = None
    # target_attached makes a local target die with the process that provisioned it (the demo's); a
    # migration's target is otherwise detached, because after the cut-over it IS the service.
    target_attached: bool = False
    # target_endpoint is the URL the target's workload serves on; never the source's own.
    target_endpoint: str | None = None
    # target_agent is host:port of the target workload's snapshot agent (agent backend).
    target_agent: str | None = None
    # target_agent_id is the id provision gave the target's agent (GPUMIGRATE_AGENT_ID): no other is accepted there.
    target_agent_id: str | None = None
    # target_store is where the target reads the image: its own disk for local hosts, else the plan's store.
    target_store: str | None = None
    # target_pid and target_pid_start name the process a restore started on the target (CRIU), for its undo.
    target_pid: int | None = None
    target_pid_start: int | None = None
    # target_torn_down is set once an undo terminated the target.
    target_torn_down: bool = False
    # image is the final image the snapshot committed (None: the state stayed in the process).
    image: ImageRef | None = None
    # source_frozen is true between a freeze and the resume that follows it; an undo resumes the source.
    source_frozen: bool = False
    # froze_at and resumed_at (epoch seconds): the source's first freeze and the resume after it (inference), what
    # the client-visible stall is measured around (flows/client_figures.py); froze_at also means that an undo
    # after it resumed a source that had stopped: the migration rolled back.
    froze_at: float | None = None
    resumed_at: float | None = None
    # access_marks: where each front-door Envoy's access log stood before the snapshot ({path: [inode, offset]}).
    access_marks: dict[str, list[int]] = {}
    # source_holds_work is true while the source holds work in flight that the final image carried (an LLM's
    # generations), sealed, for its hand-over to the restored target; an undo takes it back. work_handed_over: done.
    source_holds_work: bool = False
    work_handed_over: bool = False
    # traffic_state_dir overrides where the front door's control plane keeps its state (the demo's own).
    traffic_state_dir: str | None = None
    # ramp_samples are the ramp's intervals, flattened for the chart (the last 2000).
    ramp_samples: list[Sample] = []
    # flow_pid and flow_host say which process runs the flow: the rollback path asks whether it still acts.
    flow_pid: int | None = None
    flow_host: str | None = None
    # rollback_deadline (epoch seconds) is until when the source is kept warm for a rollback.
    rollback_deadline: float | None = None
    # source_zeroized and source_retired: the source's state was wiped (or stopped) once the cut-over held.
    source_zeroized: bool = False
    source_retired: bool = False
    # rollback_refused: an undo found the source gone while the target served, and kept both as they were
    # (flows/undo.py): the migration is then not "rolled back", whatever asked for the rollback.
    rollback_refused: bool = False
    # rollback_incomplete: the undo steps whose last attempt did not take effect (step -> error: traffic, receiver,
    # target, source); a later undo that gets a step done drops it. The migration is not "rolled back" while any is.
    rollback_incomplete: dict[str, str] = {}

    # -- where the image lands (provision sets them; the snapshot writes, the transfer checks, the undo stops) --
    # image_store is where the source's agent writes its pre-copy rounds and final image: where the target
    # reads them (its own store, the bucket) or the receiver that lands them there. None: the plan's store.
    image_store: str | None = None
    # receiver_dir is the state directory of the receiver the flow started on the target (stream://target,
    # nixl://target); receiver_stopped is set once it was stopped (after the transfer, or by an undo).
    receiver_dir: str | None = None
    receiver_stopped: bool = False


@dataclass(frozen=True)
class Siblings:
    """The sibling objects the phases drive through the core's Protocols; tests hand in fakes."""

    provider: Callable[[Plan, bool], Provider]  # (plan, attached) -> the provider of the plan's target
    backend: Callable[[str, Setup], SnapshotBackend]  # (plan.snapshot.backend, setup) -> SnapshotBackend
    host_actions: HostActions

    @classmethod
    def real(cls) -> Siblings:
        def provider(plan: Plan, attached: bool) -> Provider:
            from gpumigrate.infra import get_provider, provider_options

            name = plan.target.provider
            return get_provider(name, **provider_options(name, attached=attached, plan=plan))

        def host_actions(host: str, action: str, params: Mapping[str, Any]) -> dict[str, Any]:
            # Imported on first use: it loads Prefect (a host's worker), which a rollback must not wait for.
            from gpumigrate.flows.host_actions import dispatch

            return dispatch(host, action, params)

        return cls(provider=provider, backend=snapshot_backend, host_actions=host_actions)


@dataclass
class RunContext:
    migration: Migration
    plan: Plan  # validated once, when the context is loaded
    siblings: Siblings = field(default_factory=Siblings.real)

    @classmethod
    def load(cls, migration_id: str, *, siblings: Siblings | None = None) -> RunContext:
        m = Migration.open(migration_id)
        return cls(m, load_plan(m.plan_path), siblings or Siblings.real())

    @classmethod
    def create(
        cls, plan_path: str | Path, *, migration_id: str | None, resume: bool | None, **runtime: Any
    ) -> RunContext:
        """Validate the plan, then create the migration's record, or reopen it to resume.

        ``resume=None`` resumes when a migration with that id exists (the deployment's way). An invalid
        plan fails (exit 2) before anything is recorded. ``runtime`` presets facts (the demo's front door).
        """
        plan = load_plan(plan_path)
        if resume is None:
            resume = bool(migration_id) and Migration(migration_id or "").exists
        if resume:
            if not migration_id:
                raise InvalidInputError("--resume needs --id: the id of the migration to continue")
            m = Migration.open(migration_id)
            _same_plan(m, plan_path)
            if m.read().get("status") == "rolled_back" and m.rollback_requested():
                # Resuming a rolled-back migration is a new attempt: the old request must not stop it again.
                m.clear_rollback_request()
                m.record("migration.retry", {"after": "rolled_back"})
            plan = load_plan(m.plan_path)  # a resume runs the plan the migration was created with
        else:
            m = Migration.create(migration_id or new_migration_id(plan.workload.name), Path(plan_path).read_text())
        ctx = cls(m, plan)
        ctx.update(plan_dir=str(Path(plan_path).resolve().parent), **runtime)
        return ctx

    # -- runtime (state.json "runtime") ---------------------------------------------------------
    @property
    def runtime(self) -> Runtime:
        """Read afresh: another process (a rollback, a resume) may have changed it."""
        return Runtime.model_validate(self.migration.read().get("runtime") or {})

    def update(self, **changes: Any) -> Runtime:
        """Set runtime facts under the state record's lock (validated; an unknown name is a bug)."""
        unknown = set(changes) - set(Runtime.model_fields)
        if unknown:
            raise TypeError(f"not runtime facts: {', '.join(sorted(unknown))}")
        out: list[Runtime] = []

        def change(state: dict[str, Any]) -> None:
            merged = Runtime.model_validate({**(state.get("runtime") or {}), **changes})
            state["runtime"] = merged.model_dump(mode="json", exclude_unset=True)  # the facts set so far
            out.append(merged)

        self.migration.mutate(change)
        return out[0]

    def need(self, value: T | None, name: str) -> T:
        """``value``, which an earlier phase should have set; a clear error for a resume out of order."""
        if value is None:
            raise InvalidInputError(
                f"migration {self.migration.id}: {name} is not known yet (an earlier phase has not run); "
                f"re-run with --resume to continue from the first unfinished phase"
            )
        return value

    # -- what the siblings get ------------------------------------------------------------------
    def provider(self) -> Provider:
        return self.siblings.provider(self.plan, self.runtime.target_attached)

    def target_host(self) -> Host:
        return self.need(self.runtime.target_host, "the target host")

    def target_endpoint(self) -> str:
        """Where the target serves: refused if it is the source's own endpoint (that would compare the
        source with itself and ramp traffic to it)."""
        endpoint = self.need(self.runtime.target_endpoint, "the target endpoint")
        if self.plan.workload.endpoint and same_endpoint(endpoint, self.plan.workload.endpoint):
            raise InvalidInputError(
                f"the target endpoint {endpoint} is the source's own: parity and the ramp need two endpoints"
            )
        return endpoint

    def traffic_dir(self) -> Path:
        """The front door's control-plane state: the run's own (the demo's), else the workload's (or the door
        `gpumigrate frontdoor up` started without --workload, when it fronts this plan's endpoint)."""
        explicit = self.runtime.traffic_state_dir
        return Path(explicit) if explicit else find_dir(self.plan.workload.name, self.plan.workload.endpoint)

    def backend(self) -> SnapshotBackend:
        """The plan's snapshot backend, set up with what is known now (the target once provisioned)."""
        plan, rt = self.plan, self.runtime
        host = rt.target_host
        pid = rt.source_facts.get("pid")
        store = rt.image_store or self.store_url()  # the source writes where the target reads
        setup = Setup(
            store=store,
            key_ref=self.key_ref() or {},
            # the bounds reach each live pre-copy round's writer in the workload (gpumigrate/bounds.py)
            writer_options={
                "compression": plan.transfer.compression,
                **plan.transfer.bounds().options(),
            },
            policy=dict(plan.parity.environment),
            source_host=plan.workload.source_host,
            source_agent=plan.workload.agent,
            ranks=plan.workload.ranks,
            source_pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
            checked=rt.backend_facts,
            source_dir=str(self.migration.dir / "criu-dump"),
            parent=rt.image.id if rt.image and rt.image.store == store else None,  # a parent where it writes
            target_host=host.name if host else None,
            target_agent=rt.target_agent,
            target_agent_id=rt.target_agent_id,
            target_store=rt.target_store,
            fill_from_source=plan.transfer.restore_from == "source",
            target_dir=str(Path(host.workdir or self.migration.dir) / "criu-restore") if host else None,
            target_pid=rt.target_pid,
            target_pid_start=rt.target_pid_start,
            host_actions=self.siblings.host_actions,
            end_parked_source=plan.workload.kind == "training" and not plan.snapshot.keep_parked_source,
        )
        return self.siblings.backend(plan.snapshot.backend, setup)

    # -- plan-relative paths --------------------------------------------------------------------
    @property
    def plan_dir(self) -> Path:
        return Path(self.runtime.plan_dir or self.migration.dir)

    def resolve(self, value: str) -> Path:
        return resolve_relative(self.plan_dir / "plan.yaml", value)

    def store_url(self) -> str:
        """The plan's store with a relative ``file://`` path made absolute against the plan's folder."""
        url = self.plan.transfer.store
        if url.startswith("file://") and not url.startswith("file:///"):
            return "file://" + str(self.resolve(url[len("file://") :]))
        return url

    def key_ref(self) -> dict[str, str] | None:
        """The encryption key's reference (never the key), a file reference made absolute."""
        ref = self.plan.transfer.encryption_key
        if ref is None:
            return None
        if ref.env:
            return {"env": ref.env}
        return {"file": str(self.resolve(ref.file or ""))}

    def golden_inputs(self) -> Path | None:
        g = self.plan.parity.golden_inputs
        return self.resolve(g) if g else None


def same_endpoint(a: str, b: str) -> bool:
    """Whether two service URLs reach one listener (scheme, host and port; a path does not count)."""
    pa, pb = urlsplit(a), urlsplit(b)
    return (pa.scheme, pa.hostname, pa.port or 80) == (pb.scheme, pb.hostname, pb.port or 80)


def _same_plan(m: Migration, plan_path: str | Path) -> None:
    """A resume runs the plan the migration was created with: refused (exit 2) when the plan file given is
    another (its content hash differs from the one recorded at creation), naming both."""
    given = plan_sha256(Path(plan_path).read_text())
    recorded = m.recorded_plan_sha256()
    if given != recorded:
        raise InvalidInputError(
            f"migration {m.id} was started with another plan: {plan_path} has sha256 {given[:16]}, the "
            f"migration's plan {m.plan_path} has sha256 {recorded[:16]}",
            hint=f"resume with the plan it was started with ({m.plan_path}), or start a new migration "
            "with another --id",
        )
