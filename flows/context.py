"""One migration's working context: the plan, its state record, and the runtime facts phases share.

Phases hand each other facts (the target host, the image id, the traffic state dir) through the
``runtime`` section of the migration's ``state.json``, never through memory, so a re-run in another
process (``--resume``, the rollback deployment) finds them. Nothing here is a secret: keys are
kept as references ({"env": NAME} or {"file": PATH}).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumigrate.errors import InvalidInputError
from gpumigrate.plan import Plan, load_plan, resolve_relative
from gpumigrate.state import Migration


@dataclass
class RunContext:
    migration: Migration
    plan: Plan

    @classmethod
    def load(cls, migration_id: str) -> RunContext:
        m = Migration.open(migration_id)
        return cls(m, load_plan(m.plan_path))

    # -- runtime facts (state.json "runtime") ---------------------------------------
    @property
    def runtime(self) -> dict[str, Any]:
        return self.migration.read().get("runtime", {})

    def get(self, key: str, default: Any = None) -> Any:
        return self.runtime.get(key, default)

    def put(self, **facts: Any) -> dict[str, Any]:
        state = self.migration.mutate(lambda st: st.setdefault("runtime", {}).update(facts))
        return state["runtime"]

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise InvalidInputError(
                f"migration {self.migration.id}: {key!r} is not known yet (an earlier phase has not run); "
                f"re-run with --resume to continue from the first unfinished phase"
            )
        return value

    # -- plan-relative paths ---------------------------------------------------------
    @property
    def plan_dir(self) -> Path:
        return Path(self.get("plan_dir") or self.migration.dir)

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
