"""The audit records what happened: an undo step is recorded once it took effect, and one that failed is
recorded as failed (its own event, with the error), never as done. The migration is not "rolled back" while a
step is left undone, and the next rollback tries it again.

The phases' fakes of the siblings (test_phases.py) stand in for the provider and the snapshot backend; the
state record, the audit log and the front door's state directory are the real ones.
"""

from __future__ import annotations

from pathlib import Path

from gpumigrate.atomic import atomic_write_json
from gpumigrate.errors import ProviderError, SnapshotError
from gpumigrate.flows.phases import provision
from gpumigrate.flows.rollback import roll_back_here
from gpumigrate.flows.undo import undo_all, undo_source, undo_traffic
from gpumigrate.traffic.frontdoor import FRONTDOOR
from gpumigrate.traffic.state import DesiredState, StateStore, Upstream
from tests.flows import test_phases as phases
from tests.flows.test_phases import World, WorldMaker

# The phases' fixtures, shared: a migration of a real HTTP source to a real HTTP target, with fake siblings.
source, target, world = phases.source, phases.target, phases.world

SPLIT = {"source": 75.0, "target": 25.0}


def _door(doors: Path, *, nodes: list[str] | None = None) -> StateStore:
    store = StateStore(doors)
    store.init(
        DesiredState(
            upstreams={"source": Upstream("source", "127.0.0.1", 1), "target": Upstream("target", "127.0.0.1", 2)},
            weights=dict(SPLIT),
        )
    )
    if nodes is not None:
        atomic_write_json(doors / FRONTDOOR, {"admin_urls": ["http://127.0.0.1:9"], "nodes": nodes})
    return store


def _provisioned(w: World, doors: Path) -> None:
    provision.run(w.ctx)
    w.ctx.migration.set_phase("provision", "completed")
    w.ctx.update(traffic_state_dir=str(doors))


def test_a_split_back_that_envoy_rejected_is_recorded_as_written_not_applied(world: WorldMaker, tmp_path: Path) -> None:
    w = world()
    store = _door(tmp_path / "doors", nodes=["edge-1"])
    # The one Envoy of the door rejected every version from here on (its control plane wrote the NACK).
    store.write_status("edge-1", {"node": "edge-1", "applied": 0, "nack": {"version": 10**9, "type": "RDS",
                                                                            "error": "rejected"}})  # fmt: skip
    _provisioned(w, tmp_path / "doors")
    undo_traffic(w.ctx, reason="gate failed")
    assert store.read().weights == {"source": 100.0, "target": 0.0}  # written: the control plane has it
    rec = w.data("traffic.rolled_back")
    assert rec["applied"] is False and "rejected" in rec["apply_error"]


def test_a_split_back_every_envoy_confirmed_is_recorded_as_applied(world: WorldMaker, tmp_path: Path) -> None:
    w = world()
    _door(tmp_path / "doors", nodes=[])
    _provisioned(w, tmp_path / "doors")
    undo_traffic(w.ctx, reason="gate failed")
    assert w.data("traffic.rolled_back")["applied"] is True
    assert "traffic.rollback_failed" not in w.events()


def test_a_split_back_that_could_not_be_written_is_a_failed_step(world: WorldMaker, tmp_path: Path) -> None:
    w = world()
    doors = tmp_path / "doors"
    _door(doors)
    (doors / "desired.json").write_text("{not json")  # the state a rollback must rewrite cannot be read
    _provisioned(w, doors)
    undo_all(w.ctx, reason="gate failed")
    assert "traffic.rolled_back" not in w.events()
    assert w.data("traffic.rollback_failed")["error"]
    assert "traffic" in w.ctx.runtime.rollback_incomplete
    result = roll_back_here(w.ctx, reason="operator asked", actor="sre", trigger="manual", after="ramp")
    assert result.status == "failed" and "rollback is incomplete (traffic:" in (result.error or "")
    assert "rollback.completed" not in w.events() and "rollback.incomplete" in w.events()


def test_a_target_that_could_not_be_torn_down_keeps_the_rollback_open_until_a_retry_does_it(
    world: WorldMaker, tmp_path: Path
) -> None:
    w = world()
    _door(tmp_path / "doors")
    _provisioned(w, tmp_path / "doors")
    terminate = w.provider.terminate

    def refuse(host: object) -> None:
        raise ProviderError("the cloud API refused TerminateInstances: throttled")

    w.provider.terminate = refuse  # type: ignore[method-assign]
    first = roll_back_here(w.ctx, reason="gate failed", actor="sre", trigger="manual", after="ramp")
    assert first.status == "failed" and "target: ProviderError" in (first.error or "")
    assert "rollback.target_torn_down" not in w.events()
    assert "throttled" in w.data("rollback.target_teardown_failed")["error"]
    assert not w.ctx.runtime.target_torn_down and w.ctx.migration.read()["status"] == "failed"
    assert "rollback.completed" not in w.events()

    w.provider.terminate = terminate  # type: ignore[method-assign]
    again = roll_back_here(w.ctx, reason="again", actor="sre", trigger="manual", after="failed")
    assert again.status == "rolled_back" and w.ctx.runtime.rollback_incomplete == {}
    assert w.ctx.runtime.target_torn_down and "rollback.completed" in w.events()


def test_a_frozen_source_that_did_not_resume_is_a_failed_step(world: WorldMaker) -> None:
    w = world()
    w.ctx.update(source_frozen=True)

    def broken() -> None:
        raise SnapshotError("the source agent is unreachable")

    w.backend.resume = broken  # type: ignore[method-assign]
    undo_source(w.ctx)
    assert "rollback.source_resumed" not in w.events()
    rec = w.data("rollback.source_resume_failed")
    assert rec["frozen"] is True and "unreachable" in rec["error"]
    assert w.ctx.runtime.source_frozen and "source" in w.ctx.runtime.rollback_incomplete


def test_a_resume_that_failed_on_a_source_never_frozen_is_recorded_but_leaves_nothing_undone(
    world: WorldMaker,
) -> None:
    w = world()

    def broken() -> None:
        raise SnapshotError("the source agent is unreachable")

    w.backend.resume = broken  # type: ignore[method-assign]
    undo_source(w.ctx)
    assert w.data("rollback.source_resume_failed")["frozen"] is False
    assert w.ctx.runtime.rollback_incomplete == {}


def test_a_source_that_died_frozen_is_started_again_by_the_operator_and_the_next_rollback_ends_it(
    world: WorldMaker, tmp_path: Path
) -> None:
    """The fault matrix's source cells: a killed source cannot be resumed however often the rollback asks, so the
    error tells the operator to start it again first; the retry then finds it running and the migration ends."""
    w = world()
    _door(tmp_path / "doors")
    _provisioned(w, tmp_path / "doors")
    w.ctx.update(source_frozen=True)
    resume = w.backend.resume

    def refused() -> None:
        raise SnapshotError("cannot reach the snapshot agent at 127.0.0.1:9: Connection refused")

    w.backend.resume = refused  # type: ignore[method-assign]
    first = roll_back_here(w.ctx, reason="gate failed", actor="sre", trigger="manual", after="ramp")
    assert first.status == "failed" and "source: SnapshotError" in (first.error or "")
    assert "start the source workload again if it stopped" in (first.error or "")
    assert f"`gpumigrate rollback {w.ctx.migration.id}`" in (first.error or "")

    w.backend.resume = resume  # type: ignore[method-assign]  # the operator started the source again
    again = roll_back_here(w.ctx, reason="again", actor="sre", trigger="manual", after="failed")
    assert again.status == "rolled_back" and w.ctx.runtime.rollback_incomplete == {}
